import json
from pathlib import Path

import pytest

from openinfer import EngineOptions


def build_engine(path: Path, **options):
    from openinfer_qwen3 import plugin

    config = json.loads((path / "config.json").read_text())
    return plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cpu", **options))


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir):
    eng = build_engine(tiny_qwen3_dir)
    yield eng
    eng.close_sync()
