"""Bad Kimi-K2 / DeepSeek-V3 checkpoints fail with the tensor or field named, before a backend exists."""

import json

import pytest
from openinfer_kimi_k2 import plugin
from safetensors.numpy import load_file, save_file

from openinfer import EngineOptions, WeightLoadError
from tests.helpers.tiny_deepseek_v3 import (
    INT4_QUANTIZATION_CONFIG,
    write_quantized_copy,
    write_tiny_deepseek_v3,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-kimi")
    source, hf = write_tiny_deepseek_v3(root / "source", seed=2, num_hidden_layers=2)
    write_quantized_copy(root / "int4", source, hf, "int4")
    return root


@pytest.fixture(autouse=True)
def no_backend(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a backend was created before the checkpoint was checked")
    monkeypatch.setattr(plugin, "create_backend", refuse)


def create(path):
    config = json.loads((path / "config.json").read_text())
    return plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cpu"))


def rewrite(src, dst, drop=(), config_changes=None):
    dst.mkdir()
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items() if k not in drop}
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config.update(config_changes or {})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_expert_tensor_is_named(checkpoints, tmp_path):
    bad = rewrite(checkpoints / "source", tmp_path / "m", drop={"model.layers.1.mlp.experts.5.up_proj.weight"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        create(bad)


def test_wrong_int4_group_size_names_the_scale(checkpoints, tmp_path):
    quant = json.loads(json.dumps(INT4_QUANTIZATION_CONFIG))
    quant["config_groups"]["group_0"]["weights"]["group_size"] = 16
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "model.safetensors").symlink_to(checkpoints / "int4" / "model.safetensors")
    config = json.loads((checkpoints / "int4" / "config.json").read_text())
    (tmp_path / "g" / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(WeightLoadError, match=r"experts\.0\.gate_proj\.weight_scale"):
        create(tmp_path / "g")


def test_wrong_expert_shape_and_unknown_quant_method_are_named(checkpoints, tmp_path):
    bad = rewrite(checkpoints / "source", tmp_path / "s", config_changes={"moe_intermediate_size": 20})
    with pytest.raises(WeightLoadError, match=r"experts\.0\.gate_proj\.weight.*config implies"):
        create(bad)
    unknown = rewrite(checkpoints / "source", tmp_path / "q", config_changes={"quantization_config": {
        "quant_method": "gptq"}})
    with pytest.raises(WeightLoadError, match="quant_method='gptq'"):
        create(unknown)
