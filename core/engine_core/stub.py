"""A model-free ``PagedEngine`` whose "device" takes a fixed time per step.

For serving benchmarks and fault tests on the CPU: everything but the model is real (scheduler,
KV pool, batch building, the engine-core process, frontends, detokenization, SSE). The stub
backend behaves like a GPU under async scheduling: a launched step finishes ``step_ms`` after
the device became free, and reading its tokens back waits for that moment, so the engine's
own Python work overlaps the "device" exactly as it does on a GPU.

A stub model directory is a tokenizer plus a ``config.json`` with ``"model_type":
"openinfer-stub"`` and ``"stub_step_ms"``; ``openinfer serve --engine-factory
openinfer.engine_core.stub:create_stub_engine --model-path DIR`` serves it.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.options import EngineOptions
from openinfer.runtime.engine import PagedEngine
from openinfer.runtime.model import ModelSpec
from openinfer.runtime.sampler import RowSample

FACTORY_SPEC = "openinfer.engine_core.stub:create_stub_engine"  # for --engine-factory
# when set, the stub backend keeps its launch log ``[[wall time, rows], ...]`` (the last
# LAUNCH_LOG_SIZE launches) in this JSON file, rewritten every STATS_INTERVAL_S: the engine-side
# step time a benchmark puts next to what its clients saw
STATS_ENV = "OPENINFER_STUB_STATS"
LAUNCH_LOG_SIZE = 20_000
STATS_INTERVAL_S = 0.25
# generated ids stay clear of the low ids where tokenizers keep their special tokens
FIRST_PLAIN_ID = 300


class StubBackend(NumpyBackend):
    """NumPy backend whose sampling is the "device": each step costs ``step_s`` of wall time."""

    def __init__(self, step_s: float, vocab_size: int, eos_token_ids: tuple[int, ...]):
        super().__init__()
        self.step_s = step_s
        self.vocab_size = vocab_size
        self.device_free_at = 0.0
        self.num_device_steps = 0
        self.launches: collections.deque = collections.deque(maxlen=LAUNCH_LOG_SIZE)  # (wall time, rows)

    def write_stats_every(self, path: str, interval_s: float = STATS_INTERVAL_S) -> threading.Thread:
        """Rewrite ``path`` with the launch log every ``interval_s`` (a daemon thread)."""
        def loop() -> None:
            while True:
                time.sleep(interval_s)
                temporary = path + ".tmp"
                with open(temporary, "w") as handle:
                    json.dump({"step_ms": self.step_s * 1e3, "launches": list(self.launches)}, handle)
                os.replace(temporary, path)

        thread = threading.Thread(target=loop, name="openinfer-stub-stats", daemon=True)
        thread.start()
        return thread

    def _launch(self, rows: Any) -> tuple[np.ndarray, float]:
        done = max(time.perf_counter(), self.device_free_at) + self.step_s
        self.device_free_at = done
        self.num_device_steps += 1
        self.launches.append((time.time(), len(rows)))
        span = max(1, self.vocab_size - FIRST_PLAIN_ID)
        ids = np.fromiter(((FIRST_PLAIN_ID + (row.position * 7 + len(row.request.request_id)) % span)
                           for row in rows), np.int32, count=len(rows))
        return ids, done

    @staticmethod
    def _wait(done: float) -> None:
        delay = done - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def sample_rows_async(self, logits: Any, rows: Any) -> tuple[np.ndarray, Any]:
        ids, done = self._launch(rows)

        def read_back() -> list[RowSample]:
            self._wait(done)
            return [RowSample(int(token)) for token in ids]

        return ids, read_back

    def sample_rows(self, logits: Any, rows: Any, eos_token_ids: Any) -> list[RowSample]:
        ids, done = self._launch(rows)
        self._wait(done)
        return [RowSample(int(token)) for token in ids]


class StubModel:
    """A ``PagedModel`` with no weights: ``forward`` returns empty logits rows."""

    def __init__(self, spec: ModelSpec, backend: StubBackend):
        self.spec = spec
        self.backend = backend

    def forward(self, batch: Any, kv_cache: Any) -> np.ndarray:
        return np.zeros((len(batch.logits_rows), 1), np.float32)


def create_stub_engine(model_path: str, **options: Any) -> PagedEngine:
    """The engine factory for ``--engine-factory openinfer.engine_core.stub:create_stub_engine``."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    eos = config.get("eos_token_id", [])
    eos = tuple(eos if isinstance(eos, list) else [eos])
    spec = ModelSpec(architectures=("OpenInferStub",), model_type="openinfer-stub",
                     vocab_size=int(config["vocab_size"]), max_model_len=int(config.get("max_position_embeddings", 4096)),
                     num_layers=1, num_kv_heads=1, head_dim=1, eos_token_ids=eos)
    backend = StubBackend(float(config.get("stub_step_ms", 1.0)) / 1e3, spec.vocab_size, eos)
    engine_options = EngineOptions.from_kwargs(**options)
    if engine_options.async_scheduling is None:
        engine_options = engine_options.with_(async_scheduling=True)  # it stands in for a GPU
    if engine_options.device == "cuda":
        engine_options = engine_options.with_(device="cpu")
    if os.environ.get(STATS_ENV):
        backend.write_stats_every(os.environ[STATS_ENV])
    return PagedEngine(StubModel(spec, backend), engine_options, model_path=str(model_path), plugin="openinfer-stub")


def write_stub_model(directory: Path, tokenizer_dir: Path, step_ms: float, max_model_len: int = 4096) -> Path:
    """A stub model directory using the tokenizer files of ``tokenizer_dir``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        source = Path(tokenizer_dir) / name
        if source.exists():
            (directory / name).write_bytes(source.read_bytes())
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    vocab = len(tokenizer["model"]["vocab"]) + len(tokenizer.get("added_tokens", []))
    generation = directory / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id", []) if generation.exists() else []
    config = {"architectures": ["OpenInferStub"], "model_type": "openinfer-stub", "vocab_size": vocab,
              "max_position_embeddings": max_model_len, "stub_step_ms": step_ms, "eos_token_id": eos}
    (directory / "config.json").write_text(json.dumps(config))
    return directory
