"""The kernel ledger's step-time model, re-derived on the CPU from the committed ledgers
(``python -m openinfer.tools.ledger --from-json``): tables render, and the committed Qwen3
predictions stay within 15 % of the measured steps at batch 1, 64 and 256. And the ledger tool
itself, run end to end on the NumPy backend (``--device cpu``) for a dense model (Qwen3) and a
hybrid one (Qwen3.5: paged attention blocks + Gated DeltaNet state slots), so the GPU run of the
same command finds its batches, op wrappers and report in working order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openinfer.tools.ledger import (
    StepLayout,
    StepModel,
    breakdown,
    decode_batch,
    interpolate,
    main,
    prefill_batch,
)
from tests.helpers.tiny_deepseek_v3 import tiny_config
from tests.helpers.tiny_qwen3 import TINY_QWEN3
from tests.plugins.qwen35.qwen35_helpers import TINY_QWEN35

ROOT = Path(__file__).resolve().parents[2]
LEDGERS = {"qwen3": ROOT / "plugins/openinfer-qwen3/src/openinfer_qwen3/ledger.json",
           "qwen35": ROOT / "plugins/openinfer-qwen35/openinfer_qwen35/ledger.json",
           "kimi_k2": ROOT / "plugins/openinfer-kimi-k2/openinfer_kimi_k2/ledger.json"}


def test_interpolation_linear_and_quadratic() -> None:
    assert interpolate([1.0, 2.0, 4.0], [1.0, 2.0, 4.0], 3.0) == pytest.approx(3.0)
    assert interpolate([1.0, 2.0], [1.0, 2.0], 5.0) == pytest.approx(5.0)  # extrapolates
    assert interpolate([1.0, 2.0, 4.0], [1.0, 4.0, 16.0], 3.0, degree=2) == pytest.approx(9.0)


def test_model_sums_ops_over_the_grid() -> None:
    entries = [{"batch": b, "context": c, "sum_device_s": 0.0, "measured_s": 0.0,
                "ops": [{"op": "gemm", "time_s": 1e-3 * b, "host_s": 0.0},
                        {"op": "attn", "time_s": 1e-6 * b * c, "host_s": 0.0}]}
               for b in (1, 4) for c in (100, 300)]
    model = StepModel(entries, eager=False)
    # context: linear; batch: linear in log2(batch), so batch 2 sits halfway between 1 and 4
    assert model.predict(2, 200) == pytest.approx(2.5e-3 + 5e-4)


@pytest.mark.parametrize("name", sorted(LEDGERS))
def test_committed_ledger_rederives(name: str, tmp_path: Path) -> None:
    out = tmp_path / "ledger.json"
    assert main(["--from-json", str(LEDGERS[name]), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    table = out.with_suffix(".md").read_text()
    assert "| op | kernels | shape |" in table and report["entries"]
    for entry in report["entries"]:
        assert all(row["time_s"] >= 0 and row["calls"] >= 1 for row in entry["ops"])
    if name == "qwen3":
        errors = {c["batch"]: abs(c["error"]) for c in report["checks"] if c["phase"] == "decode" and c["context"] == 512}
        assert set(errors) >= {1, 64, 256} and max(errors[b] for b in (1, 64, 256)) < 0.15, errors


# the ops each model's step must show in its ledger rows (besides its linears)
TINY_MODELS = {"qwen3": (TINY_QWEN3, {"attention", "embedding"}),
               "qwen35": (TINY_QWEN35, {"attention", "delta_net", "embedding"}),
               # MLA + routed experts: the plan's ops take the backend first, ``(ops, x, ...)``
               "deepseek_v3": (tiny_config(num_hidden_layers=3, vocab_size=200), {"attention", "moe", "embedding"})}


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_ledger_runs_end_to_end_on_the_numpy_backend(name: str, tmp_path: Path) -> None:
    config, must_show = TINY_MODELS[name]
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "ledger.json"
    argv = ["--model-path", str(model_dir), "--device", "cpu", "--load-format", "dummy", "--batches", "1,3",
            "--contexts", "8,40", "--prefill", "16,48,80", "--check", "2:24", "--check-prefill", "32",
            "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert not out.with_suffix(".partial.json").exists()
    decode = [e for e in report["entries"] if e["phase"] == "decode"]
    prefill = [e for e in report["entries"] if e["phase"] == "prefill"]
    assert sorted((e["batch"], e["context"]) for e in decode) == [(1, 8), (1, 40), (3, 8), (3, 40)]
    assert [e["tokens"] for e in prefill] == [16, 48, 80]
    for entry in report["entries"]:
        ops = {row["op"].split("(")[0]: row for row in entry["ops"]}
        assert must_show <= set(ops), sorted(ops)
        linears = [row for row in entry["ops"] if row["op"].startswith("linear(W")]
        assert linears and all(row["bytes"] > 0 and row["flops"] > 0 for row in linears)
        for row in linears:  # FLOPs: 2 x rows x the weight's elements per call (rows: every token, or
            # for the LM head one logits row per sequence)
            out_features, in_features = (int(v) for v in row["op"][len("linear(W"):-1].split("x"))
            rows = row["flops"] / (2.0 * out_features * in_features * row["calls"])
            assert rows in (entry["tokens"], entry["batch"]), row["op"]
        assert ops["attention"]["flops"] > 0 and entry["measured_s"] > 0
        if "moe" in ops:
            assert ops["moe"]["bytes"] > 0 and ops["moe"]["flops"] > 0
        kinds = breakdown(entry)  # every device op counted once, by kind
        assert sum(kinds.values()) == pytest.approx(sum(r["time_s"] for r in entry["ops"]))
        assert "projections (GEMM)" in kinds and "norms" in kinds
    assert [(c["phase"], c["batch"], c["context"]) for c in report["checks"]] == [("decode", 2, 24),
                                                                                  ("prefill", 1, 32)]
    assert all(c["predicted_s"] > 0 and c["measured_s"] > 0 and not c["on_grid"] for c in report["checks"])
    assert report["device"].startswith("CPU") and not report["cuda_graphs"]
    table = out.with_suffix(".md").read_text()
    assert "| decode | 2 | 24 |" in table and "NumPy fp32 matmul" in table and "By kind: " in table


def test_ledger_batches_follow_the_kv_groups() -> None:
    hybrid = StepLayout(vocab_size=50, paged_groups=(True, False), with_state=True)
    batch = decode_batch(3, 33, hybrid)
    assert batch.token_ids.max() < 50 and list(batch.state_slots) == [1, 2, 3]
    assert batch.kv_block_tables[0] is batch.block_tables and batch.kv_block_tables[1].shape == (3, 0)
    assert (batch.kv_slot_mappings[1] == -1).all()
    # each sequence's new token lands in the last of its own blocks
    assert list(batch.slot_mapping) == [int(batch.block_tables[i, 2]) * 16 for i in range(3)]
    dense = prefill_batch(20, StepLayout())
    assert dense.kv_block_tables == () and dense.state_slots.shape == (0,)
    assert list(dense.slot_mapping) == list(range(16, 36)) and dense.max_query_len == 20


@pytest.mark.parametrize("argv", [["--model-path", "/nonexistent-model", "--device", "cpu", "--out", "x.json"],
                                  ["--random", "qwen3-4b", "--device", "cpu", "--repeats", "0", "--out", "x.json"],
                                  ["--random", "qwen3-4b", "--check", "1-512", "--out", "x.json"]])
def test_ledger_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_an_expanded_op_is_recorded_as_the_calls_it_makes() -> None:
    """cuda attention is recorded as its q/k-norm + RoPE + KV write and its kernel, each a row."""
    import types

    from openinfer.tools.ledger import OpRecorder

    kernels = types.ModuleType("kernels")
    kernels.write = lambda x: x + 1
    kernels.attend = lambda x: x * 2

    class Backend:
        name = "fake"

        def attention(self, x: int) -> int:
            return kernels.attend(kernels.write(x))  # module lookups at call time, as attention.py does

        def rms_norm(self, x: int) -> int:
            return x - 3

    backend = Backend()
    recorder = OpRecorder({"backend": backend}, kernel_names=False, expand={"attention": (kernels, ("write", "attend"))})
    calls = recorder.record(lambda: backend.rms_norm(backend.attention(5)))
    assert [(c.owner, c.name, c.args, c.result) for c in calls] == [
        ("attention", "write", (5,), 6), ("attention", "attend", (6,), 12), ("backend", "rms_norm", (12,), 9)]
    assert [c.fn(*c.args) for c in calls] == [6, 12, 9]  # replayed unwrapped
    assert backend.attention(1) == 4 and not recorder.recording  # outside recording: plain calls
    # a model plan's op of the same name (MLA attention) is one row of its own, not dropped
    plan = types.SimpleNamespace(attention=lambda ops, x: x * 10)
    model = types.SimpleNamespace()
    recorder = OpRecorder({"backend": Backend()}, model=model, kernel_names=False,
                          expand={"attention": (kernels, ("write", "attend"))})
    model.attention = recorder._wrap("plan", "attention", plan.attention)
    calls = recorder.record(lambda: model.attention(None, 2))
    assert [(c.owner, c.name, c.result) for c in calls] == [("plan", "attention", 20)]


def test_moe_and_mla_costs_count_what_the_step_must_touch() -> None:
    """A MoE layer's bytes: the experts its tokens reach (all of them once tokens x top_k far
    exceeds the expert count), the shared expert and router; its FLOPs: top_k experts per token.
    MLA's FLOPs take the cheaper form: absorbed for one decode token, decompressed for a long
    prompt with no cached context."""
    import types

    import numpy as np

    from openinfer.mla import MLASpec, MLAWeights
    from openinfer.moe import ExpertWeights, MoEWeights, RouterSpec
    from openinfer.tools.ledger.recording import mla_cost, moe_cost

    def dense(out_features: int, in_features: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(weight=np.zeros((out_features, in_features), np.float32))

    hidden, inner, experts, top_k = 8, 4, 16, 2
    layer = MoEWeights(router=RouterSpec(num_experts=experts, top_k=top_k), gate=np.zeros((experts, hidden), np.float32),
                       experts=[ExpertWeights(dense(2 * inner, hidden), dense(hidden, inner))] * experts,
                       shared=ExpertWeights(dense(2 * inner, hidden), dense(hidden, inner)))
    per_expert = 4 * (2 * inner * hidden + hidden * inner)
    many = np.zeros((1000, hidden), np.float32)
    moved, flops = moe_cost((many, layer, None))
    assert moved == pytest.approx((experts + 1) * per_expert + experts * hidden * 4 + 2 * many.nbytes, rel=1e-6)
    assert flops == pytest.approx(2 * 1000 * (experts * hidden + (top_k + 1) * 3 * inner * hidden))
    one = np.zeros((1, hidden), np.float32)
    assert moe_cost((one, layer, None))[0] == pytest.approx((top_k + 1) * per_expert + experts * hidden * 4 + 2 * one.nbytes)

    spec = MLASpec(num_heads=2, qk_nope_dim=4, qk_rope_dim=2, v_head_dim=4, kv_lora_rank=8, scale=1.0)
    weights = types.SimpleNamespace(mla=MLAWeights(np.zeros((2, 4, 8), np.float32), np.zeros((2, 4, 8), np.float32)))
    kv = types.SimpleNamespace(k=np.zeros((4, 16, 10), np.float32))

    def step(new: list[int], context: list[int]) -> types.SimpleNamespace:
        return types.SimpleNamespace(query_start=np.concatenate(([0], np.cumsum(new))), context_lens=np.array(context))

    decode = mla_cost((np.zeros((1, 4 + 10)), weights, kv, None, spec, None, None, 1e-6), step([1], [100]))
    absorbed = 2 * 2 * 8 * (4 + 4) + 100 * 2 * 2 * (8 + 2 + 8)
    assert decode[1] == pytest.approx(absorbed)
    assert decode[0] == pytest.approx(14 * 8 + 2 * 4 * 8 + 2 * 64 * 4 + 100 * 10 * 4)
    prompt = mla_cost((np.zeros((64, 14)), weights, kv, None, spec, None, None, 1e-6), step([64], [64]))
    pairs = 64 * 65 / 2
    assert prompt[1] == pytest.approx(2 * 64 * 8 * 2 * 8 + pairs * 2 * 2 * (4 + 2 + 4))
