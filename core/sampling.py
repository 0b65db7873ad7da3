"""Turning logits into tokens: validation, penalties, temperature/top-k/top-p/min-p, seeds, logprobs.

This NumPy sampler is the reference (and the CPU path). Order of operations, per row:

1. log-probabilities for the response are taken from the *raw* logits (what the model said,
   as vLLM's default ``raw_logprobs``);
2. repetition penalty (prompt + output tokens), presence and frequency penalties (output tokens);
3. ``logit_bias`` added (OpenAI semantics: values in [-100, 100] added to the logits);
4. the structured-output grammar's mask (forbidden tokens → -inf; see ``openinfer.structured``);
5. eos / stop ids masked while fewer than ``min_tokens`` were generated;
6. greedy (temperature 0) → argmax; else temperature → top-k → top-p → min-p → sample with the
   request's own generator, so a seeded request gives the same tokens alone or in a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from openinfer.errors import InvalidRequestError
from openinfer.structured import LOGIT_BIAS_LIMIT, GrammarMatcher, apply_bitmask
from openinfer.v1 import engine_pb2 as pb

MAX_LOGPROBS = 20


@dataclass
class SamplingState:
    """What the sampler remembers about one request between steps."""

    params: pb.SamplingParams
    generator: np.random.Generator
    prompt_token_ids: np.ndarray
    output_counts: dict[int, int] = field(default_factory=dict)
    # structured outputs: advanced by every recorded token; its mask applies to every step
    grammar: GrammarMatcher | None = None
    # logit_bias as parallel arrays (ids int64, values float32, clamped to [-100, 100])
    bias_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None

    @classmethod
    def create(cls, params: pb.SamplingParams, prompt_token_ids: Sequence[int], engine_seed: int,
               request_index: int, grammar: GrammarMatcher | None = None) -> SamplingState:
        seed = params.seed if params.HasField("seed") else (engine_seed * 1_000_003 + request_index)
        state = cls(params, np.random.Generator(np.random.PCG64(seed)),
                    np.asarray(prompt_token_ids, dtype=np.int64), grammar=grammar)
        if params.logit_bias:
            items = sorted(params.logit_bias.items())
            state.bias_ids = np.array([t for t, _ in items], dtype=np.int64)
            state.bias_values = np.clip(np.array([v for _, v in items], dtype=np.float32),
                                        -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        return state

    @property
    def needs_host_history(self) -> bool:
        """Whether sampling the next token needs the previous one on the host (a grammar consumes
        every token before it can compute the next mask)."""
        return self.grammar is not None

    def record(self, token_id: int) -> None:
        self.count(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def count(self, token_id: int) -> None:
        """Count an output token (penalties read the counts) without advancing the grammar: for
        a caller that hands the grammar's advance to the mask worker."""
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def validate_sampling(params: pb.SamplingParams) -> None:
    """Reject values no sampler can honour; the message names the field."""
    if not np.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidRequestError(f"temperature must be >= 0, got {params.temperature}", "temperature")
    if params.top_p != 0 and not (0.0 < params.top_p <= 1.0):
        raise InvalidRequestError(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
    if not (0.0 <= params.min_p <= 1.0):
        raise InvalidRequestError(f"min_p must be in [0, 1], got {params.min_p}", "min_p")
    if params.top_k < -1:
        raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or >= 1, got {params.top_k}", "top_k")
    if params.repetition_penalty < 0 or not np.isfinite(params.repetition_penalty):
        raise InvalidRequestError(
            f"repetition_penalty must be > 0, got {params.repetition_penalty}", "repetition_penalty")
    for token, value in params.logit_bias.items():
        if not np.isfinite(value) or abs(value) > LOGIT_BIAS_LIMIT:
            raise InvalidRequestError(
                f"logit_bias values must be in [-100, 100], got {value} for token {token}", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (-2.0 <= value <= 2.0):
            raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top_logprobs(logprobs_row: np.ndarray, n: int) -> list[tuple[int, float]]:
    if n <= 0:
        return []
    top = np.argpartition(-logprobs_row, n - 1)[:n]
    top = top[np.argsort(-logprobs_row[top], kind="stable")]
    return [(int(i), float(logprobs_row[i])) for i in top]


def apply_penalties(logits: np.ndarray, state: SamplingState) -> np.ndarray:
    params = state.params
    repetition = params.repetition_penalty
    if repetition and repetition != 1.0:
        seen = np.unique(np.concatenate([state.prompt_token_ids,
                                         np.fromiter(state.output_counts, dtype=np.int64)]))
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / repetition, values * repetition)
    if state.output_counts and (params.presence_penalty or params.frequency_penalty):
        ids = np.fromiter(state.output_counts.keys(), dtype=np.int64)
        counts = np.fromiter(state.output_counts.values(), dtype=np.float32)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def apply_logit_bias(logits: np.ndarray, state: SamplingState) -> np.ndarray:
    if state.bias_ids is not None:
        logits[state.bias_ids] += state.bias_values
    return logits


def sample_row(logits: np.ndarray, state: SamplingState, banned_ids: Sequence[int] = (),
               num_logprobs: int = 0, want_logprob: bool = False,
               bitmask_row: np.ndarray | None = None) -> SampleResult:
    """Sample one token from a float32 logits row (the row may be modified). ``bitmask_row``:
    the grammar's allowed tokens (``openinfer.structured`` layout), None when unconstrained."""
    result = SampleResult(token_id=-1)
    if want_logprob or num_logprobs:
        raw = log_softmax(logits.astype(np.float32, copy=False))
    logits = apply_penalties(logits, state)
    logits = apply_logit_bias(logits, state)
    if bitmask_row is not None:
        logits = apply_bitmask(logits, bitmask_row)
    if banned_ids:
        banned = np.asarray(banned_ids, dtype=np.int64)
        kept = logits[banned].copy()
        logits[banned] = -np.inf
        if not np.isfinite(logits.max()):  # the grammar allows nothing but a stop: it wins over min_tokens
            logits[banned] = kept
    params = state.params
    if params.temperature == 0.0:
        token = int(np.argmax(logits))
    else:
        token = _sample_random(logits / params.temperature, params, state.generator)
    result.token_id = token
    if want_logprob or num_logprobs:
        result.logprob = float(raw[token])
        result.top = top_logprobs(raw, num_logprobs)
    return result


def _sample_random(logits: np.ndarray, params: pb.SamplingParams, generator: np.random.Generator) -> int:
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(logits, vocab - params.top_k)[vocab - params.top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if 0.0 < params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cutoff = int(np.searchsorted(cumulative, params.top_p)) + 1
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[:cutoff]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    if params.min_p > 0.0:
        probs = np.where(probs < params.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    # inverse-CDF with one uniform draw per step: reproducible for a given generator state
    cdf = np.cumsum(probs, dtype=np.float64)
    u = generator.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), vocab - 1))
