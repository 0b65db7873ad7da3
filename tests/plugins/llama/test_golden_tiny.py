"""Tiny random Llamas against HF transformers: all-position logits (one shot and chunked) and
greedy tokens through the engine. Every parameter is random, norms and biases included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.engine_utils import make_request, prefill_logits, run_all
from tests.plugins.llama.conftest import build_engine
from tests.plugins.llama.tiny_llama import LLAMA3_ROPE, load_hf, write_tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

VARIANTS: dict[str, dict[str, Any]] = {
    "default-rope-untied-gqa": {},
    "llama3-rope-biases-tied": {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "attention_bias": True,
                                "mlp_bias": True, "tie_word_embeddings": True},
    "head-dim-not-hidden-over-heads-mha": {"head_dim": 24, "num_key_value_heads": 4,
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = write_tiny_llama(tmp_path_factory.mktemp(request.param), seed=len(request.param),
                            **VARIANTS[request.param])
    return path, load_hf(path)


def hf_logits(hf: Any, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].numpy()


def test_prefill_logits_match_transformers(tiny: tuple[Path, Any]) -> None:
    from openinfer_llama import LlamaConfig, LlamaForCausalLM

    from openinfer import create_backend, read_model_config

    path, hf = tiny
    model = LlamaForCausalLM.load(path, LlamaConfig.from_dict(read_model_config(path)), create_backend("cpu"))
    tokens = np.random.default_rng(0).integers(3, 300, size=150).tolist()  # crosses llama3's bands
    expected = hf_logits(hf, tokens)
    np.testing.assert_allclose(prefill_logits(model, tokens), expected, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(prefill_logits(model, tokens, chunk_sizes=[37, 1, 64, 48]), expected,
                               atol=2e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers_generate(tiny: tuple[Path, Any]) -> None:
    path, hf = tiny
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (5, 23, 40)]
    engine = build_engine(path)
    try:
        outcomes = run_all(engine, [make_request(f"r{i}", p, max_tokens=16) for i, p in enumerate(prompts)])
    finally:
        engine.close_sync()
    for prompt, outcome in zip(prompts, outcomes, strict=True):
        assert outcome.token_ids == hf_greedy(hf, prompt, 16)


def hf_greedy(hf: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """Argmax decoding with no stop token (the engine requests use ignore_eos)."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt):]
