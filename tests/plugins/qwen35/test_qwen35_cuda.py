"""Qwen3.5 on the cuda backend (run on an H100/H200 with ``pytest -m gpu tests/plugins/qwen35``).

Every cuda op against the NumPy op on the same bf16-rounded inputs; the whole model against
HF transformers in bf16 on the same GPU, teacher-forced (on HF's top token at every position:
mean |Δlogprob| <= 0.06, p99 <= 0.20, the Qwen3 thresholds); greedy tokens through the engine
equal HF's until the first near-tie; state slots come back after every request. Decode steps
replay CUDA graphs that read the state slots from the batch: bit-identical to eager launches of
the same padded inputs; a request alone equals itself among 63 others (until a near-tie of its
own logits); a prefix-cache hit (KV blocks + restored state snapshot) equals the cold run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.engine_utils import make_request, run_all, run_one
from tests.plugins.qwen35.qwen35_helpers import TINY_QWEN35, Driver, make_hf_model, write_text_checkpoint

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

# head_dim 64 (the cuda attention kernels take 32/64/128/256); real GDN head dims (128).
GPU_CONFIG = {**TINY_QWEN35, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 4, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "max_position_embeddings": 1024}
NEAR_TIE = 0.1


def bf16_round(x: np.ndarray) -> np.ndarray:
    from openinfer import bf16_to_float32, float32_to_bf16

    return bf16_to_float32(float32_to_bf16(np.asarray(x, np.float32)))


def to_device_bf16(x: np.ndarray):
    from openinfer import float32_to_bf16

    return cupy.asarray(float32_to_bf16(np.asarray(x, np.float32)))


def to_host(x) -> np.ndarray:
    from openinfer import bf16_to_float32

    return bf16_to_float32(cupy.asnumpy(x))


@pytest.fixture(scope="module")
def backend():
    from openinfer import create_backend

    return create_backend("cuda")


@pytest.mark.parametrize("key_dim, value_dim, prefill", [(128, 128, ""), (12, 8, ""), (128, 128, "chunked_split"),
                                                          (64, 64, "chunked_split"), (64, 64, "chunked_split_f16")])
def test_delta_net_matches_numpy_on_a_mixed_batch(backend, key_dim, value_dim, prefill, monkeypatch):
    from openinfer_qwen35 import cuda_ops, gated_deltanet
    from openinfer_qwen35.config import Qwen35Config
    from openinfer_qwen35.state import StepSequences
    from openinfer_qwen35.weights import DeltaNetWeights

    if prefill:
        monkeypatch.setenv("OPENINFER_QWEN35_GDN_PREFILL", prefill)
    config = Qwen35Config.from_dict({**TINY_QWEN35, "linear_key_head_dim": key_dim,
                                     "linear_value_head_dim": value_dim})
    rng = np.random.default_rng(0)
    nv, width, conv_dim = config.linear_num_value_heads, config.linear_conv_kernel_dim, config.conv_dim
    # prefill from scratch, a decode, a continued chunk, a one-token prompt
    lengths, fresh = [70, 1, 20, 1], np.array([True, False, False, True])
    query_start = np.concatenate([[0], np.cumsum(lengths)])
    slots = np.array([3, 1, 4, 2])
    proj = bf16_round(rng.standard_normal((query_start[-1], conv_dim + config.linear_value_dim + 2 * nv)))
    conv_state = bf16_round(rng.standard_normal((5, width - 1, conv_dim)))
    ssm_state = (0.3 * rng.standard_normal((5, nv, key_dim, value_dim))).astype(np.float32)
    conv_weight = bf16_round(0.4 * rng.standard_normal((conv_dim, width)))
    neg_rate = -np.exp(rng.uniform(np.log(0.05), np.log(2.0), nv)).astype(np.float32)
    dt_bias = bf16_round(0.5 * rng.standard_normal(nv))
    norm = bf16_round(1 + 0.3 * rng.standard_normal(value_dim))
    seqs = StepSequences(query_start, slots, fresh)

    host_w = DeltaNetWeights(None, conv_weight, neg_rate, dt_bias, norm, None)
    host_conv, host_ssm = conv_state.copy(), ssm_state.copy()
    expected = gated_deltanet.delta_net(proj, host_w, host_conv, host_ssm, seqs, config)

    device_w = DeltaNetWeights(None, to_device_bf16(conv_weight), cupy.asarray(neg_rate), cupy.asarray(dt_bias),
                               to_device_bf16(norm), None)
    device_conv, device_ssm = to_device_bf16(conv_state), cupy.asarray(ssm_state)
    got = to_host(cuda_ops.delta_net(to_device_bf16(proj), device_w, device_conv, device_ssm,
                                     cuda_ops.prepare_sequences(seqs), config))
    scale = max(1.0, float(np.abs(expected).max()))
    assert np.abs(got - expected).max() <= 0.05 * scale
    assert np.abs(got - expected).mean() <= 0.01 * scale
    np.testing.assert_allclose(to_host(device_conv)[slots], host_conv[slots], atol=1e-6)
    ssm = cupy.asnumpy(device_ssm)
    assert np.abs(ssm[slots] - host_ssm[slots]).max() <= 0.03 * max(1.0, float(np.abs(host_ssm[slots]).max()))
    np.testing.assert_array_equal(ssm[0], ssm_state[0])  # the null slot is never touched


@pytest.mark.parametrize("prefill", ["chunked_fp32", "chunked_split", "chunked_split_f16"])
def test_fp32_chunked_prefill_matches_the_token_by_token_kernels(backend, monkeypatch, prefill):
    """Issue #17: OPENINFER_QWEN35_GDN_PREFILL=chunked_fp32 (gdn_chunked_fp32.cu) and =chunked_split
    (gdn_chunked_split.cu: tensor cores, split operands; =chunked_split_f16 its walk on fp16 parts) against the
    token-by-token kernels (OPENINFER_QWEN35_GDN_KERNELS=recurrent) on the same ragged mixed step (a prompt from scratch, a decode,
    a continued chunk, a one-token prompt, prompts of exactly one and two chunks; the 4B head dims): the same
    gated-normed bf16 rows nearly everywhere (fp32 sums in another order), states to fp32 rounding, the null
    slot untouched."""
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.config import Qwen35Config
    from openinfer_qwen35.state import StepSequences
    from openinfer_qwen35.weights import DeltaNetWeights

    config = Qwen35Config.from_dict({**TINY_QWEN35, "linear_key_head_dim": 128, "linear_value_head_dim": 128})
    rng = np.random.default_rng(3)
    nv, width, conv_dim = config.linear_num_value_heads, config.linear_conv_kernel_dim, config.conv_dim
    lengths, fresh = [200, 1, 90, 1, 64, 128], np.array([True, False, False, True, True, False])
    query_start = np.concatenate([[0], np.cumsum(lengths)])
    slots = np.array([3, 1, 4, 2, 6, 5])
    proj = bf16_round(rng.standard_normal((query_start[-1], conv_dim + config.linear_value_dim + 2 * nv)))
    conv_state = bf16_round(rng.standard_normal((7, width - 1, conv_dim)))
    ssm_state = (0.3 * rng.standard_normal((7, nv, 128, 128))).astype(np.float32)
    weights = DeltaNetWeights(None, to_device_bf16(0.4 * rng.standard_normal((conv_dim, width))),
                              cupy.asarray(-np.exp(rng.uniform(np.log(0.05), np.log(2.0), nv)).astype(np.float32)),
                              cupy.asarray(bf16_round(0.5 * rng.standard_normal(nv))),
                              to_device_bf16(1 + 0.3 * rng.standard_normal(128)), None)
    results = {}
    for name, environment in (("chunked", {"OPENINFER_QWEN35_GDN_PREFILL": prefill}),
                              ("recurrent", {"OPENINFER_QWEN35_GDN_KERNELS": "recurrent"})):
        for variable in ("OPENINFER_QWEN35_GDN_PREFILL", "OPENINFER_QWEN35_GDN_KERNELS"):
            monkeypatch.delenv(variable, raising=False)
        for variable, value in environment.items():
            monkeypatch.setenv(variable, value)
        device_ssm = cupy.asarray(ssm_state)
        out = cuda_ops.delta_net(to_device_bf16(proj), weights, to_device_bf16(conv_state), device_ssm,
                                 cuda_ops.prepare_sequences(StepSequences(query_start, slots, fresh)), config)
        results[name] = (to_host(out), cupy.asnumpy(device_ssm))
    (ours, our_ssm), (base, base_ssm) = results["chunked"], results["recurrent"]
    differs, relative = float((ours != base).mean()), float(np.abs(ours - base).mean() / np.abs(base).mean())
    print(f"{prefill} vs token-by-token: {differs:.4f} of the bf16 outputs differ, relative {relative:.2e}")
    assert differs < 0.01
    assert relative < 1e-4
    np.testing.assert_allclose(our_ssm[slots], base_ssm[slots], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(our_ssm[0], ssm_state[0])


def test_sigmoid_mul_matches_numpy_with_a_column_slice_gate(backend):
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.kernel_plan import sigmoid_mul

    rng = np.random.default_rng(1)
    x = bf16_round(rng.standard_normal((7, 64)))
    wide = bf16_round(rng.standard_normal((7, 192)))
    got = to_host(cuda_ops.sigmoid_mul(to_device_bf16(x), to_device_bf16(wide)[:, 128:]))
    np.testing.assert_allclose(got, sigmoid_mul(x, wide[:, 128:]), rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU for the HF bf16 reference")
    hf, config = make_hf_model(seed=21, base=GPU_CONFIG)
    path = write_text_checkpoint(tmp_path_factory.mktemp("qwen35-gpu"), hf.to(torch.bfloat16), config)
    return path, hf.cuda().eval()


def cuda_model(path):
    from openinfer_qwen35.plugin import build_model

    from openinfer import EngineOptions, create_backend

    config = json.loads((path / "config.json").read_text())
    return build_model(path, config, create_backend("cuda"), EngineOptions(device="cuda", max_model_len=512,
                                                                           max_num_seqs=64))


def test_teacher_forced_logprobs_match_hf_bf16(gpu_checkpoint):
    from openinfer.sampling import log_softmax

    path, hf = gpu_checkpoint
    model = cuda_model(path)
    rng = np.random.default_rng(1)
    diffs = []
    driver = Driver(model, num_blocks=256)
    for i in range(12):
        tokens = rng.integers(3, GPU_CONFIG["vocab_size"], size=int(rng.integers(70, 200))).tolist()
        ours = driver.step({f"s{i}": tokens}, all_rows=True)[0]
        driver.release(f"s{i}")
        with torch.no_grad():
            reference = hf(torch.tensor([tokens], device="cuda")).logits[0].float().cpu().numpy()
        top = np.argmax(reference, axis=-1)
        rows = np.arange(len(tokens))
        diffs.append(np.abs(log_softmax(ours)[rows, top] - log_softmax(reference)[rows, top]))
    diffs = np.concatenate(diffs)
    mean, p99 = float(diffs.mean()), float(np.percentile(diffs, 99))
    print(f"qwen35 teacher-forced |dlogprob| over {diffs.size} positions: mean {mean:.4f}, p99 {p99:.4f}")
    assert mean <= 0.06 and p99 <= 0.20


def test_engine_greedy_matches_hf_until_near_tie_and_frees_slots(gpu_checkpoint):
    from openinfer_qwen35 import plugin

    from openinfer import EngineOptions

    path, hf = gpu_checkpoint
    config = json.loads((path / "config.json").read_text())
    engine = plugin.openinfer_create_engine(str(path), config, EngineOptions(
        device="cuda", max_model_len=512, max_num_seqs=16, num_kv_blocks=512, max_num_batched_tokens=96))
    rng = np.random.default_rng(2)
    batch = [rng.integers(3, GPU_CONFIG["vocab_size"], size=int(rng.integers(70, 120))).tolist() for _ in range(4)]
    try:
        outcomes = run_all(engine, [make_request(f"r{i}", p, max_tokens=24) for i, p in enumerate(batch)])
        assert engine.state_slots.num_used_slots == engine.kv.num_snapshots  # no live slot left
    finally:
        engine.close_sync()
    for prompt, outcome in zip(batch, outcomes, strict=True):
        with torch.no_grad():
            generated = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=0, output_scores=True,
                                    return_dict_in_generate=True)
        expected = generated.sequences[0, len(prompt):].tolist()
        for step, (ours, theirs) in enumerate(zip(outcome.token_ids, expected, strict=True)):
            if ours != theirs:
                top2 = torch.topk(generated.scores[step][0].float(), 2).values
                assert float(top2[0] - top2[1]) < NEAR_TIE, f"step {step} differs from HF away from a near-tie"
                break


def near_tie(top: float, gap: float) -> bool:
    """Two bf16 logits this close are a tie within bf16 resolution (as in tests/gpu)."""
    ulp = 2.0 ** (np.floor(np.log2(max(abs(top), 1e-3))) - 7)
    return gap <= max(0.1, 4 * ulp)


def first_real_divergence(ours: list[int], reference) -> int | None:
    """The first step where ``ours`` leaves ``reference``'s tokens although its top-2 gap
    (from 2 logprobs per step) was clear."""
    for step, (a, b) in enumerate(zip(ours, reference.token_ids, strict=True)):
        if a != b:
            top = reference.logprobs[step].top
            return None if near_tie(top[0].logprob, top[0].logprob - top[1].logprob) else step
    return None


def cuda_engine(path, **options):
    from openinfer_qwen35 import plugin

    from openinfer import EngineOptions

    config = json.loads((path / "config.json").read_text())
    defaults = dict(device="cuda", max_model_len=512, max_num_seqs=64, num_kv_blocks=2048, max_num_batched_tokens=512)
    return plugin.openinfer_create_engine(str(path), config, EngineOptions(**{**defaults, **options}))


def test_graph_replay_is_bit_identical_to_eager(gpu_checkpoint):
    from openinfer.graph import CudaGraphRunner

    path, _ = gpu_checkpoint
    model = cuda_model(path)
    backend = model.backend
    driver = Driver(model, num_blocks=256, num_slots=16)
    runner = CudaGraphRunner(backend, lambda batch: model.forward(batch, driver.kv_cache), max_num_seqs=8,
                             max_blocks_per_seq=16, buckets=(1, 2, 4, 8), with_state=True)
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    states = [cache for cache in driver.kv_cache if not hasattr(cache, "k")]
    rng = np.random.default_rng(3)
    names = [f"g{i}" for i in range(6)]
    for name in names:  # prefill (eager), one request at a time
        driver.step({name: rng.integers(3, GPU_CONFIG["vocab_size"], size=int(rng.integers(20, 120))).tolist()})
    for live in (names, names[:3], names[1:2], names):
        batch, _ = driver.batch({n: [int(rng.integers(3, GPU_CONFIG["vocab_size"]))] for n in live})
        assert runner.bucket_for(batch) is not None
        before = [{k: t.copy() for k, t in layer.tensors.items()} for layer in states]
        replayed = backend.to_host(runner.run(batch)).copy()
        after_replay = [{k: cupy.asnumpy(t) for k, t in layer.tensors.items()} for layer in states]
        for layer, saved in zip(states, before, strict=True):  # rewind the state, then run eagerly
            for k, t in saved.items():
                layer.tensors[k][...] = t
        eager = backend.to_host(runner.run_padded_eager(batch))
        assert np.isfinite(replayed).all()
        assert np.array_equal(replayed, eager), f"graph and eager logits differ for {len(live)} sequences"
        for layer, want in zip(states, after_replay, strict=True):
            for k, t in want.items():
                assert np.array_equal(cupy.asnumpy(layer.tensors[k]), t), f"state {k} differs after replay"


def test_request_alone_equals_itself_among_63_others_with_slot_reuse(gpu_checkpoint):
    path, _ = gpu_checkpoint
    rng = np.random.default_rng(4)
    batch = [rng.integers(3, GPU_CONFIG["vocab_size"], size=int(rng.integers(40, 120))).tolist() for _ in range(64)]
    engine = cuda_engine(path, enable_prefix_cache=False)
    try:
        assert engine.runner.graphs  # decode replays graphs
        alone = run_one(engine, make_request("alone", batch[0], max_tokens=16, logprobs=2))
        for wave in range(2):  # every slot retires and is admitted again
            together = run_all(engine, [make_request(f"w{wave}-{i}", p, max_tokens=16, logprobs=2)
                                        for i, p in enumerate(batch)])
            step = first_real_divergence(together[0].token_ids, alone)
            assert step is None, f"wave {wave}: among 63 others differs from alone at step {step}"
            assert engine.state_slots.num_used_slots == 0
        again = run_one(engine, make_request("again", batch[0], max_tokens=16, logprobs=2))
        assert again.token_ids == alone.token_ids
    finally:
        engine.close_sync()


def test_prefix_cache_hit_equals_cold_run(gpu_checkpoint):
    path, _ = gpu_checkpoint
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, GPU_CONFIG["vocab_size"], size=150).tolist()
    engine = cuda_engine(path)
    try:
        first = run_one(engine, make_request("first", prompt, max_tokens=24, logprobs=2))
        hit = run_one(engine, make_request("hit", prompt, max_tokens=24, logprobs=2))
        turn = prompt + first.token_ids[:20] + [5, 6, 7, 8]  # a second turn over the first's history
        second_turn = run_one(engine, make_request("turn", turn, max_tokens=16, logprobs=2))
        assert engine.kv.num_snapshots >= 2
    finally:
        engine.close_sync()
    cold_engine = cuda_engine(path, enable_prefix_cache=False)
    try:
        cold = run_one(cold_engine, make_request("cold", prompt, max_tokens=24, logprobs=2))
        cold_turn = run_one(cold_engine, make_request("cold-turn", turn, max_tokens=16, logprobs=2))
    finally:
        cold_engine.close_sync()
    print(f"qwen35 prefix: first {first.token_ids}, hit {hit.token_ids}, cold {cold.token_ids}; "
          f"turn {second_turn.token_ids} (cached {second_turn.cached_tokens}), cold turn {cold_turn.token_ids}")
    assert first.cached_tokens == 0 and hit.cached_tokens == 144
    # the hit computes the same last chunk after the same restored state as the first run: identical
    assert hit.token_ids == first.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(hit.logprobs, first.logprobs, strict=True)) <= 1e-3
    assert first_real_divergence(hit.token_ids, cold) is None
    # the second turn starts from the snapshot the first run's decode took at 160 tokens
    assert second_turn.cached_tokens == 160
    assert first_real_divergence(second_turn.token_ids, cold_turn) is None
