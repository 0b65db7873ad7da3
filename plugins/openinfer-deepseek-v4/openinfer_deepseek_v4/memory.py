"""What a DeepSeek-V4 model holds per GPU, from config.json alone (``openinfer plan``).

Bytes as served on a GPU with the weights kept packed: routed experts FP4 e2m1 (0.5 byte + one
e8m0 scale per 32 inputs), the attention projections and shared experts FP8 e4m3 (1 byte + one
e8m0 scale per 128×128 block), the rest bf16 (fp32 where the checkpoint is: hyper-connections,
sinks, gate bias). Routed experts split over the expert-parallel ranks; everything else is held by
every rank. KV per token: each CSA/HCA layer's compressed entries (``head_dim`` per ``rate``
tokens, plus the CSA indexer's keys), bf16; the 128-token sliding windows are a fixed cost per
sequence (counted in the reserve, not per token). The MTP block is not served and not counted.
"""

from __future__ import annotations

from openinfer import ModelMemory, TensorPlacement
from openinfer_deepseek_v4.config import CSA, SLIDING, DeepseekV4Config

BF16, FP32 = 2.0, 4.0
FP4 = 0.5 + 1.0 / 32
FP8 = 1.0 + 1.0 / (128 * 128)


def deepseek_v4_model_memory(config: DeepseekV4Config) -> ModelMemory:
    c, hidden = config, config.hidden_size
    tensors: dict[str, TensorPlacement] = {}

    def add(name: str, shape: tuple[int, ...], bytes_per_element: float, split: str = "replicated") -> None:
        tensors[name] = TensorPlacement(shape, bytes_per_element, split)

    add("embed.weight", (c.vocab_size, hidden), BF16, "vocab")
    add("head.weight", (c.vocab_size, hidden), BF16, "vocab")
    hc = c.hc_mult * hidden
    mix = (2 + c.hc_mult) * c.hc_mult
    heads_dim = c.num_attention_heads * c.head_dim
    inter = c.moe_intermediate_size
    kv_per_token = 0.0
    for i, kind in enumerate(c.layer_types):
        p = f"layers.{i}."
        for hyper in ("hc_attn", "hc_ffn"):
            add(f"{p}{hyper}_fn", (mix, hc), FP32)
        add(p + "attn.wq_a.weight", (c.q_lora_rank, hidden), FP8)
        add(p + "attn.wq_b.weight", (heads_dim, c.q_lora_rank), FP8)
        add(p + "attn.wkv.weight", (c.head_dim, hidden), FP8)
        add(p + "attn.wo_a.weight", (c.o_groups * c.o_lora_rank, heads_dim // c.o_groups), FP8)
        add(p + "attn.wo_b.weight", (hidden, c.o_groups * c.o_lora_rank), FP8)
        if kind != SLIDING:
            rate = c.compress_rate(kind)
            width = (2 if kind == CSA else 1) * c.head_dim
            add(p + "attn.compressor.wkv.weight", (width, hidden), BF16)
            add(p + "attn.compressor.wgate.weight", (width, hidden), BF16)
            kv_per_token += c.head_dim * BF16 / rate
            if kind == CSA:
                add(p + "attn.indexer.wq_b.weight", (c.index_n_heads * c.index_head_dim, c.q_lora_rank), FP8)
                add(p + "attn.indexer.weights_proj.weight", (c.index_n_heads, hidden), BF16)
                add(p + "attn.indexer.compressor.wkv.weight", (2 * c.index_head_dim, hidden), BF16)
                add(p + "attn.indexer.compressor.wgate.weight", (2 * c.index_head_dim, hidden), BF16)
                kv_per_token += c.index_head_dim * BF16 / rate
        add(p + "ffn.gate.weight", (c.n_routed_experts, hidden), BF16)
        for e in range(c.n_routed_experts):
            for w, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
                add(f"{p}ffn.experts.{e}.{w}.weight", shape, FP4, "experts")
        shared = inter * c.n_shared_experts
        for w, shape in (("w1", (shared, hidden)), ("w3", (shared, hidden)), ("w2", (hidden, shared))):
            add(f"{p}ffn.shared_experts.{w}.weight", shape, FP8)
    return ModelMemory(tensors, kv_bytes_per_token=max(1, round(kv_per_token)), num_kv_heads=1,
                       kv_split="replicated",
                       description=f"deepseek_v4 ({c.num_hidden_layers} layers, {c.n_routed_experts} FP4 experts)")
