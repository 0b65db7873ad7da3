"""Fixtures for the Llama plugin: tiny random checkpoints, the converted demo model and its HF twin."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from openinfer import EngineOptions
from openinfer.demo import ensure_demo_model
from tests.plugins.llama.tiny_llama import load_hf


def build_engine(path: Path, **options: Any) -> Any:
    """The engine exactly as ``openinfer serve`` builds it: through the plugin's hook."""
    from openinfer_llama import plugin

    config = json.loads((path / "config.json").read_text())
    return plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cpu", **options))


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """Converted once per run into openinfer's cache (``$OPENINFER_CACHE``); later runs reuse it."""
    return ensure_demo_model(progress=False)


@pytest.fixture(scope="session")
def demo_engine(demo_model_dir: Path) -> Iterator[Any]:
    engine = build_engine(demo_model_dir, num_kv_blocks=256)
    yield engine
    engine.close_sync()


@pytest.fixture(scope="session")
def hf_demo_model(demo_model_dir: Path) -> Any:
    """transformers' LlamaForCausalLM on the same converted weights, fp32."""
    pytest.importorskip("transformers")
    return load_hf(demo_model_dir)
