"""Checkpoint → weights of the Kimi-K2 / DeepSeek-V3 model.

Names (HF DeepSeek-V3 spelling, identical in the real Kimi-K2 checkpoints; Kimi-K2.5 nests the
same under ``language_model.``)::

    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.{i}.input_layernorm / post_attention_layernorm .weight
    model.layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
                                kv_a_layernorm, kv_b_proj, o_proj}
    dense layers:  model.layers.{i}.mlp.{gate,up,down}_proj
    MoE layers:    model.layers.{i}.mlp.gate.weight, .gate.e_score_correction_bias,
                   .experts.{e}.{gate,up,down}_proj, .shared_experts.{gate,up,down}_proj

Loading happens in two passes: every linear is first *planned* from the safetensors headers
(shape, quantized format, scales present, group size) so a bad checkpoint fails with the tensor's
name before any weight is read or any device memory is taken; then the weights are read.

Fused rows (``[out, in]``)::

    qkv_a    [ q_a_proj: q_lora (or q_proj: H·192) | kv_a_proj_with_mqa: kv_lora + rope ]
    gate_up  [ gate_proj: I | up_proj: I ]

DeepSeek's RoPE rotates interleaved pairs (x0, x1), (x2, x3), …; the rope rows of ``q_b_proj``
and ``kv_a_proj_with_mqa`` are permuted at load to (x0, x2, …, x1, x3, …) so the standard
rotate-half RoPE computes the same scores (q and k are permuted alike).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer import Backend, Checkpoint, DummyCheckpoint, WeightLoadError
from openinfer.mla import MLASpec, MLAWeights
from openinfer.moe import ExpertWeights, MoEWeights
from openinfer.weights import StoredLinear
from openinfer_kimi_k2.config import KimiK2Config


@dataclass
class MLAAttentionWeights:
    qkv_a: Any  # fused q_a (or q_proj) + kv_a_proj_with_mqa
    q_a_norm: Any | None  # None without q_lora
    q_b: Any | None
    kv_a_norm: Any
    mla: MLAWeights
    o_proj: Any


@dataclass
class DenseMLPWeights:
    gate_up: Any
    down: Any


@dataclass
class LayerWeights:
    input_norm: Any
    attention: MLAAttentionWeights
    post_attention_norm: Any
    mlp: DenseMLPWeights | MoEWeights


@dataclass
class KimiK2Weights:
    embed_tokens: Any
    layers: list[LayerWeights]
    final_norm: Any
    lm_head: Any


def checkpoint_prefix(ckpt: Checkpoint) -> str:
    """``""`` for text checkpoints, ``"language_model."`` for multimodal wrappers."""
    for prefix in ("", "language_model."):
        if f"{prefix}model.embed_tokens.weight" in ckpt:
            return prefix
    raise WeightLoadError(f"no model.embed_tokens.weight (or language_model.model.embed_tokens.weight) in "
                          f"{ckpt.model_dir}; is this a DeepSeek-V3 / Kimi-K2 checkpoint?")


def rope_deinterleave(rope_dim: int) -> np.ndarray:
    """Row order turning interleaved rope pairs into rotate-half halves."""
    return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


def mla_spec(config: KimiK2Config) -> MLASpec:
    return MLASpec(config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                   config.v_head_dim, config.kv_lora_rank, config.softmax_scale)


class _Planner:
    """Collects every linear's ``StoredLinear`` from headers (pass 1)."""

    def __init__(self, ckpt: Checkpoint, config: KimiK2Config):
        self.ckpt, self.config = ckpt, config
        self.linears: dict[str, StoredLinear] = {}

    def linear(self, module: str, shape: tuple[int, int]) -> None:
        self.linears[module] = self.ckpt.stored_linear(module, self.config.quant, shape)

    def vector(self, name: str, size: int) -> None:
        self.ckpt.expect_shape(name, (size,))


