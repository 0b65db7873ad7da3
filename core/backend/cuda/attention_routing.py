"""Which attention kernel takes which rows of a step: host-side decisions from host arrays and
counts only (no device reads, no CuPy), so CPU CI tests them and a step never waits on the GPU.

* ``split_mixed_step``: a mixed step (running decodes + prompt chunks in one forward) sends its
  leading 1-token sequences to the decode kernel and only the tiles of the multi-token sequences
  to the prefill kernel, instead of one 128-query prefill tile per decode row.
* ``wants_short_query``: whether a short step (<= 16 new tokens per sequence) takes the split-KV
  short-query kernel; in "auto" mode only from a context length where it beats the prefill kernel.
* ``wanted_sm90_short_query`` / ``sm90_short_query_row_groups``: whether such a step runs the Hopper
  wgmma version of that kernel (prefill_attention_sm90_short.cu; ``OPENINFER_SM90_SHORT_QUERY``,
  default on since E1 of session 8), and its CTAs per (split, KV head, sequence).
* ``wanted_sm90_kv_runs``: whether the sm90 prefill kernel copies runs of consecutive KV blocks in
  one TMA box (``OPENINFER_SM90_KV_RUNS``); ``wanted_sm90_q_registers``: whether its Q K^T takes Q
  from registers (``OPENINFER_SM90_Q_REGISTERS``); both default on since E1 of session 8, "0" reverts.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

# A few decode rows are cheaper inside the prefill launch than as a second kernel launch plus
# the copy of their rows; from this many on they go to the decode kernel. W3a (H100, per layer,
# gpu_prefill_attention.py --routing): 4 decodes at 1k + a 2k chunk 0.91x (slower), 16 decodes at
# 4k + a 512 chunk 1.47x, 64 at 1k + 2k 1.69x, 256 at 1k + 512 2.20x, 256 at 1k + 2k 2.54x.
MIXED_MIN_DECODE_ROWS = 16
# "auto": the short-query kernel from this longest context on. W3a (H100, 16 new tokens, the
# short-query kernel against the prefill kernel): 1.06x at 1008 cached, 1.27x at 1520, 1.35x at
# 2032, 1.60x at 3056, 1.86x at 4080; 8 sequences 1.32x at 1008; 32 x (1020 + 4) 2.37x (W1's 0.70x
# at 1008 was its first, cold case). Below 1k its split-KV floor (~45 us) is not measured to win.
SHORT_QUERY_MIN_CONTEXT = 1024
SHORT_QUERY_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class MixedSplit:
    """A mixed step's rows: token rows ``[0, decode_rows)`` are the first ``decode_rows``
    sequences' single new tokens (decode kernel); ``prefill_tile_ranges`` are the contiguous
    ``[start, stop)`` ranges of the batch's prefill tiles that belong to the other sequences."""

    decode_rows: int
    prefill_tile_ranges: tuple[tuple[int, int], ...]


def split_mixed_step(query_start: np.ndarray, tile_seq: np.ndarray,
                     min_decode_rows: int = MIXED_MIN_DECODE_ROWS) -> MixedSplit | None:
    """The split of a step whose first sequences have one new token each and whose others have
    more, or None when there is nothing to split (no multi-token sequence, fewer than
    ``min_decode_rows`` leading 1-token sequences).

    ``query_start [B+1]``: each sequence's first token row; ``tile_seq [N]``: the sequence of each
    prefill tile, in launch order. Only a *leading* run of 1-token sequences is split off (the
    scheduler puts running decodes first), so their token rows, block-table rows and output rows
    are the first ``decode_rows`` of the batch's and no gather is needed; a 1-token sequence after
    a longer one stays in the prefill kernel.
    """
    counts = np.diff(np.asarray(query_start))
    if counts.size == 0 or int(counts.max()) <= 1:
        return None
    longer = np.flatnonzero(counts != 1)
    decode_rows = int(longer[0])  # the leading run of 1-token sequences
    if decode_rows < max(1, min_decode_rows):
        return None
    keep = np.asarray(tile_seq) >= decode_rows
    edges = np.flatnonzero(np.diff(np.concatenate(([0], keep.astype(np.int8), [0]))))
    ranges = tuple((int(start), int(stop)) for start, stop in zip(edges[::2], edges[1::2], strict=True))
    return MixedSplit(decode_rows, ranges)


