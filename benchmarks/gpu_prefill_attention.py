"""GPU benchmark: causal prefill attention over the paged KV cache, Qwen3-4B shape (32 query heads,
8 KV heads, head_dim 128, 16-token blocks), through openinfer's public prefill entry point.

  attention  TFLOP/s (causal FLOPs: 4 d per visible query-key pair and head) of the mma.sync kernel
             ("mma", any GPU) and the Hopper wgmma kernel ("sm90") on one 1k / 4k / 16k prompt, a
             4k chunk on a 12k cached prefix and 8 prompts of 2k; torch's scaled_dot_product_attention
             (flash backend, and cuDNN where it runs) on contiguous tensors of the same sizes is the
             external reference on the same GPU; the relative difference sm90 vs mma is recorded too;
  model      time to first token of a Qwen3-4B-shaped model (random weights, benchmarks/gpu_bench.py's
             builder) on 1k / 4k / 16k prompts with OPENINFER_PREFILL_KERNEL=mma (before) and auto (after).
Writes benchmarks/results/gpu_prefill_attention.json and .png (and copies under $OUT when set).

  --sm90-variants  instead: TFLOP/s of run-time variants of the sm90 kernel (OPENINFER_SM90_*:
             intra-warpgroup overlap, K/V loads by TMA page boxes (or shared by CTA pairs) or cp.async,
             persistent CTAs, the session-6 barrier / rescale refinements, session 7's consumer-loop
             refinements and head pairs; plus a no-K/V-load timing diagnostic) on the same cases and
             8 prompts of 1k, --rounds interleaved rounds (2 by default; best median kept), device
             time per call (calls queued behind a spin kernel: a 1k prompt's kernel is shorter than
             the host's launch path), each output compared with the default's, torch SDPA alongside;
             writes gpu_prefill_attention_variants.json.

  --short-queries  instead: steps of a few new tokens over a long cached context (a warm prefix's
             last block): the prefill kernel (auto) against the split-KV short-query kernel, time and
             KV read rate as a fraction of the copy bandwidth, outputs compared; then the whole
             Qwen3-4B-shaped model's step for 16 new tokens over a 16k cached prefix (eager, as the
             engine runs it) with OPENINFER_SHORT_QUERY_ATTENTION off and on, next to a 1-token
             step over the same context (the decode kernel) and its graph replay; writes
             gpu_prefill_attention_short.json. A 1-new-token row compares with the decode kernel
             (where attention() sends one new token per sequence), not the prefill kernel.

  --routing  instead: attention() routings, per layer. Mixed steps (running decodes + a prompt
             chunk in one forward): the whole step on the prefill kernel (before) against the
             decode rows on the decode kernel and the chunk's tiles on the prefill kernel
             (OPENINFER_MIXED_DECODE_ATTENTION=1), outputs compared; and the short-query kernel
             against the prefill kernel around their crossover (16 new tokens over 1k-4k) with
             the "auto" routing's pick; writes gpu_prefill_attention_routing.json and .png.

    python benchmarks/gpu_prefill_attention.py [--no-model | --sm90-variants | --short-queries | --routing]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench  # noqa: E402  (the Qwen3-4B builder and ceilings of the TTFT part)
from gpu_bench import environment, log  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
LENGTHS = (1024, 4096, 16384)
# --qwen35: Qwen3.5's gated full-attention layers (16 query / 4 KV heads, head_dim 256); --sm90-variants then
# times a 64-stream burst's mixed-step prompts (8 x 1008) and single 4k / 16k prompts
QWEN35_SHAPE = (16, 4, 256)
QWEN35_CASES = [("8 prompts of 1008", [0] * 8, [1008] * 8), ("prompt 4096", [0], [4096]), ("prompt 16384", [0], [16384])]


def random_bf16(shape: tuple[int, ...]):
    import cupy

    return (cupy.random.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)


CONTIGUOUS_BLOCKS = False  # --contiguous-blocks: each sequence's blocks in order, as a fresh block pool hands them out


def paged_case(cached: list[int], new: list[int]):
    """A ForwardBatch over shuffled blocks (consecutive ones with CONTIGUOUS_BLOCKS) plus random q
    and a random K/V cache for it."""
    from openinfer.backend.base import ForwardBatch, KVLayer

    rng = np.random.default_rng(sum(new))
    lengths = [c + n for c, n in zip(cached, new, strict=True)]
    blocks = [-(-length // BLOCK_SIZE) for length in lengths]
    order = np.arange(sum(blocks)) + 1 if CONTIGUOUS_BLOCKS else rng.permutation(sum(blocks)) + 1
    tables = np.zeros((len(lengths), max(blocks)), np.int32)
    start = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = order[start:start + count]
        start += count
    batch = ForwardBatch.over_blocks(tables, cached, new, BLOCK_SIZE)
    shape = (sum(blocks) + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv = KVLayer(random_bf16(shape), random_bf16(shape))
    q = random_bf16((int(sum(new)), NUM_HEADS, HEAD_DIM))
    flops = sum(4 * HEAD_DIM * NUM_HEADS * (n * c + n * (n + 1) // 2) for c, n in zip(cached, new, strict=True))
    return batch, kv, q, flops


def torch_sdpa_seconds(cached: list[int], new: list[int], backend_name: str) -> float | None:
    """Median seconds of torch SDPA (causal, contiguous, GQA expanded) on the same shapes; prompts
    with a cached prefix use the bottom-right causal mask."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    calls = []
    for c, n in zip(cached, new, strict=True):
        q = torch.randn(1, NUM_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, NUM_HEADS, c + n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        calls.append((q, k, v, causal_lower_right(n, c + n) if c else None))

    def run():
        for q, k, v, mask in calls:
            if mask is None:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    try:
        with sdpa_kernel(backend):
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            times = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
    except Exception as error:  # noqa: BLE001 - a backend that does not run these shapes is reported, not fatal
        log(f"torch sdpa {backend_name} unavailable: {str(error).splitlines()[0]}")
        return None
    return float(np.median(times))


def bench_attention(backend, mma_only: bool) -> list[dict]:
    import cupy

    from openinfer.backend.base import AttentionSpec
    from openinfer.backend.cuda.attention import prefill_attention, sm90_prefill_supported
    from openinfer.tools.ledger import gpu_seconds

    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, None, HEAD_DIM**-0.5, None, None, 1e-6)
    cases = [(f"prompt {n}", [0], [n]) for n in LENGTHS]
    cases += [("chunk 4096 on 12288 cached", [12288], [4096]), ("8 prompts of 2048", [0] * 8, [2048] * 8)]
    implementations = ["mma", "sm90"] if sm90_prefill_supported(HEAD_DIM) and not mma_only else ["mma"]
    rows = []
    for name, cached, new in cases:
        batch, kv, q, flops = paged_case(cached, new)
        device_batch = backend.prepare_batch(batch)
        row: dict = {"case": name, "cached": cached, "new": new, "flops": flops}
        outputs = {}
        for implementation in implementations:
            out = cupy.empty((batch.num_tokens, NUM_HEADS * HEAD_DIM), cupy.uint16)
            call = functools.partial(prefill_attention, q, spec, kv, device_batch, implementation=implementation,
                                     out=out)
            seconds = gpu_seconds(call, repeats=10 if flops < 1e13 else 5, warmup=2)
            row[f"{implementation}_ms"] = seconds * 1e3
            row[f"{implementation}_tflops"] = flops / seconds / 1e12
            outputs[implementation] = (out.astype(cupy.uint32) << 16).view(cupy.float32)
        if len(outputs) == 2:
            diff = cupy.linalg.norm(outputs["sm90"] - outputs["mma"]) / cupy.linalg.norm(outputs["mma"])
            row["sm90_vs_mma_relative_difference"] = float(diff)
        del outputs
        for torch_backend in ("flash", "cudnn"):
            seconds = torch_sdpa_seconds(cached, new, torch_backend)
            if seconds is not None:
                row[f"torch_{torch_backend}_ms"] = seconds * 1e3
                row[f"torch_{torch_backend}_tflops"] = flops / seconds / 1e12
        log(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                     if k not in ("cached", "new")))
        rows.append(row)
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


