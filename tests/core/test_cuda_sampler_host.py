"""The CUDA sampler's host side on the CPU: ``openinfer.backend.cuda.sampler`` imported over a
NumPy stand-in for CuPy whose two kernels are emulated (bias + packed grammar mask, greedy
choice; the kernels themselves are checked bit for bit by ``test_logit_constraints_emulated``
and on the GPU by ``tests/gpu``). What this pins down is the wiring: which rows' masks, biases
and draws reach which kernel row, in the async path (every row on the device) and in the
mixed path (some rows on the device, some on the host sampler, masks re-indexed to each)."""

from __future__ import annotations

import importlib
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from openinfer.runtime.batch_builder import LogitsRow
from openinfer.runtime.sampler import device_sampling_inputs
from openinfer.runtime.sampler import sample_rows as sample_rows_reference
from openinfer.sampling import SamplingState
from openinfer.structured import StepMasks, allowed_tokens
from openinfer.v1 import engine_pb2 as pb


class _DeviceArray(np.ndarray):
    """A "device" array: NumPy memory with CuPy's ``get``."""

    def get(self, stream=None, out=None, blocking=True):
        if out is None:
            return np.array(self)
        out[...] = self
        return out


def _device(x, dtype=None) -> _DeviceArray:
    return np.array(x, dtype=dtype).view(_DeviceArray)


def _fake_cupy() -> tuple[types.ModuleType, types.ModuleType]:
    cupy = types.ModuleType("cupy")
    cupy.ndarray = _DeviceArray
    cupy.int32, cupy.float32 = np.int32, np.float32
    cupy.asarray = lambda x, dtype=None: _device(x, dtype)
    cupy.array = lambda x, copy=True, order="C": _device(x)
    cupy.ascontiguousarray = lambda x: _device(x)
    cupy.zeros = lambda shape, dtype=np.float32: _device(np.zeros(shape, dtype))
    cupy.full = lambda shape, value, dtype=np.float32: _device(np.full(shape, value, dtype))
    cupy.empty = lambda shape, dtype=np.float32: _device(np.empty(shape, dtype))
    event = SimpleNamespace(record=lambda stream=None: None, synchronize=lambda: None)
    cupy.cuda = SimpleNamespace(get_current_stream=lambda: None, Event=lambda **_: event,
                                alloc_pinned_memory=lambda nbytes: bytearray(nbytes))  # sampler.empty_pinned's
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype: np.empty(shape, dtype)
    return cupy, cupyx


def _apply_logit_constraints(grid, block, args) -> None:
    logits, vocab, bias_start, bias_ids, bias_values, bitmask, words, mask_rows = args
    for r in range(grid[0]):
        span = slice(bias_start[r], bias_start[r + 1])
        logits[r, bias_ids[span]] += bias_values[span]
        if mask_rows[r] >= 0:
            logits[r, ~allowed_tokens(bitmask[mask_rows[r]][:words], int(vocab))] = -np.inf


class _Kernels:
    """``kernel(source, name)`` of the stand-in: the two sampling kernels, greedy rows only."""

    def __init__(self) -> None:
        self.draws: list[np.ndarray] = []
        self.names: list[str] = []

    def __call__(self, source: str, name: str):
        self.names.append(name)
        if name in ("apply_logit_constraints", "apply_logit_constraints_tiled"):  # grid[0]: the rows, both
            return _apply_logit_constraints

        def sample(grid, block, args) -> None:
            logits, vocab, temperature, top_k, top_p, min_p, uniform, tokens, logprobs = args
            assert np.all(np.asarray(temperature) == 0), "the stand-in samples greedy rows only"
            self.draws.append(np.array(uniform))
            tokens[...] = np.argmax(np.asarray(logits)[:, :int(vocab)], axis=1)
        return sample


@pytest.fixture
def cuda_sampler(monkeypatch):
    cupy, cupyx = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    for name in ("openinfer.backend.cuda.sampler", "openinfer.backend.cuda.loader"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module("openinfer.backend.cuda.sampler")
    kernels = _Kernels()
    monkeypatch.setattr(module, "kernel", kernels)
    yield module, kernels
    package = sys.modules["openinfer.backend.cuda"]
    for name in ("openinfer.backend.cuda.sampler", "openinfer.backend.cuda.loader"):
        sys.modules.pop(name, None)  # the stand-in's modules never serve a later import
        if hasattr(package, name.rsplit(".", 1)[1]):
            delattr(package, name.rsplit(".", 1)[1])


def _request(index: int, logit_bias: dict | None = None, logprobs: int = 0) -> SimpleNamespace:
    params = pb.SamplingParams(temperature=0.0, logit_bias=logit_bias or {})
    return SimpleNamespace(sampling=SamplingState.create(params, [1, 2], 0, index), want_logprobs=logprobs > 0,
                           num_logprobs=logprobs, want_prompt_logprobs=False, num_output_tokens=0,
                           stop=pb.StopConditions(), request_id=f"r{index}")


def _random_masks(rng: np.random.Generator, rows: int, vocab: int, constrained: list[int]) -> StepMasks:
    words = (vocab + 31) // 32
    bitmask = rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    bitmask &= rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)  # ~1/4 allowed
    return StepMasks.from_rows(bitmask, constrained)


