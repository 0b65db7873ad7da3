"""The o_proj / down GEMMs adding into the residual in place (cuBLAS beta = 1,
``OPENINFER_RESIDUAL_GEMM=1``): each against its unfused NumPy composition (residual + x @ W^T,
rounded once), the fallbacks that must launch nothing, and a whole decoder stack with the switch
on against off (the same logits within bf16 rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.cuda.bf16 import round_to_bf16
from openinfer.backend.numpy_backend import NumpyBackend
from tests.gpu.conftest import bf16_random, relative_error

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

REF = NumpyBackend()


@pytest.fixture
def residual_gemm_on(monkeypatch, cuda_backend):
    from openinfer.backend.cuda import linear

    monkeypatch.setattr(cuda_backend, "gemm_row_buckets", ())  # another test's graphs may have set some
    monkeypatch.setenv(linear.RESIDUAL_GEMM_ENV, "1")
    linear.residual_gemm_wanted.cache_clear()
    yield
    linear.residual_gemm_wanted.cache_clear()


@pytest.mark.parametrize("rows,k,n", [(2, 64, 96), (77, 1000, 1000), (300, 4096, 2560), (1024, 1536, 512)])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_linear_residual_adds_the_product_into_the_residual(cuda_backend, rng, residual_gemm_on, rows, k, n, silu_mul):
    x = bf16_random(rng, rows, 2 * k if silu_mul else k)
    residual = bf16_random(rng, rows, n)
    w = bf16_random(rng, n, k, scale=0.05)
    layer = cuda_backend.linear_weight(w, None)
    dx, dr = cuda_backend.upload(x), cuda_backend.upload(residual)
    pointer = dr.data.ptr
    assert cuda_backend.linear_residual(dx, layer, dr, silu_mul)
    assert dr.data.ptr == pointer  # in place
    act = round_to_bf16(REF.silu_mul(x)) if silu_mul else x
    reference = round_to_bf16(residual + act @ w.T)
    assert relative_error(cuda_backend.to_host(dr), reference) < 1e-2
    # against the default's two roundings (product, then sum): at most a bf16 step apart per element
    unfused = cuda_backend.to_host(cuda_backend.add(cuda_backend.linear(
        cuda_backend.silu_mul(dx) if silu_mul else dx, layer), cuda_backend.upload(residual)))
    assert relative_error(cuda_backend.to_host(dr), unfused) < 1e-2


def test_linear_residual_does_nothing_where_it_does_not_apply(cuda_backend, rng, residual_gemm_on, monkeypatch):
    from openinfer.backend.cuda import linear

    w = bf16_random(rng, 96, 64, scale=0.05)
    layer, biased = cuda_backend.linear_weight(w, None), cuda_backend.linear_weight(w, bf16_random(rng, 96))
    x, residual = bf16_random(rng, 4, 64), bf16_random(rng, 4, 96)
    cases = [
        (cuda_backend.upload(x[:1]), layer, cuda_backend.upload(residual[:1])),  # a GEMV row
        (cuda_backend.upload(x), biased, cuda_backend.upload(residual)),  # a bias
        (cuda_backend.upload(x), layer, cuda_backend.upload(np.ascontiguousarray(residual[:, :48]))),  # shape
        (cuda_backend.upload(x), layer, cuda_backend.upload(np.concatenate([residual, residual], 1))[:, ::2]),
    ]
    for dx, weight, dr in cases:
        before = cuda_backend.to_host(dr)
        assert not cuda_backend.linear_residual(dx, weight, dr)
        assert np.array_equal(cuda_backend.to_host(dr), before)
    # 4 rows would pad to a bucket of 8: the padded rows would land past the residual
    monkeypatch.setattr(cuda_backend, "gemm_row_buckets", (8, 16))
    assert not cuda_backend.linear_residual(cuda_backend.upload(x), layer, cuda_backend.upload(residual))
    monkeypatch.setenv(linear.RESIDUAL_GEMM_ENV, "0")
    linear.residual_gemm_wanted.cache_clear()
    assert not cuda_backend.linear_residual(cuda_backend.upload(x), layer, cuda_backend.upload(residual))


@pytest.mark.parametrize("tokens", [1, 37, 512])
def test_a_decoder_stack_gives_the_same_logits_with_the_residual_gemm(cuda_backend, rng, monkeypatch, tokens):
    monkeypatch.setattr(cuda_backend, "gemm_row_buckets", ())
    from openinfer import AttentionSpec, DecoderLayer, DecoderStack
    from openinfer.backend.base import ForwardBatch
    from openinfer.backend.cuda import linear

    hidden, heads, kv_heads, head_dim, inter, vocab, num_layers = 512, 4, 2, 128, 1024, 1000, 3
    layers, kv = [], []
    for _ in range(num_layers):
        spec = AttentionSpec(heads, kv_heads, head_dim, None, head_dim ** -0.5)
        layers.append(DecoderLayer(
            input_norm=cuda_backend.weight(round_to_bf16(1 + bf16_random(rng, hidden, scale=0.1))),
            qkv=cuda_backend.linear_weight(bf16_random(rng, (heads + 2 * kv_heads) * head_dim, hidden, scale=0.05), None),
            attention=spec,
            o_proj=cuda_backend.linear_weight(bf16_random(rng, hidden, heads * head_dim, scale=0.05), None),
            post_attention_norm=cuda_backend.weight(round_to_bf16(1 + bf16_random(rng, hidden, scale=0.1))),
            gate_up=cuda_backend.linear_weight(bf16_random(rng, 2 * inter, hidden, scale=0.05), None),
            down=cuda_backend.linear_weight(bf16_random(rng, hidden, inter, scale=0.05), None)))
        kv.append(cuda_backend.allocate_kv(-(-tokens // 16) + 1, 16, kv_heads, head_dim))
    stack = DecoderStack(embed_tokens=cuda_backend.weight(bf16_random(rng, vocab, hidden)), layers=layers,
                         final_norm=cuda_backend.weight(round_to_bf16(1 + bf16_random(rng, hidden, scale=0.1))),
                         lm_head=cuda_backend.linear_weight(bf16_random(rng, vocab, hidden, scale=0.05), None), eps=1e-6)
    batch = ForwardBatch.over_blocks(np.arange(1, -(-tokens // 16) + 1, dtype=np.int32)[None, :], [0], [tokens], 16,
                                     token_ids=rng.integers(0, vocab, tokens))

    accumulated = []
    matmul_nt = cuda_backend.blas.matmul_nt

    def counting(x, weight, out, accumulate=False):
        accumulated.append(accumulate)
        return matmul_nt(x, weight, out, accumulate)

    monkeypatch.setattr(cuda_backend.blas, "matmul_nt", counting)

    def logits(switch: str) -> np.ndarray:
        monkeypatch.setenv(linear.RESIDUAL_GEMM_ENV, switch)
        linear.residual_gemm_wanted.cache_clear()
        accumulated.clear()
        out = cuda_backend.to_host(stack.forward(cuda_backend, cuda_backend.prepare_batch(batch), kv))
        return out, sum(accumulated)

    try:
        (off, off_added), (on, on_added) = logits("0"), logits("1")
    finally:
        linear.residual_gemm_wanted.cache_clear()
    assert relative_error(on, off) < 3e-2
    assert off_added == 0
    # o_proj and down of every layer add into the residual, but for a batch-1 row (its GEMVs)
    assert on_added == (0 if tokens == 1 else 2 * num_layers)


@pytest.mark.parametrize("rows,features", [(1, 2560), (300, 2560), (1027, 1024), (4096, 3072)])
def test_rms_norm_rows_late_weight_equals_the_default_bits(cuda_backend, rng, rows, features):
    """rms_norm.cu's RMS_NORM_ROWS_LATE_WEIGHT=1 (the weight loaded where the normalization uses it:
    100 registers instead of 177) computes what the default computes, bit for bit, and both match
    the NumPy RMSNorm."""
    from openinfer.backend.cuda.backend import NORM_ROWS_PER_BLOCK, row_norm_vectors_per_lane
    from openinfer.backend.cuda.loader import kernel

    x = bf16_random(rng, rows, features)
    norm = round_to_bf16(1 + bf16_random(rng, features, scale=0.3))
    dx, weight = cuda_backend.upload(x), cuda_backend.weight(norm)
    vectors = row_norm_vectors_per_lane(features, dx, weight)
    outs = []
    for late in (0, 1):
        out = cupy.empty_like(dx)
        kernel("rms_norm.cu", "rms_norm_rows", VECS_PER_LANE=vectors, RMS_NORM_ROWS_LATE_WEIGHT=late)(
            (-(-rows // NORM_ROWS_PER_BLOCK),), (32 * NORM_ROWS_PER_BLOCK,),
            (dx, weight, out, np.int32(rows), np.int32(features), np.float32(1e-6)))
        outs.append(out)
    assert bool(cupy.array_equal(outs[0], outs[1]))
    assert relative_error(cuda_backend.to_host(outs[1]), REF.rms_norm(x, norm, 1e-6)) < 1e-2