# name -> OPENINFER_SM90_* settings (keys of openinfer.backend.cuda.attention.SM90_ENV); "default" sets none.
# The grid / page-read / ping-pong / stage variants were timed on H100 (results/gpu_prefill_attention.md)
# and became the defaults; SM90_VARIANTS of tests/gpu/test_prefill_attention.py keeps them all tested.
SM90_VARIANTS = {
    "default": {},
    "no-overlap": {"overlap": "0"},
    "tma": {"kv_loads": "tma"},
    "tma-no-overlap": {"kv_loads": "tma", "overlap": "0"},
    "tma-multicast": {"kv_loads": "tma_multicast"},
    "tma-auto": {"kv_loads": "auto"},
    "persistent": {"schedule": "persistent"},
    "persistent-tma": {"schedule": "persistent", "kv_loads": "tma"},
    "persistent-auto": {"schedule": "persistent", "kv_loads": "auto"},  # TMA from 2k context, persistent CTAs
    "auto-schedule": {"schedule": "auto"},  # persistent CTAs below 8k tokens of context, the grid from there
    # session 6's opt-in refinements (kernel_choices.py), one at a time over the default, then together
    "page-prefetch": {"page_prefetch": "1"},
    "split-kv": {"split_kv": "1"},
    "early-rescale": {"early_rescale": "1"},
    "lean-arrivals": {"lean_arrivals": "1"},
    "refined": {"page_prefetch": "1", "split_kv": "1", "early_rescale": "1", "lean_arrivals": "1"},
    "persistent-refined": {"schedule": "persistent", "kv_loads": "auto", "page_prefetch": "1", "split_kv": "1",
                           "early_rescale": "1", "lean_arrivals": "1"},
    # TMA at every context with the refinements (TMA was 0.8-0.96x cp.async on 1k prompts before them)
    "tma-refined": {"kv_loads": "tma", "page_prefetch": "1", "split_kv": "1", "early_rescale": "1",
                    "lean_arrivals": "1"},
    "persistent-tma-refined": {"schedule": "persistent", "kv_loads": "tma", "page_prefetch": "1", "split_kv": "1",
                               "early_rescale": "1", "lean_arrivals": "1"},
    # the E1 flips one at a time against the new default, and session 5's defaults
    "session5-defaults": {"schedule": "grid", "page_prefetch": "0", "tma_min_context": "2048"},
    "grid": {"schedule": "grid"},
    "no-page-prefetch": {"page_prefetch": "0"},
    "tma-from-2k": {"tma_min_context": "2048"},
    # session 7's consumer-loop refinements (kernel_choices.py), alone, together, and with persistent CTAs
    # the head_dim-128 consumer loop before E1 (session 7) turned the four refinements below on
    "session6-consumer-loop": {"descriptor_adds": "0", "skip_unit_rescale": "0", "ordered_softmax": "0",
                               "rescale_slack": "0"},
    "descriptor-adds": {"descriptor_adds": "1"},
    "skip-unit-rescale": {"skip_unit_rescale": "1"},
    "ordered-softmax": {"ordered_softmax": "1"},
    "lean-math": {"descriptor_adds": "1", "skip_unit_rescale": "1"},
    "lean-ordered": {"descriptor_adds": "1", "skip_unit_rescale": "1", "ordered_softmax": "1"},
    "lean-ordered-slack": {"descriptor_adds": "1", "skip_unit_rescale": "1", "ordered_softmax": "1",
                           "rescale_slack": "1"},
    "ordered-early-rescale": {"ordered_softmax": "1", "early_rescale": "1"},  # FlashAttention-3's order
    "persistent-lean-ordered": {"schedule": "persistent", "descriptor_adds": "1", "skip_unit_rescale": "1",
                                "ordered_softmax": "1"},
    "persistent-lean-ordered-slack": {"schedule": "persistent", "descriptor_adds": "1", "skip_unit_rescale": "1",
                                      "ordered_softmax": "1", "rescale_slack": "1"},
    "head-pairs": {"head_pairs": "1"},
    "head-pairs-lean-ordered": {"head_pairs": "1", "descriptor_adds": "1", "skip_unit_rescale": "1",
                                "ordered_softmax": "1"},
    "persistent-head-pairs-lean-ordered": {"schedule": "persistent", "head_pairs": "1", "descriptor_adds": "1",
                                           "skip_unit_rescale": "1", "ordered_softmax": "1"},
    # attn16 session 8: a tile of consecutive KV blocks in one TMA box per column block (OPENINFER_SM90_KV_RUNS;
    # the cases' blocks are shuffled unless --contiguous-blocks, as a fresh block pool hands them out)
    "kv-runs": {"kv_runs": "1"},
    # after E1 (session 8) runs and Q registers are the default: the loads before, and each alone
    "session7-loads": {"kv_runs": "0", "q_registers": "0"},
    "no-q-registers": {"q_registers": "0"},
    "no-kv-runs": {"kv_runs": "0"},
    "kv-runs-persistent": {"kv_runs": "1", "schedule": "persistent"},
    "kv-runs-head-pairs": {"kv_runs": "1", "head_pairs": "1"},
    # CTA pairs (two query heads of a KV head) share each tile's run boxes: half the L2 -> SM K/V traffic
    "kv-runs-multicast": {"kv_runs": "1", "kv_loads": "tma_multicast", "schedule": "grid"},
    # Q K^T with Q as A fragments in registers (OPENINFER_SM90_Q_REGISTERS; head_dim 128): wgmma reads only K
    "q-registers": {"q_registers": "1"},
    "q-registers-kv-runs": {"q_registers": "1", "kv_runs": "1"},
    "q-registers-persistent": {"q_registers": "1", "schedule": "persistent"},
    "tma-kv-runs": {"kv_loads": "tma", "kv_runs": "1"},
    "no-pingpong": {"pingpong": "0"},
    "diag-no-kv-loads": {"skip_kv_loads": "1"},  # wrong output: bounds what removing K/V traffic could give
    "diag-no-kv-loads-lean-ordered": {"skip_kv_loads": "1", "descriptor_adds": "1", "skip_unit_rescale": "1",
                                      "ordered_softmax": "1"},
}


