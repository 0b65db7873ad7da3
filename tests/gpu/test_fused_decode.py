"""Fused decode GEMVs (gemv.cu ``gemv_m1_add_rms_norm``, ``gemv_m1_silu_mul``): each against its
unfused NumPy composition, bit-identical to the unfused CUDA ops, and greedy tokens unchanged with
fusion on and off (``OPENINFER_FUSED_DECODE``; off by default, see benchmarks/GPU.md)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from openinfer.backend.cuda.bf16 import round_to_bf16
from openinfer.backend.numpy_backend import NumpyBackend
from tests.gpu.conftest import bf16_random, relative_error

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

REF = NumpyBackend()
BF16_TOL = 1e-2


def _bits(backend, x) -> np.ndarray:
    return cupy.asnumpy(x).view(np.uint16)


# blocks per SM of the fused launch: the default, and 1 (with 1 SM: one block loops over every tile)
GRIDS = [("default", None), ("1 per SM", (None, 1)), ("one block", (1, 1))]


def _grid_args(cuda_backend, grid) -> dict:
    from openinfer.backend.cuda.linear import FUSED_BLOCKS_PER_SM

    if grid is None:
        return {"num_sms": cuda_backend.num_sms, "blocks_per_sm": FUSED_BLOCKS_PER_SM}
    sms, per_sm = grid
    return {"num_sms": sms or cuda_backend.num_sms, "blocks_per_sm": per_sm}


@pytest.mark.parametrize("k,n", [(64, 96), (1000, 1001), (2560, 6144), (4096, 768)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grid", [g for _, g in GRIDS], ids=[name for name, _ in GRIDS])
def test_add_rms_norm_linear_fused(cuda_backend, rng, k, n, with_residual, bias, grid):
    from openinfer.backend.cuda.backend import _norm_threads
    from openinfer.backend.cuda.linear import fused_add_rms_norm_gemv

    x, r = bf16_random(rng, 1, k), bf16_random(rng, 1, k)
    norm = round_to_bf16(1 + bf16_random(rng, k, scale=0.3))
    w, b = bf16_random(rng, n, k, scale=0.05), (bf16_random(rng, n) if bias else None)
    layer, weight = cuda_backend.linear_weight(w, b), cuda_backend.weight(norm)
    dx, dr = cuda_backend.upload(x), cuda_backend.upload(r) if with_residual else None
    y, residual = fused_add_rms_norm_gemv(dx, dr, weight, 1e-6, _norm_threads(k), layer, **_grid_args(cuda_backend, grid))
    # the NumPy composition, on the bf16 values the GPU holds
    h = round_to_bf16(x + r) if with_residual else x
    reference = REF.linear(round_to_bf16(REF.rms_norm(h, norm, 1e-6)), REF.linear_weight(w, b))
    assert relative_error(cuda_backend.to_host(y), reference) < BF16_TOL
    assert np.array_equal(cuda_backend.to_host(residual), h)
    # the unfused cuda ops give the very same bits
    if with_residual:
        h_dev, residual_dev = cuda_backend.add_rms_norm(dx, dr, weight, 1e-6)
    else:
        h_dev, residual_dev = cuda_backend.rms_norm(dx, weight, 1e-6), dx
    assert np.array_equal(_bits(cuda_backend, y), _bits(cuda_backend, cuda_backend.linear(h_dev, layer)))
    assert np.array_equal(_bits(cuda_backend, residual), _bits(cuda_backend, residual_dev))


@pytest.mark.parametrize("k,n", [(96, 64), (9728, 2560), (1000, 333), (2560, 19456)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grid", [g for _, g in GRIDS], ids=[name for name, _ in GRIDS])
def test_silu_mul_linear_fused(cuda_backend, rng, k, n, bias, grid):
    from openinfer.backend.cuda.linear import fused_silu_mul_gemv

    gate_up = bf16_random(rng, 1, 2 * k)
    w, b = bf16_random(rng, n, k, scale=0.05), (bf16_random(rng, n) if bias else None)
    layer = cuda_backend.linear_weight(w, b)
    dgu = cuda_backend.upload(gate_up)
    y = fused_silu_mul_gemv(dgu, layer, **_grid_args(cuda_backend, grid))
    reference = REF.linear(round_to_bf16(REF.silu_mul(gate_up)), REF.linear_weight(w, b))
    assert relative_error(cuda_backend.to_host(y), reference) < BF16_TOL
    unfused = cuda_backend.linear(cuda_backend.silu_mul(dgu), layer)
    assert np.array_equal(_bits(cuda_backend, y), _bits(cuda_backend, unfused))


def test_backend_ops_fuse_only_decode_rows(cuda_backend, rng):
    """More than one row takes the unfused path; both paths agree with each other's bits."""
    from openinfer.backend.cuda import CudaBackend

    fused, unfused = CudaBackend(fuse_decode=True), CudaBackend(fuse_decode=False)
    assert fused.fuse_decode and not unfused.fuse_decode
    k, n = 512, 256
    norm = cuda_backend.weight(round_to_bf16(1 + bf16_random(rng, k, scale=0.3)))
    layer = cuda_backend.linear_weight(bf16_random(rng, n, k, scale=0.05))
    for rows in (1, 3):
        x, r = cuda_backend.upload(bf16_random(rng, rows, k)), cuda_backend.upload(bf16_random(rng, rows, k))
        y1, res1 = fused.add_rms_norm_linear(x, r, norm, 1e-6, layer)
        y2, res2 = unfused.add_rms_norm_linear(x, r, norm, 1e-6, layer)
        assert np.array_equal(_bits(cuda_backend, y1), _bits(cuda_backend, y2))
        assert np.array_equal(_bits(cuda_backend, res1), _bits(cuda_backend, res2))
        gu = cuda_backend.upload(bf16_random(rng, rows, 2 * k))
        down = cuda_backend.linear_weight(bf16_random(rng, n, k, scale=0.05))
        assert np.array_equal(_bits(cuda_backend, fused.silu_mul_linear(gu, down)),
                              _bits(cuda_backend, unfused.silu_mul_linear(gu, down)))


def _greedy(path, monkeypatch, fused: bool) -> list[int]:
    import openinfer
    from openinfer.v1 import engine_pb2 as pb

    monkeypatch.setenv("OPENINFER_FUSED_DECODE", "1" if fused else "0")
    engine = openinfer.create_engine(str(path), device="cuda", max_num_seqs=4, num_kv_blocks=64, max_model_len=512)
    assert engine.model.backend.fuse_decode is fused

    async def run() -> list[int]:
        ids: list[int] = []
        request = pb.GenerateRequest(request_id="fused", prompt_token_ids=list(range(3, 40)),
                                     sampling=pb.SamplingParams(temperature=0.0),
                                     stop=pb.StopConditions(max_tokens=32, ignore_eos=True))
        async for event in engine.generate(request):
            if event.WhichOneof("event") == "tokens":
                ids.extend(event.tokens.ids)
        return ids

    try:
        return asyncio.run(run())
    finally:
        engine.close_sync()


def test_greedy_tokens_unchanged_with_fusion(tmp_path_factory, monkeypatch):
    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    small = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    path = write_tiny_qwen3(tmp_path_factory.mktemp("fused"), seed=3, dtype="bfloat16", **small)
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 256
    on, off = _greedy(path, monkeypatch, True), _greedy(path, monkeypatch, False)
    assert len(on) == 32 and on == off
