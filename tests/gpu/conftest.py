"""GPU tests: run with ``pytest -m gpu tests/gpu`` on a machine with CuPy and an NVIDIA GPU.

Every module here marks itself ``gpu`` and skips cleanly when CuPy or a GPU is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend import cuda_available
from openinfer.backend.cuda.bf16 import bf16_bits_to_float, float_to_bf16_bits


@pytest.fixture(scope="session")
def cuda_backend():
    if not cuda_available():
        pytest.skip("needs CuPy and an NVIDIA GPU")
    from openinfer.backend.cuda import CudaBackend

    return CudaBackend()


@pytest.fixture
def rng(request):
    # fresh random inputs per test, reproducible from the test's name
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


def bf16_random(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """float32 values exactly representable in bf16 (what both backends then hold)."""
    return bf16_bits_to_float(float_to_bf16_bits(rng.standard_normal(shape).astype(np.float32) * scale))


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    assert np.isfinite(ours).all(), "non-finite values in the cuda result"
    return float(np.linalg.norm(ours - reference) / max(np.linalg.norm(reference), 1e-30))


def load_qwen3(path, backend, max_model_len: int = 512):
    """The Qwen3 plugin's model from a checkpoint directory, on ``backend``."""
    import json

    from openinfer_qwen3.config import qwen3_config
    from openinfer_qwen3.model import Qwen3ForCausalLM

    config = json.loads((path / "config.json").read_text())
    return Qwen3ForCausalLM.load(path, qwen3_config(config), backend, max_model_len)
