"""Qwen3 on the NumPy backend against HF transformers (fp32) on tiny random checkpoints."""

import json

import numpy as np
import pytest
import torch
from openinfer_qwen3.config import qwen3_config
from openinfer_qwen3.model import Qwen3ForCausalLM

from openinfer import create_backend
from tests.helpers.engine_utils import make_request, prefill_logits, run_one
from tests.helpers.tiny_qwen3 import load_hf, write_tiny_qwen3
from tests.plugins.qwen3.conftest import build_engine

VARIANTS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
             "max_position_embeddings": 512},
    # transformers 5.x uses the configured factor even when max/original disagrees (here 1.25)
    "yarn-factor-not-ratio": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 128},
                              "max_position_embeddings": 160},
    # as saved by transformers 5 without original_max_position_embeddings: original = max
    "yarn-no-original": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
    "mha-bias": {"num_key_value_heads": 4, "attention_bias": True, "head_dim": 16},
}


def load_ours(path):
    config = json.loads((path / "config.json").read_text())
    return Qwen3ForCausalLM.load(path, qwen3_config(config), create_backend("cpu"))


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = write_tiny_qwen3(tmp_path_factory.mktemp(request.param), seed=len(request.param), **VARIANTS[request.param])
    return path, load_hf(path)


def prompt_ids(n: int, seed: int = 0, vocab: int = 320) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def test_prefill_logits_match_hf(variant):
    path, hf = variant
    prompt = prompt_ids(45)
    ours = prefill_logits(load_ours(path), prompt)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(ours - reference).max() <= 1e-4


def test_32_greedy_tokens_match_hf_generate(variant):
    path, hf = variant
    prompt = prompt_ids(41, seed=3)
    engine = build_engine(path)
    try:
        ours = run_one(engine, make_request("g", prompt, max_tokens=32)).token_ids
    finally:
        engine.close_sync()
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    assert ours == generated[0, len(prompt):].tolist()


def test_chunked_prefill_equals_one_shot(tiny_qwen3_dir):
    model = load_ours(tiny_qwen3_dir)
    prompt = prompt_ids(53, seed=5)
    one_shot = prefill_logits(model, prompt)
    chunked = prefill_logits(model, prompt, chunk_sizes=[7, 16, 1, 29])
    assert np.abs(one_shot - chunked).max() <= 1e-5


def test_bf16_and_sharded_checkpoints_load(tmp_path, tiny_qwen3_dir):
    from safetensors.numpy import load_file, save_file

    # bf16 file, read without torch at run time
    bf16_dir = write_tiny_qwen3(tmp_path / "bf16", seed=0, dtype="bfloat16")
    hf = load_hf(bf16_dir)
    prompt = prompt_ids(20)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(prefill_logits(load_ours(bf16_dir), prompt) - reference).max() <= 1e-4

    # the same fp32 tensors split over two shards with an index
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    tensors = load_file(tiny_qwen3_dir / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "config.json").write_text((tiny_qwen3_dir / "config.json").read_text())
    assert np.array_equal(prefill_logits(load_ours(sharded), prompt), prefill_logits(load_ours(tiny_qwen3_dir), prompt))


def test_legacy_and_5x_rope_keys_agree():
    legacy = {"rope_theta": 5000.0, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                      "original_max_position_embeddings": 64}}
    modern = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 2.0,
                                  "original_max_position_embeddings": 64}}
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    assert qwen3_config({**base, **legacy}).rope == qwen3_config({**base, **modern}).rope
