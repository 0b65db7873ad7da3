"""Decode-step MoE routing on the GPU (core/backend/cuda/moe_routing.py, kernels/moe_routing.cu): the one-launch
decode router against the routing it replaces, and the order of the routing and the shared experts' side stream
(moe.py ``moe_forward``): the same bits every way, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.conftest import bf16_random

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _capture_replay(step, to_host, replays: int = 2) -> list[np.ndarray]:
    """``step()`` captured into a CUDA graph on a side stream (after one eager warm-up there), replayed
    ``replays`` times (the output zeroed before each): each replay's ``to_host(output)``."""
    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    outs = []
    with cupy.cuda.using_allocator(pool.malloc), stream:
        step()
        stream.synchronize()
        stream.begin_capture()
        try:
            out = step()
        finally:
            graph = stream.end_capture()
        for _ in range(replays):
            out[...] = 0
            graph.launch(stream)
            stream.synchronize()
            outs.append(to_host(out))
    return outs


@pytest.mark.parametrize("order", ["before", "after", "first"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_route_before_shared_equals_inline(cuda_backend, rng, monkeypatch, tokens, order):
    """OPENINFER_MOE_ROUTE_BEFORE_SHARED=1 ("first": the side stream's fork recorded before the routing, the routing
    launched first) and OPENINFER_MOE_SHARED_AFTER_ROUTE=1 ("after") give the bits of the shared expert forked
    before the routing ("before", the default) and of the shared expert inline, eagerly and from a graph."""
    from openinfer.backend.cuda import moe
    from openinfer.moe import RouterSpec

    hidden, inter, experts = 256, 64, 16
    weights = {name: cuda_backend.weight(bf16_random(rng, experts, rows, cols, scale=0.05))
               for name, rows, cols in (("gate_up", 2 * inter, hidden), ("down", hidden, inter))}
    layer = moe.DeviceMoE(RouterSpec(experts, 4, "sigmoid", routed_scaling_factor=2.5),
                          cuda_backend.weight(bf16_random(rng, experts, hidden, scale=0.1)),
                          cupy.asarray((0.1 * rng.standard_normal(experts)).astype(np.float32)),
                          moe.ExpertLinear("bf16", weights["gate_up"], None, 2 * inter, hidden),
                          moe.ExpertLinear("bf16", weights["down"], None, hidden, inter))
    shared_up = cuda_backend.linear_weight(bf16_random(rng, 2 * inter, hidden, scale=0.05))
    shared_down = cuda_backend.linear_weight(bf16_random(rng, hidden, inter, scale=0.05))
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))

    def shared_experts(h):
        return cuda_backend.silu_mul_linear(cuda_backend.linear(h, shared_up), shared_down)

    def step():
        return moe.moe_forward(cuda_backend, x, layer, shared_experts=shared_experts)

    monkeypatch.setenv(moe.SHARED_OVERLAP_ENV, "0")
    inline = cuda_backend.to_host(step())
    monkeypatch.setenv(moe.SHARED_OVERLAP_ENV, "1")
    monkeypatch.setenv(moe.ROUTE_BEFORE_SHARED_ENV, "1" if order == "first" else "0")
    monkeypatch.setenv(moe.SHARED_AFTER_ROUTE_ENV, "1" if order == "after" else "0")
    assert moe.route_before_shared(tokens) == (order == "first")
    assert np.array_equal(cuda_backend.to_host(step()), inline)
    for replay in _capture_replay(step, cuda_backend.to_host):
        assert np.array_equal(replay, inline)


def test_route_before_shared_switch(monkeypatch):
    """The switch parses 1 / 0 (unset: the default), refuses other values, and is off where the shared experts
    do not overlap (no tokens, or steps above SHARED_OVERLAP_MAX_TOKENS unless forced)."""
    from openinfer.backend.cuda import moe

    monkeypatch.delenv(moe.SHARED_OVERLAP_ENV, raising=False)
    monkeypatch.delenv(moe.ROUTE_BEFORE_SHARED_ENV, raising=False)
    assert moe.route_before_shared(1) == moe.DEFAULT_ROUTE_BEFORE_SHARED
    monkeypatch.setenv(moe.ROUTE_BEFORE_SHARED_ENV, "1")
    assert moe.route_before_shared(1) and not moe.route_before_shared(0)
    assert not moe.route_before_shared(moe.SHARED_OVERLAP_MAX_TOKENS + 1)
    monkeypatch.setenv(moe.ROUTE_BEFORE_SHARED_ENV, "0")
    assert not moe.route_before_shared(1)
    monkeypatch.setenv(moe.ROUTE_BEFORE_SHARED_ENV, "early")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        moe.route_before_shared(1)
