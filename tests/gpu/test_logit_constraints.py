"""logit_bias and structured-output masks on the GPU sampler against the NumPy sampler."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.sampling import SamplingState, sample_row
from openinfer.structured import StepMasks, allocate_bitmask, allowed_tokens
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
                              StepMasks.from_rows(bitmask, [r for r in range(rows) if masked[r]]))
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


def test_engine_mixes_constrained_and_free_rows_on_cuda(tmp_path):
    """JSON Schema rows, logit_bias rows and plain rows in the same steps on the GPU: every
    constrained output validates, biased rows are forced, and steps without a grammar row are
    still launched ahead (async scheduling kept)."""
    import json as json_module
    import sys
    from pathlib import Path

    from openinfer_qwen3 import plugin

    from openinfer import EngineOptions
    from tests.helpers.engine_utils import make_request, run_all
    from tests.helpers.tiny_qwen3 import write_tiny_qwen3

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
    from agent_checkpoints import write_family_tokenizer

    jsonschema = pytest.importorskip("jsonschema")
    path = write_tiny_qwen3(tmp_path / "q", seed=3, head_dim=32, vocab_size=512)
    write_family_tokenizer(path, "qwen3")
    config = json_module.loads((path / "config.json").read_text())
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "k": {"enum": ["a", "b"]}},
              "required": ["n", "k"], "additionalProperties": False}
    requests = []
    for i in range(24):
        request = make_request(f"r{i}", [5 + i, 9, 11], max_tokens=40, temperature=1.0, seed=i, ignore_eos=i % 3 != 0)
        if i % 3 == 0:
            request.structured_output.json_schema = json_module.dumps(schema)
        elif i % 3 == 1:
            request.sampling.logit_bias[77] = 100.0
        requests.append(request)
    engine = plugin.openinfer_create_engine(str(path), config, EngineOptions(device="cuda"))
    try:
        outcomes = run_all(engine, requests)
        assert engine.num_steps_launched_ahead > 0
    finally:
        engine.close_sync()
    from openinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(path)
    for i, outcome in enumerate(outcomes):
        if i % 3 == 0:
            jsonschema.validate(json_module.loads(tokenizer.decode(outcome.token_ids)), schema)
        elif i % 3 == 1:
            assert set(outcome.token_ids) == {77}


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("vocab", [4099, 151936])
def test_packed_masks_on_the_device_equal_numpy_exactly(cuda_backend, rng, vocab, tiled, monkeypatch):
    """The step's packed int32 bitmask applied on the device (``apply_logit_constraints``, bias
    first; or its tiled variant, ``OPENINFER_TILED_LOGIT_CONSTRAINTS=1``) gives bit for bit the
    logits of the NumPy sampler's ``apply_logit_bias`` + ``apply_bitmasks`` (bf16 rounding of the
    biased values included), for random masks of every kind (dense, all / none allowed, a few
    allowed, a few forbidden)."""
    from openinfer.backend.cuda.sampler import TILED_CONSTRAINTS_ENV, apply_logit_constraints

    monkeypatch.setenv(TILED_CONSTRAINTS_ENV, "1" if tiled else "0")
    from openinfer.sampling import apply_logit_bias
    from openinfer.structured import apply_bitmasks
    from openinfer.weights import bf16_to_float32, float32_to_bf16
    from tests.core.test_structured import _random_bitmasks

    rows = 12
    logits = bf16_random(rng, rows, vocab, scale=3.0)
    bitmask = _random_bitmasks(rng, rows, vocab)
    masked = [r for r in range(rows) if r % 3 != 2]
    params = []
    for r in range(rows):
        p = pb.SamplingParams()
        if r % 2 == 0:
            for token in rng.choice(vocab, size=4, replace=False):
                p.logit_bias[int(token)] = float(rng.uniform(-100, 100))
        params.append(p)
    states = [SamplingState.create(p, [1], 0, i) for i, p in enumerate(params)]
    adjusted = apply_logit_constraints(cuda_backend.upload(logits), states, StepMasks.from_rows(bitmask, masked))
    ours = cuda_backend.to_host(adjusted)
    expected = logits.copy()
    for r in range(rows):  # the kernel adds the bias in fp32 and stores bf16
        biased = apply_logit_bias(expected[r].copy(), states[r])
        expected[r] = bf16_to_float32(float32_to_bf16(biased))
    expected[masked] = apply_bitmasks(expected[masked], bitmask[masked])
    assert np.array_equal(ours, expected)


def test_masks_computed_after_the_sampling_is_queued_are_waited_for_on_the_device(cuda_backend, rng):
    """Pending masks (``StepMasks.pending``, the engine's grammar rows sampled ahead with
    ``OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT=1``): the sampling is queued before the masks exist, the
    GPU waits for the host's flag, and the tokens equal those sampled with the masks known up
    front — for several steps in a row (the slots' reuse), the masks written by another thread
    after a delay; a step whose masks are abandoned fails at read-back instead of hanging."""
    import threading
    import time
    from types import SimpleNamespace

    from openinfer.backend.cuda.sampler import mask_gates, sample_rows_async

    rows, vocab = 16, 151936
    waited_before, waits_before = mask_gates().device_wait_ms
    masked = [r for r in range(rows) if r % 4 != 3]
    params = [pb.SamplingParams(temperature=0.0 if r % 2 else 1.0, seed=r) for r in range(rows)]

    def sampling_rows():  # fresh states: each run draws the same numbers
        return [SimpleNamespace(samples=True, request=SimpleNamespace(
            sampling=SamplingState.create(p, [1], 0, i), want_prompt_logprobs=False, want_logprobs=False,
            num_logprobs=0, num_output_tokens=0, stop=pb.StopConditions()))
            for i, p in enumerate(params)]

    def compute_later(pending: StepMasks, bitmask: np.ndarray) -> None:
        time.sleep(0.05)
        assert pending.compute_into(pending.bitmask)  # not started yet: nothing waited on the host
        pending.bitmask[...] = bitmask[masked]
        pending._started = True
        pending._finish()

    for step in range(6):  # more steps than _MaskGates.DEPTH
        logits = cupy.asarray(bf16_random(rng, rows, vocab, scale=3.0))
        bitmask = random_bitmask(rng, rows, vocab, keep=0.01 if step % 2 else 0.5)
        known = sample_rows_async(logits, sampling_rows(), StepMasks.from_rows(bitmask, masked))
        expected = [s.token_id for s in known[1]()]
        pending = StepMasks.pending(masked, rows, bitmask.shape[1])
        launched = sample_rows_async(logits, sampling_rows(), pending)
        assert launched is not None
        writer = threading.Thread(target=compute_later, args=(pending, bitmask))
        writer.start()
        tokens = [s.token_id for s in launched[1]()]
        writer.join()
        assert tokens == expected
        for r in masked:
            assert allowed_tokens(bitmask[r], vocab)[tokens[r]]
    waited, waits = mask_gates().device_wait_ms  # the GPU waited out each 50 ms delay, less its own work
    assert waits - waits_before == 6 and 6 * 10 < waited - waited_before < 6 * 5000
    abandoned = StepMasks.pending(masked, rows, bitmask.shape[1])
    launched = sample_rows_async(logits, sampling_rows(), abandoned)
    abandoned.abandon()
    with pytest.raises(RuntimeError, match="grammar masks"):
        launched[1]()


def test_tiled_in_place_constraints_sample_what_the_copying_kernel_samples(cuda_backend, rng, monkeypatch):
    """``OPENINFER_TILED_LOGIT_CONSTRAINTS=1``: the engine's asynchronous sampling applies the bias and
    masks with the tiled kernel to the forward's logits in place; the tokens equal those of the
    one-block-per-row kernel on a copy, for seeded random and greedy rows, with and without a mask
    or a bias, and every masked row samples an allowed token."""
    from types import SimpleNamespace

    from openinfer.backend.cuda.sampler import TILED_CONSTRAINTS_ENV, sample_rows_async

    rows, vocab = 24, 151936
    logits = bf16_random(rng, rows, vocab, scale=3.0)
    bitmask = random_bitmask(rng, rows, vocab, keep=0.05)
    masked = [r for r in range(rows) if r % 3 != 0]
    params = []
    for r in range(rows):
        p = pb.SamplingParams(temperature=0.0 if r % 2 else 1.0, seed=r)
        if r % 4 == 1:
            p.logit_bias[int(rng.integers(vocab))] = 30.0
        params.append(p)

    def sampled(tiled: str) -> list[int]:
        monkeypatch.setenv(TILED_CONSTRAINTS_ENV, tiled)
        batch = [SimpleNamespace(samples=True, request=SimpleNamespace(
            sampling=SamplingState.create(p, [1], 0, i), want_prompt_logprobs=False, want_logprobs=False,
            num_logprobs=0, num_output_tokens=0, stop=pb.StopConditions()))
            for i, p in enumerate(params)]
        launched = sample_rows_async(cupy.asarray(logits), batch, StepMasks.from_rows(bitmask, masked))
        assert launched is not None
        return [s.token_id for s in launched[1]()]

    tokens = sampled("1")
    assert tokens == sampled("0")
    for r in masked:
        assert allowed_tokens(bitmask[r], vocab)[tokens[r]]
