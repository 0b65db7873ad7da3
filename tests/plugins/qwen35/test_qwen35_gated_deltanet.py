"""The NumPy Gated DeltaNet pieces against HF's torch reference functions, and against each
other (chunked = recurrent, any split of a sequence = one pass)."""

import numpy as np
import pytest
import torch
from openinfer_qwen35 import gated_deltanet as gdn
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

NK, NV, DK, DV = 2, 6, 16, 8


def random_inputs(length: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((length, NK, DK)).astype(np.float32)
    k = rng.standard_normal((length, NK, DK)).astype(np.float32)
    v = rng.standard_normal((length, NV, DV)).astype(np.float32)
    g = -rng.uniform(0.0, 3.0, (length, NV)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (length, NV)).astype(np.float32)
    state = rng.standard_normal((NV, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, state


def prepared(q, k):
    """What the model feeds the delta rule: l2-normalised q (scaled) and k, repeated to NV heads."""
    repeat = NV // NK
    q = np.repeat(gdn.l2_normalize(q), repeat, axis=1) * np.float32(DK**-0.5)
    return q, np.repeat(gdn.l2_normalize(k), repeat, axis=1)


@pytest.mark.parametrize("length", [1, 63, 64, 150])
def test_chunked_delta_rule_matches_hf(length):
    q, k, v, g, beta, state = random_inputs(length)
    t = torch.from_numpy
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(
        t(q)[None], t(k)[None], t(v)[None], t(g)[None], t(beta)[None], initial_state=t(state)[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, new_state = gdn.chunk_gated_delta_rule(*prepared(q, k), v, g, beta, state)
    assert np.abs(out - ref_out[0].numpy()).max() < 1e-5
    assert np.abs(new_state - ref_state[0].numpy()).max() < 1e-5


def test_recurrent_step_matches_hf_and_the_chunked_form():
    q, k, v, g, beta, state = random_inputs(70, seed=1)
    t = torch.from_numpy
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
        t(q)[None], t(k)[None], t(v)[None], t(g)[None], t(beta)[None], initial_state=t(state)[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = prepared(q, k)
    running, outs = state[None], []
    for i in range(len(q)):  # a batch of one sequence, one token at a time
        out, running = gdn.recurrent_gated_delta_rule_step(qn[i][None], kn[i][None], v[i][None], g[i][None],
                                                           beta[i][None], running)
        outs.append(out[0])
    assert np.abs(np.stack(outs) - ref_out[0].numpy()).max() < 1e-5
    assert np.abs(running[0] - ref_state[0].numpy()).max() < 1e-5
    chunk_out, chunk_state = gdn.chunk_gated_delta_rule(qn, kn, v, g, beta, state)
    assert np.abs(np.stack(outs) - chunk_out).max() < 1e-5
    assert np.abs(running[0] - chunk_state).max() < 1e-5


@pytest.mark.parametrize("splits", [(1,), (17, 64), (63, 65, 66), (5, 6, 7, 100)])
def test_chunked_delta_rule_carries_state_across_any_split(splits):
    q, k, v, g, beta, state = random_inputs(131, seed=2)
    qn, kn = prepared(q, k)
    whole, whole_state = gdn.chunk_gated_delta_rule(qn, kn, v, g, beta, state)
    pieces, running = [], state
    for start, end in zip((0, *splits), (*splits, len(q)), strict=True):
        out, running = gdn.chunk_gated_delta_rule(qn[start:end], kn[start:end], v[start:end], g[start:end],
                                                  beta[start:end], running)
        pieces.append(out)
    assert np.abs(np.concatenate(pieces) - whole).max() < 1e-5
    assert np.abs(running - whole_state).max() < 1e-5


def test_causal_conv1d_matches_hf_with_and_without_state():
    rng = np.random.default_rng(3)
    channels, width = 10, 4
    x = rng.standard_normal((23, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, width)).astype(np.float32)
    t = torch.from_numpy
    reference = hf.causal_conv1d_fn(t(x.T.copy())[None], t(weight), None, activation="silu")[0].numpy().T
    zero = np.zeros((width - 1, channels), np.float32)
    out, state = gdn.causal_conv1d(x, weight, zero)
    assert np.abs(out - reference).max() < 1e-6
    np.testing.assert_array_equal(state, x[-(width - 1):])
    # the same sequence as a prefix, a decode step per token, and a tail chunk
    first, state = gdn.causal_conv1d(x[:9], weight, zero)
    steps = []
    for i in range(9, 15):
        step, state_batch = gdn.causal_conv1d_step(x[i][None], weight, state[None])
        steps.append(step[0])
        state = state_batch[0]
    tail, _ = gdn.causal_conv1d(x[15:], weight, state)
    assert np.abs(np.concatenate([first, np.stack(steps), tail]) - reference).max() < 1e-6


def test_gated_rms_norm_matches_hf():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((12, DV)).astype(np.float32)
    z = rng.standard_normal((12, DV)).astype(np.float32)
    norm = hf.Qwen3_5RMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(rng.standard_normal(DV).astype(np.float32)))
        reference = norm(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    ours = gdn.gated_rms_norm(x, z, norm.weight.detach().numpy(), 1e-6)
    assert np.abs(ours - reference).max() < 1e-6
