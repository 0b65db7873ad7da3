"""Reading Qwen3.5 config.json spellings; plugin matching."""

import pytest
from openinfer_qwen35 import plugin
from openinfer_qwen35.config import Qwen35Config

from openinfer import WeightLoadError
from tests.plugins.qwen35.qwen35_helpers import TINY_QWEN35, TINY_QWEN35_VARIANT


def test_layer_types_are_read_as_given():
    config = Qwen35Config.from_dict(TINY_QWEN35)
    assert config.layer_types == tuple(TINY_QWEN35["layer_types"])
    assert config.linear_layer_ids == (0, 1, 3) and config.full_layer_ids == (2,)
    assert config.conv_dim == 2 * 2 * 12 + 4 * 8
    assert config.rope.partial_rotary_factor == 0.5
    assert "mrope_section" not in dict(config.rope.scaling)  # text positions: plain 1-D RoPE
    assert config.eos_token_ids == (2,)
    assert not config.is_multimodal


def test_full_attention_interval_and_default_partial_rotary():
    config = Qwen35Config.from_dict(TINY_QWEN35_VARIANT)
    assert config.layer_types == ("linear_attention", "full_attention", "linear_attention", "full_attention")
    assert config.rope.partial_rotary_factor == 0.25
    assert config.tie_word_embeddings and config.attention_bias


def test_multimodal_config_reads_text_config():
    text = {k: v for k, v in TINY_QWEN35.items() if k != "architectures"}
    config = Qwen35Config.from_dict({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                                     "text_config": text, "vision_config": {"depth": 2}, "eos_token_id": 7},
                                    {"eos_token_id": [2, 9]})
    assert config.is_multimodal and config.hidden_size == TINY_QWEN35["hidden_size"]
    assert config.eos_token_ids == (2, 9)


@pytest.mark.parametrize("change, message", [
    ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ({"layer_types": ["linear_attention"] * 3 + ["mamba"]}, "unknown kinds"),
    ({"hidden_act": "gelu"}, "only 'silu'"),
])
def test_bad_configs_are_refused_with_a_reason(change, message):
    with pytest.raises(WeightLoadError, match=message):
        Qwen35Config.from_dict({**TINY_QWEN35, **change})


def test_plugin_match_scores():
    assert plugin.openinfer_match({"architectures": ["Qwen3_5ForConditionalGeneration"]}) == 100
    assert plugin.openinfer_match({"architectures": ["Qwen3_5ForCausalLM"]}) == 100
    assert plugin.openinfer_match({"model_type": "qwen3_5_text"}) == 50
    assert plugin.openinfer_match({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}) is None
    assert "Qwen3_5ForConditionalGeneration" in plugin.openinfer_claims()
