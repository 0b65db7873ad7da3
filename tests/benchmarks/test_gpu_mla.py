"""benchmarks/gpu_mla.py's CPU side: its plan (points, variants, roofline bytes and FLOPs) as a dry
run, and bad arguments refused with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_mla.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_dry_run_prints_the_plan():
    result = run("--dry-run", "--batches", "1,256", "--contexts", "1024", "--prefill", "1024",
                 "--variants", "auto,mma_shared:64,mma_shared:32:16,mma_shared:::waves,mma_shared::::wide")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert [(p["batch"], p["context"]) for p in plan["decode"]] == [(1, 1024), (256, 1024)]
    # 576 bf16 latents per token of context (the new token's included)
    assert plan["decode"][1]["cache_bytes"] == 256 * 1025 * 576 * 2
    # causal: 16 heads x (192 + 128) dims x 2 FLOPs per visible (query, key) pair
    assert plan["prefill"][0]["attention_gflop"] == 2 * 16 * 320 * 1024 * 1025 / 2 / 1e9
    assert [(v["kernel"], v["keys"], v["max_splits"], v["policy"], v["combine"]) for v in plan["variants"]] == [
        ("auto", "", "", "", ""), ("mma_shared", "64", "", "", ""), ("mma_shared", "32", "16", "", ""),
        ("mma_shared", "", "", "waves", ""), ("mma_shared", "", "", "", "wide")]


def test_prefill_plan_heads_and_kernel_variants():
    result = run("prefill", "--dry-run", "--prefill", "1024,8192", "--prefill-heads", "16,64",
                 "--prefill-kernels", "pipelined,wgmma,wgmma:64:1:1:1", "--variants", "auto:::::1")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert [(p["heads"], p["tokens"]) for p in plan["prefill"]] == [(16, 1024), (16, 8192), (64, 1024), (64, 8192)]
    assert plan["prefill"][3]["attention_gflop"] == 2 * 64 * 320 * 8192 * 8193 / 2 / 1e9
    assert [(k["kernel"], k["keys"], k["pingpong"], k["split_kv"], k["tma"]) for k in plan["prefill_kernels"]] == [
        ("pipelined", "", "", "", ""), ("wgmma", "", "", "", ""), ("wgmma", "64", "1", "1", "1")]
    assert plan["variants"][0]["q_regs"] == "1"


def test_ragged_plan_and_tma_fields():
    result = run("decode", "--dry-run", "--ragged", "--batches", "64", "--contexts", "1024", "--decode-heads", "64",
                 "--variants", "auto,tma:16:::::4:8:0:1,tma::::::::1,mma_shared::::::::::1")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert plan["ragged"] and plan["decode_heads"] == 64
    # contexts spread over [128, 1920] (mean 1024): the same bytes as 64 x 1024
    assert plan["decode"][0]["cache_bytes"] == 64 * 1025 * 576 * 2
    assert [(v["keys"], v["stages"], v["cluster"], v["balance"], v["barriers"]) for v in plan["variants"]] == [
        ("", "", "", "", ""), ("16", "4", "8", "0", "1"), ("", "", "", "1", ""), ("", "", "", "", "")]
    assert plan["variants"][3]["write_absorb"] == "1" and plan["variants"][3]["expand"] == ""


def test_variant_switches_after_the_fields():
    """``+OPENINFER_NAME=VALUE`` after a variant's fields: any core switch (the fused latent write, clusters ...)."""
    result = run("decode", "--dry-run", "--batches", "16", "--contexts", "1024",
                 "--variants", "auto,tma:32+OPENINFER_MLA_FUSED_WRITE=1+OPENINFER_MLA_TMA_CLUSTER=16")
    assert result.returncode == 0, result.stderr
    variants = json.loads(result.stdout)["plan"]["variants"]
    assert variants[0]["switches"] == {}
    assert variants[1]["keys"] == "32"
    assert variants[1]["switches"] == {"OPENINFER_MLA_FUSED_WRITE": "1", "OPENINFER_MLA_TMA_CLUSTER": "16"}
    assert run("--dry-run", "--variants", "auto+FUSED=1").returncode == 2


def test_device_cpu_is_a_dry_run():
    result = run("decode", "--device", "cpu", "--batches", "16")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["prefill"] == []


def test_bad_arguments_exit_2():
    for args in (["--variants", "tensor"], ["--variants", "mma_shared:48"], ["--variants", "mma:32:0"],
                 ["--batches", "x"], ["--batches", "0"], ["warp"], ["--variants", ","],
                 ["--prefill-kernels", "fast"], ["--prefill-kernels", ""],
                 ["--variants", "mma_shared:32:4:often"], ["--variants", "mma:32:4:waves:x"],
                 ["--variants", "mma:32:4:waves:wide:y"], ["--variants", "mma_shared:32:4:waves:wide:2"],
                 ["--prefill-kernels", "wgmma:96"], ["--prefill-kernels", "wgmma:64:2"],
                 ["--prefill-kernels", "wgmma:64:1:1:1:1:1"], ["--prefill-kernels", "wgmma:64:1:1:1:x"],
                 ["--prefill-heads", "0"], ["--variants", "tma:48"], ["--variants", "mma_shared:32:::::2"],
                 ["--variants", "tma:::::::3"], ["--variants", "mma:::::::8"], ["--variants", "tma::::::::2"],
                 ["--variants", "tma:32:::::2:8:1:x"], ["--variants", "tma:32:::::2:8:1:3"],
                 ["--variants", "mma:::::::::1"], ["--variants", "auto::::::::::2"],
                 ["--variants", "mma:::::::::::1"], ["--variants", "tma:::::::::::2"],
                 ["--variants", "auto::::::::::::2"], ["--variants", "auto::::::::::::1:1:1"], ["--variants", "auto:::::::::::::2"],
                 ["--decode-heads", "0"]):
        result = run("--dry-run", *args)
        assert result.returncode == 2 and "error" in result.stderr, args
