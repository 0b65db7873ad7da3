"""Qwen3.5's fast Gated DeltaNet kernels on the GPU against the NumPy reference
(``openinfer_qwen35.gated_deltanet``, fp32): the chunked tensor-core prefill
(``gdn_chunked.cu``) and the fused conv1d + delta-rule + gated-norm decode step
(``gdn_decode.cu``), at the real head dims (128 / 128), within bf16 tolerance.

Run with ``pytest -m gpu tests/gpu/test_qwen35_kernels.py`` on an H100/H200.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytest.importorskip("openinfer_qwen35")
pytestmark = pytest.mark.gpu

from openinfer_qwen35 import gated_deltanet  # noqa: E402
from openinfer_qwen35.config import Qwen35Config  # noqa: E402
from openinfer_qwen35.state import StepSequences  # noqa: E402
from openinfer_qwen35.weights import DeltaNetWeights  # noqa: E402

from openinfer import bf16_to_float32, float32_to_bf16  # noqa: E402

# the Qwen3.5 GDN head shape with fewer heads: 2 key heads shared by 4 value heads
CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 64,
    "intermediate_size": 64, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
}
NUM_SLOTS = 8


def bf16(x) -> np.ndarray:
    return bf16_to_float32(float32_to_bf16(np.asarray(x, np.float32)))


def device_bf16(x: np.ndarray):
    return cupy.asarray(float32_to_bf16(np.asarray(x, np.float32)))


def host(x) -> np.ndarray:
    return bf16_to_float32(cupy.asnumpy(x))


class Layer:
    """One GDN layer's weights and state slots, on the host (fp32 reference) and the device."""

    def __init__(self, rng: np.random.Generator, fast_decay: bool = False, num_slots: int = NUM_SLOTS):
        self.config = config = Qwen35Config.from_dict(CONFIG)
        nv, width, conv_dim = config.linear_num_value_heads, config.linear_conv_kernel_dim, config.conv_dim
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.features = conv_dim + config.linear_value_dim + 2 * nv
        conv_weight = bf16(0.4 * rng.standard_normal((conv_dim, width)))
        # decay rates as trained models have them: from slow to fast forgetting heads
        high = np.log(16.0) if fast_decay else np.log(2.0)
        neg_rate = -np.exp(rng.uniform(np.log(0.02), high, nv)).astype(np.float32)
        dt_bias = bf16(0.5 * rng.standard_normal(nv))
        norm = bf16(1 + 0.3 * rng.standard_normal(dv))
        self.host_weights = DeltaNetWeights(None, conv_weight, neg_rate, dt_bias, norm, None)
        self.device_weights = DeltaNetWeights(None, device_bf16(conv_weight), cupy.asarray(neg_rate),
                                              cupy.asarray(dt_bias), device_bf16(norm), None)
        self.host_conv = bf16(rng.standard_normal((num_slots, width - 1, conv_dim)))
        self.host_ssm = (0.3 * rng.standard_normal((num_slots, nv, dk, dv))).astype(np.float32)
        self.device_conv = device_bf16(self.host_conv)
        self.device_ssm = cupy.asarray(self.host_ssm)

    def step(self, proj: np.ndarray, lengths: list[int], slots: list[int], fresh: list[bool]):
        """One step on both sides; returns (device output, reference output)."""
        from openinfer_qwen35 import cuda_ops

        query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        seqs = StepSequences(query_start, np.asarray(slots, np.int64), np.asarray(fresh))
        expected = gated_deltanet.delta_net(proj, self.host_weights, self.host_conv, self.host_ssm, seqs,
                                            self.config)
        got = cuda_ops.delta_net(device_bf16(proj), self.device_weights, self.device_conv, self.device_ssm,
                                 cuda_ops.prepare_sequences(seqs), self.config)
        return host(got), expected

    def assert_states_match(self, slots: list[int]) -> None:
        np.testing.assert_array_equal(host(self.device_conv)[slots], self.host_conv[slots])
        ssm = cupy.asnumpy(self.device_ssm)[slots]
        reference = self.host_ssm[slots]
        assert np.abs(ssm - reference).max() <= 0.02 * max(1.0, float(np.abs(reference).max()))


def assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    scale = max(1.0, float(np.abs(expected).max()))
    assert np.isfinite(got).all()
    assert np.abs(got - expected).max() <= 0.05 * scale
    assert np.abs(got - expected).mean() <= 0.006 * scale


FAST_PREFILL_CHOICES = ("split_rows", "blocked", "registers", "fused", "grouped", "grouped_mma", "grouped_conv",
                        "grouped_out", "grouped_staged", "grouped_coalesced", "grouped_f16", "chunked_split",
                        "chunked_split_f16")


@pytest.fixture(params=["chunked", "recurrent", *FAST_PREFILL_CHOICES])
def kernels(request, monkeypatch):
    """Each test on the earlier chunked prefill (OPENINFER_QWEN35_GDN_PREFILL=plain), on the
    token-by-token kernels (the benchmark's baseline), on split_rows (the chunk walk split from
    the output, a mixed step's one-token rows token by token), on blocked (split_rows with the
    triangular solve by 16 x 16 blocks), on the default, registers (blocked with the chunk walk's
    state in mma accumulator registers where a step fills the SMs), on fused (registers with the gated norm
    in the output kernel; a step's one-token rows normed apart) and on grouped (registers with a prepare
    block per chunk and key head), grouped_mma (that with the solve's block products on tensor cores) and
    grouped_conv (that with the conv1d inside the prepare), grouped_out (that with the staged output kernel)
    and the default, grouped_staged (grouped_mma with the staged output kernel), grouped_f16 (that with
    fp16 operands), chunked_split (bf16 hi/mid/lo operand splits: products of about fp32's precision) and
    chunked_split_f16 (fp16 hi / lo parts)."""
    from openinfer_qwen35 import cuda_ops

    if not cupy.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.setenv(cuda_ops.KERNELS_ENV, "recurrent" if request.param == "recurrent" else "chunked")
    monkeypatch.setenv(cuda_ops.PREFILL_ENV,
                       request.param if request.param in FAST_PREFILL_CHOICES else "plain")
    # the grouped prepares as a big step runs them (a block per key head); these steps are small
    monkeypatch.setattr(cuda_ops, "GROUPED_PREPARE_BLOCKS_PER_SM", 0)
    return request.param


def test_chunked_prefill_matches_numpy_across_chunk_boundaries_and_saved_states(kernels):
    rng = np.random.default_rng(0)
    layer = Layer(rng)
    # from scratch: 200 tokens (3 chunks + 8), a one-token prompt, a 64-token prompt, 9 tokens
    lengths, slots, fresh = [200, 1, 64, 9], [3, 1, 4, 2], [True, True, True, True]
    proj = bf16(rng.standard_normal((sum(lengths), layer.features)))
    got, expected = layer.step(proj, lengths, slots, fresh)
    assert_close(got, expected)
    layer.assert_states_match(slots)
    # continuing those states (chunked prefill: the next chunk of each prompt) and two slots
    # restored from elsewhere (a prefix-cache snapshot copied into the slot), mixed with decodes
    lengths, slots, fresh = [130, 1, 70, 1, 65], [3, 1, 4, 2, 6], [False, False, False, False, False]
    proj = bf16(rng.standard_normal((sum(lengths), layer.features)))
    got, expected = layer.step(proj, lengths, slots, fresh)
    assert_close(got, expected)
    layer.assert_states_match(slots)
    untouched = [0, 5, 7]
    np.testing.assert_array_equal(cupy.asnumpy(layer.device_ssm)[untouched], layer.host_ssm[untouched])


