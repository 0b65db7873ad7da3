"""The kernel ledger's step-time model, re-derived on the CPU from the committed ledgers
(``python -m openinfer.tools.ledger --from-json``): tables render, and the committed Qwen3
predictions stay within 15 % of the measured steps at batch 1, 64 and 256."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openinfer.tools.ledger import StepModel, _interpolate, main

ROOT = Path(__file__).resolve().parents[2]
LEDGERS = {"qwen3": ROOT / "plugins/openinfer-qwen3/src/openinfer_qwen3/ledger.json",
           "qwen35": ROOT / "plugins/openinfer-qwen35/openinfer_qwen35/ledger.json"}


def test_interpolation_linear_and_quadratic() -> None:
    assert _interpolate([1.0, 2.0, 4.0], [1.0, 2.0, 4.0], 3.0) == pytest.approx(3.0)
    assert _interpolate([1.0, 2.0], [1.0, 2.0], 5.0) == pytest.approx(5.0)  # extrapolates
    assert _interpolate([1.0, 2.0, 4.0], [1.0, 4.0, 16.0], 3.0, degree=2) == pytest.approx(9.0)


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
