"""The recurrent state of every Gated DeltaNet layer, held in fixed state slots.

One slot per live request (``openinfer.kv.state_slots.StateSlots``); every GDN layer keeps
two tensors with a leading slot axis, allocated once at start-up::

    slot            0 (null)    1           2          ...   N-1
    conv[layer]   [K-1, C]    [K-1, C]    [K-1, C]    ...         last K-1 conv inputs
    ssm[layer]    [nv,dk,dv]  [nv,dk,dv]  [nv,dk,dv]  ...         delta-rule state, fp32

Lifecycle of a request's slot:

- its first chunk (context starting at position 0) takes a slot and zeroes it in every layer
  — also after a preemption, when the engine recomputes the request from its tokens;
- later chunks and decode steps read and update the same slot in place;
- ``release`` (request finished, aborted or preempted) returns the slot to the pool.

The full-attention layers keep their K/V in the paged block pool, not here.
"""

from __future__ import annotations

import numpy as np

from openinfer.errors import OpenInferError
from openinfer.kv.state_slots import StateSlots
from openinfer_qwen35.config import Qwen35Config


class DeltaNetStateCache:
    def __init__(self, config: Qwen35Config, num_slots: int):
        self.slots = StateSlots(num_slots)
        num_layers = len(config.linear_layer_ids)
        conv_shape = (num_slots, config.linear_conv_kernel_dim - 1, config.conv_dim)
        ssm_shape = (num_slots, config.linear_num_value_heads, config.linear_key_head_dim,
                     config.linear_value_head_dim)
        # np.zeros maps untouched pages lazily, so an unused slot costs no resident memory.
        self.conv = [np.zeros(conv_shape, np.float32) for _ in range(num_layers)]
        self.ssm = [np.zeros(ssm_shape, np.float32) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(config: Qwen35Config) -> int:
        conv = (config.linear_conv_kernel_dim - 1) * config.conv_dim
        ssm = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        return 4 * (conv + ssm) * len(config.linear_layer_ids)

    def begin(self, request_id: str) -> int:
        """A request's first chunk: take (or keep) its slot and zero the state in every layer."""
        slot = self.slots.allocate(request_id)
        for conv, ssm in zip(self.conv, self.ssm, strict=True):
            conv[slot] = 0.0
            ssm[slot] = 0.0
        return slot

    def slot_of(self, request_id: str) -> int:
        if not self.slots.has(request_id):
            raise OpenInferError(
                f"request {request_id!r} continues from a later position but holds no state slot; "
                "a recurrent model must see every request from position 0 (disable the prefix cache)")
        return self.slots.slot_of(request_id)

    def release(self, request_id: str) -> bool:
        return self.slots.free(request_id)
