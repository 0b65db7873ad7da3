"""DeepSeek-V4 weights: the checkpoint's tensors, shape-checked against the config, per layer.

Linears go through ``backend.linear_weight`` (the NumPy backend keeps a transposed fp32 copy);
everything the model mixes in fp32 by hand (mHC ``fn``/``base``/``scale``, ``attn_sink``,
compressor ``ape``, router weight and bias, ``tid2eid``) stays a host NumPy array. The grouped
output projection ``wo_a`` ``[groups·o_lora, H·D/groups]`` is kept as ``[groups, o_lora, H·D/groups]``.

``mtp.0.*`` (the multi-token-prediction block: one more layer plus ``e_proj``/``h_proj``,
``enorm``/``hnorm``, its own ``norm`` and ``hc_head``) is loaded and shape-checked when the
checkpoint has it, and not used: it serves speculative decoding, which this plugin does not
offer yet. HF-saved checkpoints drop it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer import Backend, WeightLoadError
from openinfer.moe import ExpertWeights, MoEWeights, RouterSpec
from openinfer_deepseek_v4.checkpoint import DeepseekV4Checkpoint
from openinfer_deepseek_v4.config import CSA, HASH_MOE, HCA, SLIDING, DeepseekV4Config


@dataclass
class HyperConnectionWeights:
    fn: np.ndarray  # [(2 + hc)·hc, hc·hidden] (the head: [hc, hc·hidden])
    base: np.ndarray
    scale: np.ndarray  # [3] (the head: [1])


@dataclass
class CompressorWeights:
    """Pools ``ratio`` tokens into one entry of ``head_dim``. ``overlap`` (CSA): the projections
    are ``2·head_dim`` wide and entry w also pools the first half of window w−1."""

    wkv: Any
    wgate: Any
    ape: np.ndarray  # [ratio, c·head_dim]
    norm: Any  # [head_dim]
    ratio: int
    head_dim: int
    overlap: bool


@dataclass
class IndexerWeights:
    wq_b: Any  # [heads·head_dim, q_lora]
    weights_proj: Any  # [heads, hidden]
    compressor: CompressorWeights
    num_heads: int
    head_dim: int
    topk: int


@dataclass
class AttentionWeights:
    wq_a: Any
    q_norm: Any
    wq_b: Any
    wkv: Any
    kv_norm: Any
    wo_a: np.ndarray  # [groups, o_lora, H·D/groups]
    wo_b: Any
    sink: np.ndarray  # [H]
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


@dataclass
class LayerWeights:
    attn_norm: Any
    ffn_norm: Any
    hc_attn: HyperConnectionWeights
    hc_ffn: HyperConnectionWeights
    attn: AttentionWeights
    ffn: MoEWeights


@dataclass
class MTPWeights:
    layer: LayerWeights
    e_proj: Any
    h_proj: Any
    enorm: Any
    hnorm: Any
    norm: Any
    hc_head: HyperConnectionWeights


@dataclass
class DeepseekV4Weights:
    embed: Any
    head: Any
    norm: Any
    hc_head: HyperConnectionWeights
    layers: list[LayerWeights]
    mtp: MTPWeights | None = None


# (checkpoint, the layer's expert module prefixes "layers.{i}.ffn.experts.{e}.", in/out sizes)
# -> a backend's stacked copy of every expert (``MoEWeights.stacked``)
ExpertStacker = Callable[[DeepseekV4Checkpoint, list[str], int, int], Any]
# (checkpoint, modules whose rows make one linear (several: a fused gate_up), [out, in]) -> the
# backend's copy of that linear in its stored format, or None to take it dequantised
DenseLinearLoader = Callable[[DeepseekV4Checkpoint, list[str], tuple[int, int]], Any]


def load_weights(ckpt: DeepseekV4Checkpoint, config: DeepseekV4Config, backend: Backend,
                 progress: bool = False, experts: slice | None = None,
                 stack_experts: ExpertStacker | None = None,
                 dense_linear: DenseLinearLoader | None = None) -> DeepseekV4Weights:
    """``experts``: the routed experts this rank holds under expert parallelism (the others stay
    ``None``); default all. ``stack_experts``: a backend that runs the experts as one grouped
    GEMM in their stored format (cuda) gets them stacked by it instead of one linear each.
    ``dense_linear``: a backend that runs quantised dense linears as stored (cuda, FP8) gets
    first say over each one (and the shared experts' fused gate_up)."""
    c = config
    held = experts or slice(0, c.n_routed_experts)
    hc_flat = c.hc_mult * c.hidden_size

    def fused_linear(modules: list[str], shape: tuple[int, int]) -> Any:
        kept = None if dense_linear is None else dense_linear(ckpt, modules, shape)
        if kept is not None:
            return kept
        part = (shape[0] // len(modules), shape[1])
        rows = [ckpt.weight(m, part) for m in modules]
        return backend.linear_weight(rows[0] if len(rows) == 1 else np.concatenate(rows))

    def linear(module: str, shape: tuple[int, int]) -> Any:
        return fused_linear([module], shape)

    def norm(name: str, size: int) -> Any:
        return backend.weight(ckpt.vector(name, (size,)))

    def hyper(prefix: str, rows: int, scales: int) -> HyperConnectionWeights:
        return HyperConnectionWeights(ckpt.vector(f"{prefix}_fn", (rows, hc_flat)), ckpt.vector(f"{prefix}_base", (rows,)),
                                      ckpt.vector(f"{prefix}_scale", (scales,)))

    mix = (2 + c.hc_mult) * c.hc_mult

    def layer(p: str, kind: str, hashed: bool) -> LayerWeights:
        return LayerWeights(
            attn_norm=norm(p + "attn_norm.weight", c.hidden_size), ffn_norm=norm(p + "ffn_norm.weight", c.hidden_size),
            hc_attn=hyper(p + "hc_attn", mix, 3), hc_ffn=hyper(p + "hc_ffn", mix, 3),
            attn=_attention(ckpt, c, p, kind, linear, norm),
            ffn=_moe(ckpt, c, p, hashed, fused_linear, held, stack_experts))

    layers = [layer(f"layers.{i}.", c.layer_types[i], c.mlp_layer_types[i] == HASH_MOE)
              for i in range(c.num_hidden_layers)]
    mtp = None
    if "mtp.0.e_proj.weight" in ckpt:
        square = (c.hidden_size, c.hidden_size)
        mtp = MTPWeights(layer("mtp.0.", c.mtp_layer_type, False), linear("mtp.0.e_proj", square),
                         linear("mtp.0.h_proj", square), norm("mtp.0.enorm.weight", c.hidden_size),
                         norm("mtp.0.hnorm.weight", c.hidden_size), norm("mtp.0.norm.weight", c.hidden_size),
                         hyper("mtp.0.hc_head", c.hc_mult, 1))
    head_name = "head" if "head.weight" in ckpt or not c.tie_word_embeddings else "embed"
    embed = ckpt.weight("embed", (c.vocab_size, c.hidden_size))
    head = embed if head_name == "embed" else ckpt.weight("head", (c.vocab_size, c.hidden_size))
    return DeepseekV4Weights(
        embed=backend.weight(embed), head=backend.linear_weight(head), norm=norm("norm.weight", c.hidden_size),
        hc_head=hyper("hc_head", c.hc_mult, 1), layers=layers, mtp=mtp)


def _compressor(ckpt: DeepseekV4Checkpoint, prefix: str, hidden: int, head_dim: int, ratio: int, overlap: bool,
                linear: Any, norm: Any) -> CompressorWeights:
    width = (2 if overlap else 1) * head_dim
    return CompressorWeights(
        wkv=linear(prefix + "wkv", (width, hidden)), wgate=linear(prefix + "wgate", (width, hidden)),
        ape=ckpt.vector(prefix + "ape", (ratio, width)), norm=norm(prefix + "norm.weight", head_dim),
        ratio=ratio, head_dim=head_dim, overlap=overlap)


def _attention(ckpt: DeepseekV4Checkpoint, c: DeepseekV4Config, layer: str, kind: str, linear: Any,
               norm: Any) -> AttentionWeights:
    p = layer + "attn."
    heads_dim = c.num_attention_heads * c.head_dim
    per_group = heads_dim // c.o_groups
    wo_a = ckpt.weight(p + "wo_a", (c.o_groups * c.o_lora_rank, per_group))
    compressor = indexer = None
    if kind != SLIDING:
        compressor = _compressor(ckpt, p + "compressor.", c.hidden_size, c.head_dim, c.compress_rate(kind),
                                 kind == CSA, linear, norm)
    if kind == CSA:
        indexer = IndexerWeights(
            wq_b=linear(p + "indexer.wq_b", (c.index_n_heads * c.index_head_dim, c.q_lora_rank)),
            weights_proj=linear(p + "indexer.weights_proj", (c.index_n_heads, c.hidden_size)),
            compressor=_compressor(ckpt, p + "indexer.compressor.", c.hidden_size, c.index_head_dim,
                                   c.compress_rate(CSA), True, linear, norm),
            num_heads=c.index_n_heads, head_dim=c.index_head_dim, topk=c.index_topk)
    elif kind == HCA and f"{p}indexer.wq_b.weight" in ckpt:
        raise WeightLoadError(f"{layer} is HCA in config.json but the checkpoint has an indexer for it")
    return AttentionWeights(
        wq_a=linear(p + "wq_a", (c.q_lora_rank, c.hidden_size)), q_norm=norm(p + "q_norm.weight", c.q_lora_rank),
        wq_b=linear(p + "wq_b", (heads_dim, c.q_lora_rank)), wkv=linear(p + "wkv", (c.head_dim, c.hidden_size)),
        kv_norm=norm(p + "kv_norm.weight", c.head_dim),
        wo_a=np.ascontiguousarray(wo_a.reshape(c.o_groups, c.o_lora_rank, per_group)),
        wo_b=linear(p + "wo_b", (c.hidden_size, c.o_groups * c.o_lora_rank)),
        sink=ckpt.vector(p + "attn_sink", (c.num_attention_heads,)), compressor=compressor, indexer=indexer)


def _moe(ckpt: DeepseekV4Checkpoint, c: DeepseekV4Config, layer: str, is_hash: bool, fused_linear: Any,
         held: slice, stack_experts: ExpertStacker | None = None) -> MoEWeights:
    """Core's MoE layer: sqrt-softplus (or the configured) scores, hash or biased top-k choice,
    weights always renormalised (the reference divides by their sum whatever norm_topk_prob
    says) and scaled, SwiGLU clamped at swiglu_limit; experts' w1/w3 fused into gate_up."""
    p = layer + "ffn."
    inter = c.moe_intermediate_size

    def expert(prefix: str, width: int) -> ExpertWeights:
        return ExpertWeights(gate_up=fused_linear([prefix + "w1", prefix + "w3"], (2 * width, c.hidden_size)),
                             down=fused_linear([prefix + "w2"], (c.hidden_size, width)))

    tid2eid = bias = None
    if is_hash:
        name = p + "gate.tid2eid"
        tid2eid = np.asarray(ckpt.raw(name)).astype(np.int64)
        if tid2eid.shape != (c.vocab_size, c.num_experts_per_tok):
            raise WeightLoadError(f"tensor {name} has shape {tid2eid.shape}, expected "
                                  f"({c.vocab_size}, {c.num_experts_per_tok})")
        if tid2eid.min() < 0 or tid2eid.max() >= c.n_routed_experts:
            raise WeightLoadError(f"tensor {name} names experts outside 0..{c.n_routed_experts - 1}")
    else:
        bias = ckpt.vector(p + "gate.bias", (c.n_routed_experts,))
    router = RouterSpec(num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok, scoring=c.scoring_func,
                        norm_topk_prob=True, routed_scaling_factor=c.routed_scaling_factor)
    shared = expert(p + "shared_experts.", inter * c.n_shared_experts) if c.n_shared_experts else None
    stacked = None
    if stack_experts is not None:
        # this rank's experts only (all of them without expert parallelism), local ids from 0
        stacked = stack_experts(ckpt, [f"{p}experts.{e}." for e in range(held.start, held.stop)], c.hidden_size, inter)
        routed: list[ExpertWeights | None] = [None] * c.n_routed_experts
    else:
        routed = [expert(f"{p}experts.{e}.", inter) if held.start <= e < held.stop else None
                  for e in range(c.n_routed_experts)]
    return MoEWeights(
        router=router, gate=ckpt.weight(p + "gate", (c.n_routed_experts, c.hidden_size)),
        experts=routed, correction_bias=bias, tid2eid=tid2eid, shared=shared,
        swiglu_limit=c.swiglu_limit or None, stacked=stacked)
