"""``--load-format dummy`` for Kimi-K2 / DeepSeek-V3: noise at exactly the real checkpoint's
tensor names and shapes, loaded and run with no weight file on disk."""

import json

import numpy as np
from openinfer_kimi_k2.config import KimiK2Config
from openinfer_kimi_k2.plugin import build_model
from openinfer_kimi_k2.weights import kimi_tensor_shapes
from safetensors import safe_open

from openinfer import EngineOptions
from tests.helpers.engine_utils import prefill_logits
from tests.helpers.tiny_deepseek_v3 import write_tiny_deepseek_v3


def test_dummy_shapes_equal_a_real_checkpoint_and_the_model_runs(tmp_path):
    path, _ = write_tiny_deepseek_v3(tmp_path / "real", seed=1, num_hidden_layers=3)
    config = json.loads((path / "config.json").read_text())
    with safe_open(path / "model.safetensors", "numpy") as real:
        stored = {name: tuple(real.get_slice(name).get_shape()) for name in real.keys()}
    assert kimi_tensor_shapes(KimiK2Config.from_dict(config)) == stored
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(config))
    model = build_model(bare, config, EngineOptions(device="cpu", load_format="dummy"))
    logits = prefill_logits(model, list(range(3, 40)), chunk_sizes=[20, 1, 16])
    assert logits.shape == (37, config["vocab_size"]) and np.isfinite(logits).all() and logits.std() > 0
