"""MLA attention of the Moonlight-16B-A3B / DeepSeek-V3 shape (issue 13), kernel by kernel, JSON + PNG
into benchmarks/results/ (and $OUT).

``decode``: one layer's absorbed decode (16 heads, kv_lora 512 + rope 64, nope 128, v 128) at batch
1/16/64/256 x context 1k/4k over a paged cache of 16-token blocks (the engine's), each variant (an absorbed kernel, optionally its key tile and a cap on
the context splits) side by side in one process: the whole ``mla_forward`` as a CUDA-graph replay
(as the engine's decode steps run it) and each kernel's device time in step order (the ledger's
timer: ops behind a spin kernel, an event between each): mla_write_latent, W_UK (cuBLAS), the
attention kernel, the split combine, W_UV (cuBLAS); against the latent cache's bytes over the
measured copy bandwidth.

``prefill``: one sequence's 1k / 4k / 8k-token prompt in the decompressed form (mla_gather_context, kv_b
by cuBLAS into per-head keys and values, the causal attention) kernel by kernel with the attention's
TFLOP/s, at each head count of ``--prefill-heads`` (16: Moonlight, 64: Kimi-K2 on 2 GPUs' share), for
each attention kernel of ``--prefill-kernels`` (wgmma: mla_prefill_attention_sm90, Hopper, the default;
pipelined: mla_prefill_attention_pipelined; plain: mla_prefill_attention), and the absorbed form of the
whole forward beside it where it is short (``--prefill-absorbed``).

    python benchmarks/gpu_mla.py                          # both sections, default variants
    python benchmarks/gpu_mla.py decode --variants auto,mma,mma16,mma_shared,mma_shared:64
    python benchmarks/gpu_mla.py --dry-run                # the plan (points, variants, bytes, FLOPs); no GPU

A decode variant is
``kernel[:keys[:max_splits[:policy[:combine[:q_regs[:stages[:cluster[:balance[:barriers[:write_absorb[:rows[:expand]]]]]]]]]]]]``
then any core switches as ``+OPENINFER_NAME=VALUE`` (e.g. ``auto+OPENINFER_MLA_FUSED_WRITE=1``):
kernel ``auto``
(what ships) or one of core's ABSORBED_KERNELS; keys the mma_shared tile (32 / 64; empty: the default) or the tma
kernel's (16 / 32 / 64), stages the tma kernel's ring depth ($OPENINFER_MLA_TMA_TILE=KEYSxSTAGES), cluster its
largest cluster of splits combined on chip ($OPENINFER_MLA_TMA_CLUSTER: 2 / 4 / 8 / 16), balance 1 its splits balanced
over a ragged batch ($OPENINFER_MLA_TMA_BALANCE), barriers its block barriers per tile (1 / 2,
$OPENINFER_MLA_TMA_BARRIERS); write_absorb 1 the latent write and W_UK in one kernel for small steps (any
kernel, $OPENINFER_MLA_WRITE_ABSORB), rows 1 the tma kernel's whole-row TMA boxes ($OPENINFER_MLA_TMA_ROW_BOXES),
expand 1 W_UV by mla_expand_small at <= 64 rows (any kernel, $OPENINFER_MLA_EXPAND_SMALL); max_splits caps
the context splits ($OPENINFER_MLA_MAX_SPLITS); policy mma_shared's split count (resident / waves,
$OPENINFER_MLA_SHARED_SPLITS); combine the split combine (shared / loop / wide / flat, $OPENINFER_MLA_COMBINE);
q_regs 1: mma_shared's query fragments in registers ($OPENINFER_MLA_SHARED_Q_REGS).
Each variant's output is compared to the first's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results"

HEADS, NOPE, ROPE, V_DIM, KV_LORA = 16, 128, 64, 128, 512  # Moonlight-16B-A3B
LATENT_BYTES = (KV_LORA + ROPE) * 2
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096)
PREFILL_TOKENS = (1024, 4096, 8192)
PREFILL_HEADS = (16, 64)
ABSORBED_PREFILL_MAX = 2048
BLOCK_SIZE = 16  # the engine's KV block (EngineOptions.block_size)  # the absorbed form of a prompt is timed up to this many tokens
DEFAULT_VARIANTS = "auto,mma,mma16,mma_shared,mma_shared:64,mma_shared:32:16"
# core's ABSORBED_KERNELS and SHARED_KEYS_CHOICES (openinfer.backend.cuda.mla needs CuPy: a dry run checks
# names against these copies, a GPU run that they still match core's)
KERNELS = ("cuda_cores", "mma", "mma16", "mma_shared", "tma")
SHARED_KEYS = (32, 64)
TMA_KEYS = (16, 32, 64)  # core's mla_decode_sm90.TMA_KEY_CHOICES
SPLIT_POLICIES = ("resident", "waves")  # core's resident_splits
COMBINES = ("loop", "shared", "wide", "flat")  # core's COMBINE_KERNELS
PREFILL_KERNELS = ("plain", "pipelined", "wgmma")  # core's PREFILL_KERNELS
SM90_KEYS = ("128", "64")  # core's SM90_PREFILL_STAGES keys


def parse_variants(text: str) -> list[dict]:
    """``kernel[:keys[:max_splits[:policy[:combine[:q_regs[:stages[:cluster[:balance[:barriers[:write_absorb[:rows
    [:expand]]]]]]]]]]]]`` comma list → dicts; bad names exit 2 (argparse)."""
    variants = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        # any core switch after the fields: kernel[:...]+OPENINFER_X=V+OPENINFER_Y=W
        item_fields, *switches = item.split("+")
        extra = {}
        for switch in switches:
            key, sep, value = switch.partition("=")
            if not sep or not key.startswith("OPENINFER_"):
                raise ValueError(f"variant {item!r}: a switch is +OPENINFER_NAME=VALUE, got {switch!r}")
            extra[key] = value
        fields = item_fields.split(":")
        if len(fields) > 13:
            raise ValueError(f"variant {item!r}: kernel[:keys[:max_splits[:policy[:combine[:q_regs[:stages[:cluster"
                             "[:balance[:barriers[:write_absorb[:rows[:expand]]]]]]]]]]]]")
        (kernel, keys, splits, policy, combine, q_regs, stages, cluster, balance, barriers, write_absorb, rows,
         expand) = (fields + [""] * 12)[:13]
        if kernel not in ("auto", *KERNELS):
            raise ValueError(f"variant {item!r}: kernel is auto or one of {', '.join(KERNELS)}")
        key_choices = TMA_KEYS if kernel == "tma" else SHARED_KEYS
        if keys and (not keys.isdigit() or int(keys) not in key_choices):
            raise ValueError(f"variant {item!r}: keys is one of {key_choices}")
        if stages and (kernel != "tma" or not stages.isdigit() or int(stages) < 1):
            raise ValueError(f"variant {item!r}: stages (a positive integer) is the tma kernel's only")
        if cluster and (kernel != "tma" or cluster not in ("0", "2", "4", "8", "16")):
            raise ValueError(f"variant {item!r}: cluster (0, 2, 4, 8 or 16) is the tma kernel's only")
        if balance and (kernel != "tma" or balance not in ("0", "1")):
            raise ValueError(f"variant {item!r}: balance (0 or 1) is the tma kernel's only")
        if barriers and (kernel != "tma" or barriers not in ("1", "2")):
            raise ValueError(f"variant {item!r}: barriers (1 or 2) is the tma kernel's only")
        if write_absorb not in ("", "0", "1"):
            raise ValueError(f"variant {item!r}: write_absorb is 0 or 1")
        if rows and (kernel != "tma" or rows not in ("0", "1")):
            raise ValueError(f"variant {item!r}: rows (0 or 1) is the tma kernel's only")
        if expand not in ("", "0", "1"):
            raise ValueError(f"variant {item!r}: expand is 0 or 1")
        if splits and (not splits.isdigit() or int(splits) < 1):
            raise ValueError(f"variant {item!r}: max_splits is a positive integer")
        if policy and policy not in SPLIT_POLICIES:
            raise ValueError(f"variant {item!r}: policy is one of {', '.join(SPLIT_POLICIES)}")
        if combine and combine not in COMBINES:
            raise ValueError(f"variant {item!r}: combine is one of {', '.join(COMBINES)}")
        if q_regs not in ("", "0", "1"):
            raise ValueError(f"variant {item!r}: q_regs is 0 or 1")
        variants.append({"name": item, "kernel": kernel, "keys": keys, "max_splits": splits, "policy": policy,
                         "combine": combine, "q_regs": q_regs, "stages": stages, "cluster": cluster,
                         "balance": balance, "barriers": barriers, "write_absorb": write_absorb,
                         "rows": rows, "expand": expand, "switches": extra})
    if not variants:
        raise ValueError("no variants")
    return variants


@contextlib.contextmanager
def variant_env(variant: dict):
    """Core's switches for one variant (restored after)."""
    from gpu_kimi import switched_env

    with switched_env(variant_switches(variant)):
        yield


