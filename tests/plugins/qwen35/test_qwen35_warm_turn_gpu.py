"""The warm turn on the cuda backend (``pytest -m gpu``): with snapshots inside a step
(``OPENINFER_QWEN35_SNAPSHOT_IN_STEP=1``) a prompt runs as one step whose GDN layers run around the
block boundary (``state.split_at_snapshots``); a prefix-cache hit from that snapshot, alone or
with other prompts in its step, equals the cold run."""

from __future__ import annotations

import numpy as np
import pytest
from openinfer_qwen35.state import SNAPSHOT_IN_STEP_ENV

from tests.helpers.engine_utils import assert_everything_returned, make_request, run_all, run_one
from tests.plugins.qwen35.test_qwen35_cuda import (  # noqa: F401 (the fixture)
    GPU_CONFIG,
    cuda_engine,
    first_real_divergence,
    gpu_checkpoint,
)

pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def spy_forwards(engine) -> list[tuple[list[int], list[tuple[int, ...]]]]:
    steps: list = []
    forward = engine.model.forward

    def spy(batch, kv_cache):
        host = getattr(batch, "host", None) or batch
        steps.append((np.diff(host.query_start).tolist(), [tuple(r) for r in host.state_snapshots.tolist()]))
        return forward(batch, kv_cache)

    engine.model.forward = spy
    return steps


def test_in_step_snapshot_hit_equals_cold_run(gpu_checkpoint, monkeypatch):  # noqa: F811
    monkeypatch.setenv(SNAPSHOT_IN_STEP_ENV, "1")
    path, _ = gpu_checkpoint
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, GPU_CONFIG["vocab_size"], size=150).tolist()
    others = [rng.integers(3, GPU_CONFIG["vocab_size"], size=n).tolist() for n in (77, 40)]
    engine = cuda_engine(path)
    try:
        steps = spy_forwards(engine)
        first = run_one(engine, make_request("first", prompt, max_tokens=24, logprobs=2))
        assert steps[0][0] == [150] and [r[:2] for r in steps[0][1]] == [(0, 144)]  # one step, split at 144
        hit = run_one(engine, make_request("hit", prompt, max_tokens=24, logprobs=2))
        # the hit's 6 rows run alone, the first run's beside 144 others (GEMM tiles may differ): near-ties aside
        assert hit.cached_tokens == 144 and first_real_divergence(hit.token_ids, first) is None
        turn = prompt + first.token_ids[:20] + [5, 6, 7, 8]
        # the turn beside two fresh prompts in one step: snapshot rows of sequences not last
        together = run_all(engine, [make_request("turn", turn, max_tokens=16, logprobs=2)]
                           + [make_request(f"o{i}", p, max_tokens=16, logprobs=2) for i, p in enumerate(others)])
        assert together[0].cached_tokens == 160
        assert_everything_returned(engine)
    finally:
        engine.close_sync()
    cold_engine = cuda_engine(path, enable_prefix_cache=False)
    try:
        cold = run_one(cold_engine, make_request("cold", prompt, max_tokens=24, logprobs=2))
        cold_turn = run_one(cold_engine, make_request("cold-turn", turn, max_tokens=16, logprobs=2))
        cold_others = [run_one(cold_engine, make_request(f"co{i}", p, max_tokens=16, logprobs=2))
                       for i, p in enumerate(others)]
    finally:
        cold_engine.close_sync()
    assert first_real_divergence(first.token_ids, cold) is None
    assert first_real_divergence(together[0].token_ids, cold_turn) is None
    for got, want in zip(together[1:], cold_others, strict=True):
        assert first_real_divergence(got.token_ids, want) is None


def test_copy_state_rows_equals_indexed_assignment():
    import cupy
    from openinfer_qwen35 import cuda_ops

    rng = np.random.default_rng(0)
    conv = cupy.asarray(rng.integers(0, 2**16, size=(6, 3, 40), dtype=np.uint16))
    ssm = cupy.asarray(rng.standard_normal((6, 2, 8, 8)).astype(np.float32))
    want_conv, want_ssm = conv.copy(), ssm.copy()
    pairs = ((1, 4), (2, 5))
    for src, dst in pairs:
        want_conv[dst] = want_conv[src]
        want_ssm[dst] = want_ssm[src]
    cuda_ops.copy_state_rows([conv, ssm], pairs)
    assert cupy.array_equal(conv, want_conv) and cupy.array_equal(ssm, want_ssm)
