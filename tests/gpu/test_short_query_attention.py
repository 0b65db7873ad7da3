"""The short-query attention kernel's two layouts (decode_attention.short_query_attention_mma,
tiles "warp" and "shared") against a float64 NumPy causal attention over the same paged cache:
warm-prefix tails of 16 tokens over 1k / 4k / 16k cached tokens at the Qwen3-4B heads (32 query,
8 KV, head_dim 128), several sequences of ragged contexts and query lengths, GQA 16 (several row
groups of the shared layout), head_dim 64 and 256 (Qwen3.5's full-attention heads), at the tuned
split count and at 1 and 32 splits; an output poisoned with NaN before each run so every unwritten element shows. The
OPENINFER_SHORT_QUERY_TILES switch is parsed and checked; the shared layout also with the opt-in
softmax per 64-key tile (OPENINFER_SHORT_QUERY_SOFTMAX=tile)."""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

from openinfer.backend.cuda.bf16 import bf16_bits_to_float, float_to_bf16_bits
from tests.gpu.conftest import relative_error
from tests.gpu.test_prefill_attention import paged_problem

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CASES = {
    # name: (head_dim, num_heads, num_kv_heads, cached tokens per sequence, new tokens per sequence)
    "warm-tail-1k": (128, 32, 8, [1008], [16]),
    "warm-tail-4k": (128, 32, 8, [4080], [16]),
    "warm-tail-16k": (128, 32, 8, [16368], [16]),
    "ragged-16k-and-short": (128, 32, 8, [16000, 37, 2100], [16, 5, 9]),
    "gqa16-row-groups": (128, 16, 1, [3000, 200], [16, 11]),
    "d64-mha": (64, 4, 4, [130, 0], [16, 7]),
    "d256-gqa2": (256, 4, 2, [333, 17], [5, 16]),
    "d256-gqa4-qwen35-full-attention": (256, 16, 4, [5000], [16]),
}


@functools.cache
def problem(case: str) -> tuple:
    """The case's paged step and NumPy reference, made once for all its layouts and split counts
    (the float64 reference over 16k keys is the slow part)."""
    head_dim, num_heads, num_kv_heads, cached, new = CASES[case]
    return paged_problem(np.random.default_rng(zlib.crc32(case.encode())), head_dim, num_heads, num_kv_heads,
                         cached, new)


@pytest.mark.parametrize("splits", [None, 1, 32])  # (odd counts: tests/core/test_attention_kernels_emulated.py)
@pytest.mark.parametrize("tiles", ["warp", "shared", "shared-tile-softmax"])
@pytest.mark.parametrize("case", list(CASES))
def test_short_query_layouts_match_numpy(cuda_backend, case, tiles, splits, monkeypatch):
    from openinfer.backend.cuda import decode_attention_plan
    from openinfer.backend.cuda.decode_attention import short_query_attention_mma

    if tiles == "shared-tile-softmax":  # the opt-in softmax per 64-key tile (OPENINFER_SHORT_QUERY_SOFTMAX=tile)
        monkeypatch.setenv(decode_attention_plan.SHORT_QUERY_SOFTMAX_ENV, "tile")
        tiles = "shared"
    decode_attention_plan.wanted_tile_softmax.cache_clear()

    num_heads, head_dim = CASES[case][1], CASES[case][0]
    batch, k_cache, v_cache, q, scale, expected = problem(case)
    device_batch = cuda_backend.prepare_batch(batch)
    out = cupy.full((batch.num_tokens, num_heads * head_dim), 0x7FC0, dtype=cupy.uint16)  # bf16 NaN
    result = short_query_attention_mma(cupy.asarray(float_to_bf16_bits(q)), cuda_backend.upload(k_cache),
                                       cuda_backend.upload(v_cache), device_batch.block_tables,
                                       device_batch.context_lens, device_batch.query_start, batch.max_query_len,
                                       scale, cuda_backend.num_sms, splits=splits, tiles=tiles, out=out)
    decode_attention_plan.wanted_tile_softmax.cache_clear()  # the switch as the environment has it again
    assert result is out
    ours = bf16_bits_to_float(cupy.asnumpy(out))
    assert relative_error(ours, expected) < 1e-2
    rows = np.abs(ours - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-6)
    assert rows.max() < 0.1, int(rows.argmax())


def test_the_tiles_switch_is_read_and_checked(monkeypatch, cuda_backend):
    from openinfer.backend.cuda import decode_attention_plan as decode_attention

    for value in ("warp", "shared"):
        monkeypatch.setenv(decode_attention.SHORT_QUERY_TILES_ENV, value)
        decode_attention.wanted_short_query_tiles.cache_clear()
        assert decode_attention.wanted_short_query_tiles() == value
    monkeypatch.setenv(decode_attention.SHORT_QUERY_TILES_ENV, "wide")
    decode_attention.wanted_short_query_tiles.cache_clear()
    with pytest.raises(ValueError, match="OPENINFER_SHORT_QUERY_TILES"):
        decode_attention.wanted_short_query_tiles()
    monkeypatch.delenv(decode_attention.SHORT_QUERY_TILES_ENV)
    decode_attention.wanted_short_query_tiles.cache_clear()
