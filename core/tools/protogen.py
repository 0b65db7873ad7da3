"""Regenerate ``openinfer/v1/*_pb2*.py`` from ``proto/openinfer/v1/engine.proto``.

Usage (repository root):  python -m openinfer.tools.protogen [--check]
``--check`` exits 1 when the committed code differs from what grpcio-tools generates.

The generated code carries version guards: ``engine_pb2_grpc.py`` refuses to import under a
grpcio older than the grpcio-tools that generated it, ``engine_pb2.py`` under a protobuf older
than the protoc that generated it. Left as generated, they would tie users to the newest
grpcio/protobuf of whoever ran this tool, whatever pyproject.toml declares. The guards are
therefore rewritten to the declared floors (``GRPCIO_FLOOR``, ``PROTOBUF_FLOOR``; a test checks
that pyproject.toml declares the same), which is sound because the code itself only uses APIs
those versions have (registered method handlers, grpcio >= 1.63; the descriptor builder,
protobuf >= 5.26). The floors are what the SGLang service's ``smg-grpc-proto`` needs anyway.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = PROTO_ROOT / "openinfer" / "v1" / "engine.proto"
GENERATED_DIR = REPO_ROOT / "core" / "v1"
GENERATED_NAMES = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")
GRPCIO_FLOOR = "1.81.1"
PROTOBUF_FLOOR = (6, 33, 5)

_GRPC_GUARD = re.compile(r"^GRPC_GENERATED_VERSION = '[0-9.]+'$", re.MULTILINE)
_PROTOBUF_GUARD = re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*)"
                             r"\d+,\s*\d+,\s*\d+,")


def lower_version_guards(name: str, text: str) -> str:
    """Rewrite the generated version guard of file ``name`` to the declared floor."""
    if name.endswith("_pb2_grpc.py"):
        text, count = _GRPC_GUARD.subn(f"GRPC_GENERATED_VERSION = '{GRPCIO_FLOOR}'  # the declared floor "
                                       "(openinfer.tools.protogen)", text)
    elif name.endswith("_pb2.py"):
        major, minor, patch = PROTOBUF_FLOOR
        text, count = _PROTOBUF_GUARD.subn(rf"\g<1>{major},\n    {minor},\n    {patch},", text)
    else:
        return text
    if count != 1:
        raise RuntimeError(f"cannot find the version guard in generated {name}; update "
                           "openinfer.tools.protogen.lower_version_guards for this grpcio-tools")
    return text


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
    return {name: lower_version_guards(name, (produced / name).read_text()) for name in GENERATED_NAMES}


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
