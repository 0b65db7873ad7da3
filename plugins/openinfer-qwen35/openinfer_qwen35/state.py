"""The recurrent state of every Gated DeltaNet layer as a KV cache spec: engine-owned slots.

Each GDN layer declares a ``RecurrentStateSpec`` (``openinfer.kv.spec``); the engine sizes a
slot pool from memory like KV blocks, allocates every layer's tensors with a leading slot axis
at fixed device addresses, gives each request one slot for its life and passes the step's slot
ids in ``batch.state_slots`` (a device array on cuda, so a CUDA graph replays with them)::

    slot            0 (null)    1           2          ...   N-1
    conv[layer]   [K-1, C]    [K-1, C]    [K-1, C]    ...         last K-1 conv inputs
    ssm[layer]    [nv,dk,dv]  [nv,dk,dv]  [nv,dk,dv]  ...         delta-rule state, fp32
                  padding     live request / prefix-cache snapshot (the engine copies rows)

Lifecycle of a request's slot:

- its first chunk (context starting at position 0) reads its initial state as zeros
  (``StepSequences.fresh``) instead of the slot's stale content — also after a preemption;
- a request starting from a cached prefix at n tokens gets its slot filled by the engine from
  the snapshot taken at n tokens (a row copy of ``conv`` and ``ssm``) before its first chunk;
- later chunks and decode steps read and update the same slot in place;
- a prefix-cache snapshot at a block boundary inside a step's rows (``batch.state_snapshots``,
  the spec's ``snapshot_within_step``; where: ``KVCacheManager.snapshot_within``'s policy): where
  the plan's kernels can (``KernelPlan.writes_snapshots``: cuda, the chunked walk with
  ``OPENINFER_QWEN35_SNAPSHOT_EMIT``, on by default) each GDN layer writes the state at the boundary into the
  snapshot slot in its one run; otherwise it runs the rows before the boundary, copies the slot
  into the snapshot slot, then runs the rest (``split_at_snapshots``) — in the one forward;
- the engine frees the slot when it drops the request (finished, aborted, preempted).

The full-attention layers keep their K/V in the paged block pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer import RecurrentStateSpec, StateTensor
from openinfer_qwen35.config import Qwen35Config

SNAPSHOT_IN_STEP_ENV = "OPENINFER_QWEN35_SNAPSHOT_IN_STEP"  # "1" / "0": snapshots inside a step on / off
# on by measurement (H200, D1 2026-11-24, gpu_qwen35.py --multi-turn-only, 4k history + 50 new tokens,
# medians of 5, in-process engine; RESULTS/D1/warm17d): with the packed metadata uploads, warm 37.9 ->
# 34.8 ms (cold 63.4 / 63.3: 0.60 -> 0.55x), the warm turn one 66-row forward instead of 64 + 2 rows,
# a lone cold 500-token prompt 33.9 -> 29.7 ms; GPU tests: a hit from the in-step snapshot equals the
# cold run, graph replay == eager. "0": a prompt's last partial block runs as a step of its own again
DEFAULT_SNAPSHOT_IN_STEP = True


def snapshot_in_step() -> bool:
    """``OPENINFER_QWEN35_SNAPSHOT_IN_STEP`` (read when the model is built), else the default."""
    value = os.environ.get(SNAPSHOT_IN_STEP_ENV, "").strip().lower()
    if value not in ("", "0", "1"):
        raise ValueError(f"{SNAPSHOT_IN_STEP_ENV}={value!r}: expected '1' or '0'")
    return DEFAULT_SNAPSHOT_IN_STEP if not value else value == "1"


def state_spec(config: Qwen35Config, conv_dtype: str = "float32", within_step: bool | None = None) -> RecurrentStateSpec:
    """One GDN layer's state: the conv window (``conv_dtype``: the backend's activation dtype)
    and the fp32 delta-rule matrix of every value head. ``within_step``: the model writes prefix-cache
    snapshots inside a step (default: ``snapshot_in_step()``)."""
    return RecurrentStateSpec((
        StateTensor("conv", (config.linear_conv_kernel_dim - 1, config.conv_dim), conv_dtype),
        StateTensor("ssm", (config.linear_num_value_heads, config.linear_key_head_dim,
                            config.linear_value_head_dim), "float32"),
    ), snapshot_within_step=snapshot_in_step() if within_step is None else within_step)


def bytes_per_slot(config: Qwen35Config, conv_dtype: str = "float32") -> int:
    """State bytes of one request over every GDN layer."""
    return state_spec(config, conv_dtype).slot_bytes * len(config.linear_layer_ids)


@dataclass
class StepSequences:
    """The sequences of one step as the GDN layers see them: host arrays on numpy; on cuda
    ``device`` holds int32 device arrays (``query_start``, ``slots``, ``fresh``, ``token_seq``)
    and ``slots`` may itself be a device array (graph-captured decode)."""

    query_start: np.ndarray | None  # [B+1] rows of each sequence in the step's tokens
    slots: Any  # [B] state slot of each sequence
    fresh: Any  # [B] bool: the sequence starts at position 0 (its initial state is zero)
    device: Any = None
    # [S, 3] host (sequence, rows before the boundary, snapshot slot): see ``split_at_snapshots``
    snapshots: np.ndarray | None = None


def host_step_sequences(batch: Any) -> StepSequences:
    """Each sequence's slot (``batch.state_slots``); a sequence starting at position 0 begins
    a fresh state."""
    query_start = np.asarray(batch.query_start, np.int64)
    slots = np.asarray(batch.state_slots, np.int64)
    if slots.shape[0] != batch.num_seqs:
        raise ValueError(f"Qwen3.5 keeps recurrent state: the batch must carry one state slot per sequence "
                         f"(batch.state_slots has {slots.shape[0]}, the batch {batch.num_seqs} sequences)")
    fresh = (np.asarray(batch.context_lens) - np.diff(query_start)) == 0
    return StepSequences(query_start, slots, fresh, snapshots=step_snapshots(batch))


def step_snapshots(batch: Any) -> np.ndarray | None:
    """``batch.state_snapshots`` (a host batch's, or a device batch's host copy), checked; None
    when the step takes no snapshot inside a sequence."""
    host = getattr(batch, "host", None)
    snapshots = getattr(batch if host is None else host, "state_snapshots", None)
    if snapshots is None or not len(snapshots):
        return None
    snapshots = np.asarray(snapshots, np.int64).reshape(-1, 3)
    host_batch = batch if host is None else host
    lengths = np.diff(np.asarray(host_batch.query_start, np.int64))
    seq, rows = snapshots[:, 0], snapshots[:, 1]
    if (seq < 0).any() or (seq >= len(lengths)).any() or len(np.unique(seq)) != len(seq):
        raise ValueError(f"state_snapshots name sequences outside the batch or one twice: {snapshots[:, 0].tolist()}")
    if (rows < 1).any() or (rows >= lengths[seq]).any():
        raise ValueError("a state snapshot must fall strictly inside its sequence's rows of the step")
    return snapshots


@dataclass
class SnapshotSplit:
    """A step whose GDN layers snapshot a sequence's state after one of its rows: the rows before
    each boundary (every sequence's rows, cut there: ``head``) run first, then each such slot is
    copied into its snapshot slot, then the rows from the boundary on (``tail``, the snapshotted
    sequences only, continuing their slots)::

        step rows      [ a0 a1 a2 a3 | b0 b1 b2 ]     a: snapshot after 3 rows, b: none
        head           [ a0 a1 a2 | b0 b1 b2 ]        every sequence, a cut at its boundary
        copy           snapshot slot of a <- live slot of a (conv window and delta-rule state)
        tail           [ a3 ]                          a again, from the boundary

    ``order``: the step's rows as head rows then tail rows (None when they already are: one
    sequence, or only the last one snapshotted); ``inverse`` puts the outputs back."""

    head: StepSequences
    tail: StepSequences
    num_head_rows: int
    order: Any  # [T] row ids, or None
    inverse: Any  # [T] row ids, or None
    live: Any  # [S] slots to copy from (after the head)
    snapshot: Any  # [S] slots to copy to
    pairs: tuple[tuple[int, int], ...] = ()  # the same (live, snapshot) pairs as host ints


def split_at_snapshots(seqs: StepSequences) -> SnapshotSplit | None:
    """The host ``SnapshotSplit`` of a step with snapshots inside sequences (None without)."""
    snapshots = seqs.snapshots
    if snapshots is None or not len(snapshots):
        return None
    query_start = np.asarray(seqs.query_start, np.int64)
    lengths = np.diff(query_start)
    slots = np.asarray(seqs.slots, np.int64)
    seq, cut = snapshots[:, 0], snapshots[:, 1]
    head_lengths = lengths.copy()
    head_lengths[seq] = cut
    tail_lengths = lengths[seq] - cut
    head_start = np.concatenate([[0], np.cumsum(head_lengths)])
    tail_start = np.concatenate([[0], np.cumsum(tail_lengths)])
    num_head = int(head_start[-1])
    head = StepSequences(head_start, slots, np.asarray(seqs.fresh, bool))
    tail = StepSequences(tail_start, slots[seq], np.zeros(len(seq), bool))
    in_order = len(seq) == 1 and int(seq[0]) == len(lengths) - 1
    order = inverse = None
    if not in_order:
        head_rows = np.concatenate([np.arange(query_start[s], query_start[s] + head_lengths[s])
                                    for s in range(len(lengths))])
        tail_rows = np.concatenate([np.arange(query_start[s] + c, query_start[s + 1]) for s, c in zip(seq, cut, strict=True)])
        order = np.concatenate([head_rows, tail_rows])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
    live, snapshot = slots[seq], snapshots[:, 2].astype(np.int64)
    pairs = tuple(zip(live.tolist(), snapshot.tolist(), strict=True))
    return SnapshotSplit(head, tail, num_head, order, inverse, live, snapshot, pairs)
