"""The short-query kernel's launch plans (decode_attention_plan.short_query_launch), host-only:
the "shared" layout reads each KV tile once per four 16-row blocks and splits a batch-1 step's
keys over enough blocks for the GPU; rows that fit one block stay on the "warp" kernel; the
OPENINFER_SHORT_QUERY_TILES switch is read and checked."""

from __future__ import annotations

import math

import pytest

from openinfer.backend.cuda import decode_attention_plan as plan

H200_SMS = 132


@pytest.mark.parametrize("group, new_tokens, row_groups", [(4, 16, 1), (4, 5, 1), (8, 16, 2), (16, 16, 4), (16, 5, 2)])
def test_the_shared_layout_reads_the_keys_once_per_four_row_blocks(group, new_tokens, row_groups):
    warp = plan.short_query_launch("warp", 1, 8, group, 128, new_tokens, H200_SMS)
    shared = plan.short_query_launch("shared", 1, 8, group, 128, new_tokens, H200_SMS)
    assert warp.kernel == "short_query_attention_mma" and warp.row_blocks == math.ceil(new_tokens / (16 // group))
    assert shared.kernel == "short_query_attention_shared" and shared.row_blocks == row_groups
    assert shared.threads == 128 and shared.shared_bytes == 3 * 2 * 64 * 128 * 2


def test_a_batch_one_warm_tail_fills_the_gpu_with_splits():
    """Qwen3-4B heads (8 KV heads, groups of 4), 16 new tokens: 8 units take 32 splits (a power of
    two up to two blocks per SM: 33 -> 32), 4 sequences 8 (8.25 -> 8); the warp layout's 32
    row-block units stay at 8."""
    shared = plan.short_query_launch("shared", 1, 8, 4, 128, 16, H200_SMS)
    assert shared.splits == 32 and shared.grid(1, 8) == (32, 8, 1)
    assert plan.short_query_launch("shared", 4, 8, 4, 128, 16, H200_SMS).splits == 8
    assert plan.short_query_launch("shared", 2, 8, 4, 128, 16, H200_SMS).splits == 16
    assert plan.short_query_launch("warp", 1, 8, 4, 128, 16, H200_SMS).grid(1, 8) == (32, 8, 1)
    assert plan.short_query_launch("shared", 64, 8, 4, 128, 16, H200_SMS).splits == 1  # many sequences: one each
    assert plan.short_query_launch("shared", 1, 8, 4, 128, 16, 1000).splits == plan.MAX_SPLITS
    for units in range(1, 300):
        count = plan.shared_split_count(units, H200_SMS)
        assert count & (count - 1) == 0 and count <= max(1, 2 * H200_SMS // units) and count <= plan.MAX_SPLITS
    assert plan.short_query_launch("shared", 1, 8, 4, 128, 16, H200_SMS, splits=5).splits == 5


def test_rows_of_one_block_stay_on_the_warp_kernel():
    for group, new_tokens in ((4, 4), (4, 1), (16, 1), (1, 16)):
        launch = plan.short_query_launch("shared", 1, 8, group, 128, new_tokens, H200_SMS)
        assert launch.kernel == "short_query_attention_mma" and launch.row_blocks == 1


def test_head_dim_256_tiles_fit_the_same_shared_memory():
    assert plan.shared_tile_keys(256) == 32 and plan.shared_tile_bytes(256) == plan.shared_tile_bytes(128)
    assert plan.shared_tile_bytes(64) == 3 * 2 * 64 * 64 * 2


def test_the_tiles_switch(monkeypatch):
    with pytest.raises(ValueError, match="tiles must be one of"):
        plan.short_query_launch("wide", 1, 8, 4, 128, 16, H200_SMS)
    try:
        for value in plan.SHORT_QUERY_TILES:
            monkeypatch.setenv(plan.SHORT_QUERY_TILES_ENV, value)
            plan.wanted_short_query_tiles.cache_clear()
            assert plan.wanted_short_query_tiles() == value
        monkeypatch.setenv(plan.SHORT_QUERY_TILES_ENV, "wide")
        plan.wanted_short_query_tiles.cache_clear()
        with pytest.raises(ValueError, match=plan.SHORT_QUERY_TILES_ENV):
            plan.wanted_short_query_tiles()
        monkeypatch.delenv(plan.SHORT_QUERY_TILES_ENV)
        plan.wanted_short_query_tiles.cache_clear()
        assert plan.wanted_short_query_tiles() == plan.SHORT_QUERY_TILES_DEFAULT
    finally:
        plan.wanted_short_query_tiles.cache_clear()


def test_the_tile_softmax_switch(monkeypatch):
    try:
        for value, expected in (("tile", True), ("subtile", False)):
            monkeypatch.setenv(plan.SHORT_QUERY_SOFTMAX_ENV, value)
            plan.wanted_tile_softmax.cache_clear()
            assert plan.wanted_tile_softmax() is expected
        monkeypatch.setenv(plan.SHORT_QUERY_SOFTMAX_ENV, "wide")
        plan.wanted_tile_softmax.cache_clear()
        with pytest.raises(ValueError, match=plan.SHORT_QUERY_SOFTMAX_ENV):
            plan.wanted_tile_softmax()
        monkeypatch.delenv(plan.SHORT_QUERY_SOFTMAX_ENV)
        plan.wanted_tile_softmax.cache_clear()
        assert plan.wanted_tile_softmax() is True  # the default: per 64-key tile
    finally:
        plan.wanted_tile_softmax.cache_clear()
