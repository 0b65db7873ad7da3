"""Kimi-K2 / DeepSeek-V3 GPU benchmarks (issue 13), JSON + PNG into benchmarks/results/ (and $OUT).

``kernels``: the choices inside core's Kimi kernels, measured side by side (CUDA events):
MLA attention of one prefill in the absorbed form vs the decompressed form (kv_b expansion +
tensor-core flash attention) at Moonlight's 16 and Kimi-K2's 64 heads; dense FP8 / INT4 linears
at Kimi-K2 shapes by method (moe_gemv, per-tile dequantising GEMM, bf16 scratch + cuBLAS, and a
bf16 cuBLAS baseline) over the row count; the routed INT4 experts' gate_up GEMM by kernel.

    python benchmarks/gpu_kimi.py kernels

``layer``: one Kimi-K2-shaped decoder layer (hidden 7168, MLA with 64 heads over a paged latent
cache, 384 INT4 experts top-8 + 1 shared expert; random weights, speed does not depend on the
values) timed alone with CUDA events at batch 1/64/256, against its HBM roofline: the bytes a
step must read (attention weights, the router, the shared expert, every expert some token routes
to, the batch's latent cache) over the measured device-to-device copy bandwidth. The step is timed
as a CUDA graph replay; each op (the MLA's latent write, W_UK, attention and W_UV apart) by its
device time in step order with the stream held behind a spin kernel (core's ledger timer: no host
launch gaps, weights cold in L2 as in a real step).

    python benchmarks/gpu_kimi.py layer [--context 1024] [--absorbed-kernel mma]   # OPENINFER_MOE_GEMV=mma: the tensor-core GEMV
    python benchmarks/gpu_kimi.py layer --variants cuda_cores:moe_gemv,mma:mma      # side by side, one run
    python benchmarks/gpu_kimi.py layer --batches 1 --variants auto:auto,auto:mma:no_mla_async+mla_combine_loop
    # a variant's options change core's defaults (LAYER_OPTIONS); without options it runs what ships
    python benchmarks/gpu_kimi.py warm   # moe.cu's modules compiled in parallel into CuPy's disk cache first

``gemv``: the decode GEMV kernels side by side (core's ``moe_gemv`` and the opt-in ones: the shapes
of ``moe_gemv_wide``, the tensor-core ``moe_gemv_mma``) and what runs without a GEMV (dense: bf16
scratch + cuBLAS; grouped: the per-tile GEMM): dense FP8 / INT4 linears at Kimi-K2 shapes with
1-32 rows and the routed INT4 experts' gate_up and down at 1-512 tokens (top-8 of 384), each call
timed inside a CUDA graph of calls on rotating weight copies / routings (so neither host launch
cost nor an L2-resident weight flatters the figure), against the bytes it must read over the copy
bandwidth. ``kernels --sections mla_decode``: MLA decode naive (decompressed) vs absorbed on CUDA
cores vs absorbed on tensor cores.

    python benchmarks/gpu_kimi.py gemv

``moonlight``: a Moonlight-16B-A3B-shaped model (27 layers, hidden 2048, 16 heads, kv_lora 512, qk
128+64, v 128, one dense layer of 11264, then 64 experts of 1408 top-6 + 2 shared, routed scaling
2.446, vocab 163840) as a random bf16 checkpoint on disk (~32 GB of sharded safetensors in the HF
DeepSeek-V3 spelling, written once per machine), served by ``openinfer serve`` and, with ``--engines
openinfer,vllm`` (or ``vllm`` alone plus ``--append`` in a later call), by vLLM 0.26.0 (installed by
``../shared/tools/vllm-peer.sh``) on the same weights, driven by the same client as
``gpu_concurrency.py`` (bursts of 1/16/64/256 streams, fresh 1k-token prompts, 128 tokens out):
TPOT p50 and output throughput, and their ratios when both ran.

    python benchmarks/gpu_kimi.py moonlight [--engines openinfer,vllm]
    python benchmarks/gpu_kimi.py moonlight --tiny --streams 1,4 --input-len 64 --output-len 8  # CPU dry run

Both servers get ``--max-model-len 4096`` (``{max_model_len}`` in ``--vllm-cmd``), the same prompts
(token-id lists, fresh per point) and greedy ignore_eos requests from the lean multi-process SSE
client. The checkpoint: config.json as published (``q_lora_rank: null``, no rope_scaling, no
auto_map: vLLM's own DeepseekV3 model, no --trust-remote-code), HF tensor names (transformers'
DeepseekV3ForCausalLM loads it with nothing missing or unexpected: tests/benchmarks), a word-level
tokenizer.json with ``PreTrainedTokenizerFast`` (as the Qwen3 side by side), no
generation_config.json (both engines keep their defaults). It goes to /dev/shm when that has 40 GB
free, else /tmp, written by 16 threads (``--write-threads``); a copy of the same config is reused.
Each server's output goes to ``$OUT/moonlight_ENGINE.log`` (the last lines are printed when it
fails to start); SIGTERM (``timeout``) stops the running server first.

The two device calls (E2, one warm H200; vLLM installed at /tmp/vsite; the second call finds the
checkpoint and the first call's JSON on the same machine):

    mkdir -p $OUT/moonlight && timeout 60 python3 benchmarks/gpu_kimi.py warm; \
    OUT=$OUT/moonlight timeout 470 python3 benchmarks/gpu_kimi.py moonlight --engines openinfer \
        --start-timeout 300; cp benchmarks/results/moonlight_serving.json /tmp/moonlight_openinfer.json
    mkdir -p $OUT/moonlight && OUT=$OUT/moonlight timeout 570 python3 benchmarks/gpu_kimi.py moonlight \
        --engines vllm --append /tmp/moonlight_openinfer.json --start-timeout 450

Where the second call ran without the first's JSON, combine the two afterwards (no device):
``python benchmarks/gpu_kimi.py moonlight --engines none --append OURS.json,VLLM.json``.
openinfer's ``--load-format dummy`` would skip the file but serve other weights than vLLM (other
expert routing); the file costs one write and vLLM needs it anyway, so both read it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
FORMATS_OF_WARM = ("bf16", "int4", "fp8")  # core's expert weight formats (cuda moe.FORMATS)
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

KIMI_LAYER = {"hidden": 7168, "heads": 64, "q_lora": 1536, "kv_lora": 512, "nope": 128, "rope": 64, "v": 128,
              "experts": 384, "top_k": 8, "inter": 2048, "group": 32}
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
    "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "n_shared_experts": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "max_position_embeddings": 8192, "rope_theta": 50000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585, "torch_dtype": "bfloat16",
    # as in the published config.json (both engines also default to these)
    "hidden_act": "silu", "rope_scaling": None, "attention_bias": False, "num_nextn_predict_layers": 0,
}


@contextlib.contextmanager
def switched_env(switches: dict[str, str]):
    """Environment switches set for the block, each restored (or removed) after it."""
    before = {name: os.environ.get(name) for name in switches}
    os.environ.update(switches)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def device_name() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown GPU"


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    import cupy

    src = cupy.ones(2**30, dtype=cupy.uint16)
    dst = cupy.empty_like(src)
    dst[...] = src
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(10):
        dst[...] = src
    stop.record()
    stop.synchronize()
    seconds = cupy.cuda.get_elapsed_time(start, stop) / 1e3 / 10
    return 2 * src.nbytes / seconds


# --- kernel choices ------------------------------------------------------------------------------

MLA_PREFILLS = [(0, 128), (0, 512), (0, 2048), (0, 4096), (2016, 32), (4032, 64)]  # (cached, new) of one sequence
LINEAR_SHAPES = {"fp8 o_proj 7168x8192": ("fp8", 7168, 8192), "int4 expert gate_up 4096x7168": ("int4", 4096, 7168)}
LINEAR_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
GROUPED_TOKENS = [1, 16, 64, 256]


def one_sequence_batch(backend, cached: int, new: int, block_size: int = 64):
    from openinfer.backend.base import ForwardBatch

    total = cached + new
    blocks = -(-total // block_size)
    tables = (1 + np.arange(blocks, dtype=np.int32))[None]
    positions = np.arange(cached, total, dtype=np.int32)
    host = ForwardBatch(token_ids=np.zeros(new, np.int32), positions=positions,
                        query_start=np.array([0, new], np.int32), context_lens=np.array([total], np.int32),
                        block_tables=tables,
                        slot_mapping=(tables[0, positions // block_size] * block_size + positions % block_size
                                      ).astype(np.int32),
                        logits_rows=np.array([new - 1], np.int32), max_query_len=new, max_context_len=total)
    return backend.prepare_batch(host), blocks + 1


def attend_once(backend, q, latent, cache, w_uk, w_uv, norm, spec, batch, cos, sin, min_query: int):
    from openinfer.backend.cuda import mla as cuda_mla

    return cuda_mla.mla_forward(backend.blas, q.copy(), latent, cache, w_uk, w_uv, norm, spec, batch, cos, sin,
                                1e-6, backend.num_sms, prefill_min_query=min_query)


def bench_mla_prefill(backend, rng) -> list[dict]:
    """Absorbed vs decompressed MLA over one sequence's new tokens (the latent write included in both)."""
    import cupy

    from openinfer.mla import MLASpec
    from openinfer.rope import RopeParameters, RotaryEmbedding
    from openinfer.tools.ledger import gpu_seconds

    points = []
    rope = RotaryEmbedding.create(64, RopeParameters(50000.0), 8192)
    cos, sin = cupy.asarray(rope.cos), cupy.asarray(rope.sin)
    for heads in (16, 64):
        spec = MLASpec(heads, 128, 64, 128, 512, 192 ** -0.5)
        w_uk = backend.weight((0.05 * rng.standard_normal((heads, 128, 512))).astype(np.float32))
        w_uv = backend.weight((0.05 * rng.standard_normal((heads, 128, 512))).astype(np.float32))
        norm = backend.weight(np.ones(512, np.float32))
        for cached, new in MLA_PREFILLS:
            batch, num_blocks = one_sequence_batch(backend, cached, new)
            cache = backend.upload(rng.standard_normal((num_blocks, 64, 1, 576)).astype(np.float32))
            q = backend.upload(rng.standard_normal((new, heads * 192)).astype(np.float32))
            latent = backend.upload(rng.standard_normal((new, 576)).astype(np.float32))
            outputs, times = {}, {}
            for form, min_query in (("absorbed", 10**9), ("decompressed", 1)):
                attend = partial(attend_once, backend, q, latent, cache, w_uk, w_uv, norm, spec, batch, cos, sin,
                                 min_query)
                outputs[form] = backend.to_host(attend())
                times[form] = gpu_seconds(attend, repeats=3 if heads * new * (cached + new) > 2**27 else 10)
            ref = outputs["absorbed"]
            point = {"heads": heads, "cached": cached, "new": new,
                     "absorbed_ms": 1e3 * times["absorbed"], "decompressed_ms": 1e3 * times["decompressed"],
                     "speedup": times["absorbed"] / times["decompressed"],
                     "relative_difference": float(np.linalg.norm(outputs["decompressed"] - ref) / np.linalg.norm(ref))}
            points.append(point)
            print(json.dumps(point), flush=True)
    return points


MLA_DECODES = [(1, 1024), (1, 4096), (64, 1024), (256, 1024), (64, 4096)]  # (batch, context)
# (key, plot label): the decompressed ("naive") form, kv_b expansion of the whole context + flash
# attention, as a decode would take it with prefill_min_query 1; the absorbed form on each kernel.
MLA_DECODE_FORMS = (("decompressed", "decompressed (naive)"), ("cuda_cores", "absorbed, CUDA cores"),
                    ("mma", "absorbed, tensor cores"),
                    ("mma_async", "absorbed, tensor cores, cp.async tiles + shared combine (opt-in)"),
                    ("mma16_async", "the same in blocks of 16 heads (opt-in)"))


