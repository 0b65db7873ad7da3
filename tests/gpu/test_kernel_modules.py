"""The start-up compile's one-kernel modules on the GPU (issue 12): every kernel of core's sources
builds alone with NVRTC (``loader.kernel_subset`` cuts it out of its file), and an engine started
with an empty kernel cache serves a mixed workload without building a single kernel after its
start (``loader.late_compiles``: a kernel the start-up discovery missed would make a request wait
for NVRTC)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.core.test_cuda_sources import ARCH_FLAGS, KERNEL_DIR, VARIANTS

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


def test_every_core_kernel_builds_alone(cuda_backend, monkeypatch, tmp_path) -> None:
    """Each kernel cut out of its file compiles and loads (the other kernels' definitions gone, the
    helpers and declarations it uses still there), sm_90a sources for sm_90a, under the first of the
    CPU source test's define sets that has it (a kernel inside ``#if`` exists under some only: where
    a cut-out kernel is missing, the whole file under the same defines must lack it too)."""
    import cupy

    from openinfer.backend.cuda import loader

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))  # NVRTC builds each one now
    device = cuda_backend.device.id

    def module(source: str, defines: tuple, kernels: tuple[str, ...] | None):
        if source in ARCH_FLAGS:
            return loader._arch_module.__wrapped__(source, defines, "sm_90a", kernels)
        return loader._module.__wrapped__(source, defines, kernels)

    def has(built, name: str) -> bool:
        try:
            built.get_function(name)
        except Exception as error:  # noqa: BLE001 — CUDA_ERROR_NOT_FOUND: not defined under these defines
            if "NOT_FOUND" not in str(error):
                raise
            return False
        return True

    def check(case: tuple[str, str]) -> str | None:
        source, name = case
        cupy.cuda.Device(device).use()
        for variant in VARIANTS.get(source, [{}]):
            defines = tuple(sorted(variant.items()))
            try:
                if has(module(source, defines, (name,)), name):
                    return None
                if has(module(source, defines, None), name):
                    return f"{source}:{name} {variant}: in the whole file, missing once cut out"
            except Exception as error:  # noqa: BLE001 — collected and reported together below
                return f"{source}:{name} {variant}: {str(error)[:400]}"
        return None  # defined under none of the define sets the CPU test knows

    cases = [(path.name, name) for path in sorted(KERNEL_DIR.glob("*.cu"))
             for name, _, _ in loader.kernel_definitions(path.read_text())]
    assert len(cases) > 60
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        failures = [f for f in pool.map(check, cases) if f is not None]
    assert not failures, "\n".join(failures)


SERVE_MIXED = textwrap.dedent("""
    import json, sys
    import numpy as np
    from openinfer import EngineOptions
    from openinfer.backend.cuda import loader
    from openinfer_qwen3 import plugin
    from tests.helpers.engine_utils import make_request, run_all

    path = sys.argv[1]
    config = json.loads(open(path + "/config.json").read())
    engine = plugin.openinfer_create_engine(path, config, EngineOptions(device="cuda", max_num_seqs=32))
    rng = np.random.default_rng(0)
    try:
        for burst in (1, 3, 8, 20, 32):  # decode batches of every size class, prompts short to long
            requests = []
            for i in range(burst):
                prompt = rng.integers(3, 300, size=int(rng.integers(1, 700))).tolist()
                sampled = dict(temperature=0.8, top_p=0.9, seed=i) if i % 3 == 0 else {}
                requests.append(make_request(f"b{burst}-{i}", prompt, max_tokens=int(rng.integers(1, 40)), **sampled))
            run_all(engine, requests)
    finally:
        engine.close_sync()
    assert loader._serving.is_set(), "the engine never marked its start-up over"
    print("LATE_COMPILES " + json.dumps(loader.late_compiles))
""")


def test_engine_builds_no_kernel_after_start(cuda_backend, tmp_path) -> None:
    """A fresh process, an empty kernel cache: the start-up discovery finds every kernel that a
    mixed workload (1–32 requests, prompts of 1–700 tokens, greedy and sampled) launches."""
    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    path = write_tiny_qwen3(tmp_path / "q", seed=7, dtype="bfloat16", head_dim=128, hidden_size=256,
                            intermediate_size=512, max_position_embeddings=2048)
    env = {**os.environ, "CUPY_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    result = subprocess.run([sys.executable, "-c", SERVE_MIXED, str(path)], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("LATE_COMPILES "))
    assert json.loads(line.split(" ", 1)[1]) == [], result.stderr[-4000:]


def test_the_cuda_backend_does_not_import_scipy() -> None:
    """``import cupyx`` brought cupyx.linalg and SciPy in: 0.4 s of every engine start (s12 D1)."""
    pytest.importorskip("cupy")
    code = ("import sys, openinfer.backend.cuda.backend, openinfer.engine_core.process; "
            "print(sorted(m for m in ('scipy', 'cupyx.linalg', 'cupyx.scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"


def test_copy_token_sources_equals_the_numpy_gather_scatter(cuda_backend) -> None:
    """``fill_token_sources`` (static_batch.cu's copy_token_sources, one of the STEP_KERNELS built at
    start) writes ``token_ids[dest] = previous[src]`` as NumPy's indexing does, other entries kept."""
    import types

    import cupy
    import numpy as np

    rng = np.random.default_rng(3)
    for count, size in ((0, 5), (1, 1), (7, 40), (300, 1000)):
        token_ids = rng.integers(0, 1 << 30, size=size, dtype=np.int32)
        previous = rng.integers(0, 1 << 30, size=max(count, 1) * 2, dtype=np.int32)
        sources = np.stack([rng.permutation(size)[:count], rng.integers(0, previous.size, count)], axis=1)
        expected = token_ids.copy()
        expected[sources[:, 0]] = previous[sources[:, 1]]
        batch = types.SimpleNamespace(token_ids=cupy.asarray(token_ids))
        cuda_backend.fill_token_sources(batch, cupy.asarray(previous), sources.astype(np.int64))
        np.testing.assert_array_equal(batch.token_ids.get(), expected)
