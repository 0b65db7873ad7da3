"""Engine options: the knobs ``openinfer serve`` / ``generate`` pass to a plugin's engine."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from openinfer.errors import InvalidRequestError

# the scheduler's policies (``openinfer.sched.scheduler.POLICIES``), named here too so that `openinfer
# serve`'s flags need not import the scheduler (NumPy, the KV manager, grammars: ~0.3 s of the supervisor's
# start, before it spawns the engine core)
SCHEDULER_POLICIES = ("mixed", "split", "prefill_first")


@dataclass(frozen=True)
class EngineOptions:
    """Every option has a default that works on a laptop CPU.

    ``device``: "auto" (cuda when CuPy sees a GPU, else cpu), "cuda" or "cpu".
    ``num_kv_blocks``: explicit KV pool size in blocks (of each KV cache group's pool); None sizes it from memory
    (``gpu_memory_utilization`` on cuda; ``cpu_kv_cache_gib`` on the CPU).
    """

    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on cuda, 512 on cpu
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_cache: bool = True
    cuda_graph: bool = True
    # schedule and launch step N+1 before reading back step N's tokens (None: on for cuda)
    async_scheduling: bool | None = None
    max_queue: int = 1024
    served_model_name: str | None = None
    seed: int = 0
    # write a Chrome-trace JSON per request into this directory (openinfer.tracing); None: off
    trace_dir: str | None = None
    # ranks (openinfer.parallel): one per GPU on cuda, threads with a fake communicator on cpu
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    # under expert parallel: each rank attends for its own sequences and caches only their KV
    # (MLA's latent cache is then split across ranks, not copied to every one)
    attention_data_parallel: bool = False
    # how a step mixes decodes and prompt chunks: one of SCHEDULER_POLICIES
    scheduler_policy: str = "mixed"
    load_format: str = "auto"  # "auto": the checkpoint; "dummy": random tensors at the real shapes

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option(s) {unknown}; known options: {sorted(known)}", field=unknown[0]
            )
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k in ("max_model_len",)})

    def with_(self, **changes: Any) -> EngineOptions:
        return replace(self, **changes)
