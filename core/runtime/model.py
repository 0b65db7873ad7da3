"""What a model plugin hands to the default engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from openinfer.backend.base import Backend, KVLayer


@dataclass(frozen=True)
class ModelSpec:
    """Facts the engine needs about a model (sizes for KV and memory, token ids for stops)."""

    architectures: tuple[str, ...]
    model_type: str
    vocab_size: int
    max_model_len: int
    num_layers: int  # layers holding paged KV
    num_kv_heads: int
    head_dim: int
    num_heads: int = 0
    hidden_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    num_parameters: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class PagedModel(Protocol):
    """A model the default engine can run: one ``forward`` for prefill, decode and mixed steps.

    ``forward`` receives the step's batch (already on the backend's device) and one ``KVLayer``
    per attention layer, and returns logits ``[len(batch.logits_rows), vocab_size]`` as a
    backend array (float32 on numpy).
    """

    spec: ModelSpec
    backend: Backend

    def forward(self, batch: Any, kv_cache: list[KVLayer]) -> Any: ...


@runtime_checkable
class RequestStateModel(Protocol):
    """Optional, for models that keep per-request state outside the paged KV pool (recurrent
    layers holding a conv window and a matrix state in fixed ``StateSlots``).

    Such a model reads ``batch.request_ids`` in ``forward``: a sequence whose context starts at
    position 0 begins a fresh state, any other continues its request's state. The engine calls
    ``release_request`` whenever it drops a request's KV — finished, aborted, failed or
    preempted (a preempted request is recomputed from position 0 later) — so the model can
    free the slot. Such models cannot use the prefix cache (their plugin turns it off).
    """

    def release_request(self, request_id: str) -> None: ...
