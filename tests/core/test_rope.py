"""RoPE inverse frequencies and attention scaling against transformers 5.x's own functions.

The YaRN cases are the ones where an older reading went wrong: a configured ``factor`` that
differs from ``max_position_embeddings / original_max_position_embeddings`` (HF uses the
factor as given) and a config without ``original_max_position_embeddings`` (HF defaults it to
``max_position_embeddings`` and still scales).
"""

import numpy as np
import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from openinfer.rope import inverse_frequencies, rope_parameters_from_config

BASE = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "head_dim": 32, "rope_theta": 10000.0}

CASES = {
    # Qwen3's documented long-context set-up: factor 4 while max/original = 1.25
    "yarn-qwen3-long-context": {"max_position_embeddings": 40960, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    # saved by transformers 5 without original_max_position_embeddings
    "yarn-no-original": {"max_position_embeddings": 4096, "rope_parameters": {
        "rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0}},
    "yarn-no-truncate-mscale": {"max_position_embeddings": 2048, "rope_scaling": {
        "rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 1024, "truncate": False,
        "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}},
    "yarn-attention-factor": {"max_position_embeddings": 2048, "rope_scaling": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512, "attention_factor": 1.3}},
    "yarn-top-level-original": {"max_position_embeddings": 8192, "original_max_position_embeddings": 2048,
                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 1000}},
    "llama3-no-original": {"max_position_embeddings": 4096, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
}


@pytest.mark.parametrize("name", list(CASES))
def test_inverse_frequencies_match_transformers(name):
    config = {**BASE, **CASES[name]}
    hf_config = Qwen3Config(**config)
    rope_type = hf_config.rope_parameters["rope_type"]
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    params = rope_parameters_from_config(config)
    ours, scaling = inverse_frequencies(params, config["head_dim"], config["max_position_embeddings"])
    np.testing.assert_allclose(ours, hf_inv_freq.double().numpy(), rtol=1e-6)
    assert scaling == pytest.approx(hf_scaling, rel=1e-12)


def test_qwen3_long_context_uses_the_configured_factor():
    _, scaling = inverse_frequencies(rope_parameters_from_config({**BASE, **CASES["yarn-qwen3-long-context"]}),
                                     32, 40960)
    assert scaling == pytest.approx(0.1 * np.log(4.0) + 1.0)  # 1.139, not the 1.022 of factor 1.25
