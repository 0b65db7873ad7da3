"""The standard dense decoder-only transformer (Llama, Qwen2/3, Mistral-like), shared by
plugins: config fields, checkpoint loading with fused weights, and the model object the
default engine runs. A plugin supplies only what differs: its architecture names, defaults,
and switches such as per-head q/k norms (Qwen3) or biases.

Per layer, the HF tensors are fused so each step runs one GEMM where HF runs two or three::

    {prefix}layers.{i}.self_attn.{q,k,v}_proj.weight  →  qkv      [q_size + 2*kv_size, hidden]
    {prefix}layers.{i}.mlp.{gate,up}_proj.weight      →  gate_up  [2*intermediate,     hidden]

``backend.linear_weight`` then stores each matrix as its backend wants it (NumPy: transposed,
contiguous fp32; CUDA: bf16 in the kernels' layout). The LM head is ``lm_head.weight`` or,
tied, the embedding table.

Tensor parallel (``RankContext.tensor``): each rank reads its heads' rows of q/k/v (KV heads
replicated when the group is larger than ``num_key_value_heads``), its rows of gate/up, the
matching input columns of o_proj/down and its vocab rows of the embedding and LM head; see
``openinfer.parallel.tensor``. ``--load-format dummy`` reads a ``DummyCheckpoint`` built from
``decoder_tensor_shapes`` instead of files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from openinfer.backend.base import AttentionSpec, Backend, KVLayer
from openinfer.errors import WeightLoadError
from openinfer.layers import DecoderLayer, DecoderStack, eos_token_ids_from, fused_linear_weight
from openinfer.parallel.dummy import DummyCheckpoint
from openinfer.parallel.layout import TensorShard, check_attention_heads
from openinfer.parallel.memory_plan import ModelMemory, dense_model_memory
from openinfer.parallel.rank import SINGLE, RankContext
from openinfer.parallel.tensor import column_rows, head_rows, row_columns, row_parallel_bias, vocab_rows
from openinfer.rope import RopeParameters, RotaryEmbedding, rope_parameters_from_config
from openinfer.runtime.model import ModelSpec
from openinfer.weights import Checkpoint

SUPPORTED_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class DecoderConfig:
    """The config.json fields of a dense decoder (transformers 4.x and 5.x spellings)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeParameters
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    architectures: tuple[str, ...]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None, *,
                  model_type: str, architectures: tuple[str, ...], default_rope_theta: float = 10000.0,
                  default_max_position_embeddings: int = 2048) -> DecoderConfig:
        """Read ``config.json`` (and ``generation_config.json`` for extra eos ids)."""
        activation = config.get("hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise WeightLoadError(f"config.json has hidden_act={activation!r}; supported: {SUPPORTED_ACTIVATIONS}")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            parsed = cls(
                model_type=model_type,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(config.get("head_dim") or hidden // heads),
                max_position_embeddings=int(config.get("max_position_embeddings", default_max_position_embeddings)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=rope_parameters_from_config(config, default_theta=default_rope_theta),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                eos_token_ids=eos_token_ids_from(config, generation_config),
                bos_token_id=config.get("bos_token_id"),
                architectures=tuple(config.get("architectures") or architectures),
            )
        except KeyError as exc:
            raise WeightLoadError(f"config.json lacks the {model_type} field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise WeightLoadError(f"config.json has a malformed {model_type} field: {exc}") from exc
        if heads % kv_heads:
            raise WeightLoadError(
                f"config.json has num_attention_heads={heads}, not a multiple of num_key_value_heads={kv_heads}")
        return parsed


@dataclass(frozen=True)
class DecoderLayout:
    """What differs between dense decoder families at load time."""

    prefix: str = "model."  # where the decoder's tensors live in the checkpoint
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    o_proj_bias: bool | None = None  # None: follow attention_bias


def check_decoder_shapes(checkpoint: Checkpoint, config: DecoderConfig, layout: DecoderLayout) -> None:
    """Fail before loading anything when config.json and the tensors disagree."""
    c, root = config, layout.prefix
    checkpoint.expect_shape(root + "embed_tokens.weight", (c.vocab_size, c.hidden_size))
    for i in range(c.num_hidden_layers):
        p = f"{root}layers.{i}."
        checkpoint.expect_shape(p + "self_attn.q_proj.weight", (c.q_size, c.hidden_size))
        checkpoint.expect_shape(p + "self_attn.k_proj.weight", (c.kv_size, c.hidden_size))
        checkpoint.expect_shape(p + "self_attn.v_proj.weight", (c.kv_size, c.hidden_size))
        checkpoint.expect_shape(p + "self_attn.o_proj.weight", (c.hidden_size, c.q_size))
        checkpoint.expect_shape(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size))
        checkpoint.expect_shape(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size))
        checkpoint.expect_shape(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size))


