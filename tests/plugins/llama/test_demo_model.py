"""SmolLM2-135M-Instruct (the embedded demo model) through the Llama plugin, against HF transformers
running the very same dequantized weights in fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from openinfer.tokenizer import Tokenizer
from tests.helpers.engine_utils import make_request, run_all, run_one

torch = pytest.importorskip("torch")

PROMPTS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why 1 is not prime."}],
]


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_model_dir)


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_32_greedy_tokens_equal_transformers(demo_engine: Any, hf_demo_model: Any, tokenizer: Tokenizer) -> None:
    prompts = [chat_ids(tokenizer, messages) for messages in PROMPTS]
    requests = [make_request(f"golden{i}", ids, max_tokens=32, ignore_eos=True) for i, ids in enumerate(prompts)]
    outcomes = run_all(demo_engine, requests)  # both prompts batched in the same steps
    for ids, outcome in zip(prompts, outcomes, strict=True):
        prompt = torch.tensor([ids])
        with torch.no_grad():  # explicit mask: HF would otherwise mask the prompt's <|im_end|> (= pad id)
            generated = hf_demo_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                                               min_new_tokens=32, do_sample=False, eos_token_id=None,
                                               pad_token_id=2)
        expected = generated[0, len(ids):].tolist()
        assert outcome.token_ids == expected, (tokenizer.decode(outcome.token_ids), tokenizer.decode(expected))


def test_prompt_logits_close_to_transformers(demo_engine: Any, hf_demo_model: Any, tokenizer: Tokenizer) -> None:
    from tests.helpers.engine_utils import prefill_logits

    ids = chat_ids(tokenizer, PROMPTS[1])
    ours = prefill_logits(demo_engine.model, ids, chunk_sizes=[17, len(ids) - 17])
    with torch.no_grad():
        theirs = hf_demo_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-3, rtol=1e-3)


def test_capital_of_france_is_paris(demo_engine: Any, tokenizer: Tokenizer) -> None:
    ids = chat_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    outcome = run_one(demo_engine, make_request("paris", ids, max_tokens=24, ignore_eos=False))
    answer = tokenizer.decode(outcome.token_ids)
    assert "Paris" in answer, answer
    assert outcome.token_ids[-1] == 2 and outcome.finish is not None  # stopped at <|im_end|>


def test_generate_cli_on_the_cached_demo_directory(demo_model_dir: Path) -> None:
    """``--model-path`` on the converted cache directory works like any model directory."""
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "openinfer.cli", "generate", "--model-path", str(demo_model_dir), "--device", "cpu",
         "--prompt", "The capital of France is", "--max-tokens", "4", "--json"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert "Paris" in payload["text"]
    assert len(payload["token_ids"]) <= 4 and payload["finish_reason"] in ("stop", "length")
