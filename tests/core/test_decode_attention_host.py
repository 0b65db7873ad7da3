"""The decode-attention entry points' ``out=`` and the mixed step's wiring, on the CPU:
``openinfer.backend.cuda.decode_attention`` / ``attention`` imported over a NumPy stand-in for
CuPy whose kernels only mark the rows they write (the kernels' numbers are checked on the GPU by
tests/gpu/test_attention.py and test_prefill_attention.py). Pinned down here: the final writer of
each entry point writes the caller's ``out`` (a view into a larger output included) and nothing
else; a bad ``out`` is refused before any launch; a mixed step's decode rows are written in place
and its prompt chunks take one prefill launch."""

from __future__ import annotations

import importlib
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from openinfer.backend.base import AttentionSpec, KVLayer
from openinfer.backend.cuda.attention_routing import split_mixed_step
from openinfer.backend.cuda.prefill_tiles import prefill_tiles

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
WIDTH = NUM_HEADS * HEAD_DIM
DECODE_MARK, PREFILL_MARK, UNTOUCHED = 1, 2, 7


class _DeviceArray(np.ndarray):
    """A "device" array: NumPy memory standing in for a CuPy array."""


def _device(x, dtype=None) -> _DeviceArray:
    return np.asarray(x, dtype=dtype).view(_DeviceArray)


def _stand_in_cupy() -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.ndarray = _DeviceArray
    cupy.uint16, cupy.float32, cupy.int32 = np.uint16, np.float32, np.int32
    cupy.empty = lambda shape, dtype=np.float32: _device(np.empty(shape, dtype))
    cupy.zeros = lambda shape, dtype=np.float32: _device(np.zeros(shape, dtype))
    cupy.asarray = lambda x, dtype=None: _device(x, dtype)
    cupy.ascontiguousarray = lambda x: _device(np.ascontiguousarray(x))
    cupy.cuda = SimpleNamespace()
    return cupy


class _Kernel:
    """One stand-in kernel: records its launches; a kernel that writes a final output marks its
    rows of it (``FINAL_OUTPUT``: that argument's index, given the launch's arguments)."""

    def __init__(self, name: str, launches: list) -> None:
        self.name, self.launches = name, launches
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        self.launches.append((self.name, args))
        index = FINAL_OUTPUT[self.name](args) if self.name in FINAL_OUTPUT else None
        if index is not None:
            args[index][...] = DECODE_MARK


# the argument each kernel writes as the final output: the mma kernels write ``out`` themselves
# only with one split (else their partials, which the merge writes into ``out``)
FINAL_OUTPUT = {
    "decode_attention_mma": lambda args: 6 if int(args[11]) == 1 else None,
    "short_query_attention_mma": lambda args: 8 if int(args[13]) == 1 else None,
    "short_query_attention_shared": lambda args: 8 if int(args[13]) == 1 else None,
    "decode_attention_merge": lambda args: 2,
    "decode_attention_combine": lambda args: 2,
}


@pytest.fixture
def modules(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _stand_in_cupy())
    names = ("openinfer.backend.cuda.loader", "openinfer.backend.cuda.decode_attention",
             "openinfer.backend.cuda.batch", "openinfer.backend.cuda.attention")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    decode = importlib.import_module("openinfer.backend.cuda.decode_attention")
    attention = importlib.import_module("openinfer.backend.cuda.attention")
    launches: list = []

    def kernel(source: str, name: str, **defines: int) -> _Kernel:
        return _Kernel(name, launches)

    monkeypatch.setattr(decode, "kernel", kernel)
    yield decode, attention, launches
    package = sys.modules["openinfer.backend.cuda"]
    for name in names:
        sys.modules.pop(name, None)  # the stand-in's modules never serve a later import
        if hasattr(package, name.rsplit(".", 1)[1]):
            delattr(package, name.rsplit(".", 1)[1])


def decode_inputs(num_seqs: int) -> tuple:
    q = _device(np.zeros((num_seqs, NUM_HEADS, HEAD_DIM), np.uint16))
    cache = _device(np.zeros((8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), np.uint16))
    tables = _device(np.ones((num_seqs, 4), np.int32))
    lens = _device(np.full(num_seqs, 40, np.int32))
    return q, cache, cache, tables, lens


@pytest.mark.parametrize("kernel_name", ["mma", "split"])
@pytest.mark.parametrize("num_sms", [1, 132])  # one split / several (partials merged into out)
def test_decode_writes_the_given_rows_of_a_larger_output_in_place(modules, kernel_name, num_sms):
    decode, _, launches = modules
    rows = 5
    whole = _device(np.full((rows + 3, WIDTH), UNTOUCHED, np.uint16))
    result = decode.paged_decode_attention(*decode_inputs(rows), 0.125, num_sms, kernel_name=kernel_name,
                                           out=whole[:rows])
    assert np.shares_memory(result, whole) and result.shape == (rows, WIDTH)
    assert np.all(whole[:rows] == DECODE_MARK) and np.all(whole[rows:] == UNTOUCHED)
    assert launches, "no kernel ran"
    # without out=: a new array, the same kernels
    count = len(launches)
    fresh = decode.paged_decode_attention(*decode_inputs(rows), 0.125, num_sms, kernel_name=kernel_name)
    assert not np.shares_memory(fresh, whole) and [n for n, _ in launches[count:]] == [n for n, _ in launches[:count]]


