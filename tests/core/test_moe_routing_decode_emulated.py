"""moe_routing.cu's one-launch decode routing, moe_route_decode, compiled with g++ against the host stand-in for the
CUDA built-ins (tests/helpers/cuda_host) and run on the CPU: its logits carry moe.cu moe_router_logits' bits, its ids,
weights, offsets and tile list equal moe_route_sort's on those logits (each expert's slots as a set, slot_pos their
inverse), twice in a row on one ticket counter, which it leaves at zero; and NumPy's route picks the same experts with
the same weights (fp32 rounding apart). The shapes (those of ``route_decode_shape``) cover one and several token groups,
4 and 8 warps, experts past one per lane and the fused shared experts. The GPU test (tests/gpu/test_moe_routing_decode.py) checks the same on the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import float32_to_bf16
from openinfer.moe import RouterSpec, route
from tests.helpers.cuda_emulation import bf16, compile_harness, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "route_decode_harness.cpp"
TILE_ROWS = 64  # moe_routing.cu GROUP_TILE_ROWS
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


def _route_decode_shape(tokens, hidden, experts, slots, warps):
    """moe_routing.route_decode_shape's grid and defines (that module needs CuPy; these tests run without it)."""
    group = min(tokens, max(g for g in (1, 2, 4) if g == 1 or g * hidden * 2 <= 44 * 1024))
    staged = -(-max(group * hidden * 2, slots * 4) // 16) * 16
    return -(-tokens // group) * -(-experts // warps), {
        "ROUTE_DECODE_WARPS": warps, "ROUTE_DECODE_TOKENS": group, "ROUTE_DECODE_CHUNKS": -(-hidden // 256),
        "ROUTE_DECODE_PER_LANE": -(-experts // 32), "ROUTE_DECODE_X_BYTES": staged}


@pytest.mark.parametrize("tokens,hidden,experts,top_k,scoring,shared,warps", [
    (1, 200, 24, 4, "sigmoid", 0, 4), (3, 64, 70, 6, "softmax", 2, 4), (5, 136, 40, 8, "sqrtsoftplus", 0, 8),
    (9, 520, 33, 3, "sigmoid", 1, 8), (2, 264, 50, 5, "sigmoid", 0, 4)])
def test_route_decode_matches_route_sort(tmp_path, tokens, hidden, experts, top_k, scoring, shared, warps):
    width, grouped = top_k + shared, experts + shared
    slots = tokens * width
    grid, defines = _route_decode_shape(tokens, hidden, experts, slots, warps)
    binary = compile_harness(HARNESS, REPO / "core" / "kernels", tmp_path / "harness",
                             {**defines, "ROUTE_SHARED_EXPERTS": shared})
    rng = np.random.default_rng(tokens * 1000 + experts)
    spec = RouterSpec(experts, top_k, scoring, norm_topk_prob=scoring != "softmax", routed_scaling_factor=2.5)
    x, gate = bf16(rng.standard_normal((tokens, hidden))), bf16(0.1 * rng.standard_normal((experts, hidden)))
    bias = None if scoring == "softmax" else (0.3 * rng.standard_normal(experts)).astype(np.float32)
    max_tiles = -(-slots // TILE_ROWS) + min(grouped, slots)
    run_harness(binary, tmp_path,
                params=np.array([tokens, hidden, experts, top_k, SCORINGS.index(scoring), int(spec.norm_topk_prob),
                                 int(bias is not None), max_tiles, grid], np.int32),
                scaling=np.array([spec.routed_scaling_factor], np.float32), x=float32_to_bf16(x),
                gate=float32_to_bf16(gate), bias=np.zeros(1, np.float32) if bias is None else bias)
    logits = np.fromfile(tmp_path / "logits.bin", np.float32).reshape(tokens, experts)
    assert np.abs(logits - x @ gate.T).max() <= 1e-5 * np.abs(logits).max()
    assert np.array_equal(np.fromfile(tmp_path / "decode_logits.bin", np.float32).reshape(tokens, experts), logits)
    assert np.fromfile(tmp_path / "done.bin", np.uint32)[0] == 0

    def layout(name):
        flat = np.fromfile(tmp_path / name, np.int32)
        ids, weights = flat[:slots].reshape(tokens, width), flat[slots:2 * slots].view(np.float32).reshape(tokens, width)
        rest = flat[2 * slots:]
        offsets = rest[:grouped + 1]
        sorted_slots, slot_pos = rest[grouped + 1:grouped + 1 + slots], rest[grouped + 1 + slots:grouped + 1 + 2 * slots]
        tiles = rest[grouped + 1 + 2 * slots:]
        return ids, weights, offsets, sorted_slots, slot_pos, tiles

    reference = layout("route_sort.bin")
    ids, _, offsets, _, _, tiles = reference
    for name in ("decode_0.bin", "decode_1.bin"):
        got = layout(name)
        for part in (0, 1, 2, 5):  # ids, weights (bits), offsets, tile lists + count
            assert np.array_equal(got[part], reference[part]), (name, part)
        sorted_slots, slot_pos = got[3], got[4]
        assert np.array_equal(sorted_slots[slot_pos], np.arange(slots))
        for e in range(grouped):
            assert np.array_equal(np.sort(sorted_slots[offsets[e]:offsets[e + 1]]), np.flatnonzero(ids.reshape(-1) == e))
    expected_weights, expected_ids = route(logits, spec, bias)
    order, expected_order = np.argsort(ids[:, :top_k], 1), np.argsort(expected_ids, 1)
    assert np.array_equal(np.take_along_axis(ids[:, :top_k], order, 1), np.take_along_axis(expected_ids, expected_order, 1))
    assert np.allclose(np.take_along_axis(reference[1][:, :top_k], order, 1),
                       np.take_along_axis(expected_weights, expected_order, 1), rtol=1e-4, atol=1e-5)
    if shared:
        assert np.array_equal(ids[:, top_k:], np.broadcast_to(np.arange(experts, grouped), (tokens, shared)))
