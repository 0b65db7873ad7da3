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
    # norm rows: 80 features (held in registers by 64 threads), 400 (32 threads: too wide, re-read)
    norms = {prefix: (bf16(rng.standard_normal((rows, features))), bf16(3 * rng.standard_normal((rows, features))),
                      (1.0 + 0.3 * bf16(rng.standard_normal(features))).astype(np.float32))  # 1 + w, not rounded
             for prefix, rows, features in (("norm", 5, 80), ("wide", 2, 400))}
    norm_arrays = {f"{prefix}_{name}": float32_to_bf16(array) if name != "weight" else array
                   for prefix, arrays in norms.items()
                   for name, array in zip(("x", "residual", "weight"), arrays, strict=True)}
    run_harness(harness, tmp_path, nk, nv, VALUE_DIM, width, config.rms_norm_eps, 24, timeout=300, **{"proj": float32_to_bf16(proj), "conv_weight": float32_to_bf16(conv_weight),
             "conv_state": float32_to_bf16(conv_state), "ssm_state": ssm_state, "neg_decay_rate": neg_rate,
             "dt_bias": dt_bias, "norm": float32_to_bf16(norm), "query_start": query_start, "slots": slots,
             "fresh": fresh.astype(np.int32), "token_seq": token_seq, "gate_x": float32_to_bf16(gate_x),
             "gate_wide": float32_to_bf16(gate_wide), **norm_arrays})

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
    def zero_centred(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return bf16(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps) * weight)

    for prefix, (norm_x, norm_residual, norm_weight) in norms.items():
        summed = bf16(norm_x + norm_residual)
        np.testing.assert_array_equal(read_array(tmp_path, f"{prefix}_sum", np.uint16, summed.shape), summed)
        np.testing.assert_allclose(read_array(tmp_path, f"{prefix}_out", np.uint16, summed.shape),
                                   zero_centred(summed, norm_weight), rtol=8e-3, atol=1e-6)
        np.testing.assert_allclose(read_array(tmp_path, f"{prefix}_plain", np.uint16, norm_x.shape),
                                   zero_centred(norm_x, norm_weight), rtol=8e-3, atol=1e-6)


FAST_HARNESS = Path(__file__).parent / "cuda_emulation" / "fast_paths_harness.cpp"
FAST_KEY_DIM, FAST_VALUE_DIM = 64, 64  # the chunked kernels take dk % 64 == 0, dv % 32 == 0


@pytest.fixture(scope="module")
def fast_harness(tmp_path_factory) -> Path:
    kernels = Path(str(resources.files("openinfer_qwen35") / "kernels"))
    # the conv width compiled in, as cuda_ops compiles gdn_decode_step
    return compile_harness(FAST_HARNESS, kernels, tmp_path_factory.mktemp("gdn-fast") / "harness",
                           {"DK": FAST_KEY_DIM, "CONV_WIDTH": TINY_QWEN35["linear_conv_kernel_dim"]})


