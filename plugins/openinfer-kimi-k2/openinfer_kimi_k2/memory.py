"""What a Kimi-K2 / DeepSeek-V3 model holds per GPU, from config.json alone (``openinfer plan``).

Bytes per element follow the checkpoint's ``quantization_config`` as served on a GPU (kept
packed, dequantized inside the GEMM): INT4 pack-quantized = 0.5 byte + one bf16 scale per
``group_size`` weights; FP8 block = 1 byte + one fp32 scale per block; the rest bf16. Routed
experts split over the expert-parallel ranks; attention, dense layers, shared experts,
embedding and LM head are held by every rank (attention is replicated), and so is the MLA
latent cache (``kv_split="replicated"``: one 576-wide row per token and layer on every rank).
"""

from __future__ import annotations

from openinfer import ModelMemory, TensorPlacement
from openinfer_kimi_k2.config import KimiK2Config

BF16 = 2.0


def _bytes_per_element(config: KimiK2Config, module: str) -> float:
    quant = config.quant
    if not quant.applies_to(module):
        return BF16
    if quant.method == "int4":
        return 0.5 + BF16 / quant.group_size
    if quant.method == "fp8":
        return 1.0 + 4.0 / (quant.block[0] * quant.block[1])
    return BF16


def kimi_model_memory(config: KimiK2Config) -> ModelMemory:
    c, hidden = config, config.hidden_size
    tensors: dict[str, TensorPlacement] = {}

    def linear(module: str, rows: int, cols: int, split: str) -> None:
        tensors[module + ".weight"] = TensorPlacement((rows, cols), _bytes_per_element(c, module), split)

    def vector(name: str, size: int) -> None:
        tensors[name] = TensorPlacement((size,), BF16, "replicated")

    def swiglu(module: str, intermediate: int, split: str) -> None:
        linear(module + ".gate_proj", intermediate, hidden, split)
        linear(module + ".up_proj", intermediate, hidden, split)
        linear(module + ".down_proj", hidden, intermediate, split)

    heads = c.num_attention_heads
    tensors["model.embed_tokens.weight"] = TensorPlacement((c.vocab_size, hidden), BF16, "vocab")
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = TensorPlacement((c.vocab_size, hidden), BF16, "vocab")
    vector("model.norm.weight", hidden)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = p + ".self_attn"
        if c.q_lora_rank:
            linear(attn + ".q_a_proj", c.q_lora_rank, hidden, "replicated")
            vector(attn + ".q_a_layernorm.weight", c.q_lora_rank)
            linear(attn + ".q_b_proj", heads * c.qk_head_dim, c.q_lora_rank, "replicated")
        else:
            linear(attn + ".q_proj", heads * c.qk_head_dim, hidden, "replicated")
        linear(attn + ".kv_a_proj_with_mqa", c.latent_dim, hidden, "replicated")
        vector(attn + ".kv_a_layernorm.weight", c.kv_lora_rank)
        linear(attn + ".kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, "replicated")
        linear(attn + ".o_proj", hidden, heads * c.v_head_dim, "replicated")
        vector(p + ".input_layernorm.weight", hidden)
        vector(p + ".post_attention_layernorm.weight", hidden)
        if c.is_moe_layer(i):
            tensors[p + ".mlp.gate.weight"] = TensorPlacement((c.n_routed_experts, hidden), 4.0, "replicated")
            for e in range(c.n_routed_experts):
                swiglu(f"{p}.mlp.experts.{e}", c.moe_intermediate_size, "experts")
            if c.n_shared_experts:
                swiglu(p + ".mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts, "replicated")
        else:
            swiglu(p + ".mlp", c.intermediate_size, "replicated")
    return ModelMemory(tensors, kv_bytes_per_token=int(c.latent_dim * BF16 * c.num_hidden_layers), num_kv_heads=1,
                       kv_split="replicated",
                       description=f"{c.model_type} ({c.num_hidden_layers} layers, {c.n_routed_experts} experts, "
                                   f"{c.quant.method} weights)")
