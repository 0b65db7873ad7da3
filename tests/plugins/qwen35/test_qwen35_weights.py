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


class Bf16Source(DictSource):
    """A checkpoint that stores every tensor in bf16 (``raw`` bits), like a real release."""

    def dtype(self, name):
        return "BF16"

    def raw(self, name):
        from openinfer import float32_to_bf16

        return float32_to_bf16(self.tensors[name])


class Bf16Backend:
    """Records what the loader hands a backend that stores bf16 (the cuda backend's contract:
    uint16 arrays are taken as bf16 bits)."""

    name = "recording"
    activation_dtype = np.uint16

    def __init__(self):
        self.placed: list[np.ndarray] = []

    def weight(self, array):
        self.placed.append(np.asarray(array))
        return array

    def linear_weight(self, weight, bias=None):
        self.placed.append(np.asarray(weight))
        return weight


def test_a_bf16_backend_gets_raw_bf16_matrices_with_no_float32_copy(source_and_config):
    from openinfer import float32_to_bf16

    tensors, config = source_and_config
    source = Bf16Source(tensors)
    backend = Bf16Backend()
    weights = load_weights(source, config, backend, norm_weight=lambda x: np.asarray(x, np.float32))
    matrices = [a for a in backend.placed if a.ndim == 2]
    assert matrices and all(a.dtype == np.uint16 for a in matrices)
    # bits straight from the checkpoint, fused as before: in_proj = [qkv | z | b | a]
    prefix = "model.layers.0.linear_attn."
    expected = np.concatenate([source.raw(prefix + n) for n in ("in_proj_qkv.weight", "in_proj_z.weight",
                                                                 "in_proj_b.weight", "in_proj_a.weight")])
    np.testing.assert_array_equal(weights.layers[0].mixer.in_proj, expected)
    np.testing.assert_array_equal(weights.embed_tokens, float32_to_bf16(tensors["model.embed_tokens.weight"]))
    # norms (1 + w) are computed in float32
    np.testing.assert_allclose(weights.layers[0].input_norm, 1.0 + tensors["model.layers.0.input_layernorm.weight"])
