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

# A mid-size config for the GPU's bf16 teacher-forced check: every layer kind (sliding, CSA,
# HCA), a hash layer, widths where bf16 rounding behaves as at scale (head_dim 128, 16 experts).
MID_DSV4: dict[str, Any] = {
    **TINY_DSV4, "vocab_size": 4096, "hidden_size": 512, "num_attention_heads": 8, "head_dim": 128,
    "qk_rope_head_dim": 32, "q_lora_rank": 256, "o_groups": 4, "o_lora_rank": 128, "moe_intermediate_size": 256,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "num_hash_layers": 1, "sliding_window": 32,
    "index_n_heads": 8, "index_head_dim": 64, "index_topk": 16, "swiglu_limit": 10.0,
    "max_position_embeddings": 2048,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 128, "beta_fast": 32,
                     "beta_slow": 1},
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
    """HF greedy continuation through its own DeepSeek-V4 cache (sliding window + compressor
    state), one token per step, EOS not special (``generate`` would suppress it under
    ``min_new_tokens`` and pick another token)."""
    import torch

    tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=True)
        for _ in range(num_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def save_hf(model: Any, config: dict[str, Any], path: Path) -> Path:
    """``save_pretrained`` (HF-saved hybrid names), with config.json replaced by ours (legacy keys)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    return path


def load_model(path: Path, max_model_len: int = 512, backend: Any = None) -> Any:
    """The plugin's model on ``backend`` (default: the NumPy backend)."""
    from openinfer_deepseek_v4.plugin import build_model

    from openinfer import EngineOptions, create_backend

    config = json.loads((path / "config.json").read_text())
    return build_model(path, config, backend or create_backend("cpu"), EngineOptions(max_model_len=max_model_len))


def bf16_emulation_backend() -> Any:
    """The NumPy backend with bf16 weights and every op's output rounded to bf16, as the cuda
    backend stores them between kernels (math stays fp32): the yardstick for bf16 logits."""
    from openinfer import bf16_to_float32, float32_to_bf16
    from openinfer.backend import NumpyBackend

    def bf16(x: Any) -> np.ndarray:
        return bf16_to_float32(float32_to_bf16(np.asarray(x, np.float32)))

    class Bf16Rounding(NumpyBackend):
        def weight(self, array: np.ndarray) -> np.ndarray:
            return bf16(super().weight(array))

        def linear_weight(self, weight: np.ndarray, bias: np.ndarray | None = None) -> Any:
            return super().linear_weight(bf16(weight), None if bias is None else bf16(bias))

        def embedding(self, table: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
            return bf16(super().embedding(table, token_ids))

        def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
            return bf16(super().rms_norm(x, weight, eps))

        def linear(self, x: np.ndarray, weight: Any) -> np.ndarray:
            return bf16(super().linear(x, weight))

    return Bf16Rounding()


class DirectRunner:
    """Drives ``model.forward`` without the engine: every request gets its own fixed run of
    blocks (the same ids in every KV cache group) and a state slot."""

    def __init__(self, model: Any, max_tokens: int = 512, max_requests: int = 12, block_size: int = 16):
        from openinfer import group_specs

        self.model = model
        specs = model.kv_cache_specs()
        self.groups = group_specs(specs).groups
        self.blocks_per_request = -(-max_tokens // block_size)
        num_blocks = 1 + max_requests * self.blocks_per_request
        self.kv_cache = [model.backend.allocate_kv(s, num_blocks if s.paged else max_requests + 1, block_size)
                         for s in specs]
        self.requests: dict[str, int] = {}

    def run(self, sequences: list[tuple[str, list[int], int]]) -> np.ndarray:
        """One forward over several sequences: (request id, new token ids, start position) each;
        returns all-position logits of every new token, in order."""
        from openinfer import ForwardBatch

        index = [self.requests.setdefault(rid, len(self.requests)) for rid, _, _ in sequences]
        tables = np.stack([1 + i * self.blocks_per_request + np.arange(self.blocks_per_request) for i in index])
        tokens = np.concatenate([np.asarray(ids, np.int32) for _, ids, _ in sequences])
        positions = np.concatenate([np.arange(start, start + len(ids), dtype=np.int32) for _, ids, start in sequences])
        query_start = np.zeros(len(sequences) + 1, np.int32)
        query_start[1:] = np.cumsum([len(ids) for _, ids, _ in sequences])
        context_lens = np.asarray([start + len(ids) for _, ids, start in sequences], np.int32)
        no_writes = np.full(len(tokens), -1, np.int32)
        batch = ForwardBatch(
            token_ids=tokens, positions=positions, query_start=query_start, context_lens=context_lens,
            block_tables=tables.astype(np.int32), slot_mapping=no_writes,
            logits_rows=np.arange(len(tokens), dtype=np.int32), max_query_len=max(len(s[1]) for s in sequences),
            max_context_len=int(context_lens.max()), request_ids=tuple(rid for rid, _, _ in sequences),
            kv_block_tables=tuple(tables.astype(np.int32) for _ in self.groups),
            kv_slot_mappings=tuple(no_writes for _ in self.groups),
            state_slots=np.asarray([1 + i for i in index], np.int32))
        ops = self.model.backend
        return ops.to_host(self.model.forward(ops.prepare_batch(batch), self.kv_cache))


def load_runner(path: Path) -> DirectRunner:
    return DirectRunner(load_model(path))


def run_chunks(runner: DirectRunner, sequences: list[tuple[str, list[int], int]]) -> np.ndarray:
    return runner.run(sequences)


# --- the other on-disk spellings -------------------------------------------------------------------

def official_state(hf_dir: Path) -> dict[str, Any]:
    """The HF-saved tensors under the official names (MODELS.md §1.2), as torch tensors."""
    from safetensors.torch import load_file

    state = {}
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        name = name.replace("hc_head.hc_", "hc_head_")
        parts = name.split(".")
        if len(parts) == 5 and parts[2] == "attn" and parts[3] == "norm":  # layers.{i}.attn.norm.weight
            name = ".".join([*parts[:3], "kv_norm", parts[4]])
        state[name] = tensor
    return state


def write_official(hf_dir: Path, path: Path, state: dict[str, Any] | None = None) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in (state or official_state(hf_dir)).items()}, path / "model.safetensors")
    (path / "config.json").write_text((hf_dir / "config.json").read_text())
    return path


def write_mp8(hf_dir: Path, path: Path, num_experts: int) -> Path:
    """What the official ``convert.py --model-parallel 8`` writes: one file per rank."""
    import re

    from safetensors.torch import save_file

    world = 8
    dim0 = ("embed", "wq_b", "wo_a", "head", "weights_proj")
    per_rank = num_experts // world
    ranks: list[dict[str, Any]] = [{} for _ in range(world)]
    for name, tensor in official_state(hf_dir).items():
        expert = re.search(r"\.experts\.(\d+)\.", name)
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        for rank in range(world):
            if expert:
                if int(expert.group(1)) // per_rank == rank:
                    ranks[rank][name] = tensor
            elif module in dim0 or name.endswith("attn_sink"):
                ranks[rank][name] = tensor.chunk(world, dim=0)[rank].contiguous()
            elif module == "wo_b":
                ranks[rank][name] = tensor.chunk(world, dim=1)[rank].contiguous()
            else:
                ranks[rank][name] = tensor
    path.mkdir(parents=True, exist_ok=True)
    for rank, state in enumerate(ranks):
        save_file(state, path / f"model{rank}-mp{world}.safetensors")
    (path / "config.json").write_text((hf_dir / "config.json").read_text())
    return path


_FP8_LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
_FP4_VALUES = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]


