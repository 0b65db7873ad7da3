"""The GPU decode GEMV's tiled INT4 layout (core/quant.py ``tile_int4``, moe.cu INT4_TILED): the
repack and its inverse, and moe.cu's INT4 kernels compiled with g++ against the host stand-in for
the CUDA built-ins (tests/helpers/cuda_host) reading tiled weights: the same bits as on the
checkpoint layout (same products in the same order) and the NumPy product within bf16 rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import bf16_to_float32, float32_to_bf16
from openinfer.quant import (
    dequantize_int4_group,
    int4_tiling_fits,
    quantize_int4_group,
    tile_int4,
    untile_int4,
)
from tests.helpers.cuda_emulation import bf16, compile_harness, read_array, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "int4_tiled_harness.cpp"
OUTPUTS = ("tiles", "gemv", "wide", "mma", "dense_tiles", "dense_wide", "dense_mma")


def test_tile_int4_round_trip_and_index():
    rng = np.random.default_rng(1)
    experts, n, k = 2, 48, 384
    words = rng.integers(-2**31, 2**31 - 1, (experts, n, k // 8)).astype(np.int32)
    scales = rng.integers(0, 2**16, (experts, n, k // 32)).astype(np.uint16)
    tiled_words, tiled_scales = tile_int4(words, scales)
    assert tiled_words.shape == (experts, n // 16, k // 128, 256) and tiled_scales.shape == (experts, n // 16, k // 128, 64)
    flat_words, flat_scales = tiled_words.reshape(-1), tiled_scales.reshape(-1)
    for e, row, col in [(0, 0, 0), (1, 47, 376), (0, 9, 136), (1, 23, 264), (0, 31, 96)]:
        chunk = (e * (n // 16) + row // 16) * (k // 128) + col // 128  # moe.cu int4_word_index / int4_scale_index
        word = ((chunk * 2 + (row >> 3) % 2) * 8 + row % 8) * 16 + (col >> 3) % 4 * 4 + (col >> 5) % 4
        scale = ((chunk * 8 + row % 8) * 2 + (row >> 3) % 2) * 4 + (col >> 5) % 4
        assert flat_words[word] == words[e, row, col // 8] and flat_scales[scale] == scales[e, row, col // 32]
    back = untile_int4(tiled_words, tiled_scales, n, k)
    assert np.array_equal(back[0], words) and np.array_equal(back[1], scales)


def test_tile_int4_refuses_shapes_it_cannot_hold():
    assert int4_tiling_fits(4096, 7168, 32) and not int4_tiling_fits(40, 256, 32)
    assert not int4_tiling_fits(48, 192, 32) and not int4_tiling_fits(48, 256, 64)
    with pytest.raises(ValueError, match="no tiled INT4 layout"):
        tile_int4(np.zeros((1, 40, 32), np.int32), np.zeros((1, 40, 8), np.uint16))


# moe.cu defines per case: moe_gemv_mma as shipped, with a ring of 3 chunks, with K split over two
# warps (N = 48: the second block's last two warps lie past N); moe_gemv_int4_tiled (K = 384: three
# chunks) with one n-tile and a register ring of 4 (never full), two n-tiles and a ring of 2 (wraps),
# and its shared-memory ring of 2 stages (wraps); the first and last with each warp's stream rotated;
# "rows2": each warp two row blocks as one stream (N = 48: the second warp a lone last block), a ring of 5
CASES = {"mma": {"TILED_NTILES": 1, "TILED_DEPTH": 4, "TILED_ROTATE": 1},
         # gate_up with SiLU·mul fused (N = 48: I = 24 is not whole 16-row blocks, so N = 64 here)
         "silu": {"TILED_NTILES": 1, "TILED_DEPTH": 4, "TILED_ROTATE": 1, "TILED_FUSE_SILU": 1},
         "rows2": {"TILED_NTILES": 1, "TILED_DEPTH": 5, "TILED_ROTATE": 1, "TILED_ROW_BLOCKS": 2},
         # moe_gemv_int4_tiled_pair: two row blocks per warp side by side (N = 48: a lone last block)
         "pair": {"TILED_NTILES": 1, "TILED_DEPTH": 3, "TILED_ROTATE": 1, "TILED_PAIR": 1},
         "mma-depth3": {"MMA_GEMV_DEPTH": 3, "TILED_NTILES": 2, "TILED_DEPTH": 2},
         "mma-split2": {"MMA_GEMV_KSPLIT": 2, "TILED_NTILES": 2, "TILED_STAGES": 2, "TILED_ROTATE": 1}}


@pytest.mark.parametrize("case", list(CASES))
def test_int4_kernels_read_the_tiled_layout(tmp_path, case):
    rng = np.random.default_rng(len(case))
    silu = bool(CASES[case].get("TILED_FUSE_SILU"))
    experts, top_k, tokens, n, k = 3, 2, 12, 64 if silu else 48, 384
    dense = [bf16(0.08 * rng.standard_normal((n, k))) for _ in range(experts)]
    packed = [quantize_int4_group(w, 32) for w in dense]
    words = np.stack([p for p, _ in packed])
    scales = np.stack([float32_to_bf16(s) for _, s in packed])
    reference_weights = np.stack([dequantize_int4_group(p, bf16_to_float32(s), (n, k))
                                  for (p, _), s in zip(packed, scales, strict=True)])
    x = bf16(rng.standard_normal((tokens, k)))
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    outputs = {}
    for tiled in (0, 1):
        folder = tmp_path / f"tiled{tiled}"
        folder.mkdir()
        binary = compile_harness(HARNESS, REPO / "core" / "kernels", folder / "int4", {
            "USE_MMA": 0, "WEIGHT_FORMAT": 1, "GROUP": 32, "INT4_TILED": tiled, **CASES[case]})
        w, s = tile_int4(words, scales) if tiled else (words, scales)
        run_harness(binary, folder, params=np.array([tokens, experts, top_k, n, k], np.int32),
                    x=float32_to_bf16(x), ids=ids, w=w, s=s)
        outputs[tiled] = {name: read_array(folder, name, np.uint16, (-1, n)) for name in OUTPUTS}
        outputs[tiled]["w0"] = read_array(folder, "w0", np.uint16, (n, k))
        if tiled and silu:
            outputs[tiled]["tiled_silu"] = read_array(folder, "tiled_silu", np.uint16, (-1, n // 2))
        elif tiled:
            outputs[tiled]["tiled"] = read_array(folder, "tiled", np.uint16, (-1, n))
            outputs[tiled]["dense_tiled"] = read_array(folder, "dense_tiled", np.uint16, (-1, n))
        # grouped rows back in slot order (the order inside an expert's segment is the atomics')
        by_slot = np.empty(tokens * top_k, np.int64)
        by_slot[read_array(folder, "sorted", np.int32, -1)] = np.arange(tokens * top_k)
        for name in ("tiles", "gemv", "wide", "mma", "tiled_silu" if silu else "tiled")[:4 + tiled]:
            outputs[tiled][name] = outputs[tiled][name][by_slot]
    for name in (*OUTPUTS, "w0"):  # the same values in the same order: the same bits
        assert np.array_equal(outputs[1][name], outputs[0][name]), name
    assert np.array_equal(outputs[1]["w0"], bf16(reference_weights[0]))
    grouped = np.stack([x[slot // top_k] @ reference_weights[e].T for slot, e in enumerate(ids.reshape(-1))])
    if silu:  # elementwise silu_mul of the rows layout's GEMV: fp32 rounding apart (scales after the mma)
        gate, up = outputs[1]["mma"][:, :n // 2], outputs[1]["mma"][:, n // 2:]
        want = bf16(bf16(gate / (1 + np.exp(-gate))) * up)
        got = outputs[1]["tiled_silu"]
        assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-2
        return
    for name in ("tiles", "gemv", "wide", "mma", "tiled"):
        got = outputs[1][name]
        assert float(np.linalg.norm(got - grouped) / np.linalg.norm(grouped)) < 1e-2, name
    # moe_gemv_int4_tiled: scales after the mma, so fp32 rounding apart from moe_gemv_mma
    for name, mma in (("tiled", "mma"), ("dense_tiled", "dense_mma")):
        assert float(np.linalg.norm(outputs[1][name] - outputs[1][mma]) / np.linalg.norm(outputs[1][mma])) < 5e-3
    for name in ("dense_tiles", "dense_wide", "dense_mma", "dense_tiled"):
        want = x @ reference_weights[0].T
        got = outputs[1][name]
        assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-2, name