def decoder_tensor_shapes(config: DecoderConfig, layout: DecoderLayout) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds, by name (for ``--load-format dummy``)."""
    c, root = config, layout.prefix
    shapes: dict[str, tuple[int, ...]] = {root + "embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                          root + "norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    o_bias = c.attention_bias if layout.o_proj_bias is None else layout.o_proj_bias
    for i in range(c.num_hidden_layers):
        p = f"{root}layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for name, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, c.hidden_size)
            if c.attention_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        if layout.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        for name in ("gate", "up"):
            shapes[f"{p}mlp.{name}_proj.weight"] = (c.intermediate_size, c.hidden_size)
            if c.mlp_bias:
                shapes[f"{p}mlp.{name}_proj.bias"] = (c.intermediate_size,)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        if c.mlp_bias:
            shapes[p + "mlp.down_proj.bias"] = (c.hidden_size,)
    return shapes


def _qkv_part(checkpoint: Checkpoint, config: DecoderConfig, shard: TensorShard, attn: str, projection: str,
              suffix: str) -> np.ndarray:
    """This rank's heads of ``q_proj`` (or of ``k_proj`` / ``v_proj``: its KV heads)."""
    tensor = checkpoint.get(f"{attn}{projection}_proj.{suffix}")
    if shard.size == 1:
        return tensor
    heads = (shard.split(config.num_attention_heads, "num_attention_heads") if projection == "q"
             else shard.kv_heads(config.num_key_value_heads))
    return head_rows(tensor, heads, config.head_dim)


def load_decoder_layer(checkpoint: Checkpoint, config: DecoderConfig, layout: DecoderLayout, ops: Backend,
                       rope: RotaryEmbedding, index: int, rank: RankContext = SINGLE) -> DecoderLayer:
    c, p = config, f"{layout.prefix}layers.{index}."
    attn, mlp = p + "self_attn.", p + "mlp."
    shard = rank.tensor
    o_bias = c.attention_bias if layout.o_proj_bias is None else layout.o_proj_bias
    heads = shard.split(c.num_attention_heads, "num_attention_heads")
    kv_heads = shard.kv_heads(c.num_key_value_heads)

    def qkv(suffix: str) -> list[np.ndarray]:
        return [_qkv_part(checkpoint, c, shard, attn, projection, suffix) for projection in "qkv"]

    def gate_up(suffix: str) -> list[np.ndarray]:
        return [column_rows(checkpoint.get(f"{mlp}{n}_proj.{suffix}"), shard, "intermediate_size")
                for n in ("gate", "up")]

    def row_parallel(name: str, with_bias: bool, what: str) -> object:
        weight = checkpoint.get(name + ".weight")
        bias = checkpoint.get(name + ".bias") if with_bias else None
        if shard.size == 1:
            return ops.linear_weight(weight, bias)
        return ops.linear_weight(row_columns(weight, shard, what), row_parallel_bias(bias, shard))

    return DecoderLayer(
        input_norm=ops.weight(checkpoint.get(p + "input_layernorm.weight")),
        qkv=fused_linear_weight(ops, qkv("weight"), qkv("bias") if c.attention_bias else None),
        attention=AttentionSpec(
            num_heads=heads.stop - heads.start, num_kv_heads=kv_heads.stop - kv_heads.start, head_dim=c.head_dim,
            rope=rope, scale=c.head_dim**-0.5,
            q_norm=ops.weight(checkpoint.get(attn + "q_norm.weight")) if layout.qk_norm else None,
            k_norm=ops.weight(checkpoint.get(attn + "k_norm.weight")) if layout.qk_norm else None,
            norm_eps=c.rms_norm_eps),
        o_proj=row_parallel(attn + "o_proj", bool(o_bias), "num_attention_heads * head_dim"),
        post_attention_norm=ops.weight(checkpoint.get(p + "post_attention_layernorm.weight")),
        gate_up=fused_linear_weight(ops, gate_up("weight"), gate_up("bias") if c.mlp_bias else None),
        down=row_parallel(mlp + "down_proj", c.mlp_bias, "intermediate_size"),
    )


