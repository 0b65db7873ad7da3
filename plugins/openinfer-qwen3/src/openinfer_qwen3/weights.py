"""Checkpoint tensors → backend weights: fused qkv and gate_up, tied or separate LM head."""

from __future__ import annotations

from openinfer import (
    AttentionSpec,
    Backend,
    Checkpoint,
    DecoderLayer,
    DecoderStack,
    RotaryEmbedding,
    fuse_rows,
)
from openinfer_qwen3.config import Qwen3Config


def load_qwen3(checkpoint: Checkpoint, config: Qwen3Config, ops: Backend, rope: RotaryEmbedding,
               progress=None) -> DecoderStack:
    c = config
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    checkpoint.expect_shape("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        checkpoint.expect_shape(p + "self_attn.q_proj.weight", (q_size, c.hidden_size))
        checkpoint.expect_shape(p + "self_attn.k_proj.weight", (kv_size, c.hidden_size))
        qkv_bias = o_bias = None
        if c.attention_bias:
            qkv_bias = fuse_rows(*(checkpoint.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"))
            o_bias = checkpoint.get(p + "self_attn.o_proj.bias")
        spec = AttentionSpec(
            num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
            rope=rope, scale=c.head_dim**-0.5,
            q_norm=ops.weight(checkpoint.get(p + "self_attn.q_norm.weight")),
            k_norm=ops.weight(checkpoint.get(p + "self_attn.k_norm.weight")),
            norm_eps=c.rms_norm_eps)
        layers.append(DecoderLayer(
            input_norm=ops.weight(checkpoint.get(p + "input_layernorm.weight")),
            qkv=ops.linear_weight(fuse_rows(*(checkpoint.get(p + f"self_attn.{n}_proj.weight") for n in "qkv")),
                                  qkv_bias),
            attention=spec,
            o_proj=ops.linear_weight(checkpoint.get(p + "self_attn.o_proj.weight"), o_bias),
            post_attention_norm=ops.weight(checkpoint.get(p + "post_attention_layernorm.weight")),
            gate_up=ops.linear_weight(fuse_rows(checkpoint.get(p + "mlp.gate_proj.weight"),
                                                checkpoint.get(p + "mlp.up_proj.weight"))),
            down=ops.linear_weight(checkpoint.get(p + "mlp.down_proj.weight")),
        ))
        if progress is not None:
            progress.update(1)
    embed = checkpoint.get("model.embed_tokens.weight")
    tied = c.tie_word_embeddings or "lm_head.weight" not in checkpoint
    lm_head = embed if tied else checkpoint.get("lm_head.weight")
    return DecoderStack(embed_tokens=ops.weight(embed), layers=layers,
                        final_norm=ops.weight(checkpoint.get("model.norm.weight")),
                        lm_head=ops.linear_weight(lm_head), eps=c.rms_norm_eps)
