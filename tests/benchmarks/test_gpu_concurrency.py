"""benchmarks/gpu_concurrency.py: the #16/#12 comparison table from a JSON holding both servers,
and a stub-engine run (the real ``openinfer serve``) whose TTFT rows are measured for ours and,
appended by a second call, for a peer server standing in for vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_concurrency  # noqa: E402


def sweep_row(streams: int, client: str, rng: np.random.Generator) -> dict:
    return {"streams": streams, "client": client, "output_throughput": float(rng.uniform(100, 5000)),
            "tpot_ms": {"p50": float(rng.uniform(2, 60)), "p99": 99.0}}


def server_run(server: str, label: str, rng: np.random.Generator, contexts: list[int]) -> dict:
    sweep = [sweep_row(n, client, rng) for client in ("httpx", "lean") for n in (1, 16, 64, 256)]
    ttft = [{"context": c, "cold_ttft_ms": float(rng.uniform(20, 900)), "warm_ttft_ms": float(rng.uniform(5, 80)),
             "warm_cached_tokens": [c - 16, c - 16, None]} for c in contexts]
    return {"server": server, "label": label, "sweep": sweep, "ttft": ttft,
            "idle_rss_bytes": {"total": float(rng.uniform(1, 6)) * 2**30},
            "cold_start_to_http_ready_s": float(rng.uniform(3, 200))}


def table_cells(table: str) -> dict[str, list[str]]:
    rows = {}
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| |"):
            name, *cells = [part.strip() for part in line.strip("|").split("|")]
            rows[name] = cells
    return rows


def test_the_table_compares_the_first_openinfer_run_with_vllm(tmp_path, capsys):
    rng = np.random.default_rng(16)
    contexts = [1024, 4096, 16384]
    ours = server_run("openinfer", "openinfer (1 API server)", rng, contexts)
    other = server_run("openinfer", "openinfer (2 API servers)", rng, contexts)
    peer = server_run("vllm", "vLLM", rng, contexts)
    report = {"device": "NVIDIA H200", "model": "Qwen3-4B shape", "input_len": 1024, "output_len": 128,
              "runs": [ours, other, peer]}
    (tmp_path / "side.json").write_text(json.dumps(report))
    assert gpu_concurrency.main(["--table", "--results-dir", str(tmp_path), "--tag", "side"]) == 0
    rows = table_cells(capsys.readouterr().out)

    def lean(run: dict, streams: int) -> dict:
        return next(r for r in run["sweep"] if r["client"] == "lean" and r["streams"] == streams)

    def check(name: str, mine: float, theirs: float, higher_is_better: bool, digits: int) -> None:
        cells = rows[name]
        assert cells[0].startswith(f"{mine:,.{digits}f}") and cells[1].startswith(f"{theirs:,.{digits}f}")
        assert cells[2] == f"{(mine / theirs if higher_is_better else theirs / mine):.2f}×"

    check("bs=1 TPOT p50 (ms)", lean(ours, 1)["tpot_ms"]["p50"], lean(peer, 1)["tpot_ms"]["p50"], False, 2)
    for streams in (16, 64, 256):
        check(f"{streams} streams: output tok/s", lean(ours, streams)["output_throughput"],
              lean(peer, streams)["output_throughput"], True, 0)
        check(f"{streams} streams: TPOT p50 (ms)", lean(ours, streams)["tpot_ms"]["p50"],
              lean(peer, streams)["tpot_ms"]["p50"], False, 1)
    for index, context in enumerate(contexts):
        check(f"cold TTFT, {context:,}-token prompt (ms)", ours["ttft"][index]["cold_ttft_ms"],
              peer["ttft"][index]["cold_ttft_ms"], False, 1)
        name = f"warm-prefix TTFT, {context:,}-token prompt, last token changed (ms)"
        check(name, ours["ttft"][index]["warm_ttft_ms"], peer["ttft"][index]["warm_ttft_ms"], False, 1)
        assert all(cell.endswith(f"({context - 16:,} cached)") for cell in rows[name][:2])
    # the full-batch decode step comes from openinfer's step log only: no vLLM cell, no ratio
    report["failures"] = ["openinfer ×2: TimeoutError('not ready')"]
    full = lean(ours, 256)["full_batch_decode"] = {"num_steps": 90, "seqs": 256, "busy_ms_p50": 14.6,
                                                   "tpot_over_step": lean(ours, 256)["tpot_ms"]["p50"] / 14.6}
    (tmp_path / "side.json").write_text(json.dumps(report))
    gpu_concurrency.main(["--table", "--results-dir", str(tmp_path), "--tag", "side"])
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("failed: openinfer ×2: TimeoutError('not ready')")
    rows = table_cells(printed)
    assert rows["256 streams: full-batch decode step, same run (ms)"] == ["14.60 (GPU time)", "—", "—"]
    assert rows["256 streams: TPOT p50 ÷ that step"] == [f"{full['tpot_over_step']:.2f}", "—", "—"]
    assert "64 streams: TPOT p50 ÷ that step" not in rows
    check("idle RSS, all processes (MiB)", ours["idle_rss_bytes"]["total"] / 2**20,
          peer["idle_rss_bytes"]["total"] / 2**20, False, 0)
    check("cold start → HTTP ready (s)", ours["cold_start_to_http_ready_s"], peer["cold_start_to_http_ready_s"],
          False, 1)


@pytest.mark.slow
def test_a_stub_run_and_an_appended_peer_both_get_ttft_rows(tmp_path, capsys):
    common = ["--stub", "--streams", "2", "--clients", "lean", "--client-procs", "1", "--input-len", "16",
              "--output-len", "24", "--ttft-contexts", "40,300", "--ttft-repeats", "2", "--max-model-len", "1024",
              "--results-dir", str(tmp_path), "--tag", "stub"]
    assert gpu_concurrency.main(common + ["--api-server-counts", "1"]) == 0
    # the peer: another `openinfer serve` of the stub model, in vLLM's place (--vllm-url)
    port = gpu_concurrency.free_port()
    peer = subprocess.Popen([sys.executable, "-m", "openinfer.cli", "serve", "--model-path",
                             "/tmp/openinfer-stub-concurrency", "--port", str(port), "--grpc-port", "0",
                             "--max-model-len", "1024", "--engine-factory", gpu_concurrency.STUB_FACTORY,
                             "--device", "cpu", "--log-level", "warning"], start_new_session=True)
    try:
        gpu_concurrency.wait_ready(f"http://127.0.0.1:{port}", peer, 120)
        assert gpu_concurrency.main(common + ["--api-server-counts", "0", "--append",
                                              "--vllm-url", f"http://127.0.0.1:{port}"]) == 0
    finally:
        gpu_concurrency.stop(peer)
    report = json.loads((tmp_path / "stub.json").read_text())
    assert [run["server"] for run in report["runs"]] == ["openinfer", "vllm"] and not report.get("failures")
    for run in report["runs"]:
        assert [row["context"] for row in run["ttft"]] == [40, 300]
        for row in run["ttft"]:
            assert row["num_failed"] == 0 and len(row["cold_ttft_ms_each"]) == len(row["warm_ttft_ms_each"]) == 2
            assert row["cold_ttft_ms"] > 0 and row["warm_ttft_ms"] > 0
            assert row["cold_cached_tokens"] == [0, 0]  # fresh prompts: nothing cached
            # the warm prompt differs only in its last token: every full block before it is cached
            assert all(0 < cached < row["context"] for cached in row["warm_cached_tokens"])
    # the stub's step takes 14.5 ms: in steady state its full-batch decode steps (2 streams decoding) come
    # that far apart (the first launches of a burst queue ahead of the "device": 24 tokens keep them a minority)
    burst = report["runs"][0]["sweep"][0]
    full = burst["full_batch_decode"]
    assert full["num_steps"] >= 1 and full["seqs"] == 2 and full["period_ms_p50"] >= 14.0
    assert full["tpot_over_step"] == pytest.approx(burst["tpot_ms"]["p50"] / full["period_ms_p50"])
    rows = table_cells(capsys.readouterr().out.rsplit("| | openinfer | vLLM | ratio |", 1)[1])
    assert rows["cold TTFT, 300-token prompt (ms)"][2].endswith("×")  # both servers in the last table
    try:  # the PNG is written where matplotlib is installed (not on CI)
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        assert not (tmp_path / "stub.png").exists()
    else:
        assert (tmp_path / "stub.png").stat().st_size > 0


def test_per_request_tpot_pairs_streams_with_the_steps_their_requests_rode_in():
    columns = ["began", "host_ms", "tokens", "seqs", "decodes", "max_query", "graph",
               "device_start_ms", "busy_ms", "gap_ms"]
    # step 0 prefills a and b, step 1 decodes them beside c's prompt (a long mixed step), steps 2-3
    # decode all three, step 4 only c; each step begins 0.1 s after the previous (wall clock)
    busy = [50.0, 100.0, 10.0, 10.0, 9.0]
    starts = [0.0, 51.0, 152.0, 163.0, 175.0]
    steps = [[100.0 + 0.1 * i, 1.0, 0, 0, 0, 1, 0, start, b, None if i == 0 else 1.0]
             for i, (start, b) in enumerate(zip(starts, busy, strict=True))]
    log = {"columns": columns, "steps": steps, "decode_rows": {"a": [1, 2, 3], "b": [1, 2, 3], "c": [2, 3, 4]}}
    # a and b: first token after step 0, last after step 3, 4 tokens; c one step later
    row = {"burst_began": 99.0, "burst_ended": 101.0,
           "stream_times": [[100.06, 100.36, 4], [100.16, 100.46, 4], [100.05, 100.35, 4]]}
    out = gpu_concurrency.per_request_tpot(row, log)
    assert out["matched"] and out["num_streams"] == out["num_engine_requests"] == 3
    assert out["decode_steps_per_token"] == 1.0
    # a / b rode steps 1-3 (100 + 10 + 10 ms); c rode 2-4 (10 + 10 + 9)
    device = sorted([120.0 / 3] * 2 + [29.0 / 3])
    assert np.isclose(out["device_ms"]["p50"], np.percentile(device, 50))
    tpot = [100.0, 100.0, 100.0]  # every stream: 0.3 s over 3 tokens after its first
    assert np.isclose(out["tpot_over_device"]["p50"], np.percentile(np.divide(tpot, [40.0, 40.0, 29.0 / 3]), 50))
    # cadence on the device timeline: a / b from the end of step 0 (50) to the end of step 3 (173),
    # c from the end of step 1 (151) to the end of step 4 (184), over 3 steps each
    assert np.isclose(out["engine_ms"]["p50"], 41.0) and np.isclose(out["engine_ms"]["mean"], (41 + 41 + 11) / 3)
    one_short = dict(row, stream_times=row["stream_times"][:2])
    assert not gpu_concurrency.per_request_tpot(one_short, log)["matched"]