def variant_switches(variant: dict) -> dict[str, str]:
    """Core's environment switches for one variant (empty: core's default)."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90

    return {cuda_mla.SHARED_KEYS_ENV: "" if variant["kernel"] == "tma" else variant["keys"],
                mla_decode_sm90.TMA_TILE_ENV: tma_tile_text(variant), mla_decode_sm90.TMA_CLUSTER_ENV: variant["cluster"],
                mla_decode_sm90.TMA_BALANCE_ENV: variant["balance"], mla_decode_sm90.TMA_BARRIERS_ENV: variant["barriers"],
                cuda_mla.WRITE_ABSORB_ENV: variant["write_absorb"], mla_decode_sm90.TMA_ROW_BOXES_ENV: variant["rows"],
                cuda_mla.EXPAND_SMALL_ENV: variant["expand"],
                cuda_mla.MAX_SPLITS_ENV: variant["max_splits"],
                cuda_mla.SHARED_SPLITS_ENV: variant["policy"], cuda_mla.COMBINE_ENV: variant["combine"],
                cuda_mla.SHARED_Q_REGS_ENV: variant["q_regs"], **variant.get("switches", {})}


def tma_tile_text(variant: dict) -> str:
    """$OPENINFER_MLA_TMA_TILE for a tma variant that names its keys or stages (empty: core's default)."""
    if variant["kernel"] != "tma" or not (variant["keys"] or variant["stages"]):
        return ""
    return f"{variant['keys'] or 32}x{variant['stages'] or 2}"


def decode_contexts(batch: int, context: int, ragged: bool) -> np.ndarray:
    """Each request's cached context: ``context`` for all, or (ragged) spread evenly over [c/8, 2c - c/8]
    (mean c; one request keeps c) in a fixed shuffled order."""
    if not ragged or batch == 1:
        return np.full(batch, context, np.int64)
    spread = np.linspace(context / 8, 2 * context - context / 8, batch).round().astype(np.int64)
    return np.random.default_rng(batch).permutation(spread)


def decode_bytes(batch: int, context: int, ragged: bool = False) -> int:
    """The latent bytes a decode step reads: every request's context and its new token."""
    return int((decode_contexts(batch, context, ragged) + 1).sum()) * LATENT_BYTES


def ragged_decode_batch(backend, contexts: np.ndarray, block_size: int):
    """A decode step of one new token per request over its own cached context (gpu_kimi.decode_batch's layout:
    each request's blocks in order after the previous one's), and the cache's block count."""
    from openinfer.backend.base import ForwardBatch

    blocks = -(-(contexts + 1) // block_size)
    tables = np.zeros((len(contexts), int(blocks.max())), np.int32)
    first = 1 + np.concatenate([[0], np.cumsum(blocks)[:-1]])
    for row, (start, count) in enumerate(zip(first, blocks, strict=True)):
        tables[row, :count] = np.arange(start, start + count)
    positions = contexts.astype(np.int32)
    slots = tables[np.arange(len(contexts)), positions // block_size] * block_size + positions % block_size
    host = ForwardBatch(token_ids=np.zeros(len(contexts), np.int32), positions=positions,
                        query_start=np.arange(len(contexts) + 1, dtype=np.int32),
                        context_lens=(positions + 1).astype(np.int32), block_tables=tables,
                        slot_mapping=slots.astype(np.int32), logits_rows=np.arange(len(contexts), dtype=np.int32),
                        max_query_len=1, max_context_len=int(positions.max()) + 1)
    return backend.prepare_batch(host), int(blocks.sum()) + 1


def prefill_flops(tokens: int, heads: int = HEADS) -> float:
    """Causal attention FLOPs of one prompt: QK (nope + rope) and PV per visible (query, key) pair."""
    return 2.0 * heads * (NOPE + ROPE + V_DIM) * tokens * (tokens + 1) / 2


def plan(args) -> dict:
    variants = parse_variants(args.variants)
    return {"decode_heads": args.decode_heads, "ragged": args.ragged,
            "decode": [{"batch": b, "context": c, "cache_bytes": decode_bytes(b, c, args.ragged)}
                       for b in args.batches for c in args.contexts] if "decode" in args.sections else [],
            "prefill": [{"heads": h, "tokens": n, "attention_gflop": prefill_flops(n, h) / 1e9}
                        for h in args.prefill_heads for n in args.prefill]
            if "prefill" in args.sections else [], "prefill_kernels": args.prefill_kernels,
            "variants": variants}


def mla_inputs(backend, rng, heads: int = HEADS):
    import cupy

    from openinfer.mla import MLASpec
    from openinfer.rope import RopeParameters, RotaryEmbedding

    spec = MLASpec(heads, NOPE, ROPE, V_DIM, KV_LORA, (NOPE + ROPE) ** -0.5)
    w_uk = backend.weight((0.05 * rng.standard_normal((heads, NOPE, KV_LORA))).astype(np.float32))
    w_uv = backend.weight((0.05 * rng.standard_normal((heads, V_DIM, KV_LORA))).astype(np.float32))
    norm = backend.weight(np.ones(KV_LORA, np.float32))
    rope = RotaryEmbedding.create(ROPE, RopeParameters(50000.0), 16384)
    return spec, w_uk, w_uv, norm, cupy.asarray(rope.cos), cupy.asarray(rope.sin)


def bench_decode(backend, rng, args, variants: list[dict], bandwidth: float) -> list[dict]:
    from gpu_kimi import decode_batch, device_random_bf16, graph_call_seconds, layer_breakdown

    from openinfer.backend.cuda import mla as cuda_mla

    heads = args.decode_heads
    spec, w_uk, w_uv, norm, cos, sin = mla_inputs(backend, rng, heads)
    points = []
    for batch_size in args.batches:
        for context in args.contexts:
            if args.ragged:
                batch, num_blocks = ragged_decode_batch(backend, decode_contexts(batch_size, context, True),
                                                        BLOCK_SIZE)
            else:
                batch, num_blocks = decode_batch(backend, batch_size, context, BLOCK_SIZE)
            cache = device_random_bf16((num_blocks, BLOCK_SIZE, 1, spec.latent_dim))
            q = backend.upload(rng.standard_normal((batch_size, heads * spec.qk_head_dim)).astype(np.float32))
            latent = backend.upload(rng.standard_normal((batch_size, spec.latent_dim)).astype(np.float32))
            point = {"batch": batch_size, "context": context,
                     "cache_roofline_ms": 1e3 * decode_bytes(batch_size, context, args.ragged) / bandwidth,
                     "variants": {}}
            reference = None
            for variant in variants:
                kernel = None if variant["kernel"] == "auto" else variant["kernel"]
                with variant_env(variant):
                    forward = partial(cuda_mla.mla_forward, backend.blas, q.copy(), latent, cache, w_uk, w_uv, norm,
                                      spec, batch, cos, sin, 1e-6, backend.num_sms, prefill_min_query=10**9,
                                      absorbed_kernel=kernel)
                    out = backend.to_host(forward())
                    seconds, graph_error = graph_call_seconds([forward])
                    q_rot = q.copy()
                    cuda_mla.write_latent(q_rot, latent, cache, norm, spec, batch, cos, sin, 1e-6)
                    q_latent = cuda_mla.absorb_queries(backend.blas, q_rot, w_uk, spec)
                    o_latent, partials = cuda_mla.attend_splits(q_latent, q_rot, cache, spec, batch, None,
                                                                backend.num_sms, kernel)
                    if cuda_mla.write_absorb_fits(batch_size, spec):  # one launch for both
                        parts = [("mla_write_absorb", partial(cuda_mla.write_latent_absorb, q.copy(), latent, cache,
                                                              norm, w_uk, spec, batch, cos, sin, 1e-6))]
                    else:
                        parts = [("mla_write_latent", partial(cuda_mla.write_latent, q.copy(), latent, cache, norm,
                                                              spec, batch, cos, sin, 1e-6)),
                                 ("w_uk", partial(cuda_mla.absorb_queries, backend.blas, q_rot, w_uk, spec))]
                    parts += [("attention", partial(cuda_mla.attend_splits, q_latent, q_rot, cache, spec, batch, None,
                                                   backend.num_sms, kernel))]
                    if partials is not None:
                        parts.append(("combine", partial(cuda_mla.combine_splits, partials, o_latent, spec)))
                    parts.append(("w_uv", partial(cuda_mla.expand_values, backend.blas, o_latent, w_uv, spec,
                                                  cupy_empty_like_out(batch_size, heads))))
                    breakdown = layer_breakdown(parts, forward, args.iters)
                    ran = cuda_mla.choose_absorbed_kernel(heads, batch_size, kernel)
                    splits = partials.splits if partials is not None else 1
                entry = {"forward_ms": 1e3 * seconds, "kernel_run": ran, "splits": splits,
                         "breakdown_ms": breakdown["breakdown_ms"],
                         "attention_share_of_roofline": point["cache_roofline_ms"]
                         / max(breakdown["breakdown_ms"]["attention"], 1e-9)}
                if variant["kernel"] == "tma":
                    entry["tma_tile"] = tma_tile_text(variant) or "default"
                if graph_error:
                    entry["graph_error"] = graph_error
                if reference is None:
                    reference = out
                else:
                    entry["relative_difference"] = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
                point["variants"][variant["name"]] = entry
            first = point["variants"][variants[0]["name"]]["forward_ms"]
            for entry in point["variants"].values():
                entry["speedup_vs_first"] = first / entry["forward_ms"]
            points.append(point)
            print(json.dumps(point), flush=True)
            del cache
    return points


def cupy_empty_like_out(rows: int, heads: int = HEADS):
    import cupy

    return cupy.empty((rows, heads * V_DIM), dtype=cupy.uint16)


def parse_prefill_kernels(text: str) -> list[dict]:
    """``kernel[:keys[:pingpong[:split_kv[:tma[:ordered]]]]]`` comma list → dicts (the wgmma kernel's keys per
    tile, turn-taking, split K / V barriers, TMA K / V loads and ordered softmax, $OPENINFER_MLA_SM90_KEYS /
    _PINGPONG / _SPLIT_KV / _TMA / _ORDERED; empty: core's defaults); bad names raise ValueError."""
    kernels = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        if len(fields) > 6:
            raise ValueError(f"prefill kernel {item!r}: kernel[:keys[:pingpong[:split_kv[:tma[:ordered]]]]]")
        kernel, keys, pingpong, split_kv, tma, ordered = (fields + ["", "", "", "", ""])[:6]
        if kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill kernel {item!r}: kernel is one of {', '.join(PREFILL_KERNELS)}")
        if keys and keys not in SM90_KEYS:
            raise ValueError(f"prefill kernel {item!r}: keys is one of {', '.join(SM90_KEYS)}")
        if {pingpong, split_kv, tma, ordered} - {"", "0", "1"}:
            raise ValueError(f"prefill kernel {item!r}: pingpong, split_kv, tma and ordered are 0 or 1")
        kernels.append({"name": item, "kernel": kernel, "keys": keys, "pingpong": pingpong, "split_kv": split_kv,
                        "tma": tma, "ordered": ordered})
    if not kernels:
        raise ValueError("no prefill kernels")
    return kernels


@contextlib.contextmanager
def prefill_env(variant: dict):
    from gpu_kimi import switched_env

    from openinfer.backend.cuda import mla as cuda_mla

    with switched_env({cuda_mla.PREFILL_KERNEL_ENV: variant["kernel"], cuda_mla.SM90_KEYS_ENV: variant["keys"],
                       cuda_mla.SM90_PINGPONG_ENV: variant["pingpong"],
                       cuda_mla.SM90_SPLIT_KV_ENV: variant["split_kv"], cuda_mla.SM90_TMA_ENV: variant["tma"],
                       cuda_mla.SM90_ORDERED_ENV: variant["ordered"]}):
        yield


def bench_prefill(backend, rng, args, variants: list[dict]) -> list[dict]:
    from gpu_kimi import layer_breakdown, one_sequence_batch

    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.tools.ledger import gpu_seconds

    points = []
    for heads, tokens in [(h, n) for h in args.prefill_heads for n in args.prefill]:
        spec, w_uk, w_uv, norm, cos, sin = mla_inputs(backend, rng, heads)
        batch, num_blocks = one_sequence_batch(backend, 0, tokens, BLOCK_SIZE)
        cache = backend.upload(rng.standard_normal((num_blocks, BLOCK_SIZE, 1, spec.latent_dim)).astype(np.float32))
        q = backend.upload(rng.standard_normal((tokens, heads * spec.qk_head_dim)).astype(np.float32))
        latent = backend.upload(rng.standard_normal((tokens, spec.latent_dim)).astype(np.float32))
        forward = partial(cuda_mla.mla_forward, backend.blas, q.copy(), latent, cache, w_uk, w_uv, norm, spec, batch,
                          cos, sin, 1e-6, backend.num_sms, prefill_min_query=cuda_mla.PREFILL_MIN_QUERY)
        point = {"heads": heads, "tokens": tokens, "kernels": {}, "absorbed": {}}
        reference = None
        for prefill_variant in args.prefill_kernels:
            name = prefill_variant["name"]
            with prefill_env(prefill_variant):  # the plan is laid out for the kernel (its tile size)
                plan_ = cuda_mla.plan_prefill(batch.host, spec)
                q_rot = q.copy()
                cuda_mla.write_latent(q_rot, latent, cache, norm, spec, batch, cos, sin, 1e-6)
                c_kv, k_pe = cuda_mla.gather_context(cache, spec, batch, plan_)
                k_nope, values = cuda_mla.expand_context(backend.blas, c_kv, w_uk, w_uv, spec)
                parts = [("mla_write_latent", partial(cuda_mla.write_latent, q.copy(), latent, cache, norm, spec,
                                                      batch, cos, sin, 1e-6)),
                         ("mla_gather_context", partial(cuda_mla.gather_context, cache, spec, batch, plan_)),
                         ("kv_b", partial(cuda_mla.expand_context, backend.blas, c_kv, w_uk, w_uv, spec)),
                         ("attention", partial(cuda_mla.prefill_attention, q_rot, k_nope, k_pe, values, spec, plan_,
                                               cupy_empty_like_out(tokens, heads)))]
                # the output from unrotated queries (mla_forward rotates its q's rope dims in place)
                out = backend.to_host(cuda_mla.mla_forward(backend.blas, q.copy(), latent, cache, w_uk, w_uv, norm,
                                                           spec, batch, cos, sin, 1e-6, backend.num_sms))
                breakdown = layer_breakdown(parts, forward, args.iters)["breakdown_ms"]
                entry = {"forward_ms": 1e3 * gpu_seconds(forward, repeats=args.iters), "breakdown_ms": breakdown,
                         "attention_tflops": prefill_flops(tokens, heads) / breakdown["attention"] / 1e9,
                         "plan_kernel": plan_.kernel}
            if reference is None:
                reference = out
            else:
                entry["relative_difference"] = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
                first = point["kernels"][args.prefill_kernels[0]["name"]]
                entry["attention_speedup_vs_first"] = first["breakdown_ms"]["attention"] / breakdown["attention"]
            point["kernels"][name] = entry
        if args.prefill_absorbed and tokens <= ABSORBED_PREFILL_MAX:
            for variant in variants:
                kernel = None if variant["kernel"] == "auto" else variant["kernel"]
                with variant_env(variant):
                    absorbed = partial(cuda_mla.mla_forward, backend.blas, q.copy(), latent, cache, w_uk, w_uv, norm,
                                       spec, batch, cos, sin, 1e-6, backend.num_sms, prefill_min_query=10**9,
                                       absorbed_kernel=kernel)
                    absorbed_out = backend.to_host(absorbed())
                    point["absorbed"][variant["name"]] = {
                        "ms": 1e3 * gpu_seconds(absorbed, repeats=args.iters),
                        "relative_difference": float(np.linalg.norm(absorbed_out - reference)
                                                     / np.linalg.norm(reference))}
        points.append(point)
        print(json.dumps(point), flush=True)
    return points


def warm(backend, rng, variants: list[dict] | None = None) -> int:
    """Compile every MLA kernel module the decode / prefill variants (and core's other switches:
    async tiles, combine) can launch, in parallel NVRTC threads into CuPy's disk cache: dry steps
    (a 100-token chunk on 60 cached, decompressed and absorbed) under core's discover_kernels record them.
    ``variants``: only what these decode variants launch (a decode-only run)."""
    import cupy
    from gpu_kimi import one_sequence_batch, switched_env

    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda.loader import compile_kernels, discover_kernels

    spec, w_uk, w_uv, norm, cos, sin = mla_inputs(backend, rng)
    batch, num_blocks = one_sequence_batch(backend, 60, 100, BLOCK_SIZE)
    cache = cupy.zeros((num_blocks, BLOCK_SIZE, 1, spec.latent_dim), dtype=cupy.uint16)
    q = cupy.zeros((100, HEADS * spec.qk_head_dim), dtype=cupy.uint16)
    latent = cupy.zeros((100, spec.latent_dim), dtype=cupy.uint16)
    started = time.perf_counter()
    settings = [{cuda_mla.ASYNC_TILES_ENV: a, cuda_mla.COMBINE_ENV: c, cuda_mla.SHARED_KEYS_ENV: str(k),
                 cuda_mla.PREFILL_KERNEL_ENV: p, cuda_mla.HEADS16_ENV: h, cuda_mla.SHARED_Q_REGS_ENV: qr}
                for a in ("0", "1") for c in cuda_mla.COMBINE_KERNELS for k in SHARED_KEYS for p in PREFILL_KERNELS
                for h in ("0", "1") for qr in ("0", "1")]
    settings += [{cuda_mla.PREFILL_KERNEL_ENV: "wgmma", cuda_mla.SM90_KEYS_ENV: k, cuda_mla.SM90_PINGPONG_ENV: pp,
                  cuda_mla.SM90_SPLIT_KV_ENV: sk, cuda_mla.SM90_TMA_ENV: tma, cuda_mla.SM90_ORDERED_ENV: o}
                 for k in SM90_KEYS for pp in ("0", "1") for sk in ("0", "1")
                 for tma in ("0", "1") for o in ("0", "1")]  # the wgmma kernel's variants
    kernels_of = {}  # setting index -> the absorbed kernels to run under it
    if variants is not None:
        settings = [variant_switches(v) for v in variants]
        kernels_of = {i: [None if v["kernel"] == "auto" else v["kernel"]] for i, v in enumerate(variants)}
    with discover_kernels() as found:
        for i, setting in enumerate(settings):
            with switched_env(setting):
                for kernel in kernels_of.get(i, KERNELS):
                    for min_query in (16, 10**9):  # decompressed beside absorbed rows; all absorbed
                        cuda_mla.mla_forward(backend.blas, q.copy(), latent, cache, w_uk, w_uv, norm, spec, batch,
                                             cos, sin, 1e-6, backend.num_sms, prefill_min_query=min_query,
                                             absorbed_kernel=kernel)
    built = compile_kernels(found, cupy.cuda.Device().id, threads=16)
    print(f"compiled {built} MLA modules in {time.perf_counter() - started:.1f} s", flush=True)
    return built


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode, prefill = report.get("decode", []), report.get("prefill", [])
    panels = (1 if decode else 0) + (1 if prefill else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(8 * panels, 5), squeeze=False)
    ax = axes[0][0]
    if decode:
        names = list(decode[0]["variants"])
        x = np.arange(len(decode))
        width = 0.8 / (len(names) + 1)
        for i, name in enumerate(names):
            ax.bar(x + i * width, [p["variants"][name]["breakdown_ms"]["attention"] for p in decode], width,
                   label=f"attention kernel, {name}")
        ax.bar(x + len(names) * width, [p["cache_roofline_ms"] for p in decode], width, color="k",
               label="latent bytes / copy rate")
        ax.set(xticks=x + 0.4, yscale="log", ylabel="ms per layer",
               title=f"MLA decode, {report['plan']['decode_heads']} heads ({report.get('device', '')})")
        ax.set_xticklabels([f"b{p['batch']} c{p['context']}" for p in decode], rotation=30)
        ax.legend(fontsize=7)
    if prefill:
        ax = axes[0][panels - 1]
        kernels = list(prefill[0]["kernels"])
        bars = [(p, k) for p in prefill for k in kernels]
        parts = list(prefill[0]["kernels"][kernels[0]]["breakdown_ms"])
        bottom = np.zeros(len(bars))
        for part in parts:
            values = np.array([p["kernels"][k]["breakdown_ms"][part] for p, k in bars])
            ax.bar(range(len(bars)), values, bottom=bottom, label=part)
            bottom += values
        ax.set(xticks=range(len(bars)), ylabel="ms per layer", title="MLA prefill, decompressed form")
        ax.set_xticklabels([f"{p['heads']}h {p['tokens']} {k}\n{p['kernels'][k]['attention_tflops']:.0f} TFLOP/s"
                            for p, k in bars], fontsize=6, rotation=30)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", default=["decode", "prefill"],
                        help="decode and/or prefill; warm: compile the MLA kernel modules only (CuPy's disk cache)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="comma list of kernel[:keys[:max_splits[:policy[:combine[:q_regs[:stages[:cluster"
                             "[:balance[:barriers[:write_absorb[:rows[:expand]]]]]]]]]]]]")
    parser.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)))
    parser.add_argument("--ragged", action="store_true",
                        help="decode: contexts spread evenly over [c/8, 2c - c/8] (mean c) instead of all c")
    parser.add_argument("--decode-heads", type=int, default=HEADS,
                        help="decode's heads per GPU (16: Moonlight; 64: Kimi-K2 / DeepSeek-V3 on 2 GPUs)")
    parser.add_argument("--contexts", default=",".join(map(str, DECODE_CONTEXTS)))
    parser.add_argument("--prefill", default=",".join(map(str, PREFILL_TOKENS)), help="prompt lengths")
    parser.add_argument("--prefill-heads", default=",".join(map(str, PREFILL_HEADS)), help="head counts")
    parser.add_argument("--prefill-absorbed", action="store_true",
                        help="also time the absorbed form of prompts up to 2k tokens (each decode variant)")
    parser.add_argument("--prefill-kernels", default="pipelined,wgmma",
                        help="comma list of kernel[:keys[:pingpong[:split_kv[:tma[:ordered]]]]], the decompressed "
                             "attention kernels ($OPENINFER_MLA_PREFILL; wgmma's keys per tile 128 / 64, turn-taking, "
                             "split K / V barriers, TMA K / V loads and ordered softmax 0 / 1)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--name", default="gpu_mla", help="results file name")
    parser.add_argument("--dry-run", action="store_true", help="print the plan as JSON; no GPU")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same as --dry-run")
    args = parser.parse_args()
    try:
        if set(args.sections) - {"decode", "prefill", "warm"}:
            raise ValueError(f"sections are decode, prefill and warm, got {args.sections}")
        args.batches = [int(v) for v in args.batches.split(",") if v]
        args.contexts = [int(v) for v in args.contexts.split(",") if v]
        args.prefill = [int(v) for v in args.prefill.split(",") if v]
        args.prefill_heads = [int(v) for v in args.prefill_heads.split(",") if v]
        args.prefill_kernels = parse_prefill_kernels(args.prefill_kernels)
        if min(args.batches + args.contexts + args.prefill + args.prefill_heads + [args.iters, args.decode_heads],
               default=1) < 1:
            raise ValueError("batches, contexts, prompt lengths, head counts and --iters are positive")
        report = {"plan": plan(args)}
    except ValueError as error:
        parser.error(str(error))
    if args.dry_run or args.device == "cpu":
        print(json.dumps(report, indent=1))
        return
    from gpu_kimi import copy_bandwidth, device_name

    from openinfer.backend.cuda import CudaBackend
    from openinfer.backend.cuda import mla as cuda_mla

    if (tuple(cuda_mla.ABSORBED_KERNELS), tuple(cuda_mla.SHARED_KEYS_CHOICES), tuple(cuda_mla.PREFILL_KERNELS),
            tuple(cuda_mla.COMBINE_KERNELS), tuple(map(str, cuda_mla.SM90_PREFILL_STAGES))) != (
            KERNELS, SHARED_KEYS, PREFILL_KERNELS, COMBINES, SM90_KEYS):
        raise SystemExit("gpu_mla.py's KERNELS / SHARED_KEYS / PREFILL_KERNELS / COMBINES / SM90_KEYS no longer "
                         "match core's")
    backend = CudaBackend()
    rng = np.random.default_rng(0)
    if "warm" in args.sections:
        warm(backend, rng)
        return
    # every variant's kernels built up front in parallel threads (the sm_90a cubins have no disk cache)
    report["warm_modules"] = warm(backend, rng, report["plan"]["variants"] if args.sections == ["decode"] else None)
    bandwidth = copy_bandwidth()
    variants = report["plan"]["variants"]
    report.update({"device": device_name(), "copy_bandwidth_gbs": bandwidth / 1e9, "num_sms": backend.num_sms})
    print(json.dumps({k: report[k] for k in ("device", "copy_bandwidth_gbs")}), flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    path = RESULTS / f"{args.name}.json"

    def save() -> None:  # after each section: a later failure keeps what was measured
        report["time"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        path.write_text(json.dumps(report, indent=2))
        if out is not None:
            shutil.copy(path, out / path.name)

    for section in dict.fromkeys(args.sections):  # in the order given
        if section == "decode":
            report["decode"] = bench_decode(backend, rng, args, variants, bandwidth)
        else:
            report["prefill"] = bench_prefill(backend, rng, args, variants)
        save()
    plot(report, RESULTS / f"{args.name}.png")
    if out is not None and (RESULTS / f"{args.name}.png").exists():
        shutil.copy(RESULTS / f"{args.name}.png", out / f"{args.name}.png")


if __name__ == "__main__":
    main()
