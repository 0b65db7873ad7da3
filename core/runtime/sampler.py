"""Sampling a step's logits rows. Backends may sample on the device (``backend.sample_rows``);
the NumPy path below is the reference."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from openinfer.runtime.batch_builder import LogitsRow
from openinfer.sampling import SamplingState, log_softmax, sample_row, top_logprobs
from openinfer.structured import CompilerCache, StepMasks, TimingLog, apply_bitmasks, bitmask_words
from openinfer.v1 import engine_pb2 as pb


@dataclass
class RowSample:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None

    def as_proto(self) -> pb.TokenLogprob:
        return pb.TokenLogprob(logprob=self.logprob or 0.0,
                               top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in (self.top or [])])


def _sampling_traits(request: Any) -> tuple[bool, bool, bool]:
    """(the sampling kernel implements the row apart from a pending ``min_tokens``, sampling
    reads the request's history on the host, it does for more than a grammar): fixed for a request's life, so computed once
    and kept on it (``Request.sampling_traits``) — the engine asks twice per row per step."""
    traits = getattr(request, "sampling_traits", None)
    if traits is None:
        params = request.sampling.params
        penalties = bool(params.repetition_penalty not in (0.0, 1.0) or params.presence_penalty
                         or params.frequency_penalty)
        kernel = not (request.want_prompt_logprobs or penalties or request.want_logprobs or request.num_logprobs > 0)
        besides_grammar = bool(request.want_prompt_logprobs or penalties)
        traits = (kernel, besides_grammar or request.sampling.needs_host_history, besides_grammar)
        try:
            request.sampling_traits = traits
        except AttributeError:  # a read-only stand-in: computed again next time
            pass
    return traits


def needs_host_history(request: Any) -> bool:
    """Sampling this request's next token reads its generated tokens on the host (penalties count
    them; prompt-logprob rows read the prompt's next token; a grammar consumes every token before
    it can mask the next), so it waits for the previous step."""
    return _sampling_traits(request)[1]


def kernel_can_sample(request: Any) -> bool:
    """Whether the CUDA sampling kernel implements everything this row asks for: no penalties,
    prompt logprobs or logprobs, no banned stop ids (pending ``min_tokens``). logit_bias and a
    grammar mask are applied on the device before the kernel."""
    if not _sampling_traits(request)[0]:
        return False
    return not (request.stop.min_tokens and request.num_output_tokens < request.stop.min_tokens)


def samples_on_device(request: Any) -> bool:
    """THE sample-ahead predicate, on a backend that samples asynchronously: may this row of a
    step be sampled before the previous step is read back? The kernel samples it
    (:func:`kernel_can_sample`) and nothing about it waits for the previous token on the host (a
    grammar does: its mask follows the token). Other rows are sampled once the previous step is
    read back, while their step's forward runs; grammar rows then still use the kernel."""
    return not _sampling_traits(request)[1] and kernel_can_sample(request)


def samples_on_device_behind_masks(request: Any) -> bool:
    """:func:`samples_on_device` for a device sampler that waits for grammar masks on the device
    (the sampling is queued at once, the GPU holds it until the host finished the step's masks):
    a grammar alone does not hold the row back."""
    return not _sampling_traits(request)[2] and kernel_can_sample(request)


# a step's structured-output masks, compact (see ``openinfer.structured.StepMasks``)
GrammarMasks = StepMasks


def grammar_rows(rows: Sequence[LogitsRow]) -> list[tuple[Any, int]]:
    """(grammar matcher, row index) of the sampling rows whose request has a grammar (a request
    finished meanwhile, its previous step stopped it, has nothing left to mask)."""
    return [(row.request.sampling.grammar, i) for i, row in enumerate(rows)
            if row.samples and row.request.sampling.grammar is not None and not row.request.is_finished]


def start_grammar_masks(rows: Sequence[LogitsRow], compilers: CompilerCache, background: bool = True,
                        consume: Sequence[tuple[Any, int]] = (), into: GrammarMasks | None = None
                        ) -> GrammarMasks | None:
    """Start computing the masks of every sampling row whose request has a grammar (None when no
    row has one); ``wait()`` on the result before sampling. Every such matcher must have
    consumed the previous step's token, or be in ``consume`` (matcher, token id): consumed in
    the same job, off this thread. Without ``background``, computed before returning.
    ``into``: the step's pending masks (:func:`pending_grammar_masks`), started now."""
    constrained = grammar_rows(rows)
    if not constrained and into is None and not consume:  # (tokens to consume: a preempted request's too)
        return None
    return compilers.get().start_masks(constrained, len(rows), background, consume, into)


def pending_grammar_masks(rows: Sequence[LogitsRow], compilers: CompilerCache) -> GrammarMasks | None:
    """The masks of a step sampled before its matchers consumed the previous step's tokens
    (None when no row has a grammar): a device sampler queues the sampling behind them, and
    :func:`start_grammar_masks` (``into``) computes them once the tokens are read back."""
    constrained = grammar_rows(rows)
    if not constrained:
        return None
    return GrammarMasks.pending([row for _, row in constrained], len(rows),
                                bitmask_words(compilers.get().vocab_size))


