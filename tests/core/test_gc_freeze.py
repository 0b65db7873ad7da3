"""The engine core freezes its start-up heap, so a full collection during serving only walks what
serving allocated (a gen-2 pass over the whole heap had stalled a step's launch by 100-200 ms)."""

from __future__ import annotations

import gc

import pytest

from openinfer.engine_core.startup import GC_FREEZE_ENV, freeze_startup_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_start_up_objects_move_to_the_permanent_generation(unfrozen, monkeypatch):
    monkeypatch.delenv(GC_FREEZE_ENV, raising=False)
    survivors = [[i] for i in range(1000)]  # alive after start-up
    frozen = freeze_startup_heap()
    # other threads of the test session may unfreeze or add objects between the two reads: no equality
    assert frozen >= len(survivors) and gc.get_freeze_count() >= len(survivors)
    assert not any(gc.get_count()[1:])  # the young generations were emptied into the frozen one


def test_switch_off(unfrozen, monkeypatch):
    monkeypatch.setenv(GC_FREEZE_ENV, "0")
    assert freeze_startup_heap() == 0
    assert gc.get_freeze_count() == 0


def test_early_cuda_runs_only_for_one_gpu_at_device_zero(monkeypatch) -> None:
    """OPENINFER_EARLY_CUDA=1: the engine-core process imports CuPy and makes the CUDA context in a
    thread while it discovers plugins; only when the engine's one GPU is device 0, and a failure
    there (no GPU) is left to the backend's start."""
    import sys
    import types

    from openinfer.engine_core import startup
    from openinfer.engine_core.startup import early_cuda_from_argv, early_cuda_wanted, start_cuda_early

    monkeypatch.setenv("OPENINFER_EARLY_CUDA", "0")
    assert not early_cuda_wanted({"device": "cuda"})
    monkeypatch.delenv("OPENINFER_EARLY_CUDA", raising=False)  # the default: by the driver
    assert early_cuda_wanted({"device": "cuda"})
    monkeypatch.setenv("OPENINFER_EARLY_CUDA", "1")
    assert early_cuda_wanted({}) and early_cuda_wanted({"device": "cuda", "tensor_parallel_size": 1})
    assert not early_cuda_wanted({"device": "cpu"}) and not early_cuda_wanted({"device": "cuda:1"})
    assert not early_cuda_wanted({"device": "cuda", "tensor_parallel_size": 2})
    assert not early_cuda_wanted({"expert_parallel_size": 4})
    freed: list[int] = []
    runtime = types.SimpleNamespace(free=freed.append)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(startup, "_early_cuda", None)
    first = start_cuda_early()
    first.join(5)
    assert freed == [0] and start_cuda_early() is first  # once per process
    assert early_cuda_from_argv(["--run-dir", "x", "--options-json", '{"device": "cuda"}']) is first
    monkeypatch.setattr(startup, "_early_cuda", None)
    for argv in (["--options-json", '{"device": "cpu"}'], ["--options-json={not json"], ["--options-json", "[1]"],
                 ["--options-json"]):
        assert early_cuda_from_argv(argv) is None
    thread = early_cuda_from_argv(["--run-dir", "x", "--options-json={}"])  # "auto": device 0 when there is one
    assert thread is not None
    thread.join(5)
    assert freed == [0, 0]
    monkeypatch.setattr(startup, "_early_cuda", None)

    def no_gpu(pointer: int) -> None:
        raise RuntimeError("cudaErrorNoDevice")

    runtime.free = no_gpu
    thread = start_cuda_early()
    thread.join(5)
    assert not thread.is_alive()


def test_early_cuda_by_the_driver_makes_the_context_without_cupy(monkeypatch) -> None:
    """OPENINFER_EARLY_CUDA=driver: the thread retains the primary context through the driver API
    (ctypes, no GIL held) and imports nothing; a value that is no mode is a clear error."""
    import sys

    import pytest

    from openinfer.engine_core import startup
    from openinfer.errors import OpenInferError

    retained: list[int] = []
    monkeypatch.setattr(startup, "retain_primary_context", lambda ordinal=0: retained.append(ordinal) or True)
    monkeypatch.setitem(sys.modules, "cupy", None)  # importing it would fail
    monkeypatch.setattr(startup, "_early_cuda", None)
    monkeypatch.setenv("OPENINFER_EARLY_CUDA", "driver")
    assert startup.early_cuda_wanted({"device": "cuda"})
    thread = startup.start_cuda_early()
    thread.join(5)
    assert retained == [0]
    monkeypatch.setattr(startup, "_early_cuda", None)
    monkeypatch.setenv("OPENINFER_EARLY_CUDA", "sometimes")
    with pytest.raises(OpenInferError, match="OPENINFER_EARLY_CUDA"):
        startup.early_cuda_wanted({"device": "cuda"})
    assert startup.early_cuda_from_argv(["--options-json", "{}"]) is None  # reported by the core's start


def test_retaining_the_context_without_a_driver_reports_false(monkeypatch) -> None:
    import ctypes

    from openinfer.engine_core.startup import retain_primary_context

    def missing(name: str):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert retain_primary_context(0) is False


