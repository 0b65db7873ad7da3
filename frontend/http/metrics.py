"""Prometheus metrics of one HTTP server (its own registry, so several apps can share a process).

Counters and histograms are fed by the request path (``ChoiceStream``); the gauges of engine
state (running, waiting, KV blocks) are read from ``engine.load()`` at scrape time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from openinfer.engine import EngineHandle

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)


def process_rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (Linux /proc), None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ProcessTable:
    """The processes of one ``openinfer serve`` (role → pid), as the supervisor writes them."""

    def __init__(self, run_dir: str | None = None):
        self.path = Path(run_dir) / "processes.json" if run_dir else None

    def pids(self) -> dict[str, int]:
        if self.path is not None:
            try:
                return {str(k): int(v) for k, v in json.loads(self.path.read_text()).items()}
            except (OSError, ValueError):
                pass
        return {"server": os.getpid()}


class FrontendMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: EngineHandle, model_name: str, processes: ProcessTable | None = None):
        self.engine = engine
        self.processes = processes or ProcessTable()
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        names = ["model_name"]
        self.requests = Counter("openinfer_request_success", "Requests that completed (stop or length)",
                                [*names, "finished_reason"], registry=self.registry)
        # aborted (client gone, queue wait timed out, shutdown) and failed requests are not successes
        self.aborted = Counter("openinfer_request_aborted", "Requests aborted before they completed",
                               names, registry=self.registry).labels(**labels)
        self.failed = Counter("openinfer_request_failed", "Requests the engine ended with an error",
                              names, registry=self.registry).labels(**labels)
        self.prompt_tokens = Counter("openinfer_prompt_tokens", "Prompt tokens of finished requests",
                                     names, registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("openinfer_generation_tokens", "Generated tokens",
                                         names, registry=self.registry).labels(**labels)
        self.ttft = Histogram("openinfer_time_to_first_token_seconds", "Arrival to first generated token",
                              names, buckets=TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram("openinfer_inter_token_latency_seconds", "Time between generated tokens",
                             names, buckets=ITL_BUCKETS, registry=self.registry).labels(**labels)
        self.running = Gauge("openinfer_num_requests_running", "Requests in the running batch",
                             names, registry=self.registry).labels(**labels)
        self.waiting = Gauge("openinfer_num_requests_waiting", "Requests waiting in the queue",
                             names, registry=self.registry).labels(**labels)
        self.kv_used = Gauge("openinfer_kv_blocks_used", "KV-cache blocks in use",
                             names, registry=self.registry).labels(**labels)
        self.kv_total = Gauge("openinfer_kv_blocks_total", "KV-cache blocks in the pool",
                              names, registry=self.registry).labels(**labels)
        self.kv_cached = Gauge("openinfer_kv_blocks_cached", "Free KV-cache blocks still holding a cached prefix",
                               names, registry=self.registry).labels(**labels)
        self.rss = Gauge("openinfer_process_resident_memory_bytes",
                         "Resident memory of each openinfer process (supervisor, engine core, API servers)",
                         [*names, "process"], registry=self.registry)
        self.kv_usage = Gauge("openinfer_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                              names, registry=self.registry).labels(**labels)

    def observe_tokens(self, arrival_time: float, last_token_time: float | None, now: float,
                       num_tokens: int) -> None:
        """One Tokens event of ``num_tokens`` ids arrived at ``now``."""
        if last_token_time is None:
            if arrival_time:
                self.ttft.observe(max(0.0, now - arrival_time))
        elif num_tokens:
            gap = max(0.0, now - last_token_time) / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(gap)

    def observe_finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        if reason == "abort":
            self.aborted.inc()
        elif reason == "error":
            self.failed.inc()
        else:
            self.requests.labels(finished_reason=reason, **self._labels).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        load = self.engine.load()
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_used.set(load.kv_blocks_used)
        self.kv_total.set(load.kv_blocks_total)
        self.kv_cached.set(load.kv_blocks_cached)
        self.kv_usage.set(load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0)
        self.rss.clear()
        for role, pid in self.processes.pids().items():
            rss = process_rss_bytes(pid)
            if rss is not None:
                self.rss.labels(process=role, **self._labels).set(rss)
        return generate_latest(self.registry)
