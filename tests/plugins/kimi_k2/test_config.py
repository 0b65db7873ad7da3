"""Kimi-K2 config reading and plugin matching."""

import math

import pytest
from openinfer_kimi_k2.config import KimiK2Config
from openinfer_kimi_k2.plugin import openinfer_match

from openinfer import WeightLoadError
from tests.helpers.tiny_deepseek_v3 import tiny_config

KIMI_K2_YARN = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_plugin_matches_kimi_and_deepseek_v3_spellings():
    assert openinfer_match({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}) == 100
    assert openinfer_match({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}}) == 100
    assert openinfer_match({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}) == 100
    assert openinfer_match({"model_type": "deepseek_v3"}) == 50
    assert openinfer_match({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}) is None


def test_text_config_legacy_and_5x_rope_keys_agree():
    legacy = KimiK2Config.from_dict(tiny_config(rope_scaling=KIMI_K2_YARN, max_position_embeddings=131072))
    modern_fields = {k: v for k, v in tiny_config(max_position_embeddings=131072).items()
                     if k not in ("rope_scaling", "rope_theta")}
    modern = KimiK2Config.from_dict({"model_type": "kimi_k25", "text_config": {
        **modern_fields, "rope_parameters": {**KIMI_K2_YARN, "rope_type": "yarn", "rope_theta": 10000.0}}})
    assert legacy.rope == modern.rope and legacy.router == modern.router


@pytest.mark.parametrize("factor,multiplier", [(32.0, 1.8133), (64.0, 2.0049)])
def test_yarn_mscale_enters_the_softmax_scale(factor, multiplier):
    config = KimiK2Config.from_dict(tiny_config(rope_scaling={**KIMI_K2_YARN, "factor": factor},
                                                qk_nope_head_dim=128, qk_rope_head_dim=64))
    assert math.isclose(config.softmax_scale / 192 ** -0.5, multiplier, rel_tol=1e-4)


def test_config_errors_name_the_field():
    with pytest.raises(WeightLoadError, match="kv_lora_rank"):
        KimiK2Config.from_dict({k: v for k, v in tiny_config().items() if k != "kv_lora_rank"})
    with pytest.raises(WeightLoadError, match="topk_method"):
        KimiK2Config.from_dict(tiny_config(topk_method="bogus"))
    with pytest.raises(WeightLoadError, match="topk_group"):
        KimiK2Config.from_dict(tiny_config(n_group=2, topk_group=3))