def plan_checkpoint(ckpt: Checkpoint, config: KimiK2Config) -> dict[str, StoredLinear]:
    """Check every tensor the model will read (names, shapes, quantized formats) from headers only."""
    prefix = checkpoint_prefix(ckpt)
    plan = _Planner(ckpt, config)
    c = config
    hidden, heads = c.hidden_size, c.num_attention_heads
    ckpt.expect_shape(f"{prefix}model.embed_tokens.weight", (c.vocab_size, hidden))
    plan.vector(f"{prefix}model.norm.weight", hidden)
    if not c.tie_word_embeddings:
        plan.linear(f"{prefix}lm_head", (c.vocab_size, hidden))
    for i in range(c.num_hidden_layers):
        layer = f"{prefix}model.layers.{i}"
        plan.vector(f"{layer}.input_layernorm.weight", hidden)
        plan.vector(f"{layer}.post_attention_layernorm.weight", hidden)
        attn = f"{layer}.self_attn"
        if c.q_lora_rank:
            plan.linear(f"{attn}.q_a_proj", (c.q_lora_rank, hidden))
            plan.vector(f"{attn}.q_a_layernorm.weight", c.q_lora_rank)
            plan.linear(f"{attn}.q_b_proj", (heads * c.qk_head_dim, c.q_lora_rank))
        else:
            plan.linear(f"{attn}.q_proj", (heads * c.qk_head_dim, hidden))
        plan.linear(f"{attn}.kv_a_proj_with_mqa", (c.latent_dim, hidden))
        plan.vector(f"{attn}.kv_a_layernorm.weight", c.kv_lora_rank)
        plan.linear(f"{attn}.kv_b_proj", (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
        plan.linear(f"{attn}.o_proj", (hidden, heads * c.v_head_dim))
        mlp = f"{layer}.mlp"
        if c.is_moe_layer(i):
            ckpt.expect_shape(f"{mlp}.gate.weight", (c.n_routed_experts, hidden))
            if c.router is not None and c.router.scoring == "sigmoid":
                plan.vector(f"{mlp}.gate.e_score_correction_bias", c.n_routed_experts)
            for e in range(c.n_routed_experts):
                _plan_swiglu(plan, f"{mlp}.experts.{e}", hidden, c.moe_intermediate_size)
            if c.n_shared_experts:
                _plan_swiglu(plan, f"{mlp}.shared_experts", hidden, c.moe_intermediate_size * c.n_shared_experts)
        else:
            _plan_swiglu(plan, mlp, hidden, c.intermediate_size)
    return plan.linears


def kimi_tensor_shapes(config: KimiK2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of an unquantized checkpoint of ``config`` (HF DeepSeek-V3 names), by name:
    what ``--load-format dummy`` fills with noise."""
    c = config
    hidden, heads = c.hidden_size, c.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)

    def swiglu(module: str, intermediate: int) -> None:
        shapes[f"{module}.gate_proj.weight"] = (intermediate, hidden)
        shapes[f"{module}.up_proj.weight"] = (intermediate, hidden)
        shapes[f"{module}.down_proj.weight"] = (hidden, intermediate)

    for i in range(c.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
        attn = f"{layer}.self_attn"
        if c.q_lora_rank:
            shapes[f"{attn}.q_a_proj.weight"] = (c.q_lora_rank, hidden)
            shapes[f"{attn}.q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[f"{attn}.q_b_proj.weight"] = (heads * c.qk_head_dim, c.q_lora_rank)
        else:
            shapes[f"{attn}.q_proj.weight"] = (heads * c.qk_head_dim, hidden)
        shapes[f"{attn}.kv_a_proj_with_mqa.weight"] = (c.latent_dim, hidden)
        shapes[f"{attn}.kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        shapes[f"{attn}.kv_b_proj.weight"] = (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        shapes[f"{attn}.o_proj.weight"] = (hidden, heads * c.v_head_dim)
        mlp = f"{layer}.mlp"
        if c.is_moe_layer(i):
            shapes[f"{mlp}.gate.weight"] = (c.n_routed_experts, hidden)
            if c.router is not None and c.router.scoring == "sigmoid":
                shapes[f"{mlp}.gate.e_score_correction_bias"] = (c.n_routed_experts,)
            for e in range(c.n_routed_experts):
                swiglu(f"{mlp}.experts.{e}", c.moe_intermediate_size)
            if c.n_shared_experts:
                swiglu(f"{mlp}.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
        else:
            swiglu(mlp, c.intermediate_size)
    return shapes


class DummyKimiCheckpoint(DummyCheckpoint):
    """``--load-format dummy``: noise at ``kimi_tensor_shapes``, every linear stored dense."""

    def __init__(self, config: KimiK2Config, seed: int = 0):
        super().__init__(kimi_tensor_shapes(config), seed)

    def stored_linear(self, module: str, quant: Any = None, shape: tuple[int, int] | None = None) -> StoredLinear:
        weight = f"{module}.weight"
        if shape is not None:
            self.expect_shape(weight, shape)
        rows, columns = self.shape(weight)
        return StoredLinear(module, "dense", (rows, columns), (("weight", weight),))


def _plan_swiglu(plan: _Planner, module: str, hidden: int, intermediate: int) -> None:
    plan.linear(f"{module}.gate_proj", (intermediate, hidden))
    plan.linear(f"{module}.up_proj", (intermediate, hidden))
    plan.linear(f"{module}.down_proj", (hidden, intermediate))


class LinearBuilder:
    """Turns planned linears into backend weights. The NumPy reference dequantizes to fp32 and
    fuses rows; a device backend's builder (the CUDA plan's) may keep them quantized."""

    def __init__(self, ckpt: Checkpoint, linears: dict[str, StoredLinear], backend: Backend):
        self.ckpt, self.linears, self.backend = ckpt, linears, backend

    def dense(self, module: str) -> np.ndarray:
        return self.linears[module].dequantize(self.ckpt)

    def fused(self, modules: list[str], row_orders: list[np.ndarray | None] | None = None) -> Any:
        """One linear from the row blocks of ``modules``, each optionally reordered (``row_orders``)."""
        orders = row_orders or [None] * len(modules)
        return self.backend.linear_weight(np.concatenate(
            [self.dense(m) if order is None else self.dense(m)[order] for m, order in zip(modules, orders, strict=True)]))

    def array(self, array: np.ndarray) -> Any:
        """A linear from an fp32 array (tied LM head)."""
        return self.backend.linear_weight(array)

    def experts(self, modules: list[str | None]) -> tuple[list[ExpertWeights | None], Any]:
        """Per-expert SwiGLU weights of one layer (``modules``: ``…experts.{e}``, None for an expert
        another expert-parallel rank holds), and a backend's stacked copy (None on NumPy)."""
        return [self.swiglu(m) if m is not None else None for m in modules], None

    def swiglu(self, module: str) -> ExpertWeights:
        return ExpertWeights(self.fused([f"{module}.gate_proj", f"{module}.up_proj"]),
                             self.fused([f"{module}.down_proj"]))


def load_weights(ckpt: Checkpoint, config: KimiK2Config, backend: Backend,
                 linears: dict[str, StoredLinear] | None = None,
                 builder: Callable[..., LinearBuilder] | None = None, experts: slice | None = None) -> KimiK2Weights:
    """Plan (headers only; or take ``linears`` from an earlier ``plan_checkpoint``), then read every
    weight through ``builder`` (default: the NumPy reference's fp32 ``LinearBuilder``). ``experts``:
    the routed experts this rank holds under expert parallelism (the others stay ``None``); default all."""
    linears = linears if linears is not None else plan_checkpoint(ckpt, config)
    prefix = checkpoint_prefix(ckpt)
    build = (builder or LinearBuilder)(ckpt, linears, backend)
    c = config
    perm = rope_deinterleave(c.qk_rope_head_dim) if c.rope_interleave else np.arange(c.qk_rope_head_dim)
    held = experts or slice(0, c.n_routed_experts)
    layers = []
    for i in range(c.num_hidden_layers):
        layer = f"{prefix}model.layers.{i}"
        attn = f"{layer}.self_attn"
        q_module = f"{attn}.q_b_proj" if c.q_lora_rank else f"{attn}.q_proj"
        kv_a_module = f"{attn}.kv_a_proj_with_mqa"
        kv_b = build.dense(f"{attn}.kv_b_proj")
        q_order, kv_a_order = rope_row_orders(c, perm)
        if c.q_lora_rank:
            qkv_a = build.fused([f"{attn}.q_a_proj", kv_a_module], [None, kv_a_order])
            q_a_norm = backend.weight(ckpt.get(f"{attn}.q_a_layernorm.weight"))
            q_b = build.fused([q_module], [q_order])
        else:
            qkv_a = build.fused([q_module, kv_a_module], [q_order, kv_a_order])
            q_a_norm, q_b = None, None
        mla = MLAWeights.from_kv_b(kv_b, mla_spec(c))
        attention = MLAAttentionWeights(qkv_a, q_a_norm, q_b,
                                        backend.weight(ckpt.get(f"{attn}.kv_a_layernorm.weight")),
                                        MLAWeights(backend.weight(mla.w_uk), backend.weight(mla.w_uv)),
                                        build.fused([f"{attn}.o_proj"]))
        mlp_name = f"{layer}.mlp"
        if c.is_moe_layer(i):
            assert c.router is not None
            bias_name = f"{mlp_name}.gate.e_score_correction_bias"
            experts, stacked = build.experts([f"{mlp_name}.experts.{e}" if held.start <= e < held.stop else None
                                              for e in range(c.n_routed_experts)])
            mlp: DenseMLPWeights | MoEWeights = MoEWeights(
                router=c.router, gate=ckpt.get(f"{mlp_name}.gate.weight"), experts=experts,
                correction_bias=ckpt.get(bias_name) if bias_name in ckpt else None,
                shared=build.swiglu(f"{mlp_name}.shared_experts") if c.n_shared_experts else None,
                stacked=stacked)
        else:
            fused = build.swiglu(mlp_name)
            mlp = DenseMLPWeights(fused.gate_up, fused.down)
        layers.append(LayerWeights(backend.weight(ckpt.get(f"{layer}.input_layernorm.weight")), attention,
                                   backend.weight(ckpt.get(f"{layer}.post_attention_layernorm.weight")), mlp))
    embed = ckpt.get(f"{prefix}model.embed_tokens.weight")
    lm_head = build.array(embed) if c.tie_word_embeddings else build.fused([f"{prefix}lm_head"])
    return KimiK2Weights(backend.weight(embed), layers, backend.weight(ckpt.get(f"{prefix}model.norm.weight")),
                         lm_head)


def rope_row_orders(c: KimiK2Config, perm: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Row orders of the q projection (per head: nope rows, then the rope rows permuted) and of
    kv_a (c_kv rows, then the rope rows permuted); None when the permutation is the identity.
    Rows only move inside their head's rope range, so FP8 blocks of 128 rows stay intact for
    DeepSeek's sizes (a builder that keeps weights quantized checks this)."""
    if np.array_equal(perm, np.arange(len(perm))):
        return None, None
    head = np.concatenate([np.arange(c.qk_nope_head_dim), c.qk_nope_head_dim + perm])
    q_order = (np.arange(c.num_attention_heads)[:, None] * c.qk_head_dim + head[None, :]).reshape(-1)
    kv_a_order = np.concatenate([np.arange(c.kv_lora_rank), c.kv_lora_rank + perm])
    return q_order, kv_a_order
