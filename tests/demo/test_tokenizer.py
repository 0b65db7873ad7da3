"""Our tokenizer.json (built with `tokenizers` from the GGUF vocab + merges) against the tokenizer
transformers builds from the same GGUF."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

TRICKY = [
    "Hello world",
    "What is the capital of France?",
    "  leading spaces and trailing   ",
    "a  b   c    d\t\te",
    "digits 0 12 345 6789 3.14159 -42 1e10 2,048",
    "line one\nline two\n\n\nline five\r\nwindows",
    "héllo wörld — naïve café, Ærøskøbing",
    "日本語のテキスト 中文 한국어 Русский ελληνικά עברית العربية",
    "emoji 🤗🚀 👩‍👩‍👧‍👦 🇫🇷 ✅",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><repo_name>x<file_sep>",
    "not special: <|im_start  |im_end|> <im_start>",
    "code:\n    def f(x):\n        return x ** 2  # square\n",
    "URLs https://example.com/a?b=c&d=e#f and e-mail a.b@c.org",
    "'s 't 're 've 'm 'll 'd don't I'M",
    "\u00a0nbsp\u2009thin\u200bzero-width",
    "",
]


@pytest.fixture(scope="module")
def ours(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


@pytest.mark.parametrize("text", TRICKY)
def test_ids_equal_transformers_gguf_tokenizer(ours: Tokenizer, hf_gguf_tokenizer: Any, text: str) -> None:
    expected = hf_gguf_tokenizer(text, add_special_tokens=True)["input_ids"]
    assert ours.encode(text).ids == expected


@pytest.mark.parametrize("text", TRICKY)
def test_decode_round_trips(ours: Tokenizer, text: str) -> None:
    assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>").ids == [1, 2, 0]
    assert ours.decode([1, 9906, 2], skip_special_tokens=True) == ours.decode([9906])


def test_transformers_loads_the_converted_directory_the_same(demo_model_dir: Path,
                                                              hf_gguf_tokenizer: Any) -> None:
    transformers = pytest.importorskip("transformers")
    converted = transformers.AutoTokenizer.from_pretrained(str(demo_model_dir))
    for text in TRICKY:
        assert converted(text)["input_ids"] == hf_gguf_tokenizer(text)["input_ids"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert converted.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert (converted.bos_token, converted.eos_token, converted.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")


def test_tokenizer_config_carries_chat_template_and_special_tokens(demo_model_dir: Path) -> None:
    config = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert config["eos_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(config["additional_special_tokens"])
    generation = json.loads((demo_model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
