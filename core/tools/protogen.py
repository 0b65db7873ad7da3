"""Regenerate ``openinfer/v1/*_pb2*.py`` from ``proto/openinfer/v1/engine.proto``.

Usage (repository root):  python -m openinfer.tools.protogen [--check]
``--check`` exits 1 when the committed code differs from what grpcio-tools generates.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = PROTO_ROOT / "openinfer" / "v1" / "engine.proto"
GENERATED_DIR = REPO_ROOT / "core" / "v1"
GENERATED_NAMES = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")


def generate(out_dir: Path) -> dict[str, str]:
    """Run protoc into ``out_dir``; returns {file name: contents}."""
    from grpc_tools import protoc  # test/dev-time dependency only

    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")
    produced = out_dir / "openinfer" / "v1"
    return {name: (produced / name).read_text() for name in GENERATED_NAMES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    stale = [n for n, text in fresh.items() if not (GENERATED_DIR / n).exists()
             or (GENERATED_DIR / n).read_text() != text]
    if args.check:
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run python -m openinfer.tools.protogen")
            return 1
        return 0
    for name, text in fresh.items():
        (GENERATED_DIR / name).write_text(text)
    print(f"wrote {len(fresh)} files to {GENERATED_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
