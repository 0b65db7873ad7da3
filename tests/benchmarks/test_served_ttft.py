"""benchmarks/served_ttft.py: variants parsed or refused clearly, the summary's medians and ratios,
and a stub-engine run (the real ``openinfer serve``, two variants, spans) end to end."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import served_ttft  # noqa: E402


@pytest.mark.parametrize(("text", "parsed"), [
    ("base:", ("base", {})),
    ("spin:OPENINFER_CORE_SPIN_MS=25", ("spin", {"OPENINFER_CORE_SPIN_MS": "25"})),
    ("both:OPENINFER_A=1,OPENINFER_B=x", ("both", {"OPENINFER_A": "1", "OPENINFER_B": "x"})),
])
def test_variants_parse(text, parsed):
    assert served_ttft.parse_variant(text) == parsed


@pytest.mark.parametrize("text", ["base", ":OPENINFER_A=1", "x:PATH=/tmp", "x:OPENINFER_A"])
def test_bad_variants_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="variant"):
        served_ttft.parse_variant(text)


def test_summary_pools_every_round_and_compares_with_the_first_variant():
    rng = np.random.default_rng(0)

    def run(scale: float) -> dict:
        return {"ttft": [{"context": 16384, "warm_ttft_ms_each": list(scale * rng.uniform(9, 11, 5)),
                          "cold_ttft_ms_each": list(scale * rng.uniform(300, 320, 5))}]}

    report = {"contexts": [16384], "variants": [{"name": "a", "runs": [run(1.0), run(1.0)]},
                                                {"name": "b", "runs": [run(0.5), {"error": "x", "ttft": []}]}]}
    lines = served_ttft.summary(report)
    assert lines[0].startswith("warm  16384: a ") and "n 10" in lines[0] and "n 5" in lines[0]
    assert "(0.50" in lines[0] or "(0.49" in lines[0] or "(0.51" in lines[0]
    assert lines[1].startswith("cold  16384:")


def test_a_stub_run_measures_each_variant_and_the_timeline(tmp_path):
    out = tmp_path / "served.json"
    subprocess.run([sys.executable, str(BENCHMARKS / "served_ttft.py"), "--stub", "--contexts", "64,256",
                    "--repeats", "2", "--variant", "base:", "--variant", "submit:OPENINFER_SUBMIT_AT_ONCE=1",
                    "--spans", "--out", str(out)], check=True, timeout=240, capture_output=True)
    report = json.loads(out.read_text())
    for variant in report["variants"]:
        [run] = variant["runs"]
        assert [row["context"] for row in run["ttft"]] == [64, 256]
        for row in run["ttft"]:
            assert row["num_failed"] == 0 and len(row["warm_ttft_ms_each"]) == 2
            assert all(cached >= 48 for cached in row["warm_cached_tokens"])
    assert [row["context"] for row in report["spans"]] == [64, 256]
    assert "body_decode->body_decoded" in report["spans"][1]["segments_ms"]
    assert any("submit" in line and "x base" in line for line in report["summary"])
