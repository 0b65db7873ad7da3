"""The CUDA kernels' own source (``kernels/gated_deltanet.cu``) compiled with g++ against a host
stand-in for the CUDA built-ins (tests/helpers/cuda_host) and run on the CPU against the NumPy ops:
checks the kernels' indexing, state handling and arithmetic in CI, where there is no GPU.
Launch glue (CuPy) and performance are covered by the ``gpu`` tests only."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from openinfer_qwen35 import gated_deltanet
from openinfer_qwen35.config import Qwen35Config
from openinfer_qwen35.kernel_plan import sigmoid_mul
from openinfer_qwen35.state import StepSequences
from openinfer_qwen35.weights import DeltaNetWeights

from openinfer import float32_to_bf16
from tests.helpers.cuda_emulation import bf16, compile_harness, read_array, run_harness
from tests.plugins.qwen35.qwen35_helpers import TINY_QWEN35

HARNESS = Path(__file__).parent / "cuda_emulation" / "harness.cpp"
KEY_DIM, VALUE_DIM = 12, 40  # dv not a multiple of 32: idle threads in the last warp


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    kernels = Path(str(resources.files("openinfer_qwen35") / "kernels"))
    return compile_harness(HARNESS, kernels, tmp_path_factory.mktemp("gdn-harness") / "harness", {"DK": KEY_DIM})


def test_kernels_match_numpy_on_a_mixed_batch(harness, tmp_path):
    config = Qwen35Config.from_dict({**TINY_QWEN35, "linear_key_head_dim": KEY_DIM,
                                     "linear_value_head_dim": VALUE_DIM})
    rng = np.random.default_rng(0)
    nk, nv, width, conv_dim = (config.linear_num_key_heads, config.linear_num_value_heads,
                               config.linear_conv_kernel_dim, config.conv_dim)
    # prefill from scratch, a decode, a continued chunk shorter than the conv window, a 1-token prompt
    lengths, fresh = [21, 1, 2, 1], np.array([True, False, False, True])
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    slots = np.array([3, 1, 4, 2], np.int32)
    proj = bf16(rng.standard_normal((query_start[-1], conv_dim + config.linear_value_dim + 2 * nv)))
    conv_state = bf16(rng.standard_normal((5, width - 1, conv_dim)))
    ssm_state = (0.3 * rng.standard_normal((5, nv, KEY_DIM, VALUE_DIM))).astype(np.float32)
    conv_weight = bf16(0.4 * rng.standard_normal((conv_dim, width)))
    neg_rate = -np.exp(rng.uniform(np.log(0.05), np.log(4.0), nv)).astype(np.float32)
    dt_bias = bf16(0.5 * rng.standard_normal(nv))
    norm = bf16(1 + 0.3 * rng.standard_normal(VALUE_DIM))
    gate_x = bf16(rng.standard_normal((9, 24)))
    gate_wide = bf16(rng.standard_normal((9, 48)))
    token_seq = np.repeat(np.arange(4, dtype=np.int32), lengths)
    norm_x, norm_residual = bf16(rng.standard_normal((5, 80))), bf16(3 * rng.standard_normal((5, 80)))
    norm_weight = (1.0 + 0.3 * bf16(rng.standard_normal(80))).astype(np.float32)  # 1 + w, not rounded
    run_harness(harness, tmp_path, nk, nv, VALUE_DIM, width, config.rms_norm_eps, 24, timeout=300, **{"proj": float32_to_bf16(proj), "conv_weight": float32_to_bf16(conv_weight),
             "conv_state": float32_to_bf16(conv_state), "ssm_state": ssm_state, "neg_decay_rate": neg_rate,
             "dt_bias": dt_bias, "norm": float32_to_bf16(norm), "query_start": query_start, "slots": slots,
             "fresh": fresh.astype(np.int32), "token_seq": token_seq, "gate_x": float32_to_bf16(gate_x),
             "gate_wide": float32_to_bf16(gate_wide), "norm_x": float32_to_bf16(norm_x),
             "norm_residual": float32_to_bf16(norm_residual), "norm_weight": norm_weight})

    host_conv, host_ssm = conv_state.copy(), ssm_state.copy()
    weights = DeltaNetWeights(None, conv_weight, neg_rate, dt_bias, norm, None)
    expected = gated_deltanet.delta_net(proj, weights, host_conv, host_ssm,
                                        StepSequences(query_start.astype(np.int64), slots.astype(np.int64), fresh),
                                        config)

    out = read_array(tmp_path, "out", np.uint16, expected.shape)
    # bf16 rounding where HF's bf16 model rounds (conv output, beta, core output, norm): ~1%
    assert np.abs(out - expected).max() <= 0.05 * max(1.0, float(np.abs(expected).max()))
    assert np.abs(out - expected).mean() <= 0.01
    np.testing.assert_array_equal(read_array(tmp_path, "conv_state_out", np.uint16, conv_state.shape), host_conv)
    ssm = read_array(tmp_path, "ssm_state_out", np.float32, ssm_state.shape)
    assert np.abs(ssm[slots] - host_ssm[slots]).max() <= 0.03 * max(1.0, float(np.abs(host_ssm[slots]).max()))
    np.testing.assert_array_equal(ssm[0], ssm_state[0])  # the null slot is never touched
    gated = read_array(tmp_path, "gated", np.uint16, gate_x.shape)
    np.testing.assert_allclose(gated, sigmoid_mul(gate_x, gate_wide[:, 24:]), rtol=1e-2, atol=1e-2)

    # Qwen3.5's norm as HF's bf16 model: fp32 normalize × fp32 (1 + w), one rounding
    def zero_centred(x: np.ndarray) -> np.ndarray:
        return bf16(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps) * norm_weight)

    summed = bf16(norm_x + norm_residual)
    np.testing.assert_array_equal(read_array(tmp_path, "norm_sum", np.uint16, summed.shape), summed)
    np.testing.assert_allclose(read_array(tmp_path, "norm_out", np.uint16, summed.shape), zero_centred(summed), rtol=8e-3, atol=1e-6)
    np.testing.assert_allclose(read_array(tmp_path, "norm_plain", np.uint16, norm_x.shape), zero_centred(norm_x), rtol=8e-3,
                               atol=1e-6)
