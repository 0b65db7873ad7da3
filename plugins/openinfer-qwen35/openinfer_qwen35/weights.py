"""Qwen3.5 weights: checkpoint names → fused, backend-placed tensors.

Where the language model lives in the checkpoint::

    text checkpoint        model.embed_tokens.weight, model.layers.N..., model.norm.weight, lm_head.weight
    multimodal checkpoint  model.language_model.{embed_tokens,layers.N,norm}..., lm_head.weight
                           model.visual.*  and  mtp.*  are ignored (vision tower, MTP draft head)

Fusions made at load time (rows of the ``[out, in]`` weights, top to bottom)::

    full attention   qkv_gate = [ q (nh·hd) | k (nkv·hd) | v (nkv·hd) | gate (nh·hd) ]
                     from q_proj's per-head interleaving [h0: q | gate][h1: q | gate]...
    Gated DeltaNet   in_proj  = [ q | k | v  (= in_proj_qkv, the conv channels) | z | b | a ]
    MLP              gate_up  = [ gate_proj | up_proj ]

Zero-centred RMSNorm weights (every norm but the GDN output norm) are stored as ``1 + w`` so
the backend's plain ``rms_norm`` applies them; ``A_log`` is stored as ``-exp(A_log)``.

Host memory: for a backend computing in bf16 (cuda) every bf16 matrix and the conv weight go
from the memory-mapped checkpoint to the device as raw bf16 bits — slices and fusions are
uint16 concatenations, never a float32 copy of the model (the earlier loader widened each
tensor to fp32 on the host first: twice the bytes through malloc, and an idle process that
kept much of it). Only the small vectors that take fp32 math (norms, A_log, dt_bias) widen.

Tensor parallel (``shard``): every fused part is cut to the rank's heads before fusing —
attention heads (q, gate) and KV heads (k, v), GDN key heads (q, k channels) and value heads
(v channels, z, b, a, A_log, dt_bias), gate/up rows; o_proj, out_proj and down keep the
matching input columns (row-parallel, bias on rank 0); embedding and LM head their vocab rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from openinfer import (
    TensorShard,
    VocabShard,
    WeightLoadError,
    column_rows,
    head_rows,
    row_columns,
    row_parallel_bias,
    vocab_rows,
)
from openinfer_qwen35.config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config

TEXT_PREFIXES = ("model.language_model.", "model.")
IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


class TensorSource(Protocol):
    """What the loader reads from: ``openinfer.Checkpoint`` or a plain dict wrapper in tests."""

    def __contains__(self, name: str) -> bool: ...
    def get(self, name: str) -> np.ndarray: ...  # float32
    def names(self) -> Iterable[str]: ...
    # optional (openinfer.Checkpoint, DummyCheckpoint): stored dtype name and raw bits, so a bf16
    # backend receives bf16 tensors without a float32 copy


def _stores_bf16(backend: Any) -> bool:
    return np.dtype(getattr(backend, "activation_dtype", np.float32)) == np.uint16


@dataclass
class FullAttentionWeights:
    qkv_gate: Any  # backend linear: [q | k | v | gate]
    o_proj: Any
    q_norm: Any  # 1 + w, [head_dim]
    k_norm: Any


@dataclass
class DeltaNetWeights:
    in_proj: Any  # backend linear: [q | k | v | z | b | a]
    conv_weight: Any  # [conv_dim, kernel]
    neg_decay_rate: Any  # -exp(A_log), [nv] fp32
    dt_bias: Any  # [nv] fp32
    norm: Any  # gated RMSNorm weight [dv] (plain, not zero-centred)
    out_proj: Any


@dataclass
class LayerWeights:
    kind: str
    input_norm: Any  # 1 + w
    post_attention_norm: Any  # 1 + w
    mixer: FullAttentionWeights | DeltaNetWeights
    gate_up: Any
    down: Any


@dataclass
class Qwen35Weights:
    embed_tokens: Any
    layers: list[LayerWeights]
    final_norm: Any  # 1 + w
    lm_head: Any  # backend linear
    vocab: VocabShard | None = None  # tensor parallel: this rank's rows of embed_tokens / lm_head


def text_prefix(source: TensorSource) -> str:
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in source:
            return prefix
    raise WeightLoadError(
        "no Qwen3.5 embedding found: expected 'model.embed_tokens.weight' (text checkpoint) or "
        "'model.language_model.embed_tokens.weight' (multimodal checkpoint)")


class _Reader:
    """Reads tensors under the text prefix, checking shapes and remembering what was used."""

    def __init__(self, source: TensorSource, prefix: str, native_bf16: bool = False):
        self.source, self.prefix = source, prefix
        # raw bf16 bits for matrices when the backend stores bf16 and the source can hand them out
        self.native_bf16 = native_bf16 and hasattr(source, "raw") and hasattr(source, "dtype")
        self.used: set[str] = set()

    def matrix(self, name: str, shape: tuple[int, ...], full_name: bool = False) -> np.ndarray:
        """A weight for ``backend.weight`` / ``linear_weight``: raw bf16 bits (uint16) where the
        backend stores bf16 and the tensor is stored in bf16, else float32."""
        key = name if full_name else self.prefix + name
        if self.native_bf16 and key in self.source and self.source.dtype(key) == "BF16":
            array = self.source.raw(key)
            self._check(key, array, shape)
            return array
        return self.get(name, shape, full_name)

    def get(self, name: str, shape: tuple[int, ...], full_name: bool = False) -> np.ndarray:
        key = name if full_name else self.prefix + name
        if key not in self.source:
            raise WeightLoadError(f"tensor {key!r} is missing from the checkpoint")
        array = np.asarray(self.source.get(key), dtype=np.float32)
        self._check(key, array, shape)
        return array

    def _check(self, key: str, array: np.ndarray, shape: tuple[int, ...]) -> None:
        if array.shape != shape:
            raise WeightLoadError(f"tensor {key!r} has shape {array.shape}, the config implies {shape}; "
                                  "config.json and the weights disagree")
        self.used.add(key)

    def optional(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        return self.get(name, shape) if self.prefix + name in self.source else None

    def check_all_used(self) -> None:
        unused = sorted(n for n in self.source.names()
                        if n not in self.used and not n.startswith(IGNORED_PREFIXES)
                        and (n.startswith(self.prefix) or n.startswith("lm_head.")))
        if unused:
            shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
            raise WeightLoadError(f"{len(unused)} checkpoint tensors are not part of a Qwen3.5 text model "
                                  f"({shown}); is this the right plugin for the checkpoint?")


def _fp32(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32)


def load_weights(source: TensorSource, config: Qwen35Config, backend: Any,
                 fp32_vector: Callable[[np.ndarray], Any] = _fp32,
                 norm_weight: Callable[[np.ndarray], Any] | None = None,
                 shard: TensorShard | None = None) -> Qwen35Weights:
    """``fp32_vector`` places the per-head GDN parameters (``-exp(A_log)``, ``dt_bias``), which
    stay fp32 on every backend (HF computes the decay in fp32 from them); ``norm_weight`` places
    the layer and final norms' ``1 + w`` (default ``backend.weight``; the cuda plan keeps fp32).
    ``shard``: this rank's part under tensor parallelism (default: everything)."""
    shard = shard or TensorShard()
    config.for_rank(shard)  # heads that do not split fail here, before anything is read
    reader = _Reader(source, text_prefix(source), native_bf16=_stores_bf16(backend))
    hidden = config.hidden_size
    place_norm = norm_weight or backend.weight
    embed = reader.matrix("embed_tokens.weight", (config.vocab_size, hidden))
    layers = [_load_layer(reader, config, backend, i, fp32_vector, place_norm, shard)
              for i in range(config.num_hidden_layers)]
    final_norm = 1.0 + reader.get("norm.weight", (hidden,))
    if "lm_head.weight" in source and not config.tie_word_embeddings:
        lm_head = reader.matrix("lm_head.weight", (config.vocab_size, hidden), full_name=True)
    else:
        lm_head = embed
        if "lm_head.weight" in source:
            reader.used.add("lm_head.weight")
    reader.check_all_used()
    if shard.size == 1:
        return Qwen35Weights(backend.weight(embed), layers, place_norm(final_norm), backend.linear_weight(lm_head))
    vocab = shard.vocab(config.vocab_size)
    return Qwen35Weights(backend.weight(vocab_rows(embed, vocab)), layers, place_norm(final_norm),
                         backend.linear_weight(vocab_rows(lm_head, vocab)), vocab)


