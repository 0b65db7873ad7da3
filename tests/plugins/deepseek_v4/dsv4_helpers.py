"""Tiny random DeepSeek-V4 checkpoints (HF transformers is the reference, test-only).

The tiny config is written in the legacy keys of the real ``config.json`` (``compress_ratios``
with its extra MTP entry, ``num_hash_layers``, ``rope_theta`` + ``rope_scaling`` YaRN,
``qk_rope_head_dim``): layer 0 sliding only, layers 1 and 3 CSA (rate 4), layer 2 HCA (rate 128),
two hash-routed layers. The sliding window (8) and ``index_topk`` (5) are small so that a
140-token prompt crosses many windows and the indexer really selects. Sizes are multiples of 8
so the MP8 split works, and of 32 so the FP4 groups fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

TINY_DSV4: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 0.6,
    "num_hash_layers": 2,
    "sliding_window": 8,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 5,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "compress_ratios": [0, 4, 128, 4, 0],
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 1,
}

# The transformers 5.x spelling, with an HCA rate small enough for several HCA windows.
TINY_DSV4_5X: dict[str, Any] = {
    **{k: v for k, v in TINY_DSV4.items()
       if k not in ("compress_ratios", "num_hash_layers", "rope_scaling", "rope_theta", "compress_rope_theta",
                    "qk_rope_head_dim")},
    "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                    "heavily_compressed_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "partial_rotary_factor": 0.5,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 8.0,
                     "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                     "attention_factor": 1.0, "partial_rotary_factor": 0.5},
    },
}


def make_hf_model(seed: int = 0, base: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """An fp32 HF DeepseekV4ForCausalLM with every parameter and buffer randomised."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = dict(base or TINY_DSV4)
    hf_config = DeepseekV4Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config).float().eval()
    randomize(model, seed, config["vocab_size"], config["n_routed_experts"], config["num_experts_per_tok"])
    return model, config


def randomize(model: Any, seed: int, vocab: int, num_experts: int, top_k: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed + 1)

    def randn(shape: Any) -> Any:
        return torch.randn(shape, generator=generator)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * randn(param.shape)
            elif name.endswith(("hc.scale", "hc_scale")):
                value = 0.5 + 0.5 * torch.rand(param.shape, generator=generator)
            elif name.endswith(("hc.fn", "hc_fn")):
                value = 0.3 * randn(param.shape)
            elif name.endswith("sinks"):
                value = randn(param.shape)
            elif name.endswith("position_bias"):
                value = 0.5 * randn(param.shape)
            elif name.endswith(("embed_tokens.weight",)):
                value = randn(param.shape)
            elif param.dim() >= 2:
                fan_in = param.shape[-1]
                value = randn(param.shape) / fan_in**0.5
            else:
                value = 0.3 * randn(param.shape)
            param.copy_(value)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * randn(buffer.shape))
            elif name.endswith("tid2eid"):
                rows = [torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(vocab)]
                buffer.copy_(torch.stack(rows))


def hf_logits(model: Any, token_ids: list[int]) -> np.ndarray:
    """All-position logits of one full forward (fp32)."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=True)
    return out.logits[0].numpy()


def hf_greedy(model: Any, token_ids: list[int], num_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=num_tokens, do_sample=False,
                             min_new_tokens=num_tokens)
    return out[0, len(token_ids):].tolist()


def save_hf(model: Any, config: dict[str, Any], path: Path) -> Path:
    """``save_pretrained`` (HF-saved hybrid names), with config.json replaced by ours (legacy keys)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    return path


def load_model(path: Path, max_model_len: int = 512) -> Any:
    """The plugin's model on the NumPy backend, driven directly (no engine)."""
    from openinfer_deepseek_v4.plugin import build_model

    from openinfer import EngineOptions, create_backend

    config = json.loads((path / "config.json").read_text())
    return build_model(path, config, create_backend("cpu"), EngineOptions(max_model_len=max_model_len))


def run_chunks(model: Any, sequences: list[tuple[str, list[int], int]]) -> np.ndarray:
    """One forward over several sequences: (request id, new token ids, start position) each;
    returns all-position logits of every new token, in order."""
    from openinfer import ForwardBatch

    tokens = np.concatenate([np.asarray(ids, np.int32) for _, ids, _ in sequences])
    positions = np.concatenate([np.arange(start, start + len(ids), dtype=np.int32) for _, ids, start in sequences])
    query_start = np.zeros(len(sequences) + 1, np.int32)
    query_start[1:] = np.cumsum([len(ids) for _, ids, _ in sequences])
    context_lens = np.asarray([start + len(ids) for _, ids, start in sequences], np.int32)
    batch = ForwardBatch(
        token_ids=tokens, positions=positions, query_start=query_start, context_lens=context_lens,
        block_tables=np.zeros((len(sequences), 1), np.int32), slot_mapping=np.zeros(len(tokens), np.int32),
        logits_rows=np.arange(len(tokens), dtype=np.int32), max_query_len=max(len(s[1]) for s in sequences),
        max_context_len=int(context_lens.max()), request_ids=tuple(rid for rid, _, _ in sequences))
    return np.asarray(model.forward(batch, []))
