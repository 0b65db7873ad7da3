"""The recurrent state of every Gated DeltaNet layer, held in fixed state slots.

One slot per live request (``openinfer.kv.state_slots.StateSlots``); every GDN layer keeps
two tensors with a leading slot axis, allocated once at start-up on the backend's device::

    slot            0 (null)    1           2          ...   N-1
    conv[layer]   [K-1, C]    [K-1, C]    [K-1, C]    ...         last K-1 conv inputs
    ssm[layer]    [nv,dk,dv]  [nv,dk,dv]  [nv,dk,dv]  ...         delta-rule state, fp32

Lifecycle of a request's slot:

- its first chunk (context starting at position 0) takes a slot; the kernels read that
  step's initial state as zeros (``StepSequences.fresh``) instead of the slot's stale
  content — also after a preemption, when the engine recomputes the request from scratch;
- later chunks and decode steps read and update the same slot in place;
- ``release`` (request finished, aborted, failed or preempted) returns the slot to the pool.

The full-attention layers keep their K/V in the paged block pool, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer.errors import OpenInferError
from openinfer.kv.state_slots import StateSlots
from openinfer_qwen35.config import Qwen35Config


@dataclass
class StepSequences:
    """The sequences of one step as the GDN layers see them (host arrays; ``device`` holds the
    backend's copies, e.g. int32 CuPy arrays of ``slots`` / ``fresh``)."""

    query_start: np.ndarray  # [B+1] rows of each sequence in the step's tokens
    slots: np.ndarray  # [B] state slot of each sequence
    fresh: np.ndarray  # [B] bool: the sequence starts at position 0 (its initial state is zero)
    device: Any = None


class DeltaNetStateCache:
    def __init__(self, config: Qwen35Config, num_slots: int, xp: Any = np, conv_dtype: Any = np.float32):
        self.slots = StateSlots(num_slots)
        num_layers = len(config.linear_layer_ids)
        conv_shape = (num_slots, config.linear_conv_kernel_dim - 1, config.conv_dim)
        ssm_shape = (num_slots, config.linear_num_value_heads, config.linear_key_head_dim,
                     config.linear_value_head_dim)
        # (NumPy) zeros map untouched pages lazily: an unused slot costs no resident memory.
        self.conv = [xp.zeros(conv_shape, conv_dtype) for _ in range(num_layers)]
        self.ssm = [xp.zeros(ssm_shape, np.float32) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(config: Qwen35Config) -> int:
        conv = (config.linear_conv_kernel_dim - 1) * config.conv_dim
        ssm = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        return 4 * (conv + ssm) * len(config.linear_layer_ids)

    def begin(self, request_id: str) -> int:
        """A request's first chunk: take (or keep) its slot; the step reads it as zeros."""
        return self.slots.allocate(request_id)

    def slot_of(self, request_id: str) -> int:
        if not self.slots.has(request_id):
            raise OpenInferError(
                f"request {request_id!r} continues from a later position but holds no state slot; "
                "a recurrent model must see every request from position 0 (disable the prefix cache)")
        return self.slots.slot_of(request_id)

    def release(self, request_id: str) -> bool:
        return self.slots.free(request_id)

    def step_sequences(self, request_ids: tuple[str, ...], query_start: np.ndarray,
                       context_lens: np.ndarray) -> StepSequences:
        """Each sequence's slot; a sequence starting at position 0 begins a fresh state."""
        query_start = np.asarray(query_start, np.int64)
        fresh = (np.asarray(context_lens) - np.diff(query_start)) == 0
        slots = np.asarray([self.begin(rid) if is_fresh else self.slot_of(rid)
                            for rid, is_fresh in zip(request_ids, fresh.tolist(), strict=True)], np.int64)
        return StepSequences(query_start, slots, fresh)
