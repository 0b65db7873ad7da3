"""core's tensor-core decode attention kernels (``kernels/decode_attention_mma.cu``) compiled with
g++ against the host stand-in for the CUDA built-ins (tests/helpers/cuda_host; mma.sync, ldmatrix
and cp.async emulated lane by lane) and run on the CPU against a float64 NumPy attention over the
same paged cache: the decode kernel and the short-query kernel (a few new tokens per sequence,
each with its own causal limit), with one split (direct write) and several (partials + merge,
including splits with no keys), GQA groups whose rows do not fill the mma tile, block sizes that
are and are not multiples of the 16-key tile, shuffled non-contiguous blocks. Launch glue and
speed: tests/gpu/test_attention.py and benchmarks/gpu_decode_attention.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from openinfer import bf16_to_float32, float32_to_bf16
from tests.helpers.cuda_emulation import compile_harness, read_array, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "attention_harness.cpp"
LOG2E = 1.4426950408889634
MMA_ROWS = 16  # rows of one mma row block (decode_attention_mma.cu)
SHARED_TILE_WARPS = 4  # mma row blocks of one short_query_attention_shared block

# name: (head_dim, group, num_kv_heads, cached tokens per sequence, new tokens per sequence, block size, splits)
SHORT_QUERY_CASES = {
    "warm-tail-16-gqa4": (64, 4, 2, [300], [16], 16, 3),
    "mixed-short-direct": (64, 4, 1, [40, 0, 129], [5, 3, 9], 16, 1),
    "mixed-short-empty-splits": (64, 4, 1, [4, 0, 129], [5, 3, 9], 16, 4),
    "group3-ragged": (64, 3, 2, [70, 17], [7, 11], 16, 2),
    "group1-block8": (64, 1, 2, [50], [19], 8, 2),
    "d128-group8": (128, 8, 1, [100, 30], [5, 2], 16, 2),
}
DECODE_CASES = {
    "decode-gqa4": (64, 4, 2, [0, 36, 199], [1, 1, 1], 16, 3),
    "decode-d128-group8-direct": (128, 8, 1, [49, 80], [1, 1], 16, 1),
}


def bf16(x) -> np.ndarray:
    return bf16_to_float32(float32_to_bf16(np.asarray(x, np.float32)))


def paged_case(rng, cached: list[int], new: list[int], block_size: int):
    """Block tables over shuffled blocks (block 0 is the null block), context lengths, query starts."""
    lengths = [c + n for c, n in zip(cached, new, strict=True)]
    blocks_per_seq = [-(-length // block_size) for length in lengths]
    ids = rng.permutation(np.arange(1, 1 + sum(blocks_per_seq))).astype(np.int32)
    tables = np.zeros((len(lengths), max(blocks_per_seq) + 1), np.int32)
    offset = 0
    for i, count in enumerate(blocks_per_seq):
        tables[i, :count] = ids[offset:offset + count]
        offset += count
    query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return tables, np.asarray(lengths, np.int32), query_start, 1 + len(ids)


def reference(q, k_cache, v_cache, tables, lengths, query_start, block_size, scale) -> np.ndarray:
    """float64 causal attention: new token j of n sees cache positions 0 .. length - n + j."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    out = np.zeros((num_tokens, num_heads, head_dim))
    for b, length in enumerate(lengths):
        start, end = query_start[b], query_start[b + 1]
        positions = np.arange(length)
        slots = tables[b, positions // block_size] * block_size + positions % block_size
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].astype(np.float64)
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].astype(np.float64)
        query_pos = length - (end - start) + np.arange(end - start)
        visible = positions[None, :] <= query_pos[:, None]
        for h in range(num_heads):
            scores = np.where(visible, q[start:end, h].astype(np.float64) @ keys[:, h // group].T * scale, -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[start:end, h] = (weights / weights.sum(axis=1, keepdims=True)) @ values[:, h // group]
    return out.reshape(num_tokens, num_heads * head_dim)


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    built: dict[tuple[int, int], Path] = {}

    def get(head_dim: int, group: int, tile_softmax: int = 0) -> Path:
        key = (head_dim, group, tile_softmax)
        if key not in built:
            tmp = tmp_path_factory.mktemp(f"attention-{head_dim}-{group}-{tile_softmax}")
            built[key] = compile_harness(HARNESS, REPO / "core" / "kernels", tmp / "harness",
                                         {"HEAD_DIM": head_dim, "GROUP": group, "SQ_TILE_SOFTMAX": tile_softmax})
        return built[key]
    return get


def run_case(harnesses, tmp_path: Path, case: tuple, short_query: bool, shared_tiles: bool = False,
             tile_softmax: int = 0) -> None:
    head_dim, group, num_kv_heads, cached, new, block_size, splits = case
    rng = np.random.default_rng(sum(cached) * 31 + head_dim + group)
    tables, lengths, query_start, num_blocks = paged_case(rng, cached, new, block_size)
    num_heads, num_tokens = num_kv_heads * group, int(query_start[-1])
    k_cache = bf16(rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)))
    v_cache = bf16(rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)))
    q = bf16(2.0 * rng.standard_normal((num_tokens, num_heads, head_dim)))  # sharp softmax rows too
    scale = head_dim**-0.5
    # the launcher's row blocks: 16 // group new tokens each (decode_attention.py); the shared-tile
    # kernel's row groups: 4 such blocks each
    row_blocks = math.ceil(max(new) / (MMA_ROWS // group)) if short_query else 1
    if shared_tiles:
        row_blocks = math.ceil(row_blocks / SHARED_TILE_WARPS)
    params = np.array([2 if shared_tiles else int(short_query), len(lengths), num_tokens, num_kv_heads, block_size, tables.shape[1],
                       splits, row_blocks], np.int32)
    run_harness(harnesses(head_dim, group, tile_softmax), tmp_path, params=params,
                scale_log2=np.array([scale * LOG2E], np.float32), q=float32_to_bf16(q),
                k_cache=float32_to_bf16(k_cache), v_cache=float32_to_bf16(v_cache), block_tables=tables,
                context_lens=lengths, query_start=query_start)
    ours = read_array(tmp_path, "out", np.uint16, (num_tokens, num_heads * head_dim))
    expected = reference(q, k_cache, v_cache, tables, lengths, query_start, block_size, scale)
    assert np.isfinite(ours).all(), "a row was left unwritten"
    rows = np.abs(ours - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-6)
    assert rows.max() < 2e-2, int(rows.argmax())


@pytest.mark.parametrize("name", list(SHORT_QUERY_CASES))
def test_short_query_kernel_matches_numpy(harnesses, tmp_path, name):
    run_case(harnesses, tmp_path, SHORT_QUERY_CASES[name], short_query=True)


# the shared-tile kernel's own shapes besides the cases above: several row groups (group 8 and 16:
# 2 and 1 tokens a warp), a split boundary inside a 64-key tile's reach, warps with no tokens
# (3 new tokens at group 4: one of four warps busy), 32 splits over a long context
SHARED_TILE_CASES = {
    **SHORT_QUERY_CASES,
    "group16-row-groups": (64, 16, 1, [90, 33], [16, 9], 16, 3),
    "group8-d128-two-groups": (128, 8, 1, [200], [16], 16, 4),
    "gqa4-one-busy-warp": (64, 4, 2, [150, 70], [3, 16], 16, 2),
    "gqa4-32-splits-long": (64, 4, 1, [2300], [16], 16, 32),
    "d256-gqa2": (256, 2, 1, [100], [12], 16, 2),
}


@pytest.mark.parametrize("tile_softmax", [0, 1])  # SQ_TILE_SOFTMAX: the softmax per 16 keys / per 64-key tile
@pytest.mark.parametrize("name", list(SHARED_TILE_CASES))
def test_shared_tile_short_query_kernel_matches_numpy(harnesses, tmp_path, name, tile_softmax):
    run_case(harnesses, tmp_path, SHARED_TILE_CASES[name], short_query=True, shared_tiles=True,
             tile_softmax=tile_softmax)


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_kernel_matches_numpy(harnesses, tmp_path, name):
    run_case(harnesses, tmp_path, DECODE_CASES[name], short_query=False)
