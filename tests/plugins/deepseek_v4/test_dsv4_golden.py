"""The NumPy model equals HF DeepseekV4ForCausalLM (fp32) on tiny random checkpoints: prefill over
140 tokens (35 CSA windows with a real top-k, one HCA window, a ragged tail, the sliding window
passed many times), chunked prefill split anywhere, batching, and 32 greedy decode tokens."""

import numpy as np
import pytest

from tests.plugins.deepseek_v4.conftest import prompt
from tests.plugins.deepseek_v4.dsv4_helpers import hf_greedy, hf_logits, load_runner, run_chunks

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tiny):
    return load_runner(tiny[0])


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
    """Clamped SwiGLU, an indexer top-k that really drops visible entries, HCA entries."""
    from openinfer_deepseek_v4 import attention

    from openinfer import moe

    ids, _ = reference
    clamped, dropped, hca_entries = [], [], []
    swiglu, index_select, compress = moe.swiglu, attention.index_select, attention.compress

    def spy_swiglu(gate_up, limit=None):
        clamped.append(np.abs(gate_up[:, gate_up.shape[1] // 2:]).max() > limit)
        return swiglu(gate_up, limit)

    def spy_index(ops, x, qr, positions, w, cache, rope, eps):
        chosen = index_select(ops, x, qr, positions, w, cache, rope, eps)
        visible = (positions + 1) // w.compressor.ratio
        dropped.append(bool(np.any(chosen.sum(axis=1) < np.minimum(visible, chosen.shape[1]))))
        return chosen

    def spy_compress(ops, x, w, window, first, rope, eps):
        entries, after = compress(ops, x, w, window, first, rope, eps)
        if w.ratio == 128:
            hca_entries.append(entries.shape[0])
        return entries, after

    moe.swiglu, attention.index_select, attention.compress = spy_swiglu, spy_index, spy_compress
    try:
        run_chunks(model, [("branches", ids, 0)])
    finally:
        moe.swiglu, attention.index_select, attention.compress = swiglu, index_select, compress
    assert any(clamped) and any(dropped) and hca_entries == [1]


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


def test_5x_config_with_several_hca_windows_equals_hf(tiny_5x):
    path, hf = tiny_5x
    ids = prompt(90, seed=5)
    model = load_runner(path)
    assert np.abs(run_chunks(model, [("x", ids, 0)]) - hf_logits(hf, ids)).max() <= TOLERANCE
