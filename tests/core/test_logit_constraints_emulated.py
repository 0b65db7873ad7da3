"""The CUDA sampler's logit adjustments (``core/kernels/logit_constraints.cu``: logit_bias, then
the step's packed int32 grammar bitmask, rows with and without a mask in one launch) compiled
for the host and run on the CPU, against the NumPy sampler's ``apply_logit_bias`` +
``apply_bitmasks`` in bf16: the same logits, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import bf16_to_float32, float32_to_bf16
from openinfer.structured import apply_bitmasks, bitmask_words
from tests.core.test_structured import _random_bitmasks
from tests.helpers.cuda_emulation import compile_harness, read_array, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "logit_constraints_harness.cpp"


@pytest.mark.parametrize(("vocab", "tiled", "threads"), [(70, False, 256), (4099, False, 256), (70, True, 4),
                                                     (4099, True, 64)])
def test_logit_constraints_kernel_matches_numpy(tmp_path, vocab, tiled, threads):
    """Both kernels; the tiled one over tiles of threads * 8 tokens whose last one is partial (70 =
    32 + 32 + 6 tokens, 4099 = 8 * 512 + 3), a row's bias ids falling into several tiles."""
    rng = np.random.default_rng(vocab)
    rows, words = 7, bitmask_words(vocab)
    logits = float32_to_bf16(rng.standard_normal((rows, vocab)).astype(np.float32) * 3)
    # rows 1, 3, 4 and 6 carry a mask (their own packed rows, in a compacted bitmask); 0, 2, 4 a bias
    masked = [1, 3, 4, 6]
    bitmask = _random_bitmasks(rng, len(masked), vocab)
    mask_row = np.full(rows, -1, np.int32)
    mask_row[masked] = np.arange(len(masked), dtype=np.int32)
    biases = {r: (rng.choice(vocab, size=5, replace=False), rng.uniform(-100, 100, 5).astype(np.float32))
              for r in (0, 2, 4)}
    bias_start = np.zeros(rows + 1, np.int32)
    bias_start[1:] = np.cumsum([len(biases[r][0]) if r in biases else 0 for r in range(rows)])
    bias_ids = np.concatenate([biases[r][0] for r in sorted(biases)]).astype(np.int32)
    bias_values = np.concatenate([biases[r][1] for r in sorted(biases)])

    binary = compile_harness(HARNESS, REPO / "core" / "kernels", tmp_path / "logit_constraints")
    run_harness(binary, tmp_path, params=np.array([rows, vocab, words, threads, int(tiled)], np.int32), logits=logits,
                bias_start=bias_start, bias_ids=bias_ids, bias_values=bias_values, bitmask=bitmask,
                mask_row=mask_row)
    ours = read_array(tmp_path, "out", np.uint16, (rows, vocab))

    expected = bf16_to_float32(logits)
    for r, (ids, values) in biases.items():  # the kernel adds in fp32 and rounds to bf16
        expected[r, ids] = bf16_to_float32(float32_to_bf16(expected[r, ids] + values))
    expected[masked] = apply_bitmasks(expected[masked], bitmask)
    assert np.array_equal(ours, expected)
    assert np.array_equal(np.signbit(ours), np.signbit(expected))