def test_a_prompt_split_anywhere_gives_the_one_pass_result(kernels):
    """Chunked prefill cut at a point that is not a chunk boundary (the state carried between
    steps through the slot) equals the prompt in one step, both against the NumPy reference."""
    rng = np.random.default_rng(1)
    one_pass, split = Layer(np.random.default_rng(7)), Layer(np.random.default_rng(7))
    proj = bf16(rng.standard_normal((300, one_pass.features)))
    whole, expected = one_pass.step(proj, [300], [2], [True])
    first, expected_first = split.step(proj[:97], [97], [2], [True])
    second, expected_second = split.step(proj[97:], [203], [2], [False])
    np.testing.assert_allclose(np.concatenate([expected_first, expected_second]), expected, rtol=1e-4, atol=1e-4)
    assert_close(np.concatenate([first, second]), expected)
    assert_close(whole, expected)
    split.assert_states_match([2])
    one_pass.assert_states_match([2])


def test_long_prompt_with_fast_decaying_heads_stays_within_bf16_tolerance(kernels):
    """2,048 tokens through 32 chunks, heads whose in-chunk log-decay reaches hundreds."""
    rng = np.random.default_rng(2)
    layer = Layer(rng, fast_decay=True)
    proj = bf16(rng.standard_normal((2048, layer.features)))
    got, expected = layer.step(proj, [2048], [5], [True])
    assert_close(got, expected)
    layer.assert_states_match([5])


@pytest.mark.parametrize("register_walk", [False, True])
def test_fp16_operands_bring_the_chunked_prefill_to_the_token_by_token_error(monkeypatch, register_walk):
    """Issue #17: the chunked prefill's bf16 operands (q / k normed, W, U, P, S^T, V') put it ~2.5x
    further from HF than the token-by-token kernels (fp32 state, q / k normed in fp32); grouped_f16
    (the same kernels compiled with fp16 operands) is within a fraction of that of them. Two
    1k-token prompts from the same saved states through either state walk (gdn_chunk_states or
    gdn_chunk_states_registers), heads from slow to fast forgetting: each chunked variant's output
    and final states against the token-by-token kernels' (the emulated test's figures at 64 / 64:
    core 0.0031 -> 0.0004, state 0.0027 -> 0.0003)."""
    from openinfer_qwen35 import cuda_ops

    if not cupy.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.setattr(cuda_ops, "GROUPED_PREPARE_BLOCKS_PER_SM", 0)
    monkeypatch.setattr(cuda_ops, "register_walk_fills_gpu", lambda dv, heads: register_walk)
    lengths, slots = [1024, 1024], [0, 1]
    proj = bf16(np.random.default_rng(4).standard_normal((sum(lengths), Layer(np.random.default_rng(3)).features)))
    outs, states = {}, {}
    for choice in ("recurrent", "grouped_staged", "grouped_f16"):
        monkeypatch.setenv(cuda_ops.KERNELS_ENV, "recurrent" if choice == "recurrent" else "chunked")
        monkeypatch.setenv(cuda_ops.PREFILL_ENV, "grouped_staged" if choice == "recurrent" else choice)
        layer = Layer(np.random.default_rng(3), fast_decay=True)  # the same weights and saved states
        got, expected = layer.step(proj, lengths, slots, [False] * len(lengths))
        assert_close(got, expected)
        layer.assert_states_match(slots)
        outs[choice], states[choice] = got, cupy.asnumpy(layer.device_ssm)[slots]

    def relative(a, b):
        return float(np.abs(a - b).mean() / np.abs(b).mean())

    errors = {choice: (relative(outs[choice], outs["recurrent"]), relative(states[choice], states["recurrent"]))
              for choice in ("grouped_staged", "grouped_f16")}
    print(f"relative mean |difference| from the token-by-token kernels (output, final state), register walk "
          f"{register_walk}: {errors}")
    assert errors["grouped_f16"][0] <= 0.5 * errors["grouped_staged"][0]
    assert errors["grouped_f16"][1] <= 0.3 * errors["grouped_staged"][1]