def queued_device_seconds(fn, timer, calls: int, rounds: int = 3) -> float:
    """Device seconds per call of ``fn``: ``calls`` calls enqueued behind a spin kernel (so the host's
    Python launch path, longer than a 1k prompt's kernel, is off the clock) between two events; the
    median of ``rounds``."""
    import cupy

    fn()
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    times = []
    for _ in range(rounds):
        timer.hold(0.002 + 100e-6 * calls)  # longer than the host takes to enqueue the calls
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / calls)
    return float(np.median(times))


def set_sm90_variant(settings: dict[str, str]) -> None:
    from openinfer.backend.cuda.attention import SM90_ENV, refresh_kernel_choices
    from openinfer.backend.cuda.attention_routing import (
        SM90_KV_RUNS_ENV,
        SM90_Q_REGISTERS_ENV,
        wanted_sm90_kv_runs,
        wanted_sm90_q_registers,
    )

    for key, name in {**SM90_ENV, "kv_runs": SM90_KV_RUNS_ENV, "q_registers": SM90_Q_REGISTERS_ENV}.items():
        if key in settings:
            os.environ[name] = settings[key]
        else:
            os.environ.pop(name, None)
    refresh_kernel_choices()  # the switches are read once per process
    wanted_sm90_kv_runs.cache_clear()
    wanted_sm90_q_registers.cache_clear()


def compile_variants(backend, spec, variants: dict[str, dict[str, str]]) -> None:
    """Build every variant's kernels at once, in parallel threads (NVRTC, about 2 s each, one after
    the other otherwise): dry launches of a short (cp.async K/V loads) and a long-context (TMA) step
    record the kernels each variant would compile."""
    import cupy

    from openinfer.backend.cuda.attention import prefill_attention
    from openinfer.backend.cuda.loader import compile_kernels, discover_kernels

    probes = []
    for cached, new in (([0], [128]), ([2048], [128])):
        batch, kv, q, _ = paged_case(cached, new)
        probes.append((backend.prepare_batch(batch), kv, q))
    with discover_kernels() as found:
        for settings in variants.values():
            set_sm90_variant(settings)
            for device_batch, kv, q in probes:
                prefill_attention(q, spec, kv, device_batch, implementation="sm90")
    set_sm90_variant({})
    built = compile_kernels(found, cupy.cuda.Device().id)
    log(f"compiled {built} kernel modules for {len(variants)} variants")


