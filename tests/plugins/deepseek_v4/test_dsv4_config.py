"""config.json → DeepseekV4Config: the legacy keys of the real checkpoint and the 5.x keys."""

import pytest
from openinfer_deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, DeepseekV4Config

from openinfer import WeightLoadError
from tests.plugins.deepseek_v4.dsv4_helpers import TINY_DSV4, TINY_DSV4_5X

# the published DeepSeek-V4-Flash config.json, less the fields that do not matter here
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "num_nextn_predict_layers": 1, "expert_dtype": "fp4",
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


def test_flash_legacy_config():
    c = DeepseekV4Config.from_dict(FLASH)
    assert c.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and len(c.layer_types) == 43
    assert c.layer_ids(CSA) == tuple(range(2, 43, 2)) and c.layer_ids(HCA) == tuple(range(3, 42, 2))
    assert c.mlp_layer_types[:4] == (HASH_MOE, HASH_MOE, HASH_MOE, MOE)
    assert c.compress_rate(CSA) == 4 and c.compress_rate(HCA) == 128 and c.layer_compress_rate(0) == 0
    assert c.rope_head_dim == 64 and c.rope_main.rope_type == "default" and c.rope_main.theta == 10000
    assert c.rope_compress.rope_type == "yarn" and c.rope_compress.theta == 160000
    assert c.rope_compress.get("factor") == 16 and c.rope_compress.get("attention_factor") == 1.0
    assert c.quantization_config["expert_dtype"] == "fp4" and c.eos_token_ids == (1,)


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
