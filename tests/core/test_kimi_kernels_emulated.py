"""core's MoE (``kernels/moe.cu``, plain-FMA build USE_MMA=0) and MLA (``kernels/mla.cu``) CUDA
sources compiled with g++ against a host stand-in for the CUDA built-ins (tests/helpers/cuda_host)
and run on the CPU against the NumPy references: checks routing, grouping, tile schedule, the
in-kernel dequantisation of bf16 / INT4 / FP8 weights, the combine, the latent write and the
absorbed attention's indexing in CI, where there is no GPU. The tensor-core path, launch glue and
speed are covered by the ``gpu`` tests (tests/gpu/test_kimi_ops.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import RotaryEmbedding, bf16_to_float32, float32_to_bf16
from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.mla import rotate_half_rope
from openinfer.moe import ExpertWeights, RouterSpec, group_by_expert, route, run_experts
from openinfer.quant import (
    dequantize_fp8_block,
    dequantize_int4_group,
    quantize_fp8_block,
    quantize_int4_group,
)
from openinfer.rope import RopeParameters
from tests.helpers.cuda_emulation import bf16, compile_harness, read_array, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "harness.cpp"
REF = NumpyBackend()
FORMATS = {"bf16": 0, "int4": 1, "fp8": 2}


def build(tmp: Path, name: str, defines: dict[str, int]) -> Path:
    return compile_harness(HARNESS, REPO / "core" / "kernels", tmp / name, defines)


def relative_error(ours, reference) -> float:
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def stored_weights(rng, fmt: str, experts: int, out_features: int, in_features: int, group: int = 32):
    """(bytes as the kernel reads them, scale bytes, fp32 dequantized [E, N, K])."""
    dense = [bf16(0.08 * rng.standard_normal((out_features, in_features))) for _ in range(experts)]
    if fmt == "bf16":
        return np.stack([float32_to_bf16(w) for w in dense]), np.zeros(0, np.uint8), np.stack(dense)
    if fmt == "int4":
        packed = [quantize_int4_group(w, group) for w in dense]
        scales = np.stack([float32_to_bf16(s) for _, s in packed])
        deq = np.stack([dequantize_int4_group(p, bf16_to_float32(s), (out_features, in_features))
                        for (p, _), s in zip(packed, scales, strict=True)])
        return np.stack([p for p, _ in packed]), scales, deq
    codes = [quantize_fp8_block(w) for w in dense]
    return (np.stack([c for c, _ in codes]), np.stack([s for _, s in codes]),
            np.stack([dequantize_fp8_block(c, s) for c, s in codes]))


CASES = {
    # format, router: group-limited sigmoid with a dominant expert (> one 64-row tile), softmax, sqrt-softplus
    "bf16-sigmoid-groups": ("bf16", RouterSpec(6, 2, "sigmoid", num_groups=3, topk_groups=2,
                                               routed_scaling_factor=2.5)),
    "int4-softmax": ("int4", RouterSpec(6, 2, "softmax", norm_topk_prob=False)),
    "fp8-sqrtsoftplus": ("fp8", RouterSpec(6, 2, "sqrtsoftplus", routed_scaling_factor=1.5)),
    # INT4 groups of 16: smaller than moe_gemv_wide's 32-weight chunk (a scale per 8-weight piece)
    "int4-group16-sigmoid": ("int4", RouterSpec(6, 2, "sigmoid")),
    # moe_gemv_mma with a ring of 3 chunks per lane: gate_up's K = 320 is ten 32-weight bf16 chunks
    # (four turns of the ring, the last partly empty), down's 64 two (the ring never fills); the ring
    # does not depend on the format (GPU tests: INT4 / FP8 / bf16 at K = 1152). moe_router_logits
    # with 2 loads per lane in flight: the second one past K = 320 for most lanes
    "bf16-mma-depth3": ("bf16", RouterSpec(6, 2, "softmax")),
    # moe_gemv_mma with K split over the block's warps (summed in shared memory): INT4 with K = 320,
    # three 128-weight chunks over 4 slices (one slice empty) and the last chunk partial; down's
    # K = 64 is one chunk (three slices empty); two slices with a ring of 3 on FP8
    "int4-mma-split4": ("int4", RouterSpec(6, 2, "sigmoid")),
    "fp8-mma-split2-depth3": ("fp8", RouterSpec(6, 2, "softmax")),
    # moe_gemv_mma_staged (INT4 group 32): K = 1024 in four 2-chunk stages through a ring of 2
    "int4-mma-staged": ("int4", RouterSpec(6, 2, "sigmoid")),
    # moe_grouped_gemm_pipelined (bf16): gate_up K = 96 (a 64-wide k-tile and a half one) through a
    # ring of 3, N = 144 (a 128-row block and a 16-row one); down K = 72, N = 96; fused SiLU·mul with
    # I = 72 (a 64-column block and an 8-column one) through a ring of 2
    "bf16-pipelined": ("bf16", RouterSpec(6, 2, "sigmoid")),
    "bf16-pipelined-fused": ("bf16", RouterSpec(6, 2, "softmax")),
    # the 256 x 32 block shape: K = 96 in three k-tiles, N = 144 and I = 72 in one partial block each
    "bf16-pipelined-n256-fused": ("bf16", RouterSpec(6, 2, "sigmoid")),
    # the 64 x 64 block shape: N = 144 in three blocks (the last 16 rows), I = 72 in three
    "bf16-pipelined-n64-fused": ("bf16", RouterSpec(6, 2, "softmax")),
}
# (hidden, moe_intermediate, extra moe.cu defines) where a case departs from the default shape
CASE_SHAPES = {"bf16-mma-depth3": (320, 64, {"MMA_GEMV_DEPTH": 3}),
               "int4-mma-split4": (320, 64, {"MMA_GEMV_KSPLIT": 4}),
               "fp8-mma-split2-depth3": (320, 64, {"MMA_GEMV_KSPLIT": 2, "MMA_GEMV_DEPTH": 3}),
               "int4-mma-staged": (1024, 64, {"STAGED_CHUNKS": 2, "STAGED_STAGES": 2}),
               "bf16-pipelined": (96, 72, {"PIPE_STAGES": 3}),
               "bf16-pipelined-fused": (96, 72, {"PIPE_STAGES": 2, "PIPE_FUSE_SILU": 1}),
               "bf16-pipelined-n256-fused": (96, 72, {"PIPE_STAGES": 4, "PIPE_FUSE_SILU": 1, "PIPE_WARP_N8": 8,
                                                       "PIPE_TILE_K": 32}),
               "bf16-pipelined-n64-fused": (96, 72, {"PIPE_STAGES": 4, "PIPE_FUSE_SILU": 1, "PIPE_WARP_N8": 2})}


def sort_layout(flat: np.ndarray, num_experts: int, slots: int, tiles: int) -> dict[str, np.ndarray]:
    """The harness's flat copy of a moe_sort layout, split into its arrays (tile lists cut to the count)."""
    parts, at = {}, 0
    for name, size in (("offsets", num_experts + 1), ("sorted", slots), ("pos", slots), ("tile_expert", tiles),
                       ("tile_row", tiles), ("num_tiles", 1)):
        parts[name] = flat[at:at + size]
        at += size
    count = int(parts["num_tiles"][0])
    parts["tile_expert"], parts["tile_row"] = parts["tile_expert"][:count], parts["tile_row"][:count]
    return parts


