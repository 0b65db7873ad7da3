"""Building a model for the engine from the parallel flags: one rank, or a group of ranks."""

from __future__ import annotations

import sys
from typing import Any

from openinfer.backend import create_backend, resolve_device
from openinfer.engine_core.startup import note_event
from openinfer.errors import ParallelConfigError
from openinfer.parallel.layout import ParallelLayout, check_devices
from openinfer.parallel.memory_plan import ModelMemory, plan_memory
from openinfer.parallel.rank import LOAD_FORMATS, RankContext
from openinfer.parallel.workers import RankModelFactory, start_process_group, start_thread_group


def layout_from_options(options: Any) -> ParallelLayout:
    return ParallelLayout(getattr(options, "tensor_parallel_size", 1), getattr(options, "expert_parallel_size", 1),
                          bool(getattr(options, "attention_data_parallel", False)))


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ParallelConfigError(f"--load-format {load_format!r} is not one of {LOAD_FORMATS}")


def gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy or no driver: no GPUs
        return 0


def check_memory_plan(memory: ModelMemory, layout: ParallelLayout, options: Any, max_model_len: int) -> None:
    """On GPUs, before loading: print what each rank will hold and refuse what cannot fit."""
    import cupy

    _, total = cupy.cuda.runtime.memGetInfo()
    plan = plan_memory(memory, layout, gpu_bytes=int(total), gpu_memory_utilization=options.gpu_memory_utilization,
                       max_model_len=max_model_len, max_num_seqs=options.max_num_seqs)
    print(plan.render(), file=sys.stderr, flush=True)
    plan.check()


def create_parallel_model(factory: RankModelFactory, options: Any, memory: ModelMemory | None = None,
                          max_model_len: int = 4096) -> Any:
    """The model to hand to ``PagedEngine``: ``factory(backend, RankContext())`` for one rank;
    for a group, rank 0's model driving the other ranks (threads with the fake communicator on
    the CPU, one process and GPU per rank with NCCL on cuda). Bad layouts fail here, first;
    on GPUs the memory plan of ``memory`` (the plugin's ``ModelMemory``) is printed and checked
    before anything loads."""
    layout = layout_from_options(options)
    load_format = getattr(options, "load_format", "auto")
    check_load_format(load_format)
    device = resolve_device(options.device)
    if device == "cuda":
        check_devices(layout, gpu_count())
        if memory is not None:
            check_memory_plan(memory, layout, options, options.max_model_len or max_model_len)
        note_event("memory_plan_checked")  # a start-up event: CuPy imported, the CUDA context made
    if layout.world_size == 1:
        return factory(create_backend(device), RankContext(load_format=load_format))
    if device == "cuda":
        return start_process_group(factory, layout, load_format)
    return start_thread_group(factory, layout, load_format, lambda: create_backend("cpu"))