def _load_layer(reader: _Reader, config: Qwen35Config, backend: Any, index: int,
                fp32_vector: Callable[[np.ndarray], Any], place_norm: Callable[[np.ndarray], Any],
                shard: TensorShard) -> LayerWeights:
    prefix = f"layers.{index}."
    hidden, inter = config.hidden_size, config.intermediate_size
    kind = config.layer_types[index]
    if kind == FULL_ATTENTION:
        mixer: FullAttentionWeights | DeltaNetWeights = _load_full_attention(reader, config, backend, prefix, shard)
    else:
        mixer = _load_delta_net(reader, config, backend, prefix, fp32_vector, shard)
    gate_up = np.concatenate([column_rows(reader.matrix(prefix + "mlp.gate_proj.weight", (inter, hidden)), shard,
                                          "intermediate_size"),
                              column_rows(reader.matrix(prefix + "mlp.up_proj.weight", (inter, hidden)), shard,
                                          "intermediate_size")])
    return LayerWeights(
        kind=kind,
        input_norm=place_norm(1.0 + reader.get(prefix + "input_layernorm.weight", (hidden,))),
        post_attention_norm=place_norm(1.0 + reader.get(prefix + "post_attention_layernorm.weight", (hidden,))),
        mixer=mixer,
        gate_up=backend.linear_weight(gate_up),
        down=backend.linear_weight(row_columns(reader.matrix(prefix + "mlp.down_proj.weight", (hidden, inter)), shard,
                                               "intermediate_size")),
    )