def _quantize_fp8(weight: Any) -> tuple[Any, Any, Any]:
    """(e4m3 codes, e8m0 128×128 block scales, the dequantised weight), in torch."""
    import torch

    out_features, in_features = weight.shape
    rows, cols = -(-out_features // 128), -(-in_features // 128)
    padded = torch.zeros(rows * 128, cols * 128)
    padded[:out_features, :in_features] = weight
    amax = padded.view(rows, 128, cols, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))  # a power of two: exact in e8m0
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_features, :in_features]
    codes = (weight / expanded).to(torch.float8_e4m3fn)
    return codes, scale.to(torch.float8_e8m0fnu), codes.float() * expanded


def _quantize_fp4(weight: Any) -> tuple[Any, Any, Any]:
    """(I8 [out, in/2] two e2m1 codes per byte, low nibble first; e8m0 scales per 32; dequantised)."""
    import torch

    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-12) / 6.0)))
    values = torch.tensor(_FP4_VALUES)
    scaled = (groups / scale[..., None]).reshape(out_features, in_features)
    codes = (scaled[..., None] - values).abs().argmin(-1)  # nearest code (ties: the lower index)
    dequantised = values[codes] * scale.repeat_interleave(32, 1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu), dequantised


def write_quantized(hf_dir: Path, path: Path) -> tuple[Path, dict[str, Any]]:
    """An official-name checkpoint the way DeepSeek ships V4: attention linears, the indexer's
    wq_b and the shared experts FP8 with e8m0 block scales, routed experts FP4 (I8 as
    ``convert.py`` writes them; layer 1's as safetensors F4, torch's float4_e2m1fn_x2), compressor
    and indexer wkv/wgate BF16 — except layer 3's compressor, FP8 with a .scale like Flash-Base.
    Returns the directory and the dequantised official state (for the HF reference)."""
    import torch

    quantized, dequantised = {}, {}
    for name, tensor in official_state(hf_dir).items():
        module, _, leaf = name.rpartition(".")
        kind = module.rsplit(".", 1)[-1]
        fp8 = leaf == "weight" and (
            (kind in _FP8_LINEARS and ".compressor." not in name)
            or ".shared_experts." in name
            or (name.startswith("layers.3.attn.compressor.") and kind in ("wkv", "wgate")))
        fp4 = leaf == "weight" and ".ffn.experts." in name
        if fp8 or fp4:
            codes, scale, value = (_quantize_fp8 if fp8 else _quantize_fp4)(tensor.float())
            if fp4 and name.startswith("layers.1."):
                codes = codes.view(torch.float4_e2m1fn_x2)
            quantized[name], quantized[module + ".scale"] = codes, scale
            dequantised[name] = value
        elif leaf == "weight" and kind in ("wkv", "wgate"):
            quantized[name] = tensor.to(torch.bfloat16)
            dequantised[name] = quantized[name].float()
        else:
            quantized[name] = dequantised[name] = tensor
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    config["expert_dtype"] = "fp4"
    write_official(hf_dir, path, quantized)
    (path / "config.json").write_text(json.dumps(config))
    return path, dequantised


def hf_from_official(state: dict[str, Any], config: dict[str, Any], path: Path) -> Any:
    """An HF model loaded from an official-name fp32 checkpoint (HF's own renaming)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.float().contiguous() if v.is_floating_point() else v for k, v in state.items()},
              path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    return model


# --- a tiny tokenizer with the DeepSeek-V4 special tokens --------------------------------------------

SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                  "</think>", "<tool_result>", "</tool_result>"]


def write_tokenizer(path: Path) -> Path:
    """Character-level tokenizer.json (ids < 128) + tokenizer_config.json without a chat template,
    like the real checkpoint (whose template is DeepSeek's Python encoder)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + ["<unk>"] + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(".|\\n"), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "add_bos_token": False}))
    return path