def test_fused_decode_step_matches_numpy_over_many_steps(kernels):
    """64 sequences (fresh and continuing) decoding 12 steps: the fused kernel's conv window
    hand-off between the value heads of a key head, its state and its gated norm."""
    rng = np.random.default_rng(3)
    rows = 64
    layer = Layer(rng, num_slots=rows)
    slots = [int(s) for s in rng.permutation(rows)]
    fresh = [bool(f) for f in rng.integers(0, 2, rows)]
    for step in range(12):
        proj = bf16(rng.standard_normal((rows, layer.features)))
        got, expected = layer.step(proj, [1] * rows, slots, fresh if step == 0 else [False] * rows)
        assert_close(got, expected)
    layer.assert_states_match(slots)


def test_fused_decode_step_replays_in_a_cuda_graph(kernels):
    """Captured once, replayed: the same outputs and states as eager launches of the same step
    (the arrival counters reset themselves, so replays need no memset)."""
    from openinfer_qwen35 import cuda_ops

    rng = np.random.default_rng(4)
    eager, graphed = Layer(np.random.default_rng(9)), Layer(np.random.default_rng(9))
    config = eager.config
    query_start = np.arange(NUM_SLOTS + 1, dtype=np.int64)
    slots = np.arange(NUM_SLOTS, dtype=np.int64)
    seqs = cuda_ops.prepare_sequences(StepSequences(query_start, slots, np.zeros(NUM_SLOTS, bool)))
    decode_seqs = StepSequences(None, seqs.device["slots"], seqs.device["fresh"], device=seqs.device)
    proj = cupy.empty((NUM_SLOTS, eager.features), dtype=cupy.uint16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuda_ops.delta_net(proj, graphed.device_weights, graphed.device_conv, graphed.device_ssm, decode_seqs,
                           config)  # compile and warm outside the capture
        graphed.device_conv[...] = eager.device_conv
        graphed.device_ssm[...] = eager.device_ssm
        stream.begin_capture()
        out = cuda_ops.delta_net(proj, graphed.device_weights, graphed.device_conv, graphed.device_ssm,
                                 decode_seqs, config)
        graph = stream.end_capture()
    stream.synchronize()
    for _ in range(5):
        with stream:
            values = device_bf16(rng.standard_normal((NUM_SLOTS, eager.features)))
            proj[...] = values
            graph.launch(stream)
            expected = cuda_ops.delta_net(values, eager.device_weights, eager.device_conv, eager.device_ssm,
                                          decode_seqs, config)
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(expected))
        np.testing.assert_array_equal(cupy.asnumpy(graphed.device_ssm), cupy.asnumpy(eager.device_ssm))
        np.testing.assert_array_equal(cupy.asnumpy(graphed.device_conv), cupy.asnumpy(eager.device_conv))


