"""Tiny random Qwen3.5 checkpoints (HF transformers is the reference, test-only) and a direct
model driver that builds ``ForwardBatch``es by hand, without the engine."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from openinfer_qwen35.plugin import build_model

from openinfer import EngineOptions, ForwardBatch, create_backend
from openinfer.kv import BlockPool, KVCacheManager, StateSlots, group_specs

# nv > nk (value heads share key heads), dk != dv, partial RoPE with an mrope section,
# layer kinds given explicitly with a full-attention layer in the middle.
TINY_QWEN35: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}

# The other spellings: layer kinds from full_attention_interval, tied embeddings, q/k/v/o biases,
# default partial_rotary_factor (0.25), single key head shared by 3 value heads.
TINY_QWEN35_VARIANT: dict[str, Any] = {
    **{k: v for k, v in TINY_QWEN35.items() if k not in ("layer_types", "rope_parameters")},
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "tie_word_embeddings": True,
    "attention_bias": True,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 3,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
}


def randomize(model: Any, seed: int) -> None:
    """Every parameter random, including what HF initialises to constants (norms at 0/1,
    dt_bias at 1): zero-centred norms around 0, the gated output norm around 1.

    Decay rates A = exp(A_log) are drawn from [0.02, 0.5]: with faster decays the fp32 HF
    reference itself drifts (its in-chunk cumulative log-decay, summed in fp32, reaches the
    hundreds) by more than the 1e-4 being tested. Fast decays are covered op by op
    (test_qwen35_gated_deltanet) against HF's delta-rule functions."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def randn(shape: Any) -> Any:
        return torch.randn(shape, generator=generator)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                value = torch.empty(param.shape).uniform_(math.log(0.02), math.log(0.5), generator=generator)
            elif name.endswith("dt_bias"):
                value = 0.5 * randn(param.shape)
            elif name.endswith("linear_attn.norm.weight"):
                value = 1.0 + 0.3 * randn(param.shape)
            elif "norm" in name:
                value = 0.3 * randn(param.shape)
            elif name.endswith("conv1d.weight"):
                value = 0.4 * randn(param.shape)
            elif name.endswith("embed_tokens.weight"):
                value = 0.25 * randn(param.shape)  # tied heads: keeps logits O(1)
            elif param.ndim == 2:
                value = randn(param.shape) / math.sqrt(param.shape[1])
            else:  # biases
                value = 0.2 * randn(param.shape)
            param.copy_(value)


def hf_text_config(config: dict[str, Any]) -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})


def make_hf_model(seed: int = 0, base: dict[str, Any] | None = None, **overrides: Any) -> tuple[Any, dict[str, Any]]:
    import torch
    from transformers import Qwen3_5ForCausalLM

    config = {**(base or TINY_QWEN35), **overrides}
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(hf_text_config(config)).eval()
    randomize(model, seed)
    return model, config


def write_text_checkpoint(path: Path, model: Any, config: dict[str, Any]) -> Path:
    """config.json + model.safetensors with HF's own names (``model.``, ``lm_head.``)."""
    model.save_pretrained(path, safe_serialization=True)
    saved = json.loads((path / "config.json").read_text())
    saved.update(config)
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