def wants_short_query(mode: str, max_context_len: int | None, min_context: int = SHORT_QUERY_MIN_CONTEXT) -> bool:
    """Short-query kernel or not for a short step, by the switch's ``mode`` ("on", "off", "auto")
    and the batch's longest context (a host count: no synchronisation). ``None``: the context is
    not known when the kernel is chosen (a CUDA graph captured once, replayed at any context);
    "auto" then takes the short-query kernel, at most ~1.4x slower at short contexts and up to
    4x faster at long ones."""
    if mode not in SHORT_QUERY_MODES:
        raise ValueError(f"short-query mode must be one of {SHORT_QUERY_MODES}, got {mode!r}")
    if mode == "auto":
        return max_context_len is None or max_context_len >= min_context
    return mode == "on"


SM90_SHORT_QUERY_ENV = "OPENINFER_SM90_SHORT_QUERY"
SM90_SHORT_QUERY_ROWS = 64  # query rows per CTA of the sm90 short-query kernel: one wgmma M tile


SM90_KV_RUNS_ENV = "OPENINFER_SM90_KV_RUNS"
SM90_Q_REGISTERS_ENV = "OPENINFER_SM90_Q_REGISTERS"


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "1" if default else "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


@functools.cache
def wanted_sm90_short_query() -> bool:
    """``OPENINFER_SM90_SHORT_QUERY``: "1" (the default) runs short steps on the Hopper wgmma
    short-query kernel where it applies, "0" on decode_attention_mma.cu's. E1 (H200, 16 new tokens,
    Qwen3-4B heads, per layer, gpu_short_query_attention_s8e1_h200.json) against the mma kernel's
    default (shared tiles, tile softmax): batch 1 at 16 splits 8.8 / 12.8 / 25.7 vs 12.3 / 17.1 / 36.7 us
    at 1k / 4k / 16k (1.40 / 1.34 / 1.43x); batch 4 (8 splits) 14.2 / 28.0 / 76.6 vs 16.9 / 36.7 / 112.9;
    the Qwen3-4B warm-tail step at 16k (graph) 4.580 -> 4.295 ms at 32 splits. Read once per process;
    ``wanted_sm90_short_query.cache_clear()`` re-reads it."""
    return _env_flag(SM90_SHORT_QUERY_ENV, True)


@functools.cache
def wanted_sm90_kv_runs() -> bool:
    """``OPENINFER_SM90_KV_RUNS``: "1" (the default) lets the sm90 prefill kernel's TMA loads copy a K/V
    tile whose pages are consecutive cache blocks as one box per column block (KV_RUNS), "0" page by
    page. E1 (H200, consecutive blocks, gpu_prefill_attention_variants_contiguous.json): 1.101x geomean
    over the six cases, 16k 613.4 -> 647.2 TFLOP/s, a 4k chunk on 12k 608.1 -> 692.3; head_dim 256 (with
    TMA) 1.171x, 8 x 1008 270.4 -> 300.7, 16k 386.1 -> 469.2. Read once per process;
    ``wanted_sm90_kv_runs.cache_clear()`` re-reads it."""
    return _env_flag(SM90_KV_RUNS_ENV, True)


def sm90_short_query_row_groups(max_query_len: int, group: int) -> int:
    """CTAs of the sm90 short-query kernel per (split, KV head, sequence): each takes
    ``SM90_SHORT_QUERY_ROWS // group`` new tokens with all ``group`` query heads of its KV head."""
    if not 1 <= group <= SM90_SHORT_QUERY_ROWS:
        raise ValueError(f"the sm90 short-query kernel takes GQA groups 1..{SM90_SHORT_QUERY_ROWS}, got {group}")
    if max_query_len < 1:
        raise ValueError(f"a short step has at least one new token per sequence, got {max_query_len}")
    return -(-max_query_len // (SM90_SHORT_QUERY_ROWS // group))


@functools.cache
def wanted_sm90_q_registers() -> bool:
    """``OPENINFER_SM90_Q_REGISTERS``: "1" (the default) has the sm90 prefill kernel's consumers hold Q
    as wgmma A fragments in registers at head_dim 128 with the overlapped loop (Q_REGISTERS: Q K^T reads
    only K from shared memory), "0" both operands from shared memory. E1 (H200, consecutive blocks):
    with K/V runs 1.123x geomean over the default (runs alone 1.101x), 16k 681.7 TFLOP/s (cuDNN 645.1
    in the same run). Read once per process; ``wanted_sm90_q_registers.cache_clear()`` re-reads it."""
    return _env_flag(SM90_Q_REGISTERS_ENV, True)
