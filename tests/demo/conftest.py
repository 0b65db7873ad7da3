"""Fixtures for the demo-model tests: the converted SmolLM2 directory (converted once per run,
in openinfer's cache, which later runs reuse) and transformers' own reading of the same GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from openinfer.demo import ensure_demo_model, find_demo_gguf


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    return ensure_demo_model(progress=False)


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    return find_demo_gguf()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(demo_gguf: Path) -> Any:
    """The tokenizer transformers builds from the GGUF itself: the golden reference."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(demo_gguf.parent), gguf_file=demo_gguf.name)
