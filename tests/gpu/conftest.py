"""GPU tests: run with ``pytest -m gpu tests/gpu`` on a machine with CuPy and an NVIDIA GPU.

Every module here marks itself ``gpu`` and skips cleanly when CuPy or a GPU is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend import cuda_available
from openinfer.backend.base import ForwardBatch
from openinfer.backend.cuda.bf16 import bf16_bits_to_float, float_to_bf16_bits

BLOCK_SIZE = 16  # KV cache block size of the attention tests' paged batches


@pytest.fixture(scope="session")
def cuda_backend():
    if not cuda_available():
        pytest.skip("needs CuPy and an NVIDIA GPU")
    from openinfer.backend.cuda import CudaBackend

    return CudaBackend()


@pytest.fixture
def cuda_moe(cuda_backend):
    """``openinfer.backend.cuda.moe`` (MoE ops, quantized linears), after ``cuda_backend``'s GPU check."""
    from openinfer.backend.cuda import moe

    return moe


@pytest.fixture
def sm90_moe(cuda_backend):
    """``openinfer.backend.cuda.moe_sm90`` (the Hopper grouped expert GEMM); skips unless the GPU runs sm_90a code."""
    from openinfer.backend.cuda import moe_sm90

    if not moe_sm90.sm90_supported():
        pytest.skip("moe_grouped_gemm_sm90 needs a compute capability 9.0 GPU")
    return moe_sm90


@pytest.fixture
def rng(request):
    # fresh random inputs per test, reproducible from the test's name
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


def bf16_random(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """float32 values exactly representable in bf16 (what both backends then hold)."""
    return bf16_bits_to_float(float_to_bf16_bits(rng.standard_normal(shape).astype(np.float32) * scale))


def moe_router_case(backend, rng: np.random.Generator, experts: int, top_k: int, hidden: int, *,
                    scoring: str = "sigmoid", scaling: float = 2.446, shared: int = 0, inter: int = 0,
                    expert_width: int | None = None, gate_scale: float = 0.1, bias_scale: float = 0.3):
    """A ``DeviceMoE`` for the routing tests: ``RouterSpec(experts, top_k, scoring)`` (norm_topk_prob unless softmax,
    ``scaling``), a bf16 router gate [experts, hidden] of scale ``gate_scale``, a correction bias of scale ``bias_scale``
    (none for softmax routers or ``bias_scale`` 0), ``shared`` fused shared experts; with ``inter``, bf16 expert stacks
    gate_up [E + S, 2 inter, width] and down [E + S, width, inter] (width: ``expert_width``, default ``hidden``; scale
    0.05), else none (routing only)."""
    import cupy

    from openinfer.backend.cuda import moe
    from openinfer.moe import RouterSpec

    spec = RouterSpec(experts, top_k, scoring, norm_topk_prob=scoring != "softmax", routed_scaling_factor=scaling)
    gate = backend.weight(bf16_random(rng, experts, hidden, scale=gate_scale))
    bias = (None if scoring == "softmax" or not bias_scale
            else cupy.asarray((bias_scale * rng.standard_normal(experts)).astype(np.float32)))
    gate_up = down = None
    if inter:
        width = expert_width or hidden
        gate_up = moe.ExpertLinear("bf16", backend.weight(bf16_random(rng, experts + shared, 2 * inter, width,
                                                                      scale=0.05)), None, 2 * inter, width)
        down = moe.ExpertLinear("bf16", backend.weight(bf16_random(rng, experts + shared, width, inter, scale=0.05)),
                                None, width, inter)
    return moe.DeviceMoE(spec, gate, bias, gate_up, down, shared_experts=shared)


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    assert np.isfinite(ours).all(), "non-finite values in the cuda result"
    return float(np.linalg.norm(ours - reference) / max(np.linalg.norm(reference), 1e-30))


def paged_batch(rng: np.random.Generator, cached: list[int], new: list[int], num_blocks: int,
                vocab: int = 0) -> ForwardBatch:
    """A batch of sequences with ``cached`` tokens already in the cache and ``new`` to run, owning
    shuffled, non-contiguous blocks of BLOCK_SIZE (block 0 left free, one padded null entry per
    table row). Token ids are drawn from ``rng`` below ``vocab`` (after the tables), or zeros."""
    lengths = [c + n for c, n in zip(cached, new, strict=True)]
    max_blocks = max(-(-length // BLOCK_SIZE) for length in lengths) + 1  # +1: a padded null entry
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(lengths), max_blocks), np.int32)
    for i, length in enumerate(lengths):
        for j in range(-(-length // BLOCK_SIZE)):
            tables[i, j] = free.pop()
    num_tokens = int(sum(new))
    token_ids = rng.integers(0, vocab, size=num_tokens) if vocab else np.zeros(num_tokens)
    return ForwardBatch.over_blocks(tables, cached, new, BLOCK_SIZE, token_ids)


def load_qwen3(path, backend, max_model_len: int = 512):
    """The Qwen3 plugin's model from a checkpoint directory, on ``backend``."""
    import json

    from openinfer_qwen3.config import qwen3_config
    from openinfer_qwen3.model import Qwen3ForCausalLM

    config = json.loads((path / "config.json").read_text())
    return Qwen3ForCausalLM.load(path, qwen3_config(config), backend, max_model_len)
