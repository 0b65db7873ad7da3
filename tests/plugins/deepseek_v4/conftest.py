"""Session fixtures: tiny random DeepSeek-V4 checkpoints in every spelling, HF models kept as the
reference (fp32, eager)."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.plugins.deepseek_v4.dsv4_helpers import MID_DSV4, TINY_DSV4, TINY_DSV4_5X, make_hf_model, save_hf


def prompt(length: int = 140, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(2, TINY_DSV4["vocab_size"], size=length).tolist()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> tuple[Path, Any]:
    """(HF-saved checkpoint dir with the legacy-key config.json, HF model)."""
    hf, config = make_hf_model(seed=0)
    return save_hf(hf, config, tmp_path_factory.mktemp("dsv4-hf")), hf


@pytest.fixture(scope="session")
def tiny_5x(tmp_path_factory) -> tuple[Path, Any]:
    """The transformers 5.x spelling (layer_types, compress_rates with HCA 16, rope_parameters)."""
    hf, config = make_hf_model(seed=3, base=TINY_DSV4_5X)
    return save_hf(hf, config, tmp_path_factory.mktemp("dsv4-5x")), hf


@pytest.fixture(scope="session")
def mid(tmp_path_factory) -> Path:
    """A mid-size random checkpoint (``MID_DSV4``, HF-saved names)."""
    hf, config = make_hf_model(seed=5, base=MID_DSV4)
    return save_hf(hf, config, tmp_path_factory.mktemp("dsv4-mid"))
