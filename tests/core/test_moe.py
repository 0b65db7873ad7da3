"""MoE routing and expert compute (NumPy reference) against HF DeepseekV3 and first principles."""

import numpy as np
import pytest
import torch

from openinfer import create_backend
from openinfer.errors import WeightLoadError
from openinfer.moe import ExpertWeights, MoEWeights, RouterSpec, group_by_expert, moe_forward, route


def _hf_moe(num_experts=16, top_k=4, n_group=4, topk_group=2, seed=0):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=24, moe_intermediate_size=8, n_routed_experts=num_experts,
                              num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group, n_shared_experts=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(seed)
    moe = DeepseekV3MoE(config).float()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        moe.gate.e_score_correction_bias.copy_(torch.randn(num_experts) * 0.5)
    return config, moe


def _ours_from_hf(config, moe, ops):
    experts = []
    for e in range(config.n_routed_experts):
        experts.append(ExpertWeights(ops.linear_weight(moe.experts.gate_up_proj[e].detach().numpy()),
                                     ops.linear_weight(moe.experts.down_proj[e].detach().numpy())))
    shared = moe.shared_experts
    spec = RouterSpec(config.n_routed_experts, config.num_experts_per_tok, "sigmoid", config.n_group,
                      config.topk_group, "top2_sum", config.norm_topk_prob, config.routed_scaling_factor)
    gate_up = np.concatenate([shared.gate_proj.weight.detach().numpy(), shared.up_proj.weight.detach().numpy()])
    return MoEWeights(spec, moe.gate.weight.detach().numpy(), experts,
                      moe.gate.e_score_correction_bias.detach().numpy(),
                      shared=ExpertWeights(ops.linear_weight(gate_up),
                                           ops.linear_weight(shared.down_proj.weight.detach().numpy())))


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
def test_router_and_moe_match_hf_deepseek_v3(n_group, topk_group):
    config, moe = _hf_moe(n_group=n_group, topk_group=topk_group)
    x = np.random.default_rng(1).standard_normal((37, 24)).astype(np.float32)
    with torch.no_grad():
        _, hf_weights, hf_ids = moe.gate(torch.tensor(x))
        reference = moe(torch.tensor(x)[None])[0].numpy()
    ops = create_backend("cpu")
    layer = _ours_from_hf(config, moe, ops)
    weights, ids = route(x @ layer.gate.T, layer.router, layer.correction_bias)
    order_ours, order_hf = np.argsort(ids, axis=1), np.argsort(hf_ids.numpy(), axis=1)
    assert np.array_equal(np.take_along_axis(ids, order_ours, 1), np.take_along_axis(hf_ids.numpy(), order_hf, 1))
    assert np.allclose(np.take_along_axis(weights, order_ours, 1),
                       np.take_along_axis(hf_weights.numpy(), order_hf, 1), atol=1e-6)
    assert np.abs(moe_forward(ops, x, layer) - reference).max() <= 1e-5


def test_group_limit_keeps_experts_inside_the_chosen_groups():
    spec = RouterSpec(num_experts=8, top_k=2, scoring="sigmoid", num_groups=4, topk_groups=1)
    logits = np.array([[5.0, -5, -5, -5, 4, 4.5, -5, -5]], np.float32)  # group 2 holds the best two-sum
    _, ids = route(logits, spec)
    assert sorted(ids[0].tolist()) == [4, 5]


def test_softmax_sqrtsoftplus_and_hash_routing():
    logits = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    softmax = RouterSpec(6, 2, "softmax", norm_topk_prob=False)
    weights, ids = route(logits, softmax)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    assert np.allclose(np.sort(weights, 1), np.sort(probs, 1)[:, -2:], atol=1e-6)
    v4 = RouterSpec(6, 2, "sqrtsoftplus", routed_scaling_factor=1.5)
    weights, ids = route(logits, v4, correction_bias=np.zeros(6, np.float32))
    scores = np.sqrt(np.log1p(np.exp(logits)))
    assert np.array_equal(np.sort(ids, 1), np.sort(np.argsort(-scores, 1)[:, :2], 1))
    assert np.allclose(weights.sum(1), 1.5, atol=1e-6)
    tid2eid = np.array([[0, 1], [2, 3], [4, 5]])
    weights, ids = route(logits[:3], v4, token_ids=np.array([2, 0, 1]), tid2eid=tid2eid)
    assert ids.tolist() == [[4, 5], [0, 1], [2, 3]]
    chosen = np.take_along_axis(scores[:3], ids, 1)
    assert np.allclose(weights, chosen / chosen.sum(1, keepdims=True) * 1.5, atol=1e-6)


def test_group_by_expert_sorts_slots_stably():
    grouping = group_by_expert(np.array([[3, 0], [0, 2]]), 4)
    assert grouping.order.tolist() == [1, 2, 3, 0]
    assert grouping.offsets.tolist() == [0, 2, 2, 3, 4]
    assert grouping.token_rows.tolist() == [0, 1, 1, 0]
    assert grouping.active_experts().tolist() == [0, 2, 3]


def test_bad_router_configs_name_the_field():
    with pytest.raises(WeightLoadError, match="scoring_func"):
        RouterSpec(8, 2, "tanh")
    with pytest.raises(WeightLoadError, match="n_group"):
        RouterSpec(8, 2, "sigmoid", num_groups=3)
    with pytest.raises(WeightLoadError, match="topk_group"):
        RouterSpec(8, 2, "sigmoid", num_groups=4, topk_groups=5)
