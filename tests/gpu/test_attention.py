"""cuda attention (q/k norm + RoPE + paged KV write + decode / prefill attention) against NumPy,
on ragged batches whose contexts end on, before and after block boundaries, with shuffled
block tables and pre-filled KV."""

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


CASES = {
    # name: (head_dim, num_heads, num_kv_heads, cached, new, qk_norm, rotary_factor)
    "decode-gqa4-boundaries": (128, 8, 2, [0, 14, 15, 16, 299], [1] * 5, True, 1.0),
    "decode-gqa8": (128, 16, 2, [40, 700], [1, 1], True, 1.0),
    "decode-mha-d64": (64, 4, 4, [31, 32, 33], [1, 1, 1], True, 1.0),
    "decode-d256-partial-rope": (256, 4, 2, [5, 130], [1, 1], False, 0.5),
    "decode-d32": (32, 4, 1, [17, 3], [1, 1], True, 1.0),
    "prefill-mixed-chunked": (128, 8, 2, [0, 50, 32, 16], [100, 37, 1, 130], True, 1.0),
    "prefill-mha-d64-long": (64, 4, 4, [0], [200], True, 1.0),
    "prefill-gqa8-chunks": (128, 16, 2, [64, 3], [64, 65], True, 1.0),
    "prefill-no-norm-no-rope": (128, 4, 2, [10], [20], False, 0.0),
    "prefill-gqa2-prefix-hit": (128, 16, 8, [64], [16], True, 1.0),
    "decode-gqa2": (128, 16, 8, [79, 100, 0], [1, 1, 1], True, 1.0),
    "prefill-32-prompts": (128, 16, 8, [0] * 32, [80, 82, 48, 32, 26, 72, 26, 16, 30, 22, 50, 69, 42, 72, 88, 67, 95,
                                                  76, 79, 18, 85, 91, 54, 75, 21, 73, 20, 42, 89, 59, 71, 94], True, 1.0),
    # a warm prefix's last block over a long cached context, and short steps mixed with decode tokens
    "short-warm-tail": (128, 32, 8, [2032], [16], True, 1.0),
    "short-mixed-with-decode": (128, 8, 2, [300, 7, 0, 64], [5, 1, 12, 16], True, 1.0),
    "short-d64-gqa3": (64, 6, 2, [90, 33], [9, 2], True, 1.0),
}
# steps of at most SHORT_QUERY_MAX_TOKENS new tokens per sequence that are not plain decode
SHORT_CASES = [name for name, case in CASES.items() if max(case[4]) > 1 and max(case[4]) <= 16]