def sample_rows(backend: Any, logits: Any, rows: Sequence[LogitsRow], eos_token_ids: Sequence[int],
                masks: GrammarMasks | None = None) -> list[RowSample]:
    device_sampler = getattr(backend, "sample_rows", None)
    if device_sampler is not None:
        return device_sampler(logits, rows, eos_token_ids, masks)
    host = backend.to_host(logits)
    # the step's packed masks are applied at once to every constrained row whose logprobs are not
    # asked for (masking before penalties and logit_bias gives the same logits: -inf stays -inf);
    # rows that report logprobs need their raw logits, so sample_row masks them itself
    premasked: list[int] = []
    if masks is not None:
        premasked = [i for i in masks.constrained
                     if rows[i].samples and not (rows[i].request.want_logprobs or rows[i].request.num_logprobs)]
    masked_rows = apply_bitmasks(np.array(host[premasked], dtype=np.float32),
                                 masks.bitmask[masks.mask_rows[premasked]]) if premasked else None
    premasked_at = {row: k for k, row in enumerate(premasked)}
    results: list[RowSample] = []
    for index, row in enumerate(rows):
        request = row.request
        if not row.samples:  # logprob of the prompt token at position + 1
            logprobs = log_softmax(host[index].astype(np.float32))
            token = request.token_ids[row.position + 1]
            results.append(RowSample(token, float(logprobs[token]), top_logprobs(logprobs, request.num_logprobs)))
            continue
        banned: list[int] = []
        if request.num_output_tokens < request.stop.min_tokens:
            banned = list(request.stop.stop_token_ids)
            if not request.stop.ignore_eos:
                banned += list(eos_token_ids)
        if index in premasked_at:
            assert masked_rows is not None
            row_logits, bitmask_row = masked_rows[premasked_at[index]], None
        else:
            row_logits = np.array(host[index], dtype=np.float32)
            bitmask_row = masks.row(index) if masks is not None else None
        result = sample_row(row_logits, request.sampling, banned, request.num_logprobs, request.want_logprobs,
                            bitmask_row)
        results.append(RowSample(result.token_id, result.logprob, result.top))
    return results


@dataclass
class DeviceSamplingInputs:
    """The host arrays a device sampler uploads for one step (``backend.cuda.sampler``): per-row
    parameters, the rows' logit_bias as sparse lists and the step's grammar masks. Built here,
    without the device, so the engine thread's share of a device step is one tested function."""

    params: np.ndarray  # [5, rows] float32: temperature, top_p, min_p, uniform draw, top_k (int32 bits)
    bias_start: np.ndarray | None  # [rows + 1] int32: row r's entries are [bias_start[r], bias_start[r + 1]);
    bias_ids: np.ndarray | None  # int32                None when no row has a logit_bias
    bias_values: np.ndarray | None  # float32
    masks: GrammarMasks | None

    @property
    def constrains(self) -> bool:
        return self.bias_start is not None or self.masks is not None


def device_sampling_inputs(states: Sequence[SamplingState], masks: GrammarMasks | None = None,
                           draws: bool = True) -> DeviceSamplingInputs:
    """With ``draws``, each random row draws its uniform number here: exactly one
    ``generator.random()`` per step, as the NumPy sampler does (a seeded request reproduces
    alone or in a batch); without, the draws stay 0 and no generator advances."""
    rows = len(states)
    params = np.empty((5, rows), np.float32)
    top_k = np.empty(rows, np.int32)
    for i, state in enumerate(states):
        p = state.params
        temperature = p.temperature
        params[0, i], params[1, i], params[2, i] = temperature, p.top_p, p.min_p
        params[3, i] = state.generator.random() if draws and temperature > 0 else 0.0
        top_k[i] = p.top_k
    params[4] = top_k.view(np.float32)
    biased = [i for i, s in enumerate(states) if s.bias_ids is not None]
    if not biased:
        return DeviceSamplingInputs(params, None, None, None, masks)
    counts = np.zeros(rows, np.int32)
    counts[biased] = [len(states[i].bias_ids) for i in biased]
    bias_start = np.zeros(rows + 1, np.int32)
    np.cumsum(counts, out=bias_start[1:])
    bias_ids = np.concatenate([states[i].bias_ids for i in biased]).astype(np.int32)
    bias_values = np.concatenate([states[i].bias_values for i in biased]).astype(np.float32)
    return DeviceSamplingInputs(params, bias_start, bias_ids, bias_values, masks)


@dataclass
class SampledStep:
    """One step's samples. ``device_token_ids`` (int32, one per row, on the backend's device)
    can feed the next step's inputs before anything is read back; ``results()`` reads the
    rows back (waiting for the device the first time)."""

    device_token_ids: Any
    _results: list[RowSample] | None = None
    _read_back: Callable[[], list[RowSample]] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def results(self) -> list[RowSample]:
        """(Once, from any thread: the mask worker may read a step back before the engine does.)"""
        if self._results is None:
            with self._lock:
                if self._results is None:
                    assert self._read_back is not None
                    started = time.perf_counter()
                    self._results = self._read_back()
                    READ_BACKS.add((time.perf_counter() - started) * 1e3)
        return self._results


# per deferred read-back: how long the host waited for the step's tokens (~0: the device had finished
# before the host asked, the host is the step's bottleneck)
READ_BACKS = TimingLog()


def sample_step(backend: Any, logits: Any, rows: Sequence[LogitsRow], eos_token_ids: Sequence[int],
                deferred: bool, masks: GrammarMasks | None = None) -> SampledStep:
    """Sample a step. With ``deferred`` and a backend that samples asynchronously
    (``sample_rows_async``), nothing is read back until ``results()``; grammar masks go to
    the device with the rows (the engine samples a step with masks only once every matcher
    has consumed the previous step's tokens)."""
    async_sampler = getattr(backend, "sample_rows_async", None)
    if deferred and async_sampler is not None:
        launched = async_sampler(logits, rows) if masks is None else async_sampler(logits, rows, masks)
        if launched is not None:
            device_ids, read_back = launched
            return SampledStep(device_ids, None, read_back)
    results = sample_rows(backend, logits, rows, eos_token_ids, masks)
    ids = np.fromiter((r.token_id for r in results), dtype=np.int32, count=len(results))
    upload = getattr(backend, "upload_token_ids", None)
    return SampledStep(upload(ids) if upload is not None else ids, results)