def test_chunked_prefill_and_fused_decode_match_numpy(fast_harness, tmp_path):
    """The tensor-core chunked prefill (mma emulated lane by lane) over prompts that are not a
    multiple of 64, a chunk continuing a saved state and a one-token row; the fused decode step
    over fresh and continuing sequences sharing key heads, its early-loads and coalesced variants
    (the same bits) and its vec4 variant (16-byte state accesses: to fp32 rounding)."""
    config = Qwen35Config.from_dict({**TINY_QWEN35, "linear_key_head_dim": FAST_KEY_DIM,
                                     "linear_value_head_dim": FAST_VALUE_DIM})
    rng = np.random.default_rng(3)
    nk, nv, width, conv_dim = (config.linear_num_key_heads, config.linear_num_value_heads,
                               config.linear_conv_kernel_dim, config.conv_dim)
    assert nv // nk >= 2  # value heads share a key head's conv window: the fused decode's hand-off
    features = conv_dim + config.linear_value_dim + 2 * nv
    conv_weight = bf16(0.4 * rng.standard_normal((conv_dim, width)))
    neg_rate = -np.exp(rng.uniform(np.log(0.05), np.log(4.0), nv)).astype(np.float32)
    dt_bias = bf16(0.5 * rng.standard_normal(nv))
    norm = bf16(1 + 0.3 * rng.standard_normal(FAST_VALUE_DIM))
    weights = DeltaNetWeights(None, conv_weight, neg_rate, dt_bias, norm, None)

    def step(lengths: list[int], fresh: np.ndarray, slots: np.ndarray):
        query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        proj = bf16(rng.standard_normal((query_start[-1], features)))
        conv_state = bf16(rng.standard_normal((6, width - 1, conv_dim)))
        ssm_state = (0.3 * rng.standard_normal((6, nv, FAST_KEY_DIM, FAST_VALUE_DIM))).astype(np.float32)
        host_conv, host_ssm = conv_state.copy(), ssm_state.copy()
        expected = gated_deltanet.delta_net(proj, weights, host_conv, host_ssm,
                                            StepSequences(query_start.astype(np.int64), slots.astype(np.int64),
                                                          fresh), config)
        return query_start, proj, conv_state, ssm_state, expected, host_conv, host_ssm

    # prefill: 150 tokens from scratch (2 full chunks + 22), a one-token row, a 64-token chunk
    # continuing its slot's state, 5 tokens continuing
    slots = np.array([3, 1, 4, 2], np.int32)
    fresh = np.array([True, False, False, False])
    query_start, proj, conv_state, ssm_state, expected, host_conv, host_ssm = step([150, 1, 64, 5], fresh, slots)
    chunk_start, chunk_len, seq_chunks = gated_deltanet.chunk_layout(query_start)
    # decode: six sequences, two fresh; slot 5 twice would race, so distinct slots
    d_slots = np.array([5, 2, 0, 3, 1, 4], np.int32)
    d_fresh = np.array([False, True, False, False, True, False])
    d_query_start, d_proj, d_conv, d_ssm, d_expected, d_host_conv, d_host_ssm = step([1] * 6, d_fresh, d_slots)

    run_harness(fast_harness, tmp_path, nk, nv, FAST_VALUE_DIM, width, config.rms_norm_eps, timeout=600,
                proj=float32_to_bf16(proj), conv_weight=float32_to_bf16(conv_weight),
                conv_state=float32_to_bf16(conv_state), ssm_state=ssm_state, neg_decay_rate=neg_rate,
                dt_bias=dt_bias, norm=float32_to_bf16(norm), query_start=query_start, slots=slots,
                fresh=fresh.astype(np.int32), token_seq=np.repeat(np.arange(4, dtype=np.int32), np.diff(query_start)),
                chunk_start=chunk_start, chunk_len=chunk_len, seq_chunks=seq_chunks,
                decode_proj=float32_to_bf16(d_proj), decode_conv_state=float32_to_bf16(d_conv),
                decode_ssm_state=d_ssm, decode_query_start=d_query_start, decode_slots=d_slots,
                decode_fresh=d_fresh.astype(np.int32))

    def check(prefix: str, out_shape, expected, conv_shape, host_conv, host_ssm, ssm_before, used_slots):
        out = read_array(tmp_path, f"{prefix}out", np.uint16, out_shape)
        scale = max(1.0, float(np.abs(expected).max()))
        assert np.abs(out - expected).max() <= 0.05 * scale
        assert np.abs(out - expected).mean() <= 0.01 * scale
        conv = read_array(tmp_path, f"{prefix}conv_state", np.uint16, conv_shape)
        np.testing.assert_array_equal(conv[used_slots], host_conv[used_slots])
        ssm = read_array(tmp_path, f"{prefix}ssm_state", np.float32, ssm_before.shape)
        state_scale = max(1.0, float(np.abs(host_ssm[used_slots]).max()))
        assert np.abs(ssm[used_slots] - host_ssm[used_slots]).max() <= 0.03 * state_scale
        untouched = np.setdiff1d(np.arange(ssm_before.shape[0]), used_slots)
        np.testing.assert_array_equal(ssm[untouched], ssm_before[untouched])

    check("prefill_", expected.shape, expected, conv_state.shape, host_conv, host_ssm, ssm_state, slots)
    # the 8-channel conv, the staged prepare kernel (every global read first) and the warp-per-head
    # gated norm write the plain ones' arrays bit for bit
    assert read_array(tmp_path, "staged_prepare_same", np.int32, (1,))[0] == 1
    # the blocked triangular solve: qn, kn, P and c bit for bit; W and U (T times bf16 rows, rounded
    # to bf16) within a bf16 rounding or two of the substitution's
    assert read_array(tmp_path, "blocked_prepare_same", np.int32, (1,))[0] == 1
    num_tokens = int(query_start[-1])
    for name, width in (("w", FAST_KEY_DIM), ("u", FAST_VALUE_DIM)):
        want = read_array(tmp_path, f"prepare_{name}", np.uint16, (num_tokens, nv, width))
        got = read_array(tmp_path, f"blocked_{name}", np.uint16, (num_tokens, nv, width))
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-3 * max(1.0, float(np.abs(want).max())))
        assert np.abs(got - want).mean() <= 1e-3 * max(1.0, float(np.abs(want).mean()))
    # the grouped prepare (a block per chunk and key head; q / k normed by 16-byte rows, T scaled into
    # the A operands): blocked's arrays within a bf16 rounding or two (c to fp64 rounding)
    num_chunks = len(chunk_start)
    for name, dtype, shape in (("qn", np.uint16, (num_tokens, nk, FAST_KEY_DIM)),
                               ("kn", np.uint16, (num_tokens, nk, FAST_KEY_DIM)),
                               ("w", np.uint16, (num_tokens, nv, FAST_KEY_DIM)),
                               ("u", np.uint16, (num_tokens, nv, FAST_VALUE_DIM)),
                               ("p", np.uint16, (num_chunks, nv, 64, 64)), ("cum", np.float32, (num_tokens, nv))):
        want = read_array(tmp_path, f"blocked_{name}", dtype, shape)
        got = read_array(tmp_path, f"grouped_{name}", dtype, shape)
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-3 * scale, err_msg=name)
        assert np.abs(got - want).mean() <= 1e-3 * max(1.0, float(np.abs(want).mean())), name
    # the grouped prepare with the solve's block products on tensor cores (hi / lo bf16 splits): the
    # scalar solve's qn, kn, P and c bit for bit, W and U within a bf16 rounding of them
    assert read_array(tmp_path, "grouped_mma_same", np.int32, (1,))[0] == 1
    # a key head's value heads split over blocks (a step too small to fill the GPU): the same bits
    assert read_array(tmp_path, "grouped_split_same", np.int32, (1,))[0] == 1
    # W / U staged through shared memory and stored as 16-byte row pieces: the same bits
    assert read_array(tmp_path, "grouped_coalesced_same", np.int32, (1,))[0] == 1
    for name, width in (("w", FAST_KEY_DIM), ("u", FAST_VALUE_DIM)):
        want = read_array(tmp_path, f"grouped_{name}", np.uint16, (num_tokens, nv, width))
        got = read_array(tmp_path, f"grouped_mma_{name}", np.uint16, (num_tokens, nv, width))
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3 * scale, err_msg=name)
        assert np.abs(got - want).mean() <= 1e-3 * max(1.0, float(np.abs(want).mean())), name
    # the conv fused into the grouped prepare (projection rows + the old windows): grouped_mma's arrays
    # bit for bit; the one-token rows convolved alone: conv_out's rows bit for bit
    assert read_array(tmp_path, "grouped_conv_same", np.int32, (1,))[0] == 1
    assert read_array(tmp_path, "conv_rows_same", np.int32, (1,))[0] == 1
    # the scan split in a state walk and an all-chunks output kernel: the scan's O and states bit for bit
    assert read_array(tmp_path, "split_scan_same", np.int32, (1,))[0] == 1
    # the walk with the state in mma accumulator registers (transposed products, the same operands
    # in the same k order): the split walk's S^T per chunk, V', O and final states bit for bit
    assert read_array(tmp_path, "registers_states_same", np.int32, (1,))[0] == 1
    # the 8-channel gated norm (16-byte accesses, the sum of squares in another order): within a bf16 rounding
    vec_norm = read_array(tmp_path, "vec_norm_out", np.uint16, expected.shape)
    np.testing.assert_allclose(vec_norm, read_array(tmp_path, "prefill_out", np.uint16, expected.shape),
                               rtol=8e-3, atol=1e-5)
    # the output kernel with a block's operands loaded at once (V' as the row-major B operand): its bits
    assert read_array(tmp_path, "output_staged_same", np.int32, (1,))[0] == 1
    # the output kernel with the gated norm fused in: the separate norm's rows (the RMS summed in another
    # order: within a bf16 rounding)
    fused = read_array(tmp_path, "fused_out", np.uint16, expected.shape)
    separate = read_array(tmp_path, "prefill_out", np.uint16, expected.shape)
    np.testing.assert_allclose(fused, separate, rtol=8e-3, atol=1e-5)
    # the decode harness writes "decode_conv_state_out" / "decode_ssm_state_out"
    out = read_array(tmp_path, "decode_out", np.uint16, d_expected.shape)
    scale = max(1.0, float(np.abs(d_expected).max()))
    assert np.abs(out - d_expected).max() <= 0.05 * scale
    assert np.abs(out - d_expected).mean() <= 0.01 * scale
    conv = read_array(tmp_path, "decode_conv_state_out", np.uint16, d_conv.shape)
    np.testing.assert_array_equal(conv[d_slots], d_host_conv[d_slots])
    ssm = read_array(tmp_path, "decode_ssm_state_out", np.float32, d_ssm.shape)
    assert np.abs(ssm[d_slots] - d_host_ssm[d_slots]).max() <= 0.03 * max(1.0, float(np.abs(d_host_ssm).max()))
    # every key head's last block reset its arrival counter for the next step
    np.testing.assert_array_equal(read_array(tmp_path, "decode_arrivals", np.int32, (6 * nk,)), 0)
    # the early-loads kernel (the token's scalars read first) computes the same step: bit for bit
    # the plain kernel's outputs and states
    for name, dtype, shape in (("out", np.uint16, d_expected.shape), ("conv_state_out", np.uint16, d_conv.shape),
                               ("ssm_state_out", np.float32, d_ssm.shape)):
        np.testing.assert_array_equal(read_array(tmp_path, f"early_loads_{name}", dtype, shape),
                                      read_array(tmp_path, f"decode_{name}", dtype, shape))
    np.testing.assert_array_equal(read_array(tmp_path, "early_loads_arrivals", np.int32, (6 * nk,)), 0)
    # the coalesced kernel (a column's threads dv apart, partial sums in shared memory): the same bits
    for name, dtype, shape in (("out", np.uint16, d_expected.shape), ("conv_state_out", np.uint16, d_conv.shape),
                               ("ssm_state_out", np.float32, d_ssm.shape)):
        np.testing.assert_array_equal(read_array(tmp_path, f"coalesced_{name}", dtype, shape),
                                      read_array(tmp_path, f"decode_{name}", dtype, shape))
    # the vec4 kernel (16-byte state accesses; a column's 16 partial sums in another order): the
    # plain kernel's conv window bit for bit, its state to fp32 rounding, its outputs to a bf16 rounding
    np.testing.assert_array_equal(read_array(tmp_path, "vec4_conv_state_out", np.uint16, d_conv.shape),
                                  read_array(tmp_path, "decode_conv_state_out", np.uint16, d_conv.shape))
    np.testing.assert_allclose(read_array(tmp_path, "vec4_ssm_state_out", np.float32, d_ssm.shape),
                               read_array(tmp_path, "decode_ssm_state_out", np.float32, d_ssm.shape),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(read_array(tmp_path, "vec4_out", np.uint16, d_expected.shape),
                               read_array(tmp_path, "decode_out", np.uint16, d_expected.shape), rtol=8e-3, atol=1e-5)
    np.testing.assert_array_equal(read_array(tmp_path, "vec4_arrivals", np.int32, (6 * nk,)), 0)
    # the bulk kernel (state tile by bulk copies through shared memory): vec4's outputs, window and state bit for bit
    assert read_array(tmp_path, "bulk_same", np.int32, (1,))[0] == 1
    np.testing.assert_array_equal(read_array(tmp_path, "bulk_arrivals", np.int32, (6 * nk,)), 0)


OPERAND_HARNESS = Path(__file__).parent / "cuda_emulation" / "operand_format_harness.cpp"


def test_fp16_operands_cut_the_chunked_prefill_error(tmp_path_factory):
    """Issue #17: the default chunked chain (grouped_mma prepare, either state walk, staged output, gated
    norm) compiled with bf16 and with fp16 operands (GDN_F16_OPERANDS, OPENINFER_QWEN35_GDN_PREFILL=
    grouped_f16), mma emulated lane by lane, against the NumPy reference: a 256-token prompt from
    scratch and 130 tokens continuing a saved state. Both walks agree to fp32 sums in either format;
    fp16 has well under the bf16 operands' error (the layer's output and the final states)."""
    kernels = Path(str(resources.files("openinfer_qwen35") / "kernels"))
    config = Qwen35Config.from_dict({**TINY_QWEN35, "linear_key_head_dim": FAST_KEY_DIM,
                                     "linear_value_head_dim": FAST_VALUE_DIM})
    rng = np.random.default_rng(5)
    nk, nv, width, conv_dim = (config.linear_num_key_heads, config.linear_num_value_heads,
                               config.linear_conv_kernel_dim, config.conv_dim)
    features = conv_dim + config.linear_value_dim + 2 * nv
    conv_weight = bf16(0.4 * rng.standard_normal((conv_dim, width)))
    neg_rate = -np.exp(rng.uniform(np.log(0.05), np.log(4.0), nv)).astype(np.float32)
    dt_bias = bf16(0.5 * rng.standard_normal(nv))
    norm = bf16(1 + 0.3 * rng.standard_normal(FAST_VALUE_DIM))
    weights = DeltaNetWeights(None, conv_weight, neg_rate, dt_bias, norm, None)
    lengths, slots, fresh = [256, 130], np.array([2, 0], np.int32), np.array([True, False])
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    proj = bf16(rng.standard_normal((query_start[-1], features)))
    conv_state = bf16(rng.standard_normal((3, width - 1, conv_dim)))
    ssm_state = (0.3 * rng.standard_normal((3, nv, FAST_KEY_DIM, FAST_VALUE_DIM))).astype(np.float32)
    host_conv, host_ssm = conv_state.copy(), ssm_state.copy()
    expected = gated_deltanet.delta_net(proj, weights, host_conv, host_ssm,
                                        StepSequences(query_start.astype(np.int64), slots.astype(np.int64), fresh),
                                        config)
    chunk_start, chunk_len, seq_chunks = gated_deltanet.chunk_layout(query_start)
    errors = {}
    for fmt, defines in (("bf16", {}), ("fp16", {"GDN_F16_OPERANDS": 1})):
        directory = tmp_path_factory.mktemp(f"gdn-{fmt}")
        binary = compile_harness(OPERAND_HARNESS, kernels, directory / "harness", {"DK": FAST_KEY_DIM, **defines})
        run_harness(binary, directory, nk, nv, FAST_VALUE_DIM, width, config.rms_norm_eps, timeout=600,
                    proj=float32_to_bf16(proj), conv_weight=float32_to_bf16(conv_weight),
                    conv_state=float32_to_bf16(conv_state), ssm_state=ssm_state, neg_decay_rate=neg_rate,
                    dt_bias=dt_bias, norm=float32_to_bf16(norm), query_start=query_start, slots=slots,
                    fresh=fresh.astype(np.int32),
                    token_seq=np.repeat(np.arange(len(lengths), dtype=np.int32), lengths),
                    chunk_start=chunk_start, chunk_len=chunk_len, seq_chunks=seq_chunks)
        outs = {walk: read_array(directory, f"{walk}_out", np.uint16, expected.shape) for walk in ("shared", "registers")}
        states = {walk: read_array(directory, f"{walk}_ssm_state", np.float32, ssm_state.shape)
                  for walk in ("shared", "registers")}
        # the two walks: the same products on the same operands, in another order of fp32 sums
        mismatched = int((outs["registers"] != outs["shared"]).sum())
        print(f"{fmt}: walks differ at {mismatched} of {outs['shared'].size} outputs")
        assert mismatched <= 1e-3 * outs["shared"].size
        np.testing.assert_allclose(outs["registers"], outs["shared"], rtol=1e-2, atol=1e-4)
        np.testing.assert_allclose(states["registers"], states["shared"], rtol=1e-4, atol=1e-5)
        # against the token-by-token kernel on the same conv_out (fp32 state, q / k normed in fp32): what
        # the chunked path adds; and against the NumPy reference (no bf16 conv_out / beta / norm rounding)
        base_out = read_array(directory, "recurrent_out", np.uint16, expected.shape)
        base_core = read_array(directory, "recurrent_core", np.uint16, expected.shape)
        base_state = read_array(directory, "recurrent_ssm_state", np.float32, ssm_state.shape)[slots]
        core = read_array(directory, "shared_core", np.uint16, expected.shape)
        out, state = outs["shared"], states["shared"][slots]
        assert np.abs(out - expected).max() <= 0.05 * max(1.0, float(np.abs(expected).max()))

        def relative(a, b):
            return float(np.abs(a - b).mean() / np.abs(b).mean())

        errors[fmt] = {"core vs token-by-token": relative(core, base_core),
                       "state vs token-by-token": relative(state, base_state),
                       "output vs NumPy": relative(out, expected)}
        errors["token-by-token output vs NumPy"] = relative(base_out, expected)
    print(f"relative mean |error|: {errors}")
    for what in ("core vs token-by-token", "state vs token-by-token"):
        assert errors["fp16"][what] < 0.3 * errors["bf16"][what], what
    assert errors["fp16"]["output vs NumPy"] < errors["bf16"]["output vs NumPy"]


FP32_HARNESS = Path(__file__).parent / "cuda_emulation" / "fp32_chunked_harness.cpp"


@pytest.fixture(scope="module")
def fp32_and_split_chains(tmp_path_factory):
    """The harness run once: its directory (every chain's core and states), the step's shape, slots and
    the states it started from."""
    kernels = Path(str(resources.files("openinfer_qwen35") / "kernels"))
    config = Qwen35Config.from_dict({**TINY_QWEN35, "linear_key_head_dim": FAST_KEY_DIM,
                                     "linear_value_head_dim": FAST_VALUE_DIM})
    rng = np.random.default_rng(7)
    nk, nv, width, conv_dim = (config.linear_num_key_heads, config.linear_num_value_heads,
                               config.linear_conv_kernel_dim, config.conv_dim)
    features = conv_dim + config.linear_value_dim + 2 * nv
    lengths, slots, fresh = [150, 70], np.array([2, 0], np.int32), np.array([True, False])
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ssm_state = (0.3 * rng.standard_normal((3, nv, FAST_KEY_DIM, FAST_VALUE_DIM))).astype(np.float32)
    chunk_start, chunk_len, seq_chunks = gated_deltanet.chunk_layout(query_start)
    directory = tmp_path_factory.mktemp("gdn-fp32")
    binary = compile_harness(FP32_HARNESS, kernels, directory / "harness", {"DK": FAST_KEY_DIM})
    run_harness(binary, directory, nk, nv, FAST_VALUE_DIM, width, timeout=600,
                proj=float32_to_bf16(rng.standard_normal((query_start[-1], features)).astype(np.float32)),
                conv_weight=float32_to_bf16((0.4 * rng.standard_normal((conv_dim, width))).astype(np.float32)),
                conv_state=float32_to_bf16(rng.standard_normal((3, width - 1, conv_dim)).astype(np.float32)),
                ssm_state=ssm_state,
                neg_decay_rate=-np.exp(rng.uniform(np.log(0.05), np.log(4.0), nv)).astype(np.float32),
                dt_bias=bf16(0.5 * rng.standard_normal(nv)), query_start=query_start, slots=slots,
                fresh=fresh.astype(np.int32), token_seq=np.repeat(np.arange(len(lengths), dtype=np.int32), lengths),
                chunk_start=chunk_start, chunk_len=chunk_len, seq_chunks=seq_chunks)
    return directory, (int(query_start[-1]), nv * FAST_VALUE_DIM), slots, ssm_state


@pytest.mark.parametrize("chain", ["fp32", "split", "split_f16"])
def test_fp32_chunked_prefill_matches_the_token_by_token_kernel(fp32_and_split_chains, chain):
    """Issue #17: the fp32 chunked prefill (gdn_chunked_fp32.cu, OPENINFER_QWEN35_GDN_PREFILL=chunked_fp32)
    and the split-operand tensor-core one (gdn_chunked_split.cu, =chunked_split: exact q / k products,
    ~24-bit splits elsewhere; =chunked_split_f16: its walk on fp16 hi / lo parts, ~22 bits) against the
    token-by-token kernel on the same conv_out: a 150-token prompt
    from scratch and 70 tokens continuing a saved state; the bf16 output equals the token-by-token
    kernel's nearly everywhere (fp32 sums in another order) and the final states agree to fp32 rounding."""
    directory, shape, slots, ssm_state = fp32_and_split_chains
    ours, base = (read_array(directory, f"{name}_core", np.uint16, shape) for name in (chain, "recurrent"))
    differs = float((ours != base).mean())
    relative = float(np.abs(ours - base).mean() / np.abs(base).mean())
    print(f"{chain} chunked vs token-by-token: {differs:.4f} of the bf16 outputs differ, relative mean |error| "
          f"{relative:.2e}")
    assert differs < 0.01
    assert relative < 2e-5
    states = {name: read_array(directory, f"{name}_ssm_state", np.float32, ssm_state.shape)[slots]
              for name in (chain, "recurrent")}
    np.testing.assert_allclose(states[chain], states["recurrent"], rtol=1e-4, atol=1e-5)
    untouched = read_array(directory, f"{chain}_ssm_state", np.float32, ssm_state.shape)[1]
    np.testing.assert_array_equal(untouched, ssm_state[1])


def test_split_f16_walk_snapshot_equals_the_prefix_run(fp32_and_split_chains):
    """gdn_chunk_walk_split_f16_snapshot (an in-step prefix snapshot): the state entering the 150-token prompt's
    third chunk, stored into slot 1 on the way, equals the prompt's first two chunks walked alone (the same bits);
    the output and the final states equal the plain walk's."""
    directory, shape, slots, ssm_state = fp32_and_split_chains
    snapshot, prefix, plain = (read_array(directory, f"{name}_ssm_state", np.float32, ssm_state.shape)
                               for name in ("split_f16_snapshot", "split_f16_prefix", "split_f16"))
    np.testing.assert_array_equal(snapshot[1], prefix[1])
    assert np.abs(snapshot[1]).max() > 0
    np.testing.assert_array_equal(snapshot[slots], plain[slots])
    np.testing.assert_array_equal(read_array(directory, "split_f16_snapshot_core", np.uint16, shape),
                                  read_array(directory, "split_f16_core", np.uint16, shape))
