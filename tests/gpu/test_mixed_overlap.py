"""OPENINFER_MIXED_OVERLAP (opt-in "1"; off by default): a mixed step's decode rows attend on a second stream beside the
prompt chunks' prefill attention. The same kernels on the same inputs: the same bits as the
one-stream mixed attention, through the backend's attention op as through the function."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.base import AttentionSpec, KVLayer
from openinfer.backend.cuda.bf16 import float_to_bf16_bits
from tests.gpu.conftest import BLOCK_SIZE, bf16_random, paged_batch

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

# running decodes first (one new token each, at least MIXED_MIN_DECODE_ROWS of them), then chunks
DECODE_CONTEXTS = [300, 47, 900, 16, 1, 250, 0, 33, 129, 64, 700, 5, 15, 17, 400, 90, 1000, 3]
CASES = {
    "decodes-then-a-chunk": (8, 2, DECODE_CONTEXTS + [0], [1] * 18 + [300]),
    "decodes-then-chunks": (32, 8, DECODE_CONTEXTS + [0, 200, 0], [1] * 18 + [257, 64, 1024]),
}


@pytest.fixture
def mixed_choices(monkeypatch):
    """Decode rows on the decode kernel (the split the overlap runs on), no short-query routing."""
    from openinfer.backend.cuda.attention import MIXED_DECODE_ENV, SHORT_QUERY_ENV, refresh_kernel_choices

    monkeypatch.setenv(MIXED_DECODE_ENV, "1")
    monkeypatch.setenv(SHORT_QUERY_ENV, "0")
    refresh_kernel_choices()
    yield
    monkeypatch.undo()
    refresh_kernel_choices()


def mixed_problem(rng, num_heads, num_kv_heads, cached, new, backend):
    head_dim = 128
    num_blocks = 3 + sum(-(-(c + n) // BLOCK_SIZE) for c, n in zip(cached, new, strict=True))
    batch = paged_batch(rng, cached, new, num_blocks)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kv = KVLayer(backend.upload(bf16_random(rng, *shape)), backend.upload(bf16_random(rng, *shape)))
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, None, head_dim**-0.5, None, None, 1e-6)
    return batch, kv, spec


@pytest.mark.parametrize("case", list(CASES))
def test_two_streams_give_the_one_stream_bits(cuda_backend, rng, case, mixed_choices):
    from openinfer.backend.cuda.attention import mixed_attention, mixed_split

    num_heads, num_kv_heads, cached, new = CASES[case]
    batch, kv, spec = mixed_problem(rng, num_heads, num_kv_heads, cached, new, cuda_backend)
    device_batch = cuda_backend.prepare_batch(batch)
    split = mixed_split(device_batch)
    assert split is not None and split.decode_rows == 18
    q = cupy.asarray(float_to_bf16_bits(bf16_random(rng, batch.num_tokens, num_heads, 128, scale=2.0)))
    one_stream = cupy.asnumpy(mixed_attention(q, spec, kv, device_batch, split, cuda_backend.num_sms))
    side = cupy.cuda.Stream(non_blocking=True)
    for _ in range(3):  # repeated: the side stream's rows are joined before each result is read
        two_streams = cupy.asnumpy(mixed_attention(q, spec, kv, device_batch, split, cuda_backend.num_sms,
                                                   decode_stream=side))
        np.testing.assert_array_equal(two_streams, one_stream)


def test_the_backend_switch_routes_only_mixed_steps(cuda_backend, rng, mixed_choices):
    """``CudaBackend.attention`` with ``mixed_overlap`` on: a mixed step's output and KV writes
    equal the default path's; a plain decode step takes the decode kernel as before."""
    num_heads, num_kv_heads, cached, new = CASES["decodes-then-chunks"]
    batch, kv, spec = mixed_problem(rng, num_heads, num_kv_heads, cached, new, cuda_backend)
    device_batch = cuda_backend.prepare_batch(batch)
    qkv = cupy.asarray(float_to_bf16_bits(bf16_random(rng, batch.num_tokens, (num_heads + 2 * num_kv_heads) * 128)))
    saved = cuda_backend.mixed_overlap
    try:
        cuda_backend.mixed_overlap = False
        default = cupy.asnumpy(cuda_backend.attention(qkv, spec, kv, device_batch))
        k_default, v_default = cupy.asnumpy(kv.k), cupy.asnumpy(kv.v)
        cuda_backend.mixed_overlap = True
        overlapped = cupy.asnumpy(cuda_backend.attention(qkv, spec, kv, device_batch))
        np.testing.assert_array_equal(overlapped, default)
        np.testing.assert_array_equal(cupy.asnumpy(kv.k), k_default)
        np.testing.assert_array_equal(cupy.asnumpy(kv.v), v_default)

        decode = cuda_backend.prepare_batch(paged_batch(rng, [40, 7, 300], [1, 1, 1], kv.k.shape[0]))
        decode_qkv = qkv[:3]
        cuda_backend.mixed_overlap = False
        expected = cupy.asnumpy(cuda_backend.attention(decode_qkv, spec, kv, decode))
        cuda_backend.mixed_overlap = True
        np.testing.assert_array_equal(cupy.asnumpy(cuda_backend.attention(decode_qkv, spec, kv, decode)), expected)
    finally:
        cuda_backend.mixed_overlap = saved


def test_a_bad_switch_value_is_refused(monkeypatch):
    from openinfer.backend import cuda_available

    if not cuda_available():
        pytest.skip("needs CuPy and an NVIDIA GPU")
    from openinfer.backend.cuda import CudaBackend
    from openinfer.backend.cuda.backend import MIXED_OVERLAP_ENV

    monkeypatch.setenv(MIXED_OVERLAP_ENV, "yes")
    with pytest.raises(ValueError, match=MIXED_OVERLAP_ENV):
        CudaBackend()
