"""A CUDA error that poisons the device context (an illegal address) stops the engine loop, so that
the engine-core process exits and its supervisor restarts it, instead of failing every later step;
an ordinary step error fails only that step's requests and the engine goes on serving."""

from __future__ import annotations

import pytest

from openinfer.errors import DeviceFaultError, is_device_fault
from tests.helpers.engine_utils import make_request, run_one
from tests.plugins.qwen3.conftest import build_engine


class CUDARuntimeError(RuntimeError):
    """Stands in for cupy_backends' CUDARuntimeError (same class name, same message form)."""


def test_sticky_cuda_errors_are_device_faults():
    assert is_device_fault(CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered"))
    assert is_device_fault(type("CUDADriverError", (RuntimeError,), {})("CUDA_ERROR_LAUNCH_FAILED: unspecified"))
    assert not is_device_fault(CUDARuntimeError("cudaErrorMemoryAllocation: out of memory"))
    assert not is_device_fault(ValueError("cudaErrorIllegalAddress"))  # not a CUDA error class


@pytest.mark.parametrize(("error", "fatal"), [
    (CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered"), True),
    (RuntimeError("a step's own bug"), False),
])
def test_a_device_fault_stops_the_engine_and_an_ordinary_error_does_not(tiny_qwen3_dir, error, fatal):
    engine = build_engine(tiny_qwen3_dir)
    try:
        assert len(run_one(engine, make_request("before", [1, 2, 3], max_tokens=2)).token_ids) == 2
        original = engine._run_forward
        calls = {"n": 0}

        def failing_once(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise error
            return original(*args, **kwargs)

        engine._run_forward = failing_once
        failed = run_one(engine, make_request("hit", [4, 5, 6], max_tokens=2))
        assert failed.error is not None and failed.error.message
        if fatal:
            health = engine.health()
            assert not health.healthy and DeviceFaultError.__name__ in health.message
        else:
            assert engine.health().healthy
            assert len(run_one(engine, make_request("after", [1, 2, 3], max_tokens=2)).token_ids) == 2
    finally:
        engine.close_sync()
