"""DeepSeek-V4 kernels on the GPU (run on an H100/H200 with ``pytest -m gpu tests/plugins/deepseek_v4``):
every launcher in ``cuda_ops`` against the NumPy op it mirrors, on the same bf16-rounded inputs,
at real DeepSeek-V4-Flash widths (head_dim 512, rope 64, 64 index heads × 128, hc 4 × 4096)."""

from __future__ import annotations

import numpy as np
import pytest
from openinfer_deepseek_v4.attention import attend, index_scores, pool_entries, top_k_visible
from openinfer_deepseek_v4.hyper_connection import collapse, collapse_head, expand
from openinfer_deepseek_v4.weights import HyperConnectionWeights

from openinfer import bf16_to_float32, float32_to_bf16
from openinfer.quant import dequantize_fp4_e2m1, quantize_fp4_e2m1
from tests.plugins.deepseek_v4.test_dsv4_cuda_emulated import NEG_BIG, bf16, paged, rope

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    from openinfer_deepseek_v4 import cuda_ops

    return cuda_ops


def dev_bf16(x: np.ndarray):
    return cupy.asarray(float32_to_bf16(x))


def host(x) -> np.ndarray:
    x = cupy.asnumpy(x)
    return bf16_to_float32(x) if x.dtype == np.uint16 else x


