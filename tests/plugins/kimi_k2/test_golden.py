"""Kimi-K2 / DeepSeek-V3 on the NumPy backend against HF ``DeepseekV3ForCausalLM`` (fp32), tiny random configs."""

import json

import numpy as np
import pytest
import torch
from openinfer_kimi_k2.plugin import build_model

from openinfer import EngineOptions, PagedEngine, create_backend
from openinfer.mla import MLAWeights, mla_absorbed, mla_naive
from tests.helpers.engine_utils import make_request, prefill_logits, run_all, run_one
from tests.helpers.tiny_deepseek_v3 import write_quantized_copy, write_tiny_deepseek_v3

VARIANTS = {
    # n_group 1, one dense layer, YaRN with mscale == mscale_all_dim (Kimi-K2's own setting)
    "kimi": {},
    # group-limited routing with topk_group < n_group, two dense layers, YaRN mscale != mscale_all_dim
    # and a factor (8) other than max_position_embeddings / original (4)
    "groups": {"n_routed_experts": 12, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
               "first_k_dense_replace": 2, "num_hidden_layers": 4, "n_shared_experts": 2,
               "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}},
    # DeepSeek-V2-Lite style: no q LoRA, plain RoPE
    "no-q-lora": {"q_lora_rank": None, "rope_scaling": None, "routed_scaling_factor": 1.0},
}


def load_ours(path, **options):
    config = json.loads((path / "config.json").read_text())
    return build_model(path, config, EngineOptions(device="cpu", **options), create_backend("cpu"))


def make_engine(path, **options):
    return PagedEngine(load_ours(path), EngineOptions(device="cpu", **options))


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    return write_tiny_deepseek_v3(tmp_path_factory.mktemp(request.param), seed=len(request.param),
                                  **VARIANTS[request.param])


def prompt_ids(n, seed=0):
    return np.random.default_rng(seed).integers(3, 160, size=n).tolist()


def hf_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].numpy()


def test_prefill_logits_match_hf(variant):
    path, hf = variant
    prompt = prompt_ids(75)
    assert np.abs(prefill_logits(load_ours(path), prompt) - hf_logits(hf, prompt)).max() <= 1e-4


def test_32_greedy_tokens_match_hf_generate_and_batching_is_invisible(variant):
    path, hf = variant
    prompts = [prompt_ids(72, seed=3), prompt_ids(80, seed=4), prompt_ids(5, seed=5)]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        expected.append(generated[0, len(prompt):].tolist())
    engine = make_engine(path)
    try:
        alone = run_one(engine, make_request("alone", prompts[0], max_tokens=32)).token_ids
        together = run_all(engine, [make_request(f"b{i}", p, max_tokens=32) for i, p in enumerate(prompts)])
    finally:
        engine.close_sync()
    assert alone == expected[0]
    assert [o.token_ids for o in together] == expected


def test_chunked_prefill_equals_one_shot(variant):
    path, _ = variant
    model = load_ours(path)
    prompt = prompt_ids(77, seed=6)
    one_shot = prefill_logits(model, prompt)
    assert np.abs(prefill_logits(model, prompt, chunk_sizes=[16, 1, 33, 1, 26]) - one_shot).max() <= 1e-5


def test_chunked_engine_and_prefix_cache_hits_keep_outputs(variant):
    path, _ = variant
    shared = prompt_ids(64, seed=7)
    first, second = shared + prompt_ids(9, seed=8), shared + prompt_ids(11, seed=9)
    reference = make_engine(path, enable_prefix_cache=False)
    try:
        expected = [run_one(reference, make_request(f"r{i}", p, max_tokens=12)).token_ids
                    for i, p in enumerate([first, second])]
    finally:
        reference.close_sync()
    engine = make_engine(path, max_num_batched_tokens=24)  # prompts prefilled in chunks of <= 24 tokens
    try:
        cold = run_one(engine, make_request("cold", first, max_tokens=12))
        warm = run_one(engine, make_request("warm", second, max_tokens=12))
    finally:
        engine.close_sync()
    assert cold.token_ids == expected[0] and warm.token_ids == expected[1]
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == 64 and warm.finish.cached_tokens == 64


def test_naive_and_absorbed_mla_are_equal():
    from openinfer.mla import MLASpec

    rng = np.random.default_rng(0)
    spec = MLASpec(num_heads=3, qk_nope_dim=6, qk_rope_dim=4, v_head_dim=5, kv_lora_rank=8, scale=0.3)
    weights = MLAWeights.from_kv_b(rng.standard_normal((3 * 11, 8)).astype(np.float32), spec)
    context = rng.standard_normal((19, 12)).astype(np.float32)
    for n in (1, 7):
        q = rng.standard_normal((n, 3, 10)).astype(np.float32)
        assert np.abs(mla_naive(q, context, weights, spec) - mla_absorbed(q, context, weights, spec)).max() <= 1e-5


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_quantized_checkpoints_equal_hf_on_dequantized_weights(tmp_path, method):
    source, hf = write_tiny_deepseek_v3(tmp_path / "source", seed=11)
    reference = write_quantized_copy(tmp_path / method, source, hf, method)
    prompt = prompt_ids(70, seed=12)
    ours = load_ours(tmp_path / method)
    assert np.abs(prefill_logits(ours, prompt) - hf_logits(reference, prompt)).max() <= 1e-4