def write_multimodal_checkpoint(path: Path, model: Any, config: dict[str, Any]) -> Path:
    """The layout of real Qwen3.5 releases: text weights under ``model.language_model.``, a
    vision tower under ``model.visual.`` and an MTP head under ``mtp.`` (both to be ignored),
    and a config whose language-model fields sit under ``text_config``."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        target = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        tensors[target] = tensor.detach().numpy().astype(np.float32)
    rng = np.random.default_rng(7)
    tensors["model.visual.patch_embed.proj.weight"] = rng.standard_normal((8, 3, 2, 4, 4)).astype(np.float32)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = rng.standard_normal((24, 8)).astype(np.float32)
    tensors["mtp.fc.weight"] = rng.standard_normal((48, 96)).astype(np.float32)
    tensors["mtp.layers.0.input_layernorm.weight"] = rng.standard_normal(48).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    text = {k: v for k, v in config.items() if k != "architectures"}
    multimodal = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 8, "model_type": "qwen3_5_vision"},
        "image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 92, "vision_end_token_id": 93,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }
    (path / "config.json").write_text(json.dumps(multimodal, indent=2))
    return path


def hf_logits(model: Any, token_ids: Sequence[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].numpy()


def hf_greedy(model: Any, prompt: Sequence[int], num_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=num_tokens, do_sample=False,
                             min_new_tokens=num_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def load_model(path: Path, **options: Any) -> Any:
    config = json.loads((path / "config.json").read_text())
    return build_model(path, config, create_backend("cpu"), EngineOptions.from_kwargs(device="cpu", **options))


class Driver:
    """Runs a model directly: each ``step`` takes ``{request_id: new_tokens}`` and returns the
    logits of every new token (``all_rows``) or of each request's last new token. Caches come
    from the model's KV cache specs (attention blocks and GDN state slots), as in the engine."""

    def __init__(self, model: Any, num_blocks: int = 96, block_size: int = 16, num_slots: int = 66):
        self.model = model
        specs = model.kv_cache_specs()
        groups = group_specs(specs)
        self.state_slots = StateSlots(num_slots)
        self.kv = KVCacheManager(BlockPool(num_blocks, block_size, enable_prefix_cache=False), groups=groups,
                                 state_slots=self.state_slots)
        self.kv_cache = [model.backend.allocate_kv(s, num_blocks if s.paged else num_slots, block_size)
                         for s in specs]
        self.attention_group = groups.paged_groups[0].group_id
        self.tokens: dict[str, list[int]] = {}

    def batch(self, new_tokens: dict[str, Sequence[int]], all_rows: bool = False
              ) -> tuple[ForwardBatch, list[list[int]]]:
        """The host batch of one step (the requests' tokens advance) and each request's rows."""
        block_size = self.kv.block_size
        token_ids, positions, slot_mapping, query_start, context_lens, rows = [], [], [], [0], [], []
        tables = []
        for request_id, tokens in new_tokens.items():
            if request_id not in self.tokens:
                self.tokens[request_id] = []
                self.kv.start_request(request_id, [], use_cache=False)
            start = len(self.tokens[request_id])
            self.tokens[request_id].extend(int(t) for t in tokens)
            end = len(self.tokens[request_id])
            assert self.kv.grow(request_id, end)
            table = np.asarray(self.kv.group_tables(request_id)[self.attention_group], np.int64)
            span = np.arange(start, end)
            token_ids.extend(tokens)
            positions.extend(span.tolist())
            slot_mapping.extend((table[span // block_size] * block_size + span % block_size).tolist())
            first = query_start[-1]
            query_start.append(first + len(tokens))
            context_lens.append(end)
            tables.append(table)
            rows.append(list(range(first, first + len(tokens))) if all_rows else [first + len(tokens) - 1])
        block_tables = np.zeros((len(tables), max(len(t) for t in tables)), np.int32)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = table
        batch = ForwardBatch(
            token_ids=np.asarray(token_ids, np.int32), positions=np.asarray(positions, np.int32),
            query_start=np.asarray(query_start, np.int32), context_lens=np.asarray(context_lens, np.int32),
            block_tables=block_tables, slot_mapping=np.asarray(slot_mapping, np.int32),
            logits_rows=np.asarray([r for rs in rows for r in rs], np.int32),
            max_query_len=max(len(t) for t in new_tokens.values()), max_context_len=max(context_lens),
            request_ids=tuple(new_tokens),
            state_slots=np.asarray([self.kv.state_slot(r) for r in new_tokens], np.int32))
        return batch, rows

    def step(self, new_tokens: dict[str, Sequence[int]], all_rows: bool = False) -> list[np.ndarray]:
        batch, rows = self.batch(new_tokens, all_rows)
        backend = self.model.backend
        logits = backend.to_host(self.model.forward(backend.prepare_batch(batch), self.kv_cache))
        out, offset = [], 0
        for rs in rows:
            out.append(logits[offset : offset + len(rs)])
            offset += len(rs)
        return out

    def release(self, request_id: str) -> None:
        self.kv.free_request(request_id)
        self.tokens.pop(request_id, None)

    def greedy(self, request_id: str, prompt: Sequence[int], num_tokens: int) -> list[int]:
        logits = self.step({request_id: prompt})[0][-1]
        out = []
        for _ in range(num_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            logits = self.step({request_id: [token]})[0][-1]
        return out