@pytest.mark.parametrize(("variant", "reference"), [("early_loads", "plain"), ("coalesced", "plain"), ("bulk", "vec4")])
def test_decode_step_variants_equal_the_plain_kernel_bit_for_bit(monkeypatch, variant, reference):
    """OPENINFER_QWEN35_GDN_DECODE=early_loads (the token's gate inputs, decay parameters, z and
    norm weight read beside the state column) and =coalesced (that, with a column's threads dv
    apart and their partial sums met in shared memory) against plain; =bulk (vec4 with the state
    tile moved by bulk copies through shared memory) against vec4: 200 rows, fresh and continuing,
    over 6 steps give the reference kernel's outputs and states bit for bit, eager and replayed
    from a CUDA graph."""
    from openinfer_qwen35 import cuda_ops

    if not cupy.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.delenv(cuda_ops.KERNELS_ENV, raising=False)
    rows = 200
    plain, early = Layer(np.random.default_rng(5), num_slots=rows), Layer(np.random.default_rng(5), num_slots=rows)
    config = plain.config
    rng = np.random.default_rng(6)
    slots = rng.permutation(rows).astype(np.int64)

    def decode(layer: Layer, proj, seqs, choice: str):
        monkeypatch.setenv(cuda_ops.DECODE_ENV, choice)
        return cuda_ops.delta_net(proj, layer.device_weights, layer.device_conv, layer.device_ssm, seqs, config)

    def assert_same_states() -> None:
        np.testing.assert_array_equal(cupy.asnumpy(early.device_conv), cupy.asnumpy(plain.device_conv))
        np.testing.assert_array_equal(cupy.asnumpy(early.device_ssm), cupy.asnumpy(plain.device_ssm))

    for step in range(6):
        fresh = rng.integers(0, 2, rows).astype(bool) if step == 0 else np.zeros(rows, bool)
        seqs = cuda_ops.prepare_sequences(StepSequences(np.arange(rows + 1, dtype=np.int64), slots, fresh))
        proj = device_bf16(rng.standard_normal((rows, plain.features)))
        want, got = decode(plain, proj, seqs, reference), decode(early, proj, seqs, variant)
        np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(want))
        assert_same_states()
    # captured with the variant, replayed on new inputs: still the plain kernel's bits
    seqs = cuda_ops.prepare_sequences(StepSequences(np.arange(rows + 1, dtype=np.int64), slots, np.zeros(rows, bool)))
    proj = cupy.empty((rows, plain.features), dtype=cupy.uint16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = decode(early, proj, seqs, variant)
        graph = stream.end_capture()
    for _ in range(3):
        with stream:
            proj[...] = device_bf16(rng.standard_normal((rows, plain.features)))
            graph.launch(stream)
            want = decode(plain, proj, seqs, reference)
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(want))
        assert_same_states()


def test_kernels_first_launched_after_warm_up_opt_into_their_shared_memory(monkeypatch):
    """``warm_up`` only compiles ``start_up_kernels``' modules (no kernel handle made, no attribute
    set): a kernel taking more than 48 KiB of dynamic shared memory opts in where it is first
    launched — the bulk decode step (75 KiB) first met inside a CUDA graph capture, the default
    chunked prefill's prepare and walk eagerly — with the eager kernels' results. A build of its
    own (an extra define) makes every function new to this process."""
    from openinfer_qwen35 import cuda_ops

    if not cupy.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    for name in (cuda_ops.KERNELS_ENV, cuda_ops.PREFILL_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cuda_ops.DECODE_ENV, "bulk")
    rows = 8
    captured, eager = Layer(np.random.default_rng(11), num_slots=rows), Layer(np.random.default_rng(11), num_slots=rows)
    config = captured.config
    rng = np.random.default_rng(12)
    with cuda_ops.defines_added(OPENINFER_TEST_BUILD=int(rng.integers(1, 2**30))):
        cuda_ops._bulk_decode_kernel.cache_clear()
        cuda_ops.warm_up(config)
        assert cuda_ops.kernel.cache_info().currsize == 0 and cuda_ops._bulk_decode_kernel.cache_info().currsize == 0
        seqs = cuda_ops.prepare_sequences(StepSequences(np.arange(rows + 1, dtype=np.int64),
                                                        np.arange(rows, dtype=np.int64), np.zeros(rows, bool)))
        proj = cupy.empty((rows, captured.features), dtype=cupy.uint16)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            out = cuda_ops.delta_net(proj, captured.device_weights, captured.device_conv, captured.device_ssm, seqs,
                                     config)
            graph = stream.end_capture()
            proj[...] = device_bf16(rng.standard_normal((rows, captured.features)))
            graph.launch(stream)
            want = cuda_ops.delta_net(proj, eager.device_weights, eager.device_conv, eager.device_ssm, seqs, config)
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(want))
        np.testing.assert_array_equal(cupy.asnumpy(captured.device_ssm), cupy.asnumpy(eager.device_ssm))
        walk = cuda_ops.prefill_kernels(config, captured.features).states
        assert max(cuda_ops.chunked_split_shared_bytes(128, 128, walk)) > 48 * 1024
        prefill = Layer(np.random.default_rng(13), num_slots=3)
        lengths = [200, 77]
        got, expected = prefill.step(bf16(rng.standard_normal((sum(lengths), prefill.features))), lengths, [1, 2],
                                     [True, False])
        assert_close(got, expected)
    cuda_ops._bulk_decode_kernel.cache_clear()


