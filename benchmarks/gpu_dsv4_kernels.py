"""DeepSeek-V4-Flash layers on one GPU, against the HBM roofline (issue 14).

One decoder layer of each attention kind — sliding window only, CSA (rate 4, indexer 64 heads ×
128, top-512), HCA (rate 128) — each followed by the MoE (256 FP4 experts top-6 + one shared
expert, clamped SwiGLU), at DeepSeek-V4-Flash shapes (hidden 4096, 64 heads, head_dim 512, rope
64, window 128, q_lora 1024, 8 output groups of rank 1024, hc 4) with random weights in their
real formats (bf16 dense linears, FP4 e2m1 + e8m0 routed experts; speed does not depend on the
values). Each is a one-layer ``DeepseekV4Model`` on the cuda backend (vocab cut to 1024 so the
embedding and head cost nothing next to the layer), its decode step captured in a CUDA graph
(``openinfer.graph.CudaGraphRunner``) and replayed at batch 1 / 64 / 256 with every sequence at
context 4k / 64k (caches filled with random rows; the step at position context − 2).

Roofline: the bytes the step must read — the layer's weights (attention, mHC, router, shared
expert, and the routed experts the batch touches: E·(1 − (1 − k/E)^B) of them in expectation),
the sliding window, the compressed entries attention reads (HCA: all; CSA: the 512 picked) and,
for CSA, every indexer key — over the measured device copy bandwidth.

    python benchmarks/gpu_dsv4_kernels.py [--quick] [--fp4-gemm auto|stream|tiles] [--attention-splits auto|1|N]
        [--indexer-split fixed|auto] [--layers sliding,csa,hca] [--batches 1,64] [--contexts 4096,65536]
        [--no-fp4-gemms] [--no-breakdown] [--no-linears] [--no-layers] [--hc-split 1|auto]
        [--stream-stages 2|4] [--fp8-linears bf16|stream|bf16,stream] [--name NAME]

Then a breakdown at context 4k, batch 1 and 64: the layer's parts timed alone, each captured in a
CUDA graph (device time, no host launch cost) — mHC, the dense projections, the MoE and its parts
(router, grouping, both FP4 expert GEMMs, shared expert), the indexer (fixed 256 entries per block
and the ``auto`` split), sparse attention (one run and the ``auto`` split) — next to
the whole layer; and the FP4 expert GEMMs alone (moe_fp4.cu's stream and tiles kernels, both
projections, batch 1 / 64 / 256) against the bytes they must read.

``--fp4-gemm`` sets ``OPENINFER_DSV4_FP4_GEMM`` for the layer rows (auto: the stream kernel for
steps of at most 256 tokens), ``--attention-splits`` ``OPENINFER_DSV4_ATTENTION_SPLITS`` (auto, the
default: split while the blocks do not fill the GPU; 1: one run of keys per block). Writes benchmarks/results/NAME.json and .png (NAME defaults to
gpu_dsv4_kernels; copies under $OUT when set).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
from openinfer_deepseek_v4.config import flash_config

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 64
VOCAB = 1024
# DeepSeek-V4-Flash (the plugin's one copy of its config.json), one layer, a small vocab, no hash routing
FLASH = {**flash_config(), "vocab_size": VOCAB, "num_hidden_layers": 1, "num_hash_layers": 0}
RATES = {"sliding": 0, "csa": 4, "hca": 128}


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    src = cupy.ones(2**30, dtype=cupy.uint16)
    dst = cupy.empty_like(src)
    return 2 * src.nbytes / gpu_seconds(lambda: dst.__setitem__(Ellipsis, src), 10, 2)


POOL_VALUES = 1 << 26  # the largest linear (wq_b, wo_b: 32M values) fits


@functools.cache
def random_pool() -> np.ndarray:
    """N(0, 1) values drawn once: the dense linears are slices of it, since speed does not depend
    on the values and drawing ~130M values per layer kind would take most of a short device job."""
    return np.random.default_rng(1).standard_normal(POOL_VALUES, np.float32)


def random_fp8_linear(out_features: int, in_features: int):
    """An FP8 linear (``cuda_linears.Fp8Linear``) of random e4m3 codes of magnitude 0.25 .. 3.75 and
    one e8m0 scale 2^−round(log2(in)/2) per block: values of the bf16 linears' size, no NaN codes."""
    import cupy
    from openinfer_deepseek_v4.cuda_linears import upload_fp8_linear

    codes = cupy.random.randint(5 << 3, 9 << 3, (out_features, in_features), dtype=cupy.int32)
    codes |= cupy.random.randint(0, 2, (out_features, in_features), dtype=cupy.int32) << 7
    scale = 127 - round(np.log2(in_features) / 2)
    return upload_fp8_linear(codes.astype(cupy.uint8), np.full((-(-out_features // 128), -(-in_features // 128)),
                                                               scale, np.uint8))


class Weights:
    """Random weights of one layer kind (the MoE shared across kinds), with their byte count.
    ``fp8``: the dense linears FP8 as the checkpoint stores them (kept so on the GPU:
    ``OPENINFER_DSV4_FP8_LINEAR=stream``) instead of bf16."""

    def __init__(self, backend, rng, fp8: bool = False):
        self.backend, self.rng, self.bytes, self.fp8 = backend, rng, 0, fp8

    def linear(self, out_features: int, in_features: int, stored_fp8: bool = True):
        """``stored_fp8`` False: a linear V4-Flash ships in BF16 (compressor, indexer weights_proj)."""
        if self.fp8 and stored_fp8:
            self.bytes += out_features * in_features + -(-out_features // 128) * -(-in_features // 128)
            return random_fp8_linear(out_features, in_features)
        self.bytes += 2 * out_features * in_features
        values = random_pool()[:out_features * in_features].reshape(out_features, in_features)
        return self.backend.linear_weight(values / np.float32(np.sqrt(in_features)))

    def norm(self, size: int):
        self.bytes += 2 * size
        return self.backend.weight((1 + 0.1 * self.rng.standard_normal(size)).astype(np.float32))

    def host(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        self.bytes += 4 * int(np.prod(shape))
        return (scale * self.rng.standard_normal(shape)).astype(np.float32)


def build_moe(backend, rng, c):
    """256 FP4 experts (gate_up [E, 2I, H], down [E, H, I]) + shared expert + router."""
    import cupy
    from openinfer_deepseek_v4.cuda_experts import Fp4Experts

    from openinfer.moe import ExpertWeights, MoEWeights, RouterSpec

    def fp4(num_experts: int, out_features: int, in_features: int) -> Fp4Experts:
        codes = cupy.empty((num_experts, out_features, in_features // 2), cupy.uint8)
        for e in range(num_experts):  # one expert at a time keeps the temporaries small
            codes[e] = cupy.random.randint(0, 256, (out_features, in_features // 2), dtype=cupy.int32).astype(cupy.uint8)
        scales = cupy.full((num_experts, out_features, in_features // 32), 124, cupy.uint8)  # 2^-3
        return Fp4Experts(codes, scales, out_features, in_features)

    w = Weights(backend, rng)
    hidden, inter, experts = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts
    router = RouterSpec(num_experts=experts, top_k=c.num_experts_per_tok, scoring="sqrtsoftplus",
                        routed_scaling_factor=c.routed_scaling_factor)
    shared = ExpertWeights(w.linear(2 * inter, hidden), w.linear(hidden, inter))
    moe = MoEWeights(router=router, gate=w.host(experts, hidden, scale=hidden**-0.5), experts=[None] * experts,
                     correction_bias=w.host(experts, scale=0.01), shared=shared, swiglu_limit=c.swiglu_limit,
                     stacked=(fp4(experts, 2 * inter, hidden), fp4(experts, hidden, inter)))
    w.bytes -= 4 * experts * hidden  # the router reads its weight in bf16 on the device
    w.bytes += 2 * experts * hidden
    per_expert = 3 * inter * hidden // 2 + 3 * inter * hidden // 32
    return moe, w.bytes, per_expert


def with_fp8_shared_expert(backend, moe, moe_bytes: int) -> tuple:
    """The same MoE with its shared expert FP8 as stored (``Weights(fp8=True)``), and its bytes."""
    import dataclasses

    from openinfer.moe import ExpertWeights

    w = Weights(backend, None, fp8=True)
    inter, hidden = moe.shared.down.in_features, moe.shared.down.out_features
    shared = ExpertWeights(w.linear(2 * inter, hidden), w.linear(hidden, inter))
    return dataclasses.replace(moe, shared=shared), moe_bytes - 2 * 3 * inter * hidden + w.bytes


def build_model(backend, kind: str, moe, max_model_len: int, fp8: bool = False):
    from openinfer_deepseek_v4.config import DeepseekV4Config
    from openinfer_deepseek_v4.model import DeepseekV4Model
    from openinfer_deepseek_v4.weights import (
        AttentionWeights,
        CompressorWeights,
        DeepseekV4Weights,
        HyperConnectionWeights,
        IndexerWeights,
        LayerWeights,
    )

    c = DeepseekV4Config.from_dict({**FLASH, "compress_ratios": [RATES[kind], 0]})
    w = Weights(backend, np.random.default_rng(1), fp8)
    hidden, heads, dim, hc = c.hidden_size, c.num_attention_heads, c.head_dim, c.hc_mult

    def hyper(rows: int, scales: int) -> HyperConnectionWeights:
        return HyperConnectionWeights(w.host(rows, hc * hidden, scale=0.01), w.host(rows, scale=0.3),
                                      np.full(scales, 0.7, np.float32))

    def compressor(width: int, rate: int, overlap: bool) -> CompressorWeights:
        c_width = (2 if overlap else 1) * width
        return CompressorWeights(w.linear(c_width, hidden, False), w.linear(c_width, hidden, False),
                                 w.host(rate, c_width, scale=0.3),
                                 w.norm(width), rate, width, overlap)

    rate = RATES[kind]
    attn = AttentionWeights(
        wq_a=w.linear(c.q_lora_rank, hidden), q_norm=w.norm(c.q_lora_rank), wq_b=w.linear(heads * dim, c.q_lora_rank),
        wkv=w.linear(dim, hidden), kv_norm=w.norm(dim),
        wo_a=w.host(c.o_groups, c.o_lora_rank, heads * dim // c.o_groups, scale=(heads * dim // c.o_groups) ** -0.5),
        wo_b=w.linear(hidden, c.o_groups * c.o_lora_rank), sink=w.host(heads),
        compressor=compressor(dim, rate, kind == "csa") if rate else None,
        indexer=IndexerWeights(w.linear(c.index_n_heads * c.index_head_dim, c.q_lora_rank),
                               w.linear(c.index_n_heads, hidden, False), compressor(c.index_head_dim, rate, True),
                               c.index_n_heads, c.index_head_dim, c.index_topk) if kind == "csa" else None)
    w.bytes -= 2 * c.o_lora_rank * heads * dim  # wo_a: counted as fp32 on the host, bf16 on the device
    layer = LayerWeights(w.norm(hidden), w.norm(hidden), hyper((2 + hc) * hc, 3), hyper((2 + hc) * hc, 3), attn, moe)
    attention_bytes = w.bytes
    weights = DeepseekV4Weights(embed=backend.weight(np.zeros((VOCAB, hidden), np.float32)),
                                head=backend.linear_weight(np.zeros((VOCAB, hidden), np.float32)),
                                norm=backend.weight(np.ones(hidden, np.float32)), hc_head=hyper(hc, 1),
                                layers=[layer])
    return DeepseekV4Model(c, weights, backend, max_model_len=max_model_len), attention_bytes


def decode_setup(backend, model, batch: int, context: int):
    """Caches for ``batch`` sequences at ``context`` (random rows), and the decode step at
    position context − 2 (a typical step: it closes no compressed window, rates 4 and 128)."""
    import cupy

    from openinfer import ForwardBatch, group_specs

    specs = model.kv_cache_specs()
    groups = group_specs(specs)
    position = context - 2
    widths, tables = [], []
    for group in groups.groups:
        if not group.paged:
            widths.append(0)
            tables.append(None)
            continue
        blocks = group.spec.blocks_for(context, BLOCK)
        first = group.spec.first_live_block(position, BLOCK)
        table = np.zeros((batch, blocks), np.int32)
        live = blocks - first
        table[:, first:] = 1 + np.arange(batch * live, dtype=np.int32).reshape(batch, live)
        widths.append(1 + batch * live)
        tables.append(table)
    kv_cache = []
    for spec, gid in zip(specs, groups.group_of_layer, strict=True):
        layer = backend.allocate_kv(spec, widths[gid] if spec.paged else batch + 1, BLOCK)
        if spec.paged:  # random bf16 rows: N(0, 1) bits, the sign and exponent of a normal value
            layer.k[...] = (cupy.random.standard_normal(layer.k.shape, dtype=cupy.float32).view(cupy.uint32)
                            >> 16).astype(cupy.uint16)
        kv_cache.append(layer)
    width = max(t.shape[1] for t in tables if t is not None)
    padded = [np.pad(t, ((0, 0), (0, width - t.shape[1]))) if t is not None else np.zeros((batch, 0), np.int32)
              for t in tables]
    positions = np.full(batch, position, np.int32)
    no_writes = np.full(batch, -1, np.int32)
    step = ForwardBatch(
        token_ids=np.random.default_rng(2).integers(2, VOCAB, batch).astype(np.int32), positions=positions,
        query_start=np.arange(batch + 1, dtype=np.int32), context_lens=positions + 1, block_tables=padded[0],
        slot_mapping=no_writes, logits_rows=np.arange(batch, dtype=np.int32), max_query_len=1,
        max_context_len=position + 1, kv_block_tables=tuple(padded), kv_slot_mappings=tuple(no_writes for _ in padded),
        state_slots=np.arange(1, batch + 1, dtype=np.int32))
    return kv_cache, step, width, len(groups.groups)


def kv_bytes(kind: str, batch: int, context: int, c) -> int:
    per_seq = c.sliding_window * c.head_dim * 2
    if kind == "hca":
        per_seq += context // RATES[kind] * c.head_dim * 2
    elif kind == "csa":
        entries = context // RATES[kind]
        per_seq += min(entries, c.index_topk) * c.head_dim * 2 + entries * c.index_head_dim * 2
    return batch * per_seq


def bench_layer(backend, kind: str, built: tuple, moe_bytes: int, per_expert: int, batch: int, context: int,
                bandwidth: float) -> dict:
    """``built``: ``build_model``'s (model, attention bytes) for this kind and context."""
    from openinfer.graph import CudaGraphRunner
    from openinfer.tools.ledger import gpu_seconds

    model, attention_bytes = built
    kv_cache, step, width, num_groups = decode_setup(backend, model, batch, context)
    runner = CudaGraphRunner(backend, lambda b: model.forward(b, kv_cache), max_num_seqs=batch,
                             max_blocks_per_seq=width, buckets=(batch,), num_groups=num_groups, with_state=True)
    runner.capture()
    seconds = gpu_seconds(lambda: runner.run(step), 20, 3)
    c = model.config
    experts = c.n_routed_experts * (1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** batch)
    moved = attention_bytes + moe_bytes + experts * per_expert + kv_bytes(kind, batch, context, c)
    return {"layer": kind, "batch": batch, "context": context, "seconds": seconds, "bytes": int(moved),
            "experts_touched": experts, "roofline_seconds": moved / bandwidth,
            "roofline_fraction": moved / bandwidth / seconds}


def graph_seconds(fn, repeats: int = 20) -> float:
    """Median device time of ``fn`` (kernel launches only, no host sync) replayed from a CUDA
    graph: what it costs inside a captured decode step, without eager launch overhead."""
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # compiles, fills the pool on this stream
        stream.synchronize()
        mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)  # as openinfer.graph captures
        stream.begin_capture() if mode is None else stream.begin_capture(mode)
        try:
            fn()
        finally:
            graph = stream.end_capture()
        return gpu_seconds(lambda: graph.launch(stream), repeats, 3)


def bf16_random(shape: tuple[int, ...]):
    import cupy

    return (cupy.random.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)


def breakdown(backend, kind: str, moe, batch: int, context: int, fp8: bool = False) -> dict:
    """The layer's parts timed alone (eager, CUDA events) on its own caches: where the step goes."""
    import cupy
    from openinfer_deepseek_v4 import cuda_experts, cuda_ops
    from openinfer_deepseek_v4.cuda_linears import linear

    from openinfer.backend.cuda import moe_routing

    model, _ = build_model(backend, kind, moe, context + BLOCK, fp8)
    kv_cache, step, _, _ = decode_setup(backend, model, batch, context)
    device = backend.prepare_batch(step)
    c, layer, where = model.config, model.weights.layers[0], model.cache_index[0]
    attn, hidden, rate = layer.attn, c.hidden_size, RATES[kind]
    token_seq = cuda_ops.token_seq(device.query_start, batch)
    streams = cupy.random.standard_normal((batch, c.hc_mult, hidden), dtype=cupy.float32)
    mixed = cupy.empty_like(streams)
    fn, base, scale = (cupy.asarray(a, cupy.float32) for a in (layer.hc_attn.fn, layer.hc_attn.base,
                                                               layer.hc_attn.scale))
    x, qr, low_rank = bf16_random((batch, hidden)), bf16_random((batch, c.q_lora_rank)), bf16_random(
        (batch, c.o_groups * c.o_lora_rank))
    moe_device = cuda_experts.device_layer(layer.ffn, backend)

    def mhc() -> None:
        y, post, comb = cuda_ops.hc_collapse(streams, fn, base, scale, sinkhorn_iters=c.hc_sinkhorn_iters,
                                             hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps)
        cuda_ops.hc_expand(streams, y, post, comb, out=mixed)

    projections = [(x, attn.wq_a), (qr, attn.wq_b), (x, attn.wkv), (low_rank, attn.wo_b)]
    if attn.compressor is not None:
        projections += [(x, attn.compressor.wkv), (x, attn.compressor.wgate)]
    if attn.indexer is not None:
        projections += [(qr, attn.indexer.wq_b), (x, attn.indexer.weights_proj), (x, attn.indexer.compressor.wkv),
                        (x, attn.indexer.compressor.wgate)]
    ffn = layer.ffn
    ids, weights = moe_routing.route(x, moe_device.gate, ffn.router, moe_device.correction_bias)
    grouping = moe_routing.group_by_expert(ids, weights, ffn.router.num_experts)
    hidden_rows = bf16_random((grouping.sorted_slots.size, ffn.stacked[1].in_features))

    def shared() -> None:
        linear(backend, cuda_experts.swiglu_clamp(linear(backend, x, ffn.shared.gate_up), ffn.swiglu_limit),
               ffn.shared.down)

    times = {
        "mhc collapse + expand (x1 of 2)": graph_seconds(mhc),
        "dense projections (FP8 stream)" if fp8 else "dense projections (cuBLAS, bf16)": graph_seconds(
            lambda: [linear(backend, a, w) for a, w in projections]),
        "moe (route + FP4 experts + shared)": graph_seconds(
            lambda: cuda_experts.moe_layer(backend, x, ffn, moe_device, device.token_ids)),
        "moe: router (core moe_route)": graph_seconds(lambda: moe_routing.route(x, moe_device.gate, ffn.router,
                                                                             moe_device.correction_bias)),
        "moe: grouping (core moe_sort)": graph_seconds(lambda: moe_routing.group_by_expert(ids, weights,
                                                                                        ffn.router.num_experts)),
        "moe: FP4 gate_up": graph_seconds(lambda: cuda_experts.grouped_gemm(x, moe_device.gate_up, grouping, True)),
        "moe: FP4 down": graph_seconds(lambda: cuda_experts.grouped_gemm(hidden_rows, moe_device.down, grouping,
                                                                         False)),
        "moe: shared expert (FP8 stream)" if fp8 else "moe: shared expert (cuBLAS, bf16)": graph_seconds(shared),
    }
    entries = entry_tables = selected = None
    if rate:
        entries = kv_cache[where.entries].k
        entry_tables = device.group_block_tables(where.entries_group)
    if kind == "csa":
        index = attn.indexer
        keys, key_tables = kv_cache[where.index_keys].k, device.group_block_tables(where.index_keys_group)
        index_q = bf16_random((batch, index.num_heads, index.head_dim))
        head_weights = cupy.random.standard_normal((batch, index.num_heads), dtype=cupy.float32)

        def pick(split: str = "fixed"):
            return cuda_ops.indexer_topk(index_q, head_weights, keys, key_tables, BLOCK, token_seq, device.positions,
                                         rate, context // rate, index.topk, split=split)

        times["indexer scores + top-k"] = graph_seconds(pick)
        times["indexer scores + top-k, split over entries (auto)"] = graph_seconds(partial(pick, "auto"))
        selected = pick()[1]
    q = bf16_random((batch, c.num_attention_heads, c.head_dim))
    sinks = cupy.asarray(attn.sink, cupy.float32)
    inv_freq = cupy.asarray((model.rope_compress if rate else model.rope_main).inv_freq, cupy.float32)
    window = kv_cache[where.window].k
    for label, splits in (("sparse attention", 1), ("sparse attention, split over keys (auto)", "auto")):
        times[label] = graph_seconds(partial(
            cuda_ops.sparse_attention, q, window, device.group_block_tables(where.window_group), entries, entry_tables,
            selected, max(rate, 1), token_seq, device.positions, sinks, inv_freq, c.rope_head_dim, c.sliding_window,
            BLOCK, splits=splits))
    times["whole layer"] = graph_seconds(lambda: model.forward(device, kv_cache), 10)
    return {"layer": kind, "batch": batch, "context": context, "fp8_linears": "stream" if fp8 else "bf16",
            "seconds": times}


def mhc_rows(batches: list[int], hidden: int, hc: int, sinkhorn_iters: int) -> list[dict]:
    """One mHC use (collapse: mixing logits, Sinkhorn, x; then expand) alone at each batch, both
    ``OPENINFER_DSV4_HC_SPLIT`` settings side by side: one block per dot product / token (``1``)
    and the dot products cut into slices, x over several blocks (``auto``)."""
    import cupy
    from openinfer_deepseek_v4 import cuda_ops

    rng = np.random.default_rng(3)
    num_mix = (2 + hc) * hc
    fn = cupy.asarray((0.01 * rng.standard_normal((num_mix, hc * hidden))).astype(np.float32))
    base = cupy.asarray((0.3 * rng.standard_normal(num_mix)).astype(np.float32))
    scale = cupy.full(3, 0.7, cupy.float32)
    rows = []
    for batch in batches:
        streams = cupy.random.standard_normal((batch, hc, hidden), dtype=cupy.float32)
        mixed = cupy.empty_like(streams)
        for split in ("1", "auto"):
            use = partial(mhc_use, cuda_ops, streams, mixed, (fn, base, scale), sinkhorn_iters, split)
            rows.append({"batch": batch, "hc_split": split, "seconds": graph_seconds(use)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def mhc_use(cuda_ops, streams, mixed, weights: tuple, sinkhorn_iters: int, split: str) -> None:
    """hc_collapse of ``streams`` (weights: fn, base, scale), then hc_expand of its x into ``mixed``."""
    x, post, comb = cuda_ops.hc_collapse(streams, *weights, sinkhorn_iters=sinkhorn_iters, hc_eps=1e-6,
                                         norm_eps=1e-6, split=split)
    cuda_ops.hc_expand(streams, x, post, comb, out=mixed)


# V4-Flash's FP8 dense linears [out, in] (the shared expert's gate_up fused)
FP8_LINEARS = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
               "indexer.wq_b": (8192, 1024), "shared gate_up": (4096, 4096), "shared down": (4096, 2048)}


def linear_rows(backend, batches: list[int], bandwidth: float) -> list[dict]:
    """Each FP8 dense linear alone at each batch: bf16 on cuBLAS (the default, dequantised at load)
    vs FP8 as stored on ``fp8_stream_linear`` (split K by ``kernel_plan.fp8_linear_splits`` and
    not; 2- and 4-stage staging), with the fraction of the copy bandwidth its weight bytes take."""
    from openinfer_deepseek_v4.cuda_linears import fp8_linear

    rows = []
    for name, (out_features, in_features) in FP8_LINEARS.items():
        dense = Weights(backend, None).linear(out_features, in_features)
        fp8 = random_fp8_linear(out_features, in_features)
        for batch in batches:
            x = bf16_random((batch, in_features))
            variants = {"bf16 cuBLAS": (partial(backend.linear, x, dense), 2),
                        "fp8 stream": (partial(fp8_linear, x, fp8, backend.blas, "stream", None, "2"), 1),
                        "fp8 stream, no split": (partial(fp8_linear, x, fp8, backend.blas, "stream", 1, "2"), 1),
                        "fp8 stream, 4 stages": (partial(fp8_linear, x, fp8, backend.blas, "stream", None, "4"), 1)}
            for variant, (run, weight_bytes) in variants.items():
                seconds = graph_seconds(run)
                moved = weight_bytes * out_features * in_features
                rows.append({"linear": name, "batch": batch, "variant": variant, "seconds": seconds,
                             "fraction_of_copy_bandwidth": moved / bandwidth / seconds})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def fp4_gemms(backend, moe, batch: int, bandwidth: float) -> list[dict]:
    """Each FP4 expert projection alone, both kernels (the stream one with 2- and 4-stage
    activation staging, ``OPENINFER_DSV4_STREAM_STAGES``), on a uniform random routing of ``batch``
    tokens (top-6 of 256, distinct per token): seconds and the fraction of the copy bandwidth its
    bytes (the touched experts' codes and scales, the rows read and written) take."""
    import cupy
    from openinfer_deepseek_v4 import cuda_experts

    from openinfer.backend.cuda import moe_routing

    router = moe.router
    rng = np.random.default_rng(batch)
    ids = np.stack([rng.permutation(router.num_experts)[:router.top_k] for _ in range(batch)]).astype(np.int32)
    touched = len(np.unique(ids))
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.asarray(rng.random(ids.shape, np.float32)),
                                        router.num_experts)
    rows = []
    for name, weight, gather in (("gate_up", moe.stacked[0], True), ("down", moe.stacked[1], False)):
        a = bf16_random((batch if gather else batch * router.top_k, weight.in_features))
        moved = (touched * weight.out_features * (weight.in_features // 2 + weight.in_features // 32)
                 + 2 * a.size + 2 * batch * router.top_k * weight.out_features)
        for method, stages in (("stream", "2"), ("stream", "4"), ("tiles", "2")):
            seconds = graph_seconds(partial(cuda_experts.fp4_grouped_gemm, a, weight, grouping, gather, method=method,
                                            stages=stages))
            label = method if stages == "2" else f"{method} ({stages}-stage staging)"
            rows.append({"projection": name, "batch": batch, "method": label, "experts_touched": touched,
                         "seconds": seconds, "bytes": int(moved), "fraction_of_copy_bandwidth": moved / bandwidth
                         / seconds})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    modes = {r.get("fp8_linears", "bf16") for r in rows}
    labels = [f"{r['layer']}\nb{r['batch']} {r['context'] // 1024}k" + (f"\n{r['fp8_linears']}" if len(modes) > 1 else "")
              for r in rows]
    axes[0].bar(range(len(rows)), [1e3 * r["seconds"] for r in rows], label="measured")
    axes[0].bar(range(len(rows)), [1e3 * r["roofline_seconds"] for r in rows], alpha=0.6, label="HBM roofline")
    axes[0].set_ylabel("ms per decode step (one layer + MoE)")
    axes[0].legend()
    axes[1].bar(range(len(rows)), [100 * r["roofline_fraction"] for r in rows])
    axes[1].set_ylabel("% of HBM roofline")
    for ax in axes:
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    fig.suptitle("DeepSeek-V4-Flash layer decode step (graph replay)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sizes(parser: argparse.ArgumentParser, flag: str, text: str | None, default: list[int], least: int) -> list[int]:
    """A comma-separated list of integers of at least ``least`` (``default`` when not given)."""
    if text is None:
        return default
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        parser.error(f"{flag} {text!r}: expected comma-separated integers of at least {least}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 64, context 4k only")
    parser.add_argument("--fp4-gemm", choices=("auto", "stream", "tiles"), default="auto",
                        help="the FP4 expert GEMM of the layer rows (OPENINFER_DSV4_FP4_GEMM)")
    parser.add_argument("--attention-splits", default="auto",
                        help="sparse attention runs of keys for the layer rows: 1, auto or a count "
                             "(OPENINFER_DSV4_ATTENTION_SPLITS)")
    parser.add_argument("--indexer-split", choices=("fixed", "auto"), default="auto",
                        help="indexer entries per scoring block for the layer rows (OPENINFER_DSV4_INDEXER_SPLIT)")
    parser.add_argument("--layers", default=",".join(RATES), help="comma-separated layer kinds (sliding,csa,hca)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes of the layer rows and "
                        "breakdown (default 1,64,256; --quick 1,64)")
    parser.add_argument("--no-fp4-gemms", action="store_true", help="skip the FP4 expert GEMMs alone")
    parser.add_argument("--no-linears", dest="linears", action="store_false",
                        help="skip the FP8 dense linears alone (bf16 cuBLAS vs FP8 stream)")
    parser.add_argument("--no-layers", dest="layers_rows", action="store_false",
                        help="skip the layer rows (the parts alone only)")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="skip the per-part breakdown (the layer rows only)")
    parser.add_argument("--contexts", default=None, help="comma-separated contexts of the layer rows "
                        "(default 4096,65536; --quick 4096)")
    parser.add_argument("--hc-split", choices=("1", "auto"), default=None,
                        help="mHC mixing dot products and x per block for the layer rows (OPENINFER_DSV4_HC_SPLIT; "
                             "default: the plugin's)")
    parser.add_argument("--stream-stages", choices=("2", "4"), default=None,
                        help="activation staging of the stream GEMMs for the layer rows "
                             "(OPENINFER_DSV4_STREAM_STAGES; default: the plugin's)")
    parser.add_argument("--fp8-linears", default=None,
                        help="the dense linears (attention projections, shared expert): bf16 (dequantised at "
                             "load), stream (FP8 as stored, OPENINFER_DSV4_FP8_LINEAR=stream) or bf16,stream (both, "
                             "side by side in one run); default: the plugin's setting")
    parser.add_argument("--name", default="gpu_dsv4_kernels", help="results file name (no suffix)")
    args = parser.parse_args()
    from openinfer_deepseek_v4.kernel_plan import (
        attention_kernel_setting,
        attention_splits_setting,
        fp8_linear_setting,
        hc_split_setting,
        stream_stages_setting,
    )

    args.fp8_linears = args.fp8_linears or fp8_linear_setting(os.environ)
    args.hc_split = args.hc_split or hc_split_setting(os.environ)
    modes = args.fp8_linears.split(",")
    if not modes or any(mode not in ("bf16", "stream") for mode in modes):
        parser.error(f"--fp8-linears {args.fp8_linears!r}: expected bf16, stream or bf16,stream")

    try:
        attention_splits_setting({"OPENINFER_DSV4_ATTENTION_SPLITS": args.attention_splits})
    except ValueError as error:
        parser.error(str(error))
    kinds = args.layers.split(",")
    if not kinds or any(kind not in RATES for kind in kinds):
        parser.error(f"--layers {args.layers!r}: expected a comma-separated subset of {','.join(RATES)}")
    batches = sizes(parser, "--batches", args.batches, [1, 64] if args.quick else [1, 64, 256], 1)
    contexts = sizes(parser, "--contexts", args.contexts, [4096] if args.quick else [4096, 65536], 2)
    os.environ["OPENINFER_DSV4_FP4_GEMM"] = args.fp4_gemm  # both read when the plugin's cuda modules load
    os.environ["OPENINFER_DSV4_ATTENTION_SPLITS"] = args.attention_splits
    os.environ["OPENINFER_DSV4_INDEXER_SPLIT"] = args.indexer_split
    os.environ["OPENINFER_DSV4_HC_SPLIT"] = args.hc_split
    if args.stream_stages:
        os.environ["OPENINFER_DSV4_STREAM_STAGES"] = args.stream_stages
    import cupy
    from openinfer_deepseek_v4.config import DeepseekV4Config

    from openinfer import create_backend

    backend = create_backend("cuda")
    bandwidth = copy_bandwidth()
    moe, moe_bytes, per_expert = build_moe(backend, np.random.default_rng(0),
                                           DeepseekV4Config.from_dict({**FLASH, "compress_ratios": [0, 0]}))
    rows: list[dict] = []
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    moes = {mode: (moe, moe_bytes) if mode == "bf16" else with_fp8_shared_expert(backend, moe, moe_bytes)
            for mode in modes}
    report = {"gpu": backend.device_name, "cupy": cupy.__version__, "copy_bandwidth_bytes_per_s": bandwidth,
              "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "what": "one DeepSeek-V4-Flash layer + MoE, decode step (graph replay)",
              "fp4_gemm": args.fp4_gemm, "attention_splits": args.attention_splits,
              "indexer_split": args.indexer_split, "hc_split": args.hc_split, "fp8_linears": args.fp8_linears,
              "stream_stages": stream_stages_setting(os.environ),
              "attention_kernel": attention_kernel_setting(os.environ), "rows": rows}
    for kind in kinds if args.layers_rows else []:
        for context in contexts:
            built = {mode: build_model(backend, kind, moes[mode][0], context + BLOCK, mode == "stream")
                     for mode in modes}  # one model per mode serves every batch
            for batch in batches:
                for mode in modes:  # side by side: the modes' rows alternate
                    row = bench_layer(backend, kind, built[mode], moes[mode][1], per_expert, batch, context,
                                      bandwidth)
                    rows.append({**row, "fp8_linears": mode})
                    print(json.dumps(rows[-1]), flush=True)
                    cupy.get_default_memory_pool().free_all_blocks()
                    out.write_text(json.dumps(report, indent=1))  # after every row: a cut-off run keeps its rows
            del built
    flash = DeepseekV4Config.from_dict({**FLASH, "compress_ratios": [0, 0]})
    report["mhc"] = mhc_rows(batches, flash.hidden_size, flash.hc_mult, flash.hc_sinkhorn_iters)
    out.write_text(json.dumps(report, indent=1))
    report["breakdown"] = parts = []
    for kind in kinds if args.breakdown else []:
        for batch in [b for b in batches if b <= 64]:
            for mode in modes:
                parts.append(breakdown(backend, kind, moes[mode][0], batch, 4096, mode == "stream"))
                print(json.dumps(parts[-1]), flush=True)
                cupy.get_default_memory_pool().free_all_blocks()
                out.write_text(json.dumps(report, indent=1))
    if args.linears:
        report["linears"] = linear_rows(backend, batches, bandwidth)
        out.write_text(json.dumps(report, indent=1))
    if not args.no_fp4_gemms:
        report["fp4_gemms"] = [row for batch in batches for row in fp4_gemms(backend, moe, batch, bandwidth)]
        out.write_text(json.dumps(report, indent=1))
    if rows:
        plot(rows, out.with_suffix(".png"))
    if os.environ.get("OUT"):
        for path in (out, out.with_suffix(".png")):
            if path.exists():
                shutil.copy(path, Path(os.environ["OUT"]) / path.name)


if __name__ == "__main__":
    main()
