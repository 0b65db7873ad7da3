"""Checkpoint spellings and formats: official names, HF-saved names and the MP8 per-rank files load
to the same logits; FP8 (e4m3 + e8m0 block scales) / FP4 (e2m1 + e8m0 per 32) checkpoints we
quantise ourselves equal HF run on the dequantised weights."""

import json

import numpy as np
import pytest
from openinfer_deepseek_v4.checkpoint import (
    DeepseekV4Checkpoint,
    official_name,
)

from openinfer import WeightLoadError
from tests.plugins.deepseek_v4.conftest import prompt
from tests.plugins.deepseek_v4.dsv4_helpers import (
    _quantize_fp4,
    _quantize_fp8,
    hf_from_official,
    hf_logits,
    load_runner,
    official_state,
    run_chunks,
    write_mp8,
    write_official,
    write_quantized,
)


@pytest.fixture(scope="module")
def ids_and_logits(tiny):
    ids = prompt(72, seed=7)
    return ids, hf_logits(tiny[1], ids)


def test_hf_name_mapping():
    assert official_name("model.embed_tokens.weight") == "embed.weight"
    assert official_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert official_name("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"
    assert official_name("model.layers.3.attn.compressor.norm.weight") == "layers.3.attn.compressor.norm.weight"
    assert official_name("layers.3.attn.kv_norm.weight") == "layers.3.attn.kv_norm.weight"
    assert official_name("head.weight") == "head.weight"


def test_official_hf_and_mp8_checkpoints_give_the_same_logits(tiny, tmp_path, ids_and_logits):
    path, hf = tiny
    ids, expected = ids_and_logits
    config = json.loads((path / "config.json").read_text())
    official = write_official(path, tmp_path / "official")
    # the official names are the real ones: HF itself loads them to the very same model
    assert np.abs(hf_logits(hf_from_official(official_state(path), config, tmp_path / "hf"), ids) - expected).max() == 0
    mp8 = write_mp8(path, tmp_path / "mp8", config["n_routed_experts"])
    assert DeepseekV4Checkpoint(mp8).is_model_parallel
    results = [run_chunks(load_runner(p), [("w", ids, 0)]) for p in (path, official, mp8)]
    assert np.abs(results[0] - expected).max() <= 1e-4
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])


def test_quantized_checkpoint_equals_hf_on_the_dequantized_weights(tiny, tmp_path):
    path, _ = tiny
    config = json.loads((path / "config.json").read_text())
    quantized, dequantized = write_quantized(path, tmp_path / "fp8-fp4")
    ckpt = DeepseekV4Checkpoint(quantized)
    dtypes = {name: ckpt.shards[0].dtype(name) for name in ckpt.names()}
    assert dtypes["layers.0.attn.wq_b.weight"] == "F8_E4M3" and dtypes["layers.0.attn.wq_b.scale"] == "F8_E8M0"
    assert dtypes["layers.2.ffn.experts.5.w2.weight"] == "I8"
    assert dtypes["layers.1.ffn.experts.5.w2.weight"] == "F4"
    assert ckpt.shards[0].shape("layers.1.ffn.experts.5.w2.weight") == (64, 32)  # F4: the logical shape
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"
    assert dtypes["layers.3.attn.compressor.wkv.weight"] == "F8_E4M3"  # decided per tensor
    hf = hf_from_official(dequantized, config, tmp_path / "hf-dequantized")
    ids = prompt(72, seed=8)
    got = run_chunks(load_runner(quantized), [("q", ids, 0)])
    assert np.abs(got - hf_logits(hf, ids)).max() <= 1e-4


def test_core_dequantizers_match_torch_on_multi_block_matrices():
    """The test's own torch quantiser and core's decoders agree on multi-block matrices."""
    import torch

    from openinfer.quant import dequantize_fp4_e2m1, dequantize_fp8_block, e8m0_to_float32

    weight = torch.randn(300, 260, generator=torch.Generator().manual_seed(0)) * 3
    codes, scale, expected = _quantize_fp8(weight)
    got = dequantize_fp8_block(codes.view(torch.uint8).numpy(), e8m0_to_float32(scale.view(torch.uint8).numpy()))
    assert scale.shape == (3, 3) and np.array_equal(got, expected.numpy())
    packed, scale, expected = _quantize_fp4(weight[:, :256])
    got = dequantize_fp4_e2m1(packed.numpy(), scale.view(torch.uint8).numpy())
    assert np.array_equal(got, expected.numpy())


