"""When the engine joins a deferred load's weight copies (``OPENINFER_WEIGHTS_JOIN``): with "serve"
(the default) the graph runner's start (capture, warm-ups) runs beside them and the engine joins
them once, after it; with "compile" the runner joins them itself, as before. A model that may not
run dry (device-computed indices on garbage weights) always joins before its runner's forwards."""

import sys
import types

import numpy as np
import pytest

from openinfer import EngineOptions, ModelSpec, PagedEngine
from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.engine_core import startup
from openinfer.kv import FullAttentionSpec

VOCAB, DIM = 16, 4


class _Toy:
    def __init__(self, dry_run_safe: bool) -> None:
        self.backend = NumpyBackend()
        self.spec = ModelSpec(architectures=("Toy",), model_type="toy", vocab_size=VOCAB, max_model_len=32,
                              num_layers=1, num_kv_heads=1, head_dim=DIM)
        self.dry_run_safe = dry_run_safe

    def kv_cache_specs(self):
        return [FullAttentionSpec(1, DIM)]

    def forward(self, batch, kv_cache):
        return np.zeros((len(batch.logits_rows), VOCAB), np.float32)


@pytest.mark.parametrize(("point", "dry_run_safe", "expected"), [
    ("serve", True, ["runner", "runner done", "joined"]),
    (None, True, ["runner", "runner done", "joined"]),  # the default
    ("compile", True, ["runner", "joined", "runner done", "joined"]),
    ("serve", False, ["runner", "joined", "runner done", "joined"]),
])
def test_the_engine_joins_the_weight_copies_where_its_switch_says(monkeypatch, point, dry_run_safe, expected):
    import openinfer.runtime.engine as engine_module

    events: list[str] = []
    monkeypatch.setitem(sys.modules, "openinfer.backend.cuda.weight_upload",
                        types.SimpleNamespace(wait_for_deferred_uploads=lambda: events.append("joined")))
    if point is None:
        monkeypatch.delenv("OPENINFER_WEIGHTS_JOIN", raising=False)
    else:
        monkeypatch.setenv("OPENINFER_WEIGHTS_JOIN", point)
    real = engine_module.create_runner

    def runner(*args, **kwargs):
        events.append("runner")
        startup.wait_for_deferred_weights()  # where CudaGraphRunner.capture joins them
        events.append("runner done")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "create_runner", runner)
    engine = PagedEngine(_Toy(dry_run_safe), EngineOptions(device="cpu", num_kv_blocks=16, max_model_len=32))
    try:
        assert events == expected
    finally:
        engine.close_sync()
