from pathlib import Path

import pytest

from tests.helpers.tiny_qwen3 import write_tiny_qwen3


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 checkpoint (no tokenizer), shared by the whole session."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3-untied"), seed=0)
