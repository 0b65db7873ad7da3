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


# The published shape of Qwen3.5-9B (multimodal release), as its config.json spells it.
QWEN35_9B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text", "attention_bias": False, "attn_output_gate": True, "eos_token_id": 248044,
        "full_attention_interval": 4, "head_dim": 256, "hidden_size": 4096, "intermediate_size": 12288,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 32,
        "rms_norm_eps": 1e-06, "vocab_size": 248320, "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1,
        "max_position_embeddings": 262144,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "out_hidden_size": 4096},
    "tie_word_embeddings": False,
}


def test_a_real_release_config_reads_as_expected():
    from openinfer_qwen35.state import bytes_per_slot

    from openinfer import RotaryEmbedding

    config = Qwen35Config.from_dict(QWEN35_9B)
    assert config.is_multimodal and config.eos_token_ids == (248044,)
    assert len(config.full_layer_ids) == 8 and config.full_layer_ids[0] == 3
    assert config.conv_dim == 2 * 16 * 128 + 32 * 128
    rope = RotaryEmbedding.create(config.head_dim, config.rope, 64, config.max_position_embeddings)
    assert rope.rotary_dim == 64 and config.rope.theta == 1e7
    # 24 GDN layers x (fp32 state 32x128x128 + fp32 conv window 3x8192) per request
    assert bytes_per_slot(config) == 24 * 4 * (32 * 128 * 128 + 3 * 8192)
    assert plugin.openinfer_match(QWEN35_9B) == 100


@pytest.mark.parametrize("change, message", [
    ({"num_experts": 256}, "MoE"),
    ({"attn_output_gate": False}, "attn_output_gate"),
])
def test_variants_this_plugin_does_not_serve_are_named(change, message):
    text = {**QWEN35_9B["text_config"], **change}
    with pytest.raises(WeightLoadError, match=message):
        Qwen35Config.from_dict({**QWEN35_9B, "text_config": text})
