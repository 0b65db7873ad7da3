"""Per-request attention state of DeepSeek-V4, layer by layer.

What each layer keeps for a request after it has seen ``n`` tokens (W = sliding_window,
m = the layer's compression rate, D = head_dim, DI = index_head_dim)::

    every layer      window        [min(n, W-1), D]   the last W-1 keys (K = V), oldest first
    CSA / HCA        entries       [n // m, D]        one compressed entry per closed window
                     pending       [n % m, c·D]  ×2   wkv / wgate rows of the open window (c = 2 for CSA)
    CSA only         overlap       [m, D]        ×2   Ca half of the last closed window (kv, gate + ape)
                     index keys    [n // m, DI]       the indexer's own compressed keys,
                     + its pending / overlap           with their own open window

The open window (``pending`` and ``overlap``) is the compressor's partial-window state: a
chunked prefill or a decode step continues it exactly where the previous step stopped, so a
prompt split anywhere gives the same entries as one shot. A request starts fresh at position 0
(also after preemption: it is recomputed from scratch); ``release`` drops everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from openinfer import OpenInferError
from openinfer_deepseek_v4.config import CSA, SLIDING, DeepseekV4Config


@dataclass
class CompressorState:
    width: int  # c·head_dim of the projections
    head_dim: int
    entries: np.ndarray = field(init=False)
    pending_kv: np.ndarray = field(init=False)
    pending_gate: np.ndarray = field(init=False)
    overlap_kv: np.ndarray | None = None
    overlap_gate: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.entries = np.zeros((0, self.head_dim), np.float32)
        self.pending_kv = np.zeros((0, self.width), np.float32)
        self.pending_gate = np.zeros((0, self.width), np.float32)

    @property
    def num_entries(self) -> int:
        return int(self.entries.shape[0])


@dataclass
class LayerState:
    window: np.ndarray
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@dataclass
class RequestState:
    num_tokens: int
    layers: list[LayerState]

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            total += layer.window.nbytes
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    total += comp.entries.nbytes + comp.pending_kv.nbytes + comp.pending_gate.nbytes
                    total += 0 if comp.overlap_kv is None else comp.overlap_kv.nbytes + comp.overlap_gate.nbytes
        return total


def new_request_state(config: DeepseekV4Config) -> RequestState:
    layers = []
    for kind in config.layer_types:
        layer = LayerState(np.zeros((0, config.head_dim), np.float32))
        if kind != SLIDING:
            width = (2 if kind == CSA else 1) * config.head_dim
            layer.compressor = CompressorState(width, config.head_dim)
        if kind == CSA:
            layer.indexer = CompressorState(2 * config.index_head_dim, config.index_head_dim)
        layers.append(layer)
    return RequestState(0, layers)


class RequestStates:
    """The live requests' states, by request id (the model's side of ``release_request``)."""

    def __init__(self, config: DeepseekV4Config, max_requests: int):
        self.config = config
        self.max_requests = max_requests
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def begin_or_continue(self, request_id: str, start_position: int) -> RequestState:
        """The state a sequence starting at ``start_position`` continues (fresh at 0)."""
        if start_position == 0:
            state = self._states[request_id] = new_request_state(self.config)
            return state
        state = self._states.get(request_id)
        if state is None or state.num_tokens != start_position:
            have = None if state is None else state.num_tokens
            raise OpenInferError(
                f"request {request_id!r} continues at position {start_position} but its DeepSeek-V4 attention "
                f"state covers {have} tokens; the engine must run every request from position 0 in order "
                "(prefix caching stays off for this model)")
        return state

    def release(self, request_id: str) -> bool:
        return self._states.pop(request_id, None) is not None

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)
