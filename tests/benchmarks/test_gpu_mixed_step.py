"""benchmarks/gpu_mixed_step.py on the NumPy backend: a tiny Qwen3 with random weights, one mixed
step (decodes first, then prompt chunks) and one decode step through the ledger, the report
summed by kind of op; bad arguments exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_mixed_step  # noqa: E402

TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": True}


def test_a_burst_step_fills_the_budget_decodes_first():
    # no decodes: whole prompts, then the first chunk of one more
    assert gpu_mixed_step.burst_step(0, 40, 16, 50) == ([16, 16, 8], [16, 16, 8])
    # decodes first, then the rest of the prompt the last step cut (over its cached start)
    assert gpu_mixed_step.burst_step(3, 40, 16, 50) == ([1, 1, 1, 3, 16, 16, 2], [50, 50, 50, 16, 16, 16, 2])
    new, contexts = gpu_mixed_step.burst_step(30, 40, 16, 50)
    assert sum(new) == 40 and new[30:] == [10] and contexts[30:] == [16]
    with pytest.raises(ValueError):
        gpu_mixed_step.burst_step(40, 40, 16, 50)


def test_a_cpu_run_ledgers_mixed_steps_and_a_decode_step(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN3))
    out = tmp_path / "results"
    assert gpu_mixed_step.main(["--device", "cpu", "--model-path", str(model), "--load-format", "dummy",
                                "--decodes", "3,0", "--budget", "40", "--prompt-len", "16", "--context", "40",
                                "--decode-batch", "5", "--decode-context", "24", "--repeats", "1",
                                "--results-dir", str(out), "--tag", "cpu-check"]) == 0
    report = json.loads((out / "mixed_step_cpu-check.json").read_text())
    decode, prompts_only, mixed = report["entries"]
    assert (decode["phase"], decode["batch"], decode["tokens"]) == ("decode", 5, 5)
    assert (prompts_only["phase"], prompts_only["batch"], prompts_only["tokens"]) == ("mixed", 3, 40)
    assert (mixed["phase"], mixed["batch"], mixed["tokens"]) == ("mixed", 7, 40)
    (comparison,) = report["comparisons"]
    by_op = {row["op"]: row for row in comparison["ops"]}
    attention = next(row for row in mixed["ops"] if row["op"] == "attention")
    assert by_op["attention"]["ms"] == pytest.approx(attention["time_s"] * 1e3)
    assert by_op["attention"]["difference_ms"] == pytest.approx(by_op["attention"]["ms"] - by_op["attention"]["base_ms"])
    for entry, summary in zip(report["entries"], report["summaries"], strict=True):
        ops = {row["op"].split("(")[0] for row in entry["ops"]}
        assert {"linear", "attention", "silu_mul", "add_rms_norm", "embedding"} <= ops
        assert summary["gemm_ms"] > 0 and summary["non_gemm_ms"] > 0
        assert summary["gemm_ms"] + summary["non_gemm_ms"] == pytest.approx(summary["ops_sum_ms"])
        assert sum(summary["by_kind_ms"].values()) == pytest.approx(summary["ops_sum_ms"])
    assert "overlap" not in report  # the two-stream probe is cuda only
    table = (out / "mixed_step_cpu-check.md").read_text()
    assert "## mixed step: 3 decodes at context 40 + prompt pieces 3 (of 16), 16, 16, 2" in table
    assert "against mixed step: 0 decodes" in table
    assert "| silu_mul | activations |" in table


@pytest.mark.parametrize("argv", [["--budget", "0"], ["--decode-batch", "-1"], ["--tag", "a/b"],
                                  ["--decodes", "8192"], ["--decodes", "x"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_mixed_step.main(["--device", "cpu", *argv])
    assert exit_info.value.code == 2


def test_a_run_without_a_decode_step(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN3))
    out = tmp_path / "results"
    assert gpu_mixed_step.main(["--device", "cpu", "--model-path", str(model), "--load-format", "dummy",
                                "--decodes", "3", "--budget", "40", "--prompt-len", "16", "--context", "40",
                                "--decode-batch", "0", "--repeats", "1", "--results-dir", str(out)]) == 0
    (mixed,) = json.loads((out / "mixed_step.json").read_text())["entries"]
    assert (mixed["phase"], mixed["tokens"]) == ("mixed", 40)