def test_compress_entries(ops):
    rng = np.random.default_rng(0)
    windows, slots, dim, rope_dim = 9, 8, 512, 64
    kv = rng.standard_normal((windows, slots, dim)).astype(np.float32)
    gate = rng.standard_normal((windows, slots, dim)).astype(np.float32)
    gate[0, :4] = NEG_BIG
    norm = (1 + 0.2 * rng.standard_normal(dim)).astype(np.float32)
    positions = (np.arange(windows) * 4).astype(np.int32)
    dest = rng.permutation(32)[:windows].astype(np.int64)
    r = rope(rope_dim, 160000.0)
    cache = cupy.zeros((32, dim), np.uint16)
    ops.compress_entries(cupy.asarray(kv), cupy.asarray(gate), cupy.asarray(norm), cupy.asarray(r.inv_freq),
                         cupy.asarray(positions), cupy.asarray(dest), cache, rope_dim, 1e-6)
    expected = pool_entries(kv, np.where(gate == NEG_BIG, -np.inf, gate), norm, positions, r, 1e-6)
    np.testing.assert_allclose(host(cache)[dest], expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("split", ["fixed", "auto"])
def test_indexer_scores_and_top_k(ops, split):
    rng = np.random.default_rng(1)
    heads, dim, rate, block_size, k = 64, 128, 4, 16, 512
    positions = np.array([3, 900, 2047, 4095, 100], np.int32)
    token_seq = np.array([0, 0, 0, 0, 1], np.int32)
    lengths = [4096 // rate, 101 // rate]
    keys, tables, _, per_seq = paged(rng, lengths, dim, block_size)
    q = bf16(rng.standard_normal((len(positions), heads, dim)))
    weights = rng.standard_normal((len(positions), heads)).astype(np.float32)
    scores, selected = ops.indexer_topk(dev_bf16(q), cupy.asarray(weights), dev_bf16(keys), cupy.asarray(tables),
                                        block_size, cupy.asarray(token_seq), cupy.asarray(positions), rate,
                                        max(lengths), k, split=split)
    scores, selected = host(scores), host(selected)
    for t, (p, seq) in enumerate(zip(positions, token_seq, strict=True)):
        visible = (p + 1) // rate
        expected = index_scores(q[t : t + 1], per_seq[seq][:visible], weights[t : t + 1])[0]
        np.testing.assert_allclose(scores[t, :visible], expected, rtol=1e-4, atol=1e-3)
        want = np.flatnonzero(top_k_visible(scores[t : t + 1, :visible], np.ones((1, visible), bool),
                                            min(k, visible))[0]) if visible else []
        got = selected[t]
        assert set(got[got >= 0].tolist()) == set(np.asarray(want).tolist())


@pytest.mark.parametrize("splits", [1, 4, "auto"])
@pytest.mark.parametrize("mode", ["sliding", "hca", "csa"])
def test_sparse_attention(ops, mode, splits):
    """Also split over keys (runs merged by dsv4_attention_combine): 4 runs, and ``auto``; the
    kernel specialised for head_dim 512 (``OPENINFER_DSV4_ATTENTION_KERNEL=auto``) gives the very
    bits of the generic one."""
    rng = np.random.default_rng(2)
    heads, dim, window, rate, block_size, rope_dim, num_selected = 8, 512, 128, 4, 16, 64, 16
    positions = np.array([0, 77, 300, 301, 40], np.int32)
    token_seq = np.array([0, 0, 0, 0, 1], np.int32)
    window_cache, window_tables, _, window_keys = paged(rng, [302, 41], dim, block_size)
    entry_cache, entry_tables, _, entries = paged(rng, [302 // rate, 41 // rate], dim, block_size)
    q = bf16(rng.standard_normal((len(positions), heads, dim)))
    sinks = rng.standard_normal(heads).astype(np.float32)
    selected = np.stack([rng.permutation(np.arange(-1, 80))[:num_selected] for _ in positions]).astype(np.int32)
    r = rope(rope_dim, 160000.0)
    def attend_on_gpu(kernel_setting: str) -> np.ndarray:
        return host(ops.sparse_attention(
            dev_bf16(q), dev_bf16(window_cache), cupy.asarray(window_tables),
            None if mode == "sliding" else dev_bf16(entry_cache),
            None if mode == "sliding" else cupy.asarray(entry_tables), cupy.asarray(selected) if mode == "csa" else None,
            rate, cupy.asarray(token_seq), cupy.asarray(positions), cupy.asarray(sinks), cupy.asarray(r.inv_freq),
            rope_dim, window, block_size, splits=splits, kernel_setting=kernel_setting))

    out = attend_on_gpu("generic")
    np.testing.assert_array_equal(attend_on_gpu("auto"), out)
    for t, (p, seq) in enumerate(zip(positions, token_seq, strict=True)):
        keys = [window_keys[seq][max(0, p - window + 1) : p + 1]]
        visible = (p + 1) // rate
        if mode == "hca":
            keys.append(entries[seq][:visible])
        elif mode == "csa":
            keys.append(entries[seq][sorted({int(e) for e in selected[t] if 0 <= e < visible})])
        keys = np.concatenate(keys)
        expected = attend(q[t : t + 1], keys, np.ones((1, len(keys)), bool), sinks, positions[t : t + 1], r, dim)
        np.testing.assert_allclose(out[t], expected[0], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("split", ["1", "auto"])
def test_hyper_connection(ops, split):
    """Both ``OPENINFER_DSV4_HC_SPLIT`` settings (``auto`` at 5 tokens: each dot product in
    several slices, x over 16 blocks)."""
    rng = np.random.default_rng(3)
    tokens, hc, dim = 5, 4, 4096
    streams = rng.standard_normal((tokens, hc, dim)).astype(np.float32)
    layer = HyperConnectionWeights((0.02 * rng.standard_normal(((2 + hc) * hc, hc * dim))).astype(np.float32),
                                   (0.3 * rng.standard_normal((2 + hc) * hc)).astype(np.float32),
                                   rng.uniform(0.5, 1.0, 3).astype(np.float32))
    head = HyperConnectionWeights(layer.fn[:hc].copy(), layer.base[:hc].copy(), layer.scale[:1].copy())
    x, post, comb = ops.hc_collapse(cupy.asarray(streams), cupy.asarray(layer.fn), cupy.asarray(layer.base),
                                    cupy.asarray(layer.scale), sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6,
                                    split=split)
    expected_x, mixing = collapse(streams, layer, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-6)
    np.testing.assert_allclose(host(x), expected_x, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(host(comb), mixing.comb, rtol=1e-3, atol=1e-5)
    y = bf16(rng.standard_normal((tokens, dim)))
    expanded = ops.hc_expand(cupy.asarray(streams), dev_bf16(y), post, comb)
    np.testing.assert_allclose(host(expanded), expand(streams, y, mixing), rtol=1e-3, atol=1e-3)
    head_x, _, _ = ops.hc_collapse(cupy.asarray(streams), cupy.asarray(head.fn), cupy.asarray(head.base),
                                   cupy.asarray(head.scale), sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, head=True,
                                   split=split)
    np.testing.assert_allclose(host(head_x), collapse_head(streams, head, hc_eps=1e-6, norm_eps=1e-6),
                               rtol=1e-2, atol=1e-2)


def test_fp4_expert_linear(ops):
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((2048, 4096)).astype(np.float32)
    codes, scales = quantize_fp4_e2m1(weight)
    x = bf16(rng.standard_normal((7, 4096)))
    y = ops.quantized_linear(dev_bf16(x), cupy.asarray(codes), cupy.asarray(scales), 2048, "fp4")
    expected = x @ dequantize_fp4_e2m1(codes, scales).T
    np.testing.assert_allclose(host(y), expected, rtol=2e-2, atol=0.5)


# --- the MoE layer's FP4 expert GEMMs (core kernels/moe_fp4.cu) ---------------------------------

def fp4_experts(rng, num_experts: int, out_features: int, in_features: int):
    """Quantised random experts: (device Fp4Experts, host dequantised [E, N, K] fp32)."""
    from openinfer_deepseek_v4.cuda_experts import Fp4Experts

    codes, scales, dense = [], [], []
    for _ in range(num_experts):
        c, s = quantize_fp4_e2m1(0.05 * rng.standard_normal((out_features, in_features)).astype(np.float32))
        codes.append(c)
        scales.append(s)
        dense.append(dequantize_fp4_e2m1(c, s))
    return (Fp4Experts(cupy.asarray(np.stack(codes)), cupy.asarray(np.stack(scales)), out_features, in_features),
            np.stack(dense))


def distinct_ids(rng, tokens: int, num_experts: int, top_k: int) -> np.ndarray:
    return np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)]).astype(np.int32)


@pytest.mark.parametrize("method", ["stream", "tiles"])
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
def test_fp4_grouped_gemms(ops, method, tokens):
    """Both FP4 GEMMs at V4-Flash's widths (K 4096, gate_up-sized N) against the NumPy
    composition, gathering token rows (gate_up) and on sorted rows (down); 300 tokens put ~225
    rows on each expert (several tiles, several stream passes)."""
    from openinfer_deepseek_v4.cuda_experts import fp4_grouped_gemm

    from openinfer.backend.cuda import moe_routing

    rng = np.random.default_rng(10 + tokens)
    num_experts, top_k, out_features, in_features = 8, 6, 1536, 4096
    experts, dense = fp4_experts(rng, num_experts, out_features, in_features)
    ids = distinct_ids(rng, tokens, num_experts, top_k)
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.asarray(rng.random(ids.shape, np.float32)),
                                        num_experts)
    sorted_slots = host(grouping.sorted_slots)
    x = bf16(rng.standard_normal((tokens, in_features)))
    rows = bf16(rng.standard_normal((tokens * top_k, in_features)))
    gathered = host(fp4_grouped_gemm(dev_bf16(x), experts, grouping, gather=True, method=method))
    direct = host(fp4_grouped_gemm(dev_bf16(rows), experts, grouping, gather=False, method=method))
    expert_of = ids.reshape(-1)[sorted_slots]
    expected_gathered = np.zeros(gathered.shape, np.float64)
    expected_direct = np.zeros(direct.shape, np.float64)
    for e in range(num_experts):
        at = np.flatnonzero(expert_of == e)
        weight = dense[e].T.astype(np.float64)
        expected_gathered[at] = x[sorted_slots[at] // top_k] @ weight
        expected_direct[at] = rows[at] @ weight
    for got, want in ((gathered, expected_gathered), (direct, expected_direct)):
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("method", ["stream", "tiles"])
def test_fp4_decode_every_code_exact(ops, method):
    """Each weight row one e2m1 code throughout and one scale (2^0, 2^-9, 2^2, 2^4): the outputs
    are exact sums — ±0.5, a bf16 subnormal before the scale multiply, must not flush to zero."""
    from openinfer_deepseek_v4.cuda_experts import Fp4Experts, fp4_grouped_gemm

    from openinfer.backend.cuda import moe_routing

    in_features = 256
    codes_per_row, scale_values = np.arange(16, dtype=np.uint8), np.array([127, 118, 129, 131], np.uint8)
    out_features = codes_per_row.size * scale_values.size
    codes = np.repeat(np.repeat(codes_per_row, scale_values.size)[:, None] * np.uint8(17), in_features // 2, axis=1)
    scales = np.repeat(np.tile(scale_values, codes_per_row.size)[:, None], in_features // 32, axis=1)
    experts = Fp4Experts(cupy.asarray(codes[None]), cupy.asarray(scales[None]), out_features, in_features)
    x = np.zeros((3, in_features), np.float32)
    x[0, 0], x[1, 1::2], x[2] = 1.0, 0.25, -1.0
    grouping = moe_routing.group_by_expert(cupy.zeros((3, 1), cupy.int32), cupy.ones((3, 1), cupy.float32), 1)
    out = host(fp4_grouped_gemm(dev_bf16(x), experts, grouping, gather=True, method=method))
    np.testing.assert_array_equal(out, x @ dequantize_fp4_e2m1(codes, scales).T)


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fp4_moe_layer(ops, tokens):
    """``cuda_experts.moe_layer`` (device routing, grouping, both FP4 GEMMs, clamped SwiGLU,
    combine, shared expert) against the NumPy composition on the device's own routing."""
    from openinfer_deepseek_v4.cuda_experts import device_layer, moe_layer

    from openinfer import create_backend
    from openinfer.backend.cuda import moe_routing
    from openinfer.moe import ExpertWeights, MoEWeights, RouterSpec, swiglu

    backend = create_backend("cuda")
    rng = np.random.default_rng(20 + tokens)
    num_experts, top_k, hidden, inter, limit = 16, 6, 1024, 512, 1.5
    gate_up, gate_up_dense = fp4_experts(rng, num_experts, 2 * inter, hidden)
    down, down_dense = fp4_experts(rng, num_experts, hidden, inter)
    shared_gate_up = bf16(0.05 * rng.standard_normal((2 * inter, hidden)))
    shared_down = bf16(0.05 * rng.standard_normal((hidden, inter)))
    router = RouterSpec(num_experts=num_experts, top_k=top_k, scoring="sqrtsoftplus", routed_scaling_factor=1.5)
    layer = MoEWeights(router=router, gate=(hidden**-0.5 * rng.standard_normal((num_experts, hidden))).astype(np.float32),
                       experts=[None] * num_experts, correction_bias=(0.01 * rng.standard_normal(num_experts)).astype(
                           np.float32),
                       shared=ExpertWeights(backend.linear_weight(shared_gate_up), backend.linear_weight(shared_down)),
                       swiglu_limit=limit, stacked=(gate_up, down))
    device = device_layer(layer, backend)
    x = bf16(rng.standard_normal((tokens, hidden)))
    x_dev = dev_bf16(x)
    out = host(moe_layer(backend, x_dev, layer, device, cupy.zeros(tokens, cupy.int32)))
    ids, weights = (host(a) for a in moe_routing.route(x_dev, device.gate, router, device.correction_bias))
    expected = bf16(swiglu(bf16(x @ shared_gate_up.T), limit)) @ shared_down.T
    for t in range(tokens):
        for j in range(top_k):
            e = ids[t, j]
            hidden_e = bf16(swiglu(bf16(x[t : t + 1] @ gate_up_dense[e].T), limit))
            expected[t] += weights[t, j] * bf16(hidden_e @ down_dense[e].T)[0]
    np.testing.assert_allclose(out, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


# --- FP8 dense linears kept as stored (cuda_linears, core kernels/moe_fp4.cu fp8_stream_linear) ------

@pytest.mark.parametrize("method", ["stream", "dequantize"])
@pytest.mark.parametrize("rows", [1, 5, 16, 64, 100, 300])
def test_fp8_linear(ops, method, rows):
    """Both paths equal x · dequantised(W)ᵀ at a V4-Flash-like width (N past a 64-row block and a
    128-row scale block), rows from one decode token to past a 64-row block row and the stream
    bound; the scales straddle 2^7, where the stream kernel takes a second multiply."""
    from openinfer_deepseek_v4.cuda_linears import fp8_linear, upload_fp8_linear

    from openinfer.backend.cuda.cublas import Cublas
    from openinfer.quant import dequantize_fp8_block, e8m0_to_float32
    from tests.plugins.deepseek_v4.test_dsv4_cuda_emulated import random_fp8_linear

    rng = np.random.default_rng(rows)
    out_features, in_features = 1000, 1024
    codes, scales = random_fp8_linear(rng, out_features, in_features, [110, 115, 120, 127, 134, 135])
    x = bf16(rng.standard_normal((rows, in_features)))
    y = fp8_linear(dev_bf16(x), upload_fp8_linear(codes, scales), Cublas(), method)
    expected = x.astype(np.float64) @ dequantize_fp8_block(codes, e8m0_to_float32(scales)).T.astype(np.float64)
    # cuBLAS may split K and add bf16-rounded partial sums (H200 D2: 16, 64 and 300 rows missed
    # 1e-5 of the largest output, 1, 5 and 100 did not): two bf16 steps of the largest output
    atol = (1e-5 if method == "stream" else 8e-3) * np.abs(expected).max()
    np.testing.assert_allclose(host(y), expected, rtol=1e-2, atol=atol)


@pytest.mark.parametrize("tokens", [1, 12])
def test_stream_stages_four_equal_two_bit_for_bit(ops, tokens):
    """``OPENINFER_DSV4_STREAM_STAGES=4`` only copies the activation rows further ahead: the FP4
    expert GEMM and the FP8 linear (split K and not) give the very bits of the 2-stage ring, with
    K long enough (32 steps) for the ring to wrap many times."""
    from openinfer_deepseek_v4.cuda_experts import fp4_grouped_gemm
    from openinfer_deepseek_v4.cuda_linears import fp8_linear, upload_fp8_linear

    from openinfer.backend.cuda import moe_routing
    from openinfer.backend.cuda.cublas import Cublas
    from tests.plugins.deepseek_v4.test_dsv4_cuda_emulated import random_fp8_linear

    rng = np.random.default_rng(20 + tokens)
    experts, _ = fp4_experts(rng, 8, 512, 4096)
    ids = distinct_ids(rng, tokens, 8, 6)
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.asarray(rng.random(ids.shape, np.float32)), 8)
    x = dev_bf16(bf16(rng.standard_normal((tokens, 4096))))
    two, four = (cupy.asnumpy(fp4_grouped_gemm(x, experts, grouping, gather=True, method="stream", stages=stages))
                 for stages in ("2", "4"))
    np.testing.assert_array_equal(four, two)
    weight = upload_fp8_linear(*random_fp8_linear(rng, 1000, 4096, [118, 121, 124]))
    for splits in (1, 4):
        two, four = (cupy.asnumpy(fp8_linear(x, weight, Cublas(), "stream", splits, stages)) for stages in ("2", "4"))
        np.testing.assert_array_equal(four, two, err_msg=f"splits {splits}")
