"""The prefill-width elementwise kernels on the GPU against NumPy: rms_norm.cu's one-warp-per-row
norms (``CudaBackend.row_norms``, OPENINFER_ROW_NORMS), elementwise.cu's silu_mul_rows
(``CudaBackend.silu_mul_rows``, OPENINFER_SILU_MUL_ROWS: the bits of silu_mul_vec8) and
qk_norm_rope.cu's 16-byte q/k/v write
(``qkv_write.write_qkv_vectorized``, OPENINFER_VECTOR_QKV_WRITE), beside the kernels they would
replace: residual sums and v bit-exact, normalised values within a bf16 step (another fp32
summation order). The same index math runs emulated on the CPU in
tests/core/test_norm_qkv_kernels_emulated.py."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.base import AttentionSpec, KVLayer
from openinfer.backend.cuda.bf16 import round_to_bf16
from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.rope import RopeParameters, RotaryEmbedding
from tests.gpu.conftest import BLOCK_SIZE, bf16_random, paged_batch, relative_error

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

REF = NumpyBackend()
EPS = 1e-6


@pytest.fixture
def row_norms(cuda_backend):
    """The session backend with ``row_norms`` set for one test, then as it was."""
    before = cuda_backend.row_norms

    def switch(on: bool):
        cuda_backend.row_norms = on
        return cuda_backend
    yield switch
    cuda_backend.row_norms = before


# widths: one vector per row (a 31-lane tail), a partial last round of lanes, Qwen3-4B's 2560,
# the widest in registers (3072), and two the row kernels leave to the block kernel (4096, 100)
@pytest.mark.parametrize("features", [8, 520, 2560, 3072, 4096, 100])
@pytest.mark.parametrize("rows", [1, 3, 64, 1031])
def test_row_norms_match_numpy_and_the_block_kernels(row_norms, rng, rows, features):
    x, r = bf16_random(rng, rows, features, scale=2.0), bf16_random(rng, rows, features)
    w = round_to_bf16(1 + bf16_random(rng, features, scale=0.3))
    results = {}
    for on in (False, True):
        backend = row_norms(on)
        dx, dr, dw = backend.upload(x), backend.upload(r), backend.weight(w)
        norm = backend.to_host(backend.rms_norm(dx, dw, EPS))
        out, residual = backend.add_rms_norm(dx, dr, dw, EPS)
        results[on] = norm, backend.to_host(out), backend.to_host(residual)
    summed = round_to_bf16(x + r)
    for norm, out, residual in results.values():
        assert np.array_equal(residual, summed)
        assert relative_error(norm, REF.rms_norm(x, w, EPS)) < 1e-2
        assert relative_error(out, REF.rms_norm(summed, w, EPS)) < 1e-2
    for block, row in zip(results[False][:2], results[True][:2], strict=True):
        # a bf16 step or two apart (the sum of squares in another order)
        assert np.abs(row - block).max() <= 2**-6 * max(np.abs(block).max(), 1e-30)


@pytest.mark.parametrize(("rows", "half"), [(1, 9728), (3, 8), (257, 1032), (1024, 9728)])
def test_silu_mul_rows_gives_the_bits_of_silu_mul_vec8(cuda_backend, rng, rows, half):
    gate_up = bf16_random(rng, rows, 2 * half, scale=3.0)
    before = cuda_backend.silu_mul_rows
    try:
        outputs = []
        for on in (False, True):
            cuda_backend.silu_mul_rows = on
            outputs.append(cuda_backend.to_host(cuda_backend.silu_mul(cuda_backend.upload(gate_up))))
    finally:
        cuda_backend.silu_mul_rows = before
    assert np.array_equal(outputs[0], outputs[1])
    assert relative_error(outputs[1], REF.silu_mul(gate_up)) < 1e-2


# head_dim, num_heads, num_kv_heads, cached, new, qk_norm, rotary_factor
QKV_CASES = {
    "qwen3-4b-prefill": (128, 32, 8, [0], [300], True, 1.0),
    "mixed-decode-and-chunks": (128, 8, 2, [0, 50, 7, 300], [100, 37, 1, 1], True, 1.0),
    "d64-mha": (64, 6, 6, [31], [40], True, 1.0),
    "d256-partial-rope": (256, 4, 2, [5, 130], [20, 1], False, 0.25),
    "d128-partial-rope-no-norm": (128, 4, 2, [0], [33], False, 0.5),
    "no-rope": (128, 4, 2, [10], [20], True, 0.0),
}


@pytest.fixture
def warp_qkv_write():
    """``attention.write_qkv`` on the warp-per-head kernel (the 16-byte one is the default)."""
    from openinfer.backend.cuda.attention import write_qkv
    from openinfer.backend.cuda.qkv_write import set_vector_qkv_write

    def write(*args):
        set_vector_qkv_write(False)
        try:
            return write_qkv(*args)
        finally:
            set_vector_qkv_write(None)
    return write


@pytest.mark.parametrize(("tokens_per_thread", "prefetch_rope", "scalar_rope"),
                         [(1, False, False), (1, True, False), (2, True, False), (4, False, False), (1, False, True),
                          (2, False, True)])
@pytest.mark.parametrize("case", list(QKV_CASES))
def test_vector_qkv_write_matches_numpy_and_the_warp_kernel(cuda_backend, rng, warp_qkv_write, case,
                                                           tokens_per_thread, prefetch_rope, scalar_rope):
    from openinfer.backend.cuda.attention import write_qkv
    from openinfer.backend.cuda.qkv_write import vector_qkv_write_supported, write_qkv_vectorized

    head_dim, nh, nkv, cached, new, qk_norm, rotary_factor = QKV_CASES[case]
    rope = None
    if rotary_factor:
        rope = RotaryEmbedding.create(head_dim, RopeParameters(theta=10000.0, partial_rotary_factor=rotary_factor),
                                      4096)
    q_norm = round_to_bf16(1 + 0.3 * bf16_random(rng, head_dim)) if qk_norm else None
    k_norm = round_to_bf16(1 + 0.3 * bf16_random(rng, head_dim)) if qk_norm else None
    spec = AttentionSpec(nh, nkv, head_dim, rope, head_dim**-0.5,
                         None if q_norm is None else cuda_backend.weight(q_norm),
                         None if k_norm is None else cuda_backend.weight(k_norm), EPS)
    assert vector_qkv_write_supported(spec)
    num_blocks = 2 + sum(-(-(c + n) // BLOCK_SIZE) for c, n in zip(cached, new, strict=True))
    batch = paged_batch(rng, cached, new, num_blocks)
    batch.slot_mapping[-1] = -1  # a padding row: no KV write
    shape = (num_blocks, BLOCK_SIZE, nkv, head_dim)
    k_init, v_init = bf16_random(rng, *shape), bf16_random(rng, *shape)
    qkv = bf16_random(rng, batch.num_tokens, (nh + 2 * nkv) * head_dim)

    # NumPy: norm, rotate, write at the non-negative slots
    q = qkv[:, : nh * head_dim].reshape(-1, nh, head_dim)
    k = qkv[:, nh * head_dim : (nh + nkv) * head_dim].reshape(-1, nkv, head_dim)
    v = qkv[:, (nh + nkv) * head_dim :].reshape(-1, nkv, head_dim)
    if qk_norm:
        q, k = round_to_bf16(REF.rms_norm(q, q_norm, EPS)), round_to_bf16(REF.rms_norm(k, k_norm, EPS))
    if rope is not None:
        ref_spec = AttentionSpec(nh, nkv, head_dim, rope, head_dim**-0.5, None, None, EPS)
        q, k = REF.apply_rope(q, batch.positions, ref_spec), REF.apply_rope(k, batch.positions, ref_spec)
    written = batch.slot_mapping >= 0
    slots = batch.slot_mapping[written]

    outputs = {}
    def vectorized(*args):
        return write_qkv_vectorized(*args, tokens_per_thread=tokens_per_thread, prefetch_rope=prefetch_rope,
                                    scalar_rope=scalar_rope)

    # the default path (attention.write_qkv: the 16-byte kernel) beside both kernels named
    for name, write in (("warp", warp_qkv_write), ("vec", vectorized), ("default", write_qkv)):
        kv = KVLayer(cuda_backend.upload(k_init), cuda_backend.upload(v_init))
        device_q = write(cuda_backend.upload(qkv), spec, kv, cuda_backend.prepare_batch(batch), cuda_backend.ropes)
        q_out = cuda_backend.to_host(device_q)
        k_out = cuda_backend.to_host(kv.k).reshape(-1, nkv, head_dim)
        v_out = cuda_backend.to_host(kv.v).reshape(-1, nkv, head_dim)
        assert relative_error(q_out, q) < 1e-2, name
        assert relative_error(k_out[slots], k[written]) < 1e-2, name
        assert np.array_equal(v_out[slots], v[written]), name
        untouched = np.setdiff1d(np.arange(k_out.shape[0]), slots)
        assert np.array_equal(k_out[untouched], k_init.reshape(-1, nkv, head_dim)[untouched]), name
        assert np.array_equal(v_out[untouched], v_init.reshape(-1, nkv, head_dim)[untouched]), name
        outputs[name] = q_out, k_out[slots]
    for warp, vec in zip(outputs["warp"], outputs["vec"], strict=True):
        assert np.abs(vec - warp).max() <= 2**-6 * max(np.abs(warp).max(), 1e-30)
    for vec, default in zip(outputs["vec"], outputs["default"], strict=True):
        if (tokens_per_thread, prefetch_rope, scalar_rope) == (1, False, True):  # the default path's launch
            assert np.array_equal(vec, default)
        else:  # the same arithmetic in another code shape (the compiler may contract it otherwise)
            assert np.abs(vec - default).max() <= 2**-6 * max(np.abs(default).max(), 1e-30)


def test_vector_qkv_write_refuses_what_it_cannot_pair(cuda_backend):
    from openinfer.backend.cuda.qkv_write import vector_qkv_write_supported

    rope = RotaryEmbedding.create(128, RopeParameters(theta=10000.0, partial_rotary_factor=0.75), 512)  # 96 dims
    assert not vector_qkv_write_supported(AttentionSpec(4, 2, 128, rope, 1.0, None, None, EPS))
    assert vector_qkv_write_supported(AttentionSpec(4, 2, 128, None, 1.0, None, None, EPS))
