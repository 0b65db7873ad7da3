"""Tiny random DeepSeek-V3-architecture checkpoints (Kimi-K2 shape in miniature); HF is the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 160,
    "hidden_size": 48,
    "intermediate_size": 80,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    return {**TINY_DEEPSEEK_V3, **overrides}


def random_hf_model(config_dict: dict[str, Any], seed: int = 0, fan_in_gain: float | None = None) -> Any:
    """An HF ``DeepseekV3ForCausalLM`` (fp32) with every parameter and buffer randomised —
    norms around 1, ``e_score_correction_bias`` too (HF initialises it to 0).

    Matrices get std 0.12 by default (tiny configs: every weight matters at fp32 tolerances);
    ``fan_in_gain`` scales them as ``gain / sqrt(fan_in)`` instead, the conditioning of a trained
    model. A fixed 0.12 at hidden 1024 makes attention scores ~8 std and the network chaotic:
    HF's own bf16 run then differs from its fp32 run by mean |Δlogprob| ~0.7, so a bf16-vs-bf16
    comparison at mid size needs the fan-in scaling to measure anything but rounding noise."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    hf_config = DeepseekV3Config(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    model = DeepseekV3ForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.12
            if fan_in_gain is not None and "norm" not in name and param.ndim >= 2:
                scale = fan_in_gain / param.shape[-1] ** 0.5
            param.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn_like(buffer))
    return model


def write_tiny_deepseek_v3(path: Path, seed: int = 0, dtype: str = "float32", fan_in_gain: float | None = None,
                           **overrides: Any) -> tuple[Path, Any]:
    """config.json + model.safetensors (``dtype``: float32 or bfloat16 on disk); returns
    ``(path, the fp32 HF model)``."""
    import torch

    config_dict = tiny_config(**overrides)
    model = random_hf_model(config_dict, seed, fan_in_gain)
    path.mkdir(parents=True, exist_ok=True)
    if dtype == "float32":
        model.save_pretrained(path, safe_serialization=True)
    else:
        model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
        model.float()
    saved = json.loads((path / "config.json").read_text())
    saved.update(config_dict)
    for key in ("rope_parameters",):  # keep the legacy spelling real checkpoints use
        saved.pop(key, None)
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path, model


INT4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [16, 16]}


def write_quantized_copy(path: Path, source: Path, model: Any, method: str) -> Any:
    """Quantize ``model``'s weights the way real checkpoints are (INT4: routed experts only, bf16
    scales, compressed-tensors names; FP8: every linear but ``lm_head`` and the router, e4m3 codes
    + f32 ``weight_scale_inv``), write them, and load the *dequantized* values back into ``model``
    so it is the reference for the quantized checkpoint."""
    import numpy as np
    import torch

    from openinfer import bf16_to_float32, float32_to_bf16
    from openinfer.quant import (
        dequantize_fp8_block,
        dequantize_int4_group,
        quantize_fp8_block,
        quantize_int4_group,
    )
    from tests.helpers.safetensors_raw import write_safetensors

    path.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import load_file

    state = load_file(source / "model.safetensors")  # the original per-expert names
    config_dict = json.loads((source / "config.json").read_text())
    out: dict[str, Any] = {}
    dequantized: dict[str, np.ndarray] = {}
    for name, value in state.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        is_expert = module is not None and ".mlp.experts." in module
        is_linear = module is not None and value.ndim == 2 and "embed_tokens" not in module \
            and not module.endswith("lm_head") and not module.endswith("mlp.gate")
        if method == "int4" and is_expert:
            group = INT4_QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"]["group_size"]
            packed, scales = quantize_int4_group(value, group)
            scales_bf16 = float32_to_bf16(scales)
            out[f"{module}.weight_packed"] = packed
            out[f"{module}.weight_scale"] = ("BF16", scales_bf16)
            out[f"{module}.weight_shape"] = np.array(value.shape, np.int32)
            dequantized[name] = dequantize_int4_group(packed, bf16_to_float32(scales_bf16), value.shape)
        elif method == "fp8" and is_linear:
            codes, scales = quantize_fp8_block(value, tuple(FP8_QUANTIZATION_CONFIG["weight_block_size"]))
            out[name] = ("F8_E4M3", codes)
            out[f"{module}.weight_scale_inv"] = scales
            dequantized[name] = dequantize_fp8_block(codes, scales, tuple(FP8_QUANTIZATION_CONFIG["weight_block_size"]))
        else:
            out[name] = value
    write_safetensors(path / "model.safetensors", out)
    quant = INT4_QUANTIZATION_CONFIG if method == "int4" else FP8_QUANTIZATION_CONFIG
    (path / "config.json").write_text(json.dumps({**config_dict, "quantization_config": quant}, indent=2))
    params = model.state_dict()
    with torch.no_grad():
        for name, value in dequantized.items():
            if ".mlp.experts." in name:  # HF keeps experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]
                prefix, rest = name.split(".experts.")
                expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
                half = value.shape[0]
                if proj == "down_proj":
                    params[f"{prefix}.experts.down_proj"][expert].copy_(torch.from_numpy(value))
                else:
                    rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
                    params[f"{prefix}.experts.gate_up_proj"][expert, rows].copy_(torch.from_numpy(value))
            else:
                params[name].copy_(torch.from_numpy(value))
    return model
