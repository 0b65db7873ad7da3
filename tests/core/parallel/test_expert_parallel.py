"""Expert parallel on the NumPy backend with the fake communicator: the MoE block with its
experts split over 2, 4 and 8 ranks equals the single-rank block (replicated and token-sharded
inputs), and the tiny Kimi-K2 (DeepSeek-V3 architecture) model gives EP=2 and EP=8 logits equal
to EP=1 — through the engine too."""

from __future__ import annotations

import json

import numpy as np
import pytest

from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.errors import ParallelConfigError
from openinfer.moe import ExpertWeights, MoEWeights, RouterSpec, moe_forward
from openinfer.parallel.expert import expert_parallel_moe, expert_parallel_moe_sharded
from openinfer.parallel.fake import run_ranks
from openinfer.parallel.layout import ExpertShard, ParallelLayout
from tests.helpers.engine_utils import make_request, run_all
from tests.helpers.parallel import prefill_then_decode, rank_logits

HIDDEN, INTER, EXPERTS = 16, 12, 8


def random_layer(seed: int = 0) -> MoEWeights:
    rng = np.random.default_rng(seed)
    ops = NumpyBackend()

    def expert(width: int) -> ExpertWeights:
        return ExpertWeights(ops.linear_weight(rng.standard_normal((2 * width, HIDDEN)).astype(np.float32) * 0.3),
                             ops.linear_weight(rng.standard_normal((HIDDEN, width)).astype(np.float32) * 0.3))

    router = RouterSpec(num_experts=EXPERTS, top_k=3, scoring="sigmoid", num_groups=4, topk_groups=2,
                        routed_scaling_factor=2.5)
    return MoEWeights(router=router, gate=rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32),
                      experts=[expert(INTER) for _ in range(EXPERTS)],
                      correction_bias=rng.standard_normal(EXPERTS).astype(np.float32) * 0.1,
                      shared=expert(2 * INTER))


def only_local(layer: MoEWeights, held: slice) -> MoEWeights:
    return MoEWeights(layer.router, layer.gate, [e if held.start <= i < held.stop else None
                                                 for i, e in enumerate(layer.experts)],
                      layer.correction_bias, layer.tid2eid, layer.shared, layer.swiglu_limit)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_replicated_tokens(ep):
    layer, ops = random_layer(), NumpyBackend()
    x = np.random.default_rng(1).standard_normal((11, HIDDEN)).astype(np.float32)
    expected = moe_forward(ops, x, layer)

    def rank(comm):
        held = ExpertShard(comm.rank, ep).experts(EXPERTS)
        return expert_parallel_moe(NumpyBackend(), x, only_local(layer, held), None, comm, held)

    for out in run_ranks(ep, rank):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_token_sharded_all_gather_reduce_scatter():
    """Data-parallel attention's layout: each rank brings its own (uneven) tokens."""
    layer, ops = random_layer(2), NumpyBackend()
    rng = np.random.default_rng(3)
    parts = [rng.standard_normal((n, HIDDEN)).astype(np.float32) for n in (5, 0, 7, 2)]

    def rank(comm):
        held = ExpertShard(comm.rank, 4).experts(EXPERTS)
        return expert_parallel_moe_sharded(NumpyBackend(), parts[comm.rank], only_local(layer, held), None, comm, held)

    for part, out in zip(parts, run_ranks(4, rank), strict=True):
        assert out.shape == part.shape
        if part.shape[0]:
            np.testing.assert_allclose(out, moe_forward(ops, part, layer), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory):
    from tests.helpers.tiny_deepseek_v3 import write_tiny_deepseek_v3

    path, _ = write_tiny_deepseek_v3(tmp_path_factory.mktemp("kimi-ep"), seed=5)
    return path


def kimi_factory(path):
    from openinfer_kimi_k2.plugin import build_model

    from openinfer import EngineOptions

    config = json.loads((path / "config.json").read_text())
    return lambda backend, rank: build_model(path, config, EngineOptions(device="cpu"), backend, rank)


@pytest.mark.parametrize("ep", [2, 8])
def test_kimi_ep_logits_equal_ep1(tiny_kimi, ep):
    """EP=8 on 8 experts: one expert per rank (the full-size Kimi-K2 layout on 8 GPUs, in miniature)."""
    batches = prefill_then_decode([[5, 17, 99, 3, 150, 41, 7], [12, 8, 90]], [61, 122])
    (reference,) = rank_logits(kimi_factory(tiny_kimi), ParallelLayout(), batches)
    ranks = rank_logits(kimi_factory(tiny_kimi), ParallelLayout(expert_parallel_size=ep), batches)
    for rank, logits in enumerate(ranks):
        for step, expected in enumerate(reference):
            np.testing.assert_allclose(logits[step], expected, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}")


