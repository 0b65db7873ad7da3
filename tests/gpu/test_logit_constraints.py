"""logit_bias and structured-output masks on the GPU sampler against the NumPy sampler."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.sampling import SamplingState, sample_row
from openinfer.structured import allocate_bitmask, allowed_tokens
from openinfer.v1 import engine_pb2 as pb
from tests.gpu.conftest import bf16_random

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def random_bitmask(rng, rows: int, vocab: int, keep: float) -> np.ndarray:
    bitmask = allocate_bitmask(rows, vocab)
    for r in range(rows):
        allowed = rng.random(vocab) < keep
        allowed[rng.integers(vocab)] = True
        bits = np.packbits(np.concatenate([allowed, np.zeros(bitmask.shape[1] * 32 - vocab, bool)]),
                           bitorder="little")
        bitmask[r] = bits.view(np.int32)
    return bitmask


def test_bias_and_mask_match_numpy(cuda_backend, rng):
    from openinfer.backend.cuda.sampler import sample_device_rows

    rows, vocab = 64, 4099  # a vocabulary that does not fill its last bitmask word
    logits = bf16_random(rng, rows, vocab, scale=2.5)
    bitmask = random_bitmask(rng, rows, vocab, keep=0.1)
    masked = [r % 2 == 0 for r in range(rows)]  # constrained and free rows in one launch
    params = []
    for r in range(rows):
        p = pb.SamplingParams(temperature=0.0 if r % 3 == 0 else 0.8, seed=r)
        if r % 4 == 1:
            p.logit_bias[int(rng.integers(vocab))] = 100.0
            p.logit_bias[int(np.argmax(logits[r]))] = -100.0
        params.append(p)
    states = [SamplingState.create(p, [1], 0, i) for i, p in enumerate(params)]
    ours = sample_device_rows(cuda_backend.upload(logits), states,
                              [bitmask[r] if masked[r] else None for r in range(rows)])
    reference_states = [SamplingState.create(p, [1], 0, i) for i, p in enumerate(params)]
    reference = [sample_row(logits[r].copy(), reference_states[r],
                            bitmask_row=bitmask[r] if masked[r] else None).token_id for r in range(rows)]
    for r in range(rows):
        if masked[r]:
            assert allowed_tokens(bitmask[r], vocab)[ours[r]], f"row {r} sampled a masked token"
    agree = float(np.mean(np.asarray(ours) == np.asarray(reference)))
    assert agree >= 0.95, f"GPU and NumPy agree on only {agree:.1%} of rows"
    for r in range(rows):
        if r % 4 == 1 and not masked[r]:
            forced = [t for t, v in params[r].logit_bias.items() if v > 0][0]
            assert ours[r] == forced