def test_vec4_decode_step_matches_numpy_and_the_plain_kernel(monkeypatch):
    """OPENINFER_QWEN35_GDN_DECODE=vec4 (16-byte state loads and stores, a column's 16 partial sums
    met in another order): 200 rows, fresh and continuing, over 6 steps within bf16 tolerance of
    NumPy, and of the plain kernel's states to fp32 rounding (conv windows bit for bit); replayed
    from a CUDA graph, bit for bit its own eager launches."""
    from openinfer_qwen35 import cuda_ops

    if not cupy.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.delenv(cuda_ops.KERNELS_ENV, raising=False)
    rows = 200
    layers = {name: Layer(np.random.default_rng(7), num_slots=rows) for name in ("plain", "vec4", "replayed")}
    config = layers["plain"].config
    rng = np.random.default_rng(8)
    slots = rng.permutation(rows).astype(np.int64)

    def decode(name: str, proj, seqs, choice: str | None = None):
        monkeypatch.setenv(cuda_ops.DECODE_ENV, choice or name)
        layer = layers[name]
        return cuda_ops.delta_net(proj, layer.device_weights, layer.device_conv, layer.device_ssm, seqs, config)

    for step in range(6):
        fresh = rng.integers(0, 2, rows).astype(bool) if step == 0 else np.zeros(rows, bool)
        proj = bf16(rng.standard_normal((rows, layers["vec4"].features)))
        monkeypatch.setenv(cuda_ops.DECODE_ENV, "vec4")
        assert cuda_ops.decode_kernel(config) == "gdn_decode_step_vec4"
        got, expected = layers["vec4"].step(proj, [1] * rows, slots.tolist(), fresh.tolist())
        assert_close(got, expected)
        seqs = cuda_ops.prepare_sequences(StepSequences(np.arange(rows + 1, dtype=np.int64), slots, fresh))
        decode("plain", device_bf16(proj), seqs)
        decode("replayed", device_bf16(proj), seqs, "vec4")
    layers["vec4"].assert_states_match(slots.tolist())
    np.testing.assert_array_equal(cupy.asnumpy(layers["vec4"].device_conv), cupy.asnumpy(layers["plain"].device_conv))
    np.testing.assert_allclose(cupy.asnumpy(layers["vec4"].device_ssm), cupy.asnumpy(layers["plain"].device_ssm),
                               rtol=1e-4, atol=1e-5)
    # captured with vec4, replayed on new inputs: the eager vec4 launches' bits
    seqs = cuda_ops.prepare_sequences(StepSequences(np.arange(rows + 1, dtype=np.int64), slots, np.zeros(rows, bool)))
    proj = cupy.empty((rows, layers["vec4"].features), dtype=cupy.uint16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = decode("replayed", proj, seqs, "vec4")
        graph = stream.end_capture()
    for _ in range(3):
        with stream:
            proj[...] = device_bf16(rng.standard_normal((rows, layers["vec4"].features)))
            graph.launch(stream)
            want = decode("vec4", proj, seqs)
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(want))
        np.testing.assert_array_equal(cupy.asnumpy(layers["replayed"].device_ssm),
                                      cupy.asnumpy(layers["vec4"].device_ssm))


@pytest.mark.parametrize(("variant", "reference"), [("staged", "plain"), ("split", "plain"), ("registers", "blocked"),
                                                    ("grouped_conv", "grouped_mma"), ("grouped_out", "grouped_conv"),
                                                    ("grouped_staged", "grouped_mma"), ("grouped_coalesced", "grouped_staged")])