@pytest.fixture
def kernel_switches(monkeypatch):
    """Set attention kernel environment switches for one test; they are re-read before and after."""
    from openinfer.backend.cuda.attention import refresh_kernel_choices

    def switch(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        refresh_kernel_choices()
    refresh_kernel_choices()
    yield switch
    monkeypatch.undo()
    refresh_kernel_choices()


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_numpy(cuda_backend, rng, case):
    check_attention_case(cuda_backend, rng, case)


@pytest.mark.parametrize("case", SHORT_CASES)
@pytest.mark.parametrize("short_query", ["0", "1"])
def test_short_steps_with_the_short_query_kernel_on_and_off(cuda_backend, rng, case, short_query, kernel_switches):
    from openinfer.backend.cuda.attention import SHORT_QUERY_ENV, runs_short_query_kernel

    kernel_switches(**{SHORT_QUERY_ENV: short_query})
    head_dim, nh, nkv, cached, new = CASES[case][:5]
    spec = AttentionSpec(nh, nkv, head_dim, None, 1.0, None, None, 1e-6)
    device_batch = cuda_backend.prepare_batch(paged_batch(rng, cached, new, 4 + sum(cached) // 8))
    assert runs_short_query_kernel(spec, device_batch) == (short_query == "1")
    check_attention_case(cuda_backend, rng, case)


@pytest.mark.parametrize("below", [1, 0])
def test_short_query_auto_goes_by_the_longest_context(cuda_backend, rng, below, kernel_switches):
    """The default ("auto"): the short-query kernel from SHORT_QUERY_MIN_CONTEXT tokens of context,
    the prefill kernel one token below it."""
    from openinfer.backend.cuda.attention import SHORT_QUERY_ENV, runs_short_query_kernel
    from openinfer.backend.cuda.attention_routing import SHORT_QUERY_MIN_CONTEXT

    kernel_switches(**{SHORT_QUERY_ENV: "auto"})
    spec = AttentionSpec(8, 2, 128, None, 1.0, None, None, 1e-6)
    cached = [SHORT_QUERY_MIN_CONTEXT - 16 - below, 10]
    device_batch = cuda_backend.prepare_batch(paged_batch(rng, cached, [16, 3], 4 + sum(cached) // 8))
    assert runs_short_query_kernel(spec, device_batch) == (below == 0)


def check_attention_case(cuda_backend, rng, case: str) -> None:
    head_dim, nh, nkv, cached, new, qk_norm, rotary_factor = CASES[case]
    num_blocks = 2 + sum(-(-(c + n) // BLOCK_SIZE) for c, n in zip(cached, new, strict=True))
    rope = None
    if rotary_factor:
        rope = RotaryEmbedding.create(head_dim, RopeParameters(theta=10000.0, partial_rotary_factor=rotary_factor),
                                      4096)
    q_norm = round_to_bf16(1 + 0.3 * bf16_random(rng, head_dim)) if qk_norm else None
    k_norm = round_to_bf16(1 + 0.3 * bf16_random(rng, head_dim)) if qk_norm else None
    spec_ref = AttentionSpec(nh, nkv, head_dim, rope, head_dim**-0.5, q_norm, k_norm, 1e-6)
    spec = AttentionSpec(nh, nkv, head_dim, rope, head_dim**-0.5,
                         None if q_norm is None else cuda_backend.weight(q_norm),
                         None if k_norm is None else cuda_backend.weight(k_norm), 1e-6)
    batch = paged_batch(rng, cached, new, num_blocks, vocab=100)
    shape = (num_blocks, BLOCK_SIZE, nkv, head_dim)
    k_init, v_init = bf16_random(rng, *shape), bf16_random(rng, *shape)
    k_init[0] = v_init[0] = 0  # the null block
    kv_ref = KVLayer(k_init.copy(), v_init.copy())
    kv = KVLayer(cuda_backend.upload(k_init), cuda_backend.upload(v_init))
    qkv = bf16_random(rng, batch.num_tokens, (nh + 2 * nkv) * head_dim)

    expected = REF.attention(qkv, spec_ref, kv_ref, batch)
    out = cuda_backend.to_host(cuda_backend.attention(cuda_backend.upload(qkv), spec, kv,
                                                      cuda_backend.prepare_batch(batch)))
    assert out.shape == expected.shape
    assert relative_error(out, expected) < 2e-2
    slots = batch.slot_mapping
    k_flat, v_flat = cuda_backend.to_host(kv.k).reshape(-1, nkv, head_dim), cuda_backend.to_host(kv.v).reshape(-1, nkv, head_dim)
    assert relative_error(k_flat[slots], kv_ref.k.reshape(-1, nkv, head_dim)[slots]) < 1e-2
    assert np.array_equal(v_flat[slots], kv_ref.v.reshape(-1, nkv, head_dim)[slots])
    untouched = np.setdiff1d(np.arange(k_flat.shape[0]), slots)
    assert np.array_equal(k_flat[untouched], k_init.reshape(-1, nkv, head_dim)[untouched])


def test_prepare_batch_round_trip(cuda_backend, rng):
    batch = paged_batch(rng, [0, 20, 5], [30, 1, 70], 20, vocab=100)
    device = cuda_backend.prepare_batch(batch)
    for name in ("token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping",
                 "logits_rows"):
        assert np.array_equal(cupy.asnumpy(getattr(device, name)), getattr(batch, name)), name
    assert device.num_tiles == 1 + 1 + 1  # 128-query tiles: 30 -> 1, 1 -> 1, 70 -> 1


# --- decode attention kernels (openinfer.backend.cuda.decode_attention) ------------------------------

DECODE_CASES = {
    # name: (num_heads, num_kv_heads, head_dim, block_size, context lengths, or (batch, max context))
    "bs1-ctx1": (32, 8, 128, 16, [1]),
    "bs1-ctx4100": (32, 8, 128, 16, [4100]),
    "bs3-edges": (32, 8, 128, 16, [1, 16, 4099]),
    "bs64-to-4100": (32, 8, 128, 16, (64, 4100)),
    "bs256-to-1100": (32, 8, 128, 16, (256, 1100)),
    "gqa8-d128": (16, 2, 128, 16, [33, 700, 1]),
    "gqa16-d128": (32, 2, 128, 16, [17, 515]),
    "mha-d128": (4, 4, 128, 16, [15, 16, 2000]),
    "mha-d64": (4, 4, 64, 16, [31, 32, 33]),
    "gqa8-d256": (16, 2, 256, 16, [5, 300, 2049]),
    "gqa4-d256-bs64": (8, 2, 256, 16, (64, 1500)),
    "gqa4-block32": (8, 2, 128, 32, [31, 100, 1025]),
    "gqa4-block8": (8, 2, 128, 8, [7, 100, 1025]),
    "gqa4-d32-split-only": (8, 2, 32, 16, [3, 40]),
    "gqa32-d64-split-only": (32, 1, 64, 16, [3, 140]),
}


def _bf16_device(shape: tuple[int, ...]) -> cupy.ndarray:
    """Random normal bf16 bits on the device (values exactly representable, never all zero)."""
    return (cupy.random.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)


def _bf16_host(x: cupy.ndarray) -> np.ndarray:
    return (cupy.asnumpy(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _decode_inputs(rng: np.random.Generator, lengths: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int) -> tuple:
    """q, k/v caches and shuffled, non-contiguous block tables (padded with the null block 0)."""
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = 1 + sum(blocks) + 7  # + unused blocks, so tables skip some
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(lengths), max(blocks + [1]) + 2), np.int32)
    for i, count in enumerate(blocks):
        tables[i, :count] = [free.pop() for _ in range(count)]
    q = _bf16_device((len(lengths), num_heads, head_dim))
    k = _bf16_device((num_blocks, block_size, num_kv_heads, head_dim))
    v = _bf16_device((num_blocks, block_size, num_kv_heads, head_dim))
    return q, k, v, tables, np.asarray(lengths, np.int32)


def _decode_reference(q, k, v, tables: np.ndarray, lengths: np.ndarray, scale: float) -> np.ndarray:
    """float64 softmax(q K^T * scale) V per sequence and query head; zeros for empty contexts."""
    qh, kh, vh = _bf16_host(q), _bf16_host(k), _bf16_host(v)
    num_seqs, num_heads, head_dim = qh.shape
    block_size, num_kv_heads = kh.shape[1], kh.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros((num_seqs, num_heads, head_dim))
    for i, length in enumerate(lengths):
        if length == 0:
            continue
        rows = tables[i, : -(-length // block_size)]
        keys = kh[rows].reshape(-1, num_kv_heads, head_dim)[:length]
        values = vh[rows].reshape(-1, num_kv_heads, head_dim)[:length]
        queries = qh[i].reshape(num_kv_heads, group, head_dim)
        scores = np.einsum("hgd,thd->hgt", queries, keys) * scale
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[i] = np.einsum("hgt,thd->hgd", probs, values).reshape(num_heads, head_dim)
    return out.reshape(num_seqs, num_heads * head_dim)


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_attention_kernels_match_numpy(cuda_backend, rng, case):
    from openinfer.backend.cuda.decode_attention import mma_supports, paged_decode_attention

    num_heads, num_kv_heads, head_dim, block_size, lengths = DECODE_CASES[case]
    if isinstance(lengths, tuple):  # (batch, max context): random lengths, the extremes included
        batch, longest = lengths
        lengths = [1, longest, *rng.integers(1, longest + 1, batch - 2).tolist()]
    q, k, v, tables, lens = _decode_inputs(rng, lengths, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    expected = _decode_reference(q, k, v, tables, lens, scale)
    kernels = ["split"] + (["mma"] if mma_supports(head_dim, num_heads // num_kv_heads) else [])
    for name in kernels:
        out = paged_decode_attention(q, k, v, cupy.asarray(tables), cupy.asarray(lens), scale,
                                     cuda_backend.num_sms, kernel_name=name)
        assert out.shape == expected.shape
        assert relative_error(cuda_backend.to_host(out), expected) < 1e-2, name


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 32])
def test_decode_attention_mma_any_split_count(cuda_backend, rng, splits):
    """Every split count merges to the same answer, including splits with no keys at all."""
    from openinfer.backend.cuda.decode_attention import decode_attention_mma

    lengths = [1, 15, 16, 17, 64, 65, 1000, 0]
    q, k, v, tables, lens = _decode_inputs(rng, lengths, 32, 8, 128, 16)
    expected = _decode_reference(q, k, v, tables, lens, 0.1)
    out = decode_attention_mma(q, k, v, cupy.asarray(tables), cupy.asarray(lens), 0.1, cuda_backend.num_sms,
                               splits=splits)
    result = cuda_backend.to_host(out)
    assert relative_error(result, expected) < 1e-2
    assert np.array_equal(result[-1], np.zeros_like(result[-1]))  # empty context -> zeros


@pytest.mark.parametrize("kernel_name", ["mma", "split"])
def test_decode_attention_in_a_captured_graph(cuda_backend, rng, kernel_name):
    """A graph captured once serves new contexts (lengths, tables, q, KV) through the same buffers;
    padded sequences (length 0) give zeros, as the graph runner's buckets need."""
    from openinfer.backend.cuda.decode_attention import paged_decode_attention

    num_heads, num_kv_heads, head_dim, width, num_blocks = 32, 8, 128, 80, 200
    q = _bf16_device((4, num_heads, head_dim))
    k = _bf16_device((num_blocks, 16, num_kv_heads, head_dim))
    v = _bf16_device((num_blocks, 16, num_kv_heads, head_dim))
    tables = cupy.zeros((4, width), cupy.int32)
    lens = cupy.zeros(4, cupy.int32)

    def refill(lengths: list[int]) -> None:
        blocks = rng.permutation(np.arange(1, num_blocks))
        host = np.zeros((4, width), np.int32)
        used = 0
        for i, length in enumerate(lengths):
            count = -(-length // 16)
            host[i, :count] = blocks[used:used + count]
            used += count
        tables[...] = cupy.asarray(host)
        lens[...] = cupy.asarray(np.asarray(lengths, np.int32))
        q[...] = _bf16_device(q.shape)

    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(pool.malloc), stream:
        refill([5, 300, 1, 0])
        paged_decode_attention(q, k, v, tables, lens, 0.2, cuda_backend.num_sms, kernel_name=kernel_name)
        stream.synchronize()
        stream.begin_capture()
        out = paged_decode_attention(q, k, v, tables, lens, 0.2, cuda_backend.num_sms, kernel_name=kernel_name)
        graph = stream.end_capture()
        for lengths in ([5, 300, 1, 0], [1200, 16, 17, 0], [1, 1, 1, 1], [0, 0, 0, 1279]):
            refill(lengths)
            graph.launch(stream)
            stream.synchronize()
            expected = _decode_reference(q, k, v, cupy.asnumpy(tables), np.asarray(lengths), 0.2)
            result = cuda_backend.to_host(out)
            assert relative_error(result, expected) < 1e-2, lengths
            empty = np.asarray(lengths) == 0
            assert np.array_equal(result[empty], np.zeros_like(result[empty]))


@pytest.mark.parametrize(("kernel_name", "splits"), [("mma", 1), ("mma", 5), ("split", None)])
def test_decode_attention_writes_out_in_place(cuda_backend, rng, kernel_name, splits):
    """``out=`` a view of the first rows of a larger output (a mixed step's decode rows): the same
    bits as a fresh output, the rows after it untouched, the view itself returned."""
    from openinfer.backend.cuda.decode_attention import decode_attention_mma, paged_decode_attention

    lengths = [1, 17, 300, 1000, 64]
    q, k, v, tables, lens = _decode_inputs(rng, lengths, 32, 8, 128, 16)
    tables, lens = cupy.asarray(tables), cupy.asarray(lens)
    whole = cupy.full((len(lengths) + 3, 32 * 128), 0x3F80, dtype=cupy.uint16)  # 1.0 in bf16
    rows = whole[:len(lengths)]
    if kernel_name == "mma":  # an explicit split count: one (the kernel writes out) and several (the merge does)
        fresh = decode_attention_mma(q, k, v, tables, lens, 0.1, cuda_backend.num_sms, splits=splits)
        result = decode_attention_mma(q, k, v, tables, lens, 0.1, cuda_backend.num_sms, splits=splits, out=rows)
    else:
        fresh = paged_decode_attention(q, k, v, tables, lens, 0.1, cuda_backend.num_sms, kernel_name="split")
        result = paged_decode_attention(q, k, v, tables, lens, 0.1, cuda_backend.num_sms, kernel_name="split",
                                        out=rows)
    assert result.data.ptr == whole.data.ptr and result.shape == fresh.shape
    assert cupy.array_equal(whole[:len(lengths)], fresh)
    assert bool((whole[len(lengths):] == 0x3F80).all())
    with pytest.raises(ValueError, match="out must be"):
        paged_decode_attention(q, k, v, tables, lens, 0.1, cuda_backend.num_sms, kernel_name=kernel_name,
                               out=whole[:, :64])


def test_a_mixed_step_uploads_its_chunk_tiles_as_one_range(cuda_backend, rng):
    """The uploaded tiles put the leading decodes' last: the mixed split runs one prefill launch."""
    from openinfer.backend.cuda.attention import mixed_split

    batch = paged_batch(rng, [100] * 20 + [0, 40], [1] * 20 + [300, 5], num_blocks=400)
    device_batch = cuda_backend.prepare_batch(batch)
    split = mixed_split(device_batch)
    assert split is not None and split.decode_rows == 20 and split.prefill_tile_ranges == ((0, 4),)
    assert np.array_equal(cupy.asnumpy(device_batch.tile_seq), device_batch.host_tile_seq)
    assert cupy.asnumpy(device_batch.tile_seq)[4:].tolist() == list(range(20))