@pytest.mark.parametrize("tiled", ["", "0"], ids=["tiled_in_place", "one_block_per_row_on_a_copy"])
def test_async_path_applies_each_rows_mask_and_bias(cuda_sampler, monkeypatch, tiled):
    """The engine's asynchronous sampling: by default the tiled kernel on the forward's logits in
    place; ``OPENINFER_TILED_LOGIT_CONSTRAINTS=0``: one block per row on a copy. Same tokens."""
    module, kernels = cuda_sampler
    if tiled:
        monkeypatch.setenv(module.TILED_CONSTRAINTS_ENV, tiled)
    else:
        monkeypatch.delenv(module.TILED_CONSTRAINTS_ENV, raising=False)
    rng = np.random.default_rng(0)
    rows, vocab = 9, 1000
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    requests = [_request(i, {int(np.argmax(logits[i])): -100.0} if i % 3 == 0 else None) for i in range(rows)]
    batch = [LogitsRow(r, 1, True) for r in requests]
    masks = _random_masks(rng, rows, vocab, [1, 2, 5, 8])
    forward_logits = _device(logits)
    ids, read_back = module.sample_rows_async(forward_logits, batch, masks)
    got = [s.token_id for s in read_back()]
    in_place = not tiled
    assert ("apply_logit_constraints_tiled" if in_place else "apply_logit_constraints") in kernels.names
    assert np.isneginf(np.asarray(forward_logits)[1]).any() == in_place
    want = [s.token_id for s in sample_rows_reference(SimpleNamespace(to_host=np.asarray), logits.copy(), batch,
                                                      [0], masks)]
    assert got == want == np.asarray(ids).tolist()
    for i in (1, 2, 5, 8):
        assert allowed_tokens(masks.row(i), vocab)[got[i]]


def test_mixed_path_reindexes_masks_to_device_and_host_rows(cuda_sampler):
    """Rows asking for logprobs go to the host sampler, the others to the kernel: both halves see
    their own rows' masks (the compact masks re-indexed to each subset)."""
    module, _ = cuda_sampler
    rng = np.random.default_rng(1)
    rows, vocab = 10, 700
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    requests = [_request(i, logprobs=2 if i in (0, 3, 4, 9) else 0) for i in range(rows)]
    batch = [LogitsRow(r, 1, True) for r in requests]
    masks = _random_masks(rng, rows, vocab, [0, 2, 3, 6, 7])
    got = module.sample_rows(_device(logits), batch, [0], np.asarray, masks)
    want = sample_rows_reference(SimpleNamespace(to_host=np.asarray), logits.copy(), batch, [0], masks)
    assert [s.token_id for s in got] == [s.token_id for s in want]
    assert [s.logprob for s in got] == [s.logprob for s in want]


def test_bias_only_and_unconstrained_rows(cuda_sampler):
    module, _ = cuda_sampler
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, 300)).astype(np.float32)
    requests = [_request(0, {7: 100.0}), _request(1), _request(2, {int(np.argmax(logits[2])): -100.0}), _request(3)]
    got = module.sample_device_rows(_device(logits), [r.sampling for r in requests])
    assert got[0] == 7 and got[1] == np.argmax(logits[1]) and got[2] != np.argmax(logits[2])
    plain = module.apply_logit_constraints(_device(logits), [requests[1].sampling, requests[3].sampling])
    assert isinstance(plain, np.ndarray) and np.array_equal(plain, logits)  # untouched when nothing applies


def test_device_sampling_inputs_draw_once_per_random_row():
    """One ``generator.random()`` per random row and step, none for greedy rows or without draws."""
    params = [pb.SamplingParams(temperature=0.0), pb.SamplingParams(temperature=0.7, seed=3, top_k=5, top_p=0.9),
              pb.SamplingParams(temperature=1.0, seed=4, min_p=0.1, logit_bias={3: 2.0, 1: -1.0})]
    states = [SamplingState.create(p, [1], 0, i) for i, p in enumerate(params)]
    twins = [SamplingState.create(p, [1], 0, i) for i, p in enumerate(params)]
    device_sampling_inputs(states, draws=False)
    inputs = device_sampling_inputs(states)
    assert inputs.params[3, 0] == 0.0
    assert inputs.params[3, 1] == np.float32(twins[1].generator.random())
    assert inputs.params[3, 2] == np.float32(twins[2].generator.random())
    assert inputs.params[4].view(np.int32).tolist() == [0, 5, 0]
    assert np.allclose(inputs.params[:3], [[0.0, 0.7, 1.0], [0.0, 0.9, 0.0], [0.0, 0.0, 0.1]])
    assert inputs.bias_start.tolist() == [0, 0, 0, 2]
    assert inputs.bias_ids.tolist() == [1, 3] and inputs.bias_values.tolist() == [-1.0, 2.0]
    assert device_sampling_inputs(states[:2]).bias_start is None