def test_prefill_variants_equal_the_plain_kernels_bit_for_bit(monkeypatch, variant, reference):
    """OPENINFER_QWEN35_GDN_PREFILL=staged (gdn_chunk_prepare_staged: every global read of a chunk
    issued first) and =split (that, and the scan split in gdn_chunk_states + gdn_chunk_output)
    against plain; =registers (the walk's state in mma accumulators: the same products with the
    operands swapped, in the same k order) against blocked; =grouped_conv (the conv1d inside the
    prepare, the windows updated after it) against grouped_mma; =grouped_out (the output kernel with
    a block's operands loaded at once) against grouped_conv: prompts from scratch, then continued
    beside decodes, and a 2,048-token prompt of fast-decaying heads give the reference kernels'
    outputs and states bit for bit."""
    from openinfer_qwen35 import cuda_ops

    if not cupy.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.delenv(cuda_ops.KERNELS_ENV, raising=False)
    rng = np.random.default_rng(11)
    for fast_decay, steps in ((False, [([200, 1, 64, 9], [3, 1, 4, 2], True), ([130, 1, 70, 1, 65], [3, 1, 4, 2, 6], False)]),
                              (True, [([2048], [5], True)])):
        plain, staged = Layer(np.random.default_rng(12), fast_decay), Layer(np.random.default_rng(12), fast_decay)
        for lengths, slots, fresh in steps:
            query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            seqs = cuda_ops.prepare_sequences(StepSequences(query_start, np.asarray(slots, np.int64),
                                                            np.full(len(slots), fresh)))
            proj = device_bf16(rng.standard_normal((sum(lengths), plain.features)))
            outs = []
            for layer, choice in ((plain, reference), (staged, variant)):
                monkeypatch.setenv(cuda_ops.PREFILL_ENV, choice)
                outs.append(cupy.asnumpy(cuda_ops.delta_net(proj, layer.device_weights, layer.device_conv,
                                                            layer.device_ssm, seqs, plain.config)))
            np.testing.assert_array_equal(outs[1], outs[0])
            np.testing.assert_array_equal(cupy.asnumpy(staged.device_ssm), cupy.asnumpy(plain.device_ssm))
            np.testing.assert_array_equal(cupy.asnumpy(staged.device_conv), cupy.asnumpy(plain.device_conv))


def test_grouped_prepare_split_over_value_heads_equals_one_block_per_key_head(monkeypatch):
    """A step too small to fill the GPU runs the grouped prepare with a block per value head (grid
    z); a big one with a block per key head: the same outputs and states bit for bit."""
    from openinfer_qwen35 import cuda_ops

    if not cupy.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.delenv(cuda_ops.KERNELS_ENV, raising=False)
    monkeypatch.setenv(cuda_ops.PREFILL_ENV, "grouped_out")
    rng = np.random.default_rng(31)
    layers = {split: Layer(np.random.default_rng(32), fast_decay=True) for split in (False, True)}
    for lengths, slots, fresh in (([200, 1, 64, 9], [3, 1, 4, 2], True), ([130, 1, 70, 1, 65], [3, 1, 4, 2, 6], False)):
        query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        seqs = cuda_ops.prepare_sequences(StepSequences(query_start, np.asarray(slots, np.int64),
                                                        np.full(len(slots), fresh)))
        proj = device_bf16(rng.standard_normal((sum(lengths), layers[False].features)))
        outs = []
        for split, layer in layers.items():
            monkeypatch.setattr(cuda_ops, "GROUPED_PREPARE_BLOCKS_PER_SM", 10**6 if split else 0)
            outs.append(cupy.asnumpy(cuda_ops.delta_net(proj, layer.device_weights, layer.device_conv,
                                                        layer.device_ssm, seqs, layer.config)))
        np.testing.assert_array_equal(outs[1], outs[0])
        np.testing.assert_array_equal(cupy.asnumpy(layers[True].device_ssm), cupy.asnumpy(layers[False].device_ssm))