def test_kimi_engine_ep2_generates_the_same_tokens(tiny_kimi):
    from openinfer_kimi_k2.plugin import openinfer_create_engine

    from openinfer import EngineOptions

    config = json.loads((tiny_kimi / "config.json").read_text())
    requests = [make_request("a", [5, 17, 99, 3, 150], max_tokens=6), make_request("b", [12, 8], max_tokens=6)]
    outputs = {}
    for ep in (1, 2):
        engine = openinfer_create_engine(str(tiny_kimi), config, EngineOptions(device="cpu", expert_parallel_size=ep,
                                                                               num_kv_blocks=64))
        try:
            outputs[ep] = [o.token_ids for o in run_all(engine, requests)]
        finally:
            engine.close_sync()
    assert outputs[2] == outputs[1] and all(len(t) == 6 for t in outputs[1])


def test_kimi_refuses_ep_beyond_its_experts_and_tensor_parallel(tiny_kimi):
    batches = prefill_then_decode([[5, 6]], [7])
    with pytest.raises(ParallelConfigError, match="exceeds the model's 8 routed experts"):
        rank_logits(kimi_factory(tiny_kimi), ParallelLayout(expert_parallel_size=16), batches)
    with pytest.raises(ParallelConfigError, match="use --expert-parallel-size"):
        rank_logits(kimi_factory(tiny_kimi), ParallelLayout(tensor_parallel_size=2), batches)




@pytest.fixture(scope="module")
def tiny_dsv4(tmp_path_factory):
    from tests.plugins.deepseek_v4.dsv4_helpers import make_hf_model, save_hf

    hf, config = make_hf_model(seed=7)
    return save_hf(hf, config, tmp_path_factory.mktemp("dsv4-ep"))


def dsv4_factory(path):
    from openinfer_deepseek_v4.plugin import build_model

    from openinfer import EngineOptions

    config = json.loads((path / "config.json").read_text())
    return lambda backend, rank: build_model(path, config, backend, EngineOptions(device="cpu"), rank)


def test_deepseek_v4_ep2_logits_equal_ep1(tiny_dsv4):
    """Hash-routed and biased-top-k layers, clamped SwiGLU, shared expert on rank 0 only."""
    from openinfer_deepseek_v4.plugin import openinfer_create_engine

    from openinfer import EngineOptions

    batches = prefill_then_decode([[5, 17, 99, 3, 120, 41, 7, 9, 11, 13], [12, 8, 90]], [61, 122])
    (reference,) = rank_logits(dsv4_factory(tiny_dsv4), ParallelLayout(), batches)
    for rank, logits in enumerate(rank_logits(dsv4_factory(tiny_dsv4), ParallelLayout(expert_parallel_size=2),
                                              batches)):
        for step, expected in enumerate(reference):
            np.testing.assert_allclose(logits[step], expected, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}")
    config = json.loads((tiny_dsv4 / "config.json").read_text())
    requests = [make_request("a", list(range(3, 40)), max_tokens=5), make_request("b", [12, 8], max_tokens=5)]
    outputs = {}
    for ep in (1, 2):
        engine = openinfer_create_engine(str(tiny_dsv4), config, EngineOptions(device="cpu", expert_parallel_size=ep))
        try:
            outputs[ep] = [o.token_ids for o in run_all(engine, requests)]
        finally:
            engine.close_sync()
    assert outputs[2] == outputs[1]


def test_deepseek_v4_dummy_load_format_ep2_equals_ep1(tmp_path):
    """``--load-format dummy`` serves DeepSeek-V4 from config.json alone (the Flash benchmark's
    path); EP=2 generates EP=1's tokens, and the routed experts a cuda rank would stack come as
    packed FP4 codes with e8m0 scales that decode to small weights."""
    from openinfer_deepseek_v4.config import DeepseekV4Config
    from openinfer_deepseek_v4.dummy import DummyDeepseekV4Checkpoint

    import openinfer
    from openinfer.quant import dequantize_fp4_e2m1
    from tests.plugins.deepseek_v4.dsv4_helpers import TINY_DSV4

    (tmp_path / "config.json").write_text(json.dumps(TINY_DSV4))
    requests = [make_request("a", list(range(3, 30)), max_tokens=5), make_request("b", [12, 8], max_tokens=5)]
    outputs = {}
    for ep in (1, 2):
        engine = openinfer.create_engine(tmp_path, device="cpu", load_format="dummy", expert_parallel_size=ep,
                                         max_model_len=256)
        try:
            outputs[ep] = [o.token_ids for o in run_all(engine, requests)]
        finally:
            engine.close_sync()
    assert outputs[2] == outputs[1] and all(len(t) == 5 for t in outputs[1])
    config = DeepseekV4Config.from_dict(TINY_DSV4)
    kind, codes, scales = DummyDeepseekV4Checkpoint(config).stored_quantized("layers.1.ffn.experts.3.w2")
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    assert kind == "fp4" and codes.shape == (hidden, inter // 2) and scales.shape == (hidden, inter // 32)
    values = dequantize_fp4_e2m1(codes, scales)
    assert values.shape == (hidden, inter) and 0 < np.abs(values).max() <= 6 * 2.0**-8
    assert DummyDeepseekV4Checkpoint(config).stored_quantized("layers.1.attn.wq_a") is None
