import json
from pathlib import Path

import pytest
from openinfer import EngineOptions

from tests.helpers.tiny_qwen3 import write_tiny_qwen3


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3-untied"), seed=0)


def build_engine(path: Path, **options):
    from openinfer_qwen3 import plugin

    config = json.loads((path / "config.json").read_text())
    return plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cpu", **options))


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir):
    eng = build_engine(tiny_qwen3_dir)
    yield eng
    eng.close_sync()
