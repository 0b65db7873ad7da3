"""The DeepSeek-V4 forward on the CUDA backend: bf16 activations and caches, fp32 mHC streams.

The same steps as ``model.DeepseekV4Model.forward`` (the NumPy reference), for every token of
the step at once — no per-sequence Python loop. Where a NumPy op works sequence by sequence,
its kernel reads the step's layout from the device batch (``query_start``, ``positions``, the
per-group block tables, ``state_slots``)::

    embed ─► streams [T, hc, D] fp32
    per layer:
      hc_collapse ─► rms_norm ─► wq_a ─► q_norm ─► wq_b ─► head_norm_rope (q)      cuBLAS + dsv4.cu
                                 wkv ─► head_norm_rope (kv_norm + RoPE) ─► write_window
                                 CSA/HCA: wkv/wgate ─► compressor_step (entries + open windows)
                                 CSA: indexer wq_b ─► RoPE, weights_proj ─► indexer_topk
                                 sparse_attention (window + entries, sinks, RoPE⁻¹)
                                 wo_a (all groups: one batched GEMM) ─► wo_b
      hc_expand; hc_collapse ─► rms_norm ─► MoE (cuda_experts) ─► hc_expand
    logits rows ─► hc head ─► norm ─► head

Nothing reads a device value back on the host: a decode step can be captured in a CUDA graph.
Graph capture runs on a static batch whose ``host`` is None; sizes that depend on the context
(the indexer's score row) then take their ``max_model_len`` bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cupy
import numpy as np

from openinfer import OpenInferError
from openinfer.backend.cuda.weight_upload import upload_vector
from openinfer_deepseek_v4 import cuda_ops
from openinfer_deepseek_v4.config import SLIDING
from openinfer_deepseek_v4.cuda_experts import DeviceMoELayer, device_layer, moe_layer
from openinfer_deepseek_v4.cuda_linears import linear
from openinfer_deepseek_v4.state import LayerCacheIndex
from openinfer_deepseek_v4.weights import AttentionWeights, CompressorWeights, HyperConnectionWeights


def bf16_to_f32(x: cupy.ndarray) -> cupy.ndarray:
    return (cupy.ascontiguousarray(x).astype(cupy.uint32) << 16).view(cupy.float32)


def _f32(array: Any) -> cupy.ndarray:
    """A weight kept in fp32 (copied off the legacy stream: core's ``upload_vector``)."""
    return upload_vector(array, np.float32)


@dataclass
class DeviceHyper:
    fn: cupy.ndarray
    base: cupy.ndarray
    scale: cupy.ndarray

    @classmethod
    def of(cls, w: HyperConnectionWeights) -> DeviceHyper:
        return cls(_f32(w.fn), _f32(w.base), _f32(w.scale))


@dataclass
class DeviceCompressor:
    ape: cupy.ndarray  # [rate, c·dim] fp32
    norm: cupy.ndarray  # [dim] fp32

    @classmethod
    def of(cls, w: CompressorWeights) -> DeviceCompressor:
        return cls(_f32(w.ape), bf16_to_f32(w.norm) if isinstance(w.norm, cupy.ndarray) else _f32(w.norm))


@dataclass
class DeviceAttention:
    sink: cupy.ndarray  # [H] fp32
    wo_a: cupy.ndarray  # [groups, o_lora, H·D/groups] bf16: one strided-batched GEMM over the groups
    compressor: DeviceCompressor | None
    index_compressor: DeviceCompressor | None


@dataclass
class DeviceLayer:
    hc_attn: DeviceHyper
    hc_ffn: DeviceHyper
    attn: DeviceAttention
    moe: DeviceMoELayer


@dataclass
class StepLayout:
    """The step's layout on the device (shared by every layer)."""

    batch: Any
    token_seq: cupy.ndarray  # [T]
    max_context: int  # an upper bound of any sequence's context after the step


class CudaForward:
    """``forward(batch, kv_cache)`` of a ``DeepseekV4Model`` on the cuda backend."""

    def __init__(self, model: Any, max_model_len: int):
        self.model = model
        self.max_model_len = max_model_len
        c, ops = model.config, model.backend
        # expert parallel: this rank's experts are stacked, its share summed over the ranks in moe_layer
        self.expert_rank = model.rank if model.rank.expert.size > 1 else None
        self.inv_freq = {False: _f32(model.rope_main.inv_freq), True: _f32(model.rope_compress.inv_freq)}
        self.layers = []
        for layer in model.weights.layers:
            if not isinstance(layer.ffn.stacked, tuple):
                raise OpenInferError("the cuda forward needs the experts stacked at load "
                                     "(load_weights(..., stack_experts=cuda_experts.stack_experts))")
            a = layer.attn
            self.layers.append(DeviceLayer(
                DeviceHyper.of(layer.hc_attn), DeviceHyper.of(layer.hc_ffn),
                DeviceAttention(_f32(a.sink), ops.weight(np.ascontiguousarray(a.wo_a, np.float32)),
                                None if a.compressor is None else DeviceCompressor.of(a.compressor),
                                None if a.indexer is None else DeviceCompressor.of(a.indexer.compressor)),
                device_layer(layer.ffn, ops)))
        self.hc_head = DeviceHyper.of(model.weights.hc_head)
        self.mixing = {"sinkhorn_iters": c.hc_sinkhorn_iters, "hc_eps": c.hc_eps, "norm_eps": c.rms_norm_eps}
        cuda_ops.warm_up(c.head_dim)  # (plugin.build_model started the builds before the weights loaded)

    def __call__(self, batch: Any, kv_cache: list[Any]) -> cupy.ndarray:
        model, c, ops = self.model, self.model.config, self.model.backend
        w, eps = model.weights, c.rms_norm_eps
        tokens = int(batch.token_ids.shape[0])
        if batch.state_slots is None and any(i.state >= 0 for i in model.cache_index):
            raise OpenInferError("DeepSeek-V4 keeps compressor state: the device batch carries no state_slots")
        # graph capture (a static batch, host None) sizes for the longest context the graph may see
        max_context = self.max_model_len if batch.host is None else int(batch.max_context_len)
        step = StepLayout(batch, cuda_ops.token_seq(batch.query_start, tokens), max_context)
        embedded = bf16_to_f32(ops.embedding(w.embed, batch.token_ids))
        streams = cupy.ascontiguousarray(cupy.broadcast_to(embedded[:, None, :], (tokens, c.hc_mult, c.hidden_size)))
        for index, (layer, device) in enumerate(zip(w.layers, self.layers, strict=True)):
            x, post, comb = cuda_ops.hc_collapse(streams, device.hc_attn.fn, device.hc_attn.base, device.hc_attn.scale,
                                                 **self.mixing)
            x = ops.rms_norm(x, layer.attn_norm, eps)
            y = self._attention(index, x, layer.attn, device.attn, kv_cache, step)
            cuda_ops.hc_expand(streams, y, post, comb, out=streams)
            x, post, comb = cuda_ops.hc_collapse(streams, device.hc_ffn.fn, device.hc_ffn.base, device.hc_ffn.scale,
                                                 **self.mixing)
            y = moe_layer(ops, ops.rms_norm(x, layer.ffn_norm, eps), layer.ffn, device.moe, batch.token_ids,
                          self.expert_rank)
            cuda_ops.hc_expand(streams, y, post, comb, out=streams)
        rows = int(batch.logits_rows.shape[0])
        if rows == 0:  # a prefill chunk that samples nothing
            return cupy.zeros((0, c.vocab_size), cupy.uint16)
        picked = cupy.ascontiguousarray(cupy.take(streams, batch.logits_rows, axis=0))
        hidden, _, _ = cuda_ops.hc_collapse(picked, self.hc_head.fn, self.hc_head.base, self.hc_head.scale,
                                            head=True, **self.mixing)
        return ops.linear(ops.rms_norm(hidden, w.norm, eps), w.head)

    # --- attention ------------------------------------------------------------------------------

    def _attention(self, index: int, x: cupy.ndarray, w: AttentionWeights, device: DeviceAttention,
                   kv_cache: list[Any], step: StepLayout) -> cupy.ndarray:
        model, c, ops = self.model, self.model.config, self.model.backend
        where: LayerCacheIndex = model.cache_index[index]
        batch, eps, tokens = step.batch, c.rms_norm_eps, int(x.shape[0])
        heads, dim, rope_dim = c.num_attention_heads, c.head_dim, c.rope_head_dim
        inv_freq = self.inv_freq[c.layer_types[index] != SLIDING]
        qr = ops.rms_norm(linear(ops, x, w.wq_a), w.q_norm, eps)
        q = cuda_ops.head_norm_rope(linear(ops, qr, w.wq_b), heads, batch.positions, inv_freq, rope_dim, norm=True,
                                    eps=eps)
        kv = cuda_ops.head_norm_rope(linear(ops, x, w.wkv), 1, batch.positions, inv_freq, rope_dim, norm=True,
                                     weight=w.kv_norm, eps=eps)
        window = kv_cache[where.window].k  # [blocks, block_size, 1, D]
        block_size = int(window.shape[1])
        window_tables = batch.group_block_tables(where.window_group)
        cuda_ops.write_window(kv, window, window_tables, block_size, step.token_seq, batch.positions)
        entries = entry_tables = selected = None
        rate = 1
        if w.compressor is not None:
            state = kv_cache[where.state].tensors
            entries = kv_cache[where.entries].k
            entry_tables = batch.group_block_tables(where.entries_group)
            rate = w.compressor.ratio
            self._compress(x, w.compressor, device.compressor, state, "", entries, entry_tables, inv_freq, step)
            if w.indexer is not None:
                keys = kv_cache[where.index_keys].k
                keys_tables = batch.group_block_tables(where.index_keys_group)
                self._compress(x, w.indexer.compressor, device.index_compressor, state, "index_", keys, keys_tables,
                               inv_freq, step)
                index_q = cuda_ops.head_norm_rope(linear(ops, qr, w.indexer.wq_b), w.indexer.num_heads,
                                                  batch.positions, inv_freq, rope_dim, norm=False)
                scale = np.float32(w.indexer.num_heads**-0.5 * w.indexer.head_dim**-0.5)
                head_weights = bf16_to_f32(linear(ops, x, w.indexer.weights_proj)) * scale
                _, selected = cuda_ops.indexer_topk(
                    index_q.reshape(tokens, w.indexer.num_heads, w.indexer.head_dim), head_weights, keys, keys_tables,
                    block_size, step.token_seq, batch.positions, rate, step.max_context // rate, w.indexer.topk)
        out = cuda_ops.sparse_attention(q.reshape(tokens, heads, dim), window, window_tables, entries, entry_tables,
                                        selected, rate, step.token_seq, batch.positions, device.sink, inv_freq,
                                        rope_dim, c.sliding_window, block_size)
        return linear(ops, self._grouped_output(out.reshape(tokens, heads * dim), device.wo_a), w.wo_b)

    def _grouped_output(self, out: cupy.ndarray, wo_a: cupy.ndarray) -> cupy.ndarray:
        """``[T, groups·o_lora]``: group g of the heads' outputs times ``wo_a[g]ᵀ``, all groups in one
        strided-batched GEMM (column-major: C_g[o_lora, T] = wo_a[g] · out_gᵀ)."""
        groups, rank, width = (int(n) for n in wo_a.shape)
        tokens = int(out.shape[0])
        low_rank = cupy.empty((tokens, groups * rank), cupy.uint16)
        if tokens:
            self.model.backend.blas.matmul_strided_batched(
                True, False, rank, tokens, width, wo_a, width, rank * width, out, groups * width, width,
                low_rank, groups * rank, rank, groups)
        return low_rank

    def _compress(self, x: cupy.ndarray, w: CompressorWeights, device: DeviceCompressor, state: dict[str, Any],
                  prefix: str, cache: cupy.ndarray, tables: cupy.ndarray, inv_freq: cupy.ndarray,
                  step: StepLayout) -> None:
        ops, c, batch = self.model.backend, self.model.config, step.batch
        cuda_ops.compressor_step(
            linear(ops, x, w.wkv), linear(ops, x, w.wgate), device.ape, state, prefix, device.norm, inv_freq,
            c.rope_head_dim, c.rms_norm_eps, token_seq=step.token_seq, positions=batch.positions,
            query_start=batch.query_start, state_slots=batch.state_slots, cache=cache, tables=tables,
            block_size=int(cache.shape[1]), rate=w.ratio, dim=w.head_dim, overlap=w.overlap)
