"""The SGLang service's small parts on their own: stop-string watcher, stream merging, tokenizer bundle."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_sglang_service import write_tiny_tokenizer

from openinfer.frontend.grpc.sglang_fanout import merge_streams
from openinfer.frontend.grpc.sglang_load import RecentRates
from openinfer.frontend.grpc.sglang_stop import StopStringWatcher
from openinfer.frontend.grpc.sglang_tokenizer_bundle import (
    CHUNK_BYTES,
    build_tokenizer_zip,
    iter_bundle_chunks,
)
from openinfer.tokenizer import Tokenizer


@pytest.fixture
def tokenizer(tmp_path: Path) -> Tokenizer:
    return Tokenizer.from_dir(write_tiny_tokenizer(tmp_path / "model"))


def test_watcher_keeps_ids_up_to_the_one_completing_the_stop_string(tokenizer):
    watcher = StopStringWatcher(tokenizer, [12], ["delta"])
    assert watcher.push([4, 5]) == ([4, 5], None)  # alpha beta
    assert watcher.push([6, 7, 8]) == ([6, 7], "delta")  # gamma delta | epsilon dropped


def test_watcher_reports_the_earliest_of_several_stop_strings(tokenizer):
    watcher = StopStringWatcher(tokenizer, [12], ["gamma", "beta"])
    assert watcher.push([4, 5, 6]) == ([4, 5], "beta")


def test_watcher_finds_a_stop_string_across_pushes(tokenizer):
    watcher = StopStringWatcher(tokenizer, [12], ["beta gamma"])
    assert watcher.push([5]) == ([5], None)
    assert watcher.push([6]) == ([6], "beta gamma")


def test_watcher_ignores_stop_strings_before_min_tokens(tokenizer):
    watcher = StopStringWatcher(tokenizer, [12], ["alpha"], min_tokens=3)
    assert watcher.push([4, 5]) == ([4, 5], None)
    assert watcher.push([4]) == ([4], "alpha")


async def numbers(values: list[int], delay: float, closed: list[int], fail_at: int | None = None) -> AsyncIterator[int]:
    try:
        for value in values:
            await asyncio.sleep(delay)
            if value == fail_at:
                raise ValueError(f"failed at {value}")
            yield value
    finally:
        closed.append(values[0])


async def test_merge_interleaves_every_item():
    closed: list[int] = []
    merged = [v async for v in merge_streams([numbers([1, 2, 3], 0.001, closed), numbers([10, 20], 0.001, closed)])]
    assert sorted(merged) == [1, 2, 3, 10, 20] and sorted(closed) == [1, 10]


async def test_merge_raises_the_first_failure_and_closes_the_other_streams():
    closed: list[int] = []
    with pytest.raises(ValueError, match="failed at 2"):
        async for _ in merge_streams([numbers([1, 2, 3], 0.01, closed, fail_at=2),
                                      numbers(list(range(100, 1000)), 0.01, closed)]):
            pass
    assert sorted(closed) == [1, 100]


async def test_merge_closes_every_stream_when_the_consumer_leaves():
    closed: list[int] = []
    merged = merge_streams([numbers(list(range(1000)), 0.001, closed), numbers(list(range(5000, 6000)), 0.001, closed)])
    assert await anext(merged) in (0, 5000)
    await merged.aclose()
    assert sorted(closed) == [0, 5000]


def test_bundle_chunks_carry_the_digest_on_the_last_one_only(tmp_path):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"weights are not part of the bundle")
    data = build_tokenizer_zip(tmp_path)
    assert set(zipfile.ZipFile(io.BytesIO(data)).namelist()) == {"tokenizer.json", "tokenizer_config.json"}
    big = bytes(range(256)) * (CHUNK_BYTES // 128)  # two full chunks and a bit
    chunks = list(iter_bundle_chunks(big + b"tail"))
    assert [len(c) for c, _ in chunks] == [CHUNK_BYTES, CHUNK_BYTES, 4]
    assert [d for _, d in chunks] == ["", "", hashlib.sha256(big + b"tail").hexdigest()]


def test_bundle_without_a_tokenizer_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        build_tokenizer_zip(tmp_path)


def test_recent_rates_forget_samples_older_than_the_window():
    now = [100.0]
    rates = RecentRates(window_s=10.0, clock=lambda: now[0])
    rates.record_tokens(30)
    rates.record_prompt(100, 25)
    now[0] = 105.0
    rates.record_tokens(20)
    rates.record_prompt(100, 75)
    assert rates.tokens_per_second() == 5.0 and rates.cache_hit_rate() == 0.5
    now[0] = 112.0
    assert rates.tokens_per_second() == 2.0 and rates.cache_hit_rate() == 0.75
    now[0] = 120.0
    assert rates.tokens_per_second() == 0.0 and rates.cache_hit_rate() == 0.0