def bench_sm90_variants(backend, out_dirs: list[Path], names: list[str] | None = None, rounds: int = 2) -> dict:
    import cupy

    from openinfer.backend.base import AttentionSpec
    from openinfer.backend.cuda.attention import prefill_attention, sm90_prefill_supported
    from openinfer.tools.ledger import Timer

    timer = Timer()
    variants = {name: SM90_VARIANTS[name] for name in (names or SM90_VARIANTS)}
    if not sm90_prefill_supported(HEAD_DIM):
        raise SystemExit("--sm90-variants needs a compute capability 9.0 GPU")
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, None, HEAD_DIM**-0.5, None, None, 1e-6)
    cases = [(f"prompt {n}", [0], [n]) for n in LENGTHS]
    cases += [("chunk 4096 on 12288 cached", [12288], [4096]), ("8 prompts of 2048", [0] * 8, [2048] * 8),
              ("8 prompts of 1024", [0] * 8, [1024] * 8)]  # a 256-stream burst's mixed step carries ~8 of them
    if (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM) == QWEN35_SHAPE:
        cases = QWEN35_CASES
    compile_variants(backend, spec, variants)
    rows = []
    for name, cached, new in cases:
        batch, kv, q, flops = paged_case(cached, new)
        device_batch = backend.prepare_batch(batch)
        row: dict = {"case": name, "cached": cached, "new": new, "flops": flops, "variants": {}}
        outputs = {variant: cupy.empty((batch.num_tokens, NUM_HEADS * HEAD_DIM), cupy.uint16)
                   for variant in variants}
        best: dict[str, float] = {}
        for round_index in range(rounds):  # interleaved rounds: clock or thermal drift hits every variant alike
            for variant, settings in variants.items():
                set_sm90_variant(settings)
                call = functools.partial(prefill_attention, q, spec, kv, device_batch, implementation="sm90",
                                         out=outputs[variant])
                seconds = queued_device_seconds(call, timer, calls=10 if flops < 1e13 else 4)
                best[variant] = min(best.get(variant, float("inf")), seconds)
                log(f"  {name} round {round_index} {variant}: {flops / seconds / 1e12:.1f} TFLOP/s")
        set_sm90_variant({})
        reference = (outputs["default"].astype(cupy.uint32) << 16).view(cupy.float32)
        for variant, seconds in best.items():
            values = (outputs[variant].astype(cupy.uint32) << 16).view(cupy.float32)
            difference = float(cupy.linalg.norm(values - reference)) / max(float(cupy.linalg.norm(reference)), 1e-30)
            row["variants"][variant] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
                                        "vs_default": best["default"] / seconds,
                                        "relative_difference_vs_default": difference}
        del outputs, reference
        for torch_backend in ("flash", "cudnn"):
            seconds = torch_sdpa_seconds(cached, new, torch_backend)
            if seconds is not None:
                row[f"torch_{torch_backend}_tflops"] = flops / seconds / 1e12
        log(f"{name}: " + " ".join(f"{v}={r['tflops']:.0f}" for v, r in row["variants"].items())
            + "".join(f" torch_{b}={row[f'torch_{b}_tflops']:.0f}" for b in ("flash", "cudnn")
                      if f"torch_{b}_tflops" in row))
        rows.append(row)
        cupy.get_default_memory_pool().free_all_blocks()
        for out in out_dirs:  # partial results, case by case
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu_prefill_attention_variants.partial.json").write_text(json.dumps(rows, indent=2))
    # geometric mean of the speed-up over the default across the cases, per (correct) variant
    summary = {variant: float(np.exp(np.mean([np.log(r["variants"][variant]["vs_default"]) for r in rows])))
               for variant in variants}
    correct = [v for v in variants if not v.startswith("diag-")
               and all(r["variants"][v]["relative_difference_vs_default"] < 2e-2 for r in rows)]
    return {"settings": variants, "timer": "device seconds per call, calls queued behind a spin kernel",
            "cases": rows, "geomean_vs_default": summary,
            "fastest_matching_default": max(correct, key=summary.__getitem__)}


def bench_model(backend, mma_only: bool) -> dict:
    """TTFT before (mma.sync) and after (auto: sm90 on Hopper) through gpu_bench's Qwen3-4B builder."""
    import cupy

    from openinfer.backend.cuda.attention import refresh_kernel_choices

    ceilings = gpu_bench.measure_ceilings(backend)
    hf = gpu_bench.build_hf(gpu_bench.QWEN3_4B)
    model = gpu_bench.build_ours(hf, gpu_bench.QWEN3_4B, backend)
    del hf
    import torch

    torch.cuda.empty_cache()
    result = {"ceilings": ceilings}
    for label, kernel in (("before_mma", "mma"),) + (() if mma_only else (("after_auto", "auto"),)):
        os.environ["OPENINFER_PREFILL_KERNEL"] = kernel
        refresh_kernel_choices()
        result[label] = gpu_bench.bench_prefill(backend, model, gpu_bench.QWEN3_4B, list(LENGTHS), ceilings)
        cupy.get_default_memory_pool().free_all_blocks()
    os.environ.pop("OPENINFER_PREFILL_KERNEL")
    refresh_kernel_choices()
    if "after_auto" in result:
        result["ttft_speedup"] = {str(b["tokens"]): b["ttft_ms"] / a["ttft_ms"]
                                  for b, a in zip(result["before_mma"], result["after_auto"], strict=True)}
    return result


