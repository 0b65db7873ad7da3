import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale():
    result = subprocess.run([sys.executable, "-m", "openinfer.tools.protogen", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _declared_floor(package: str) -> str:
    import tomllib

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = [d.split(">=", 1)[1].split(",")[0] for d in dependencies if d.split(">=")[0].strip() == package]
    assert floors, f"pyproject.toml declares no floor for {package}"
    return floors[0]


def test_version_guards_are_the_declared_floors():
    from openinfer.tools import protogen

    assert _declared_floor("grpcio") == protogen.GRPCIO_FLOOR
    assert _declared_floor("grpcio-health-checking") == protogen.GRPCIO_FLOOR
    assert _declared_floor("grpcio-reflection") == protogen.GRPCIO_FLOOR
    assert _declared_floor("protobuf") == ".".join(map(str, protogen.PROTOBUF_FLOOR))


# Imports every generated module openinfer loads, with grpcio and protobuf pretending to be
# exactly the declared floor: a generated guard newer than the floor raises at import. (grpcio-health-checking
# and -reflection are left out: pip installs the release matching the grpcio it picks.)
_IMPORT_AT_FLOOR = """
import sys
import grpc
import google.protobuf.runtime_version as runtime
# protobuf's own well-known types come with the runtime: load them before it pretends to be older
from google.protobuf import any_pb2, duration_pb2, empty_pb2, struct_pb2, timestamp_pb2, wrappers_pb2
grpc.__version__ = sys.argv[1]
runtime.MAJOR, runtime.MINOR, runtime.PATCH = map(int, sys.argv[2].split("."))
import openinfer.v1.engine_pb2_grpc
import smg_grpc_proto.generated.sglang_scheduler_pb2_grpc
import smg_grpc_proto.generated.vllm_engine_pb2_grpc
print("imported")
"""


def test_generated_code_imports_on_the_declared_floor():
    """grpcio 1.84 (older than the grpcio-tools that generated the code) is within the range."""
    for grpc_version in (_declared_floor("grpcio"), "1.84.0"):
        result = subprocess.run([sys.executable, "-c", _IMPORT_AT_FLOOR, grpc_version, _declared_floor("protobuf")],
                                cwd=REPO, capture_output=True, text=True)
        assert result.returncode == 0 and "imported" in result.stdout, result.stderr[-2000:]