def load_decoder_stack(checkpoint: Checkpoint, config: DecoderConfig, layout: DecoderLayout, ops: Backend,
                       rope: RotaryEmbedding, rank: RankContext = SINGLE) -> DecoderStack:
    """The whole decoder (this rank's part of it), with a progress bar over layers."""
    check_decoder_shapes(checkpoint, config, layout)
    check_attention_heads(rank.tensor, config.num_attention_heads, config.num_key_value_heads)
    layers = []
    for index in tqdm(range(config.num_hidden_layers), desc=f"loading {config.model_type} layers", unit="layer",
                      disable=None, leave=False):
        layers.append(load_decoder_layer(checkpoint, config, layout, ops, rope, index, rank))
    embed = checkpoint.get(layout.prefix + "embed_tokens.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in checkpoint
    lm_head = embed if tied else checkpoint.get("lm_head.weight")
    final_norm = ops.weight(checkpoint.get(layout.prefix + "norm.weight"))
    if rank.tensor.size == 1:
        return DecoderStack(embed_tokens=ops.weight(embed), layers=layers, final_norm=final_norm,
                            lm_head=ops.linear_weight(lm_head), eps=config.rms_norm_eps)
    vocab = rank.tensor.vocab(config.vocab_size)
    return DecoderStack(embed_tokens=ops.weight(vocab_rows(embed, vocab)), layers=layers, final_norm=final_norm,
                        lm_head=ops.linear_weight(vocab_rows(lm_head, vocab)), eps=config.rms_norm_eps,
                        comm=rank.comm, vocab=vocab, vocab_size=config.vocab_size)


def decoder_model_memory(config: DecoderConfig, layout: DecoderLayout, bytes_per_element: float = 2.0) -> ModelMemory:
    """What a dense decoder holds (bf16 weights and KV by default), for the memory plan."""
    kv_per_token = int(2 * config.num_hidden_layers * config.kv_size * bytes_per_element)
    return dense_model_memory(decoder_tensor_shapes(config, layout), num_kv_heads=config.num_key_value_heads,
                              kv_bytes_per_token=kv_per_token, bytes_per_element=bytes_per_element,
                              description=f"{config.model_type} ({config.num_hidden_layers} layers, "
                                          f"hidden {config.hidden_size})")


def open_checkpoint(model_path: str | Path, config: DecoderConfig, layout: DecoderLayout,
                    load_format: str = "auto") -> Checkpoint | DummyCheckpoint:
    """The files in ``model_path``, or random tensors at their shapes for ``load_format='dummy'``."""
    if load_format == "dummy":
        return DummyCheckpoint(decoder_tensor_shapes(config, layout))
    return Checkpoint(model_path)


class BackendNativeCheckpoint:
    """A checkpoint view whose ``get`` returns what the backend stores, with no fp32 host copy.

    For a backend computing in bf16 (``activation_dtype`` uint16: CUDA) a BF16 tensor comes back
    as the raw uint16 view of the memory-mapped file — the bytes go from the page cache straight
    into the device upload (fused matrices cost one bf16 concatenation, never a float32 one).
    Peak host memory while loading is then about one layer's bf16 matrices instead of the whole
    model widened to fp32. Other tensors, and every tensor on the NumPy backend, are ``get`` as
    before (float32). Everything else is the wrapped checkpoint's.
    """

    def __init__(self, checkpoint: Checkpoint, backend: Backend):
        self._checkpoint = checkpoint
        self._native_bf16 = np.dtype(getattr(backend, "activation_dtype", np.float32)) == np.uint16

    def get(self, name: str) -> np.ndarray:
        checkpoint = self._checkpoint
        dtype = getattr(checkpoint, "dtype", None)
        if self._native_bf16 and dtype is not None and dtype(name) == "BF16":
            return checkpoint.raw(name)
        return checkpoint.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._checkpoint

    def __getattr__(self, name: str):
        return getattr(self._checkpoint, name)


class DecoderOnlyLM:
    """A ``PagedModel`` for a dense decoder: one forward for prefill, decode and mixed steps."""

    # the forward computes no indices on the device (positions, slots and tables all come from
    # the batch), so it may run with every kernel skipped to find which kernels it needs
    # (``openinfer.graph``: parallel compilation on a cold kernel cache)
    dry_run_safe = True

    def __init__(self, config: DecoderConfig, layout: DecoderLayout, backend: Backend, checkpoint: Checkpoint,
                 max_model_len: int | None = None, rank: RankContext = SINGLE):
        self.config = config
        self.backend = backend
        self.rank = rank
        max_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        rope = RotaryEmbedding.create(config.head_dim, config.rope, max_len, config.max_position_embeddings)
        native = BackendNativeCheckpoint(checkpoint, backend)  # bf16 stays bf16 on its way to the GPU
        self.stack = load_decoder_stack(native, config, layout, backend, rope, rank)
        local_heads = self.stack.layers[0].attention if self.stack.layers else None
        self.spec = ModelSpec(
            architectures=config.architectures, model_type=config.model_type, vocab_size=config.vocab_size,
            max_model_len=max_len, num_layers=config.num_hidden_layers,
            # KV is sized per rank: this rank's (possibly replicated) KV heads
            num_kv_heads=local_heads.num_kv_heads if local_heads else config.num_key_value_heads,
            head_dim=config.head_dim, num_heads=config.num_attention_heads, hidden_size=config.hidden_size,
            eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id,
            num_parameters=checkpoint_parameter_count(checkpoint),
            extra={"tensor_parallel_size": rank.layout.tensor_parallel_size})

    @classmethod
    def from_pretrained(cls, model_path: str | Path, config: DecoderConfig, layout: DecoderLayout,
                        backend: Backend, max_model_len: int | None = None,
                        rank: RankContext = SINGLE) -> DecoderOnlyLM:
        return cls(config, layout, backend, open_checkpoint(model_path, config, layout, rank.load_format),
                   max_model_len, rank)

    def forward(self, batch: Any, kv_cache: list[KVLayer]) -> Any:
        return self.stack.forward(self.backend, batch, kv_cache)


def checkpoint_parameter_count(checkpoint: Checkpoint | DummyCheckpoint) -> int:
    return int(sum(np.prod(checkpoint.shape(name), dtype=np.int64) for name in checkpoint.names()))
