"""Decode-step MoE routing on the GPU (core/backend/cuda/moe_routing.py, kernels/moe_routing.cu): the one-launch
decode router against the routing it replaces, and the order of the routing and the shared experts' side stream
(moe.py ``moe_forward``): the same bits every way, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.conftest import bf16_random, moe_router_case

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


@pytest.mark.parametrize("late_down", ["0", "1"])
@pytest.mark.parametrize("order", ["before", "after", "first"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_route_before_shared_equals_inline(cuda_backend, rng, monkeypatch, tokens, order, late_down):
    """OPENINFER_MOE_ROUTE_BEFORE_SHARED=1 ("first": the side stream's fork recorded before the routing, the routing
    launched first) and OPENINFER_MOE_SHARED_AFTER_ROUTE=1 ("after") give the bits of the shared expert forked
    before the routing ("before", the default) and of the shared expert inline, eagerly and from a graph; so does
    OPENINFER_MOE_SHARED_DOWN_LATE=1 (the shared experts in two phases, the down phase beside the routed down
    projection) in each order."""
    from openinfer.backend.cuda import moe, moe_routing

    hidden, inter = 256, 64
    layer = moe_router_case(cuda_backend, rng, 16, 4, hidden, scaling=2.5, inter=inter, bias_scale=0.1)
    shared_up = cuda_backend.linear_weight(bf16_random(rng, 2 * inter, hidden, scale=0.05))
    shared_down = cuda_backend.linear_weight(bf16_random(rng, hidden, inter, scale=0.05))
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))

    shared_experts = moe.SharedExpertPhases(up=lambda h: cuda_backend.linear(h, shared_up),
                                            down=lambda g: cuda_backend.silu_mul_linear(g, shared_down))

    def step():
        return moe.moe_forward(cuda_backend, x, layer, shared_experts=shared_experts)

    monkeypatch.setenv(moe.SHARED_DOWN_LATE_ENV, late_down)
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "0")  # one routing path for every order (the ordering is under test)
    monkeypatch.setenv(moe.SHARED_OVERLAP_ENV, "0")
    inline = cuda_backend.to_host(step())
    monkeypatch.setenv(moe.SHARED_OVERLAP_ENV, "1")
    monkeypatch.setenv(moe.ROUTE_BEFORE_SHARED_ENV, "1" if order == "first" else "0")
    monkeypatch.setenv(moe.SHARED_AFTER_ROUTE_ENV, "1" if order == "after" else "0")
    assert moe.route_before_shared(tokens) == (order == "first")
    assert moe.shared_down_late(tokens, shared_experts) == (late_down == "1")
    assert np.array_equal(cuda_backend.to_host(step()), inline)
    for replay in _capture_replay(step, cuda_backend.to_host):
        assert np.array_equal(replay, inline)


@pytest.mark.parametrize("shared_side", [False, True])
@pytest.mark.parametrize("tokens", [1, 4])
def test_layer_ticket_equals_per_call(cuda_backend, rng, monkeypatch, tokens, shared_side):
    """OPENINFER_MOE_ROUTE_TICKET=layer: moe_route_decode counts on the layer's own counter (no zeroing node) and gives
    the bits of a counter zeroed per call, call after call, eagerly and replayed from a CUDA graph (the kernel's last
    block puts it back to zero each time), with and without the shared experts on the side stream."""
    from openinfer.backend.cuda import moe, moe_routing

    hidden, inter = 256, 64
    layer = moe_router_case(cuda_backend, rng, 16, 4, hidden, scaling=2.5, inter=inter, bias_scale=0.1)
    shared_up = cuda_backend.linear_weight(bf16_random(rng, 2 * inter, hidden, scale=0.05))
    shared_down = cuda_backend.linear_weight(bf16_random(rng, hidden, inter, scale=0.05))
    shared_experts = moe.SharedExpertPhases(up=lambda h: cuda_backend.linear(h, shared_up),
                                            down=lambda g: cuda_backend.silu_mul_linear(g, shared_down))
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "1")

    def step():
        return moe.moe_forward(cuda_backend, x, layer, shared_experts=shared_experts if shared_side else None)

    monkeypatch.setenv(moe.ROUTE_TICKET_ENV, "call")
    assert moe.route_ticket(layer) is not layer.route_counter
    per_call = cuda_backend.to_host(step())
    monkeypatch.setenv(moe.ROUTE_TICKET_ENV, "layer")
    assert moe.route_ticket(layer) is layer.route_counter
    for _ in range(3):
        assert np.array_equal(cuda_backend.to_host(step()), per_call)
        assert int(layer.route_counter.get()[0]) == 0
    for replay in _capture_replay(step, cuda_backend.to_host, replays=3):
        assert np.array_equal(replay, per_call)
    assert int(layer.route_counter.get()[0]) == 0
    monkeypatch.setenv(moe.ROUTE_TICKET_ENV, "graph")
    with pytest.raises(ValueError, match="OPENINFER_MOE_ROUTE_TICKET"):
        moe.route_ticket(layer)


def test_shared_down_late_switch(monkeypatch):
    """OPENINFER_MOE_SHARED_DOWN_LATE parses 1 / 0 (unset: the default), refuses other values, and holds only for
    shared experts in two phases (a plain callable runs whole) where they overlap the routed ones."""
    from openinfer.backend.cuda import moe

    phases = moe.SharedExpertPhases(up=lambda h: h, down=lambda g: g)
    monkeypatch.delenv(moe.SHARED_OVERLAP_ENV, raising=False)
    monkeypatch.delenv(moe.SHARED_DOWN_LATE_ENV, raising=False)
    assert moe.shared_down_late(1, phases) == moe.DEFAULT_SHARED_DOWN_LATE
    monkeypatch.setenv(moe.SHARED_DOWN_LATE_ENV, "1")
    assert moe.shared_down_late(1, phases) and not moe.shared_down_late(0, phases)
    assert not moe.shared_down_late(1, lambda h: h)
    assert not moe.shared_down_late(moe.SHARED_OVERLAP_MAX_TOKENS + 1, phases)
    monkeypatch.setenv(moe.SHARED_DOWN_LATE_ENV, "0")
    assert not moe.shared_down_late(1, phases)
    monkeypatch.setenv(moe.SHARED_DOWN_LATE_ENV, "later")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        moe.shared_down_late(1, phases)


def test_route_before_shared_switch(monkeypatch):
    """The switch parses 1 / 0 (unset: the default), refuses other values, and is off where the shared experts
    do not overlap (no tokens, or steps above SHARED_OVERLAP_MAX_TOKENS unless forced)."""
    from openinfer.backend.cuda import moe

    monkeypatch.delenv(moe.SHARED_OVERLAP_ENV, raising=False)
    monkeypatch.delenv(moe.ROUTE_BEFORE_SHARED_ENV, raising=False)
    assert moe.route_before_shared(1) == moe.DEFAULT_ROUTE_BEFORE_SHARED
    assert moe.route_before_shared(1, one_launch=True)  # unset: on before moe_route_decode
    monkeypatch.setenv(moe.ROUTE_BEFORE_SHARED_ENV, "1")
    assert moe.route_before_shared(1) and not moe.route_before_shared(0)
    assert not moe.route_before_shared(moe.SHARED_OVERLAP_MAX_TOKENS + 1)
    monkeypatch.setenv(moe.ROUTE_BEFORE_SHARED_ENV, "0")
    assert not moe.route_before_shared(1) and not moe.route_before_shared(1, one_launch=True)
    monkeypatch.setenv(moe.ROUTE_BEFORE_SHARED_ENV, "early")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        moe.route_before_shared(1)


@pytest.mark.parametrize("tokens,experts,hidden,top_k,shared,scoring", [
    (1, 384, 7168, 8, 0, "sigmoid"), (4, 384, 7168, 8, 0, "sigmoid"), (1, 64, 2048, 6, 2, "sigmoid"),
    (16, 64, 2048, 6, 2, "sigmoid"), (64, 64, 2048, 6, 2, "sigmoid"), (5, 60, 512, 4, 0, "softmax"),
    (3, 512, 256, 16, 0, "sqrtsoftplus"), (7, 100, 1032, 8, 1, "sigmoid")])
def test_route_decode_equals_two_launches(cuda_backend, rng, monkeypatch, tokens, experts, hidden, top_k, shared,
                                          scoring):
    """OPENINFER_MOE_ROUTE_DECODE=1 (moe_route_decode, one launch): the logits, ids and weights of router_logits +
    moe_route_sort (OPENINFER_MOE_ROUTE_SORT=1) bit for bit, their offsets and tile list, each expert's slots as a
    set (slot_pos their inverse); moe_forward gives the same bits with it, eagerly and replayed from a CUDA graph
    (the ticket counter zeroed per call)."""
    from openinfer.backend.cuda import moe, moe_routing

    experts_run = experts * hidden <= 64 * 2048  # moe_forward too (the expert stacks' size)
    layer = moe_router_case(cuda_backend, rng, experts, top_k, hidden, scoring=scoring, shared=shared, inter=64,
                            expert_width=hidden if experts_run else 8, gate_scale=0.05)
    router, bias = layer.router, layer.correction_bias
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
    monkeypatch.setenv(moe_routing.ROUTE_SORT_ENV, "1")
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "0")
    assert not moe_routing.route_decode_wanted(x, layer)
    reference = moe_routing.route_and_group(x, layer)
    logits = moe_routing.router_logits(x, layer.gate, router)
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "1")
    assert moe_routing.route_decode_wanted(x, layer)
    for _ in range(2):  # twice: the counter is zeroed per call
        got = moe_routing.route_and_group(x, layer)
        assert np.array_equal(got.ids.get(), reference.ids.get())
        assert np.array_equal(got.weights.get(), reference.weights.get())
        offsets = reference.offsets.get()
        assert np.array_equal(got.offsets.get(), offsets)
        tiles = int(reference.num_tiles.get()[0])
        assert got.max_tiles == reference.max_tiles and int(got.num_tiles.get()[0]) == tiles
        assert np.array_equal(got.tile_expert.get()[:tiles], reference.tile_expert.get()[:tiles])
        assert np.array_equal(got.tile_row.get()[:tiles], reference.tile_row.get()[:tiles])
        sorted_slots, slot_pos, flat_ids = got.sorted_slots.get(), got.slot_pos.get(), got.ids.get().reshape(-1)
        assert np.array_equal(sorted_slots[slot_pos], np.arange(flat_ids.size))
        for e in range(experts + shared):
            assert np.array_equal(np.sort(sorted_slots[offsets[e]:offsets[e + 1]]), np.flatnonzero(flat_ids == e))
    grid, defines = moe_routing.route_decode_shape(tokens, hidden, experts, tokens * (top_k + shared))
    scratch = cupy.empty((tokens, experts), cupy.float32)  # the kernel's logits: moe_router_logits' bits
    one = moe_routing.ExpertGroupingDevice(*(cupy.empty_like(a) for a in (reference.ids, reference.weights,
                                                                  reference.sorted_slots, reference.slot_pos,
                                                                  reference.offsets, reference.tile_expert,
                                                                  reference.tile_row, reference.num_tiles)),
                                   reference.max_tiles, reference.top_k)
    moe.kernel("moe_routing.cu", "moe_route_decode", **defines, **({"ROUTE_SHARED_EXPERTS": shared} if shared else {}))(
        (grid,), (defines["ROUTE_DECODE_WARPS"] * 32,), (
            x, layer.gate, np.int32(tokens), np.int32(hidden), scratch, cupy.zeros(1, cupy.uint32),
            moe_routing.NULL if bias is None else bias, np.int32(experts), np.int32(top_k), np.int32(moe_routing.SCORING[scoring]),
            np.int32(router.norm_topk_prob), np.float32(router.routed_scaling_factor), one.ids, one.weights,
            one.offsets, one.sorted_slots, one.slot_pos, one.tile_expert, one.tile_row, one.num_tiles,
            np.int32(one.max_tiles)))
    assert np.array_equal(scratch.get(), logits.get())
    if not experts_run:
        return
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "0")
    plain = cuda_backend.to_host(moe.moe_forward(cuda_backend, x, layer))
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "1")

    def step():
        return moe.moe_forward(cuda_backend, x, layer)

    assert np.array_equal(cuda_backend.to_host(step()), plain)
    for replay in _capture_replay(step, cuda_backend.to_host):
        assert np.array_equal(replay, plain)


def test_route_decode_wanted_bounds(cuda_backend, rng, monkeypatch):
    """moe_route_decode only where switched on and the step fits it: expert groups, hash routing, too many tokens,
    rows too long or not whole 16-byte pieces take the other paths; a bad switch value is a clear error."""
    from openinfer.backend.cuda import moe, moe_routing
    from openinfer.moe import RouterSpec

    def layer(spec, hidden=256, tid2eid=None, shared=0):
        return moe.DeviceMoE(spec, cupy.zeros((spec.num_experts, hidden), cupy.uint16), None, None, None,
                             tid2eid=tid2eid, shared_experts=shared)

    x = cupy.zeros((16, 256), cupy.uint16)
    spec = RouterSpec(64, 6, "sigmoid")
    monkeypatch.delenv(moe_routing.ROUTE_DECODE_ENV, raising=False)
    assert moe_routing.route_decode_wanted(x, layer(spec)) == moe_routing.DEFAULT_ROUTE_DECODE
    assert moe_routing.route_decode_wanted(x, layer(spec), beside_shared=True) == moe_routing.DEFAULT_ROUTE_DECODE_BESIDE_SHARED
    many = cupy.zeros((moe_routing.ROUTE_DECODE_DEFAULT_MAX_WORK // 64 + 1, 256), cupy.uint16)
    assert not moe_routing.route_decode_wanted(many, layer(spec))  # unset: up to ROUTE_DECODE_DEFAULT_MAX_WORK
    softmax = RouterSpec(64, 6, "softmax")  # unset: softmax routers at one token only (moe_route's sum order above)
    assert moe_routing.route_decode_wanted(x[:1], layer(softmax)) and not moe_routing.route_decode_wanted(x, layer(softmax))
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "0")
    assert not moe_routing.route_decode_wanted(x, layer(spec))
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "1")
    assert moe_routing.route_decode_wanted(many, layer(spec)) and moe_routing.route_decode_wanted(x, layer(spec), beside_shared=True)
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "1")
    assert moe_routing.route_decode_wanted(x, layer(spec)) and moe_routing.route_decode_wanted(x, layer(spec, shared=2))
    assert not moe_routing.route_decode_wanted(x, layer(RouterSpec(64, 6, "sigmoid", num_groups=8, topk_groups=3)))
    assert not moe_routing.route_decode_wanted(x, layer(spec, tid2eid=cupy.zeros((8, 6), cupy.int64)))
    assert not moe_routing.route_decode_wanted(cupy.zeros((moe_routing.ROUTE_DECODE_MAX_TOKENS + 1, 256), cupy.uint16), layer(spec))
    assert not moe_routing.route_decode_wanted(cupy.zeros((0, 256), cupy.uint16), layer(spec))
    long_rows = moe_routing.ROUTE_DECODE_MAX_HIDDEN + 8
    assert not moe_routing.route_decode_wanted(cupy.zeros((1, long_rows), cupy.uint16), layer(spec, long_rows))
    assert not moe_routing.route_decode_wanted(cupy.zeros((1, 260), cupy.uint16), layer(spec, 260))
    assert not moe_routing.route_decode_wanted(x, layer(RouterSpec(512, 8, "sigmoid"), shared=1))
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_WARPS_ENV, "6")
    with pytest.raises(ValueError, match="must be 4 or 8"):
        moe_routing.route_decode_shape(1, 256, 64, 8)
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        moe_routing.route_decode_wanted(x, layer(spec))


def test_route_decode_ticket(cuda_backend, rng, monkeypatch):
    """moe_route_decode's counter, zeroed per call by a kernel node (``route_decode_ticket``), is back at zero after
    the call (its last block puts it back): one counter also serves calls in a row, with the same routes."""
    from openinfer.backend.cuda import moe_routing

    layer = moe_router_case(cuda_backend, rng, 64, 6, 512, shared=2, bias_scale=0.1)
    x = cuda_backend.upload(bf16_random(rng, 16, 512))
    monkeypatch.setenv(moe_routing.ROUTE_DECODE_ENV, "1")
    ticket = moe_routing.route_decode_ticket()
    assert int(ticket.get()[0]) == 0
    first = moe_routing.route_and_group(x, layer, ticket)
    assert int(ticket.get()[0]) == 0
    for _ in range(2):
        again = moe_routing.route_and_group(x, layer, ticket)
        assert int(ticket.get()[0]) == 0
        assert np.array_equal(again.ids.get(), first.ids.get()) and np.array_equal(again.weights.get(),
                                                                                   first.weights.get())