# (cached tokens per sequence, new tokens per sequence, sequences): 16368 + 16 = a 16k prompt whose
# last block is recomputed after a prefix-cache hit
SHORT_CASES = [(1008, 16, 1), (4080, 16, 1), (16368, 16, 1), (32752, 16, 1), (16376, 8, 1), (16383, 1, 1),
               (4080, 16, 8), (2032, 4, 32)]


def set_short_query(on: bool) -> None:
    set_short_query_mode("1" if on else "0")


def set_short_query_mode(mode: str | None) -> None:
    """OPENINFER_SHORT_QUERY_ATTENTION = ``mode`` ("auto", "1", "0"; None: unset), re-read."""
    from openinfer.backend.cuda.attention import SHORT_QUERY_ENV, refresh_kernel_choices

    if mode is None:
        os.environ.pop(SHORT_QUERY_ENV, None)
    else:
        os.environ[SHORT_QUERY_ENV] = mode
    refresh_kernel_choices()


def decode_into(out, q, kv, device_batch, scale: float, num_sms: int) -> None:
    """The decode kernel over every row of a one-new-token-per-sequence batch, into ``out``."""
    from openinfer.backend.cuda.decode_attention import paged_decode_attention

    out[...] = paged_decode_attention(q, kv.k, kv.v, device_batch.block_tables, device_batch.context_lens, scale,
                                      num_sms)


def prefill_tile_ranges(q, spec, kv, device_batch, ranges, out) -> None:
    """The prefill kernel over the given ranges of the batch's tiles only, into ``out``."""
    from openinfer.backend.cuda.attention import prefill_attention

    for tile_range in ranges:
        prefill_attention(q, spec, kv, device_batch, out=out, tile_range=tile_range)