def test_deferred_weights_only_when_asked_for_one_cuda_rank(monkeypatch) -> None:
    """OPENINFER_DEFERRED_WEIGHTS (default on) defers a load's weight copies only for one CUDA rank; =0, on
    the CPU, for several ranks or without CuPy the block yields None, and waiting with nothing
    pending returns at once."""
    import sys
    import types

    from openinfer.engine_core.startup import deferred_weights, wait_for_deferred_weights

    def options(**fields):
        return types.SimpleNamespace(**{"device": "cuda", "tensor_parallel_size": 1, "expert_parallel_size": 1, **fields})

    monkeypatch.setenv("OPENINFER_DEFERRED_WEIGHTS", "0")
    with deferred_weights(options()) as copies:
        assert copies is None
    monkeypatch.delenv("OPENINFER_DEFERRED_WEIGHTS", raising=False)  # the default: on
    for other in (options(device="cpu"), options(tensor_parallel_size=2), options(expert_parallel_size=2)):
        with deferred_weights(other) as copies:
            assert copies is None
    monkeypatch.setitem(sys.modules, "openinfer.backend.cuda.weight_upload", None)  # as if CuPy were missing
    with deferred_weights(options()) as copies:
        assert copies is None
    assert wait_for_deferred_weights() == 0.0
    waited: list[bool] = []
    module = types.SimpleNamespace(wait_for_deferred_uploads=lambda: waited.append(True))
    monkeypatch.setitem(sys.modules, "openinfer.backend.cuda.weight_upload", module)
    assert wait_for_deferred_weights() >= 0.0 and waited == [True]


def test_weights_joined_later_hold_the_wait_until_the_block_ends(monkeypatch) -> None:
    """OPENINFER_WEIGHTS_JOIN=serve: inside ``weights_joined_later`` (the graph capture, the
    prefill warm-up) waiting for the deferred copies returns at once; after it, it waits."""
    import sys
    import types

    import pytest

    from openinfer.engine_core.startup import (
        wait_for_deferred_weights,
        weights_join_point,
        weights_joined_later,
    )
    from openinfer.errors import OpenInferError

    waited: list[bool] = []
    module = types.SimpleNamespace(wait_for_deferred_uploads=lambda: waited.append(True))
    monkeypatch.setitem(sys.modules, "openinfer.backend.cuda.weight_upload", module)
    with weights_joined_later():
        assert wait_for_deferred_weights() == 0.0 and waited == []
    with weights_joined_later(False):  # as today: the capture joins them
        wait_for_deferred_weights()
    assert waited == [True]
    wait_for_deferred_weights()
    assert waited == [True, True]
    monkeypatch.delenv("OPENINFER_WEIGHTS_JOIN", raising=False)
    assert weights_join_point() == "serve"  # the default since s12 D2
    monkeypatch.setenv("OPENINFER_WEIGHTS_JOIN", "compile")
    assert weights_join_point() == "compile"
    monkeypatch.setenv("OPENINFER_WEIGHTS_JOIN", "never")
    with pytest.raises(OpenInferError, match="OPENINFER_WEIGHTS_JOIN"):
        weights_join_point()


def test_the_start_switch_interval_holds_only_inside_its_block(monkeypatch) -> None:
    import sys

    import pytest

    from openinfer.engine_core.startup import start_switch_interval
    from openinfer.errors import OpenInferError

    before = sys.getswitchinterval()
    monkeypatch.delenv("OPENINFER_START_SWITCH_INTERVAL_MS", raising=False)
    with start_switch_interval() as seconds:
        assert seconds is None and sys.getswitchinterval() == before
    monkeypatch.setenv("OPENINFER_START_SWITCH_INTERVAL_MS", "0.5")
    with start_switch_interval() as seconds:
        assert seconds == pytest.approx(5e-4) and sys.getswitchinterval() == pytest.approx(5e-4)
    assert sys.getswitchinterval() == before
    for bad in ("0", "-1", "fast", "1000"):
        monkeypatch.setenv("OPENINFER_START_SWITCH_INTERVAL_MS", bad)
        with pytest.raises(OpenInferError, match="OPENINFER_START_SWITCH_INTERVAL_MS"), start_switch_interval():
            pass


def test_weights_joined_later_holds_only_the_thread_inside_it(monkeypatch) -> None:
    """Another thread building its own engine meanwhile still waits for the copies."""
    import sys
    import threading
    import types

    from openinfer.engine_core.startup import wait_for_deferred_weights, weights_joined_later

    waited: list[str] = []
    module = types.SimpleNamespace(wait_for_deferred_uploads=lambda: waited.append(threading.current_thread().name))
    monkeypatch.setitem(sys.modules, "openinfer.backend.cuda.weight_upload", module)
    with weights_joined_later():
        other = threading.Thread(target=wait_for_deferred_weights, name="other")
        other.start()
        other.join(5)
        wait_for_deferred_weights()
    assert waited == ["other"]