def decode_batch(backend, batch: int, context: int, block_size: int = 64):
    from openinfer.backend.base import ForwardBatch

    blocks = -(-(context + 1) // block_size)
    tables = (1 + np.arange(batch * blocks, dtype=np.int32)).reshape(batch, blocks)
    positions = np.full(batch, context, np.int32)
    host = ForwardBatch(token_ids=np.zeros(batch, np.int32), positions=positions,
                        query_start=np.arange(batch + 1, dtype=np.int32),
                        context_lens=np.full(batch, context + 1, np.int32), block_tables=tables,
                        slot_mapping=(tables[:, context // block_size] * block_size + context % block_size
                                      ).astype(np.int32),
                        logits_rows=np.arange(batch, dtype=np.int32), max_query_len=1, max_context_len=context + 1)
    return backend.prepare_batch(host), batch * blocks + 1


def device_random_bf16(shape: tuple[int, ...]):
    """N(0, 1) bf16 bits drawn on the device (a decode grid's latent caches are 10^8 values: host
    RNG plus upload would take seconds of a short device window)."""
    import cupy

    values = cupy.random.standard_normal(shape, dtype=cupy.float32)
    return (values.view(cupy.uint32) >> 16).astype(cupy.uint16)


def decode_once(backend, q, latent, cache, w_uk, w_uv, norm, spec, batch, cos, sin, form: str):
    from openinfer.backend.cuda import mla as cuda_mla

    if form == "decompressed":
        return cuda_mla.mla_forward(backend.blas, q.copy(), latent, cache, w_uk, w_uv, norm, spec, batch, cos, sin,
                                    1e-6, backend.num_sms, prefill_min_query=1)
    if form in ("mma_async", "mma16_async"):  # the opt-in kernels by their switches, for this call only
        switches = {cuda_mla.ASYNC_TILES_ENV: "1", cuda_mla.COMBINE_ENV: "shared",
                    cuda_mla.HEADS16_ENV: "1" if form == "mma16_async" else "0"}
        with switched_env(switches):
            return cuda_mla.mla_forward(backend.blas, q.copy(), latent, cache, w_uk, w_uv, norm, spec, batch, cos,
                                        sin, 1e-6, backend.num_sms, prefill_min_query=10**9, absorbed_kernel="mma")
    return cuda_mla.mla_forward(backend.blas, q.copy(), latent, cache, w_uk, w_uv, norm, spec, batch, cos, sin,
                                1e-6, backend.num_sms, prefill_min_query=10**9, absorbed_kernel=form)


def bench_mla_decode(backend, rng, bandwidth: float, heads_list: tuple[int, ...] = (16, 64)) -> list[dict]:
    """MLA decode three ways (MLA_DECODE_FORMS), whole mla_forward (latent write, W_UK or kv_b,
    attention, W_UV), against the latent cache's bytes over the copy bandwidth. The decompressed
    form is timed only where core's scratch cap lets it take every sequence (else its time would
    be a mix of both forms; ``decompressed_ms`` is then null and ``decompressed_skipped`` says why)."""
    import cupy

    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.mla import MLASpec
    from openinfer.rope import RopeParameters, RotaryEmbedding
    from openinfer.tools.ledger import gpu_seconds

    rope = RotaryEmbedding.create(64, RopeParameters(50000.0), 8192)
    cos, sin = cupy.asarray(rope.cos), cupy.asarray(rope.sin)
    points = []
    for heads in heads_list:
        spec = MLASpec(heads, 128, 64, 128, 512, 192 ** -0.5)
        w_uk = backend.weight((0.05 * rng.standard_normal((heads, 128, 512))).astype(np.float32))
        w_uv = backend.weight((0.05 * rng.standard_normal((heads, 128, 512))).astype(np.float32))
        norm = backend.weight(np.ones(512, np.float32))
        for batch_size, context in MLA_DECODES:
            batch, num_blocks = decode_batch(backend, batch_size, context)
            cache = device_random_bf16((num_blocks, 64, 1, 576))
            q = backend.upload(rng.standard_normal((batch_size, heads * 192)).astype(np.float32))
            latent = backend.upload(rng.standard_normal((batch_size, 576)).astype(np.float32))
            point = {"heads": heads, "batch": batch_size, "context": context,
                     "cache_roofline_ms": 1e3 * batch_size * (context + 1) * 576 * 2 / bandwidth}
            plan = cuda_mla.plan_prefill(batch.host, spec, 1)
            outputs = {}
            for form, _ in MLA_DECODE_FORMS:
                if form == "decompressed" and (plan is None or plan.absorbed_rows is not None):
                    point["decompressed_ms"] = None
                    point["decompressed_skipped"] = (f"expanded context past the {cuda_mla.PREFILL_SCRATCH_BYTES >> 20}"
                                                     " MiB scratch cap: some sequences stay absorbed")
                    continue
                run = partial(decode_once, backend, q, latent, cache, w_uk, w_uv, norm, spec, batch, cos, sin, form)
                outputs[form] = backend.to_host(run())
                point[f"{form}_ms"] = 1e3 * gpu_seconds(run, repeats=10)
            reference = outputs["cuda_cores"]
            for form in outputs.keys() - {"cuda_cores"}:
                point[f"{form}_relative_difference"] = float(np.linalg.norm(outputs[form] - reference)
                                                             / np.linalg.norm(reference))
            point["mma_speedup"] = point["cuda_cores_ms"] / point["mma_ms"]
            point["mma_async_speedup"] = point["mma_ms"] / point["mma_async_ms"]
            point["mma16_async_speedup"] = point["mma_ms"] / point["mma16_async_ms"]
            points.append(point)
            print(json.dumps(point), flush=True)
    return points


def bench_quantized_linears(backend, rng, bandwidth: float) -> list[dict]:
    import cupy

    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda.moe import ExpertLinear
    from openinfer.tools.ledger import gpu_seconds

    points = []
    for name, (fmt, n, k) in LINEAR_SHAPES.items():
        if fmt == "fp8":
            codes = cupy.random.randint(0, 256, size=(1, n, k), dtype=cupy.int32).astype(cupy.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
            weight = ExpertLinear("fp8", codes, cupy.full((1, -(-n // 128), -(-k // 128)), 1e-2, cupy.float32), n, k)
        else:
            words = cupy.random.randint(-2**31, 2**31 - 1, size=(1, n, k // 8), dtype=cupy.int64).astype(cupy.int32)
            weight = ExpertLinear("int4", words, backend.weight(np.full((1, n, k // 32), 0.01, np.float32)), n, k)
        stored = weight.data.nbytes + weight.scale.nbytes
        dense = cuda_moe.dequantize(weight)
        for rows in LINEAR_ROWS:
            x = backend.upload(rng.standard_normal((rows, k)).astype(np.float32))
            point = {"weight": name, "rows": rows}
            reference = None
            for method in ("gemv", "tiles", "dequantize"):
                if method == "gemv" and rows > 64:
                    continue
                out = backend.to_host(cuda_moe.quantized_linear(x, weight, backend.blas, method))
                reference = out if reference is None else reference
                point[f"{method}_relative_difference"] = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
                point[f"{method}_ms"] = 1e3 * gpu_seconds(
                    partial(cuda_moe.quantized_linear, x, weight, backend.blas, method), repeats=20)
            out = cupy.empty((rows, n), cupy.uint16)
            point["cublas_bf16_ms"] = 1e3 * gpu_seconds(partial(backend.blas.matmul_nt, x, dense, out), repeats=20)
            point["chosen_ms"] = 1e3 * gpu_seconds(partial(cuda_moe.quantized_linear, x, weight, backend.blas),
                                                   repeats=20)
            point["stored_weight_roofline_ms"] = 1e3 * stored / bandwidth
            points.append(point)
            print(json.dumps(point), flush=True)
    return points


def bench_grouped_experts(backend, rng) -> list[dict]:
    """gate_up of Kimi-K2's 384 INT4 experts (4096 x 7168), top-8 routing of T tokens: moe_gemv
    vs the tensor-core grouped GEMM over the same tiles."""
    import cupy

    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda import moe_routing
    from openinfer.backend.cuda.moe import ExpertLinear
    from openinfer.tools.ledger import gpu_seconds

    c = KIMI_LAYER
    experts, n, k = c["experts"], 2 * c["inter"], c["hidden"]
    words = cupy.random.randint(-2**31, 2**31 - 1, size=(experts, n, k // 8), dtype=cupy.int64).astype(cupy.int32)
    weight = ExpertLinear("int4", words, backend.weight(np.full((experts, n, k // 32), 0.01, np.float32)), n, k)
    per_expert = (weight.data.nbytes + weight.scale.nbytes) / experts
    points = []
    for tokens in GROUPED_TOKENS:
        ids = np.stack([rng.choice(experts, c["top_k"], replace=False) for _ in range(tokens)]).astype(np.int32)
        grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), experts)
        x = backend.upload(rng.standard_normal((tokens, k)).astype(np.float32))
        point = {"tokens": tokens, "active_experts": int(np.unique(ids).size)}
        outs = {}
        for kernel_name, gemv in (("gemv", True), ("tiles", False)):
            outs[kernel_name] = backend.to_host(cuda_moe.grouped_gemm(x, weight, grouping, True, gemv=gemv))
            point[f"{kernel_name}_ms"] = 1e3 * gpu_seconds(
                partial(cuda_moe.grouped_gemm, x, weight, grouping, True, gemv=gemv), repeats=20)
        point["relative_difference"] = float(np.linalg.norm(outs["gemv"] - outs["tiles"]) / np.linalg.norm(outs["tiles"]))
        point["chosen"] = "gemv" if cuda_moe.choose_gemv(tokens * c["top_k"] / experts, True, "int4") else "tiles"
        point["active_weight_bytes"] = point["active_experts"] * per_expert
        points.append(point)
        print(json.dumps(point), flush=True)
    return points


GEMV_DENSE_ROWS = [1, 4, 8, 16, 32]
# label -> (format, gather (gate_up) or not (down), experts, top-k, N, K): Moonlight's bf16 experts (64
# of 1408, top-6) and Kimi-K2's INT4 ones
GEMV_GROUPED = {
    "bf16 experts gate_up 64x2816x2048": ("bf16", True, 64, 6, 2816, 2048),
    "bf16 experts down 64x2048x1408": ("bf16", False, 64, 6, 2048, 1408),
    "int4 experts gate_up 384x4096x7168": ("int4", True, KIMI_LAYER["experts"], KIMI_LAYER["top_k"],
                                           2 * KIMI_LAYER["inter"], KIMI_LAYER["hidden"]),
    "int4 experts down 384x7168x2048": ("int4", False, KIMI_LAYER["experts"], KIMI_LAYER["top_k"],
                                        KIMI_LAYER["hidden"], KIMI_LAYER["inter"]),
}
GEMV_GROUPED_TOKENS = [1, 16, 64, 256, 512]  # Kimi-K2 256: 5.3 slots per expert
# What each shape takes when no decode GEMV does (the thresholds choose between them and the GEMVs):
# dense: the whole weight dequantised to a bf16 scratch + cuBLAS; grouped: the per-tile dequantising GEMM.
GEMV_BASELINES = {"dense": "dequantize", "grouped": "tiles"}
# Past this many slots per expert only the tensor-core GEMV runs against the baseline (the CUDA-core
# ones spend an FMA per weight and row: 2.9x behind it at 1.3 slots per expert, 5.2x at 5.3 on an
# H100, W1 of 2026-11-23).
CUDA_CORE_GEMV_MAX_SLOTS_PER_EXPERT = 1.5
TENSOR_CORE_GEMVS = ["mma"]
GEMV_CALLS = 16  # calls per timed graph, each on its own weight copy or routing


def graph_call_seconds(calls: list) -> tuple[float, str | None]:
    """Seconds per call of ``calls`` (closures) replayed as one CUDA graph (median of 5 replays);
    eager back-to-back launches when capture fails (the error is returned)."""
    import cupy

    from openinfer.tools.ledger import gpu_seconds

    def run_all():
        for call in calls:
            call()

    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    try:
        with cupy.cuda.using_allocator(pool.malloc), stream:
            run_all()
            stream.synchronize()
            mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
            stream.begin_capture() if mode is None else stream.begin_capture(mode)
            try:
                run_all()
            finally:
                graph = stream.end_capture()
            return gpu_seconds(graph.launch, repeats=5, warmup=1) / len(calls), None
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        return gpu_seconds(run_all, repeats=5, warmup=1) / len(calls), f"{type(exc).__name__}: {exc}"


def noting_failure(failures: dict[str, str], label: str, call) -> None:
    """``call()``; an exception is noted under ``label`` (its first one) instead of raised: one variant that cannot
    run (a bad switch combination, a kernel that fails to load) leaves the others to be measured."""
    if label in failures:
        return
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported in the results JSON
        failures[label] = f"{type(exc).__name__}: {exc}"


def warm_kernels(calls: list) -> None:
    """Compile every CUDA module ``calls`` would launch, in parallel NVRTC threads: a dry pass
    records them (core's discover_kernels; nothing runs), compile_kernels builds them. A fresh
    machine otherwise compiles moe.cu once per format and kernel variant, one after the other."""
    import cupy

    from openinfer.backend.cuda.loader import compile_kernels, discover_kernels

    started = time.perf_counter()
    with discover_kernels() as found:
        for call in calls:
            call()
    built = compile_kernels(found, cupy.cuda.Device().id, threads=16)
    print(f"compiled {built} CUDA modules in {time.perf_counter() - started:.1f} s", flush=True)


def warm_moe_modules(groups: tuple[int, ...] = (16, 32, 128), threads: int = 16,
                     formats: tuple[str, ...] = ("bf16", "int4", "fp8")) -> int:
    """Compile moe.cu's decode GEMVs and tiled GEMM for every weight format (INT4 at each group in
    ``groups``) and every ``GEMV_KERNELS`` shape in parallel NVRTC threads, into CuPy's disk cache:
    later processes on the machine (the GPU tests, the benchmarks) then load instead of compiling
    them one after the other."""
    import cupy

    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda.loader import compile_kernels, discover_kernels, kernel

    started = time.perf_counter()
    weights = [cuda_moe.ExpertLinear(fmt, None, None, 0, 0, group)
               for fmt in formats for group in (groups if fmt == "int4" else (32,))]
    if "int4" in formats and 32 in groups:  # tile_int4's layout
        weights.append(cuda_moe.ExpertLinear("int4", None, None, 0, 0, 32, layout="tiled"))
    with discover_kernels() as found:
        kernel("moe.cu", "moe_sort")  # routing: the format-free module
        for weight in weights:
            weight._kernel()
            weight._kernel("moe_dequantize")
            for name, defines in cuda_moe.GEMV_KERNELS.items():
                tiled = weight.layout == "tiled"
                if name in cuda_moe.TILED_GEMVS and not tiled:
                    continue  # checkpoint-layout weights run "mma" instead
                if "STAGED_CHUNKS" in defines and tiled:
                    defines = {"MMA_GEMV_NTILES": defines["MMA_GEMV_NTILES"]}  # what the tiled layout runs instead
                kernel_name = name if name == "moe_gemv" else "moe_gemv_int4_tiled" if name in cuda_moe.TILED_GEMVS \
                    else "moe_gemv_mma" if name in cuda_moe.TENSOR_CORE_GEMVS else "moe_gemv_wide"
                weight._kernel(kernel_name, **defines)
    built = compile_kernels(found, cupy.cuda.Device().id, threads=threads)
    print(f"compiled {built} moe.cu modules in {time.perf_counter() - started:.1f} s", flush=True)
    return built


def random_int4(backend, experts: int, n: int, k: int):
    import cupy

    from openinfer.backend.cuda.moe import ExpertLinear

    words = cupy.random.randint(-2**31, 2**31 - 1, size=(experts, n, k // 8), dtype=cupy.int64).astype(cupy.int32)
    return ExpertLinear("int4", words, backend.weight(np.full((experts, n, k // 32), 0.01, np.float32)), n, k)


def run_gemv(args) -> dict:
    """Decode GEMV kernels (moe_gemv vs the opt-in GEMV_KERNELS) at Kimi-K2 shapes, see the docstring."""
    import cupy

    from openinfer.backend.cuda import CudaBackend, moe_routing
    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda.moe import ExpertLinear

    backend = CudaBackend()
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth()
    kernels = args.kernels.split(",") if args.kernels else list(cuda_moe.GEMV_KERNELS)
    unknown = set(kernels) - set(cuda_moe.GEMV_KERNELS)
    if unknown:
        raise SystemExit(f"--kernels: unknown {sorted(unknown)}; choose from {', '.join(cuda_moe.GEMV_KERNELS)}")
    tensor_core = [name for name in kernels
                   if name in cuda_moe.TENSOR_CORE_GEMVS + cuda_moe.TILED_GEMVS + cuda_moe.GROUPS_GEMVS] \
        or TENSOR_CORE_GEMVS
    report = {"benchmark": "kimi_gemv", "device": device_name(), "copy_bandwidth_gbs": bandwidth / 1e9,
              "kernels": {name: cuda_moe.GEMV_KERNELS[name] for name in kernels},
              "choice": {"dense": cuda_moe.DENSE_GEMV_CHOICE, "grouped": cuda_moe.GROUPED_GEMV_CHOICE},
              "baselines": GEMV_BASELINES,
              "dense": [], "grouped": []}

    def measure(point: dict, make_calls, bytes_per_call: float, compare, baseline: str,
                names: list[str] = kernels) -> None:
        """Time ``names`` and ``baseline``; speedups and differences against the first of ``names``."""
        outputs = {}
        for name in [*names, baseline]:
            calls = make_calls(name)
            outputs[name] = backend.to_host(calls[0]())
            seconds, error = graph_call_seconds(calls)
            point[f"{name}_us"] = 1e6 * seconds
            point[f"{name}_fraction_of_copy_bandwidth"] = bytes_per_call / seconds / bandwidth
            if error:
                point[f"{name}_graph_error"] = error
        point["fastest"] = min([*names, baseline], key=lambda name: point[f"{name}_us"])
        point["chosen"] = (cuda_moe.choose_gemv(point["rows"], False, point["format"]) if "rows" in point else
                           cuda_moe.choose_gemv(point["slots_per_expert"], True, point["format"])) or baseline
        for name in [*names[1:], baseline]:
            point[f"{name}_speedup"] = point[f"{names[0]}_us"] / point[f"{name}_us"]
            point[f"{name}_relative_difference"] = compare(outputs[name], outputs[names[0]])
        print(json.dumps(point), flush=True)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    # every module the sweep launches (kernel choice by format), on small weights of the same formats
    small_fp8 = ExpertLinear("fp8", cupy.zeros((1, 128, 256), cupy.uint8), cupy.ones((1, 1, 2), cupy.float32), 128, 256)
    small_int4 = random_int4(backend, 4, 128, 256)
    small_bf16 = ExpertLinear("bf16", device_random_bf16((4, 128, 256)), None, 128, 256)
    small_x = backend.upload(np.ones((8, 256), np.float32))
    small_grouping = moe_routing.group_by_expert(cupy.asarray(np.arange(8, dtype=np.int32).reshape(4, 2) % 4),
                                              cupy.ones((4, 2), cupy.float32), 4)
    warm_kernels([partial(cuda_moe.quantized_linear, small_x, weight, backend.blas, "gemv", gemv_kernel=name)
                  for weight in (small_fp8, small_int4.expert(0)) for name in kernels]
                 + [partial(cuda_moe.quantized_linear, small_x, weight, backend.blas, GEMV_BASELINES["dense"])
                    for weight in (small_fp8, small_int4.expert(0))]
                 + [partial(cuda_moe.grouped_gemm, small_x, weight, small_grouping, True, True, gemv_kernel=name)
                    for weight in (small_int4, small_bf16, cuda_moe.tiled_int4(small_int4)) for name in kernels]
                 + [partial(cuda_moe.grouped_gemm, small_x, weight, small_grouping, True, False)
                    for weight in (small_int4, small_bf16)])

    sections = args.sections.split(",")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    for label, (fmt, n, k) in LINEAR_SHAPES.items():
        if "dense" not in sections:
            break
        stored = n * k * (1 if fmt == "fp8" else 0.5)
        copies = max(2, int(-(-3 * 50e6 // stored)))  # together well past the 50 MB L2
        weights = []
        for _ in range(copies):
            if fmt == "fp8":
                codes = cupy.random.randint(0, 256, size=(1, n, k), dtype=cupy.int32).astype(cupy.uint8)
                codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
                weights.append(ExpertLinear("fp8", codes, cupy.full((1, -(-n // 128), -(-k // 128)), 1e-2,
                                                                    cupy.float32), n, k))
            else:
                weights.append(random_int4(backend, 1, n, k))
        stored = weights[0].data.nbytes + weights[0].scale.nbytes
        for rows in GEMV_DENSE_ROWS:
            x = backend.upload(rng.standard_normal((rows, k)).astype(np.float32))
            point = {"weight": label, "format": fmt, "rows": rows, "copies": copies, "bytes": stored}
            measure(point, lambda name, x=x, weights=weights: [
                partial(cuda_moe.quantized_linear, x, weights[i % len(weights)], backend.blas, "gemv",
                        gemv_kernel=name) if name in kernels else
                partial(cuda_moe.quantized_linear, x, weights[i % len(weights)], backend.blas, name)
                for i in range(GEMV_CALLS)], stored, rel, GEMV_BASELINES["dense"])
            report["dense"].append(point)
    layouts = args.int4_layouts.split(",")
    if set(layouts) - set(cuda_moe.INT4_LAYOUTS):
        raise SystemExit(f"--int4-layouts: choose from {', '.join(cuda_moe.INT4_LAYOUTS)}")
    grouped_points = [(label, layout) for label, (fmt, *_) in GEMV_GROUPED.items()
                      for layout in (layouts if fmt == "int4" else ["rows"])]
    for label, layout in grouped_points:
        fmt, gather, experts, top_k, n, k = GEMV_GROUPED[label]
        if "grouped" not in sections or fmt not in args.grouped_formats.split(","):
            continue
        weight = random_int4(backend, experts, n, k) if fmt == "int4" else \
            ExpertLinear("bf16", device_random_bf16((experts, n, k)), None, n, k)
        if layout != "rows":  # the same random words, repacked for the decode GEMV
            weight = cuda_moe.tiled_int4(weight, layout)
        per_expert = (weight.data.nbytes + (0 if weight.scale is None else weight.scale.nbytes)) / experts
        for tokens in tokens_list:
            groupings, active = [], []
            for _ in range(GEMV_CALLS):
                ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
                groupings.append(moe_routing.group_by_expert(cupy.asarray(ids.astype(np.int32)),
                                                          cupy.ones(ids.shape, cupy.float32), experts))
                active.append(np.unique(ids).size)
            rows = tokens if gather else tokens * top_k
            x = backend.upload(rng.standard_normal((rows, k)).astype(np.float32))
            point = {"weight": label, "format": fmt, "layout": weight.layout, "tokens": tokens,
                     "slots_per_expert": tokens * top_k / experts,
                     "active_experts_mean": float(np.mean(active)), "bytes_mean": float(np.mean(active)) * per_expert}
            names = kernels if point["slots_per_expert"] <= CUDA_CORE_GEMV_MAX_SLOTS_PER_EXPERT else tensor_core
            # each layout's own kernels (the tiled ones run moe_gemv_mma on checkpoint rows)
            names = [name for name in names if all((name in own) == (layout == owner)
                                                   for owner, own in cuda_moe.LAYOUT_GEMVS.items())] or names
            measure(point, lambda name, x=x, weight=weight, groupings=groupings, gather=gather: [
                partial(cuda_moe.grouped_gemm, x, weight, g, gather, True, gemv_kernel=name) if name in kernels else
                partial(cuda_moe.grouped_gemm, x, weight, g, gather, False) for g in groupings],
                point["bytes_mean"], rel, GEMV_BASELINES["grouped"], names)
            report["grouped"].append(point)
    return report


# Moonlight's routed experts (bf16, 64 x top-6, hidden 2048, moe_intermediate 1408) by grouped kernel:
# decode batches (1.5-24 slots per expert, inside CUDA graphs) and an 8k-token prefill (768, eager: the
# cuBLAS-per-expert path reads the counts on the host)
EXPERTS_SHAPE = {"experts": 64, "top_k": 6, "hidden": 2048, "inter": 1408}
EXPERTS_TOKENS = [1, 4, 16, 32, 64, 128, 256, 1024, 8192]
EXPERTS_GRAPH_MAX_TOKENS = 1024  # above: timed eagerly (cuBLAS per expert cannot be captured)
# variant -> (what gate_up runs, what down runs); "+silu" adds core's silu_mul after gate_up
EXPERT_VARIANTS = {
    "chosen": "what ships (moe_forward's choices with OPENINFER_MOE_PIPELINED unset)",
    "no_sm90": "what ships with OPENINFER_MOE_SM90=0 (before E1 of 2026-11-24: pipelined / cuBLAS per expert)",
    "off": "OPENINFER_MOE_PIPELINED=off, what shipped before E1 (decode GEMV / per-tile GEMM / cuBLAS per expert)",
    "tiles": "moe_grouped_gemm (the per-tile GEMM)",
    "pipelined": "moe_grouped_gemm_pipelined (tiles mode), gate_up then silu_mul",
    "fused": "moe_grouped_gemm_pipelined, gate_up with SiLU·mul fused (fused mode)",
    "pipelined_s3": "moe_grouped_gemm_pipelined with 3 stages, gate_up with SiLU·mul fused",
    "fused_n256": "moe_grouped_gemm_pipelined in 256 x 32 blocks (PIPE_SHAPES n256), gate_up fused",
    "fused_n64": "moe_grouped_gemm_pipelined in 64 x 64 blocks (PIPE_SHAPES n64), gate_up fused",
    "blas": "cuBLAS per active expert at any slots per expert (eager points only)",
    "sm90": "moe_grouped_gemm_sm90 (wgmma + TMA, persistent), gate_up with SiLU·mul fused, 4 stages",
    "sm90_s3": "moe_grouped_gemm_sm90 with 3 stages, gate_up with SiLU·mul fused",
    "sm90_pair": "moe_grouped_gemm_sm90 in CTA pairs sharing each weight tile (TMA multicast), gate_up fused",
}
# --kernel-times: gate_up (SiLU·mul fused where the kernel fuses it) and down timed apart, eagerly
# (cuBLAS per expert cannot be captured), by kernel -> what it is
EXPERT_KERNELS = {
    "blas": "cuBLAS per active expert (gate_up without SiLU·mul)",
    "pipelined": "moe_grouped_gemm_pipelined, 256 x 32 blocks (n256), gate_up fused",
    "sm90": "moe_grouped_gemm_sm90, gate_up fused",
    "sm90_pair": "moe_grouped_gemm_sm90 in CTA pairs (TMA multicast of the weight tiles), gate_up fused",
}


def run_experts(args) -> dict:
    """Moonlight's routed experts, gate_up (+ SiLU·mul) and down, by grouped kernel; see EXPERT_VARIANTS."""
    import cupy

    from openinfer.backend.cuda import CudaBackend, moe_routing, moe_sm90
    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda.moe import ExpertLinear
    from openinfer.moe import RouterSpec
    from openinfer.tools.ledger import gpu_seconds

    backend = CudaBackend()
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth()
    c = EXPERTS_SHAPE
    variants = args.variants.split(",") if args.variants else list(EXPERT_VARIANTS)
    unknown = set(variants) - set(EXPERT_VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(EXPERT_VARIANTS)}")
    copies = 2  # 2 x 1.1 GB of weights: far past the 50 MB L2
    gate_ups = [ExpertLinear("bf16", device_random_bf16((c["experts"], 2 * c["inter"], c["hidden"])), None,
                             2 * c["inter"], c["hidden"]) for _ in range(copies)]
    downs = [ExpertLinear("bf16", device_random_bf16((c["experts"], c["hidden"], c["inter"])), None,
                          c["hidden"], c["inter"]) for _ in range(copies)]
    per_expert = 2 * (3 * c["inter"] * c["hidden"])
    router = RouterSpec(c["experts"], c["top_k"], "sigmoid", norm_topk_prob=True, routed_scaling_factor=2.446)
    router_gate = device_random_bf16((c["experts"], c["hidden"]))
    router_bias = cupy.zeros(c["experts"], cupy.float32)
    report = {"benchmark": "kimi_experts", "device": device_name(), "copy_bandwidth_gbs": bandwidth / 1e9,
              "shape": c, "variants": {name: EXPERT_VARIANTS[name] for name in variants}, "points": []}

    def experts_call(x, grouping, gate_up, down, variant: str):
        def call():
            if variant == "chosen":
                return cuda_moe.routed_experts(backend, x, gate_up, down, grouping)
            if variant == "no_sm90":
                with switched_env({moe_sm90.SM90_ENV: "0"}):
                    return cuda_moe.routed_experts(backend, x, gate_up, down, grouping)
            if variant in ("sm90", "sm90_s3", "sm90_pair"):
                stages = 3 if variant == "sm90_s3" else moe_sm90.SM90_STAGES
                pair = variant == "sm90_pair"
                activated = moe_sm90.grouped_gemm_sm90(x, gate_up, grouping, True, fuse_silu=True, stages=stages,
                                                       multicast=pair)
                return moe_sm90.grouped_gemm_sm90(activated, down, grouping, False, stages=stages, multicast=pair)
            if variant == "blas":  # cuBLAS per expert whatever the slots per expert (eager points only)
                bound, cuda_moe.BLAS_MIN_ROWS_PER_EXPERT = cuda_moe.BLAS_MIN_ROWS_PER_EXPERT, 1
                try:
                    return cuda_moe.grouped_gemm(backend.silu_mul(cuda_moe.grouped_gemm(
                        x, gate_up, grouping, True, blas=backend.blas, pipelined="off")), down, grouping, False,
                        blas=backend.blas, pipelined="off")
                finally:
                    cuda_moe.BLAS_MIN_ROWS_PER_EXPERT = bound
            shape = {"fused_n256": "n256", "fused_n64": "n64"}.get(variant, "n128")
            if variant in ("fused", "pipelined_s3", "fused_n256", "fused_n64"):
                activated = cuda_moe.fused_gate_up_silu(x, gate_up, grouping, shape=shape,
                                                        stages=3 if variant == "pipelined_s3" else cuda_moe.PIPE_STAGES)
                down_mode = "tiles"
            else:
                mode = "tiles" if variant == "pipelined" else "off"
                gemv = False if variant in ("tiles", "pipelined") else None
                blas = backend.blas if variant in ("blas", "off") else None
                activated = backend.silu_mul(cuda_moe.grouped_gemm(x, gate_up, grouping, True, gemv, blas=blas,
                                                                   pipelined=mode, pipe_shape=shape))
                down_mode = mode
            return cuda_moe.grouped_gemm(activated, down, grouping, False,
                                         None if variant in ("blas", "off") else False,
                                         blas=backend.blas if variant in ("blas", "off") else None,
                                         pipelined=down_mode, pipe_shape=shape)
        return call

    for tokens in [int(t) for t in args.tokens.split(",")]:
        groupings, active = [], []
        for _ in range(GEMV_CALLS if tokens <= EXPERTS_GRAPH_MAX_TOKENS else 2):
            ids = np.stack([rng.choice(c["experts"], c["top_k"], replace=False) for _ in range(tokens)])
            groupings.append(moe_routing.group_by_expert(cupy.asarray(ids.astype(np.int32)),
                                                      cupy.ones(ids.shape, cupy.float32), c["experts"]))
            active.append(np.unique(ids).size)
        x = backend.upload(rng.standard_normal((tokens, c["hidden"])).astype(np.float32) * 0.5)
        point = {"tokens": tokens, "slots_per_expert": tokens * c["top_k"] / c["experts"],
                 "bytes_mean": float(np.mean(active)) * per_expert,
                 "graph": tokens <= EXPERTS_GRAPH_MAX_TOKENS}
        outputs = {}
        for variant in variants:
            if variant == "blas" and point["graph"]:
                continue
            calls = [experts_call(x, g, gate_ups[i % copies], downs[i % copies], variant)
                     for i, g in enumerate(groupings)]
            outputs[variant] = backend.to_host(calls[0]())
            if point["graph"]:
                seconds, error = graph_call_seconds(calls)
                if error:
                    point[f"{variant}_graph_error"] = error
            else:
                seconds = gpu_seconds(lambda calls=calls: [call() for call in calls], repeats=3, warmup=1) / len(calls)
            point[f"{variant}_us"] = 1e6 * seconds
            point[f"{variant}_fraction_of_copy_bandwidth"] = point["bytes_mean"] / seconds / bandwidth
            point[f"{variant}_tflops"] = 2 * tokens * c["top_k"] * 3 * c["inter"] * c["hidden"] / seconds / 1e12
        if args.kernel_times:
            point.update(expert_kernel_times(backend, x, groupings, gate_ups, downs, tokens))
        reference = outputs.get("tiles", next(iter(outputs.values())))
        for variant, out in outputs.items():
            point[f"{variant}_speedup_vs_chosen"] = point.get("chosen_us", np.nan) / point[f"{variant}_us"]
            point[f"{variant}_speedup_vs_off"] = point.get("off_us", np.nan) / point[f"{variant}_us"]
            point[f"{variant}_relative_difference"] = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
            point[f"{variant}_bit_equal_tiles"] = bool(np.array_equal(out, reference))
        point["fastest"] = min(outputs, key=lambda name: point[f"{name}_us"])
        # the rest of the routed path: router + top-k (moe_route), grouping (moe_sort_parallel), combine
        y_rows = device_random_bf16((tokens * c["top_k"], c["hidden"]))
        ids, weights = moe_routing.route(x, router_gate, router, router_bias)
        grouping = moe_routing.group_by_expert(ids, weights, c["experts"])
        logits = moe_routing.router_logits(x, router_gate, router)
        parts = {"route": partial(moe_routing.route, x, router_gate, router, router_bias),
                 "group": partial(moe_routing.group_by_expert, ids, weights, c["experts"]),
                 "combine": partial(cuda_moe.combine, y_rows, grouping, None, c["hidden"])}
        # the route's two kernels apart (router logits, then scores + top-k) and the opt-in prefill kernels
        # (moe_routing.cu): not summed again
        halves = {"route_logits": partial(moe_routing.router_logits, x, router_gate, router, mma=False),
                  "route_logits_mma": partial(moe_routing.router_logits, x, router_gate, router, mma=True),
                  "route_select": partial(moe_routing.select_experts, x, router_gate, router, router_bias, logits,
                                          narrow=False),
                  "route_select_narrow": partial(moe_routing.select_experts, x, router_gate, router, router_bias, logits,
                                                 narrow=True),
                  "group_single_block": partial(moe_routing.group_by_expert, ids, weights, c["experts"],
                                                per_expert_blocks=False),
                  "group_blocks": partial(moe_routing.group_by_expert, ids, weights, c["experts"], per_expert_blocks=True)}
        for part, call in {**parts, **halves}.items():
            if point["graph"]:
                point[f"routing_{part}_us"] = 1e6 * graph_call_seconds([call] * 4)[0]
            else:
                point[f"routing_{part}_us"] = 1e6 * gpu_seconds(call, repeats=3, warmup=1)
        point["routing_us"] = sum(point[f"routing_{part}_us"] for part in parts)
        print(json.dumps(point), flush=True)
        report["points"].append(point)
    return report


def expert_kernel_times(backend, x, groupings: list, gate_ups: list, downs: list, tokens: int) -> dict:
    """gate_up and down of Moonlight's experts timed apart by EXPERT_KERNELS (eager, on rotating
    weight copies and routings): us, TFLOP/s and the largest difference from cuBLAS's output, relative to
    its largest value (fused outputs against silu_mul of cuBLAS's gate_up)."""
    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda import moe_sm90
    from openinfer.tools.ledger import gpu_seconds

    c = EXPERTS_SHAPE
    slots = tokens * c["top_k"]
    flops = {"gate_up": 2 * slots * 2 * c["inter"] * c["hidden"], "down": 2 * slots * c["hidden"] * c["inter"]}
    copies = len(gate_ups)
    activated = backend.silu_mul(cuda_moe.grouped_gemm(x, gate_ups[0], groupings[0], True, False, pipelined="off"))

    def blas(a, weight, grouping, gather):
        bound, cuda_moe.BLAS_MIN_ROWS_PER_EXPERT = cuda_moe.BLAS_MIN_ROWS_PER_EXPERT, 1
        try:
            return cuda_moe.grouped_gemm(a, weight, grouping, gather, blas=backend.blas, pipelined="off")
        finally:
            cuda_moe.BLAS_MIN_ROWS_PER_EXPERT = bound

    kernels = {
        "blas": (lambda w, g: blas(x, w, g, True), lambda w, g: blas(activated, w, g, False)),
        "pipelined": (lambda w, g: cuda_moe.fused_gate_up_silu(x, w, g, shape="n256"),
                      lambda w, g: cuda_moe.grouped_gemm(activated, w, g, False, False, pipelined="tiles",
                                                         pipe_shape="n256")),
        "sm90": (lambda w, g: moe_sm90.grouped_gemm_sm90(x, w, g, True, fuse_silu=True, multicast=False),
                 lambda w, g: moe_sm90.grouped_gemm_sm90(activated, w, g, False, multicast=False)),
        "sm90_pair": (lambda w, g: moe_sm90.grouped_gemm_sm90(x, w, g, True, fuse_silu=True, multicast=True),
                      lambda w, g: moe_sm90.grouped_gemm_sm90(activated, w, g, False, multicast=True)),
    }
    point, reference = {}, {}
    for name, (gate_up_call, down_call) in kernels.items():
        for projection, run, weights in (("gate_up", gate_up_call, gate_ups), ("down", down_call, downs)):
            calls = [partial(run, weights[i % copies], g) for i, g in enumerate(groupings)]
            first = calls[0]()
            if name == "blas" and projection == "gate_up":  # compared as the fused kernels' output
                first = backend.silu_mul(first)
            out = backend.to_host(first)
            if name == "blas":
                reference[projection] = out
            seconds = gpu_seconds(lambda calls=calls: [call() for call in calls], repeats=3, warmup=1) / len(calls)
            key = f"kernel_{name}_{projection}"
            point[f"{key}_us"] = 1e6 * seconds
            point[f"{key}_tflops"] = flops[projection] / seconds / 1e12
            point[f"{key}_max_difference"] = float(np.abs(out - reference[projection]).max()
                                                   / np.abs(reference[projection]).max())
    for projection in ("gate_up", "down"):
        point[f"kernel_sm90_pair_{projection}_speedup_vs_sm90"] = (point[f"kernel_sm90_{projection}_us"]
                                                                   / point[f"kernel_sm90_pair_{projection}_us"])
        point[f"kernel_sm90_{projection}_speedup_vs_blas"] = (point[f"kernel_blas_{projection}_us"]
                                                              / point[f"kernel_sm90_{projection}_us"])
        point[f"kernel_sm90_{projection}_speedup_vs_pipelined"] = (point[f"kernel_pipelined_{projection}_us"]
                                                                   / point[f"kernel_sm90_{projection}_us"])
    return point


def plot_experts(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(report["variants"]))
    for i, name in enumerate(report["variants"]):
        ax.bar(np.arange(len(points)) + i * width, [p.get(f"{name}_us", np.nan) for p in points], width, label=name)
    ax.set_xticks(np.arange(len(points)) + 0.4 - width / 2,
                  [f"{p['tokens']} tok\n{p['slots_per_expert']:.1f}/expert" for p in points], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("gate_up + SiLU·mul + down, us per layer")
    ax.set_title(f"Moonlight routed experts (bf16, 64 x top-6) by kernel ({report['device']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_gemv(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["dense"] + report["grouped"]
    labels = [f"{p['weight'].split()[0]} {p['weight'].split()[-2]} " + (f"{p['rows']}r" if "rows" in p else f"{p['tokens']}t")
              + (" tiled" if p.get("layout") == "tiled" else "") for p in points]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    series = [*report["kernels"], "baseline"]
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        key = (lambda p: GEMV_BASELINES["dense" if "rows" in p else "grouped"]) if name == "baseline" else \
            (lambda p, name=name: name)
        ax.bar(np.arange(len(points)) + i * width, [p.get(f"{key(p)}_fraction_of_copy_bandwidth", np.nan)
                                                    for p in points], width,
               label="no GEMV (dense: dequantize + cuBLAS; grouped: tiles)" if name == "baseline" else name)
    ax.set_xticks(np.arange(len(points)) + 0.4 - width / 2, labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("bytes read / time / copy bandwidth")
    ax.set_title(f"Decode GEMV kernels, Kimi-K2 shapes ({report['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_kernels(args) -> dict:
    from openinfer.backend.cuda import CudaBackend

    backend = CudaBackend()
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth()
    report = {"benchmark": "kimi_kernels", "device": device_name(), "copy_bandwidth_gbs": bandwidth / 1e9}
    sections = {"mla_prefill": lambda: bench_mla_prefill(backend, rng),
                "mla_decode": lambda: bench_mla_decode(backend, rng, bandwidth,
                                                       tuple(int(h) for h in args.mla_heads.split(","))),
                "quantized_linear": lambda: bench_quantized_linears(backend, rng, bandwidth),
                "grouped_experts": lambda: bench_grouped_experts(backend, rng)}
    wanted = args.sections.split(",") if args.sections else list(sections)
    unknown = sorted(set(wanted) - set(sections))
    if unknown:
        raise SystemExit(f"unknown --sections {unknown}; choose from {list(sections)}")
    for name in wanted:
        report[name] = sections[name]()
    for point in report.get("grouped_experts", []):
        point["gemv_fraction_of_roofline"] = point["active_weight_bytes"] / bandwidth / (point["gemv_ms"] / 1e3)
    return report


def plot_kernels(report: dict, path: Path) -> None:
    """One panel per section the report holds: a left-out section (--sections) gets no panel (an
    empty series on a log axis makes matplotlib's tick locator raise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if report.get("mla_prefill"):
        panels.append(partial(_plot_mla_prefill, report["mla_prefill"]))
    for name in LINEAR_SHAPES:
        points = [p for p in report.get("quantized_linear", []) if p["weight"] == name]
        if points:
            panels.append(partial(_plot_quantized_linear, name, points))
    if report.get("grouped_experts"):
        panels.append(partial(_plot_grouped_experts, report["grouped_experts"]))
    if report.get("mla_decode"):
        panels.append(partial(_plot_mla_decode, report["mla_decode"]))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, draw in zip(axes[0], panels, strict=True):
        draw(ax)
    fig.suptitle(f"Kimi-K2 kernel choices — {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_mla_prefill(points: list[dict], ax) -> None:
    x = np.arange(len(points))
    ax.bar(x - 0.2, [p["absorbed_ms"] for p in points], 0.4, label="absorbed")
    ax.bar(x + 0.2, [p["decompressed_ms"] for p in points], 0.4, label="decompressed")
    ax.set(xticks=x, yscale="log", ylabel="ms", title="MLA prefill attention (cached+new)")
    ax.set_xticklabels([f"H{p['heads']} {p['cached']}+{p['new']}" for p in points], rotation=60, fontsize=7)
    ax.legend()


def _plot_quantized_linear(name: str, points: list[dict], ax) -> None:
    for method in ("gemv", "tiles", "dequantize", "cublas_bf16"):
        measured = [p for p in points if f"{method}_ms" in p]
        if measured:
            ax.plot([p["rows"] for p in measured], [p[f"{method}_ms"] for p in measured], "o-", label=method)
    ax.plot([p["rows"] for p in points], [p["stored_weight_roofline_ms"] for p in points], "k--",
            label="weight bytes / copy bw")
    ax.set(xscale="log", yscale="log", xlabel="rows (tokens)", ylabel="ms", title=name)
    ax.legend(fontsize=7)


def _plot_grouped_experts(points: list[dict], ax) -> None:
    x = np.arange(len(points))
    ax.bar(x - 0.2, [p["gemv_ms"] for p in points], 0.4, label="moe_gemv")
    ax.bar(x + 0.2, [p["tiles_ms"] for p in points], 0.4, label="grouped GEMM (tiles)")
    ax.set(xticks=x, xticklabels=[f"T={p['tokens']}" for p in points], ylabel="ms",
           title="384 INT4 experts gate_up, top-8")
    ax.legend()


def _plot_mla_decode(points: list[dict], ax) -> None:
    x = np.arange(len(points))
    forms = [(key, label) for key, label in MLA_DECODE_FORMS if any(p.get(f"{key}_ms") for p in points)]
    width = 0.8 / len(forms)
    for i, (key, label) in enumerate(forms):
        # a form that does not apply at a point (decompressed past its scratch cap) has no bar there
        ax.bar(x + (i - (len(forms) - 1) / 2) * width, [p.get(f"{key}_ms") or np.nan for p in points], width,
               label=label)
    ax.plot(x, [p["cache_roofline_ms"] for p in points], "k_", markersize=14, label="latent cache bytes / copy bw")
    ax.set(xticks=x, yscale="log", ylabel="ms (whole mla_forward)", title="MLA decode (heads, batch x context)")
    ax.set_xticklabels([f"H{p['heads']} {p['batch']}x{p['context']}" for p in points], rotation=60, fontsize=7)
    ax.legend(fontsize=7)


# --- one Kimi-K2 layer ---------------------------------------------------------------------------

def build_layer(backend, rng):
    """Random device weights of one Kimi-K2 MoE layer, INT4 routed experts."""
    import cupy

    from openinfer.backend.cuda.moe import DeviceMoE, ExpertLinear
    from openinfer.moe import RouterSpec

    c = KIMI_LAYER
    h, heads = c["hidden"], c["heads"]

    def bf16(*shape, scale=0.02):
        return backend.weight((scale * rng.standard_normal(shape)).astype(np.float32))

    def int4(experts, n, k):
        words = cupy.random.randint(-2**31, 2**31 - 1, size=(experts, n, k // 8), dtype=cupy.int64).astype(cupy.int32)
        scales = backend.weight(np.full((experts, n, k // c["group"]), 0.01, np.float32))
        return ExpertLinear("int4", words, scales, n, k, group=c["group"])

    latent = c["kv_lora"] + c["rope"]
    attention = {
        "qkv_a": backend.linear_weight(0.02 * rng.standard_normal((c["q_lora"] + latent, h)).astype(np.float32)),
        "q_a_norm": bf16(c["q_lora"], scale=1.0), "kv_a_norm": bf16(c["kv_lora"], scale=1.0),
        "q_b": backend.linear_weight(0.02 * rng.standard_normal((heads * (c["nope"] + c["rope"]), c["q_lora"]))
                                     .astype(np.float32)),
        "w_uk": bf16(heads, c["nope"], c["kv_lora"]), "w_uv": bf16(heads, c["v"], c["kv_lora"]),
        "o_proj": backend.linear_weight(0.02 * rng.standard_normal((h, heads * c["v"])).astype(np.float32)),
    }
    router = RouterSpec(c["experts"], c["top_k"], "sigmoid", routed_scaling_factor=2.827)
    moe = DeviceMoE(router, bf16(c["experts"], h), cupy.zeros(c["experts"], cupy.float32),
                    int4(c["experts"], 2 * c["inter"], h), int4(c["experts"], h, c["inter"]))
    shared = (backend.linear_weight(0.02 * rng.standard_normal((2 * c["inter"], h)).astype(np.float32)),
              backend.linear_weight(0.02 * rng.standard_normal((h, c["inter"])).astype(np.float32)))
    return attention, moe, shared


def layer_bytes(attention, moe, shared, active_experts: int, batch: int, context: int) -> int:
    """HBM bytes one decode step of the layer must read at least."""
    c = KIMI_LAYER
    weights = sum(w.weight.nbytes for w in (attention["qkv_a"], attention["q_b"], attention["o_proj"], *shared))
    weights += attention["w_uk"].nbytes + attention["w_uv"].nbytes + moe.gate.nbytes
    per_expert = (moe.gate_up.data[0].nbytes + moe.gate_up.scale[0].nbytes + moe.down.data[0].nbytes
                  + moe.down.scale[0].nbytes)
    kv = batch * context * (c["kv_lora"] + c["rope"]) * 2
    return weights + active_experts * per_expert + kv


def layer_parts(backend, attention, moe, shared, spec, cache, batch, cos, sin, x, absorbed_kernel: str) -> list:
    """The layer step's ops in step order (``layer_step``'s calls), each a (name, closure) on inputs
    computed here once, so each op can be replayed alone."""
    import cupy

    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda import moe_routing

    c = KIMI_LAYER
    mla = partial(cuda_mla.mla_forward, backend.blas)
    mla_rest = (attention["w_uk"], attention["w_uv"], attention["kv_a_norm"], spec, batch, cos, sin, 1e-6,
                backend.num_sms)
    qkv_a = backend.linear(x, attention["qkv_a"])
    q_a = qkv_a[:, :c["q_lora"]].copy()
    latent = qkv_a[:, c["q_lora"]:]
    q = backend.add_rms_norm_linear(q_a, None, attention["q_a_norm"], 1e-6, attention["q_b"])[0]
    attn = mla(q, latent, cache, *mla_rest, absorbed_kernel=absorbed_kernel)
    q_latent = cuda_mla.absorb_queries(backend.blas, q, attention["w_uk"], spec)
    o_latent = cuda_mla.absorbed_attention(q_latent, q, cache, spec, batch, None, backend.num_sms, absorbed_kernel)
    partials = cuda_mla.attend_splits(q_latent, q, cache, spec, batch, None, backend.num_sms, absorbed_kernel)[1]
    # $OPENINFER_MLA_COMBINE_EXPAND: the combine and W_UV as one op (mla_combine_expand), as mla_forward runs them
    fused_columns = cuda_mla.combine_expand_columns(int(q.shape[0]), partials.splits if partials else 1, spec)
    h = backend.linear(attn, attention["o_proj"])
    shared_hidden = backend.linear(h, shared[0])
    shared_out = backend.silu_mul_linear(shared_hidden, shared[1])
    logits = moe_routing.router_logits(h, moe.gate, moe.router)
    ids, weights = moe_routing.select_experts(h, moe.gate, moe.router, moe.correction_bias, logits)
    grouping = moe_routing.group_by_expert(ids, weights, moe.router.num_experts)
    gate_up = cuda_moe.grouped_gemm(h, moe.gate_up, grouping, gather=True, blas=backend.blas)
    activated = backend.silu_mul(gate_up)
    y = cuda_moe.grouped_gemm(activated, moe.down, grouping, gather=False, blas=backend.blas)
    return [
        ("qkv_a", partial(backend.linear, x, attention["qkv_a"])),
        ("q_a_norm+q_b", partial(backend.add_rms_norm_linear, q_a, None, attention["q_a_norm"], 1e-6,
                                 attention["q_b"])),
        # mla_forward's absorbed steps; the latent write rotates q's rope dims in place again on each
        # call: other numbers, the same work
        ("mla_write_latent", partial(cuda_mla.write_latent, q, latent, cache, attention["kv_a_norm"], spec, batch,
                                     cos, sin, 1e-6)),
        ("mla_w_uk", partial(cuda_mla.absorb_queries, backend.blas, q, attention["w_uk"], spec)),
        ("mla_attention", partial(cuda_mla.attend_splits, q_latent, q, cache, spec, batch, None, backend.num_sms,
                                  absorbed_kernel)),
        *([("mla_combine", partial(cuda_mla.combine_splits, partials, cupy.empty_like(q_latent), spec))]
          if partials is not None and not fused_columns else []),
        *([("mla_w_uv", partial(cuda_mla.expand_values, backend.blas, o_latent, attention["w_uv"], spec,
                                cupy.empty_like(attn)))] if not fused_columns else []),
        *([("mla_combine_expand", partial(cuda_mla.combine_expand, partials, o_latent, attention["w_uv"], spec,
                                          cupy.empty_like(attn), fused_columns))] if fused_columns else []),
        ("o_proj", partial(backend.linear, attn, attention["o_proj"])),
        ("shared_gate_up", partial(backend.linear, h, shared[0])),
        ("shared_silu+down", partial(backend.silu_mul_linear, shared_hidden, shared[1])),
        # route = moe_router_logits (the [E, H] product over blocks) + moe_route (scores, top-k), then the grouping
        # (or, where moe_forward takes it, router logits + moe_route_sort: route_and_group)
        *([("route_logits+sort", partial(moe_routing.route_and_group, h, moe))]
          if moe_routing.route_sort_wanted(int(h.shape[0]), moe.router, moe.tid2eid, moe.shared_experts) else [
            ("route_logits", partial(moe_routing.router_logits, h, moe.gate, moe.router)),
            ("route_select", partial(moe_routing.select_experts, h, moe.gate, moe.router, moe.correction_bias, logits)),
            ("group", partial(moe_routing.group_by_expert, ids, weights, moe.router.num_experts))]),
        *([("experts_gate_up+silu", partial(cuda_moe.gate_up_silu_gemv, h, moe.gate_up, grouping, silu_gemv))]
          if (silu_gemv := cuda_moe.gemv_silu_kernel(h, moe.gate_up, grouping)) is not None else [
            ("experts_gate_up", partial(cuda_moe.grouped_gemm, h, moe.gate_up, grouping, True, blas=backend.blas)),
            ("experts_silu", partial(backend.silu_mul, gate_up))]),
        ("experts_down", partial(cuda_moe.grouped_gemm, activated, moe.down, grouping, False, blas=backend.blas)),
        ("combine", partial(cuda_moe.combine, y, grouping, shared_out, c["hidden"])),
    ]


def layer_breakdown(parts: list, step, iters: int) -> dict:
    """Each op's device time in ms, the ops replayed in step order behind a spin kernel that holds
    the stream with an event between consecutive ops (core's ledger timer): the host has enqueued
    the whole step before the device starts, so no host launch cost is counted, and each op finds
    its weights cold in L2 as in a real step. Also each op's host enqueue time."""
    from openinfer.tools.ledger import OpCall, Timer

    calls = [OpCall("plan", name, fn, (), {}, None) for name, fn in parts]
    timed = Timer().ops(calls, iters, step)
    return {"breakdown_ms": {name: 1e3 * t for (name, _), t in zip(parts, timed["device_s"], strict=True)},
            "breakdown_host_ms": {name: 1e3 * t for (name, _), t in zip(parts, timed["host_s"], strict=True)},
            "event_cost_ms": 1e3 * timed["event_cost_s"], "step_host_ms": 1e3 * timed["forward_host_s"]}


LAYER_OPTIONS = {  # --variants' third field ("+"-joined): what each option changes from core's defaults
    "fused": "norms / SwiGLU fused into the next GEMV for decode rows (CudaBackend(fuse_decode=True))",
    "no_fast_routing": "moe_sort and the one-block moe_combine ($OPENINFER_MOE_FAST_ROUTING=0; the parallel ones "
                       "are the default since D3, 2026-11-23)",
    "no_spread_rope": "mla_write_latent's q_pe rotation by one block per token ($OPENINFER_MLA_SPREAD_ROPE=0; "
                      "spread over blocks is the default since D3)",
    "mla_splits16": "at most 16 context splits in the absorbed MLA decode ($OPENINFER_MLA_MAX_SPLITS=16; before D3)",
    "mla_splits8": "at most 8 context splits in the absorbed MLA decode ($OPENINFER_MLA_MAX_SPLITS=8)",
    "mla_splits32": "at most 32 context splits in the absorbed MLA decode ($OPENINFER_MLA_MAX_SPLITS=32)",
    "no_mla_async": "mla_attention_mma's plain tile loads ($OPENINFER_MLA_ASYNC_TILES=0; cp.async tiles are the "
                    "default since E3, 2026-11-24)",
    "mla_combine_loop": "mla_combine_splits ($OPENINFER_MLA_COMBINE=loop; the shared-memory combine is the default "
                        "since E3)",
    "mla_heads16": "mla_attention_mma in blocks of 16 heads, a warp per output quarter ($OPENINFER_MLA_HEADS16=1)",
    "shared_overlap": "the shared expert on a side stream beside the routed ones ($OPENINFER_MOE_SHARED_OVERLAP=1)",
    "no_shared_overlap": "the shared expert inline, before the routing ($OPENINFER_MOE_SHARED_OVERLAP=0)",
    "int4_tiled": "routed INT4 experts in the decode GEMV's tiled layout (tiled_int4 of the same weights, as "
                  "$OPENINFER_INT4_LAYOUT=tiled uploads them)",
    "int4_rows": "routed INT4 experts in the checkpoint layout ($OPENINFER_INT4_LAYOUT=rows)",
    "int4_groups": "routed INT4 experts in the lane-groups layout, moe_int4.cu's GEMV at few slots per expert "
                   "($OPENINFER_INT4_LAYOUT=lane_groups)",
    "gemv_silu": "SiLU·mul inside the tiled INT4 gate_up decode GEMV ($OPENINFER_MOE_GEMV_SILU=1; with int4_tiled)",
    "no_gemv_silu": "SiLU·mul as its own launch after the gate_up GEMV ($OPENINFER_MOE_GEMV_SILU=0)",
    "route_sort": "a decode step's top-k and grouping in one block, moe_route_sort ($OPENINFER_MOE_ROUTE_SORT=1)",
    "int4_row_blocks": "moe_gemv_int4_groups blocks taking several column blocks where a decode grid exceeds a wave "
                       "($OPENINFER_INT4_ROW_BLOCKS=auto)",
    "rms_scaled": "q_a_norm + q_b at one row as one launch, gemv_m1_rms_scaled ($OPENINFER_RMS_SCALED_GEMV=1)",
    "gemv_cols1": "gemv_m1's warps own 1 column each ($OPENINFER_GEMV_M1_COLS=1; the default before s15)",
    "gemv_beside2": "the shared expert's gemv_m1 on the MoE side stream with at least 2 columns a warp "
                    "($OPENINFER_GEMV_M1_COLS_BESIDE=2)",
    "gemv_beside1": "$OPENINFER_GEMV_M1_COLS_BESIDE=1 (the shared expert's gemv_m1 as elsewhere; before s15 D6)",
    "gemv_beside4": "$OPENINFER_GEMV_M1_COLS_BESIDE=4",
    "gemv_cols2": "gemv_m1's warps own 2 columns each ($OPENINFER_GEMV_M1_COLS=2)",
    "gemv_cols4": "gemv_m1's warps own 4 columns each ($OPENINFER_GEMV_M1_COLS=4)",
    "absorb_small": "W_UK as mla_absorb_small instead of cuBLAS's batched GEMM ($OPENINFER_MLA_ABSORB_SMALL=1)",
    "expand_small": "W_UV as mla_expand_small instead of cuBLAS's batched GEMM ($OPENINFER_MLA_EXPAND_SMALL=1)",
    **{f"combine_expand{columns}": f"the split combine and W_UV as one launch, mla_combine_expand with {columns} "
       f"columns a block ($OPENINFER_MLA_COMBINE_EXPAND={columns}; bit-equal to the combine + expand_small)"
       for columns in (16, 32, 64)},
    "shared_after_route": "the shared expert's side stream forked after the routing ($OPENINFER_MOE_SHARED_AFTER_ROUTE=1)",
    "route_before_shared": "the routing launched before the shared experts ($OPENINFER_MOE_ROUTE_BEFORE_SHARED=1)",
    "route_decode": "a decode step's routing in one launch, moe_route_decode ($OPENINFER_MOE_ROUTE_DECODE=1)",
    "no_route_before_shared": "$OPENINFER_MOE_ROUTE_BEFORE_SHARED=0",
    "no_route_decode": "$OPENINFER_MOE_ROUTE_DECODE=0",
    # the switches above turned off (to time the defaults before a flip against them)
    "no_int4_row_blocks": "one column block per moe_gemv_int4_groups block ($OPENINFER_INT4_ROW_BLOCKS=1)",
    "no_rms_scaled": "q_a_norm + q_b as rms_norm then gemv_m1 ($OPENINFER_RMS_SCALED_GEMV=0)",
    "no_shared_after_route": "the shared expert forked before the routing ($OPENINFER_MOE_SHARED_AFTER_ROUTE=0)",
    "shared_down_late": "the shared expert's down projection beside the routed one instead of their gate_up "
                        "($OPENINFER_MOE_SHARED_DOWN_LATE=1)",
    "combine_expand_cap16": "with mla_combine_expand, at most 1,024 / heads context splits (Kimi-K2: 16; "
                            "$OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS=1024)",
    "no_combine_expand": "the split combine and W_UV as two launches ($OPENINFER_MLA_COMBINE_EXPAND=0; before s16)",
    "layer_ticket": "moe_route_decode's counter kept with the layer, no zeroing node per call "
                    "($OPENINFER_MOE_ROUTE_TICKET=layer; the default since s16 D3)",
    "call_ticket": "moe_route_decode's counter zeroed per call by a one-thread kernel node "
                   "($OPENINFER_MOE_ROUTE_TICKET=call; before s16 D3)",
    "mla_cluster4": "the absorbed MLA decode's splits combined on chip in clusters of up to 4 CTAs, no combine launch "
                    "($OPENINFER_MLA_TMA_CLUSTER=4)",
    "mla_cluster8": "... of up to 8 CTAs ($OPENINFER_MLA_TMA_CLUSTER=8)",
    "mla_cluster16": "... of up to 16 CTAs ($OPENINFER_MLA_TMA_CLUSTER=16)",
}
# Earlier spellings that name a default (kept so older commands still parse; they change nothing)
LAYER_DEFAULT_OPTIONS = ("fast_routing", "spread_rope", "mla_splits64", "mla_async", "mla_combine_shared")


def graph_timeline(launch, replays: int = 8) -> dict:
    """Each kernel (and memset / copy) of a captured step as the device ran it: ``launch`` (a graph's
    launch) replayed ``replays`` times under torch's profiler (CUPTI records every kernel of the process,
    CuPy's graph launches included), the replays apart (a sync between them). Per node in launch order:
    name, stream, start and duration in µs from the step's first node (medians over replays), and the
    step's span; ``error`` where torch or its CUDA profiler is missing (the rest of the JSON stands)."""
    import cupy

    try:
        from torch.profiler import ProfilerActivity, profile
    except Exception as exc:  # noqa: BLE001 - the timeline is extra; report why it is missing
        return {"error": f"{type(exc).__name__}: {exc}"}
    launch()
    cupy.cuda.Device().synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                launch()
                cupy.cuda.Device().synchronize()
                time.sleep(0.002)  # a clear gap between replays
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text()).get("traceEvents", [])
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    nodes = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                   key=lambda e: float(e["ts"]))
    if not nodes or len(nodes) % replays:
        return {"error": f"{len(nodes)} device nodes recorded over {replays} replays", "names": sorted(
            {e.get("name", "")[:60] for e in nodes})}
    per = len(nodes) // replays
    runs = [nodes[i * per:(i + 1) * per] for i in range(replays)]
    spans = [float(r[-1]["ts"]) + float(r[-1]["dur"]) - float(r[0]["ts"]) for r in runs]
    table = []
    for i in range(per):
        name = runs[0][i].get("name", "")
        table.append({"name": name[:80], "stream": runs[0][i].get("args", {}).get("stream"),
                      "start_us": float(np.median([float(r[i]["ts"]) - float(r[0]["ts"]) for r in runs])),
                      "dur_us": float(np.median([float(r[i]["dur"]) for r in runs])),
                      "same_name": all(r[i].get("name", "") == name for r in runs)})
    busy = sum(n["dur_us"] for n in table)
    return {"replays": replays, "span_us": float(np.median(spans)), "kernel_sum_us": busy, "nodes": table}


def layer_variants(text: str, absorbed_kernel: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """``--variants`` ("absorbed:gemv[:option+option],..."; options in LAYER_OPTIONS, each a change
    from core's defaults: a variant without options runs what ships), else the one variant of
    ``--absorbed-kernel`` and $OPENINFER_MOE_GEMV (each falling back to core's default) with what
    the environment switches (``fused`` from $OPENINFER_FUSED_DECODE=1; the other switches stay
    as set)."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import moe as cuda_moe

    if not text:
        on = ("fused",) if os.environ.get("OPENINFER_FUSED_DECODE", "0") in ("1", "true", "on") else ()
        return [(absorbed_kernel or os.environ.get(cuda_mla.ABSORBED_KERNEL_ENV) or "auto",
                 cuda_moe.forced_gemv_kernel() or "auto", on)]
    variants = []
    for item in text.split(","):
        absorbed, _, rest = item.partition(":")
        gemv, _, options = rest.partition(":")
        chosen = tuple(o for o in options.split("+") if o and o not in LAYER_DEFAULT_OPTIONS) if options else ()
        if absorbed not in ("auto", *cuda_mla.ABSORBED_KERNELS) or gemv not in ("auto", *cuda_moe.GEMV_KERNELS) \
                or not set(chosen) <= set(LAYER_OPTIONS):
            raise SystemExit(f"--variants item {item!r}: want ABSORBED:GEMV[:OPTION+...] with ABSORBED in auto, "
                             f"{', '.join(cuda_mla.ABSORBED_KERNELS)}, GEMV in auto, "
                             f"{', '.join(cuda_moe.GEMV_KERNELS)} and OPTION in {', '.join(LAYER_OPTIONS)}")
        variants.append((absorbed, gemv, chosen))
    return variants


def variant_layout(options: tuple[str, ...]) -> str:
    """The routed INT4 experts' layout of a variant: its int4_tiled / int4_rows option, else what
    ``upload_expert_linear`` gives ($OPENINFER_INT4_LAYOUT, else core's default)."""
    from openinfer.backend.cuda import moe as cuda_moe

    return ("tiled" if "int4_tiled" in options else "rows" if "int4_rows" in options
            else "lane_groups" if "int4_groups" in options else cuda_moe.int4_layout())


def variant_label(absorbed_kernel: str, gemv_kernel: str, options: tuple[str, ...]) -> str:
    return f"{absorbed_kernel}:{gemv_kernel}" + (f":{'+'.join(options)}" if options else "")


def use_variant(gemv_kernel: str, options: tuple[str, ...]) -> None:
    """Core's switches for a variant: the decode GEMV and each option's variable (read at each call);
    without its option a variable is unset, so core's default runs."""
    from openinfer.backend.cuda import linear as cuda_linear
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90, moe_routing
    from openinfer.backend.cuda import moe as cuda_moe

    os.environ[cuda_moe.GEMV_KERNEL_ENV] = gemv_kernel
    switches = {"no_fast_routing": (moe_routing.FAST_ROUTING_ENV, "0"), "no_spread_rope": (cuda_mla.SPREAD_ROPE_ENV, "0"),
                "mla_splits16": (cuda_mla.MAX_SPLITS_ENV, "16"), "mla_splits8": (cuda_mla.MAX_SPLITS_ENV, "8"),
                "mla_splits32": (cuda_mla.MAX_SPLITS_ENV, "32"), "no_mla_async": (cuda_mla.ASYNC_TILES_ENV, "0"),
                "mla_combine_loop": (cuda_mla.COMBINE_ENV, "loop"), "mla_heads16": (cuda_mla.HEADS16_ENV, "1"),
                "shared_overlap": (cuda_moe.SHARED_OVERLAP_ENV, "1"),
                "no_shared_overlap": (cuda_moe.SHARED_OVERLAP_ENV, "0"),
                "gemv_silu": (cuda_moe.GEMV_SILU_ENV, "1"), "no_gemv_silu": (cuda_moe.GEMV_SILU_ENV, "0"),
                "route_sort": (moe_routing.ROUTE_SORT_ENV, "1"),
                "int4_row_blocks": (cuda_moe.INT4_ROW_BLOCKS_ENV, "auto"),
                "rms_scaled": ("OPENINFER_RMS_SCALED_GEMV", "1"),
                "gemv_cols1": (cuda_linear.GEMV_M1_COLS_ENV, "1"), "gemv_cols2": (cuda_linear.GEMV_M1_COLS_ENV, "2"),
                "gemv_cols4": (cuda_linear.GEMV_M1_COLS_ENV, "4"),
                "gemv_beside2": (cuda_linear.GEMV_M1_COLS_BESIDE_ENV, "2"),
                "gemv_beside1": (cuda_linear.GEMV_M1_COLS_BESIDE_ENV, "1"),
                "gemv_beside4": (cuda_linear.GEMV_M1_COLS_BESIDE_ENV, "4"),
                "absorb_small": (cuda_mla.ABSORB_SMALL_ENV, "1"), "expand_small": (cuda_mla.EXPAND_SMALL_ENV, "1"),
                **{f"combine_expand{columns}": (cuda_mla.COMBINE_EXPAND_ENV, str(columns))
                   for columns in cuda_mla.COMBINE_EXPAND_CHOICES},
                "shared_after_route": (cuda_moe.SHARED_AFTER_ROUTE_ENV, "1"),
                "no_int4_row_blocks": (cuda_moe.INT4_ROW_BLOCKS_ENV, "1"), "no_rms_scaled": ("OPENINFER_RMS_SCALED_GEMV", "0"),
                "no_shared_after_route": (cuda_moe.SHARED_AFTER_ROUTE_ENV, "0"),
                "route_before_shared": ("OPENINFER_MOE_ROUTE_BEFORE_SHARED", "1"),
                "route_decode": ("OPENINFER_MOE_ROUTE_DECODE", "1"),
                "no_route_before_shared": ("OPENINFER_MOE_ROUTE_BEFORE_SHARED", "0"),
                "no_route_decode": ("OPENINFER_MOE_ROUTE_DECODE", "0"),
                "shared_down_late": (cuda_moe.SHARED_DOWN_LATE_ENV, "1"),
                "layer_ticket": (cuda_moe.ROUTE_TICKET_ENV, "layer"),
                "no_combine_expand": (cuda_mla.COMBINE_EXPAND_ENV, "0"),
                "combine_expand_cap16": (cuda_mla.COMBINE_EXPAND_HEAD_SPLITS_ENV, "1024"),
                "call_ticket": (cuda_moe.ROUTE_TICKET_ENV, "call"),
                "mla_cluster4": (mla_decode_sm90.TMA_CLUSTER_ENV, "4"),
                "mla_cluster8": (mla_decode_sm90.TMA_CLUSTER_ENV, "8"),
                "mla_cluster16": (mla_decode_sm90.TMA_CLUSTER_ENV, "16")}
    for env, _ in switches.values():  # first all unset (two options may set one variable), then the chosen
        os.environ.pop(env, None)
    for option, (env, value) in switches.items():
        if option in options:
            os.environ[env] = value


def layer_step(backend, attention, moe, shared, spec, cache, batch, cos, sin, x, absorbed_kernel: str):
    """One decode step of the layer, as the plugin's CUDA plan runs it: returns (attention output
    after o_proj, layer output)."""
    import cupy

    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import moe as cuda_moe

    c = KIMI_LAYER
    qkv_a = backend.linear(x, attention["qkv_a"])
    q = backend.add_rms_norm_linear(cupy.ascontiguousarray(qkv_a[:, :c["q_lora"]]), None, attention["q_a_norm"],
                                    1e-6, attention["q_b"])[0]
    attn = cuda_mla.mla_forward(backend.blas, q, qkv_a[:, c["q_lora"]:], cache, attention["w_uk"], attention["w_uv"],
                                attention["kv_a_norm"], spec, batch, cos, sin, 1e-6, backend.num_sms,
                                absorbed_kernel=absorbed_kernel)
    h = backend.linear(attn, attention["o_proj"])
    # by moe_forward, beside the routed ones with shared_overlap (its down phase beside theirs: shared_down_late)
    return h, cuda_moe.moe_forward(backend, h, moe, shared_experts=shared_mlp(backend, shared))


def shared_mlp(backend, shared):
    """The shared expert, down(silu_mul(gate_up(h))), in moe_forward's two phases (as the plugin gives it)."""
    from openinfer.backend.cuda import moe as cuda_moe

    return cuda_moe.SharedExpertPhases(up=lambda h: backend.linear(h, shared[0]),
                                       down=lambda hidden: backend.silu_mul_linear(hidden, shared[1]))


def run_layer(args) -> dict:
    import cupy

    from openinfer.backend.base import ForwardBatch
    from openinfer.backend.cuda import CudaBackend, moe_routing
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.mla import MLASpec
    from openinfer.rope import RopeParameters, RotaryEmbedding
    from openinfer.tools.ledger import gpu_seconds

    variants = layer_variants(args.variants, args.absorbed_kernel)
    backend = CudaBackend()
    backends = {False: backend, True: CudaBackend(fuse_decode=True)}  # by variant's ``fused``: same weights
    rng = np.random.default_rng(0)
    attention, moe, shared = build_layer(backend, rng)
    # the routed experts by INT4 layout (variant options int4_tiled / int4_rows, else what uploads take):
    # the same random words, repacked
    layouts = {variant_layout(options) for _, _, options in variants}
    moes = {"rows": moe}
    for layout in layouts - {"rows"}:
        moes[layout] = dataclasses.replace(moe, gate_up=cuda_moe.tiled_int4(moe.gate_up, layout),
                                           down=cuda_moe.tiled_int4(moe.down, layout))
    c = KIMI_LAYER
    spec = MLASpec(c["heads"], c["nope"], c["rope"], c["v"], c["kv_lora"], (c["nope"] + c["rope"]) ** -0.5)
    rope = RotaryEmbedding.create(c["rope"], RopeParameters(50000.0), args.context + 8)
    cos, sin = cupy.asarray(rope.cos), cupy.asarray(rope.sin)
    bandwidth = copy_bandwidth()
    points, failures = [], {}  # failures: variant label -> the error its dry run raised
    for batch in (int(b) for b in args.batches.split(",")):
        block_size = 64
        blocks_per_seq = -(-(args.context + 1) // block_size)
        cache = cupy.zeros((batch * blocks_per_seq + 1, block_size, c["kv_lora"] + c["rope"]), cupy.uint16)
        tables = (1 + np.arange(batch * blocks_per_seq, dtype=np.int32)).reshape(batch, blocks_per_seq)
        positions = np.full(batch, args.context, np.int32)
        slots = tables[:, args.context // block_size] * block_size + args.context % block_size
        host = ForwardBatch(token_ids=np.zeros(batch, np.int32), positions=positions,
                            query_start=np.arange(batch + 1, dtype=np.int32),
                            context_lens=np.full(batch, args.context + 1, np.int32), block_tables=tables,
                            slot_mapping=slots.astype(np.int32), logits_rows=np.arange(batch, dtype=np.int32),
                            max_query_len=1, max_context_len=args.context + 1)
        device_batch = backend.prepare_batch(host)
        x = backend.upload(rng.standard_normal((batch, c["hidden"])).astype(np.float32))
        if not points:  # every variant's modules compiled in parallel before anything is timed
            dry = []
            for absorbed_kernel, gemv_kernel, options in variants:
                label = variant_label(absorbed_kernel, gemv_kernel, options)
                dry.append(partial(noting_failure, failures, label, partial(use_variant, gemv_kernel, options)))
                dry.append(partial(noting_failure, failures, label, partial(
                    layer_step, backends["fused" in options], attention, moes[variant_layout(options)], shared, spec,
                    cache, device_batch, cos, sin, x, absorbed_kernel)))
            warm_kernels(dry)
        for absorbed_kernel, gemv_kernel, options in variants:
            label = variant_label(absorbed_kernel, gemv_kernel, options)
            if label in failures:  # a variant that cannot run is reported, the others still measured
                points.append({"batch": batch, "variant": label, "error": failures[label]})
                print(json.dumps(points[-1]), flush=True)
                continue
            try:  # a variant that fails here (a kernel that will not load, say) is reported, the rest measured
                use_variant(gemv_kernel, options)
                ops, moe = backends["fused" in options], moes[variant_layout(options)]
                step = partial(layer_step, ops, attention, moe, shared, spec, cache, device_batch, cos, sin, x,
                               absorbed_kernel)
                h, _ = step()
                ids, _ = moe_routing.route(h, moe.gate, moe.router, moe.correction_bias)  # the experts the step reads
                active = int(cupy.unique(ids).size)
                breakdown = layer_breakdown(layer_parts(ops, attention, moe, shared, spec, cache, device_batch, cos, sin,
                                                        x, absorbed_kernel), step, args.iters)
                eager = gpu_seconds(step, repeats=args.iters, warmup=2)
                graph_seconds, graph_error, timeline, in_model_seconds = None, None, None, None
                pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
                try:  # the engine replays decode steps as CUDA graphs: time the layer the same way
                    with cupy.cuda.using_allocator(pool.malloc), stream:
                        step()
                        stream.synchronize()
                        mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
                        if mode is None:
                            stream.begin_capture()
                        else:
                            stream.begin_capture(mode)
                        try:
                            step()
                        finally:
                            graph = stream.end_capture()
                        graph_seconds = gpu_seconds(graph.launch, repeats=args.iters, warmup=2)
                        timeline = graph_timeline(graph.launch) if args.timeline else None
                        if args.layers_per_graph > 1:  # as in a model's step: layers back to back in one graph
                            if mode is None:
                                stream.begin_capture()
                            else:
                                stream.begin_capture(mode)
                            try:
                                for _ in range(args.layers_per_graph):
                                    step()
                            finally:
                                layers_graph = stream.end_capture()
                            in_model_seconds = gpu_seconds(layers_graph.launch, repeats=args.iters,
                                                           warmup=2) / args.layers_per_graph
                except Exception as exc:  # noqa: BLE001 - reported in the JSON, eager timing stands
                    graph_error = f"{type(exc).__name__}: {exc}"
                seconds = graph_seconds or eager
                needed = layer_bytes(attention, moe, shared, active, batch, args.context)
                roofline = needed / bandwidth
                points.append({"batch": batch, "absorbed_kernel": absorbed_kernel, "gemv_kernel": gemv_kernel,
                               "options": list(options), "variant": variant_label(absorbed_kernel, gemv_kernel, options),
                               "absorbed_kernel_run": cuda_mla.choose_absorbed_kernel(spec.num_heads, batch,
                                                                                      absorbed_kernel),
                               "step_ms": 1e3 * seconds, "eager_ms": 1e3 * eager,
                               "graph_ms": None if graph_seconds is None else 1e3 * graph_seconds,
                               "graph_error": graph_error, "roofline_ms": 1e3 * roofline,
                               "fraction_of_roofline": roofline / seconds, "active_experts": active, "bytes": needed,
                               "breakdown_sum_ms": sum(breakdown["breakdown_ms"].values()), **breakdown,
                               **({"layers_per_graph": args.layers_per_graph, "in_model_ms": 1e3 * in_model_seconds,
                                   "in_model_fraction_of_roofline": roofline / in_model_seconds}
                                  if in_model_seconds else {}),
                               **({"timeline": timeline} if timeline is not None else {})})
            except Exception as exc:  # noqa: BLE001 - reported in the results JSON
                points.append({"batch": batch, "variant": label, "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(points[-1]), flush=True)
    return {"benchmark": "kimi_k2_layer", "device": device_name(), "copy_bandwidth_gbs": bandwidth / 1e9,
            "context": args.context, "variants": [variant_label(*v) for v in variants], "layer": KIMI_LAYER,
            "points": points}


# --- one MoE block alone (routing, routed + shared experts, combine) ----------------------------------

# Moonlight-16B-A3B (bf16, 64 x top-6, 2 shared of 1408) and Kimi-K2 (INT4, 384 x top-8, 1 shared of 2048)
MOE_SHAPES = {
    "moonlight": {"hidden": 2048, "inter": 1408, "experts": 64, "top_k": 6, "shared": 2, "format": "bf16",
                  "scaling": 2.446, "copies": 4},
    "kimi": {"hidden": 7168, "inter": 2048, "experts": 384, "top_k": 8, "shared": 1, "format": "int4",
             "scaling": 2.827, "copies": 1},
}
# variant -> (environment switches, INT4 experts tiled); "default": what ships; "inline": the shared experts
# on the main stream; OPENINFER_MOE_SHARED_FUSED=1 in a variant's switches runs the layer with its shared
# experts stacked after the routed ones (moe.fuse_shared_experts; bf16 experts only)
MOE_VARIANTS = {"default": ({}, False),
                # the MoE defaults before D2 of 2026-11-24 (shared MLP by cuBLAS, moe_route + moe_sort_parallel,
                # plain launches of the Hopper grouped GEMM)
                "before_d2": ({"OPENINFER_MOE_SHARED_FUSED": "0", "OPENINFER_MOE_ROUTE_SORT": "0",
                               "OPENINFER_MOE_SM90_PDL": "0"}, False),
                "inline": ({"OPENINFER_MOE_SHARED_OVERLAP": "0"}, False),
                "shared_fused": ({"OPENINFER_MOE_SHARED_FUSED": "1"}, False),
                # down's Hopper grouped GEMM launched while gate_up's last wave runs (programmatic dependent launch)
                "sm90_pdl": ({"OPENINFER_MOE_SM90_PDL": "1"}, False),
                "shared_fused_pdl": ({"OPENINFER_MOE_SHARED_FUSED": "1", "OPENINFER_MOE_SM90_PDL": "1"}, False),
                # top-k and grouping in one block (moe_route_sort) after the router logits
                "route_sort": ({"OPENINFER_MOE_ROUTE_SORT": "1"}, False),
                "shared_fused_route_sort": ({"OPENINFER_MOE_SHARED_FUSED": "1", "OPENINFER_MOE_ROUTE_SORT": "1"}, False),
                "shared_fused_route_sort_pdl": ({"OPENINFER_MOE_SHARED_FUSED": "1", "OPENINFER_MOE_ROUTE_SORT": "1",
                                                 "OPENINFER_MOE_SM90_PDL": "1"}, False),
                "overlap": ({"OPENINFER_MOE_SHARED_OVERLAP": "1"}, False),
                "tiled": ({"OPENINFER_MOE_SHARED_OVERLAP": "0"}, True),
                "tiled_overlap": ({"OPENINFER_MOE_SHARED_OVERLAP": "1"}, True),
                # the routed experts' decode GEMV with streaming weight loads (GEMV_STREAM_LOADS) where it runs
                "overlap_wide_nc": ({"OPENINFER_MOE_SHARED_OVERLAP": "1", "OPENINFER_MOE_GEMV": "wide_nc"}, False),
                "overlap_mma_staged_nc": ({"OPENINFER_MOE_SHARED_OVERLAP": "1", "OPENINFER_MOE_GEMV": "mma_staged_nc"},
                                          False),
                # the shared experts on the side stream, routing in three launches, SiLU·mul as its own launch
                # (the defaults before E1 of 2026-11-24 with the checkpoint INT4 layout)
                "overlap_before": ({"OPENINFER_MOE_SHARED_OVERLAP": "1", "OPENINFER_MOE_GEMV_SILU": "0"}, False),
                # bf16 experts' GEMVs one token row per pass, 8 columns per warp (E1: the down projection 13.3 -> 11.5 us)
                "overlap_wide8": ({"OPENINFER_MOE_SHARED_OVERLAP": "1", "OPENINFER_MOE_GEMV": "wide8_r1_nc"}, False),
                # ... and SiLU·mul inside the tiled gate_up GEMV (moe.cu TILED_FUSE_SILU)
                "tiled_overlap_silu": ({"OPENINFER_MOE_SHARED_OVERLAP": "1", "OPENINFER_MOE_GEMV_SILU": "1"}, True)}


def run_moe(args) -> dict:
    """moe_forward of one MoE block with its shared experts (``shared_experts``) per variant, timed as
    CUDA-graph replays of a decode step's block over ``copies`` weight copies (past L2)."""
    import cupy

    from openinfer.backend.cuda import CudaBackend, moe_routing
    from openinfer.backend.cuda import moe as cuda_moe
    from openinfer.backend.cuda.moe import DeviceMoE, ExpertLinear
    from openinfer.moe import RouterSpec

    shapes, variants = args.shapes.split(","), args.variants.split(",")
    if set(shapes) - set(MOE_SHAPES) or set(variants) - set(MOE_VARIANTS):
        raise SystemExit(f"--shapes from {', '.join(MOE_SHAPES)}; --variants from {', '.join(MOE_VARIANTS)}")
    tokens_list = args.tokens.split(",")
    if not all(t.isdigit() and int(t) > 0 for t in tokens_list):
        raise SystemExit(f"--tokens {args.tokens!r}: want a comma list of positive integers")
    backend = CudaBackend()
    rng = np.random.default_rng(0)
    bandwidth = copy_bandwidth()
    points = []
    for shape in shapes:
        c = MOE_SHAPES[shape]
        h, inter, experts = c["hidden"], c["inter"], c["experts"]

        def experts_weight(n, k, c=c):
            if c["format"] == "int4":
                return random_int4(backend, c["experts"], n, k)
            return ExpertLinear("bf16", device_random_bf16((c["experts"], n, k)), None, n, k)

        blocks = []
        for _ in range(c["copies"]):
            layer = DeviceMoE(RouterSpec(experts, c["top_k"], "sigmoid", routed_scaling_factor=c["scaling"]),
                              backend.weight(0.05 * rng.standard_normal((experts, h)).astype(np.float32)),
                              cupy.zeros(experts, cupy.float32), experts_weight(2 * inter, h), experts_weight(h, inter))
            shared = (backend.linear_weight(0.02 * rng.standard_normal((2 * inter * c["shared"], h)).astype(np.float32)),
                      backend.linear_weight(0.02 * rng.standard_normal((h, inter * c["shared"])).astype(np.float32)))
            tiled = dataclasses.replace(layer, gate_up=cuda_moe.tiled_int4(layer.gate_up),
                                        down=cuda_moe.tiled_int4(layer.down)) \
                if any(MOE_VARIANTS[v][1] for v in variants) and c["format"] == "int4" else layer
            fused = cuda_moe.fuse_shared_experts(layer, shared[0].weight, shared[1].weight) \
                if cuda_moe.shared_fusion_fits(layer, shared[0].weight, shared[1].weight) else None
            blocks.append((layer, tiled, shared, fused))
        per_expert = sum(w.data[0].nbytes + (0 if w.scale is None else w.scale[0].nbytes)
                         for w in (blocks[0][0].gate_up, blocks[0][0].down))
        shared_bytes = sum(w.weight.nbytes for w in blocks[0][2]) + blocks[0][0].gate.nbytes
        for tokens in (int(t) for t in tokens_list):
            x = backend.upload(rng.standard_normal((tokens, h)).astype(np.float32))
            ids, _ = moe_routing.route(x, blocks[0][0].gate, blocks[0][0].router, blocks[0][0].correction_bias)
            active = int(cupy.unique(ids).size)
            point = {"shape": shape, "tokens": tokens, "active_experts": active,
                     "bytes": active * per_expert + shared_bytes}
            outputs = {}
            for variant in variants:
                switches, use_tiled = MOE_VARIANTS[variant]
                with switched_env(switches):  # as a model's prepare_weights would decide
                    use_fused = cuda_moe.shared_fusion_wanted() and blocks[0][3] is not None
                if use_fused:
                    calls = [partial(cuda_moe.moe_forward, backend, x, fused) for *_, fused in blocks]
                else:
                    calls = [partial(cuda_moe.moe_forward, backend, x, tiled if use_tiled else layer,
                                     shared_experts=shared_mlp(backend, shared))
                             for layer, tiled, shared, _ in blocks]
                with switched_env(switches):
                    outputs[variant] = backend.to_host(calls[0]())
                    seconds, error = graph_call_seconds(calls)
                point[f"{variant}_us"] = 1e6 * seconds
                point[f"{variant}_fraction_of_copy_bandwidth"] = point["bytes"] / seconds / bandwidth
                point[f"{variant}_speedup"] = point[f"{variants[0]}_us"] / point[f"{variant}_us"]
                point[f"{variant}_max_abs_difference"] = float(np.abs(outputs[variant] - outputs[variants[0]]).max())
                point[f"{variant}_relative_difference"] = float(
                    np.linalg.norm(outputs[variant] - outputs[variants[0]]) / max(np.linalg.norm(outputs[variants[0]]),
                                                                                  1e-30))
                if error:
                    point[f"{variant}_graph_error"] = error
            print(json.dumps(point), flush=True)
            points.append(point)
    return {"benchmark": "moe_block", "device": device_name(), "copy_bandwidth_gbs": bandwidth / 1e9,
            "shapes": {name: MOE_SHAPES[name] for name in shapes},
            "variants": {name: MOE_VARIANTS[name][0] | {"int4_tiled": MOE_VARIANTS[name][1]} for name in variants},
            "points": points}


def plot_moe(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(report["variants"]))
    for i, variant in enumerate(report["variants"]):
        ax.bar(np.arange(len(points)) + i * width, [p.get(f"{variant}_us", np.nan) for p in points], width,
               label=variant)
    ax.set_xticks(np.arange(len(points)) + 0.4 - width / 2, [f"{p['shape']} {p['tokens']}t" for p in points])
    ax.set_ylabel("µs per MoE block (graph replay)")
    ax.set_title(f"MoE block with shared experts ({report['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _variant_name(variant: str) -> str:
    absorbed, gemv, *options = variant.split(":")
    return f"MLA {absorbed}, GEMV {gemv}" + "".join(f", {o}" for o in "+".join(options).split("+") if o)


def plot_layer(report: dict, path: Path) -> None:
    """Step time per batch and variant against the roofline; beside it the smallest batch's
    per-op device times (when the points carry them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    batches = sorted({p["batch"] for p in points})
    variants = report["variants"]

    def point_of(batch: int, variant: str):  # a measured point (not a variant that failed)
        return next((p for p in points if p["batch"] == batch and "error" not in p
                     and variant == p.get("variant", f"{p['absorbed_kernel']}:{p['gemv_kernel']}")), None)

    x = np.arange(len(batches))
    width = 0.8 / (len(variants) + 1)
    fig, (ax, ops_ax) = plt.subplots(1, 2, figsize=(14, 4.5))
    for i, variant in enumerate([*variants, "roofline"]):
        offset = (i - len(variants) / 2) * width
        for j, batch in enumerate(batches):
            point = point_of(batch, variants[0] if variant == "roofline" else variant)
            if point is None:
                continue
            value = point["roofline_ms"] if variant == "roofline" else point["step_ms"]
            ax.bar(j + offset, value, width, color=f"C{i}", label=None if j else
                   ("HBM roofline" if variant == "roofline" else _variant_name(variant)))
            if variant != "roofline":
                ax.text(j + offset, value, f"{100 * point['fraction_of_roofline']:.0f}%", ha="center", va="bottom",
                        fontsize=7)
    ax.set(xticks=x, xticklabels=[f"batch {b}" for b in batches], ylabel="ms per layer step (graph replay)",
           title=f"one Kimi-K2 layer, context {report['context']} — {report['device']}")
    ax.legend(fontsize=7)
    first = [point_of(batches[0], v) for v in variants]
    ops = list(dict.fromkeys(op for point in first if point for op in point["breakdown_ms"]))  # every variant's
    y = np.arange(len(ops))
    height = 0.8 / len(variants)
    for i, point in enumerate(first):
        if point is not None:
            ops_ax.barh(y + i * height, [1e3 * point["breakdown_ms"].get(op, 0.0) for op in ops], height,
                        color=f"C{i}", label=_variant_name(variants[i]))
    ops_ax.set(yticks=y + 0.4 - height / 2, yticklabels=ops, xlabel="µs per op (device, held stream)",
               title=f"batch {batches[0]}: each op")
    ops_ax.invert_yaxis()
    ops_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- Moonlight-shaped serving, side by side with vLLM --------------------------------------------

# vLLM 0.26.0 as installed by ../shared/tools/vllm-peer.sh; {model} and {port} are filled in. Moonlight's
# config.json says model_type deepseek_v3 with no auto_map: vLLM's own DeepseekV3 model, no --trust-remote-code.
VLLM_COMMAND = ("env PYTHONPATH=/tmp/vsite:/tmp/site python3 -m vllm.entrypoints.openai.api_server --model {model} "
                "--port {port} --max-model-len {max_model_len} --gpu-memory-utilization 0.9")
# A CPU dry run of the whole path (checkpoint writer, both server launches' plumbing, the client) at toy size.
MOONLIGHT_TINY = {**MOONLIGHT, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                  "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                  "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                  "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2}
WEIGHT_STD = 0.02  # keeps the residual stream bounded through 27 random layers
POOL_VALUES = 1 << 26  # random bf16 values every weight tensor is cut from (128 MiB)
SHARD_BYTES = 4 << 30
WRITE_THREADS = 16  # the device's CPU cores
CHECKPOINT_PLACES = ("/dev/shm/moonlight-random", "/tmp/moonlight-random")  # tmpfs first: written at memory speed


def default_checkpoint() -> str:
    """Where a complete copy already is, else tmpfs when it has room for ~32 GB, else /tmp."""
    for place in CHECKPOINT_PLACES:
        if (Path(place) / ".complete").exists():
            return place
    try:
        if shutil.disk_usage("/dev/shm").free > 40e9:
            return CHECKPOINT_PLACES[0]
    except OSError:
        pass
    return CHECKPOINT_PLACES[1]


def deepseek_v3_tensors(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, fill) of every tensor of a bf16 DeepSeek-V3 checkpoint, in the HF spelling both
    openinfer and vLLM read; fill: ``normal`` weights, ``ones`` norms, ``bias`` the fp32 router bias."""
    c = config
    hidden, heads, experts = c["hidden_size"], c["num_attention_heads"], c["n_routed_experts"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    tensors = [("model.embed_tokens.weight", (c["vocab_size"], hidden), "normal")]

    def swiglu(module: str, inter: int) -> None:
        tensors.extend([(f"{module}.gate_proj.weight", (inter, hidden), "normal"),
                        (f"{module}.up_proj.weight", (inter, hidden), "normal"),
                        (f"{module}.down_proj.weight", (hidden, inter), "normal")])

    for i in range(c["num_hidden_layers"]):
        layer, attn = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        tensors += [(f"{layer}.input_layernorm.weight", (hidden,), "ones"),
                    (f"{layer}.post_attention_layernorm.weight", (hidden,), "ones")]
        if c["q_lora_rank"]:
            tensors += [(f"{attn}.q_a_proj.weight", (c["q_lora_rank"], hidden), "normal"),
                        (f"{attn}.q_a_layernorm.weight", (c["q_lora_rank"],), "ones"),
                        (f"{attn}.q_b_proj.weight", (heads * qk, c["q_lora_rank"]), "normal")]
        else:
            tensors.append((f"{attn}.q_proj.weight", (heads * qk, hidden), "normal"))
        tensors += [(f"{attn}.kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden), "normal"),
                    (f"{attn}.kv_a_layernorm.weight", (c["kv_lora_rank"],), "ones"),
                    (f"{attn}.kv_b_proj.weight", (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
                     "normal"),
                    (f"{attn}.o_proj.weight", (hidden, heads * c["v_head_dim"]), "normal")]
        mlp = f"{layer}.mlp"
        if i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0:
            tensors += [(f"{mlp}.gate.weight", (experts, hidden), "normal"),
                        (f"{mlp}.gate.e_score_correction_bias", (experts,), "bias")]
            for e in range(experts):
                swiglu(f"{mlp}.experts.{e}", c["moe_intermediate_size"])
            swiglu(f"{mlp}.shared_experts", c["moe_intermediate_size"] * c["n_shared_experts"])
        else:
            swiglu(mlp, c["intermediate_size"])
    tensors += [("model.norm.weight", (hidden,), "ones"), ("lm_head.weight", (c["vocab_size"], hidden), "normal")]
    return tensors


def checkpoint_layout(config: dict) -> tuple[list[tuple[str, bytes, list[tuple[str, tuple[int, ...], str, int]]]],
                                              dict[str, str], int]:
    """Shards of ``deepseek_v3_tensors(config)`` (at most SHARD_BYTES each): (file name, header
    bytes, [(tensor, shape, fill, file offset)]), the index's weight map, and the total bytes."""
    tensors = deepseek_v3_tensors(config)
    groups: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    shard_bytes = 0
    for tensor in tensors:
        size = tensor_bytes(tensor[1], tensor[2])
        if groups[-1] and shard_bytes + size > SHARD_BYTES:
            groups.append([])
            shard_bytes = 0
        groups[-1].append(tensor)
        shard_bytes += size
    shards, weight_map = [], {}
    for index, group in enumerate(groups):
        name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor, shape, fill in group:
            size = tensor_bytes(shape, fill)
            header[tensor] = {"dtype": "F32" if fill == "bias" else "BF16", "shape": list(shape),
                              "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[tensor] = name
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        text = len(text).to_bytes(8, "little") + text
        placed, at = [], len(text)
        for tensor, shape, fill in group:
            placed.append((tensor, shape, fill, at))
            at += tensor_bytes(shape, fill)
        shards.append((name, text, placed))
    return shards, weight_map, sum(tensor_bytes(s, f) for _, s, f in tensors)


def tensor_bytes(shape: tuple[int, ...], fill: str) -> int:
    return int(np.prod(shape)) * (4 if fill == "bias" else 2)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):  # a write may be short (Linux caps one at ~2 GiB)
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def on_tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs (its pages are memory: no page cache to warm)."""
    best, kind = "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    resolved = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and (resolved == fields[1] or resolved.startswith(fields[1].rstrip("/") + "/")) \
                and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind == "tmpfs"


def write_random_checkpoint(path: Path, config: dict, seed: int = 0, threads: int = WRITE_THREADS) -> float | None:
    """A random bf16 checkpoint of ``config`` (sharded safetensors + index, config.json, a word-level
    tokenizer over the vocabulary) that openinfer and vLLM both load, so both serve the same weights
    and route tokens to the same experts. Weights are slices of one pool of N(0, 0.02) bf16 values at
    random offsets (speed does not depend on the values; writing 32 GB must not wait on an RNG),
    written by ``threads`` threads with ``os.pwrite`` at each tensor's offset (one Python thread
    reached ~1-2 GB/s into tmpfs; the copies run in parallel outside the GIL).
    Returns the seconds spent, or None when a complete copy of the same config is there already."""
    from concurrent.futures import ThreadPoolExecutor

    from gpu_serving import write_tokenizer

    marker = path / ".complete"
    digest = json.dumps({"config": config, "seed": seed, "std": WEIGHT_STD}, sort_keys=True)
    if marker.exists() and marker.read_text() == digest:
        return None
    started = time.perf_counter()
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    shards, weight_map, total = checkpoint_layout(config)
    if shutil.disk_usage(path).free < total + (1 << 30):
        raise SystemExit(f"{path}: {shutil.disk_usage(path).free / 1e9:.1f} GB free, the checkpoint needs "
                         f"{total / 1e9:.1f} GB")
    rng = np.random.default_rng(seed)
    pool_size = min(POOL_VALUES, max(1 << 16, total // 2))
    pool = ((WEIGHT_STD * rng.standard_normal(pool_size, dtype=np.float32)).view(np.uint32) >> 16).astype(np.uint16)
    pool_bytes = memoryview(pool).cast("B")
    ones = memoryview(np.full(max(config["hidden_size"], config["kv_lora_rank"], config["q_lora_rank"] or 0),
                              0x3F80, np.uint16)).cast("B")
    jobs: list[tuple[int, memoryview, int]] = []  # (fd, bytes, file offset)
    fds = []
    try:
        for name, header, placed in shards:
            fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            jobs.append((fd, memoryview(header), 0))
            for _, shape, fill, offset in placed:
                size = tensor_bytes(shape, fill)
                if fill == "ones":
                    jobs.append((fd, ones[:size], offset))
                elif fill == "bias":
                    values = (1e-3 * rng.standard_normal(size // 4)).astype(np.float32)
                    jobs.append((fd, memoryview(values).cast("B"), offset))
                else:  # a pool slice from a random even offset, wrapping round the pool's end
                    start = 2 * int(rng.integers(pool_size))
                    while size:
                        piece = min(size, len(pool_bytes) - start)
                        jobs.append((fd, pool_bytes[start:start + piece], offset))
                        size, offset, start = size - piece, offset + piece, 0
        with ThreadPoolExecutor(max(1, threads)) as executor:  # map's results re-raise a failed write
            list(executor.map(lambda job: pwrite_all(*job), jobs))
    finally:
        for fd in fds:
            os.close(fd)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, config["vocab_size"])
    marker.write_text(digest)
    return time.perf_counter() - started


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_bytes()[-16384:].decode(errors="replace").replace("\r", "\n")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def serve_engine(engine: str, command: list[str] | str, streams: list[int], args, vocab: int,
                 log_dir: Path) -> dict:
    """Start one server (its own process group, output into ``log_dir/moonlight_ENGINE.log``), wait
    for HTTP ready, run the burst sweep of ``gpu_concurrency`` with its lean multi-process client
    (fresh prompts of token ids per point, ignore_eos), stop it. openinfer's runs also carry the
    start-up phases and the engine's step log summarised per burst."""
    from gpu_concurrency import attach_step_log, free_port, process_tree_rss, stop, sweep, wait_ready

    from openinfer.engine_core.step_log import STEP_LOG_ENV

    port = free_port()
    env = dict(os.environ)
    log_path = log_dir / f"moonlight_{engine}.log"
    startup_report, step_log = log_dir / f"moonlight_{engine}.startup.json", log_dir / f"moonlight_{engine}.steps.json"
    if isinstance(command, str):
        command = command.format(model=shlex.quote(str(args.checkpoint)), port=port, max_model_len=args.max_model_len)
        popen_args: dict = {"args": command, "shell": True}
    else:
        command = [*command, "--port", str(port)]
        if engine == "openinfer":
            command += ["--startup-report", str(startup_report)]
            env[STEP_LOG_ENV] = str(step_log)
        popen_args = {"args": command}
    print(f"{engine}: {command if isinstance(command, str) else shlex.join(command)}", flush=True)
    url = f"http://127.0.0.1:{port}"
    rss, startup = 0, None
    with open(log_path, "wb") as log:
        process = subprocess.Popen(**popen_args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env)
    try:
        try:
            ready_s = wait_ready(url, process, args.start_timeout)
        except Exception:
            print(f"--- last lines of {log_path}:\n{log_tail(log_path)}", flush=True)
            raise
        import httpx

        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        rss = process_tree_rss(process.pid)
        if startup_report.exists():
            startup = json.loads(startup_report.read_text())
        print(f"{engine} ready in {ready_s:.1f} s, RSS {rss / 2**20:.0f} MiB", flush=True)
        rows = sweep(url, model, streams, args.input_len, args.output_len, vocab, ["lean"], args.client_procs)
    finally:
        stop(process)
    for _ in range(100):  # the engine core writes its step log as it shuts down
        if engine != "openinfer" or step_log.exists():
            break
        time.sleep(0.1)
    if engine == "openinfer":
        attach_step_log(rows, step_log)
    return {"command": command if isinstance(command, str) else shlex.join(command),
            "env": {name: value for name, value in sorted(env.items()) if name.startswith("OPENINFER_")},
            "cold_start_to_http_ready_s": ready_s, "startup": startup, "idle_rss_bytes": rss, "log": str(log_path),
            "sweep": rows}


class Terminated(Exception):
    """SIGTERM arrived (``timeout``): unwinds through ``serve_engine``'s clean-up."""


def stop_on_sigterm(signum: int, frame) -> None:
    raise Terminated(f"signal {signum}")


def run_moonlight(args) -> dict:
    config = MOONLIGHT_TINY if args.tiny else MOONLIGHT
    engines = [e for e in args.engines.split(",") if e and e != "none"]
    unknown = set(engines) - {"openinfer", "vllm"}
    if unknown:
        raise SystemExit(f"unknown engine(s) {sorted(unknown)}; choose from openinfer, vllm (or none)")
    checkpoint = Path(args.checkpoint or default_checkpoint())
    args.checkpoint = str(checkpoint)
    device = "cpu (tiny config)" if args.tiny else (device_name() if engines else "")
    report = {"benchmark": "moonlight_serving", "device": device,
              "model": "Moonlight-16B-A3B shape, random bf16 checkpoint" + (" (tiny dry run)" if args.tiny else ""),
              "checkpoint": str(checkpoint), "input_len": args.input_len, "output_len": args.output_len,
              "max_model_len": args.max_model_len, "client": f"lean, {args.client_procs} processes",
              "streams": [int(s) for s in args.streams.split(",")], "runs": {}}
    for previous in filter(None, args.append.split(",")):
        if Path(previous).exists():
            earlier = json.loads(Path(previous).read_text())
            report["runs"].update(earlier.get("runs", {}))
            report["device"] = report["device"] or earlier.get("device", "")
        else:
            print(f"--append {previous}: no such file, its runs are not kept", flush=True)
    if engines:
        write_s = write_random_checkpoint(checkpoint, config, threads=args.write_threads)
        print(f"checkpoint {checkpoint}: " + ("present" if write_s is None else f"written in {write_s:.1f} s"),
              flush=True)
        report["checkpoint_write_s"] = write_s
        report["checkpoint_on_tmpfs"] = on_tmpfs(checkpoint)
        if write_s is None and not on_tmpfs(checkpoint):  # a fresh copy is in the page cache already
            from gpu_concurrency import warm_page_cache

            warm_page_cache(checkpoint)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    log_dir = Path(args.log_dir) if args.log_dir else (out or Path(tempfile.mkdtemp(prefix="moonlight-logs-")))
    log_dir.mkdir(parents=True, exist_ok=True)
    # `timeout` stops this script with SIGTERM: the running server (its own session) must stop with
    # it, or the next device call finds the GPU taken
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    for engine in engines:
        if engine == "openinfer":
            command: list[str] | str = [
                sys.executable, "-m", "openinfer.cli", "serve", "--model-path", str(checkpoint), "--grpc-port", "0",
                "--max-model-len", str(args.max_model_len), "--log-level", "warning",
                "--device", "cpu" if args.tiny else "cuda", *shlex.split(args.serve_args)]
        else:
            command = args.vllm_cmd
        try:
            report["runs"][engine] = serve_engine(engine, command, report["streams"], args, config["vocab_size"],
                                                  log_dir)
        except Exception as exc:  # noqa: BLE001 - keep what the other engine measured; say what failed
            report["runs"][engine] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{engine} failed: {exc!r}", flush=True)
    ours, peer = report["runs"].get("openinfer", {}), report["runs"].get("vllm", {})
    if ours.get("sweep") and peer.get("sweep"):
        theirs = {row["streams"]: row for row in peer["sweep"]}
        report["ratios"] = [
            {"streams": row["streams"],
             "tpot_vllm_over_openinfer": theirs[row["streams"]]["tpot_ms"]["p50"] / row["tpot_ms"]["p50"],
             "throughput_openinfer_over_vllm": row["output_throughput"] / theirs[row["streams"]]["output_throughput"]}
            for row in ours["sweep"] if row["streams"] in theirs]
        print(json.dumps(report["ratios"]), flush=True)
    return report


def plot_moonlight(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in report["runs"].items():
        rows = run.get("sweep") or []
        streams = [row["streams"] for row in rows]
        left.plot(streams, [row["tpot_ms"]["p50"] for row in rows], "o-", label=name)
        right.plot(streams, [row["output_throughput"] for row in rows], "o-", label=name)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams (burst)")
        axis.legend()
    left.set(ylabel="TPOT p50 (ms)", title="decode TPOT")
    right.set(ylabel="output tokens/s", title=f"output throughput, {report['input_len']} in / {report['output_len']} out")
    fig.suptitle(f"{report['model']} — {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    kernels = sub.add_parser("kernels")
    kernels.add_argument("--sections", default="",
                         help="comma list of mla_prefill,mla_decode,quantized_linear,grouped_experts (default: all)")
    kernels.add_argument("--mla-heads", default="16,64", help="head counts of the mla_decode section")
    gemv = sub.add_parser("gemv")
    gemv.add_argument("--sections", default="dense,grouped", help="comma list of dense,grouped")
    gemv.add_argument("--grouped-formats", default="int4,bf16", help="grouped shapes of these formats (GEMV_GROUPED)")
    gemv.add_argument("--tokens", default=",".join(map(str, GEMV_GROUPED_TOKENS)), help="grouped token counts")
    gemv.add_argument("--int4-layouts", default="rows",
                      help="INT4 experts' layouts to time, comma list of rows (checkpoint), tiled, lane_groups "
                           "(tile_int4)")
    gemv.add_argument("--kernels", default="", help="comma list of GEMV_KERNELS to time, the first the reference "
                                                    "(default: all)")
    gemv.add_argument("--name", default="", help="results file name (default: kimi_gemv[_SECTIONS])")
    experts = sub.add_parser("experts", help="Moonlight's bf16 routed experts by grouped kernel")
    experts.add_argument("--tokens", default=",".join(map(str, EXPERTS_TOKENS)), help="comma list of token counts")
    experts.add_argument("--variants", default="", help=f"comma list of {', '.join(EXPERT_VARIANTS)} (default: all)")
    experts.add_argument("--name", default="kimi_experts", help="results file name (JSON + PNG)")
    experts.add_argument("--kernel-times", action="store_true",
                         help=f"also gate_up and down apart by kernel ({', '.join(EXPERT_KERNELS)}), TFLOP/s")
    layer = sub.add_parser("layer")
    layer.add_argument("--context", type=int, default=1024)
    layer.add_argument("--iters", type=int, default=20)
    layer.add_argument("--batches", default="1,64,256", help="comma list of decode batch sizes")
    layer.add_argument("--name", default="kimi_layer", help="results file name (JSON + PNG)")
    layer.add_argument("--timeline", action="store_true",
                       help="also each kernel of the graph-replayed step as the device ran it (torch's profiler)")
    layer.add_argument("--layers-per-graph", type=int, default=1,
                       help="also time N copies of the step captured back to back in one graph, per layer "
                            "(in_model_ms: a model's step replays its layers so, without a launch per layer)")
    layer.add_argument("--absorbed-kernel", default="", choices=["", "auto", "cuda_cores", "mma"],
                       help="MLA decode kernel (default: $OPENINFER_MLA_DECODE, else core's choice by batch)")
    layer.add_argument("--variants", default="",
                       help="side by side in one run: comma list of ABSORBED:GEMV[:OPTION+...], e.g. "
                            "cuda_cores:moe_gemv,mma:mma,auto:mma_depth4:fused+fast_routing (MLA decode kernel, "
                            f"$OPENINFER_MOE_GEMV, options: {'; '.join(f'{k}: {v}' for k, v in LAYER_OPTIONS.items())})")
    moe_block = sub.add_parser("moe", help="one MoE block (routing, routed + shared experts, combine) by variant")
    moe_block.add_argument("--shapes", default="moonlight,kimi", help=f"comma list of {', '.join(MOE_SHAPES)}")
    moe_block.add_argument("--tokens", default="1,4,16", help="comma list of decode batch sizes")
    moe_block.add_argument("--variants", default="inline,overlap",
                           help=f"comma list of {', '.join(MOE_VARIANTS)} (the first the reference)")
    moe_block.add_argument("--name", default="kimi_moe_block", help="results file name (JSON + PNG)")
    warm = sub.add_parser("warm", help="compile moe.cu's GEMV / GEMM modules in parallel into CuPy's disk cache")
    warm.add_argument("--formats", default="bf16,int4,fp8", help="comma list of weight formats")
    warm.add_argument("--groups", default="16,32,128", help="comma list of INT4 group sizes (32: the tiled layout too)")
    moon = sub.add_parser("moonlight")
    moon.add_argument("--checkpoint", default="",
                      help=f"where the random checkpoint is (written when absent); default: {' or '.join(CHECKPOINT_PLACES)}")
    moon.add_argument("--engines", default="openinfer",
                      help="comma list of openinfer,vllm (run in this order), or none (only --append's files)")
    moon.add_argument("--streams", default="1,16,64,256", help="concurrency points (bursts)")
    moon.add_argument("--input-len", type=int, default=1024)
    moon.add_argument("--output-len", type=int, default=128)
    moon.add_argument("--max-model-len", type=int, default=4096)
    moon.add_argument("--start-timeout", type=float, default=420.0, help="seconds to HTTP ready, per server")
    moon.add_argument("--client-procs", type=int, default=4, help="processes of the lean streaming client")
    moon.add_argument("--write-threads", type=int, default=WRITE_THREADS, help="threads writing the checkpoint")
    moon.add_argument("--log-dir", default="", help="where each server's output goes (default: $OUT, else a temp dir)")
    moon.add_argument("--serve-args", default="", help="extra `openinfer serve` flags")
    moon.add_argument("--vllm-cmd", default=VLLM_COMMAND, help="vLLM launch command; {model} and {port} filled in")
    moon.add_argument("--append", default="",
                      help="comma list of moonlight_serving JSON files whose runs to keep (e.g. openinfer's, when "
                           "vLLM runs in a later call); with --engines none only these are combined")
    moon.add_argument("--tiny", action="store_true", help="CPU dry run at toy size (checks the script)")
    moon.add_argument("--name", default="", help="results file name (default: moonlight_serving[_tiny])")
    args = parser.parse_args()
    if args.command == "warm":
        formats = tuple(args.formats.split(","))
        if set(formats) - set(FORMATS_OF_WARM):
            raise SystemExit(f"--formats: choose from {', '.join(FORMATS_OF_WARM)}")
        if not all(g.isdigit() and int(g) % 8 == 0 and int(g) > 0 for g in args.groups.split(",")):
            raise SystemExit(f"--groups {args.groups!r}: want a comma list of positive multiples of 8")
        warm_moe_modules(tuple(int(g) for g in args.groups.split(",")), formats=formats)
        return
    RESULTS.mkdir(exist_ok=True)
    if args.command == "kernels":  # a run of some sections only keeps the full run's file
        report, plot = run_kernels(args), plot_kernels
        name = "kimi_kernels" + (f"_{args.sections.replace(',', '_')}" if args.sections else "")
    elif args.command == "gemv":
        report, plot = run_gemv(args), plot_gemv
        name = args.name or "kimi_gemv" + ("" if args.sections == "dense,grouped" else f"_{args.sections.replace(',', '_')}")
    elif args.command == "experts":
        report, name, plot = run_experts(args), args.name, plot_experts
    elif args.command == "layer":
        report, name, plot = run_layer(args), args.name, plot_layer
    elif args.command == "moe":
        report, name, plot = run_moe(args), args.name, plot_moe
    else:
        report, plot = run_moonlight(args), plot_moonlight
        name = args.name or ("moonlight_serving_tiny" if args.tiny else "moonlight_serving")
    report["time"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    if out is not None:  # the measurements leave first: a failing plot must not lose them
        shutil.copy(RESULTS / f"{name}.json", out / f"{name}.json")
    plot(report, RESULTS / f"{name}.png")
    if out is not None and (RESULTS / f"{name}.png").exists():
        shutil.copy(RESULTS / f"{name}.png", out / f"{name}.png")


if __name__ == "__main__":
    main()
