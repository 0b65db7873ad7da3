"""core's ``kernels/moe_decode.cu`` (``moe_route_decode``: a decode step's router logits, top-k and
grouping in one launch, the last block to arrive routing) compiled with g++ against the host
stand-in for the CUDA built-ins (tests/helpers/cuda_host) and run on the CPU next to the three
launches it replaces (moe.cu's moe_router_logits, moe_route, moe_sort_parallel): the same experts,
weights within fp32 rounding (the logits are summed in another order), the same offsets and tile
list, each expert's slots in slot order, and again on a second launch (the arrival counter back at
0). The GPU tests (tests/gpu/test_kimi_ops.py) check the same on the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import float32_to_bf16
from tests.helpers.cuda_emulation import bf16, compile_harness, read_array, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "moe_decode_harness.cpp"
SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
TILE_ROWS = 64


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    return compile_harness(HARNESS, REPO / "core" / "kernels", tmp_path_factory.mktemp("moe_decode") / "harness",
                           {"USE_MMA": 0, "WEIGHT_FORMAT": 0})


# tokens, hidden, experts, top_k, scoring, groups, topk_groups, norm_topk, bias
CASES = {"one-token": (1, 264, 40, 6, "sigmoid", 1, 1, 1, True),
         "groups": (3, 128, 48, 4, "sigmoid", 4, 2, 1, True),
         "softmax": (2, 2056, 20, 3, "softmax", 1, 1, 0, False)}


@pytest.mark.parametrize("case", list(CASES))
def test_one_launch_routing_equals_three(harness, tmp_path, case):
    tokens, hidden, experts, top_k, scoring, groups, topk_groups, norm_topk, use_bias = CASES[case]
    rng = np.random.default_rng(len(case))
    x, gate = bf16(rng.standard_normal((tokens, hidden))), bf16(0.1 * rng.standard_normal((experts, hidden)))
    bias = (0.3 * rng.standard_normal(experts)).astype(np.float32)
    run_harness(harness, tmp_path, params=np.array([tokens, hidden, experts, top_k, SCORING[scoring], groups,
                                                     topk_groups, 0, norm_topk, int(use_bias)], np.int32),
                scaling=np.array([2.5], np.float32), x=float32_to_bf16(x), gate=float32_to_bf16(gate), bias=bias)
    slots = tokens * top_k
    max_tiles = -(-slots // TILE_ROWS) + min(experts, slots)
    sizes = [slots, experts + 1, slots, slots, max_tiles, max_tiles, 1]

    def grouping(name: str) -> tuple[list[np.ndarray], np.ndarray]:
        flat = read_array(tmp_path, f"{name}_layout", np.int32, -1)
        parts = np.split(flat, np.cumsum(sizes)[:-1])
        return parts, read_array(tmp_path, f"{name}_weights", np.float32, -1)

    (ids, offsets, sorted_slots, slot_pos, tile_expert, tile_row, num_tiles), weights = grouping("three")
    count = int(num_tiles[0])
    for name in ("one", "one_again"):
        (d_ids, d_offsets, d_sorted, d_pos, d_tile_expert, d_tile_row, d_num_tiles), d_weights = grouping(name)
        assert np.array_equal(d_ids, ids), name
        assert np.allclose(d_weights, weights, rtol=1e-5, atol=1e-6), name
        assert np.array_equal(d_offsets, offsets) and int(d_num_tiles[0]) == count, name
        assert np.array_equal(d_tile_expert[:count], tile_expert[:count]), name
        assert np.array_equal(d_tile_row[:count], tile_row[:count]), name
        for e in range(experts):  # each expert's slots, in slot order
            assert np.array_equal(d_sorted[offsets[e]:offsets[e + 1]], np.flatnonzero(ids == e)), (name, e)
        assert np.array_equal(d_pos[d_sorted], np.arange(slots)), name
    assert read_array(tmp_path, "arrival", np.uint32, -1)[0] == 0
