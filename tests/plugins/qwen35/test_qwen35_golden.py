"""Qwen3.5 on the NumPy backend against HF transformers fp32, on tiny random checkpoints
(prompts ≥ 70 tokens, so a 64-token chunk and a ragged tail are both hit)."""

import numpy as np
import pytest

from tests.plugins.qwen35.qwen35_helpers import Driver, hf_greedy, hf_logits, load_model

TOLERANCE = 1e-4


def prompt_ids(n: int, seed: int = 0, vocab: int = 96) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


@pytest.fixture(params=["tiny", "tiny_variant"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def test_prefill_logits_match_hf_at_every_position(checkpoint):
    path, hf = checkpoint
    prompt = prompt_ids(77)
    ours = Driver(load_model(path)).step({"a": prompt}, all_rows=True)[0]
    reference = hf_logits(hf, prompt)
    assert ours.shape == reference.shape
    assert np.abs(ours - reference).max() <= TOLERANCE


def test_32_greedy_tokens_match_hf_generate(checkpoint):
    path, hf = checkpoint
    prompt = prompt_ids(73, seed=5)
    assert Driver(load_model(path)).greedy("g", prompt, 32) == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("splits", [(1,), (30, 31), (64,), (10, 64, 65, 99)])
def test_chunked_prefill_equals_one_shot(tiny, splits):
    path, _ = tiny
    prompt = prompt_ids(120, seed=7)
    model = load_model(path)
    driver = Driver(model)
    whole = driver.step({"whole": prompt}, all_rows=True)[0]
    pieces = [driver.step({"split": prompt[start:end]}, all_rows=True)[0]
              for start, end in zip((0, *splits), (*splits, len(prompt)), strict=True)]
    assert np.abs(np.concatenate(pieces) - whole).max() <= TOLERANCE
    # the state after the last piece is the one-shot state: decoding continues identically
    token = int(np.argmax(whole[-1]))
    after = driver.step({"whole": [token], "split": [token]})
    assert np.abs(after[0] - after[1]).max() <= TOLERANCE


def test_multimodal_checkpoint_gives_the_text_only_answer(tiny, tiny_multimodal):
    path, hf = tiny
    model = load_model(tiny_multimodal)
    assert model.config.is_multimodal
    assert model.spec.architectures == ("Qwen3_5ForConditionalGeneration",)
    prompt = prompt_ids(71, seed=9)
    ours = Driver(model).step({"m": prompt}, all_rows=True)[0]
    assert np.abs(ours - hf_logits(hf, prompt)).max() <= TOLERANCE
    assert Driver(model).greedy("m", prompt, 8) == hf_greedy(hf, prompt, 8)


def test_mixed_batch_of_prefills_and_decodes_equals_each_alone(tiny):
    path, _ = tiny
    model = load_model(path)
    prompts = {"a": prompt_ids(80, seed=1), "b": prompt_ids(70, seed=2), "c": prompt_ids(3, seed=3)}
    alone = {}
    solo = Driver(model)
    for rid, prompt in prompts.items():
        alone[rid] = solo.greedy(rid, prompt, 6)
        solo.release(rid)
    together = Driver(model)
    # a decodes while b prefills in two chunks and c arrives late: every step mixes kinds
    outputs = {rid: [] for rid in prompts}
    last = together.step({"a": prompts["a"]})[0][-1]
    outputs["a"].append(int(np.argmax(last)))
    logits = together.step({"a": outputs["a"][-1:], "b": prompts["b"][:33]})
    outputs["a"].append(int(np.argmax(logits[0][-1])))
    logits = together.step({"b": prompts["b"][33:], "a": outputs["a"][-1:], "c": prompts["c"]})
    outputs["b"].append(int(np.argmax(logits[0][-1])))
    outputs["a"].append(int(np.argmax(logits[1][-1])))
    outputs["c"].append(int(np.argmax(logits[2][-1])))
    while any(len(out) < 6 for out in outputs.values()):
        live = {rid: out[-1:] for rid, out in outputs.items() if len(out) < 6}
        for rid, rows in zip(live, together.step(live), strict=True):
            outputs[rid].append(int(np.argmax(rows[-1])))
    assert outputs == alone


def test_bf16_checkpoint_loads_without_torch_and_matches_hf(tmp_path):
    import torch
    from transformers import Qwen3_5ForCausalLM

    from tests.plugins.qwen35.qwen35_helpers import make_hf_model, write_text_checkpoint

    hf, config = make_hf_model(seed=3)
    path = write_text_checkpoint(tmp_path / "bf16", hf.to(torch.bfloat16), config)
    reference_model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # bf16 values, fp32 math
    prompt = prompt_ids(72, seed=11)
    ours = Driver(load_model(path)).step({"b": prompt}, all_rows=True)[0]
    assert np.abs(ours - hf_logits(reference_model, prompt)).max() <= TOLERANCE
