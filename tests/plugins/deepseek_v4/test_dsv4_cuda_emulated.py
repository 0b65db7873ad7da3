"""The CUDA kernels' own source (``kernels/dsv4.cu``) compiled with g++ against a host stand-in for
the CUDA built-ins and run on the CPU against the NumPy ops they mirror: checks the kernels'
indexing (block tables, ragged sequences, windows, the indexer's picks) and arithmetic in CI,
where there is no GPU. Launch glue (CuPy) and speed are the ``gpu`` tests' job."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from openinfer_deepseek_v4.attention import attend, index_scores, pool_entries, top_k_visible
from openinfer_deepseek_v4.hyper_connection import collapse, collapse_head, expand
from openinfer_deepseek_v4.rotary import InterleavedRope
from openinfer_deepseek_v4.weights import HyperConnectionWeights

from openinfer import float32_to_bf16
from openinfer.quant import (
    FP8_E4M3_MAX,
    dequantize_fp4_e2m1,
    dequantize_fp8_block,
    e8m0_to_float32,
    float32_to_fp8_e4m3,
    quantize_fp4_e2m1,
)
from tests.helpers.cuda_emulation import bf16, compile_harness, read_array, run_harness

HARNESS = Path(__file__).parent / "cuda_emulation" / "harness.cpp"
NEG_BIG = -3.0e38


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    kernels = Path(str(resources.files("openinfer_deepseek_v4") / "kernels"))
    return compile_harness(HARNESS, kernels, tmp_path_factory.mktemp("dsv4-harness") / "harness")


def run(harness: Path, directory: Path, kernel: str, *args, **arrays) -> None:
    run_harness(harness, directory, kernel, *args, timeout=300, **arrays)


def rope(rope_dim: int, theta: float = 10000.0) -> InterleavedRope:
    inv_freq = (1.0 / theta ** (np.arange(0, rope_dim, 2) / rope_dim)).astype(np.float32)
    return InterleavedRope(inv_freq, rope_dim)


def test_compress_entries(harness, tmp_path):
    rng = np.random.default_rng(0)
    windows, slots, dim, rope_dim, rows = 5, 8, 64, 16, 12
    kv = rng.standard_normal((windows, slots, dim)).astype(np.float32)
    gate = rng.standard_normal((windows, slots, dim)).astype(np.float32)
    gate[0, :4] = NEG_BIG  # CSA's first entry: no previous window
    norm = (1 + 0.2 * rng.standard_normal(dim)).astype(np.float32)
    positions = (np.arange(windows) * 4 + 8).astype(np.int32)
    dest = np.array([7, 2, 9, 0, 11], np.int64)
    r = rope(rope_dim, 160000.0)
    run(harness, tmp_path, "compress", slots, dim, rope_dim, windows, rows, 1e-6, slot_kv=kv, slot_gate=gate,
        norm=norm, inv_freq=r.inv_freq, positions=positions, dest=dest)
    expected = pool_entries(kv, np.where(gate == NEG_BIG, -np.inf, gate), norm, positions, r, 1e-6)
    cache = read_array(tmp_path, "cache", np.uint16, (rows, dim))
    np.testing.assert_allclose(cache[dest], expected, rtol=1e-2, atol=1e-2)
    assert not cache[[1, 3, 4, 5, 6, 8, 10]].any()  # nothing else written


def paged(rng: np.random.Generator, lengths: list[int], width: int, block_size: int):
    """Per-sequence rows scattered over shuffled blocks: (cache, tables, per-sequence rows)."""
    blocks = [-(-n // block_size) for n in lengths]
    ids = rng.permutation(np.arange(1, 1 + sum(blocks)))
    stride = max(blocks)
    tables = np.zeros((len(lengths), stride), np.int32)
    cache = np.zeros((1 + sum(blocks), block_size, width), np.float32)
    values, used = [], 0
    for seq, n in enumerate(lengths):
        tables[seq, : blocks[seq]] = ids[used : used + blocks[seq]]
        used += blocks[seq]
        rows = bf16(rng.standard_normal((n, width)))
        for i in range(n):
            cache[tables[seq, i // block_size], i % block_size] = rows[i]
        values.append(rows)
    return cache.reshape(-1, width), tables, stride, values


@pytest.mark.parametrize("entries_per_block", [4, 16, 256])
def test_indexer_scores_and_top_k(harness, tmp_path, entries_per_block):
    rng = np.random.default_rng(1)
    heads, dim, rate, block_size, k = 8, 32, 4, 4, 5
    positions = np.array([3, 17, 40, 41, 42, 60, 5], np.int32)  # two sequences' queries, ragged
    token_seq = np.array([0, 0, 0, 0, 0, 1, 1], np.int32)
    lengths = [43 // rate, 61 // rate]
    keys, tables, stride, per_seq = paged(rng, lengths, dim, block_size)
    q = bf16(rng.standard_normal((len(positions), heads, dim)))
    weights = rng.standard_normal((len(positions), heads)).astype(np.float32)
    max_entries = max(lengths)
    run(harness, tmp_path, "indexer", len(positions), heads, dim, max_entries, rate, block_size, stride, k,
        entries_per_block,
        q=float32_to_bf16(q), head_weights=weights, keys=float32_to_bf16(keys), tables=tables,
        token_seq=token_seq, positions=positions)
    scores = read_array(tmp_path, "scores", np.float32, (len(positions), max_entries))
    selected = read_array(tmp_path, "selected", np.int32, (len(positions), k))
    for t, (p, seq) in enumerate(zip(positions, token_seq, strict=True)):
        visible = (p + 1) // rate
        expected = index_scores(q[t : t + 1], per_seq[seq][:visible], weights[t : t + 1])[0]
        np.testing.assert_allclose(scores[t, :visible], expected, rtol=1e-5, atol=1e-5)
        assert (scores[t, visible:] == NEG_BIG).all()
        mask = np.arange(visible)[None, :] < visible
        want = set(np.flatnonzero(top_k_visible(expected[None], mask, min(k, visible))[0]).tolist()) \
            if visible else set()
        got = selected[t]
        assert (got >= -1).all()  # every slot written (the launcher does not pre-fill them)
        assert set(got[got >= 0].tolist()) == want and (got < 0).sum() == k - len(want)


@pytest.mark.parametrize("dim", [64, 512], ids=["generic", "d512"])
@pytest.mark.parametrize("splits", [1, 3], ids=["one-run", "split-3"])
@pytest.mark.parametrize("mode", ["sliding", "hca", "csa"])
def test_sparse_attention(harness, tmp_path, mode, splits, dim):
    """Split over keys (3 runs, some of them empty for the short rows, the sink in run 0 only)
    and merged by dsv4_attention_combine equals the one-run kernel's reference too; head_dim 512
    runs the kernel specialised for it (dsv4_sparse_attention_d512)."""
    rng = np.random.default_rng({"sliding": 2, "hca": 3, "csa": 4}[mode])
    heads, window, rate, block_size, rope_dim, num_selected = 4, 8, 4, 4, 16, 3
    positions = np.array([0, 6, 21, 22, 30, 11], np.int32)
    token_seq = np.array([0, 0, 0, 0, 0, 1], np.int32)
    window_cache, window_tables, wstride, window_keys = paged(rng, [31, 12], dim, block_size)
    entry_cache, entry_tables, estride, entries = paged(rng, [31 // rate, 12 // rate], dim, block_size)
    q = bf16(rng.standard_normal((len(positions), heads, dim)))
    sinks = rng.standard_normal(heads).astype(np.float32)
    # distinct picks per query, as the indexer makes them, with -1 and not-yet-visible ones mixed in
    selected = np.stack([rng.permutation(np.arange(-1, 8))[:num_selected] for _ in positions]).astype(np.int32)
    r = rope(rope_dim, 160000.0)
    run(harness, tmp_path, "attention", len(positions), heads, dim, window, rate, block_size, wstride, estride,
        num_selected, {"sliding": 0, "hca": 1, "csa": 2}[mode], rope_dim, dim**-0.5, splits, int(dim == 512),
        q=float32_to_bf16(q),
        window_cache=float32_to_bf16(window_cache), window_tables=window_tables,
        entry_cache=float32_to_bf16(entry_cache), entry_tables=entry_tables, selected=selected,
        token_seq=token_seq, positions=positions, sinks=sinks, inv_freq=r.inv_freq)
    out = read_array(tmp_path, "out", np.uint16, q.shape)
    for t, (p, seq) in enumerate(zip(positions, token_seq, strict=True)):
        keys = [window_keys[seq][max(0, p - window + 1) : p + 1]]
        visible = (p + 1) // rate
        if mode == "hca":
            keys.append(entries[seq][:visible])
        elif mode == "csa":
            picks = sorted({int(e) for e in selected[t] if 0 <= e < visible})
            keys.append(entries[seq][picks])
        keys = np.concatenate(keys)
        expected = attend(q[t : t + 1], keys, np.ones((1, len(keys)), bool), sinks, positions[t : t + 1], r, dim)
        np.testing.assert_allclose(out[t], expected[0], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("hc", [2, 3, 4])
def test_hyper_connection_collapse_expand_and_head(harness, tmp_path, hc, splits):
    """Sinkhorn runs a thread per cell of the hc × hc matrix: every hc the kernels take (the
    mixing logits (2 + hc)·hc fit the kernel's 32 up to hc 4); the mixing dot products whole or
    cut into 3 uneven slices; x spread over 3 blocks (the last one partly idle)."""
    rng = np.random.default_rng(5)
    tokens, dim, iters = 3, 320, 20
    streams = rng.standard_normal((tokens, hc, dim)).astype(np.float32)
    layer = HyperConnectionWeights((0.3 * rng.standard_normal(((2 + hc) * hc, hc * dim))).astype(np.float32),
                                   (0.3 * rng.standard_normal((2 + hc) * hc)).astype(np.float32),
                                   rng.uniform(0.5, 1.0, 3).astype(np.float32))
    head = HyperConnectionWeights((0.3 * rng.standard_normal((hc, hc * dim))).astype(np.float32),
                                  (0.3 * rng.standard_normal(hc)).astype(np.float32),
                                  rng.uniform(0.5, 1.0, 1).astype(np.float32))
    y = bf16(rng.standard_normal((tokens, dim)))
    run(harness, tmp_path, "hc", tokens, hc, dim, iters, 1e-6, 1e-6, splits, streams=streams, y=float32_to_bf16(y),
        fn=layer.fn, base=layer.base, scale=layer.scale, head_fn=head.fn, head_base=head.base,
        head_scale=head.scale)
    x, mixing = collapse(streams, layer, hc_eps=1e-6, sinkhorn_iters=iters, norm_eps=1e-6)
    np.testing.assert_allclose(read_array(tmp_path, "x", np.uint16, x.shape), x, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(read_array(tmp_path, "post", np.float32, mixing.post.shape), mixing.post, rtol=1e-4)
    np.testing.assert_allclose(read_array(tmp_path, "comb", np.float32, mixing.comb.shape), mixing.comb, rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(read_array(tmp_path, "expanded", np.float32, streams.shape), expand(streams, y, mixing),
                               rtol=1e-4, atol=1e-4)
    expected_head = collapse_head(streams, head, hc_eps=1e-6, norm_eps=1e-6)
    np.testing.assert_allclose(read_array(tmp_path, "head_x", np.uint16, x.shape), expected_head, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_quantized_linear(harness, tmp_path, fmt):
    rng = np.random.default_rng(6)
    rows, in_features, out_features = 3, 256, 136  # FP8: two 128-wide input blocks, a partial output block
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32)
    x = bf16(rng.standard_normal((rows, in_features)))
    if fmt == "fp4":
        codes, scales = quantize_fp4_e2m1(weight)
        dequantized = dequantize_fp4_e2m1(codes, scales)
    else:
        blocks = np.abs(np.pad(weight, ((0, 120), (0, 0))).reshape(2, 128, 2, 128)).max(axis=(1, 3))
        exponents = np.ceil(np.log2(blocks / FP8_E4M3_MAX)).astype(np.int32)
        scales = (exponents + 127).astype(np.uint8)
        expanded = np.repeat(np.repeat(np.exp2(exponents), 128, 0), 128, 1)[:out_features].astype(np.float32)
        codes = float32_to_fp8_e4m3(weight / expanded)
        dequantized = dequantize_fp8_block(codes, e8m0_to_float32(scales))
    run(harness, tmp_path, "quant", rows, in_features, out_features, int(fmt == "fp4"), x=float32_to_bf16(x),
        weight=codes, scales=scales)
    y = read_array(tmp_path, "y", np.uint16, (rows, out_features))
    np.testing.assert_allclose(y, x @ dequantized.T, rtol=1e-2, atol=5e-2)


class _ProjectionRows:
    """Stands in for the backend: ``linear(x, "kv" | "gate")`` returns that half of x's columns,
    so ``attention.compress`` pools the very projection rows the kernels read."""

    def __init__(self, width: int):
        self.width = width

    def linear(self, x: np.ndarray, which: str) -> np.ndarray:
        return x[:, : self.width] if which == "kv" else x[:, self.width:]


@pytest.mark.parametrize(("rate", "overlap"), [(4, True), (4, False), (3, True)])
def test_compressor_step_and_state_over_chunks(harness, tmp_path, rate, overlap):
    """Two sequences fed in uneven chunks (single tokens, empty steps, several windows at once):
    the kernels' entries equal ``attention.compress`` over each whole sequence, so the open
    window and (CSA) the previous window's Ca half carry across steps through the state slots."""
    from openinfer_deepseek_v4.attention import compress
    from openinfer_deepseek_v4.state import OpenWindow
    from openinfer_deepseek_v4.weights import CompressorWeights

    rng = np.random.default_rng(7)
    dim, rope_dim, block_size, stride = 32, 16, 4, 4
    width = (2 if overlap else 1) * dim
    lengths = (23, 17)
    chunks = [(5, 3), (1, 8), (9, 1), (8, 0), (0, 5)]  # tokens of each sequence per step
    rows = [rng.standard_normal((n, 2 * width)).astype(np.float32) for n in lengths]
    rows = [np.concatenate([bf16(r[:, :width]), bf16(r[:, width:])], axis=1) for r in rows]
    ape = (0.5 * rng.standard_normal((rate, width))).astype(np.float32)
    norm = (1 + 0.2 * rng.standard_normal(dim)).astype(np.float32)
    r = rope(rope_dim, 160000.0)
    kv, gate, positions, step_tokens, query_start = [], [], [], [0], []
    done = [0, 0]
    for step in chunks:
        starts = [0]
        for seq, n in enumerate(step):
            part = rows[seq][done[seq]:done[seq] + n]
            kv.append(part[:, :width])
            gate.append(part[:, width:])
            positions.append(np.arange(done[seq], done[seq] + n))
            done[seq] += n
            starts.append(starts[-1] + n)
        step_tokens.append(step_tokens[-1] + sum(step))
        query_start.append(starts)
    assert done == list(lengths)
    tables = np.stack([np.arange(stride), stride + np.arange(stride)[::-1]]).astype(np.int32)
    run(harness, tmp_path, "compressor", rate, dim, int(overlap), rope_dim, 1e-6, len(chunks), stride, block_size, 3,
        kv=float32_to_bf16(np.concatenate(kv)), gate=float32_to_bf16(np.concatenate(gate)), ape=ape, norm=norm,
        inv_freq=r.inv_freq, positions=np.concatenate(positions).astype(np.int32),
        step_tokens=np.asarray(step_tokens, np.int32), query_start=np.asarray(query_start, np.int32),
        tables=tables, state_slots=np.array([2, 1], np.int32))
    cache = read_array(tmp_path, "cache", np.uint16, (2 * stride * block_size, dim))
    weights = CompressorWeights("kv", "gate", ape, norm, rate, dim, overlap)
    for seq, n in enumerate(lengths):
        empty = OpenWindow(np.zeros((0, width), np.float32), np.zeros((0, width), np.float32))
        expected, _ = compress(_ProjectionRows(width), rows[seq], weights, empty, 0, r, 1e-6)
        got = np.stack([cache[tables[seq][e // block_size] * block_size + e % block_size] for e in range(n // rate)])
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)


# --- core kernels/moe_fp4.cu: the FP4 expert GEMMs the CUDA model runs ---------------------------

FP4_HARNESS = Path(__file__).parent / "cuda_emulation" / "moe_fp4_harness.cpp"
FP4_TILE = 64  # rows of a moe_sort tile


@pytest.fixture(scope="module", params=[{"STREAM_CHUNKS": 1}, {"STREAM_CHUNKS": 8},
                                        {"STREAM_CHUNKS": 2, "STREAM_STAGES": 4}],
                ids=["stream-1-chunk", "stream-8-chunks", "stream-2-chunks-4-stages"])
def fp4_harness(request, tmp_path_factory) -> Path:
    """The harness with STREAM_CHUNKS = 1 (a tile's rows in passes of 8: every pass re-reads the
    weights), 8 (a whole 64-row tile in one pass) and 2 with a 4-deep staging ring (the opt-in
    OPENINFER_DSV4_STREAM_STAGES=4; K of 1–3 steps here, fewer than the ring)."""
    from openinfer.backend.cuda import kernel_include_dir

    binary = tmp_path_factory.mktemp("moe-fp4-harness") / "harness"
    return compile_harness(FP4_HARNESS, kernel_include_dir(), binary, request.param)


def sort_by_expert(ids: np.ndarray, num_experts: int) -> dict[str, np.ndarray]:
    """moe.cu's moe_sort layout on the host: slots grouped by expert, tiles of at most 64 rows."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tile_expert, tile_row = [], []
    for e in range(num_experts):
        for row in range(0, counts[e], FP4_TILE):
            tile_expert.append(e)
            tile_row.append(offsets[e] + row)
    max_tiles = -(-flat.size // FP4_TILE) + min(num_experts, flat.size)
    pad = max_tiles - len(tile_expert)
    return {"sorted_slots": order, "offsets": offsets, "num_tiles": np.array([len(tile_expert)], np.int32),
            "tile_expert": np.array(tile_expert + [0] * pad, np.int32),
            "tile_row": np.array(tile_row + [0] * pad, np.int32), "max_tiles": max_tiles}


def random_fp4_experts(rng, num_experts: int, out_features: int, in_features: int) -> tuple[np.ndarray, np.ndarray]:
    """Every e2m1 code (±0 and the subnormal-in-bf16 ±0.5 included) and e8m0 scales on both sides
    of 2^1, the largest the stream kernel's one-multiply path takes."""
    codes = rng.integers(0, 256, (num_experts, out_features, in_features // 2), dtype=np.uint8)
    scales = rng.choice(np.array([100, 118, 121, 124, 127, 128, 129, 131], np.uint8),
                        (num_experts, out_features, in_features // 32))
    return codes, scales


@pytest.mark.parametrize("kernel", ["tiles", "stream"])
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "rows"])
def test_fp4_grouped_gemms(fp4_harness, tmp_path, kernel, gather):
    """Both FP4 GEMMs equal the NumPy composition (token rows · dequantised expert weight) on a
    routing with an empty expert, one expert past a 64-row tile, N not a multiple of 16 and K not a
    multiple of 128 (a last K step with one scale group of four)."""
    rng = np.random.default_rng(7)
    num_experts, top_k, tokens, out_features, in_features = 5, 2, 41, 72, 160
    ids = np.stack([np.full(tokens, 1), rng.integers(2, num_experts, tokens)], axis=1).astype(np.int32)
    ids[: tokens // 2, 1] = np.where(ids[: tokens // 2, 1] == 3, 4, ids[: tokens // 2, 1])
    ids[::3] = ids[::3, ::-1]  # expert 1 in both slot positions; expert 0 never chosen
    assert np.bincount(ids.ravel(), minlength=num_experts)[0] == 0
    layout = sort_by_expert(ids, num_experts)
    codes, scales = random_fp4_experts(rng, num_experts, out_features, in_features)
    rows = tokens if gather else tokens * top_k
    a = bf16(rng.standard_normal((rows, in_features)))
    run_harness(fp4_harness, tmp_path, kernel, out_features, in_features, top_k, int(gather), layout["max_tiles"],
                timeout=600, a=float32_to_bf16(a), weight=codes, scale=scales,
                **{name: layout[name] for name in ("sorted_slots", "tile_expert", "tile_row", "num_tiles", "offsets")})
    out = read_array(tmp_path, "out", np.uint16, (tokens * top_k, out_features))
    expected = np.empty_like(out)
    for p, slot in enumerate(layout["sorted_slots"]):
        expert = ids.reshape(-1)[slot]
        row = a[slot // top_k] if gather else a[p]
        expected[p] = row.astype(np.float64) @ dequantize_fp4_e2m1(codes[expert], scales[expert]).T.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=8e-3, atol=1e-6 * np.abs(expected).max())


def test_fp4_decode_every_code(fp4_harness, tmp_path):
    """One row per code and scale: the weight row k holds code k % 16 at every position, so each
    output is a known sum; ±0.5 (a bf16 subnormal before scaling) and the two-multiply scales
    (2^2, 2^4) must come out exact."""
    in_features, top_k = 64, 1
    codes_per_row = np.arange(16, dtype=np.uint8)
    scales_list = np.array([127, 118, 129, 131], np.uint8)
    out_features = codes_per_row.size * scales_list.size
    codes = np.repeat(np.repeat(codes_per_row, scales_list.size)[:, None] * np.uint8(17), in_features // 2, axis=1)
    scales = np.repeat(np.tile(scales_list, codes_per_row.size)[:, None], in_features // 32, axis=1)
    ids = np.zeros((3, 1), np.int32)
    layout = sort_by_expert(ids, 1)
    a = np.zeros((3, in_features), np.float32)
    a[0, 0] = 1.0
    a[1, 1::2] = 0.25
    a[2] = -1.0
    expected = a @ dequantize_fp4_e2m1(codes, scales).T
    for kernel in ("tiles", "stream"):
        run_harness(fp4_harness, tmp_path, kernel, out_features, in_features, top_k, 1, layout["max_tiles"],
                    a=float32_to_bf16(a), weight=codes[None], scale=scales[None],
                    **{name: layout[name] for name in ("sorted_slots", "tile_expert", "tile_row", "num_tiles",
                                                       "offsets")})
        out = read_array(tmp_path, "out", np.uint16, (3, out_features))
        np.testing.assert_array_equal(out, expected, err_msg=kernel)


# --- core kernels/moe_fp4.cu: fp8_stream_linear, the FP8 dense linears' decode GEMM ------------------

FP8_NAN = (0x7F, 0xFF)


def random_fp8_linear(rng, out_features: int, in_features: int, exponents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every finite e4m3 code (subnormals and ±0 included) and e8m0 block scales drawn from
    ``exponents``: on both sides of 2^7, the largest the one-multiply path takes."""
    codes = rng.integers(0, 256, (out_features, in_features), dtype=np.uint8)
    codes[np.isin(codes, FP8_NAN)] = 0x01
    scales = rng.choice(np.array(exponents, np.uint8), (-(-out_features // 128), -(-in_features // 128)))
    return codes, scales


def run_fp8_linear(binary: Path, directory: Path, a: np.ndarray, codes: np.ndarray, scales: np.ndarray,
                   splits: int = 1) -> np.ndarray:
    (rows, in_features), out_features = a.shape, codes.shape[0]
    run_harness(binary, directory, "fp8", out_features, in_features, rows, splits, a=float32_to_bf16(a), weight=codes,
                scale=scales)
    return read_array(directory, "out", np.uint16, (rows, out_features))


@pytest.mark.parametrize(("rows", "splits", "in_features"),
                         [(3, 1, 352), (70, 1, 352), (3, 2, 352), (5, 3, 352), (2, 4, 352), (3, 1, 1120), (9, 3, 1120)],
                         ids=["decode", "two-block-rows", "split-k-2", "split-k-3", "split-k-4-one-empty", "long-k",
                              "long-k-split-3"])
def test_fp8_stream_linear(fp4_harness, tmp_path, rows, splits, in_features):
    """x · dequantised(W)ᵀ for an FP8 weight with N past a 64-row block and a 128-row scale block,
    K past a 128-wide scale block (a last K step of one or three 32-k groups), rows past a 64-row
    block; K's 3 steps split 2 + 1, 1 + 1 + 1 and 1 + 1 + 1 + 0 (an empty split adds zeros), the
    fp32 partials added by fp8_stream_reduce; 9 steps (3 + 3 + 3): more than the staging ring holds."""
    rng = np.random.default_rng(11)
    out_features = 200
    codes, scales = random_fp8_linear(rng, out_features, in_features, [100, 112, 120, 127, 134, 135, 140])
    a = bf16(rng.standard_normal((rows, in_features)))
    out = run_fp8_linear(fp4_harness, tmp_path, a, codes, scales, splits)
    expected = a.astype(np.float64) @ dequantize_fp8_block(codes, e8m0_to_float32(scales)).T.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=8e-3, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("block_scales", [(127, 135), (100, 141)], ids=["one-multiply", "two-multiplies"])
def test_fp8_decode_every_code(fp4_harness, tmp_path, block_scales):
    """Weight row n holds code n at every k (NaN codes left out), one scale per 128-row block: a
    unit input picks each decoded value out exactly, subnormals and the two-multiply scales included."""
    in_features = 128
    code_of_row = np.array([c for c in range(256) if c not in FP8_NAN], np.uint8)
    codes = np.repeat(code_of_row[:, None], in_features, axis=1)
    scales = np.array(block_scales, np.uint8)[:, None]
    a = np.zeros((2, in_features), np.float32)
    a[0, 0] = 1.0
    a[1, 77] = -1.0
    out = run_fp8_linear(fp4_harness, tmp_path, a, codes, scales)
    expected = a @ dequantize_fp8_block(codes, e8m0_to_float32(scales)).T
    np.testing.assert_array_equal(out, expected)
