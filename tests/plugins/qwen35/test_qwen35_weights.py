"""Loading Qwen3.5 weights: fusions match the checkpoint, and bad checkpoints are refused."""

import json

import numpy as np
import pytest
from openinfer_qwen35.config import Qwen35Config
from openinfer_qwen35.weights import load_weights

from openinfer import Checkpoint, WeightLoadError, create_backend


class DictSource:
    def __init__(self, tensors):
        self.tensors = tensors

    def __contains__(self, name):
        return name in self.tensors

    def get(self, name):
        return self.tensors[name]

    def names(self):
        return self.tensors.keys()


@pytest.fixture
def source_and_config(tiny):
    path, _ = tiny
    checkpoint = Checkpoint(path)
    tensors = {name: checkpoint.get(name) for name in checkpoint.names()}
    return tensors, Qwen35Config.from_dict(json.loads((path / "config.json").read_text()))


def test_q_proj_is_split_per_head_into_queries_then_gates(source_and_config):
    tensors, config = source_and_config
    weights = load_weights(DictSource(tensors), config, create_backend("cpu"))
    fused = weights.layers[2].mixer.qkv_gate.weight_t.T  # [q | k | v | gate, hidden]
    nh, hd = config.num_attention_heads, config.head_dim
    q_proj = tensors["model.layers.2.self_attn.q_proj.weight"].reshape(nh, 2 * hd, -1)
    np.testing.assert_array_equal(fused[hd : 2 * hd], q_proj[1, :hd])  # head 1's query rows
    np.testing.assert_array_equal(fused[-hd:], q_proj[-1, hd:])  # the last head's gate rows
    norm = weights.layers[0].input_norm
    np.testing.assert_allclose(norm, 1.0 + tensors["model.layers.0.input_layernorm.weight"])


def test_missing_tensor_is_named(source_and_config):
    tensors, config = source_and_config
    del tensors["model.layers.1.linear_attn.dt_bias"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.linear_attn\.dt_bias.*missing"):
        load_weights(DictSource(tensors), config, create_backend("cpu"))


def test_wrong_shape_is_refused(source_and_config):
    tensors, config = source_and_config
    tensors["model.layers.0.linear_attn.A_log"] = np.zeros(7, np.float32)
    with pytest.raises(WeightLoadError, match="A_log.*shape"):
        load_weights(DictSource(tensors), config, create_backend("cpu"))


def test_unknown_text_tensors_are_refused_but_vision_and_mtp_are_ignored(source_and_config):
    tensors, config = source_and_config
    tensors["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    tensors["model.visual.merger.weight"] = np.zeros((2, 2), np.float32)
    load_weights(DictSource(tensors), config, create_backend("cpu"))
    tensors["model.layers.0.linear_attn.extra.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(WeightLoadError, match="not part of a Qwen3.5 text model"):
        load_weights(DictSource(tensors), config, create_backend("cpu"))