def bench_short_attention(backend, copy_bandwidth: float | None, cases: list[tuple[int, int, int]],
                          rows: list[dict] | None = None, save=None) -> list[dict]:
    """Short steps: the short-query kernel against the kernel attention() would otherwise run on the
    same inputs (the prefill kernel; the decode kernel for one new token per sequence, a batch
    that has no prefill tiles), and which of the two the "auto" routing picks."""
    import cupy

    from openinfer.backend.base import AttentionSpec
    from openinfer.backend.cuda.attention import prefill_attention, runs_short_query_kernel
    from openinfer.backend.cuda.decode_attention import short_query_attention_mma
    from openinfer.tools.ledger import gpu_seconds

    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, None, HEAD_DIM**-0.5, None, None, 1e-6)
    set_short_query_mode("auto")
    rows = [] if rows is None else rows
    for cached_tokens, new_tokens, num_seqs in cases:
        cached, new = [cached_tokens] * num_seqs, [new_tokens] * num_seqs
        batch, kv, q, flops = paged_case(cached, new)
        device_batch = backend.prepare_batch(batch)
        kv_bytes = sum(c + n for c, n in zip(cached, new, strict=True)) * 2 * NUM_KV_HEADS * HEAD_DIM * 2
        outputs = {name: cupy.empty((batch.num_tokens, NUM_HEADS * HEAD_DIM), cupy.uint16)
                   for name in ("baseline", "short_query")}
        baseline = "decode" if batch.is_decode else "prefill"
        if baseline == "decode":
            baseline_call = functools.partial(decode_into, outputs["baseline"], q, kv, device_batch, spec.scale,
                                              backend.num_sms)
        else:
            baseline_call = functools.partial(prefill_attention, q, spec, kv, device_batch, out=outputs["baseline"])
        calls = {
            "baseline": baseline_call,
            "short_query": functools.partial(
                short_query_attention_mma, q, kv.k, kv.v, device_batch.block_tables, device_batch.context_lens,
                device_batch.query_start, batch.max_query_len, spec.scale, backend.num_sms,
                out=outputs["short_query"]),
        }
        row: dict = {"cached": cached_tokens, "new": new_tokens, "sequences": num_seqs, "kv_bytes": kv_bytes,
                     "baseline": baseline}
        for name, call in calls.items():
            seconds = gpu_seconds(call, repeats=20, warmup=3)
            row[f"{name}_us"] = seconds * 1e6
            if copy_bandwidth:
                row[f"{name}_kv_read_fraction_of_copy"] = kv_bytes / seconds / copy_bandwidth
        values = {name: (out.astype(cupy.uint32) << 16).view(cupy.float32) for name, out in outputs.items()}
        row["relative_difference"] = float(cupy.linalg.norm(values["short_query"] - values["baseline"])
                                           / cupy.linalg.norm(values["baseline"]))
        row["speedup"] = row["baseline_us"] / row["short_query_us"]
        row["auto_routes_to"] = ("short_query" if not batch.is_decode and runs_short_query_kernel(spec, device_batch)
                                 else baseline)
        log(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        rows.append(row)
        if save is not None:
            save()
        del outputs, values
        cupy.get_default_memory_pool().free_all_blocks()
    set_short_query_mode(None)
    return rows


# (decode rows, their context each, chunk tokens): running decodes and one new prompt's chunk in one step
MIXED_CASES = [(256, 1024, 512), (64, 1024, 2048), (256, 1024, 2048), (4, 1024, 2048), (16, 4096, 512)]
# the short-query crossover: 16 new tokens over 1k-4k, several sequences, and one new token
ROUTING_SHORT_CASES = [(1008, 16, 1), (2032, 16, 1), (3056, 16, 1), (16383, 1, 1), (1520, 16, 1), (4080, 16, 1),
                       (1008, 16, 8), (2032, 16, 8), (1020, 4, 32)]


def set_mixed_decode(on: bool | None) -> None:
    """OPENINFER_MIXED_DECODE_ATTENTION on / off (None: unset, the default), re-read."""
    from openinfer.backend.cuda.attention import MIXED_DECODE_ENV, refresh_kernel_choices

    if on is None:
        os.environ.pop(MIXED_DECODE_ENV, None)
    else:
        os.environ[MIXED_DECODE_ENV] = "1" if on else "0"
    refresh_kernel_choices()


def bench_mixed_steps(backend, rows: list[dict], save) -> list[dict]:
    """Per layer: a mixed step's attention with every row on the prefill kernel (before) and with
    its decode rows on the decode kernel (after), plus each part alone; outputs compared. Each
    case's row is appended to ``rows`` and ``save()`` called (partial results survive a timeout)."""
    import cupy

    from openinfer.backend.base import AttentionSpec
    from openinfer.backend.cuda.attention import attend, mixed_split
    from openinfer.backend.cuda.decode_attention import paged_decode_attention
    from openinfer.tools.ledger import gpu_seconds

    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, None, HEAD_DIM**-0.5, None, None, 1e-6)
    for decodes, context, chunk in MIXED_CASES:
        batch, kv, q, _ = paged_case([context - 1] * decodes + [0], [1] * decodes + [chunk])
        device_batch = backend.prepare_batch(batch)
        row: dict = {"case": f"{decodes} decodes at {context} + a {chunk}-token chunk", "decodes": decodes,
                     "decode_context": context, "chunk": chunk}
        outputs = {}
        for label, on in (("before", False), ("after", True)):
            set_mixed_decode(on)
            if on:
                split = mixed_split(device_batch)
                row["after_decode_rows"] = 0 if split is None else split.decode_rows
                row["after_prefill_launches"] = 1 if split is None else len(split.prefill_tile_ranges)
            call = functools.partial(attend, q, spec, kv, device_batch, backend.num_sms)
            row[f"{label}_us"] = gpu_seconds(call, repeats=20, warmup=3) * 1e6
            outputs[label] = (call().astype(cupy.uint32) << 16).view(cupy.float32)
        set_mixed_decode(None)
        row["speedup"] = row["before_us"] / row["after_us"]
        row["relative_difference"] = float(cupy.linalg.norm(outputs["after"] - outputs["before"])
                                           / cupy.linalg.norm(outputs["before"]))
        # the parts alone: the decode rows as a decode step, the chunk's tiles on the prefill kernel
        decode_alone = functools.partial(paged_decode_attention, q[:decodes], kv.k, kv.v,
                                         device_batch.block_tables[:decodes], device_batch.context_lens[:decodes],
                                         spec.scale, backend.num_sms)
        row["decode_rows_alone_us"] = gpu_seconds(decode_alone, repeats=20, warmup=3) * 1e6
        split = mixed_split(device_batch)
        if split is not None:
            out = cupy.empty((batch.num_tokens, NUM_HEADS * HEAD_DIM), cupy.uint16)
            chunk_alone = functools.partial(prefill_tile_ranges, q, spec, kv, device_batch, split.prefill_tile_ranges,
                                            out)
            row["chunk_tiles_alone_us"] = gpu_seconds(chunk_alone, repeats=20, warmup=3) * 1e6
        log(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        rows.append(row)
        save()
        del outputs
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def two_panels():
    """A figure with two side-by-side panels, drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    return fig, (left, right)


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_routing(report: dict, path: Path) -> None:
    fig, (left, right) = two_panels()
    mixed = report["mixed_steps"]
    x = np.arange(len(mixed))
    left.bar(x - 0.2, [r["before_us"] for r in mixed], 0.4, label="all rows on the prefill kernel")
    left.bar(x + 0.2, [r["after_us"] for r in mixed], 0.4, label="decode rows on the decode kernel")
    left.set_xticks(x, [f"{r['decodes']}x{r['decode_context']}\n+{r['chunk']}" for r in mixed], fontsize=8)
    left.set_ylabel("attention us per layer")
    left.set_title(f"mixed steps, Qwen3-4B heads, {report['environment']['gpu']}")
    left.legend(fontsize=8)
    short = report["short_attention"]
    for seqs in sorted({r["sequences"] for r in short}):
        points = sorted((r["cached"] + r["new"], r["speedup"]) for r in short
                        if r["sequences"] == seqs and r["baseline"] == "prefill")
        if points:
            right.plot(*zip(*points, strict=True), marker="o", label=f"{seqs} sequence(s)")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.axvline(report["short_query_min_context"], color="red", linewidth=0.8, linestyle="--",
                  label="auto threshold")
    right.set_xlabel("context tokens per sequence")
    right.set_ylabel("short-query speed-up over the prefill kernel")
    right.set_title("short steps (<= 16 new tokens per sequence)")
    right.legend(fontsize=8)
    save_figure(fig, path)


def bench_warm_step(backend, context: int = 16384, new_tokens: int = 16) -> dict:
    """The Qwen3-4B-shaped model's step for ``new_tokens`` over ``context - new_tokens`` cached
    tokens, eager (host clock to the argmax on the host), short-query kernel off and on; a 1-token
    step over the same context eager and as a graph replay for reference."""
    import cupy

    from openinfer.backend.base import ForwardBatch
    from openinfer.graph import CudaGraphRunner

    config = gpu_bench.QWEN3_4B
    hf = gpu_bench.build_hf(config)
    model = gpu_bench.build_ours(hf, config, backend)
    del hf
    import torch

    torch.cuda.empty_cache()
    blocks = -(-context // BLOCK_SIZE)
    kv = []
    for _ in range(config["num_hidden_layers"]):
        layer = backend.allocate_kv(blocks + 1, BLOCK_SIZE, config["num_key_value_heads"], config["head_dim"])
        layer.k[...] = random_bf16(layer.k.shape)
        layer.v[...] = random_bf16(layer.v.shape)
        kv.append(layer)
    table = np.arange(1, blocks + 1, dtype=np.int32)[None, :]

    def step_batch(n: int) -> ForwardBatch:
        pos = np.arange(context - n, context, dtype=np.int32)
        return ForwardBatch(token_ids=np.random.default_rng(n).integers(0, 150000, n).astype(np.int32), positions=pos,
                            query_start=np.array([0, n], np.int32), context_lens=np.array([context], np.int32),
                            block_tables=table, slot_mapping=(table[0, pos // BLOCK_SIZE] * BLOCK_SIZE
                                                              + pos % BLOCK_SIZE).astype(np.int32),
                            logits_rows=np.array([n - 1], np.int32), max_query_len=n, max_context_len=context)

    def eager_ms(batch: ForwardBatch) -> float:
        def run():
            model.forward(backend, backend.prepare_batch(batch), kv)[0].argmax().get()
        return gpu_bench.wall_time(run, repeat=10, warmup=2) * 1e3

    result: dict = {"context": context, "new_tokens": new_tokens}
    for on in (False, True):
        set_short_query(on)
        result[f"eager_step_ms_short_query_{'on' if on else 'off'}"] = eager_ms(step_batch(new_tokens))
    set_short_query(False)
    os.environ.pop("OPENINFER_SHORT_QUERY_ATTENTION")
    result["eager_1_token_step_ms"] = eager_ms(step_batch(1))
    runner = CudaGraphRunner(backend, lambda batch: model.forward(backend, batch, kv), max_num_seqs=1,
                             max_blocks_per_seq=blocks, buckets=[1])
    runner.capture()
    runner.graphs[1].static.fill(step_batch(1))
    result["graph_1_token_step_ms"] = gpu_bench.gpu_time(lambda: runner.graphs[1].graph.launch(), repeat=20) * 1e3
    log(str(result))
    cupy.get_default_memory_pool().free_all_blocks()
    return result


def plot(report: dict, path: Path) -> None:
    fig, (left, right) = two_panels()
    rows = report["attention"]
    x = np.arange(len(rows))
    series = [k[:-len("_tflops")] for k in ("mma_tflops", "sm90_tflops", "torch_flash_tflops", "torch_cudnn_tflops")
              if any(k in r for r in rows)]
    width = 0.8 / max(1, len(series))
    for i, name in enumerate(series):
        left.bar(x + i * width, [r.get(f"{name}_tflops", 0) for r in rows], width, label=name)
    left.set_xticks(x + 0.4 - width / 2, [r["case"] for r in rows], rotation=15, fontsize=8)
    left.set_ylabel("causal attention TFLOP/s")
    left.set_title(f"prefill attention, Qwen3-4B heads, {report['environment']['gpu']}")
    left.legend(fontsize=8)
    model = report.get("model")
    if model:
        tokens = [r["tokens"] for r in model["before_mma"]]
        xm = np.arange(len(tokens))
        right.bar(xm - 0.2, [r["ttft_ms"] for r in model["before_mma"]], 0.4, label="before (mma.sync)")
        if "after_auto" in model:
            right.bar(xm + 0.2, [r["ttft_ms"] for r in model["after_auto"]], 0.4, label="after (auto)")
        right.set_xticks(xm, [str(t) for t in tokens])
        right.set_yscale("log")
        right.set_xlabel("prompt tokens")
        right.set_ylabel("TTFT ms (one prefill step)")
        right.set_title("Qwen3-4B-shaped model, cold prefill")
        right.legend(fontsize=8)
    save_figure(fig, path)


def write_json(report: dict, out_dirs: list[Path], name: str) -> None:
    for out in out_dirs:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(report, indent=2))


def write_variants(report: dict, out_dirs: list[Path]) -> None:
    for out in out_dirs:
        out.mkdir(parents=True, exist_ok=True)
        name = ("gpu_prefill_attention_variants" + ("_contiguous" if CONTIGUOUS_BLOCKS else "")
                + (f"_hd{HEAD_DIM}" if HEAD_DIM != 128 else "") + ".json")
        (out / name).write_text(json.dumps({**report, "contiguous_blocks": CONTIGUOUS_BLOCKS,
                                            "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
                                                      "head_dim": HEAD_DIM}}, indent=2))
    result = report["sm90_variants"]
    cases = result["cases"]
    print(f"\n sm90 variant TFLOP/s on {report['environment']['gpu']} (x = geomean speed-up over default; "
          f"{'consecutive' if CONTIGUOUS_BLOCKS else 'shuffled'} KV blocks)")
    print(f" {'variant':24s}" + "".join(f"{c['case'][:14]:>15s}" for c in cases) + "        x   max rel diff")
    for variant in result["settings"]:
        cells = "".join(f"{c['variants'][variant]['tflops']:15.1f}" for c in cases)
        diff = max(c["variants"][variant]["relative_difference_vs_default"] for c in cases)
        print(f" {variant:24s}{cells}{result['geomean_vs_default'][variant]:9.3f}{diff:15.2e}")
    for backend_name in ("flash", "cudnn"):
        key = f"torch_{backend_name}_tflops"
        print(f" {'torch ' + backend_name:24s}" + "".join(f"{c.get(key, float('nan')):15.1f}" for c in cases))
    print(f" fastest variant matching the default's output: {result['fastest_matching_default']}")
    sys.stdout.flush()


def print_short(rows: list[dict]) -> None:
    print("\n cached  new  seqs  baseline  baseline us  short-query us  speed-up  auto picks")
    for r in rows:
        print(f" {r['cached']:6d} {r['new']:4d} {r['sequences']:5d} {r['baseline']:>9s} {r['baseline_us']:12.1f} "
              f"{r['short_query_us']:15.1f} {r['speedup']:9.2f}  {r['auto_routes_to']}")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-model", action="store_true", help="attention only (skip the whole-model TTFT)")
    parser.add_argument("--mma-only", action="store_true", help="time only the mma.sync kernel")
    parser.add_argument("--sm90-variants", action="store_true", help="time the sm90 kernel's run-time variants")
    parser.add_argument("--variants", default=None,
                        help=f"with --sm90-variants: comma-separated names among {', '.join(SM90_VARIANTS)} "
                             "(default: all; 'default' is always timed, the others are compared with it)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with --sm90-variants: interleaved timing rounds per case (best of them is kept)")
    parser.add_argument("--short-queries", action="store_true",
                        help="short steps over long contexts: prefill vs short-query kernel, and the warm 16k step")
    parser.add_argument("--routing", action="store_true",
                        help="mixed steps (decode rows on the decode kernel) and the short-query crossover")
    parser.add_argument("--qwen35", action="store_true",
                        help="Qwen3.5's full-attention shape (16 q / 4 KV heads, head_dim 256) instead of Qwen3-4B's")
    parser.add_argument("--contiguous-blocks", action="store_true",
                        help="each sequence's KV blocks in order (a fresh block pool's), not shuffled")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    global CONTIGUOUS_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    CONTIGUOUS_BLOCKS = args.contiguous_blocks
    if args.qwen35:
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = QWEN35_SHAPE

    from openinfer.backend.cuda import CudaBackend

    backend = CudaBackend()
    report: dict = {"environment": environment(backend)}
    log(str(report["environment"]))
    out_dirs = [Path(args.out)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    names = None
    if args.variants is not None:
        names = ["default"] + [n for n in args.variants.split(",") if n and n != "default"]
        unknown = [n for n in names if n not in SM90_VARIANTS]
        if unknown:
            parser.error(f"unknown --variants {unknown}; choose among {list(SM90_VARIANTS)}")
    if args.sm90_variants:
        report["sm90_variants"] = bench_sm90_variants(backend, out_dirs, names, args.rounds)
        write_variants(report, out_dirs)
        return
    if args.routing:
        from openinfer.backend.cuda.attention_routing import MIXED_MIN_DECODE_ROWS, SHORT_QUERY_MIN_CONTEXT

        report["short_query_min_context"] = SHORT_QUERY_MIN_CONTEXT
        report["mixed_min_decode_rows"] = MIXED_MIN_DECODE_ROWS
        report["mixed_steps"] = []
        bench_mixed_steps(backend, report["mixed_steps"],
                          functools.partial(write_json, report, out_dirs, "gpu_prefill_attention_routing.json"))
        report["short_attention"] = []
        bench_short_attention(backend, None, ROUTING_SHORT_CASES, report["short_attention"],
                              functools.partial(write_json, report, out_dirs, "gpu_prefill_attention_routing.json"))
        for out in out_dirs:
            plot_routing(report, out / "gpu_prefill_attention_routing.png")
        print(f"\n mixed steps on {report['environment']['gpu']}: attention us per layer")
        for r in report["mixed_steps"]:
            print(f" {r['case']:40s} before {r['before_us']:8.1f}  after {r['after_us']:8.1f}  "
                  f"x{r['speedup']:.2f}  rel diff {r['relative_difference']:.1e}")
        print_short(report["short_attention"])
        return
    if args.short_queries:
        report["ceilings"] = gpu_bench.measure_ceilings(backend)
        report["short_attention"] = bench_short_attention(backend, report["ceilings"]["copy_bandwidth_bytes_per_s"],
                                                          SHORT_CASES)
        write_json(report, out_dirs, "gpu_prefill_attention_short.json")
        if not args.no_model:
            report["warm_step"] = bench_warm_step(backend)
            write_json(report, out_dirs, "gpu_prefill_attention_short.json")
        print_short(report["short_attention"])
        return
    report["attention"] = bench_attention(backend, args.mma_only)
    if not args.no_model:
        report["model"] = bench_model(backend, args.mma_only)
    for out in out_dirs:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_prefill_attention.json").write_text(json.dumps(report, indent=2))
        plot(report, out / "gpu_prefill_attention.png")
    print("\n case                         " + "".join(f"{k:>14s}" for k in ("mma", "sm90", "torch_flash", "torch_cudnn")))
    for r in report["attention"]:
        print(f" {r['case']:28s}" + "".join(f"{r.get(k + '_tflops', float('nan')):14.1f}"
                                           for k in ("mma", "sm90", "torch_flash", "torch_cudnn")))
    for label in ("before_mma", "after_auto"):
        for r in report.get("model", {}).get(label, []):
            print(f" TTFT {label:10s} {r['tokens']:6d}: {r['ttft_ms']:8.1f} ms  MFU {r['mfu']:.0%}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
