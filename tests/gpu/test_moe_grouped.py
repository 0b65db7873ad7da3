"""moe13's grouped-expert kernels against NumPy: moe_sm90.cu's tile shapes (SM90_SHAPES) and the
prefill routing kernels of moe_routing.cu."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.conftest import bf16_random
from tests.gpu.test_kimi_ops import _expert_rows_reference, _expert_weights

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _sm90():
    from openinfer.backend.cuda import moe, moe_sm90

    if not moe_sm90.sm90_supported():
        pytest.skip("moe_grouped_gemm_sm90 needs a compute capability 9.0 GPU")
    return moe, moe_sm90


def _max_error(ours, reference) -> float:
    ours = np.asarray(ours, np.float64)
    assert np.isfinite(ours).all()
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("shape", ["base", "skip", "m64", "m64_s5", "m64_n128_s8", "n128_s6"])
def test_sm90_shapes_match_numpy(cuda_backend, rng, shape):
    """Every SM90_SHAPES build on ragged experts (an empty expert, one over several 64- and 128-slot
    tiles, tiles of 1-5 slots: a warpgroup all padding), K = 200 (a partial k-tile), N = 304 / I = 152
    (partial 128- and 256-row tiles, the next expert's rows in the box, never stored): gate_up
    (gathered rows), the fused SiLU·mul equal to silu_mul of its own gate_up, and down against NumPy
    fp32 per expert; the same as the default shape within bf16 rounding; a graph replay equals the
    eager run."""
    moe, moe_sm90 = _sm90()
    num_experts, top_k, hidden, inter, tokens = 8, 3, 200, 152, 300
    gate_up, gate_up_ref = _expert_weights(rng, "bf16", num_experts, 2 * inter, hidden)
    down, down_ref = _expert_weights(rng, "bf16", num_experts, hidden, inter)
    x_host = bf16_random(rng, tokens, hidden)
    x = cuda_backend.upload(x_host)
    ids = np.stack([rng.choice([0, 2, 3, 5, 6], top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[:260, 0] = 1  # expert 1: 260 slots (five 64-slot tiles, three 128-slot tiles)
    ids[:5, 2] = 7  # expert 7: 5 slots; expert 4: none
    grouping = moe.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), num_experts)
    offsets, sorted_slots = grouping.offsets.get(), grouping.sorted_slots.get()
    h = moe_sm90.grouped_gemm_sm90(x, gate_up, grouping, gather=True, shape=shape)
    h_ref = _expert_rows_reference(x_host, gate_up_ref, sorted_slots, offsets, top_k, gather=True)
    assert _max_error(cuda_backend.to_host(h), h_ref) < 1e-2
    fused = moe_sm90.grouped_gemm_sm90(x, gate_up, grouping, gather=True, fuse_silu=True, shape=shape)
    assert np.array_equal(fused.get(), cuda_backend.silu_mul(h).get())
    y = moe_sm90.grouped_gemm_sm90(fused, down, grouping, gather=False, shape=shape)
    y_ref = _expert_rows_reference(cuda_backend.to_host(fused), down_ref, sorted_slots, offsets, top_k, gather=False)
    assert _max_error(cuda_backend.to_host(y), y_ref) < 1e-2
    base = moe_sm90.grouped_gemm_sm90(fused, down, grouping, gather=False, shape="base")
    assert _max_error(cuda_backend.to_host(y), cuda_backend.to_host(base).astype(np.float64)) < 1e-2

    def experts():
        return moe_sm90.grouped_gemm_sm90(moe_sm90.grouped_gemm_sm90(
            x, gate_up, grouping, gather=True, fuse_silu=True, shape=shape), down, grouping, gather=False, shape=shape)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        experts()
        mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
        stream.begin_capture() if mode is None else stream.begin_capture(mode)
        graph_out = experts()
        graph = stream.end_capture()
        graph_out[...] = 0
        graph.launch()
        stream.synchronize()
    assert np.array_equal(graph_out.get(), y.get())


def test_sm90_shape_switch(cuda_backend, monkeypatch):
    """OPENINFER_MOE_SM90_SHAPE forces a shape; unset, SM90_SHAPE_CHOICE decides; a bad name is a clear error."""
    _, moe_sm90 = _sm90()
    monkeypatch.delenv(moe_sm90.SM90_SHAPE_ENV, raising=False)
    assert moe_sm90.sm90_shape(6.0) == moe_sm90.SM90_SHAPES[moe_sm90.SM90_SHAPE_CHOICE[-1][1]]
    monkeypatch.setenv(moe_sm90.SM90_SHAPE_ENV, "m64")
    assert moe_sm90.sm90_shape(6.0) == moe_sm90.SM90_SHAPES["m64"]
    monkeypatch.setenv(moe_sm90.SM90_SHAPE_ENV, "m32")
    with pytest.raises(ValueError, match="OPENINFER_MOE_SM90_SHAPE"):
        moe_sm90.sm90_shape(6.0)