def _load_full_attention(reader: _Reader, config: Qwen35Config, backend: Any, prefix: str,
                         shard: TensorShard) -> FullAttentionWeights:
    p = prefix + "self_attn."
    hidden, nh, nkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    heads, kv_heads = shard.split(nh, "num_attention_heads"), shard.kv_heads(nkv)
    local_q = (heads.stop - heads.start) * hd
    # q_proj rows are per head [query (hd) | gate (hd)]: split them into all queries, then all gates.
    q_and_gate = reader.matrix(p + "q_proj.weight", (nh * 2 * hd, hidden)).reshape(nh, 2, hd, hidden)[heads]
    k = head_rows(reader.matrix(p + "k_proj.weight", (nkv * hd, hidden)), kv_heads, hd)
    v = head_rows(reader.matrix(p + "v_proj.weight", (nkv * hd, hidden)), kv_heads, hd)
    weight = np.concatenate([q_and_gate[:, 0].reshape(local_q, hidden), k, v,
                             q_and_gate[:, 1].reshape(local_q, hidden)])
    bias = None
    o_bias = None
    if config.attention_bias:
        q_bias = reader.get(p + "q_proj.bias", (nh * 2 * hd,)).reshape(nh, 2, hd)[heads]
        k_bias = head_rows(reader.get(p + "k_proj.bias", (nkv * hd,)), kv_heads, hd)
        v_bias = head_rows(reader.get(p + "v_proj.bias", (nkv * hd,)), kv_heads, hd)
        bias = np.concatenate([q_bias[:, 0].ravel(), k_bias, v_bias, q_bias[:, 1].ravel()])
        o_bias = row_parallel_bias(reader.get(p + "o_proj.bias", (hidden,)), shard)
    o_proj = reader.matrix(p + "o_proj.weight", (hidden, nh * hd))
    return FullAttentionWeights(
        qkv_gate=backend.linear_weight(weight, bias),
        o_proj=backend.linear_weight(row_columns(o_proj, shard, "num_attention_heads * head_dim"), o_bias),
        q_norm=backend.weight(1.0 + reader.get(p + "q_norm.weight", (hd,))),
        k_norm=backend.weight(1.0 + reader.get(p + "k_norm.weight", (hd,))),
    )


