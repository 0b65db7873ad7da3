"""The order of a grammar step's work under async scheduling (NumPy backend, a tiny random Qwen3
behind a real tokenizer): step N+1's batch is built before step N's deferred sampling is
queued, and N+1's forward right after that sampling, so scheduling and batch building overlap
the previous forward and the mask work instead of sitting between two device steps; the masks
of a step start as soon as its matchers consumed the previous tokens, before that step's
tokens are emitted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import openinfer.runtime.engine as engine_module
from openinfer import EngineOptions
from openinfer.structured import GrammarCompiler
from tests.helpers.engine_utils import generate_request, run_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
from agent_checkpoints import write_family_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_family_model(tmp_path_factory.mktemp("qwen3-pipeline"), "qwen3", seed=7)


def test_next_batch_is_built_before_the_deferred_sampling_and_its_forward_follows_it(model_dir, monkeypatch):
    from openinfer_qwen3 import plugin

    events: list[str] = []

    def recording(name, function):
        def wrapper(*args, **kwargs):
            events.append(name)
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(engine_module, "build_forward_batch", recording("build", engine_module.build_forward_batch))
    monkeypatch.setattr(engine_module, "sample_step", recording("sample", engine_module.sample_step))
    monkeypatch.setattr(GrammarCompiler, "start_masks", recording("masks", GrammarCompiler.start_masks))
    config = json.loads((model_dir / "config.json").read_text())
    engine = plugin.openinfer_create_engine(str(model_dir), config, EngineOptions(device="cpu", async_scheduling=True))
    forward = engine.model.forward
    engine.model.forward = recording("forward", forward)
    emit = engine._emit
    engine._emit = lambda request_id, kind, *rest, **kw: (events.append("emit"), emit(request_id, kind, *rest, **kw))
    grammar = generate_request("g", [5, 9, 11], max_tokens=12, ignore_eos=True)
    grammar.structured_output.regex = "[a-z]{40}"
    plain = generate_request("p", [6, 9, 11], max_tokens=12)
    try:
        outcomes = run_all(engine, [grammar, plain])
    finally:
        engine.close_sync()
    assert [len(o.token_ids) for o in outcomes] == [12, 12]
    decode = [e for e in events if e != "emit"]
    # prefill: build, forward, sample (nothing in flight); then steps whose sampling is deferred
    start = decode.index("forward", decode.index("forward") + 1) - 1
    steady = decode[start:start + 12]
    assert steady[:2] == ["build", "forward"]  # step 1: launched ahead, its sampling deferred
    body = steady[2:]
    assert body[:5] == ["masks", "build", "sample", "forward", "masks"], decode
    # every deferred sampling: preceded by the next batch's build, followed by the next forward
    for k, event in enumerate(decode):
        if event == "sample" and k > start:
            assert (decode[k - 1], decode[k + 1:k + 2]) in (("build", ["forward"]), ("masks", [])), decode
    # from the first deferred step on, a step's masks start right after the read-back, before the
    # tokens read back are emitted (the prefill's masks are computed when it samples, at once)
    deferred_masks = [k for k, e in enumerate(events) if e == "masks"][1:]
    assert deferred_masks and all(events[k + 1] == "emit" for k in deferred_masks), events
    assert engine.num_steps_launched_ahead >= engine.num_steps - 3


class _LazyIds:
    """Token ids "on the device": computed when the next forward reads them."""

    def __init__(self, compute):
        self._compute, self._ids = compute, None

    def get(self) -> np.ndarray:
        if self._ids is None:
            self._ids = self._compute()
        return self._ids

    def __array__(self, dtype=None, copy=None):
        return self.get() if dtype is None else self.get().astype(dtype)


@pytest.mark.parametrize(("consume_on_worker", "gil_interval_us", "background", "early"),
                         [("1", "0", "1", ""), ("0", "0", "1", ""), ("0", "200", "1", ""), ("0", "200", "0", ""),
                          ("0", "0", "1", "1"), ("0", "200", "1", "1")],
                         ids=["worker_consumes", "engine_consumes", "engine_consumes_gil_interval",
                              "engine_computes_gil_interval", "early", "early_gil_interval"])
def test_grammar_rows_sampled_ahead_while_the_device_waits_for_their_masks(model_dir, monkeypatch, consume_on_worker,
                                                                           gil_interval_us, background, early):
    """``OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT=1`` on a backend that waits for grammar masks on the
    device (here a NumPy "device" that samples once the masks are computed, as the CUDA stream
    does behind ``wait_for_host_flag``): every decode step is sampled ahead, its masks pending
    when the sampling is queued and started only after the previous step is read back, and the
    tokens equal the synchronous engine's exactly — seeded random rows, grammar rows (regex and
    JSON Schema) and plain rows in the same batches, requests ending at different steps; with
    the step's tokens consumed on the mask worker or by the engine thread before the hand-over
    (``OPENINFER_GRAMMAR_CONSUME_ON_WORKER``); and with the GIL switch interval lowered during the
    mask work (``OPENINFER_GRAMMAR_GIL_SWITCH_INTERVAL_US``), restored once the mask worker is idle;
    and without a mask worker (``OPENINFER_BACKGROUND_GRAMMAR_MASKS=0``: the engine thread computes the
    masks at the read-back, the device still waiting for them); and with the masks handed to the
    worker before the read-back, the worker waiting for the tokens (``OPENINFER_GRAMMAR_EARLY_MASKS=1``)."""
    import sys
    import time

    from openinfer_qwen3 import plugin

    from openinfer.backend.numpy_backend import NumpyBackend
    from openinfer.runtime.sampler import sample_rows
    from openinfer.structured import (
        BACKGROUND_MASKS_ENV,
        CONSUME_ON_WORKER_ENV,
        DEVICE_WAIT_ENV,
        EARLY_MASKS_ENV,
        GIL_SWITCH_INTERVAL_ENV,
        MASK_LATENCIES,
    )

    queued_pending: list[bool] = []

    def sample_rows_async(self, logits, rows, masks=None):
        queued_pending.append(masks is not None and not masks.is_ready)
        eos = self._test_eos

        def sample():
            return sample_rows(self, logits, rows, eos, masks.wait() if masks is not None else None)

        results = _LazyIds(sample)
        ids = _LazyIds(lambda: np.fromiter((r.token_id for r in results.get()), np.int32, len(rows)))
        return ids, results.get

    config = json.loads((model_dir / "config.json").read_text())
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "k": {"enum": ["a", "bb"]}},
              "required": ["n", "k"], "additionalProperties": False}
    requests = []
    for i in range(6):
        request = generate_request(f"r{i}", [5 + i, 9, 11], max_tokens=10 + 3 * i, ignore_eos=i % 3 == 2)
        request.sampling.temperature = 0.0 if i % 2 else 1.0
        request.sampling.seed = i
        if i % 3 == 0:
            request.structured_output.regex = "[a-z]{3,30}"
        elif i % 3 == 1:
            request.structured_output.json_schema = json.dumps(schema)
        requests.append(request)
    sync = plugin.openinfer_create_engine(str(model_dir), config, EngineOptions(device="cpu", async_scheduling=False))
    try:
        want = run_all(sync, requests)
    finally:
        sync.close_sync()
    monkeypatch.setenv(DEVICE_WAIT_ENV, "1")
    monkeypatch.setenv(CONSUME_ON_WORKER_ENV, consume_on_worker)
    monkeypatch.setenv(GIL_SWITCH_INTERVAL_ENV, gil_interval_us)
    monkeypatch.setenv(BACKGROUND_MASKS_ENV, background)
    monkeypatch.setenv(EARLY_MASKS_ENV, early)
    handed_early = []
    if early:
        from openinfer.structured import GrammarCompiler

        original = GrammarCompiler.start_masks_after

        def start_masks_after(self, *args, **kwargs):
            handed_early.append(original(self, *args, **kwargs))
            return handed_early[-1]
        monkeypatch.setattr(GrammarCompiler, "start_masks_after", start_masks_after)
    latencies = MASK_LATENCIES.count
    interval = sys.getswitchinterval()
    monkeypatch.setattr(NumpyBackend, "sample_rows_async", sample_rows_async, raising=False)
    monkeypatch.setattr(NumpyBackend, "waits_for_grammar_masks", True, raising=False)
    engine = plugin.openinfer_create_engine(str(model_dir), config, EngineOptions(device="cpu", async_scheduling=True))
    engine.model.backend._test_eos = engine.info().eos_token_ids
    assert engine.grammar_tokens_consumed_on_worker == (consume_on_worker == "1")
    try:
        got = run_all(engine, requests)
        assert engine.num_steps_launched_ahead >= engine.num_steps - 4
    finally:
        engine.close_sync()
    assert [o.error for o in got] == [None] * len(requests)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish.reason for o in got] == [o.finish.reason for o in want]
    assert sum(queued_pending) >= 8, queued_pending  # the grammar rows' masks were waited for on the "device"
    assert MASK_LATENCIES.count > latencies
    if early:  # every step sampled ahead with grammar rows was handed over before its read-back
        assert len(handed_early) >= 8 and all(handed_early), handed_early
    deadline = time.monotonic() + 5
    while sys.getswitchinterval() != interval and time.monotonic() < deadline:
        time.sleep(0.01)  # the mask worker restores it once idle after the last step
    assert sys.getswitchinterval() == interval


def test_the_device_wait_is_refused_where_the_backend_cannot_wait(model_dir, monkeypatch):
    """``grammar_masks_waited_on_device``: off by default; the NumPy backend (no device stream)
    refuses it, and the environment switch is ignored there."""
    from openinfer_qwen3 import plugin

    from openinfer.structured import DEVICE_WAIT_ENV

    monkeypatch.setenv(DEVICE_WAIT_ENV, "1")
    config = json.loads((model_dir / "config.json").read_text())
    engine = plugin.openinfer_create_engine(str(model_dir), config, EngineOptions(device="cpu", async_scheduling=True))
    try:
        assert not engine.can_wait_for_grammar_masks_on_device and not engine.grammar_masks_waited_on_device
        with pytest.raises(ValueError, match="cannot wait for grammar masks"):
            engine.grammar_masks_waited_on_device = True
        engine.grammar_masks_waited_on_device = False
    finally:
        engine.close_sync()


@pytest.mark.parametrize(("consume_on_worker", "length_slices"), [(True, False), (False, False), (False, True)],
                         ids=["worker_consumes", "engine_consumes", "engine_consumes_length_slices"])
def test_preempted_grammar_requests_keep_every_token_in_their_matchers(model_dir, consume_on_worker, length_slices):
    """A KV pool too small for every request: requests are preempted and recomputed while their
    grammar rows run ahead (each step's tokens are consumed, also of a request the next step
    leaves out, on the mask worker or by the engine thread, the matchers with or without the
    string length slices: switched on the running engine); outputs equal the synchronous
    engine's, each accepted by its grammar."""
    from openinfer_qwen3 import plugin

    from openinfer.structured import GrammarCompiler

    config = json.loads((model_dir / "config.json").read_text())
    requests = []
    for i in range(6):
        request = generate_request(f"g{i}", [5 + i, 9, 11, 20 + i], max_tokens=44, ignore_eos=True)
        request.structured_output.regex = "[a-z]{2,6}( [a-z]{2,6}){0,40}"
        requests.append(request)
    outputs = {}
    for mode in (False, True):
        engine = plugin.openinfer_create_engine(str(model_dir), config, EngineOptions(
            device="cpu", async_scheduling=mode, num_kv_blocks=12, enable_prefix_cache=False))
        engine.grammar_tokens_consumed_on_worker = consume_on_worker
        engine.grammar_string_length_slices = length_slices
        try:
            outputs[mode] = run_all(engine, requests)
            assert engine.scheduler.num_preemptions > 0
            eos = list(engine.info().eos_token_ids)
        finally:
            engine.close_sync()
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    compiler = GrammarCompiler.from_dir(str(model_dir), config["vocab_size"], eos)
    for request, outcome in zip(requests, outputs[True], strict=True):
        assert outcome.error is None and len(outcome.token_ids) == 44
        matcher = compiler.compile(request.structured_output)
        assert all(matcher.accept(t) for t in outcome.token_ids), request.request_id
