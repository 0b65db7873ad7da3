"""Checkpoint tensors → backend weights, in the layout ``model.py`` computes with.

Per layer, the HF tensors are fused so each step runs one GEMM where HF runs two or three::

    model.layers.{i}.self_attn.{q,k,v}_proj.weight  →  qkv      [q_size + 2*kv_size, hidden]
    model.layers.{i}.mlp.{gate,up}_proj.weight      →  gate_up  [2*intermediate,     hidden]

``backend.linear_weight`` then stores each matrix the way its backend wants it (NumPy:
transposed, contiguous fp32). The LM head is ``lm_head.weight`` or, tied, the embedding table.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from openinfer import (
    AttentionSpec,
    Backend,
    Checkpoint,
    DecoderLayer,
    DecoderStack,
    RotaryEmbedding,
    fuse_rows,
)
from openinfer_llama.config import LlamaConfig


def check_shapes(checkpoint: Checkpoint, config: LlamaConfig) -> None:
    """Fail before loading anything when config.json and the tensors disagree."""
    c = config
    checkpoint.expect_shape("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        checkpoint.expect_shape(p + "self_attn.q_proj.weight", (c.q_size, c.hidden_size))
        checkpoint.expect_shape(p + "self_attn.k_proj.weight", (c.kv_size, c.hidden_size))
        checkpoint.expect_shape(p + "self_attn.v_proj.weight", (c.kv_size, c.hidden_size))
        checkpoint.expect_shape(p + "self_attn.o_proj.weight", (c.hidden_size, c.q_size))
        checkpoint.expect_shape(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size))
        checkpoint.expect_shape(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size))
        checkpoint.expect_shape(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size))


def _bias(checkpoint: Checkpoint, *names: str) -> np.ndarray:
    return fuse_rows(*(checkpoint.get(name) for name in names))


def load_layer(checkpoint: Checkpoint, config: LlamaConfig, ops: Backend, rope: RotaryEmbedding,
               index: int) -> DecoderLayer:
    c, p = config, f"model.layers.{index}."
    attn, mlp = p + "self_attn.", p + "mlp."
    qkv_bias = _bias(checkpoint, *(f"{attn}{n}_proj.bias" for n in "qkv")) if c.attention_bias else None
    o_bias = checkpoint.get(attn + "o_proj.bias") if c.attention_bias else None
    gate_up_bias = _bias(checkpoint, mlp + "gate_proj.bias", mlp + "up_proj.bias") if c.mlp_bias else None
    down_bias = checkpoint.get(mlp + "down_proj.bias") if c.mlp_bias else None
    return DecoderLayer(
        input_norm=ops.weight(checkpoint.get(p + "input_layernorm.weight")),
        qkv=ops.linear_weight(fuse_rows(*(checkpoint.get(f"{attn}{n}_proj.weight") for n in "qkv")), qkv_bias),
        attention=AttentionSpec(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                head_dim=c.head_dim, rope=rope, scale=c.head_dim**-0.5),
        o_proj=ops.linear_weight(checkpoint.get(attn + "o_proj.weight"), o_bias),
        post_attention_norm=ops.weight(checkpoint.get(p + "post_attention_layernorm.weight")),
        gate_up=ops.linear_weight(fuse_rows(checkpoint.get(mlp + "gate_proj.weight"),
                                            checkpoint.get(mlp + "up_proj.weight")), gate_up_bias),
        down=ops.linear_weight(checkpoint.get(mlp + "down_proj.weight"), down_bias),
    )


def load_llama(checkpoint: Checkpoint, config: LlamaConfig, ops: Backend, rope: RotaryEmbedding,
               progress: Any = None) -> DecoderStack:
    """The whole decoder; ``progress`` (a tqdm bar, optional) advances once per layer."""
    check_shapes(checkpoint, config)
    layers = []
    for index in range(config.num_hidden_layers):
        layers.append(load_layer(checkpoint, config, ops, rope, index))
        if progress is not None:
            progress.update(1)
    embed = checkpoint.get("model.embed_tokens.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in checkpoint
    lm_head = embed if tied else checkpoint.get("lm_head.weight")
    return DecoderStack(embed_tokens=ops.weight(embed), layers=layers,
                        final_norm=ops.weight(checkpoint.get("model.norm.weight")),
                        lm_head=ops.linear_weight(lm_head), eps=config.rms_norm_eps)