def _conv_channels(config: Qwen35Config, shard: TensorShard) -> np.ndarray:
    """Indices of this rank's ``[q | k | v]`` conv channels: its key heads' q and k, its value heads' v."""
    if shard.size == 1:
        return np.arange(config.conv_dim)
    key_heads = shard.kv_heads(config.linear_num_key_heads)
    value_heads = shard.split(config.linear_num_value_heads, "linear_num_value_heads")
    dk, dv, key_dim = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_key_dim
    keys = np.arange(key_heads.start * dk, key_heads.stop * dk)
    return np.concatenate([keys, key_dim + keys, 2 * key_dim + np.arange(value_heads.start * dv, value_heads.stop * dv)])


def _load_delta_net(reader: _Reader, config: Qwen35Config, backend: Any, prefix: str,
                    fp32_vector: Callable[[np.ndarray], Any], shard: TensorShard) -> DeltaNetWeights:
    p = prefix + "linear_attn."
    hidden, nv = config.hidden_size, config.linear_num_value_heads
    conv_dim, value_dim, dv = config.conv_dim, config.linear_value_dim, config.linear_value_head_dim
    channels = _conv_channels(config, shard)
    value_heads = shard.split(nv, "linear_num_value_heads")
    in_proj = np.concatenate([
        reader.matrix(p + "in_proj_qkv.weight", (conv_dim, hidden))[channels],
        head_rows(reader.matrix(p + "in_proj_z.weight", (value_dim, hidden)), value_heads, dv),
        reader.matrix(p + "in_proj_b.weight", (nv, hidden))[value_heads],
        reader.matrix(p + "in_proj_a.weight", (nv, hidden))[value_heads],
    ])
    conv = reader.matrix(p + "conv1d.weight", (conv_dim, 1, config.linear_conv_kernel_dim))[channels, 0, :]
    conv_bias = reader.optional(p + "conv1d.bias", (conv_dim,))
    if conv_bias is not None and np.any(conv_bias):
        raise WeightLoadError(f"tensor {reader.prefix + p}conv1d.bias is non-zero; Qwen3.5's conv has no bias")
    out_proj = reader.matrix(p + "out_proj.weight", (hidden, value_dim))
    return DeltaNetWeights(
        in_proj=backend.linear_weight(in_proj),
        conv_weight=backend.weight(np.ascontiguousarray(conv)),
        neg_decay_rate=fp32_vector(-np.exp(reader.get(p + "A_log", (nv,))[value_heads])),
        dt_bias=fp32_vector(reader.get(p + "dt_bias", (nv,))[value_heads]),
        norm=backend.weight(reader.get(p + "norm.weight", (dv,))),
        out_proj=backend.linear_weight(row_columns(out_proj, shard, "linear_num_value_heads * linear_value_head_dim")),
    )


def qwen35_tensor_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a text checkpoint of ``config``, by name (for ``--load-format dummy``)."""
    c, hidden, inter = config, config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)})
        if kind == LINEAR_ATTENTION:
            a, nv = p + "linear_attn.", c.linear_num_value_heads
            shapes.update({a + "in_proj_qkv.weight": (c.conv_dim, hidden),
                           a + "in_proj_z.weight": (c.linear_value_dim, hidden),
                           a + "in_proj_b.weight": (nv, hidden), a + "in_proj_a.weight": (nv, hidden),
                           a + "conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel_dim), a + "A_log": (nv,),
                           a + "dt_bias": (nv,), a + "norm.weight": (c.linear_value_head_dim,),
                           a + "out_proj.weight": (hidden, c.linear_value_dim)})
        else:
            a, q, kv = p + "self_attn.", c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            shapes.update({a + "q_proj.weight": (2 * q, hidden), a + "k_proj.weight": (kv, hidden),
                           a + "v_proj.weight": (kv, hidden), a + "o_proj.weight": (hidden, q),
                           a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)})
            if c.attention_bias:
                shapes.update({a + "q_proj.bias": (2 * q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                               a + "o_proj.bias": (hidden,)})
    return shapes
