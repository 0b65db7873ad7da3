"""LlamaConfig parsing and the plugin's match scores."""

from __future__ import annotations

import pytest
from openinfer_llama import LlamaConfig
from openinfer_llama.plugin import openinfer_claims, openinfer_match

from openinfer import WeightLoadError
from tests.plugins.llama.tiny_llama import LLAMA3_ROPE, TINY_LLAMA


def test_reads_legacy_and_5x_rope_spellings() -> None:
    legacy = LlamaConfig.from_dict({**TINY_LLAMA, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE})
    modern = LlamaConfig.from_dict({**TINY_LLAMA, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}})
    assert legacy.rope == modern.rope
    assert (legacy.rope.rope_type, legacy.rope.theta, legacy.rope.get("factor")) == ("llama3", 500000.0, 8.0)


def test_defaults_follow_transformers() -> None:
    minimal = {k: TINY_LLAMA[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                          "num_hidden_layers", "num_attention_heads")}
    config = LlamaConfig.from_dict(minimal)
    assert config.num_key_value_heads == 4 and config.head_dim == 16
    assert config.rope.theta == 10000.0 and config.rope.rope_type == "default"
    assert (config.attention_bias, config.mlp_bias, config.tie_word_embeddings) == (False, False, False)


def test_eos_ids_merge_generation_config() -> None:
    config = LlamaConfig.from_dict({**TINY_LLAMA, "eos_token_id": [2, 7]}, {"eos_token_id": [7, 9]})
    assert config.eos_token_ids == (2, 7, 9)


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"vocab_size": None}, "vocab_size"),
    ({"rope_scaling": {"rope_type": "longrope"}}, "longrope"),
])
def test_bad_configs_say_what_is_wrong(change: dict, message: str) -> None:
    config = {**TINY_LLAMA, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(WeightLoadError, match=message):
        LlamaConfig.from_dict(config)


def test_match_scores() -> None:
    assert openinfer_match({"architectures": ["LlamaForCausalLM"]}) == 100
    assert openinfer_match({"model_type": "llama"}) == 50
    assert openinfer_match({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}) is None
    assert "LlamaForCausalLM" in openinfer_claims()


def test_discovered_through_the_entry_point() -> None:
    from openinfer import discover_plugins

    registry = discover_plugins()
    assert registry.select({"architectures": ["LlamaForCausalLM"]}) == "llama"
    assert registry.plugins["llama"].distribution == "openinfer-llama"
