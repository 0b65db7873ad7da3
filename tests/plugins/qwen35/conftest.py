"""Session fixtures: tiny random Qwen3.5 checkpoints (HF models kept for the reference)."""

from pathlib import Path
from typing import Any

import pytest

from tests.plugins.qwen35.qwen35_helpers import (
    TINY_QWEN35_VARIANT,
    make_hf_model,
    write_multimodal_checkpoint,
    write_text_checkpoint,
)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> tuple[Path, Any]:
    """(checkpoint dir, HF model) of the main tiny config (explicit layer_types)."""
    hf, config = make_hf_model(seed=0)
    return write_text_checkpoint(tmp_path_factory.mktemp("qwen35-text"), hf, config), hf


@pytest.fixture(scope="session")
def tiny_variant(tmp_path_factory) -> tuple[Path, Any]:
    """The other spellings: full_attention_interval, tied embeddings, biases, nk = 1."""
    hf, config = make_hf_model(seed=2, base=TINY_QWEN35_VARIANT)
    return write_text_checkpoint(tmp_path_factory.mktemp("qwen35-variant"), hf, config), hf


@pytest.fixture(scope="session")
def tiny_multimodal(tmp_path_factory, tiny) -> Path:
    """The main tiny model in the multimodal release layout (same text weights)."""
    import json

    path, hf = tiny
    config = json.loads((path / "config.json").read_text())
    return write_multimodal_checkpoint(tmp_path_factory.mktemp("qwen35-multimodal"), hf, config)