@pytest.mark.parametrize("bad", ["shape", "dtype", "strided", "host"])
def test_a_bad_out_is_refused_before_any_launch(modules, bad):
    decode, _, launches = modules
    rows = 4
    out = {"shape": _device(np.zeros((rows + 1, WIDTH), np.uint16)),
           "dtype": _device(np.zeros((rows, WIDTH), np.float32)),
           "strided": _device(np.zeros((rows, 2 * WIDTH), np.uint16))[:, ::2],
           "host": np.zeros((rows, WIDTH), np.uint16)}[bad]
    for kernel_name in ("mma", "split"):
        with pytest.raises(ValueError, match="out must be"):
            decode.paged_decode_attention(*decode_inputs(rows), 0.125, 8, kernel_name=kernel_name, out=out)
    q, k, v, tables, lens = decode_inputs(rows)
    with pytest.raises(ValueError, match="out must be"):
        decode.short_query_attention_mma(q, k, v, tables, lens, _device(np.arange(rows + 1, dtype=np.int32)), 1,
                                         0.125, 8, out=out)
    assert launches == []


def test_a_mixed_step_writes_its_decode_rows_in_place_and_its_chunks_in_one_prefill_launch(modules, monkeypatch):
    _, attention, launches = modules
    new = [1] * 20 + [300, 5]  # 20 running decodes, a prompt chunk, a short one
    query_start = np.concatenate(([0], np.cumsum(new))).astype(np.int32)
    tile_seq, tile_query = prefill_tiles(query_start)
    split = split_mixed_step(query_start, tile_seq)
    assert split is not None and split.decode_rows == 20
    tokens = int(query_start[-1])
    batch = SimpleNamespace(num_tokens=tokens, block_tables=_device(np.ones((len(new), 24), np.int32)),
                            context_lens=_device(np.full(len(new), 350, np.int32)), tile_seq=tile_seq,
                            tile_query=tile_query, query_start=query_start)
    prefill_calls = []

    def prefill_attention(q, spec, kv, batch, out=None, tile_range=None):
        prefill_calls.append(tile_range)
        for tile in range(*tile_range):  # the tile's rows of its sequence
            first = int(batch.query_start[batch.tile_seq[tile]]) + int(batch.tile_query[tile])
            last = min(first + 128, int(batch.query_start[batch.tile_seq[tile] + 1]))
            out[first:last] = PREFILL_MARK
        return out

    monkeypatch.setattr(attention, "prefill_attention", prefill_attention)
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, None, 0.125)
    cache = _device(np.zeros((40, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), np.uint16))
    q = _device(np.zeros((tokens, NUM_HEADS, HEAD_DIM), np.uint16))
    out = attention.mixed_attention(q, spec, KVLayer(cache, cache), batch, split, num_sms=132)
    assert prefill_calls == [(0, 3 + 1)]  # the 300-token chunk's 3 tiles and the short one's: one launch
    assert np.all(out[:20] == DECODE_MARK) and np.all(out[20:] == PREFILL_MARK)
    # the decode rows' final writer got a view of the step's output: no copy afterwards
    name, args = launches[-1]
    written = args[FINAL_OUTPUT[name](args)]
    assert np.shares_memory(written, out) and written.shape == (20, WIDTH)


@pytest.mark.parametrize("tiles", ["warp", "shared"])
@pytest.mark.parametrize("num_sms", [1, 132])  # one split / several (partials merged into out)
def test_short_queries_write_the_given_rows_in_place_with_either_layout(modules, tiles, num_sms):
    decode, _, launches = modules
    seqs, new = 2, 16
    rows = seqs * new
    whole = _device(np.full((rows + 3, WIDTH), UNTOUCHED, np.uint16))
    q = _device(np.zeros((rows, NUM_HEADS, HEAD_DIM), np.uint16))
    _, k, v, tables, lens = decode_inputs(seqs)
    query_start = _device(np.arange(0, rows + 1, new, dtype=np.int32))
    result = decode.short_query_attention_mma(q, k, v, tables, lens, query_start, new, 0.125, num_sms, tiles=tiles,
                                              out=whole[:rows])
    assert np.shares_memory(result, whole)
    assert np.all(whole[:rows] == DECODE_MARK) and np.all(whole[rows:] == UNTOUCHED)
    expected = "short_query_attention_shared" if tiles == "shared" else "short_query_attention_mma"
    assert launches[0][0] == expected
    with pytest.raises(ValueError, match="tiles must be one of"):
        decode.short_query_attention_mma(q, k, v, tables, lens, query_start, new, 0.125, num_sms, tiles="wide")
