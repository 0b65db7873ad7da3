"""config.json → DeepseekV4Config: the legacy keys of the real checkpoint and the 5.x keys."""

import pytest
from openinfer_deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, DeepseekV4Config, flash_config

from openinfer import WeightLoadError
from tests.plugins.deepseek_v4.dsv4_helpers import TINY_DSV4, TINY_DSV4_5X


def test_flash_legacy_config():
    """``flash_config()``: the published DeepSeek-V4-Flash config.json, read in its legacy keys."""
    c = DeepseekV4Config.from_dict(flash_config())
    assert c.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and len(c.layer_types) == 43
    assert c.layer_ids(CSA) == tuple(range(2, 43, 2)) and c.layer_ids(HCA) == tuple(range(3, 42, 2))
    assert c.mlp_layer_types[:4] == (HASH_MOE, HASH_MOE, HASH_MOE, MOE)
    assert c.compress_rate(CSA) == 4 and c.compress_rate(HCA) == 128 and c.layer_compress_rate(0) == 0
    assert c.rope_head_dim == 64 and c.rope_main.rope_type == "default" and c.rope_main.theta == 10000
    assert c.rope_compress.rope_type == "yarn" and c.rope_compress.theta == 160000
    assert c.rope_compress.get("factor") == 16 and c.rope_compress.get("attention_factor") == 1.0
    assert c.quantization_config["expert_dtype"] == "fp4" and c.eos_token_ids == (1,)
    changed = flash_config()
    changed["compress_ratios"].append(4)
    changed["rope_scaling"]["factor"] = 2
    assert flash_config()["compress_ratios"][-1] == 0 and flash_config()["rope_scaling"]["factor"] == 16  # a copy


def test_5x_keys_equal_legacy_keys_for_the_same_model():
    legacy = DeepseekV4Config.from_dict(TINY_DSV4)
    modern = dict(TINY_DSV4_5X)
    modern.update(layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=[HASH_MOE, HASH_MOE, MOE, MOE],
                  compress_rates={CSA: 4, HCA: 128}, partial_rotary_factor=0.5,
                  rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0},
                                   "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                                                "original_max_position_embeddings": 64, "beta_fast": 32,
                                                "beta_slow": 1}})
    assert DeepseekV4Config.from_dict(modern) == legacy


def test_transformers_saved_config_reads_back(tiny_5x):
    import json

    path, hf = tiny_5x
    saved = hf.config.to_dict()  # what save_pretrained writes: layer_types, compress_rates, rope_parameters
    c = DeepseekV4Config.from_dict(saved)
    assert c == DeepseekV4Config.from_dict(json.loads((path / "config.json").read_text()))
    assert c.compress_rate(HCA) == 16 and c.layer_types[0] == HCA


@pytest.mark.parametrize("change, message", [
    ({"compress_ratios": [0, 4, 64, 4, 0]}, "compress_ratios"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
    ({"rope_scaling": {"type": "llama3", "factor": 8}}, "rope type"),
    ({"o_groups": 3}, "o_groups"),
])
def test_bad_configs_name_the_field(change, message):
    with pytest.raises(WeightLoadError, match=message):
        DeepseekV4Config.from_dict({**TINY_DSV4, **change})
