"""Async scheduling on the GPU: step N+1's inputs fed on the device from step N's samples,
read back later — the same tokens as reading every step back before the next."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_async_scheduling_matches_sync_on_cuda(tmp_path):
    pytest.importorskip("cupy")
    import json

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


def test_grammar_rows_launch_ahead_on_cuda_with_the_same_tokens(tmp_path):
    """Grammar rows next to plain rows: every step's forward is queued before the previous step
    is read back (masks go to the device with the sampling), tokens as with async off."""
    pytest.importorskip("cupy")
    import json
    import sys
    from pathlib import Path

    from openinfer_qwen3 import plugin

    from openinfer import EngineOptions
    from tests.helpers.engine_utils import make_request, run_all
    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
    from agent_checkpoints import write_family_tokenizer

    path = write_tiny_qwen3(tmp_path / "q", seed=3, head_dim=32, vocab_size=512)
    write_family_tokenizer(path, "qwen3")
    config = json.loads((path / "config.json").read_text())
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "k": {"enum": ["a", "b"]}},
              "required": ["n", "k"], "additionalProperties": False}
    requests = []
    for i in range(16):
        request = make_request(f"r{i}", [5 + i, 9, 11], max_tokens=30, ignore_eos=i % 2 == 1)
        if i % 2 == 0:
            request.structured_output.json_schema = json.dumps(schema)
        requests.append(request)
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
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    assert [o.finish.reason for o in outputs[True]] == [o.finish.reason for o in outputs[False]]
    print("step timer, async off / on:", reports[False], reports[True])
