"""Sampling on the GPU, behind the engine's ``backend.sample_rows(logits, rows, eos_token_ids)``.

Rows that sample plainly (temperature, top-k, top-p, min-p, seeds) run in one kernel
(``sampling.cu``): one small host-to-device copy of the per-row parameters and one
device-to-host copy of the chosen ids. The others are copied to the host alone and go through
the NumPy reference (``openinfer.runtime.sampler``): prompt-logprob rows, rows asking for
top-N logprobs, rows with repetition/presence/frequency penalties, and rows whose stop ids are
banned this step (min_tokens). Each random row consumes exactly one ``generator.random()``
per step, as the NumPy sampler does, so a seeded request reproduces alone or in a batch.

``logit_bias`` and structured-output masks are applied on the device before the sampling kernel
(``logit_constraints.cu``) to a copy of the rows that carry them: the bias as sparse (id, value)
lists, the mask as the step's int32 bitmask computed on the CPU during the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy
import cupyx
import numpy as np

from openinfer.backend.cuda.loader import kernel
from openinfer.runtime.batch_builder import LogitsRow
from openinfer.runtime.sampler import GrammarMasks, RowSample, kernel_can_sample
from openinfer.runtime.sampler import sample_rows as sample_rows_on_host
from openinfer.sampling import SamplingState


def samples_on_device(row: LogitsRow) -> bool:
    """True when the GPU kernel implements everything this row asks for
    (``openinfer.runtime.sampler.kernel_can_sample``: grammar rows included, their masks
    applied on the device)."""
    return row.samples and kernel_can_sample(row.request)


def sample_device_rows(logits: cupy.ndarray, states: Sequence[SamplingState],
                       bitmask_rows: Sequence[np.ndarray | None] | None = None) -> np.ndarray:
    """Token ids [rows] for ``logits [rows, vocab]`` (bf16), row i following ``states[i]``."""
    return launch_device_sampling(logits, states, bitmask_rows).get()


def apply_logit_constraints(logits: cupy.ndarray, states: Sequence[SamplingState],
                            bitmask_rows: Sequence[np.ndarray | None] | None = None) -> cupy.ndarray:
    """``logits`` with each row's logit_bias added and its grammar mask applied (a new array when
    any row has either; ``logits`` itself, untouched, when none has)."""
    bitmask_rows = bitmask_rows or [None] * len(states)
    has_bias = [s.bias_ids is not None for s in states]
    if not any(has_bias) and all(m is None for m in bitmask_rows):
        return logits
    rows, vocab = logits.shape
    counts = [len(s.bias_ids) if s.bias_ids is not None else 0 for s in states]
    bias_start = np.zeros(rows + 1, np.int32)
    bias_start[1:] = np.cumsum(counts)
    bias_ids = np.concatenate([s.bias_ids for s in states if s.bias_ids is not None] or [np.zeros(1, np.int64)])
    bias_values = np.concatenate([s.bias_values for s in states if s.bias_values is not None]
                                 or [np.zeros(1, np.float32)])
    masked = [i for i, m in enumerate(bitmask_rows) if m is not None]
    words = (vocab + 31) // 32
    bitmask = (np.stack([bitmask_rows[i] for i in masked]) if masked else np.full((1, words), -1, np.int32))
    mask_row = np.full(rows, -1, np.int32)
    mask_row[masked] = np.arange(len(masked), dtype=np.int32)
    adjusted = cupy.array(logits, copy=True, order="C")
    kernel("logit_constraints.cu", "apply_logit_constraints")(
        (rows,), (256,),
        (adjusted, np.int32(vocab), cupy.asarray(bias_start), cupy.asarray(bias_ids.astype(np.int32)),
         cupy.asarray(bias_values.astype(np.float32)), cupy.asarray(np.ascontiguousarray(bitmask, np.int32)),
         np.int32(bitmask.shape[1]), cupy.asarray(mask_row)))
    return adjusted


def launch_device_sampling(logits: cupy.ndarray, states: Sequence[SamplingState],
                           bitmask_rows: Sequence[np.ndarray | None] | None = None) -> cupy.ndarray:
    """Queue the sampling kernel; the token ids [rows] stay on the device (int32)."""
    logits = apply_logit_constraints(logits, states, bitmask_rows)
    rows, vocab = logits.shape
    # float32 rows: temperature, top_p, min_p, uniform draw, top_k (int32 bits)
    params = np.zeros((5, rows), np.float32)
    for i, state in enumerate(states):
        p = state.params
        params[0, i], params[1, i], params[2, i] = p.temperature, p.top_p, p.min_p
        params[3, i] = state.generator.random() if p.temperature > 0 else 0.0
    params[4] = np.array([s.params.top_k for s in states], np.int32).view(np.float32)
    device_params = cupy.asarray(params)
    tokens = cupy.empty(rows, dtype=cupy.int32)
    logprobs = cupy.empty(rows, dtype=cupy.float32)
    kernel("sampling.cu", "sample_rows")(
        (rows,), (1024,),
        (cupy.ascontiguousarray(logits), np.int32(vocab), device_params[0], device_params[4].view(cupy.int32),
         device_params[1], device_params[2], device_params[3], tokens, logprobs))
    return tokens


class _HostLogits:
    """Lets the reference sampler read rows that are already float32 on the host."""

    name = "host"

    @staticmethod
    def to_host(x: Any) -> np.ndarray:
        return x


def sample_rows(logits: cupy.ndarray, rows: Sequence[LogitsRow], eos_token_ids: Sequence[int],
                to_host: Any, masks: GrammarMasks | None = None) -> list[RowSample]:
    """The engine's sampling step for ``logits [len(rows), vocab]`` on the GPU; ``masks``: the
    step's grammar masks (rows with and without one sample in the same kernel launch)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
    on_device = [i for i, row in enumerate(rows) if samples_on_device(row)]
    on_host = [i for i in range(len(rows)) if i not in set(on_device)]
    results: list[RowSample | None] = [None] * len(rows)
    if on_device:
        index = cupy.asarray(np.asarray(on_device, np.int32))
        tokens = sample_device_rows(logits[index], [rows[i].request.sampling for i in on_device],
                                    [masks.row(i) for i in on_device] if masks is not None else None)
        for i, token in zip(on_device, tokens, strict=True):
            results[i] = RowSample(int(token))
    if on_host:
        index = cupy.asarray(np.asarray(on_host, np.int32))
        host = to_host(logits[index])
        host_masks = None
        if masks is not None:  # re-indexed to the host subset's rows
            host_masks = GrammarMasks(masks.bitmask[on_host], frozenset(
                j for j, i in enumerate(on_host) if i in masks.constrained))
        for i, sample in zip(on_host, sample_rows_on_host(_HostLogits(), host, [rows[i] for i in on_host],
                                                          eos_token_ids, host_masks), strict=True):
            results[i] = sample
    return [r for r in results if r is not None]


def sample_rows_async(logits: cupy.ndarray, rows: Sequence[LogitsRow],
                      masks: GrammarMasks | None = None) -> tuple[cupy.ndarray, Any] | None:
    """Queue sampling of every row (``masks``: the step's grammar masks, applied on the device)
    and an asynchronous copy of the ids into pinned memory.

    Returns (device ids, read_back) — ``read_back()`` waits only for this step's copy, not for
    work queued after it — or None when some row needs the host sampler. The engine calls it
    for a row needing the previous token on the host (a grammar) only once that token is there.
    """
    if not rows or not all(row.samples and kernel_can_sample(row.request) for row in rows):
        return None
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
    tokens = launch_device_sampling(logits, [row.request.sampling for row in rows],
                                    [masks.row(i) for i in range(len(rows))] if masks is not None else None)
    pinned = cupyx.empty_pinned(tokens.shape, dtype=np.int32)
    stream = cupy.cuda.get_current_stream()
    tokens.get(stream=stream, out=pinned, blocking=False)
    copied = cupy.cuda.Event(block=True, disable_timing=True)
    copied.record(stream)

    def read_back() -> list[RowSample]:
        copied.synchronize()
        return [RowSample(int(token)) for token in pinned]

    return tokens, read_back