def test_register_walk_and_its_small_step_fallback_equal_blocked(monkeypatch):
    """=registers: gdn_chunk_states_registers (8 warps a block) where a step's sequences x heads
    fill the SMs, gdn_chunk_states below that: 48 prompts of 70 tokens (the register walk), 24
    continued beside 24 decodes and 2 prompts (the shared-memory walk) give blocked's outputs and
    states bit for bit."""
    from openinfer_qwen35 import cuda_ops

    if not cupy.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.delenv(cuda_ops.KERNELS_ENV, raising=False)
    rng = np.random.default_rng(21)
    nv, dv = CONFIG["linear_num_value_heads"], CONFIG["linear_value_head_dim"]
    wide_sequences = 48
    assert cuda_ops.register_states_warps(dv) == 8
    assert cuda_ops.register_walk_fills_gpu(dv, wide_sequences * nv)
    assert not cuda_ops.register_walk_fills_gpu(dv, 2 * nv)
    blocked, registers = (Layer(np.random.default_rng(22), num_slots=wide_sequences + 1) for _ in range(2))
    slots = np.arange(1, wide_sequences + 1)
    for lengths, fresh in (([70] * wide_sequences, True), ([65] * (wide_sequences // 2) + [1] * (wide_sequences // 2), False),
                           ([130, 70], True)):
        step_slots = slots[: len(lengths)]
        query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        seqs = cuda_ops.prepare_sequences(StepSequences(query_start, step_slots, np.full(len(lengths), fresh)))
        proj = device_bf16(rng.standard_normal((sum(lengths), blocked.features)))
        outs = []
        for layer, choice in ((blocked, "blocked"), (registers, "registers")):
            monkeypatch.setenv(cuda_ops.PREFILL_ENV, choice)
            outs.append(cupy.asnumpy(cuda_ops.delta_net(proj, layer.device_weights, layer.device_conv,
                                                        layer.device_ssm, seqs, blocked.config)))
        np.testing.assert_array_equal(outs[1], outs[0])
        np.testing.assert_array_equal(cupy.asnumpy(registers.device_ssm), cupy.asnumpy(blocked.device_ssm))


def test_vec_row_kernels_match_the_plain_ones(monkeypatch):
    """OPENINFER_QWEN35_ROW_KERNELS=vec (8 features a thread): the attention gate bit for bit, the
    add + zero-centred RMSNorm with the same residual sum and its norm within a bf16 rounding, at
    the 4B width (4,096) and a narrow one (256), from 1 to 300 rows; a gate slice of a wider row."""
    from openinfer_qwen35 import cuda_ops

    if not cupy.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    rng = np.random.default_rng(13)
    for rows, features in ((1, 4096), (64, 4096), (300, 256)):
        x, residual = device_bf16(rng.standard_normal((rows, features))), device_bf16(rng.standard_normal((rows, features)))
        wide = device_bf16(rng.standard_normal((rows, 3 * features)))
        weight = cupy.asarray((1.0 + 0.3 * rng.standard_normal(features)).astype(np.float32))
        results = {}
        for choice in ("plain", "vec"):
            monkeypatch.setenv(cuda_ops.ROW_KERNELS_ENV, choice)
            gated = cuda_ops.sigmoid_mul(x, wide[:, 2 * features :])
            normed, summed = cuda_ops.add_rms_norm(x, residual, weight, 1e-6)
            results[choice] = [cupy.asnumpy(a) for a in (gated, summed)] + [host(normed)]
        np.testing.assert_array_equal(results["vec"][0], results["plain"][0])
        np.testing.assert_array_equal(results["vec"][1], results["plain"][1])
        np.testing.assert_allclose(results["vec"][2], results["plain"][2], rtol=8e-3, atol=1e-6)