def test_bad_checkpoints_name_the_tensor(tiny, tmp_path):
    from safetensors.torch import save_file

    path, _ = tiny
    state = official_state(path)
    del state["layers.2.ffn.gate.bias"]
    broken = write_official(path, tmp_path / "missing", state)
    with pytest.raises(WeightLoadError, match=r"layers\.2\.ffn\.gate\.bias"):
        load_runner(broken)
    state = official_state(path)
    state["layers.1.attn.wq_a.weight"] = state["layers.1.attn.wq_a.weight"][:, :10]
    with pytest.raises(WeightLoadError, match=r"layers\.1\.attn\.wq_a\.weight"):
        load_runner(write_official(path, tmp_path / "shape", state))
    mp = tmp_path / "mp-gap"
    mp.mkdir()
    save_file({"x": state["norm.weight"]}, mp / "model0-mp8.safetensors")
    with pytest.raises(WeightLoadError, match="model-parallel"):
        DeepseekV4Checkpoint(mp)


def test_mtp_block_is_loaded_and_unused(tiny, tmp_path, ids_and_logits):
    """mtp.0 as the official checkpoint ships it (a sliding, score-routed block + e_proj/h_proj,
    enorm/hnorm, norm, hc_head): loaded and shape-checked, the logits do not change."""
    import torch

    path, _ = tiny
    ids, expected = ids_and_logits
    state = official_state(path)
    generator = torch.Generator().manual_seed(5)
    for name, tensor in list(state.items()):
        source = "layers.0." if ".attn." in name or ".hc_" in name or "_norm" in name else "layers.3."
        if name.startswith(source) and (".ffn." not in name or source == "layers.3."):
            state["mtp.0." + name[len(source):]] = torch.randn(tensor.shape, generator=generator) \
                if tensor.is_floating_point() else tensor
    hidden = state["norm.weight"].shape[0]
    for extra, shape in (("e_proj.weight", (hidden, hidden)), ("h_proj.weight", (hidden, hidden)),
                         ("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)), ("norm.weight", (hidden,)),
                         ("hc_head_fn", state["hc_head_fn"].shape), ("hc_head_base", (4,)), ("hc_head_scale", (1,))):
        state["mtp.0." + extra] = torch.randn(shape, generator=generator)
    runner = load_runner(write_official(path, tmp_path / "with-mtp", state))
    mtp = runner.model.weights.mtp
    assert mtp is not None and mtp.layer.attn.compressor is None and mtp.layer.ffn.correction_bias is not None
    assert np.abs(run_chunks(runner, [("m", ids, 0)]) - expected).max() <= 1e-4
    del state["mtp.0.h_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"mtp\.0\.h_proj"):
        load_runner(write_official(path, tmp_path / "broken-mtp", state))


def test_dense_linear_loader_gets_first_say(tiny, tmp_path):
    """A backend's ``dense_linear`` loader (cuda keeps FP8 as stored) is asked for every dense
    linear, the shared experts' gate_up as its two stored parts; what it declines (here the BF16
    compressor weights) is dequantised as before, and the model still equals the plain load."""
    from openinfer_deepseek_v4.config import DeepseekV4Config
    from openinfer_deepseek_v4.weights import load_weights

    from openinfer import create_backend

    quantized, _ = write_quantized(tiny[0], tmp_path / "fp8-fp4")
    config = DeepseekV4Config.from_dict(json.loads((quantized / "config.json").read_text()))
    ckpt = DeepseekV4Checkpoint(quantized)
    asked: list[tuple[str, ...]] = []

    def keep_fp8(checkpoint, modules, shape):
        asked.append(tuple(modules))
        stored = [checkpoint.stored_quantized(m) for m in modules]
        if any(s is None or s[0] != "fp8" for s in stored):
            return None
        return ("kept", tuple(modules), shape)

    backend = create_backend("cpu")
    weights = load_weights(ckpt, config, backend, dense_linear=keep_fp8)
    c = config
    assert weights.layers[0].attn.wq_a == ("kept", ("layers.0.attn.wq_a",), (c.q_lora_rank, c.hidden_size))
    shared_parts = ("layers.0.ffn.shared_experts.w1", "layers.0.ffn.shared_experts.w3")
    assert weights.layers[0].ffn.shared.gate_up == ("kept", shared_parts, (2 * c.moe_intermediate_size, c.hidden_size))
    assert ("layers.1.attn.compressor.wkv",) in asked
    plain = load_weights(ckpt, config, backend)
    np.testing.assert_array_equal(weights.layers[1].attn.compressor.wkv.weight_t,
                                  plain.layers[1].attn.compressor.wkv.weight_t)
    assert weights.layers[3].attn.compressor.wkv[0] == "kept"  # FP8 in this file (Flash-Base style)
