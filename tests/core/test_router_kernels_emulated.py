"""core's decode routers in ``kernels/moe_routing.cu`` compiled with g++ against the host stand-in for
the CUDA built-ins (tests/helpers/cuda_host) and run on the CPU: ``moe_router_logits_blocks`` (a block per
expert, the hidden row split over its threads) against NumPy's fp32 logits, and ``moe_router_route_sort``
(the same logits, then the last block to finish routing and grouping) against ``moe_route_sort`` on those
logits — the same ids, weights and layout, twice in a row on one ticket counter, which it leaves at zero —
and NumPy's route; ``moe_route_sort`` in one warp (each lane a run of experts) gives the same layout. The GPU test (tests/gpu/test_kimi_ops.py) checks the same on the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import float32_to_bf16
from openinfer.moe import RouterSpec, route
from tests.helpers.cuda_emulation import bf16, compile_harness, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "router_harness.cpp"
TILE_ROWS = 64  # moe_routing.cu GROUP_TILE_ROWS


@pytest.fixture(scope="module", params=[0, 2], ids=["plain", "shared2"])
def harness(request, tmp_path_factory):
    shared = request.param
    binary = compile_harness(HARNESS, REPO / "core" / "kernels", tmp_path_factory.mktemp("router") / "harness",
                             {"ROUTE_SHARED_EXPERTS": shared})
    return binary, shared


@pytest.mark.parametrize("tokens,hidden,experts,top_k,scoring", [
    (1, 200, 24, 4, "sigmoid"), (3, 64, 30, 6, "softmax"), (4, 136, 40, 8, "sqrtsoftplus")])
def test_decode_routers_match_numpy(harness, tmp_path, tokens, hidden, experts, top_k, scoring):
    binary, shared = harness
    rng = np.random.default_rng(tokens * 1000 + experts)
    spec = RouterSpec(experts, top_k, scoring, norm_topk_prob=scoring != "softmax", routed_scaling_factor=2.5)
    x, gate = bf16(rng.standard_normal((tokens, hidden))), bf16(0.1 * rng.standard_normal((experts, hidden)))
    bias = None if scoring == "softmax" else (0.3 * rng.standard_normal(experts)).astype(np.float32)
    width, grouped = top_k + shared, experts + shared
    slots = tokens * width
    max_tiles = -(-slots // TILE_ROWS) + min(grouped, slots)
    run_harness(binary, tmp_path,
                params=np.array([tokens, hidden, experts, top_k, ("softmax", "sigmoid", "sqrtsoftplus").index(scoring),
                                 int(spec.norm_topk_prob), int(bias is not None), 64, max_tiles], np.int32),
                scaling=np.array([spec.routed_scaling_factor], np.float32), x=float32_to_bf16(x),
                gate=float32_to_bf16(gate), bias=np.zeros(1, np.float32) if bias is None else bias)
    logits = np.fromfile(tmp_path / "logits.bin", np.float32).reshape(tokens, experts)
    reference = x @ gate.T
    assert np.abs(logits - reference).max() <= 1e-5 * np.abs(reference).max()
    assert np.array_equal(np.fromfile(tmp_path / "fused_logits.bin", np.float32).reshape(tokens, experts), logits)
    assert np.fromfile(tmp_path / "done.bin", np.uint32)[0] == 0

    def layout(name):
        flat = np.fromfile(tmp_path / name, np.int32)
        ids, weights = flat[:slots].reshape(tokens, width), flat[slots:2 * slots].view(np.float32).reshape(tokens, width)
        rest = flat[2 * slots:]
        offsets, sorted_slots, slot_pos = rest[:grouped + 1], rest[grouped + 1:grouped + 1 + slots], rest[
            grouped + 1 + slots:grouped + 1 + 2 * slots]
        tiles = rest[grouped + 1 + 2 * slots:]
        count = int(tiles[-1])
        return ids, weights, offsets, sorted_slots, slot_pos, tiles[:count], tiles[max_tiles:max_tiles + count]

    two = layout("two_launches.bin")
    for name in ("fused_0.bin", "fused_1.bin", "one_warp.bin"):
        fused = layout(name)
        assert all(np.array_equal(a, b) for a, b in zip(fused[:3], two[:3], strict=True)), name
        assert all(np.array_equal(a, b) for a, b in zip(fused[5:], two[5:], strict=True)), name
        sorted_slots, slot_pos, flat_ids = fused[3], fused[4], fused[0].reshape(-1)
        assert np.array_equal(sorted_slots[slot_pos], np.arange(slots))
        for e in range(grouped):
            segment = sorted_slots[fused[2][e]:fused[2][e + 1]]
            assert np.array_equal(np.sort(segment), np.flatnonzero(flat_ids == e))
    ids, weights = two[0], two[1]
    assert np.array_equal(ids[:, top_k:], np.tile(experts + np.arange(shared), (tokens, 1)))
    assert np.all(weights[:, top_k:] == 1.0)
    ref_weights, ref_ids = route(reference, spec, bias)
    order, ref_order = np.argsort(ids[:, :top_k], 1), np.argsort(ref_ids, 1)
    assert np.array_equal(np.take_along_axis(ids[:, :top_k], order, 1), np.take_along_axis(ref_ids, ref_order, 1))
    assert np.allclose(np.take_along_axis(weights[:, :top_k], order, 1), np.take_along_axis(ref_weights, ref_order, 1),
                       rtol=1e-4, atol=1e-5)
