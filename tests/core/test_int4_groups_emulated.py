"""moe_int4.cu's decode GEMV for the lane-groups INT4 layout (core/quant.py ``tile_int4(lane_groups=True)``,
moe.cu INT4_TILED 2) compiled with g++ against the host stand-in for the CUDA built-ins
(tests/helpers/cuda_host): the NumPy product of the dequantised weights within bf16 rounding, and
moe.cu's moe_gemv_mma reading the same layout within fp32 rounding (the group scales after the mma)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import bf16_to_float32, float32_to_bf16
from openinfer.quant import dequantize_int4_group, quantize_int4_group, tile_int4, untile_int4
from tests.helpers.cuda_emulation import bf16, compile_harness, read_array, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "int4_groups_harness.cpp"

# moe_int4.cu defines per case: the ring of 4 (K = 384: three chunks, never full), of 2 (wraps), two
# token pairs per pass, no rotation; (tokens, experts, top_k): a batch-1 step (one row per expert), a
# few rows per expert (passes of 2 and a lone last row), ragged tiles
CASES = {"d4": {"GROUPS_DEPTH": 4}, "d2": {"GROUPS_DEPTH": 2}, "p2": {"GROUPS_DEPTH": 2, "GROUPS_PAIRS": 2},
         "d6": {"GROUPS_DEPTH": 6},
         # gate_up with SiLU·mul fused (N = 48: I = 24, three warps of 8 gate + 8 up rows, rows across blocks)
         "silu": {"GROUPS_DEPTH": 4, "GROUPS_FUSE_SILU": 1}, "silu_d2": {"GROUPS_DEPTH": 2, "GROUPS_FUSE_SILU": 1},
         # the ring in shared memory (cp.async on the GPU): deeper than K's three chunks, and one that wraps
         "s8": {"GROUPS_STAGES": 8}, "s2": {"GROUPS_STAGES": 2}, "s2_silu": {"GROUPS_STAGES": 2, "GROUPS_FUSE_SILU": 1},
         # K split over 2 / 4 warps of a block (K = 384: 2 + 1 chunks, 1 + 1 + 1 + 0; N = 48: a warp pair past N)
         "s2_k2": {"GROUPS_STAGES": 2, "GROUPS_KSPLIT": 2}, "s8_k4": {"GROUPS_STAGES": 8, "GROUPS_KSPLIT": 4},
         "s2_k2_silu": {"GROUPS_STAGES": 2, "GROUPS_KSPLIT": 2, "GROUPS_FUSE_SILU": 1},
         "s8_p4": {"GROUPS_STAGES": 8, "GROUPS_PAIRS": 4},
         "norot": {"GROUPS_DEPTH": 4, "GROUPS_ROTATE": 0},
         # several column blocks per block (GROUPS_ROW_BLOCKS; N = 192: three blocks of 64 columns over a grid of
         # 2, six of 32 over a grid of 2 with K split)
         "rb2": {"GROUPS_DEPTH": 4, "GROUPS_ROTATE": 0, "GROUPS_ROW_BLOCKS": 2},
         "s2_k2_rb3": {"GROUPS_STAGES": 2, "GROUPS_KSPLIT": 2, "GROUPS_ROW_BLOCKS": 3},
         # a chunk's mma in 2 / 4 accumulator chains (GROUPS_ACC_CHAINS), with the SiLU·mul form too
         "acc2": {"GROUPS_DEPTH": 4, "GROUPS_ACC_CHAINS": 2}, "acc4": {"GROUPS_DEPTH": 2, "GROUPS_ACC_CHAINS": 4},
         "acc2_silu": {"GROUPS_DEPTH": 4, "GROUPS_ACC_CHAINS": 2, "GROUPS_FUSE_SILU": 1},
         # the pass's activations staged in shared memory as B registers with each group's sum (GROUPS_XSMEM 2 / 1
         # token rows a pass): the ring of 4 and of 2, the fused form, several column blocks (N = 48: a block's last
         # warp past N meets the block's barriers)
         "xs": {"GROUPS_XSMEM": 2}, "xs_d2": {"GROUPS_XSMEM": 2, "GROUPS_DEPTH": 2},
         "xs_silu": {"GROUPS_XSMEM": 2, "GROUPS_FUSE_SILU": 1}, "xs_rb2": {"GROUPS_XSMEM": 2, "GROUPS_ROW_BLOCKS": 2},
         "xs1": {"GROUPS_XSMEM": 1}, "xs1_silu_d2": {"GROUPS_XSMEM": 1, "GROUPS_DEPTH": 2, "GROUPS_FUSE_SILU": 1},
         # a warp's column blocks as one chunk stream (GROUPS_ROW_STREAM; N = 192: blocks 0 + 2 and 1 alone over a grid
         # of 2, all three over a grid of 1; N = 48: a warp past N walks nothing)
         "xs_rs2": {"GROUPS_XSMEM": 2, "GROUPS_ROTATE": 0, "GROUPS_ROW_STREAM": 1, "GROUPS_ROW_BLOCKS": 2},
         "rs3_d2": {"GROUPS_DEPTH": 2, "GROUPS_ROTATE": 0, "GROUPS_ROW_STREAM": 1, "GROUPS_ROW_BLOCKS": 3},
         "xs_rs2_n48": {"GROUPS_XSMEM": 2, "GROUPS_ROTATE": 0, "GROUPS_ROW_STREAM": 1, "GROUPS_ROW_BLOCKS": 2}}
CASE_N = {"rb2": 192, "s2_k2_rb3": 192, "xs_rb2": 192, "xs_rs2": 192, "rs3_d2": 192}  # N of a case
# (default 48)
ROUTES = {"one_token": (1, 8, 4), "few": (5, 3, 2), "ragged": (12, 4, 3)}


def test_lane_groups_round_trip_and_index():
    rng = np.random.default_rng(2)
    experts, n, k = 2, 48, 384
    words = rng.integers(-2**31, 2**31 - 1, (experts, n, k // 8)).astype(np.int32)
    scales = rng.integers(0, 2**16, (experts, n, k // 32)).astype(np.uint16)
    tiled_words, tiled_scales = tile_int4(words, scales, lane_groups=True)
    flat = tiled_words.reshape(-1)
    for e, row, col in [(0, 0, 0), (1, 47, 376), (0, 9, 136), (1, 23, 264), (0, 31, 96)]:
        chunk = (e * (n // 16) + row // 16) * (k // 128) + col // 128  # moe.cu int4_word_index, INT4_TILED 2
        word = ((chunk * 2 + (row >> 3) % 2) * 8 + row % 8) * 16 + (col >> 5) % 4 * 4 + (col >> 3) % 4
        assert flat[word] == words[e, row, col // 8]
    assert np.array_equal(tiled_scales, tile_int4(words, scales)[1])  # the tiled layout's scales
    back = untile_int4(tiled_words, tiled_scales, n, k, lane_groups=True)
    assert np.array_equal(back[0], words) and np.array_equal(back[1], scales)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("case", list(CASES))
def test_groups_gemv_equals_numpy(tmp_path, case, route):
    rng = np.random.default_rng(len(case) + 7 * len(route))
    tokens, experts, top_k = ROUTES[route]
    n, k = CASE_N.get(case, 48), 384  # N: a block's last warp past N; K: three chunks
    dense = [bf16(0.08 * rng.standard_normal((n, k))) for _ in range(experts)]
    packed = [quantize_int4_group(w, 32) for w in dense]
    words = np.stack([p for p, _ in packed])
    scales = np.stack([float32_to_bf16(s) for _, s in packed])
    reference = np.stack([dequantize_int4_group(p, bf16_to_float32(s), (n, k))
                          for (p, _), s in zip(packed, scales, strict=True)])
    x = bf16(rng.standard_normal((tokens, k)))
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    binary = compile_harness(HARNESS, REPO / "core" / "kernels", tmp_path / "groups", {
        "USE_MMA": 0, "WEIGHT_FORMAT": 1, "GROUP": 32, "INT4_TILED": 2, **CASES[case]})
    w, s = tile_int4(words, scales, lane_groups=True)
    run_harness(binary, tmp_path, params=np.array([tokens, experts, top_k, n, k], np.int32),
                x=float32_to_bf16(x), ids=ids, w=w, s=s)
    by_slot = np.empty(tokens * top_k, np.int64)  # grouped rows back in slot order
    by_slot[read_array(tmp_path, "sorted", np.int32, -1)] = np.arange(tokens * top_k)
    out = {name: read_array(tmp_path, name, np.uint16, (-1, n)) for name in ("mma", "groups", "dense_mma",
                                                                          "dense_groups")}
    grouped = np.stack([x[slot // top_k] @ reference[e].T for slot, e in enumerate(ids.reshape(-1))])
    if CASES[case].get("GROUPS_FUSE_SILU"):  # gate_up + SiLU·mul: [rows, N / 2] (held in the first N / 2 columns)
        half = n // 2
        for name, mma in (("groups", "mma"), ("dense_groups", "dense_mma")):
            unfused = out[mma][by_slot] if name == "groups" else out[mma]
            gate, up = unfused[:, :half], unfused[:, half:]
            want = bf16(bf16(gate / (1 + np.exp(-gate))) * up)  # elementwise silu_mul of moe_gemv_mma's rows
            got = read_array(tmp_path, name, np.uint16, -1)[:want.size].reshape(want.shape)
            got = got[by_slot] if name == "groups" else got
            assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-2, name
        return
    for name, want in (("groups", grouped), ("mma", grouped), ("dense_groups", x @ reference[0].T)):
        got = out[name][by_slot] if name in ("groups", "mma") else out[name]
        assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-2, name
    for name, mma in (("groups", "mma"), ("dense_groups", "dense_mma")):
        assert float(np.linalg.norm(out[name] - out[mma]) / np.linalg.norm(out[mma])) < 5e-3, name
