"""Quantized formats: FP8 block, INT4 pack-quantized, FP4 e2m1; config parsing; checkpoint reading."""

import numpy as np
import pytest
import torch

from openinfer import Checkpoint
from openinfer.errors import WeightLoadError
from openinfer.quant import (
    dequantize_fp4_e2m1,
    dequantize_fp8_block,
    dequantize_int4_group,
    e8m0_to_float32,
    float32_to_fp8_e4m3,
    fp8_e4m3_to_float32,
    pack_int4,
    quant_config_from,
    quantize_fp4_e2m1,
    quantize_fp8_block,
    quantize_int4_group,
    unpack_int4,
)
from tests.helpers.safetensors_raw import write_safetensors


def test_fp8_e4m3_decode_and_round_match_torch():
    codes = np.arange(256, dtype=np.uint8)
    reference = torch.tensor(codes).view(torch.float8_e4m3fn).float().numpy()
    ours = fp8_e4m3_to_float32(codes)
    assert np.array_equal(np.isnan(ours), np.isnan(reference))
    assert np.array_equal(ours[~np.isnan(ours)], reference[~np.isnan(reference)])
    x = np.random.default_rng(0).standard_normal(4000).astype(np.float32) * 50
    assert np.array_equal(float32_to_fp8_e4m3(x), torch.tensor(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy())


def test_fp8_block_scales_broadcast_over_ragged_blocks():
    w = np.random.default_rng(1).standard_normal((200, 300)).astype(np.float32)
    codes, scales = quantize_fp8_block(w)
    assert scales.shape == (2, 3)
    expected = fp8_e4m3_to_float32(codes)
    expected[128:, 256:] *= scales[1, 2]
    expected[:128, :128] *= scales[0, 0]
    deq = dequantize_fp8_block(codes, scales)
    assert np.array_equal(deq[128:, 256:], expected[128:, 256:])
    assert np.array_equal(deq[:128, :128], expected[:128, :128])
    assert np.abs(deq - w).max() < 0.07 * np.abs(w).max()
    with pytest.raises(WeightLoadError, match="block scales"):
        dequantize_fp8_block(codes, scales[:1])


def test_int4_packing_is_lsb_first_offset_by_8():
    values = np.array([[-8, -7, 0, 1, 2, 3, 7, -1, 5]], np.int8)
    words = pack_int4(values)
    assert words.shape == (1, 2)
    first = int(words.view(np.uint32)[0, 0])
    assert [(first >> (4 * j)) & 0xF for j in range(8)] == [0, 1, 8, 9, 10, 11, 15, 7]
    assert np.array_equal(unpack_int4(words, 9), values)
    w = np.random.default_rng(2).standard_normal((6, 64)).astype(np.float32)
    packed, scales = quantize_int4_group(w, 32)
    deq = dequantize_int4_group(packed, scales, (6, 64))
    assert np.abs(deq - w).max() <= scales.max() / 2 + 1e-6
    with pytest.raises(WeightLoadError, match="whole number of groups"):
        dequantize_int4_group(packed, scales[:, :1].repeat(3, 1), (6, 64))


def test_fp4_e2m1_low_nibble_is_the_even_element():
    packed = np.array([[0x21, 0xF9]], np.uint8)  # codes 1,2 | 9,15 -> .5, 1, -.5, -6
    scales = np.array([[128]], np.uint8)  # 2^1
    assert dequantize_fp4_e2m1(np.tile(packed, (1, 8)), scales)[0, :4].tolist() == [1, 2, -1, -12]
    assert e8m0_to_float32(np.array([127, 0, 255], np.uint8))[:2].tolist() == [1.0, 2.0**-127]
    w = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    packed, scales = quantize_fp4_e2m1(w)
    assert np.abs(dequantize_fp4_e2m1(packed, scales) - w).max() <= np.abs(w).max() / 4


def test_quantization_config_parsing_and_errors():
    assert quant_config_from({}).method == "none"
    fp8 = quant_config_from({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                     "weight_block_size": [128, 128]}})
    assert (fp8.method, fp8.block) == ("fp8", (128, 128))
    int4 = quant_config_from({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head", "re:.*self_attn.*"]}})
    assert (int4.method, int4.group_size) == ("int4", 32)
    assert not int4.applies_to("model.layers.0.self_attn.q_a_proj") and not int4.applies_to("lm_head")
    assert int4.applies_to("model.layers.1.mlp.experts.3.up_proj")
    with pytest.raises(WeightLoadError, match="quant_method='awq'"):
        quant_config_from({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(WeightLoadError, match="num_bits"):
        quant_config_from({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                   "config_groups": {"g": {"weights": {"num_bits": 8}}}}})


def test_checkpoint_reads_quantized_linears_and_names_bad_tensors(tmp_path):
    rng = np.random.default_rng(4)
    dense = rng.standard_normal((130, 64)).astype(np.float32)
    codes, scales = quantize_fp8_block(dense)
    packed, int4_scales = quantize_int4_group(dense, 32)
    exponents = np.array([[120, 131]], np.uint8)  # DeepSeek-V4 style: e8m0 block scales named `.scale`
    write_safetensors(tmp_path / "model.safetensors", {
        "d.weight": ("F8_E4M3", codes[:128, :]), "d.scale": ("F8_E8M0", exponents[:, :1]),
        "a.weight": ("F8_E4M3", codes), "a.weight_scale_inv": scales,
        "b.weight_packed": packed, "b.weight_scale": int4_scales,
        "b.weight_shape": np.array([130, 64], np.int32), "c.weight": dense})
    ckpt = Checkpoint(tmp_path)
    assert np.array_equal(ckpt.get("a.weight"), fp8_e4m3_to_float32(codes))
    fp8_cfg = quant_config_from({"quantization_config": {"quant_method": "fp8"}})
    assert np.array_equal(ckpt.linear("a", fp8_cfg), dequantize_fp8_block(codes, scales))
    int4_cfg = quant_config_from({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}})
    assert np.array_equal(ckpt.linear("b", int4_cfg, (130, 64)), dequantize_int4_group(packed, int4_scales, (130, 64)))
    assert np.array_equal(ckpt.linear("c", shape=(130, 64)), dense)
    assert np.array_equal(ckpt.linear("d", fp8_cfg), fp8_e4m3_to_float32(codes[:128]) * 2.0**-7)
    with pytest.raises(WeightLoadError, match="'missing.weight' is missing"):
        ckpt.linear("missing")
    with pytest.raises(WeightLoadError, match="b.weight_shape"):
        ckpt.stored_linear("b", int4_cfg, (130, 32))
    bad_group = quant_config_from({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}}}}})
    with pytest.raises(WeightLoadError, match="b.weight_scale"):
        ckpt.stored_linear("b", bad_group)
