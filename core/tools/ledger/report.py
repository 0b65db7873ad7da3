"""The ledger's report: ops grouped by kind, the markdown tables, the JSON (final and partial)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from openinfer.tools.ledger.recording import ATTENTION_KERNEL_CALLS
from openinfer.tools.ledger.step_model import predict_checks

# what an op is, by its name (the op key up to its weight shape); first match wins
OP_KINDS = (
    ("projections (GEMM)", ("linear", "add_rms_norm_linear", "silu_mul_linear", "linear_residual")),
    ("MoE (routing, experts, combine)", ("moe",)),
    ("attention (q/k norm, RoPE, KV write, attention)", ("attention", "mla_attention")),
    ("attention kernels", ATTENTION_KERNEL_CALLS),
    ("q/k norm, RoPE, KV write", ("write_qkv",)),
    ("Gated DeltaNet", ("delta_net",)),
    ("norms", ("rms_norm", "add_rms_norm")),
    ("activations", ("silu_mul", "sigmoid_mul", "gelu_mul")),
    ("embedding, gathers, adds", ("embedding", "gather_rows", "add")),
)


def op_kind(op: str) -> str:
    name = op.split("(")[0]
    return next((kind for kind, names in OP_KINDS if name in names), "other")


def breakdown(entry: dict[str, Any]) -> dict[str, float]:
    """Device seconds of one step by kind of op (largest first); host-only rows left out."""
    kinds: dict[str, float] = defaultdict(float)
    for row in entry["ops"]:
        if not row["op"].startswith("(host"):
            kinds[op_kind(row["op"])] += row["time_s"]
    return dict(sorted(kinds.items(), key=lambda item: -item[1]))


def markdown(report: dict[str, Any]) -> str:
    copy_name, gemm_name = report.get("ceiling_names", ("copy", "cuBLAS bf16"))
    lines = [f"# Kernel ledger: {report['name']}", "",
             f"Device: {report['device']}; ceilings measured in the same run: {copy_name} "
             f"{report['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, {gemm_name} "
             f"{report['ceilings']['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s. Written by `{report['command']}`.",
             "Per op and step: time = device time summed over the op's calls in one step (layers), "
             "% roofline = max(bytes / copy rate, FLOPs / GEMM rate) / time.", "",
             "## Step-time model: predicted vs measured", "",
             f"Decode: {report['model']['decode']}"
             + (f" ({report['model']['decode_graph_saving_s'] * 1e3:.3f} ms)." if report["cuda_graphs"] else ".")
             + f" Prefill: {report['model']['prefill']}. Check points off the grid are true predictions.", "",
             "| phase | batch | context | predicted ms | measured ms | error | grid point? | measured how |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for check in report["checks"]:
        lines.append(f"| {check['phase']} | {check['batch']} | {check['context']} | {check['predicted_s'] * 1e3:.3f} | "
                     f"{check['measured_s'] * 1e3:.3f} | {100 * check['error']:+.1f} % | "
                     f"{'yes' if check['on_grid'] else 'no'} | {check['measured_how']} |")
    for entry in report["entries"]:
        kinds = ", ".join(f"{kind} {seconds * 1e3:.3f} ms ({100 * seconds / max(entry['sum_device_s'], 1e-12):.0f} %)"
                          for kind, seconds in breakdown(entry).items())
        lines += ["", f"## {entry['phase']}: batch {entry['batch']}, context {entry['context']} "
                      f"(measured step {entry['measured_s'] * 1e3:.3f} ms, ops sum {entry['sum_device_s'] * 1e3:.3f} ms)", "",
                  f"By kind: {kinds}.", "",
                  "| op | kernels | shape | calls | ms | GB | GFLOP | % roofline | bound |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for row in entry["ops"]:
            pct = f"{row['roofline_pct']:.0f}" if row.get("roofline_pct") is not None else ""
            if row["op"].startswith("(host"):
                row = {**row, "time_s": row["host_s"], "bound": "host time, not on the device"}
            lines.append(f"| {row['op']} | {', '.join(row['kernels'])} | {row['shape']} | {row['calls']} | "
                         f"{row['time_s'] * 1e3:.3f} | {row['bytes'] / 1e9:.3f} | {row['flops'] / 1e9:.1f} | {pct} | {row['bound']} |")
    return "\n".join(lines) + "\n"


def write_partial(report: dict[str, Any], path: Path) -> None:
    """The entries so far (a device run cut short still leaves its measurements)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def write_report(report: dict[str, Any], out: Path, markdown_path: str | None) -> None:
    predict_checks(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    Path(markdown_path or out.with_suffix(".md")).write_text(markdown(report))
    print("\n phase    batch context  predicted_ms  measured_ms  error")
    for r in report["checks"]:
        print(f" {r['phase']:8s} {r['batch']:5d} {r['context']:7d} {r['predicted_s'] * 1e3:13.3f} "
              f"{r['measured_s'] * 1e3:12.3f} {100 * r['error']:+6.1f} %")


