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
- the engine frees the slot when it drops the request (finished, aborted, preempted).

The full-attention layers keep their K/V in the paged block pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer import RecurrentStateSpec, StateTensor
from openinfer_qwen35.config import Qwen35Config


def state_spec(config: Qwen35Config, conv_dtype: str = "float32") -> RecurrentStateSpec:
    """One GDN layer's state: the conv window (``conv_dtype``: the backend's activation dtype)
    and the fp32 delta-rule matrix of every value head."""
    return RecurrentStateSpec((
        StateTensor("conv", (config.linear_conv_kernel_dim - 1, config.conv_dim), conv_dtype),
        StateTensor("ssm", (config.linear_num_value_heads, config.linear_key_head_dim,
                            config.linear_value_head_dim), "float32"),
    ))


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


def host_step_sequences(batch: Any) -> StepSequences:
    """Each sequence's slot (``batch.state_slots``); a sequence starting at position 0 begins
    a fresh state."""
    query_start = np.asarray(batch.query_start, np.int64)
    slots = np.asarray(batch.state_slots, np.int64)
    if slots.shape[0] != batch.num_seqs:
        raise ValueError(f"Qwen3.5 keeps recurrent state: the batch must carry one state slot per sequence "
                         f"(batch.state_slots has {slots.shape[0]}, the batch {batch.num_seqs} sequences)")
    fresh = (np.asarray(batch.context_lens) - np.diff(query_start)) == 0
    return StepSequences(query_start, slots, fresh)
