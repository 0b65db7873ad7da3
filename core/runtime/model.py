"""What a model plugin hands to the default engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from openinfer.backend.base import Backend, KVLayer
from openinfer.kv.spec import FullAttentionSpec, KVCacheSpec


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

    ``forward`` receives the step's batch (already on the backend's device) and one cache per
    KV cache spec (``KVLayer`` for paged specs, ``StateLayer`` for recurrent state), and returns
    logits ``[len(batch.logits_rows), vocab_size]`` as a backend array (float32 on numpy).

    Optionally ``kv_cache_specs() -> list[KVCacheSpec]`` declares what each cache layer holds
    (``openinfer.kv.spec``); ``kv_cache[i]`` is then allocated for ``specs[i]`` and the batch
    carries one block table per group (``batch.group_block_tables(group_specs(specs)
    .group_of_layer[i])``) and ``batch.state_slots``. Without it, every one of
    ``spec.num_layers`` layers holds full-attention K and V of ``num_kv_heads × head_dim``.
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
    Prefer declaring a ``RecurrentStateSpec`` (engine-owned slots, prefix snapshots, graphs).
    """

    def release_request(self, request_id: str) -> None: ...


def kv_cache_specs_of(model: PagedModel) -> list[KVCacheSpec]:
    """The model's per-layer KV cache specs, or full attention on every layer (dense models)."""
    declared = getattr(model, "kv_cache_specs", None)
    if declared is not None:
        return list(declared())
    spec = model.spec
    dtype = getattr(model.backend, "kv_dtype", "float32")
    return [FullAttentionSpec(spec.num_kv_heads, spec.head_dim, dtype)] * spec.num_layers