@pytest.mark.parametrize("case", list(CASES))
def test_moe_kernels_match_numpy(tmp_path, case):
    fmt, spec = CASES[case]
    group = 16 if "group16" in case else 32
    rng = np.random.default_rng(len(case))
    hidden, inter, defines = CASE_SHAPES.get(case, (96, 64, {}))  # N of down = 96: ragged against 64-wide tiles
    tokens = 70
    binary = build(tmp_path, "moe", {"MOE": 1, "USE_MMA": 0, "WEIGHT_FORMAT": FORMATS[fmt], "GROUP": group,
                                     "FP8_BLOCK": 128, **defines})
    x = bf16(rng.standard_normal((tokens, hidden)))
    gate = bf16(0.2 * rng.standard_normal((spec.num_experts, hidden)))
    bias = np.zeros(spec.num_experts, np.float32)
    bias[0] = 3.0  # expert 0 takes nearly every token: two tiles
    use_bias = spec.scoring != "softmax"
    w1, s1, w1_ref = stored_weights(rng, fmt, spec.num_experts, 2 * inter, hidden, group)
    w2, s2, w2_ref = stored_weights(rng, fmt, spec.num_experts, hidden, inter, group)
    params = [tokens, hidden, spec.num_experts, spec.top_k, {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}[spec.scoring],
              spec.num_groups, spec.topk_groups, int(spec.group_score == "max"), int(spec.norm_topk_prob),
              2 * inter, hidden, inter, int(use_bias)]
    run_harness(binary, tmp_path, **{"params": np.array(params, np.int32), "scaling": np.array([spec.routed_scaling_factor], np.float32),
             "x": float32_to_bf16(x), "gate": float32_to_bf16(gate), "bias": bias, "w1": w1, "s1": s1, "w2": w2,
             "s2": s2})
    ids = read_array(tmp_path, "ids", np.int32, (tokens, spec.top_k))
    weights = read_array(tmp_path, "weights", np.float32, (tokens, spec.top_k))
    # moe_router_logits + moe_route picks what moe_route alone picks (same order, same weights)
    assert np.array_equal(read_array(tmp_path, "inline_ids", np.int32, ids.shape), ids)
    assert np.allclose(read_array(tmp_path, "inline_weights", np.float32, ids.shape), weights, rtol=1e-5, atol=1e-6)
    ref_weights, ref_ids = route(x @ gate.T, spec, bias if use_bias else None)
    order, ref_order = np.argsort(ids, 1), np.argsort(ref_ids, 1)
    assert np.array_equal(np.take_along_axis(ids, order, 1), np.take_along_axis(ref_ids, ref_order, 1))
    assert np.allclose(np.take_along_axis(weights, order, 1), np.take_along_axis(ref_weights, ref_order, 1),
                       rtol=1e-5, atol=1e-6)
    offsets = read_array(tmp_path, "offsets", np.int32, -1)
    assert np.array_equal(np.diff(offsets), np.bincount(ref_ids.reshape(-1), minlength=spec.num_experts))
    # moe_sort_parallel: moe_sort's offsets and tile list; each expert's segment holds its slots
    slots, tiles = tokens * spec.top_k, -(-tokens * spec.top_k // 64) + min(spec.num_experts, tokens * spec.top_k)
    serial = sort_layout(read_array(tmp_path, "serial_sort", np.int32, -1), spec.num_experts, slots, tiles)
    flat_ids = ids.reshape(-1)
    for threads in (4, 256):
        layout = sort_layout(read_array(tmp_path, f"parallel_sort_{threads}", np.int32, -1), spec.num_experts,
                             slots, tiles)
        for name in ("offsets", "tile_expert", "tile_row", "num_tiles"):
            assert np.array_equal(layout[name], serial[name]), (threads, name)
        assert np.array_equal(layout["pos"][layout["sorted"]], np.arange(slots))
        for e in range(spec.num_experts):
            segment = layout["sorted"][offsets[e]:offsets[e + 1]]
            assert np.all(flat_ids[segment] == e)
    # moe_expert_counts + moe_place_slots: the same offsets and tile list; each expert's slots in slot order
    for threads in (32, 64):
        layout = sort_layout(read_array(tmp_path, f"block_sort_{threads}", np.int32, -1), spec.num_experts,
                             slots, tiles)
        for name in ("offsets", "tile_expert", "tile_row", "num_tiles"):
            assert np.array_equal(layout[name], serial[name]), (threads, name)
        for e in range(spec.num_experts):
            assert np.array_equal(layout["sorted"][offsets[e]:offsets[e + 1]], np.flatnonzero(flat_ids == e))
        assert np.array_equal(layout["pos"][layout["sorted"]], np.arange(slots))
    if use_bias:
        assert offsets[1] > 64
    out = read_array(tmp_path, "out", np.uint16, (tokens, hidden))
    assert np.array_equal(read_array(tmp_path, "out_wide", np.uint16, out.shape), out)  # combine over 3 blocks
    experts = [ExpertWeights(REF.linear_weight(w1_ref[e]), REF.linear_weight(w2_ref[e]))
               for e in range(spec.num_experts)]
    reference = run_experts(REF, x, ref_weights, group_by_expert(ref_ids, spec.num_experts), experts)
    assert relative_error(out, reference) < 2e-2
    dense = read_array(tmp_path, "dense", np.uint16, (tokens, 2 * inter))
    assert relative_error(dense, x @ w1_ref[0].T) < 1e-2
    # decode kernels: moe_gemv on the grouped GEMM's tiles and in dense mode; moe_dequantize
    h = read_array(tmp_path, "h", np.uint16, (tokens * spec.top_k, 2 * inter))
    assert relative_error(read_array(tmp_path, "h_gemv", np.uint16, h.shape), h) < 1e-2
    assert relative_error(read_array(tmp_path, "dense_gemv", np.uint16, dense.shape), x @ w1_ref[0].T) < 1e-2
    # moe_gemv_wide: the same products (bf16 rounding apart) on the tiles and in dense mode
    assert relative_error(read_array(tmp_path, "h_gemv_wide", np.uint16, h.shape), h) < 1e-2
    assert relative_error(read_array(tmp_path, "dense_gemv_wide", np.uint16, dense.shape), x @ w1_ref[0].T) < 1e-2
    # moe_gemv_mma (tensor cores via the warp stand-in): the tiles (a 64-row tile in several passes),
    # dense mode over all 70 rows, and 8 columns fewer (a warp's 16 columns past N); weights
    # dequantised as the tiles kernel rounds them, so only the summation order differs
    assert relative_error(read_array(tmp_path, "h_gemv_mma", np.uint16, h.shape), h) < 1e-2
    assert relative_error(read_array(tmp_path, "dense_gemv_mma", np.uint16, dense.shape), dense) < 1e-2
    narrow = read_array(tmp_path, "narrow_gemv_mma", np.uint16, (tokens, 2 * inter - 8))
    assert relative_error(narrow, dense[:, :-8]) < 1e-2
    assert relative_error(read_array(tmp_path, "w1_bf16", np.uint16, w1_ref[0].shape), w1_ref[0]) < 4e-3
    if "pipelined" in case:  # tensor cores (the warp stand-in) vs the plain-FMA tiles: summation order apart
        act = read_array(tmp_path, "act", np.uint16, (tokens * spec.top_k, inter))
        if "fused" in case:
            assert relative_error(read_array(tmp_path, "h_pipe", np.uint16, act.shape), act) < 1e-2
        else:
            assert relative_error(read_array(tmp_path, "h_pipe", np.uint16, h.shape), h) < 1e-2
            y = read_array(tmp_path, "y", np.uint16, (tokens * spec.top_k, hidden))
            assert relative_error(read_array(tmp_path, "y_pipe", np.uint16, y.shape), y) < 1e-2
    if "staged" in case:  # the same chunks in the same k order as moe_gemv_mma: the same bits
        assert np.array_equal(read_array(tmp_path, "h_gemv_staged", np.uint16, h.shape),
                              read_array(tmp_path, "h_gemv_mma", np.uint16, h.shape))
        assert np.array_equal(read_array(tmp_path, "dense_gemv_staged", np.uint16, dense.shape),
                              read_array(tmp_path, "dense_gemv_mma", np.uint16, dense.shape))


# (splits, mla_attention_mma's tiles by cp.async, long contexts): a long context of 72 has three
# non-empty 32-key splits, one of 41 two and an empty third (left at once under async tiles)
MLA_CASES = {"splits1": (1, False, False), "splits3": (3, False, False), "async-splits1": (1, True, False),
             "async-splits3-long": (3, True, True), "heads16-async-splits3-long": (3, True, True)}


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_kernels_match_numpy(tmp_path, case):
    splits, async_tiles, long_contexts = MLA_CASES[case]
    rng = np.random.default_rng(0)
    lora, rope_dim, nope, heads = 32, 16, 16, 20  # 20 heads: a partial 16-head chunk
    block_size = 16 if long_contexts else 4
    # heads16: mla_attention_mma's blocks of 16 heads (20 heads: 16 + a partial 4), a warp per output quarter
    binary = build(tmp_path, "mla", {"MLA": 1, "KV_LORA": lora, "ROPE_DIM": rope_dim, "MLA_ASYNC_TILES": int(async_tiles),
                                     "MLA_HEADS16": int("heads16" in case)})
    latent_dim, q_stride = lora + rope_dim, nope + rope_dim
    # fresh prompt, decodes, a chunk on cached context
    cached, new = ([0, 40, 70, 13] if long_contexts else [0, 4, 7, 13]), [5, 1, 1, 3]
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new, strict=True)]).astype(np.int32)
    tokens, num_blocks = len(positions), 16
    tables = np.zeros((4, 5), np.int32)
    free = iter(rng.permutation(np.arange(1, num_blocks)))
    for s, total in enumerate(np.add(cached, new)):
        for b in range(-(-total // block_size)):
            tables[s, b] = next(free)
    seq_of = np.repeat(np.arange(4), new)
    slots = (tables[seq_of, positions // block_size] * block_size + positions % block_size).astype(np.int32)
    query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    cache = bf16(rng.standard_normal((num_blocks, block_size, latent_dim)))
    latent = bf16(rng.standard_normal((tokens, latent_dim)))
    norm = bf16(1 + 0.2 * rng.standard_normal(lora))
    q = bf16(rng.standard_normal((tokens, heads, q_stride)))
    q_latent = bf16(rng.standard_normal((tokens, heads, lora)))
    rope = RotaryEmbedding.create(rope_dim, RopeParameters(10000.0), 128)
    scale = 0.17
    run_harness(binary, tmp_path, **{"params": np.array([tokens, heads, q_stride, nope, 4, tables.shape[1], block_size, splits], np.int32),
             "scale": np.array([scale], np.float32), "latent": float32_to_bf16(latent), "norm": float32_to_bf16(norm),
             "q": float32_to_bf16(q), "q_latent": float32_to_bf16(q_latent), "cache": float32_to_bf16(cache),
             "positions": positions, "slots": slots, "tables": tables, "query_start": query_start,
             "cos": rope.cos, "sin": rope.sin})
    # reference: latent write, q rope, absorbed attention per token over its causal context
    cos, sin = rope.cos[positions], rope.sin[positions]
    ref_cache = cache.reshape(-1, latent_dim).copy()
    ref_cache[slots] = np.concatenate([REF.rms_norm(latent[:, :lora], norm, 1e-6),
                                       rotate_half_rope(latent[:, None, lora:], cos, sin)[:, 0]], -1)
    q_rot = q.copy()
    q_rot[..., nope:] = rotate_half_rope(q[..., nope:], cos, sin)
    reference = np.empty((tokens, heads, lora), np.float32)
    for t in range(tokens):
        context_pos = np.arange(positions[t] + 1)
        rows = ref_cache[tables[seq_of[t], context_pos // block_size] * block_size + context_pos % block_size]
        scores = (q_latent[t] @ rows[:, :lora].T + q_rot[t, :, nope:] @ rows[:, lora:].T) * scale
        p = np.exp(scores - scores.max(-1, keepdims=True))
        reference[t] = (p / p.sum(-1, keepdims=True)) @ rows[:, :lora]
    cache_out = read_array(tmp_path, "cache_out", np.uint16, (-1, latent_dim))
    assert relative_error(cache_out[slots], ref_cache[slots]) < 1e-2
    untouched = np.setdiff1d(np.arange(len(ref_cache)), slots)
    assert np.array_equal(cache_out[untouched], ref_cache[untouched])
    q_out = read_array(tmp_path, "q_out", np.uint16, (tokens, heads, q_stride))
    assert relative_error(q_out, q_rot) < 1e-2
    out = read_array(tmp_path, "out", np.uint16, (tokens, heads, lora))
    assert relative_error(out, reference) < 2e-2
    # mla_attention_mma (tensor cores; bf16 probabilities) on the same step
    out_mma = read_array(tmp_path, "out_mma", np.uint16, (tokens, heads, lora))
    assert relative_error(out_mma, reference) < 2e-2
    # mla_combine_splits_shared: the same bits from the same partials
    assert np.array_equal(read_array(tmp_path, "out_mma_shared", np.uint16, out_mma.shape), out_mma)



# (rows, context splits): one decode row over 33 splits (three 16-split chunks, the last ragged), 3 rows over 5,
# the row cap of 16 over 20
COMBINE_EXPAND_CASES = [(1, 33), (3, 5), (16, 20), (1, 64), (4, 64)]  # 64: lanes past the first 32 splits


@pytest.mark.parametrize("columns", [16, 32, 64])
@pytest.mark.parametrize(("tokens", "splits"), COMBINE_EXPAND_CASES)
def test_mla_combine_expand_bit_equal_to_combine_then_expand(tmp_path, columns, tokens, splits):
    """mla_combine_expand (each column block merging its head's splits into shared memory, then W_UV on the mma
    stand-in) writes the bits of mla_combine_splits_flat followed by mla_expand_small, at each column count; with
    empty splits scattered (none in some rows, all but one in others), a row with none at all and rows written
    whole by their one split (split 0's max = +inf: read from o_latent). Kimi-K2's latent 512 and v 128."""
    rng = np.random.default_rng(tokens * 100 + columns)
    heads, lora, v = 3, 512, 128
    binary = build(tmp_path, f"combine_expand{columns}", {"MLA_COMBINE_EXPAND": 1, "COMBINE_EXPAND_COLUMNS": columns})
    partial_o = rng.standard_normal((tokens, heads, splits, lora)).astype(np.float32)
    maxima = (3 * rng.standard_normal((tokens, heads, splits))).astype(np.float32)
    sums = rng.uniform(0.5, 4.0, (tokens, heads, splits)).astype(np.float32)
    empty = rng.random((tokens, heads, splits)) < 0.3
    empty[0, 0] = True  # a row with no keys at all: zeros
    empty[-1, 1] = np.arange(splits) != splits // 2  # one non-empty split, mid-row
    maxima[empty], sums[empty] = -np.inf, 0.0  # as the attention kernels leave an empty split
    whole = rng.random((tokens, heads)) < 0.25  # rows a single split wrote whole
    whole[0, 0] = whole[-1, 1] = False
    whole[-1, 2] = True
    maxima[whole, 0] = np.inf
    partial_ml = np.stack([maxima, sums], -1)
    o_latent = bf16(rng.standard_normal((tokens, heads, lora)))
    w_uv = bf16(0.05 * rng.standard_normal((heads, v, lora)))
    run_harness(binary, tmp_path, params=np.array([tokens, heads, splits], np.int32), partial_o=partial_o,
                partial_ml=partial_ml, o_latent=float32_to_bf16(o_latent), w_uv=float32_to_bf16(w_uv))
    out_bits = np.fromfile(tmp_path / "out.bin", np.uint16)
    assert np.array_equal(np.fromfile(tmp_path / "out_fused.bin", np.uint16), out_bits)
    # and the pair itself against NumPy: the merged rows (o_latent's where written whole), then W_UV
    with np.errstate(invalid="ignore", divide="ignore"):
        weights = np.where(empty, 0.0, np.exp(maxima - maxima.max(-1, keepdims=True, initial=-np.inf,
                                                                    where=~empty)) * sums)
        merged = (weights[..., None] * partial_o).sum(2) / weights.sum(-1)[..., None]
    merged = np.where(whole[..., None], o_latent, np.nan_to_num(merged))
    combined = read_array(tmp_path, "combined", np.uint16, (tokens, heads, lora))
    assert np.array_equal(combined[whole], o_latent[whole])
    assert np.array_equal(combined[0, 0], np.zeros(lora, np.float32))
    assert relative_error(combined, merged) < 1e-2
    out = read_array(tmp_path, "out", np.uint16, (tokens, heads, v))
    assert relative_error(out, np.einsum("thl,hvl->thv", combined, w_uv)) < 1e-2

def test_mla_decompressed_prefill_matches_numpy(tmp_path):
    """The decompressed prefill (context gather + tensor-core flash attention, mma emulated per
    warp) against ``mla_naive``: a fresh 70-token prompt (a full and a partial 64-query tile), a
    20-token chunk on 45 cached tokens, a decode beside them (left to the absorbed form), 16-token
    paged blocks in shuffled order."""
    from openinfer.backend.base import ForwardBatch
    from openinfer.mla import MLASpec, MLAWeights, decompressed_prefill_layout, mla_naive

    rng = np.random.default_rng(5)
    spec = MLASpec(num_heads=3, qk_nope_dim=16, qk_rope_dim=16, v_head_dim=16, kv_lora_rank=32, scale=0.21)
    block_size, num_blocks = 16, 20
    cached, new = [0, 45, 9], [70, 20, 1]
    contexts = np.add(cached, new)
    tables = np.zeros((3, 6), np.int32)
    free = iter(rng.permutation(np.arange(1, num_blocks)))
    for s, total in enumerate(contexts):
        for b in range(-(-total // block_size)):
            tables[s, b] = next(free)
    query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    tokens = int(query_start[-1])
    batch = ForwardBatch(token_ids=np.zeros(tokens, np.int32),
                         positions=np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new, strict=True)]),
                         query_start=query_start, context_lens=contexts.astype(np.int32), block_tables=tables,
                         slot_mapping=np.zeros(tokens, np.int32), logits_rows=np.zeros(0, np.int32),
                         max_query_len=70, max_context_len=int(contexts.max()))
    layout = decompressed_prefill_layout(batch, spec, min_query=16, scratch_bytes=1 << 30)
    assert layout is not None and list(layout.seqs[:, 0]) == [0, 1] and list(layout.absorbed_rows) == [90]
    cache = bf16(rng.standard_normal((num_blocks, block_size, spec.latent_dim)))
    kv_b = bf16(0.2 * rng.standard_normal((spec.num_heads * (spec.qk_nope_dim + spec.v_head_dim), spec.kv_lora_rank)))
    weights = MLAWeights.from_kv_b(kv_b, spec)
    q = bf16(rng.standard_normal((tokens, spec.num_heads, spec.qk_head_dim)))
    contexts_rows = [cache[tables[s, np.arange(contexts[s]) // block_size], np.arange(contexts[s]) % block_size]
                     for s in (0, 1)]
    c_kv = np.concatenate(contexts_rows)[:, :spec.kv_lora_rank]
    k_nope = bf16(np.einsum("cl,hdl->chd", c_kv, weights.w_uk))
    values = bf16(np.einsum("cl,hdl->chd", c_kv, weights.w_uv))
    binary = build(tmp_path, "mla_prefill", {"MLA_PREFILL": 1, "KV_LORA": 32, "ROPE_DIM": 16, "NOPE_DIM": 16,
                                             "V_DIM": 16})
    params = [tokens, spec.num_heads, len(layout.seqs), layout.context_rows, len(layout.tile_seq), tables.shape[1],
              block_size]
    run_harness(binary, tmp_path, params=np.array(params, np.int32), scale=np.array([spec.scale], np.float32),
                cache=float32_to_bf16(cache), tables=tables, seqs=layout.seqs, q=float32_to_bf16(q),
                k_nope=float32_to_bf16(k_nope), values=float32_to_bf16(values), tile_seq=layout.tile_seq,
                tile_query=layout.tile_query)
    gathered = np.concatenate(contexts_rows)
    assert np.array_equal(read_array(tmp_path, "c_kv", np.uint16, (-1, spec.kv_lora_rank)), gathered[:, :32])
    assert np.array_equal(read_array(tmp_path, "k_pe", np.uint16, (-1, spec.qk_rope_dim)), gathered[:, 32:])
    out = read_array(tmp_path, "out", np.uint16, (tokens, spec.num_heads, spec.v_head_dim))
    for s in (0, 1):
        rows = slice(query_start[s], query_start[s + 1])
        reference = mla_naive(q[rows], contexts_rows[s], weights, spec)
        assert relative_error(out[rows], reference) < 2e-2, s
