"""Async scheduling on the GPU: step N+1's inputs fed on the device from step N's samples,
read back later — the same tokens as reading every step back before the next."""

import json

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_async_scheduling_matches_sync_on_cuda(tmp_path):
    pytest.importorskip("cupy")
    from openinfer_qwen3 import plugin

    from openinfer import EngineOptions
    from tests.helpers.engine_utils import make_request, run_all
    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    path = write_tiny_qwen3(tmp_path / "q", seed=3, head_dim=32)  # a head size the cuda kernels take
    config = json.loads((path / "config.json").read_text())
    rng = np.random.default_rng(5)
    requests = []
    for i in range(20):
        prompt = rng.integers(3, 320, size=int(rng.integers(2, 60))).tolist()
        if i % 2:
            requests.append(make_request(f"g{i}", prompt, max_tokens=int(rng.integers(1, 30))))
        else:
            requests.append(make_request(f"s{i}", prompt, max_tokens=20, temperature=0.9, seed=i,
                                         stop_token_ids=[7, 8, 9]))
    outputs = {}
    for mode in (False, True):
        engine = plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cuda", async_scheduling=mode))
        try:
            outputs[mode] = run_all(engine, requests)
            if mode:
                assert engine.num_steps_launched_ahead > 5
                report = engine._step_timer.report()
                assert report["num_steps"] > 5
            assert engine.load().kv_blocks_used == 0
        finally:
            engine.close_sync()
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]


def reference_logits(model, token_ids: list[int]) -> np.ndarray:
    """float32 next-token logits after ``token_ids`` (one request alone: no batch make-up)."""
    from tests.helpers.engine_utils import prefill_logits

    return prefill_logits(model, token_ids)[-1]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def check_divergences_at_near_ties(reference_model, compiler, requests, got, want, rank: int = 3,
                                   tolerance: float = 0.25) -> list[tuple[str, int, float]]:
    """Rows of two greedy runs agree, except that a row may part ways at a near-tie: at its first
    differing position both runs' tokens are among the ``rank`` best allowed tokens of the
    float32 reference (the request alone, on the NumPy backend, after the common prefix) and
    within ``tolerance`` reference standard deviations of the best one. Why: bf16 GEMMs round
    differently for different batch sizes (cuBLAS picks kernels by M; graphs pad to buckets),
    and async scheduling keeps a row that the previous step finished in the next batch (its
    extra token is discarded), so async and sync batches differ in make-up after a row ends.
    A wrong token (another row's, a mask on the wrong row, a stale input) lands anywhere in the
    vocabulary, not among the top ``rank`` within a hair of the best. Returns the divergences
    (request id, position, gap in standard deviations)."""
    from openinfer.structured import allocate_bitmask, allowed_tokens

    divergences = []
    for request, a, b in zip(requests, got, want, strict=True):
        position = first_divergence(a, b)
        if position is None:
            continue
        assert position < min(len(a), len(b)), f"{request.request_id}: one run stopped, the other went on"
        prefix = list(request.prompt_token_ids) + a[:position]
        logits = reference_logits(reference_model, prefix).astype(np.float64)
        if request.HasField("structured_output"):
            matcher = compiler.compile(request.structured_output)
            for token in a[:position]:
                assert matcher.accept(token)
            bitmask = allocate_bitmask(1, logits.shape[0])
            matcher.fill(bitmask[0])
            logits = np.where(allowed_tokens(bitmask[0], logits.shape[0]), logits, -np.inf)
        finite = logits[np.isfinite(logits)]
        spread = float(np.std(finite)) if finite.size > 1 else 1.0
        best = np.argsort(-logits, kind="stable")[:rank]
        for token in (a[position], b[position]):
            gap = float((logits.max() - logits[token]) / spread)
            assert token in best and gap <= tolerance, (
                f"{request.request_id}: token {token} at {position} is not a near-tie of the reference "
                f"(best {best.tolist()}, {gap:.3f} std below the best)")
        divergences.append((request.request_id, position, float((logits.max() - logits[list(best)[1]]) / spread)))
    return divergences


def grammar_requests() -> list:
    from openinfer.offline import generate_request

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "k": {"enum": ["a", "b"]}},
              "required": ["n", "k"], "additionalProperties": False}
    requests = []
    for i in range(16):
        request = generate_request(f"r{i}", [5 + i, 9, 11], max_tokens=30, ignore_eos=i % 2 == 1)
        if i % 2 == 0:
            request.structured_output.json_schema = json.dumps(schema)
        requests.append(request)
    return requests


