"""The multi-GPU benchmarks run end to end on the CPU (``--tiny --device cpu``), so the scripts
the multi-GPU machine runs cannot rot between device windows: Qwen3-8B-shaped TP=1 vs TP=2,
Moonlight-shaped EP=1 vs EP=2 and DeepSeek-V4-Flash-shaped EP=2 through the engine with dummy
weights, and the full DeepSeek-V4-Flash memory plan on two H200s in the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def run(tmp_path: Path, *args: str, script: str = "gpu_expert_parallel.py") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)


def test_tensor_parallel_smoke(tmp_path):
    result = run(tmp_path, "--tiny", "--device", "cpu", script="gpu_tensor_parallel.py")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "tensor_parallel_tiny.json").read_text())
    assert [r["tensor_parallel_size"] for r in report["runs"]] == [1, 2]
    assert set(report["speedup_tp2_over_tp1"]) == {"decode_bs1", "decode_bs4", "prefill_4k"}
    # the plan is the full Qwen3-8B shape's: TP=2 holds about half the weights per rank
    one, two = (report["plans"][k]["ranks"][0]["weight_gib"] for k in ("tp1", "tp2"))
    assert 14 < one < 16 and two == pytest.approx(one / 2, rel=0.02)


def test_moonlight_ep1_vs_ep2_smoke(tmp_path):
    result = run(tmp_path, "moonlight", "--tiny", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "expert_parallel_moonlight_tiny.json").read_text())
    assert [r["expert_parallel_size"] for r in report["runs"]] == [1, 2]
    for run_ in report["runs"]:  # a CPU decode may stream its tokens in one burst (TPOT 0): only TTFT must be > 0
        assert run_["decode_bs1_tpot_ms"] >= 0 and run_["decode_bs4_tpot_ms"] >= 0 and run_["prefill_64_ttft_ms"] > 0
    assert set(report["speedup_ep2_over_ep1"]) == {"decode_bs1_tpot", "decode_bs4_tpot", "prefill_64_ttft"}
    # the plan is the full Moonlight shape's: experts halve at EP=2, the rest stays
    one, two = (report["memory_plan"][k]["ranks"][0]["weights_by_split_gib"] for k in ("ep1", "ep2"))
    assert two["experts"] == pytest.approx(one["experts"] / 2) and two["replicated"] == one["replicated"]


def test_deepseek_v4_flash_ep2_smoke_and_two_h200_plan(tmp_path):
    result = run(tmp_path, "dsv4-flash", "--tiny", "--device", "cpu", "--sizes", "1,2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "memory plan: deepseek_v4 (43 layers, 256 FP4 experts)" in result.stdout
    report = json.loads((tmp_path / "expert_parallel_dsv4_flash_tiny.json").read_text())
    assert all("error" not in r for r in report["runs"])
    plan = report["memory_plan"]
    assert not plan["ep1"]["fits"] and "raise --expert-parallel-size" in plan["ep1"]["refusal"]
    two = plan["ep2"]
    assert two["fits"] and len(two["ranks"]) == 2 and report["memory_plan_gpu_gib"] == pytest.approx(140.0)
    # each H200 keeps KV for dozens of 128k-token sequences next to its half of the experts
    assert two["sequences_at_max_model_len"] >= 16 and two["ranks"][0]["weight_gib"] < 80


def test_bad_sizes_exit_2(tmp_path):
    result = run(tmp_path, "moonlight", "--tiny", "--device", "cpu", "--sizes", "two")
    assert result.returncode == 2 and "--sizes" in result.stderr


def test_multi_gpu_script_dry_run(tmp_path):
    """The next device window's one command, its phases run on tiny shapes on the CPU."""
    import os

    env = {**os.environ, "MULTI_GPU_DRY_RUN": "1", "PHASES": "install selftest moonlight nonsense",
           "PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(["bash", str(BENCHMARKS / "gpu_multi_gpu_all.sh")], cwd=BENCHMARKS.parent, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "run.log").read_text()
    assert "END moonlight: exit 0" in log and "unknown phase nonsense" in log
    assert json.loads((tmp_path / "expert_parallel_moonlight_tiny.json").read_text())["runs"]
