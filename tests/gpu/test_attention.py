"""cuda attention (q/k norm + RoPE + paged KV write + decode / prefill attention) against NumPy,
on ragged batches whose contexts end on, before and after block boundaries, with shuffled
block tables and pre-filled KV."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.base import AttentionSpec, ForwardBatch, KVLayer
from openinfer.backend.cuda.bf16 import round_to_bf16
from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.rope import RopeParameters, RotaryEmbedding
from tests.gpu.conftest import bf16_random, relative_error

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

REF = NumpyBackend()
BLOCK_SIZE = 16


def make_batch(rng: np.random.Generator, cached: list[int], new: list[int], num_blocks: int) -> ForwardBatch:
    lengths = [c + n for c, n in zip(cached, new, strict=True)]
    max_blocks = max(-(-length // BLOCK_SIZE) for length in lengths) + 1  # +1: a padded null entry
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(lengths), max_blocks), np.int32)
    for i, length in enumerate(lengths):
        for j in range(-(-length // BLOCK_SIZE)):
            tables[i, j] = free.pop()
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new, strict=True)]).astype(np.int32)
    seq_of_token = np.repeat(np.arange(len(new)), new)
    slots = tables[seq_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return ForwardBatch(
        token_ids=rng.integers(0, 100, size=int(sum(new))).astype(np.int32), positions=positions,
        query_start=query_start, context_lens=np.asarray(lengths, np.int32), block_tables=tables,
        slot_mapping=slots.astype(np.int32), logits_rows=(query_start[1:] - 1).astype(np.int32),
        max_query_len=max(new), max_context_len=max(lengths))


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
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_numpy(cuda_backend, rng, case):
    head_dim, nh, nkv, cached, new, qk_norm, rotary_factor = CASES[case]
    num_blocks = 2 + sum(-(-(c + n) // BLOCK_SIZE) for c, n in zip(cached, new, strict=True))
    rope = None
    if rotary_factor:
        rope = RotaryEmbedding.create(head_dim, RopeParameters(theta=10000.0, partial_rotary_factor=rotary_factor),
                                      1024)
    q_norm = round_to_bf16(1 + 0.3 * bf16_random(rng, head_dim)) if qk_norm else None
    k_norm = round_to_bf16(1 + 0.3 * bf16_random(rng, head_dim)) if qk_norm else None
    spec_ref = AttentionSpec(nh, nkv, head_dim, rope, head_dim**-0.5, q_norm, k_norm, 1e-6)
    spec = AttentionSpec(nh, nkv, head_dim, rope, head_dim**-0.5,
                         None if q_norm is None else cuda_backend.weight(q_norm),
                         None if k_norm is None else cuda_backend.weight(k_norm), 1e-6)
    batch = make_batch(rng, cached, new, num_blocks)
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
    batch = make_batch(rng, [0, 20, 5], [30, 1, 70], 20)
    device = cuda_backend.prepare_batch(batch)
    for name in ("token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping",
                 "logits_rows"):
        assert np.array_equal(cupy.asnumpy(getattr(device, name)), getattr(batch, name)), name
    assert device.num_tiles == 1 + 1 + 1  # 128-query tiles: 30 -> 1, 1 -> 1, 70 -> 1