def grammar_checkpoint(tmp_path):
    """A tiny bf16 Qwen3 with the Qwen3 family's tokenizer: (its directory, its config). bf16
    weights, so the float32 reference computes with the very weights the GPU holds."""
    import sys
    from pathlib import Path

    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
    from agent_checkpoints import write_family_tokenizer

    path = write_tiny_qwen3(tmp_path / "q", seed=3, head_dim=32, vocab_size=512, dtype="bfloat16")
    write_family_tokenizer(path, "qwen3")
    return path, json.loads((path / "config.json").read_text())


def check_grammar_outputs(path, config, requests, tested, baseline) -> list:
    """Every ``tested`` outcome ends without error and each grammar row's tokens are accepted by
    its grammar; where ``tested`` and ``baseline`` differ, only at bf16 near-ties of the float32
    reference (``check_divergences_at_near_ties``, whose divergences are returned)."""
    from openinfer_qwen3 import plugin

    from openinfer import EngineOptions
    from openinfer.structured import GrammarCompiler

    reference = plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cpu"))
    try:
        compiler = GrammarCompiler.from_dir(str(path), config["vocab_size"], reference.info().eos_token_ids)
        for request, outcome in zip(requests, tested, strict=True):
            assert outcome.error is None
            if request.HasField("structured_output"):
                matcher = compiler.compile(request.structured_output)
                assert all(matcher.accept(t) for t in outcome.token_ids), request.request_id
        return check_divergences_at_near_ties(reference.model, compiler, requests,
                                              [o.token_ids for o in tested], [o.token_ids for o in baseline])
    finally:
        reference.close_sync()


def test_grammar_rows_launch_ahead_on_cuda_with_the_same_tokens(tmp_path):
    """Grammar rows next to plain rows: every step's forward is queued before the previous step
    is read back (a grammar step's sampling deferred until the next batch is built), tokens as
    with async off — up to bf16 near-ties where the batches' make-up differs (rows ending at
    different steps), checked against the float32 reference (``check_divergences_at_near_ties``);
    every grammar row's output is accepted by its grammar."""
    pytest.importorskip("cupy")

    from openinfer_qwen3 import plugin

    from openinfer import EngineOptions
    from tests.helpers.engine_utils import run_all

    path, config = grammar_checkpoint(tmp_path)
    requests = grammar_requests()
    outputs, reports = {}, {}
    for mode in (False, True):
        engine = plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cuda", async_scheduling=mode))
        try:
            outputs[mode] = run_all(engine, requests)
            if mode:
                assert engine.num_steps_launched_ahead >= engine.num_steps - 4
            reports[mode] = engine.step_timer.report()
            assert engine.load().kv_blocks_used == 0
        finally:
            engine.close_sync()
    divergences = check_grammar_outputs(path, config, requests, outputs[True], outputs[False])
    print("divergences at near-ties (request, position, reference gap to the runner-up in std):", divergences)
    print("step timer, async off / on:", reports[False], reports[True])


@pytest.mark.parametrize(("consume_on_worker", "early"), [("1", ""), ("0", ""), ("0", "1")],
                         ids=["worker_consumes", "engine_consumes", "early_masks"])
def test_grammar_rows_sampled_ahead_with_masks_waited_for_on_the_device(tmp_path, monkeypatch, consume_on_worker,
                                                                        early):
    """``OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT=1``: grammar rows are sampled ahead like plain ones
    (the GPU waits for their masks): the same tokens as the default pipeline (deferred sampling)
    up to bf16 near-ties, every grammar row's output accepted by its grammar, nearly every
    step launched ahead; both with the step's tokens consumed on the mask worker and by the
    engine thread (``OPENINFER_GRAMMAR_CONSUME_ON_WORKER``), and with the masks handed to the
    worker before the read-back (``OPENINFER_GRAMMAR_EARLY_MASKS=1``)."""
    pytest.importorskip("cupy")

    from openinfer_qwen3 import plugin

    from openinfer import EngineOptions
    from openinfer.structured import CONSUME_ON_WORKER_ENV, DEVICE_WAIT_ENV, EARLY_MASKS_ENV
    from tests.helpers.engine_utils import run_all

    path, config = grammar_checkpoint(tmp_path)
    requests = grammar_requests()
    outputs = {}
    monkeypatch.setenv(CONSUME_ON_WORKER_ENV, consume_on_worker)
    monkeypatch.setenv(EARLY_MASKS_ENV, early)
    for wait_on_device in (False, True):
        monkeypatch.setenv(DEVICE_WAIT_ENV, "1" if wait_on_device else "0")
        engine = plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cuda", async_scheduling=True))
        try:
            outputs[wait_on_device] = run_all(engine, requests)
            assert engine.num_steps_launched_ahead >= engine.num_steps - 4
            assert engine.load().kv_blocks_used == 0
        finally:
            engine.close_sync()
    divergences = check_grammar_outputs(path, config, requests, outputs[True], outputs[False])
    print("divergences at near-ties, device wait vs deferred sampling:", divergences)
