"""The NumPy model equals HF DeepseekV4ForCausalLM (fp32) on tiny random checkpoints: prefill over
140 tokens (35 CSA windows with a real top-k, one HCA window, a ragged tail, the sliding window
passed many times), chunked prefill split anywhere, batching, and 32 greedy decode tokens."""

import numpy as np
import pytest

from tests.plugins.deepseek_v4.conftest import prompt
from tests.plugins.deepseek_v4.dsv4_helpers import hf_greedy, hf_logits, load_model, run_chunks

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny[0])


@pytest.fixture(scope="module")
def reference(tiny):
    _, hf = tiny
    ids = prompt()
    return ids, hf_logits(hf, ids)


def test_prefill_equals_hf(model, reference):
    ids, expected = reference
    got = run_chunks(model, [("one-shot", ids, 0)])
    assert np.abs(got - expected).max() <= TOLERANCE
    assert expected.std() > 0.5  # the logits really vary


def test_the_tiny_config_exercises_every_branch(model, reference):
    """Clamped SwiGLU, a top-k that really drops entries, HCA entries, a wrapped sliding window."""
    from openinfer_deepseek_v4 import moe

    ids, _ = reference
    clamped = []
    original = moe.expert_forward

    def spy(ops, x, w, limit):
        clamped.append(np.abs(ops.linear(x, w.w3)).max() > limit)
        return original(ops, x, w, limit)

    moe.expert_forward = spy
    try:
        run_chunks(model, [("branches", ids, 0)])
    finally:
        moe.expert_forward = original
    assert any(clamped)
    state = model.states.get("branches")
    c = model.config
    assert state.layers[1].compressor.num_entries == 35 > c.index_topk
    assert state.layers[2].compressor.num_entries == 1  # HCA: one window of 128
    assert state.layers[0].window.shape[0] == c.sliding_window - 1
    assert state.layers[2].compressor.pending_kv.shape[0] == 140 - 128


@pytest.mark.parametrize("splits", [(1, 37, 91), (4, 8, 12, 128, 129), (3, 70, 139), tuple(range(5, 140, 9))])
def test_chunked_prefill_split_anywhere_equals_one_shot(model, reference, splits):
    ids, expected = reference
    bounds = [0, *splits, len(ids)]
    rid = f"chunks-{splits}"
    got = np.concatenate([run_chunks(model, [(rid, ids[a:b], a)]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    assert np.abs(got - expected).max() <= TOLERANCE


def test_batching_is_invisible(model, tiny, reference):
    """Sequences at different stages in one forward: each equals its own HF run."""
    _, hf = tiny
    ids, expected = reference
    other = prompt(75, seed=1)
    run_chunks(model, [("b0", ids[:50], 0)])
    got = run_chunks(model, [("b1", other, 0), ("b0", ids[50:], 50), ("b2", ids[:9], 0)])
    assert np.abs(got[:75] - hf_logits(hf, other)).max() <= TOLERANCE
    assert np.abs(got[75:165] - expected[50:]).max() <= TOLERANCE
    assert np.abs(got[165:] - expected[:9]).max() <= TOLERANCE


def test_greedy_decode_equals_hf_across_window_boundaries(model, tiny):
    _, hf = tiny
    ids = prompt(125, seed=2)  # decode crosses the first HCA window (128) and many CSA windows
    expected = hf_greedy(hf, ids, 32)
    logits = run_chunks(model, [("greedy", ids, 0)])
    tokens = []
    for position in range(len(ids), len(ids) + 32):
        tokens.append(int(logits[-1].argmax()))
        logits = run_chunks(model, [("greedy", [tokens[-1]], position)])
    assert tokens == expected
    assert model.states.get("greedy").layers[2].compressor.num_entries == 1


def test_5x_config_with_several_hca_windows_equals_hf(tiny_5x):
    path, hf = tiny_5x
    ids = prompt(90, seed=5)
    model = load_model(path)
    assert np.abs(run_chunks(model, [("x", ids, 0)]) - hf_logits(hf, ids)).max() <= TOLERANCE
    assert model.states.get("x").layers[0].compressor.num_entries == 90 // 16
