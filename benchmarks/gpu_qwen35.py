"""Qwen3.5 on one GPU (issue 17): the Gated DeltaNet kernels before and after, side by side in
one run — prefill TTFT at 1k / 4k / 16k tokens and decode TPOT at 1 / 16 / 64 streams — plus
the engine's idle RSS and what the hybrid prefix cache buys a warm multi-turn chat.

A random Qwen3.5-4B-shaped checkpoint in the real multimodal layout (``Qwen3_5ForConditional-
Generation``: 24 Gated DeltaNet + 8 gated-attention layers under ``model.language_model.``, a
1-block vision tower, ``preprocessor_config.json`` and a word-level tokenizer over the
vocabulary) is written once (by HF transformers, in a subprocess so that this process never
holds PyTorch), then served through the default engine (``openinfer.create_engine``, CUDA
graphs, greedy, ignore_eos) twice:

- ``after``:  the chunked tensor-core prefill and the fused conv1d + delta-rule + gated-norm
  decode step (the default kernels);
- ``before``: ``OPENINFER_QWEN35_GDN_KERNELS=recurrent`` — the token-by-token prefill and the
  four separate decode kernels.

Measured per variant: TTFT of a lone request with a fresh random prompt (no cache hits; 16k is
prefilled in chunks of ``max_num_batched_tokens`` that continue the state), median of
``--repeats``; TPOT = mean gap between a request's tokens (512-token prompts, 64 new tokens,
all streams start together). ``after`` also measures the idle RSS of this process right after
the engine is up (weights loaded, graphs captured; breakdown from /proc) and a second chat turn
(4,000-token history + 50 new tokens) served from the prefix cache vs recomputed.

    python benchmarks/gpu_qwen35.py [--checkpoint /tmp/qwen35-4b-mm] [--quick]
Writes benchmarks/results/gpu_qwen35.json and .png (under $OUT instead when it is set).

Side by side with vLLM (issue 17's goal): two device calls on one warm GPU machine (vLLM
carried and installed as ``../shared/tools/vllm-peer.sh`` says), each under 550 s, from the repo
root with ``PYTHONUNBUFFERED=1``; results under $OUT. Call 1, ours (~4 min on a fresh machine):

    C=/tmp/qwen35-4b-mm; L="Qwen3.5-4B shape (multimodal layout, random bf16, fp32 GDN state)"
    timeout 150 python benchmarks/gpu_qwen35.py --checkpoint $C --write-checkpoint-only
    timeout 240 python benchmarks/gpu_concurrency.py --checkpoint $C --streams 1,16,64 \
        --api-server-counts 1 --clients lean --model-label "$L" --tag gpu_concurrency_qwen35
    cp benchmarks/results/gpu_concurrency_qwen35.json /tmp/
    timeout 120 python benchmarks/gpu_qwen35.py --checkpoint $C --multi-turn-only

Call 2, vLLM 0.26.0 on the same checkpoint with the same lean client (first start ~5 min of
Triton autotuning; ``--append`` puts its run beside ours in one JSON + PNG):

    C=/tmp/qwen35-4b-mm; L="Qwen3.5-4B shape (multimodal layout, random bf16, fp32 GDN state)"
    cp /tmp/gpu_concurrency_qwen35.json benchmarks/results/
    timeout 530 python benchmarks/gpu_concurrency.py --checkpoint $C --streams 1,16,64 \
        --api-server-counts 0 --clients lean --append --model-label "$L" --tag gpu_concurrency_qwen35 \
        --vllm-start-timeout 420 --vllm-cmd "env PYTHONPATH=/tmp/vsite:/tmp/site python3 -m \
        vllm.entrypoints.openai.api_server --model {model} --port {port} --max-model-len 4096 \
        --gpu-memory-utilization 0.85 --language-model-only --gdn-prefill-backend triton \
        --mamba-ssm-cache-dtype float32"

What each line gives: the checkpoint (random bf16, ``mamba_ssm_dtype: float32`` as the released
configs: vLLM then keeps the delta-rule state in fp32 as we do, and the last flag says so again);
``openinfer serve`` under bursts of 1 / 16 / 64 streams (1k in / 128 out: out tok/s, TPOT and
TTFT p50/p99 — the 1-stream TPOT is bs=1 decode through HTTP), its cold start and the idle RSS of
every process (results/gpu_concurrency_qwen35.json + .png); then, in-process
(results/gpu_qwen35_multi_turn.json + .png): engine start, idle RSS with its anonymous /
file-mapped / shared parts, bs=1 TPOT (1k-token prompt, 128 new tokens) and a second chat turn
(4,000-token history + 50 new tokens) warm from the prefix cache vs cold, medians of
``--repeats``; call 2 adds vLLM's run (cold start, idle RSS of its process tree, the same rows).

CPU dry runs of every step (a toy checkpoint in the same layout, the NumPy engine):

    python benchmarks/gpu_qwen35.py --checkpoint /tmp/qwen35-tiny --shape tiny --write-checkpoint-only
    python benchmarks/gpu_concurrency.py --checkpoint /tmp/qwen35-tiny --streams 1,4 --api-server-counts 1 \
        --clients lean --input-len 64 --output-len 8 --max-model-len 512 --serve-args "--device cpu" --tag dry
    python benchmarks/gpu_qwen35.py --checkpoint /tmp/qwen35-tiny --shape tiny --multi-turn-only \
        --device cpu --history 256 --new-turn 16 --repeats 2

and call 2 with ``--vllm-cmd "env PYTHONPATH=... python -m openinfer.cli serve --model-path {model}
--port {port} --device cpu --grpc-port 0"`` standing in for vLLM. Measured so (H200, D2 window of
2026-11-23 evening): 1 / 16 / 64 streams 1.23x / 1.04x / 0.84x vLLM's out tok/s, idle RSS 869 vs
4,087 MiB, second turn 38 ms warm vs 92 ms cold (plugins/openinfer-qwen35/README.md).

Decode-kernel variants (``OPENINFER_QWEN35_GDN_DECODE``, each against ``plain``):

    python benchmarks/gpu_qwen35.py --decode-kernels-only   # one GDN layer, 1-256 rows, graph replay (~20 s)
    python benchmarks/gpu_qwen35.py --decode-tpot-only --decode-variants early_loads,coalesced,vec4
                                                             # engine TPOT at 1/16/64 streams, random weights
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Qwen3.5-4B's language model: 32 layers (every 4th full attention), hidden 2560, GDN 16 key /
# 32 value heads of 128, gated attention 16 heads / 4 KV heads of 256, tied embeddings. The
# released configs say mamba_ssm_dtype float32 (the delta-rule state, as ours and HF's keep it);
# vLLM reads it, and without it keeps that state in bf16 — half the state traffic of a decode step.
QWEN35_4B_TEXT = {
    "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
    "full_attention_interval": 4, "attn_output_gate": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "eos_token_id": 248044, "mamba_ssm_dtype": "float32",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
# one vision block at the released tower's widths, projecting into the language model
VISION_1_BLOCK = {"depth": 1, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 2560,
                  "num_position_embeddings": 2304}
# --shape tiny: the same layout at toy widths, for a CPU dry run of this script and of gpu_concurrency.py
TINY_TEXT = {**QWEN35_4B_TEXT, "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_key_head_dim": 16,
             "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
             "layer_types": ["linear_attention"] * 3 + ["full_attention"], "eos_token_id": 4095}
TINY_VISION = {**VISION_1_BLOCK, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
               "num_position_embeddings": 64}
SHAPES = {"4b": (QWEN35_4B_TEXT, VISION_1_BLOCK), "tiny": (TINY_TEXT, TINY_VISION)}
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
KERNELS_ENV = "OPENINFER_QWEN35_GDN_KERNELS"  # openinfer_qwen35.cuda_ops: "recurrent" = the earlier kernels
DECODE_ENV = "OPENINFER_QWEN35_GDN_DECODE"  # openinfer_qwen35.cuda_ops: which fused decode kernel
VARIANTS = {"after": None, "before": "recurrent"}  # the engine runs (KERNELS_ENV)
# each variant's environment ("after": the defaults); "plain" / "early_loads": the default kernels with
# that fused decode kernel (gdn_decode_step / gdn_decode_step_early_loads) whichever is the default
KERNEL_ENVIRONMENTS = {"after": {}, "before": {KERNELS_ENV: "recurrent"}, "plain": {DECODE_ENV: "plain"},
                       "early_loads": {DECODE_ENV: "early_loads"}, "coalesced": {DECODE_ENV: "coalesced"},
                       "vec4": {DECODE_ENV: "vec4"}, "bulk": {DECODE_ENV: "bulk"}}
DECODE_VARIANTS = ("plain", "early_loads")
DECODE_ROWS = (1, 16, 64, 128, 256)  # --decode-kernels-only
# --gdn-kernels-only: every fused decode kernel at these rows; the prefill path per kernel for
# these (fresh prompts, tokens each, one-token decode rows beside them) steps: the 64-stream burst's
# mixed steps hold 8 prompts of ~1k and up to ~58 decodes
GDN_DECODE_VARIANTS = ("plain", "early_loads", "coalesced", "vec4", "bulk")
GDN_DECODE_ROWS = (1, 16, 64, 256)
GDN_PREFILL_STEPS = ((8, 1024, 0), (8, 1024, 48), (1, 1024, 0))
PREFILL_ENV = "OPENINFER_QWEN35_GDN_PREFILL"  # openinfer_qwen35.cuda_ops: the chunked prefill's kernels
# environments: the earlier path, split_rows, blocked (split_rows with the triangular solve by 16 x 16
# blocks), the default, registers (blocked with the chunk walk's state in mma registers) and fused (that
# with the gated norm in the output kernel), grouped (registers with a prepare block per chunk and key
# head), grouped_mma (that with the solve's block products on tensor cores), grouped_conv (that with the
# conv1d inside the prepare), grouped_out (that with the staged output kernel), grouped_staged (the
# default since session 8's E1: grouped_mma with the staged output kernel), grouped_coalesced (that with
# W / U stored as 16-byte row pieces); staged and split were
# measured in E3 (2026-11-24); chunked_fp32 (the chunk algorithm in fp32 on CUDA cores) and chunked_split
# (on tensor cores with split operands) are issue #17's accuracy-level chains
PREFILL_VARIANTS = {name: {PREFILL_ENV: name}
                    for name in ("plain", "split_rows", "blocked", "registers", "fused", "grouped", "grouped_mma",
                                 "grouped_conv", "grouped_out", "grouped_staged", "grouped_coalesced",
                                 "grouped_f16", "chunked_fp32", "chunked_split", "chunked_split_f16")}
# the token-by-token kernels for every step (issue #17: the accuracy reference of the chunked prefill; what
# prefill costs at its accuracy)
PREFILL_VARIANTS["recurrent"] = {KERNELS_ENV: "recurrent"}
# timing only, its outputs wrong: grouped_staged with every mma of gdn_chunked.cu issued 3 times
# (GDN_MMA_REPEAT): the least the tensor-core part of issue #17's fix (~3 mmas a product) costs
PREFILL_VARIANTS["grouped_staged_mma_x3"] = {PREFILL_ENV: "grouped_staged"}
# timing only, its outputs wrong: chunked_split with every product as its hi * hi mma alone
# (GDN_SPLIT_ONE_PART): what the split operands' extra mmas (and their splits) cost
DIAGNOSTIC_BUILDS = {"grouped_staged_mma_x3": {"GDN_MMA_REPEAT": 3},
                     "chunked_split_one_part": {"GDN_SPLIT_ONE_PART": 1}}
PREFILL_VARIANTS["chunked_split_one_part"] = {PREFILL_ENV: "chunked_split"}


def compiled_with(**defines: int):
    """Within: the qwen35 kernels built anew with the extra ``defines`` (a diagnostic build)."""
    from openinfer_qwen35 import cuda_ops

    return cuda_ops.defines_added(**defines)


SHORT_PROMPTS = (50, 500)  # --multi-turn-only: lone cold prompts (TTFT), a few blocks and a partial one
# the switches of the warm turn's path, recorded with --multi-turn-only's results
MULTI_TURN_SWITCHES = ("OPENINFER_QWEN35_SNAPSHOT_IN_STEP", "OPENINFER_QWEN35_SNAPSHOT_EMIT", "OPENINFER_QWEN35_PINNED_UPLOADS",
                       "OPENINFER_STATE_SNAPSHOTS")
BS1_PROMPT, BS1_NEW_TOKENS = 1024, 128  # --multi-turn-only's bs=1 TPOT: the serving rows' 1k in / 128 out


def write_checkpoint(path: Path, text: dict | None = None, vision: dict | None = None, device: str | None = None) -> float:
    """A random bf16 ``Qwen3_5ForConditionalGeneration`` checkpoint (HF's own names and config),
    its preprocessor config and a word-level tokenizer, initialised on ``device`` (default: the
    GPU when torch sees one); seconds taken."""
    import torch
    from gpu_serving import write_tokenizer
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    start = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    text, vision = dict(text or QWEN35_4B_TEXT), dict(vision or VISION_1_BLOCK)
    config = Qwen3_5Config(text_config=text, vision_config=vision,
                           tie_word_embeddings=text.get("tie_word_embeddings", False))
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default_dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    del model
    saved = json.loads((path / "config.json").read_text())
    # benchmarks/gpu_concurrency.py reads the vocabulary size at the top of config.json
    saved.setdefault("vocab_size", text["vocab_size"])
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    write_tokenizer(path, text["vocab_size"])
    return time.perf_counter() - start


def add_release_fields(path: Path) -> bool:
    """Give a checkpoint written before ``mamba_ssm_dtype`` joined QWEN35_4B_TEXT the field the
    released configs carry (config.json only; the weights are unchanged). Whether it changed."""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    text = config.get("text_config", config)
    if text.get("mamba_ssm_dtype") == QWEN35_4B_TEXT["mamba_ssm_dtype"]:
        return False
    text["mamba_ssm_dtype"] = QWEN35_4B_TEXT["mamba_ssm_dtype"]
    config_path.write_text(json.dumps(config, indent=2))
    return True


def ensure_checkpoint(path: Path, shape: str) -> float | None:
    """Write the checkpoint in a subprocess (PyTorch stays out of this process's RSS)."""
    if (path / "config.json").exists():
        return None
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--checkpoint", str(path), "--shape", shape, "--write-checkpoint-only"],
                   check=True)
    return time.perf_counter() - start


def process_rss() -> dict:
    """This process's resident memory (bytes) from /proc/self/status."""
    fields = {"VmRSS": "total", "RssAnon": "anonymous", "RssFile": "file_mapped", "RssShmem": "shared"}
    rss = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            rss[fields[key]] = int(value.split()[0]) * 1024
    return rss


def make_request(request_id: str, prompt: list[int], max_tokens: int, cache_salt: str = ""):
    from openinfer.offline import generate_request

    return generate_request(request_id, prompt, max_tokens, cache_salt=cache_salt)


async def timed(engine, request) -> tuple[float, list[float], int, list[int]]:
    """(TTFT s, token event times, cached tokens, token ids) of one request."""
    start = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    cached = 0
    async for event in engine.generate(request):
        kind = event.WhichOneof("event")
        if kind == "tokens":
            times.extend([time.perf_counter()] * len(event.tokens.ids))
            ids.extend(event.tokens.ids)
        elif kind == "scheduled":
            cached = event.scheduled.cached_tokens
        elif kind == "error":
            raise RuntimeError(event.error.message)
    return times[0] - start, times, cached, ids


class Prompts:
    """Fresh random prompts over the served checkpoint's vocabulary (never a cache hit by chance)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        import numpy as np

        self.rng = np.random.default_rng(seed)
        self.high = min(200000, vocab_size - 1)

    def tokens(self, length: int) -> list[int]:
        return self.rng.integers(100, self.high, size=length).tolist()


def prefill_ttft(engine, prompts: Prompts, length: int, repeats: int, tag: str) -> float:
    """Median TTFT (ms) of lone requests with fresh random prompts of ``length`` tokens."""
    samples = [1000 * asyncio.run(timed(engine, make_request(f"{tag}-{length}-{i}", prompts.tokens(length), 1)))[0]
               for i in range(repeats)]
    return statistics.median(samples)


def tpot(engine, prompts: Prompts, streams: int, prompt_len: int, new_tokens: int, tag: str) -> float:
    requests = [make_request(f"{tag}-{streams}-{i}", prompts.tokens(prompt_len), new_tokens)
                for i in range(streams)]

    async def main():
        return await asyncio.gather(*(timed(engine, r) for r in requests))

    gaps = [(t[-1] - t[0]) / (len(t) - 1) for _, t, _, _ in asyncio.run(main())]
    return 1000 * statistics.mean(gaps)


def multi_turn(engine, prompts: Prompts, history: int, new_turn: int, repeats: int = 1,
               trace_dir: Path | None = None) -> dict:
    """A second chat turn (``history`` tokens: turn 1's prompt and its 32 generated tokens, then
    ``new_turn`` fresh ones) served warm from the prefix cache (KV blocks + state snapshot) and
    cold (the same tokens under another cache salt: recomputed); medians over ``repeats``
    conversations, each with its own random history. Counts the conversations whose warm and
    cold turns answered alike (greedy; bf16 chunk boundaries differ, so a near-tie may not).
    ``trace_dir``: the engine's trace folder (``EngineOptions.trace_dir``): each warm turn's
    engine-side timeline (queue, prefill chunks, decode steps) is read back from its trace."""
    warm_ms, cold_ms, warm_cached, cold_cached, same, divergence = [], [], [], [], 0, []
    forwards: list[dict] = []
    spy = StepSpy(engine, trace_dir)
    for i in range(repeats):
        prompt = prompts.tokens(history - 32)
        # the second turn repeats the history token for token (prompt + what turn 1 generated)
        outcome = asyncio.run(timed(engine, make_request(f"turn1-{i}", prompt, 32)))[3]
        turn = prompt + outcome + prompts.tokens(new_turn)
        spy.calls.clear()
        began = time.time()
        warm = asyncio.run(timed(engine, make_request(f"turn2-{i}", turn, 8)))
        warm_forwards = spy.before_first_token()
        warm_timeline = spy.timeline(f"turn2-{i}", began)
        cold = asyncio.run(timed(engine, make_request(f"turn2-cold-{i}", turn, 8, cache_salt=f"cold-{i}")))
        forwards.append({"warm": warm_forwards, "cold": spy.before_first_token(), "warm_timeline": warm_timeline,
                         "warm_ttft_ms": round(1000 * warm[0], 2)})
        same += warm[3] == cold[3]
        # where the answers part (None: alike) and both answers: random weights give near-flat logits,
        # so a near-tie at the first token is expected; tests/plugins/qwen35 checks hit == cold on a
        # trained-like model with the top-2 gaps (test_prefix_cache_hit_equals_cold_run)
        part = next((k for k, (a, b) in enumerate(zip(warm[3], cold[3], strict=False)) if a != b), None)
        divergence.append({"first_different_token": part, "warm": warm[3], "cold": cold[3]})
        warm_ms.append(1000 * warm[0])
        cold_ms.append(1000 * cold[0])
        warm_cached.append(warm[2])
        cold_cached.append(cold[2])
    spy.close()
    return {"history_tokens": len(turn) - new_turn, "new_turn_tokens": new_turn, "repeats": repeats,
            "warm_ttft_ms": statistics.median(warm_ms), "warm_cached_tokens": min(warm_cached),
            "cold_ttft_ms": statistics.median(cold_ms), "cold_cached_tokens": max(cold_cached),
            "warm_ttft_ms_all": warm_ms, "cold_ttft_ms_all": cold_ms, "warm_equals_cold_answers": same,
            "answers": divergence, "forwards_before_first_token": forwards,
            "cold_over_warm": statistics.median(cold_ms) / statistics.median(warm_ms)}


class StepSpy:
    """What the engine ran for a request, from its public hooks only: each forward launch (rows,
    host ms of the launch) through the runner's launch observer (``runner.observer``, what
    ``openinfer.engine_core.step_log.StepLog`` attaches to), a request's engine-side spans (queue,
    prefill chunks, decode steps) from its trace when the engine traces (``trace_dir``), and the
    process's garbage collections (``gc.callbacks``)."""

    def __init__(self, engine, trace_dir: Path | None = None) -> None:
        self.calls: list[tuple[int, float]] = []
        self.trace_dir = trace_dir
        self.collections: list[tuple[str, float, float]] = []  # (gc<generation>, start s, ms), wall clock
        self._gc_start = 0.0
        self.runner = getattr(engine, "runner", None)  # an in-process engine's (none: nothing to observe)
        self._previous = getattr(self.runner, "observer", None)
        if self.runner is not None and hasattr(self.runner, "observer"):
            self.runner.observer = self._observe
        gc.callbacks.append(self._gc_phase)

    def _observe(self, batch, graphed: bool, began: float, returned: float) -> None:
        self.calls.append((int(batch.num_tokens), round(1000 * (returned - began), 2)))
        if self._previous is not None:
            self._previous(batch, graphed, began, returned)

    def _gc_phase(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.time()
        else:
            self.collections.append((f"gc{info.get('generation')}", self._gc_start,
                                     1000 * (time.time() - self._gc_start)))

    def close(self) -> None:
        """Give the runner back its observer and stop watching collections."""
        if self.runner is not None and hasattr(self.runner, "observer"):
            self.runner.observer = self._previous
        if self._gc_phase in gc.callbacks:
            gc.callbacks.remove(self._gc_phase)

    def timeline(self, request_id: str, since: float, wait_s: float = 2.0) -> list[tuple[str, float, float]]:
        """The request's engine spans (from its trace, when the engine traces) and the collections
        since ``since`` (wall-clock s): (name, start ms after it, ms), in start order."""
        spans = [(name, start, ms) for name, start, ms in self.collections if start >= since]
        self.collections = []
        if self.trace_dir is not None:
            from openinfer.tracing import safe_file_stem

            path = self.trace_dir / f"{safe_file_stem(request_id)}.engine.json"
            deadline = time.time() + wait_s  # written by the tracer's background thread
            while not path.exists() and time.time() < deadline:
                time.sleep(0.01)
            if path.exists():
                events = json.loads(path.read_text())["traceEvents"]
                spans += [(e["name"], e["ts"] / 1e6, e["dur"] / 1e3) for e in events if e.get("ph") == "X"]
        return sorted(((n, round(1000 * (t - since), 2), round(d, 2)) for n, t, d in spans), key=lambda s: s[1])

    def before_first_token(self) -> list[tuple[int, float]]:
        """The calls since the last clear (one lone request's), its prompt steps and its first
        decode step (one row); cleared."""
        calls, self.calls = self.calls, []
        prompt = next((i for i, c in enumerate(calls) if c[0] == 1), len(calls))
        return calls[: prompt + 1]


def set_kernels(variant: str) -> None:
    for name in (KERNELS_ENV, DECODE_ENV):
        os.environ.pop(name, None)
    os.environ.update(KERNEL_ENVIRONMENTS[variant])


def random_gdn_layer(seed: int = 0) -> SimpleNamespace:
    """One GDN layer's core weights at the 4B shape, random (conv weight, A_log, dt bias, norm
    weight, drawn in that order), with its shapes and the ``bf16(shape, scale)`` maker that keeps
    drawing from the same generator for the caller's inputs."""
    import cupy
    import numpy as np
    from openinfer_qwen35.config import Qwen35Config
    from openinfer_qwen35.weights import DeltaNetWeights

    config = Qwen35Config.from_dict(QWEN35_4B_TEXT)
    nv, dk, dv, width = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim,
                         config.linear_conv_kernel_dim)
    features = config.conv_dim + config.linear_value_dim + 2 * nv
    rng = np.random.default_rng(seed)

    def bf16(shape, scale=1.0):
        bits = (rng.standard_normal(shape).astype(np.float32) * scale).view(np.uint32) >> 16
        return cupy.asarray(bits.astype(np.uint16))

    weights = DeltaNetWeights(None, bf16((config.conv_dim, width), 0.4),
                              cupy.asarray(-np.exp(rng.uniform(-4, 2, nv)).astype(np.float32)),
                              cupy.asarray(rng.standard_normal(nv).astype(np.float32)), bf16((dv,), 0.3), None)
    return SimpleNamespace(config=config, nv=nv, dk=dk, dv=dv, width=width, features=features, bf16=bf16,
                           weights=weights)


def layer_core_timings(args: argparse.Namespace, variants: tuple[str, ...] = tuple(VARIANTS)) -> dict:
    """Device time of one GDN layer's core (``cuda_ops.delta_net``: conv, delta rule, gated
    norm; no projections) at the 4B shape, per variant: decode batches and single prompts.
    Decode is timed twice: back-to-back launches (``decode_us``: at small batches that is CuPy's
    host launch time, not the kernel's) and replayed from a CUDA graph of 24 calls
    (``decode_graph_us``: the device time the engine's decode graphs see)."""
    import cupy
    import numpy as np
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.state import StepSequences

    layer = random_gdn_layer()
    config, bf16, weights = layer.config, layer.bf16, layer.weights
    nv, dk, dv, width, features = layer.nv, layer.dk, layer.dv, layer.width, layer.features
    slots = max(args.streams) + 1
    conv_state = bf16((slots, width - 1, config.conv_dim))
    ssm_state = cupy.zeros((slots, nv, dk, dv), dtype=cupy.float32)

    def timed_ms(proj, seqs, repeats):
        """Mean ms a call: back-to-back launches, so a call's time is at least the host's launch time."""
        for _ in range(2):
            cuda_ops.delta_net(proj, weights, conv_state, ssm_state, seqs, config)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(repeats):
            cuda_ops.delta_net(proj, weights, conv_state, ssm_state, seqs, config)
        stop.record()
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / repeats

    def replayed_ms(proj, seqs, calls=24, replays=20):
        """Mean ms a call with no host in the way: ``calls`` decode calls (a model's GDN layers)
        captured in one CUDA graph, replayed; as the engine's decode graphs run them."""
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            cuda_ops.delta_net(proj, weights, conv_state, ssm_state, seqs, config)  # the pool's blocks, warm
            stream.synchronize()
            mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
            stream.begin_capture() if mode is None else stream.begin_capture(mode)
            try:
                for _ in range(calls):
                    cuda_ops.delta_net(proj, weights, conv_state, ssm_state, seqs, config)
            finally:
                graph = stream.end_capture()
            graph.launch(stream)
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(replays):
                graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / (replays * calls)

    timings: dict = {}
    for variant in variants:
        set_kernels(variant)
        decode, decode_graph, prefill = {}, {}, {}
        for rows in args.streams:
            query_start = np.arange(rows + 1)
            seqs = cuda_ops.prepare_sequences(StepSequences(query_start, np.arange(1, rows + 1), np.zeros(rows, bool)))
            proj = bf16((rows, features))
            decode[str(rows)] = 1000 * timed_ms(proj, seqs, 50)  # µs
            try:
                decode_graph[str(rows)] = 1000 * replayed_ms(proj, seqs)  # µs
            except Exception as exc:  # keep the launch timings; say why the replay is missing
                decode_graph[str(rows)] = None
                print(f"{variant}: decode bs {rows}: graph replay not measured: {exc!r}", flush=True)
        for length in args.prefill:
            seqs = cuda_ops.prepare_sequences(StepSequences(np.array([0, length]), np.array([1]), np.array([True])))
            prefill[str(length)] = timed_ms(bf16((length, features)), seqs, 3)  # ms
        timings[variant] = {"decode_us": decode, "decode_graph_us": decode_graph, "prefill_ms": prefill}
        print(f"{variant}: one GDN layer core: decode µs {decode} (graph replay {decode_graph}), "
              f"prefill ms {prefill}", flush=True)
    set_kernels("after")
    return timings


def run_variant(path: Path, variant: str, args: argparse.Namespace, results: dict) -> None:
    import openinfer

    set_kernels(variant)
    start = time.perf_counter()
    engine = openinfer.create_engine(path, device="cuda", max_model_len=max(args.prefill) + 256, max_num_seqs=64)
    results["engine_start_s"][variant] = time.perf_counter() - start
    try:
        if variant == "after":
            gc.collect()
            results["idle_rss_bytes"] = process_rss()
            print(f"idle RSS after start: {results['idle_rss_bytes']}", flush=True)
            results["kv_plan"] = {"num_blocks": engine.kv_plan.num_blocks,
                                  "num_state_slots": engine.kv_plan.num_state_slots,
                                  "num_snapshot_slots": engine.kv_plan.num_snapshot_slots}
        prompts = Prompts(args.vocab_size)
        tpot(engine, prompts, 2, 64, 8, f"warm-{variant}")
        prefill_ttft(engine, prompts, 512, 1, f"warm-{variant}")
        for length in args.prefill:
            ttft = prefill_ttft(engine, prompts, length, args.repeats, variant)
            results["prefill_ttft_ms"][variant][str(length)] = ttft
            print(f"{variant}: prefill {length} tokens TTFT {ttft:.1f} ms", flush=True)
        for streams in args.streams:
            value = tpot(engine, prompts, streams, 512, args.new_tokens, variant)
            results["decode_tpot_ms"][variant][str(streams)] = value
            print(f"{variant}: TPOT at {streams} streams {value:.2f} ms", flush=True)
        if variant == "after":
            results["multi_turn"] = multi_turn(engine, prompts, 4000, 50, args.repeats)
            print(f"multi-turn: {results['multi_turn']}", flush=True)
    finally:
        engine.close_sync()
        os.environ.pop(KERNELS_ENV, None)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is missing (no plot then)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (prefill, decode, core, turn_axis) = plt.subplots(1, 4, figsize=(20, 4.2))
    lengths = list(results["prefill_ttft_ms"]["after"])
    width = 0.38
    for offset, variant in ((-width / 2, "before"), (width / 2, "after")):
        values = [results["prefill_ttft_ms"][variant].get(n, 0.0) for n in lengths]
        prefill.bar([i + offset for i in range(len(lengths))], values, width, label=variant)
    prefill.set_xticks(range(len(lengths)), [f"{int(n) // 1024}k" for n in lengths])
    prefill.set_yscale("log")
    prefill.set_ylabel("TTFT ms (log)")
    prefill.set_title("prefill, one request")
    prefill.legend()
    for variant in ("before", "after"):
        measured = results["decode_tpot_ms"][variant]
        decode.plot([int(s) for s in measured], list(measured.values()), marker="o", label=variant)
    decode.set_xscale("log", base=2)
    decode.set_xlabel("concurrent streams")
    decode.set_ylabel("TPOT ms")
    decode.set_title("decode (CUDA graphs)")
    decode.legend()
    layer = results.get("gdn_layer_core")
    if layer:
        labels = [f"decode bs {b}" for b in layer["after"]["decode_us"]] + [
            f"prefill {int(n) // 1024}k" for n in layer["after"]["prefill_ms"]]
        ratios = [layer["before"]["decode_us"][b] / layer["after"]["decode_us"][b] for b in layer["after"]["decode_us"]]
        ratios += [layer["before"]["prefill_ms"][n] / layer["after"]["prefill_ms"][n]
                   for n in layer["after"]["prefill_ms"]]
        core.bar(labels, ratios)
        core.axhline(1.0, color="gray", linewidth=0.8)
        core.set_yscale("log")
        core.set_ylabel("before / after (device time)")
        core.set_title("one GDN layer core (conv, delta rule, norm)")
        core.tick_params(axis="x", rotation=30)
    turn = results.get("multi_turn")
    if turn:
        turn_axis.bar(["cold (recomputed)", "warm (prefix cache)"], [turn["cold_ttft_ms"], turn["warm_ttft_ms"]])
        turn_axis.set_ylabel("TTFT ms")
        turn_axis.set_title(f"2nd turn: {turn['history_tokens']} history + {turn['new_turn_tokens']} new")
    fig.suptitle(f"Qwen3.5-4B shape (random bf16), {results.get('device', '')}: Gated DeltaNet kernels "
                 "before (recurrent) / after (chunked prefill, fused decode)")
    fig.tight_layout()
    fig.savefig(path)


def plot_multi_turn(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    turn = results["multi_turn"]
    fig, axis = plt.subplots(figsize=(5, 4))
    axis.bar(["cold (recomputed)", "warm (prefix cache)"], [turn["cold_ttft_ms"], turn["warm_ttft_ms"]])
    axis.set_ylabel("TTFT ms (median)")
    axis.set_title(f"2nd turn: {turn['history_tokens']} history + {turn['new_turn_tokens']} new\n"
                   f"{results['shape']}, {results['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu (NumPy backend)"
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def run_multi_turn_only(path: Path, args: argparse.Namespace) -> dict:
    """The default engine's start, idle RSS (with CuPy's pinned / device pools: what a "shared"
    part would be), bs=1 TPOT and a warm vs cold second chat turn, nothing else: the part of this
    benchmark that goes beside gpu_concurrency.py's vLLM side by side."""
    import openinfer
    from openinfer.engine_core.startup import memory_breakdown

    results: dict = {"shape": f"Qwen3.5 {args.shape} (multimodal layout, random bf16)", "device": device_name(args.device),
                     "env": {k: os.environ.get(k, "") for k in MULTI_TURN_SWITCHES}}
    start = time.perf_counter()
    max_model_len = max(args.history + args.new_turn + 64, BS1_PROMPT + BS1_NEW_TOKENS + 64)
    trace_dir = Path(tempfile.mkdtemp(prefix="gpu-qwen35-trace-")) if args.timeline else None
    engine = openinfer.create_engine(path, device=args.device, max_model_len=max_model_len, max_num_seqs=64,
                                     **({"trace_dir": str(trace_dir)} if trace_dir else {}))
    results["engine_start_s"] = time.perf_counter() - start
    try:
        if args.gc_freeze:  # as the serving engine-core process does after start-up
            from openinfer.engine_core.startup import freeze_startup_heap

            results["gc_frozen_objects"] = freeze_startup_heap()
        gc.collect()
        results["idle_rss_bytes"] = process_rss()
        results["memory_breakdown"] = memory_breakdown()
        results["kv_plan"] = {"num_blocks": engine.kv_plan.num_blocks,
                              "num_state_slots": engine.kv_plan.num_state_slots,
                              "num_snapshot_slots": engine.kv_plan.num_snapshot_slots}
        print(f"engine up in {results['engine_start_s']:.1f} s; idle RSS {results['idle_rss_bytes']}; "
              f"{results['kv_plan']}", flush=True)
        prompts = Prompts(args.vocab_size)
        prefill_ttft(engine, prompts, min(512, args.history), 1, "warm-up")
        # bs=1 decode in this process: beside gpu_concurrency's 1-stream row, the HTTP path's share
        results["decode_tpot_ms_bs1"] = tpot(engine, prompts, 1, BS1_PROMPT, BS1_NEW_TOKENS, "bs1")
        print(f"bs=1 TPOT ({BS1_PROMPT}-token prompt): {results['decode_tpot_ms_bs1']:.2f} ms", flush=True)
        import threading

        results["threads"] = sorted(t.name for t in threading.enumerate())  # who shares the GIL with the engine
        results["multi_turn"] = multi_turn(engine, prompts, args.history, args.new_turn, args.repeats, trace_dir)
        print(f"multi-turn: {results['multi_turn']}", flush=True)
        # a lone cold prompt shorter than a few blocks: its steps (one, with in-step snapshots)
        spy = StepSpy(engine, trace_dir)
        results["short_prompt_ttft_ms"], results["short_prompt_last"] = {}, {}
        for length in SHORT_PROMPTS:
            results["short_prompt_ttft_ms"][length] = prefill_ttft(engine, prompts, length, max(3, args.repeats) - 1,
                                                                   "short")
            spy.calls.clear()
            began = time.time()
            ttft = 1000 * asyncio.run(timed(engine, make_request(f"short-last-{length}", prompts.tokens(length), 1)))[0]
            results["short_prompt_last"][length] = {"ttft_ms": round(ttft, 2), "forwards": spy.before_first_token(),
                                                    "timeline": spy.timeline(f"short-last-{length}", began)}
        spy.close()
        print(f"short cold prompts TTFT ms: {results['short_prompt_ttft_ms']}", flush=True)
    finally:
        engine.close_sync()
    name = args.tag or "gpu_qwen35_multi_turn" + ("_cpu_dry_run" if args.device == "cpu" else "")
    write_results(results, name, plot_multi_turn)
    return results


def run_decode_kernels_only(args: argparse.Namespace) -> dict:
    """One GDN layer's decode step at the 4B shape, ``OPENINFER_QWEN35_GDN_DECODE`` plain against
    early_loads (the token's scalars read beside the state column), at ``DECODE_ROWS`` rows:
    back-to-back launches and CUDA-graph replay (results/gpu_qwen35_decode_kernels.json + .png)."""
    args.streams, args.prefill = DECODE_ROWS, ()
    results: dict = {"shape": "Qwen3.5-4B GDN layer (32 value heads of 128x128 fp32 state)",
                     "device": device_name("cuda"),
                     "variants": {"plain": f"{DECODE_ENV}=plain: gdn_decode_step, grid (rows, 32), "
                                           "2 blocks of 512 threads per SM",
                                  "early_loads": f"{DECODE_ENV}=early_loads: gdn_decode_step_early_loads, the same "
                                                 "grid, gate inputs / z / norm weight read beside the state column"}}
    results["gdn_layer_core"] = layer_core_timings(args, DECODE_VARIANTS)
    # graph replay where it was measured, else back-to-back launches (device-bound from 16 rows)
    replay = {v: {rows: graphed or results["gdn_layer_core"][v]["decode_us"][rows]
                  for rows, graphed in results["gdn_layer_core"][v]["decode_graph_us"].items()}
              for v in DECODE_VARIANTS}
    results["early_loads_speedup_graph"] = {rows: replay["plain"][rows] / replay["early_loads"][rows]
                                            for rows in replay["plain"] if replay["plain"][rows] and replay["early_loads"][rows]}
    # state bytes each step moves (read + write, fp32), over the replayed time: the kernel's bandwidth
    state_bytes = 2 * 32 * 128 * 128 * 4
    results["state_bandwidth_tb_s"] = {v: {rows: int(rows) * state_bytes / (us * 1e-6) / 1e12
                                           for rows, us in replay[v].items() if us} for v in replay}
    print(json.dumps({k: results[k] for k in ("early_loads_speedup_graph", "state_bandwidth_tb_s")}), flush=True)
    write_results(results, "gpu_qwen35_decode_kernels", plot_decode_kernels)
    return results


def prefill_kernel_timings(steps=GDN_PREFILL_STEPS, repeats: int = 5, variants=tuple(PREFILL_VARIANTS)) -> dict:
    """One GDN layer's prefill path at the 4B shape, per kernel (``cuda_ops.kernel_timer``: CUDA
    events around each launch), for each (prompts, tokens each, decode rows) step and each
    PREFILL_VARIANTS environment: the median over ``repeats`` calls of each kernel's ms and the
    whole call's (events around ``delta_net``, so launch gaps included)."""
    import cupy
    import numpy as np
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.state import StepSequences

    layer = random_gdn_layer()
    config, bf16, weights = layer.config, layer.bf16, layer.weights
    nv, dk, dv, width, features = layer.nv, layer.dk, layer.dv, layer.width, layer.features
    results: dict = {}
    for variant in variants:
        environment = PREFILL_VARIANTS[variant]
        for name in environment:
            os.environ.pop(name, None)
        os.environ.update(environment)
        repeats_context = (compiled_with(**DIAGNOSTIC_BUILDS[variant]) if variant in DIAGNOSTIC_BUILDS
                           else contextlib.nullcontext())
        with repeats_context:
            per_step = {}
            for num_prompts, length, decodes in steps:
                num_seqs = num_prompts + decodes
                conv_state = bf16((num_seqs + 1, width - 1, config.conv_dim))
                ssm_state = cupy.zeros((num_seqs + 1, nv, dk, dv), dtype=cupy.float32)
                query_start = np.concatenate([np.arange(num_prompts + 1) * length,
                                              num_prompts * length + np.arange(1, decodes + 1)])
                fresh = np.arange(num_seqs) < num_prompts  # the decode rows continue their slots
                seqs = cuda_ops.prepare_sequences(StepSequences(query_start, np.arange(1, num_seqs + 1), fresh))
                proj = bf16((int(query_start[-1]), features))
                cuda_ops.delta_net(proj, weights, conv_state, ssm_state, seqs, config)  # compile, warm
                kernels: dict[str, list[float]] = {}
                totals = []
                for _ in range(repeats):
                    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                    with cuda_ops.kernel_timer() as times:
                        start.record()
                        cuda_ops.delta_net(proj, weights, conv_state, ssm_state, seqs, config)
                        stop.record()
                    stop.synchronize()
                    totals.append(cupy.cuda.get_elapsed_time(start, stop))
                    for name, ms in times.items():
                        kernels.setdefault(name, []).append(ms)
                step = f"{num_prompts}x{length}" + (f"+{decodes}dec" if decodes else "")
                per_step[step] = {"total_ms": statistics.median(totals),
                                  "kernel_ms": {k: statistics.median(v) for k, v in kernels.items()}}
                print(f"prefill {variant} {step}: {per_step[step]}", flush=True)
        results[variant] = per_step
        for name in environment:
            os.environ.pop(name, None)
    return results


ROW_KERNEL_ROWS = (64, 1024, 8192)  # a decode batch, a 1k prefill, a mixed step of the burst


def row_kernel_timings(rows=ROW_KERNEL_ROWS, features: int = 4096, calls: int = 20) -> dict:
    """The plugin's row kernels at the 4B width, ``OPENINFER_QWEN35_ROW_KERNELS`` plain vs vec:
    mean µs a call of ``add_rms_norm`` (the 63 a forward) and ``sigmoid_mul`` (the gate a column
    slice of a wider row, as the attention's q|gate projection), back-to-back launches, by CUDA
    events."""
    import cupy
    import numpy as np
    from openinfer_qwen35 import cuda_ops

    rng = np.random.default_rng(0)

    def bf16(shape):
        return cupy.asarray((rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))

    weight = cupy.asarray((1.0 + 0.3 * rng.standard_normal(features)).astype(np.float32))
    results: dict = {}
    for choice in ("plain", "vec"):
        os.environ[cuda_ops.ROW_KERNELS_ENV] = choice
        timed = {}
        for m in rows:
            x, residual, wide = bf16((m, features)), bf16((m, features)), bf16((m, 2 * features))
            ops = {"add_rms_norm": lambda: cuda_ops.add_rms_norm(x, residual, weight, 1e-6),  # noqa: B023
                   "sigmoid_mul": lambda: cuda_ops.sigmoid_mul(x, wide[:, features:])}  # noqa: B023
            for name, op in ops.items():
                op()
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                for _ in range(calls):
                    op()
                stop.record()
                stop.synchronize()
                timed.setdefault(name, {})[str(m)] = 1000 * cupy.cuda.get_elapsed_time(start, stop) / calls
        results[choice] = timed
        print(f"row kernels {choice}: {timed}", flush=True)
    os.environ.pop(cuda_ops.ROW_KERNELS_ENV, None)
    return results


def copy_bandwidth_tb_s(nbytes: int, repeats: int = 20) -> float:
    """Device-to-device copy rate (bytes read + written per second, TB/s) of an ``nbytes`` buffer:
    the bandwidth floor a decode step's state read and write can reach."""
    import cupy

    source, target = cupy.ones(nbytes // 4, dtype=cupy.float32), cupy.empty(nbytes // 4, dtype=cupy.float32)
    target[...] = source
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        target[...] = source
    stop.record()
    stop.synchronize()
    return 2 * nbytes * repeats / (cupy.cuda.get_elapsed_time(start, stop) * 1e-3) / 1e12


def run_gdn_kernels_only(args: argparse.Namespace) -> dict:
    """One GDN layer at the 4B shape, kernel by kernel (issue 17's 64-stream burst): every fused
    decode kernel at GDN_DECODE_ROWS rows (CUDA-graph replay, against plain), and the prefill
    path's kernels for GDN_PREFILL_STEPS (results/gpu_qwen35_gdn_kernels.json + .png)."""
    args.streams, args.prefill = GDN_DECODE_ROWS, ()
    results: dict = {"shape": "Qwen3.5-4B GDN layer (16 key / 32 value heads of 128, fp32 128x128 state)",
                     "device": device_name("cuda"),
                     "decode_variants": {v: KERNEL_ENVIRONMENTS[v] for v in GDN_DECODE_VARIANTS},
                     "prefill_variants": PREFILL_VARIANTS}
    results["gdn_layer_core"] = layer_core_timings(args, GDN_DECODE_VARIANTS)
    replay = {v: {rows: graphed or results["gdn_layer_core"][v]["decode_us"][rows]
                  for rows, graphed in results["gdn_layer_core"][v]["decode_graph_us"].items()}
              for v in GDN_DECODE_VARIANTS}
    results["decode_replay_us"] = replay
    results["decode_speedup_over_plain"] = {v: {rows: replay["plain"][rows] / us for rows, us in replay[v].items()
                                                if us and replay["plain"][rows]} for v in GDN_DECODE_VARIANTS}
    state_bytes = 2 * 32 * 128 * 128 * 4  # fp32 state read + written per row
    results["state_bandwidth_tb_s"] = {v: {rows: int(rows) * state_bytes / (us * 1e-6) / 1e12
                                           for rows, us in replay[v].items() if us} for v in replay}
    results["copy_tb_s"] = copy_bandwidth_tb_s(max(GDN_DECODE_ROWS) * state_bytes // 2)  # the floor, same run
    print(json.dumps({k: results[k] for k in ("decode_speedup_over_plain", "state_bandwidth_tb_s", "copy_tb_s")}),
          flush=True)
    write_results(results, "gpu_qwen35_gdn_kernels", plot_gdn_kernels)  # the decode half survives a prefill failure
    results["prefill_kernels"] = prefill_kernel_timings()
    write_results(results, "gpu_qwen35_gdn_kernels", plot_gdn_kernels)
    results["row_kernels_us"] = row_kernel_timings()
    write_results(results, "gpu_qwen35_gdn_kernels", plot_gdn_kernels)
    return results


def run_gdn_decode_only(args: argparse.Namespace) -> dict:
    """One GDN layer's fused decode step at the 4B shape for each ``--decode-variants`` kernel at
    GDN_DECODE_ROWS rows (24 calls in a CUDA graph, replayed), its state traffic against a copy
    of the same bytes in the same run (results/gpu_qwen35_gdn_decode.json)."""
    variants = tuple(args.decode_variants.split(","))
    args.streams, args.prefill = GDN_DECODE_ROWS, ()
    results: dict = {"shape": "Qwen3.5-4B GDN layer (32 value heads of 128x128 fp32 state)",
                     "device": device_name("cuda"), "decode_variants": {v: KERNEL_ENVIRONMENTS[v] for v in variants}}
    timings = layer_core_timings(args, variants)
    replay = {v: {rows: graphed or timings[v]["decode_us"][rows] for rows, graphed in timings[v]["decode_graph_us"].items()}
              for v in variants}
    results["decode_replay_us"] = replay
    base = variants[0]
    results["speedup_over"] = base
    results["speedup"] = {v: {rows: replay[base][rows] / us for rows, us in replay[v].items() if us and replay[base][rows]}
                          for v in variants}
    state_bytes = 2 * 32 * 128 * 128 * 4  # fp32 state read + written per row
    results["state_bandwidth_tb_s"] = {v: {rows: int(rows) * state_bytes / (us * 1e-6) / 1e12
                                           for rows, us in replay[v].items() if us} for v in replay}
    results["copy_tb_s"] = copy_bandwidth_tb_s(max(GDN_DECODE_ROWS) * state_bytes // 2)  # the floor, same run
    print(json.dumps({k: results[k] for k in ("speedup", "state_bandwidth_tb_s", "copy_tb_s")}), flush=True)
    write_results(results, "gpu_qwen35_gdn_decode", None)
    return results


# each prepare kernel's GDN_PHASE marks, in order (grouped: the per-head phases summed over the group's heads)
PREPARE_PHASES = {"gdn_chunk_prepare_blocked": ("q / k / v staged", "q / k normed, gates", "cumulative decay",
                                                "P and A (tensor cores)", "T = (I + A)^-1",
                                                "T, (beta V)^T, (beta exp(c) K)^T to bf16",
                                                "U and W (tensor cores) stored"),
                  "gdn_chunk_prepare_grouped_mma": ("q / k loaded and normed", "scores (tensor cores)",
                                                    "gates, cumulative decay", "P and A", "T = (I + A)^-1",
                                                    "W and U (tensor cores) stored")}
PREPARE_PHASES["gdn_chunk_prepare_grouped_coalesced"] = PREPARE_PHASES["gdn_chunk_prepare_grouped_mma"]


def prepare_phase_cycles(prompts: int = 8, length: int = 1024, name: str = "gdn_chunk_prepare_blocked") -> dict:
    """Where a prepare block's time goes (kernel ``name``, ``prompts`` x ``length`` fresh tokens,
    the 4B shape): the kernel built with GDN_PHASE_CLOCKS (thread 0 of each block adds each phase's
    SM clock cycles to a device counter), launched once on random inputs; mean cycles a block per
    phase, and µs at the device's clock rate."""
    import cupy
    import numpy as np
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.gated_deltanet import chunk_layout

    from openinfer.backend.cuda import kernel_include_options

    layer = random_gdn_layer()
    config, bf16, weights = layer.config, layer.bf16, layer.weights
    nk, nv, dk, dv = config.linear_num_key_heads, layer.nv, layer.dk, layer.dv
    module = cupy.RawModule(code=(cuda_ops.KERNEL_DIR / "gdn_chunked.cu").read_text(),
                            options=("-std=c++17", *kernel_include_options(cuda_ops.KERNEL_DIR), f"-DDK={dk}",
                                     f"-DSPLIT={cuda_ops.SPLIT}", "-DGDN_PHASE_CLOCKS"))
    prepare = module.get_function(name)
    grouped = name.startswith("gdn_chunk_prepare_grouped")
    shared = (cuda_ops.chunk_prepare_grouped_shared_bytes(dk, dv, nv // nk) if grouped
              else cuda_ops.chunk_prepare_shared_bytes(dk, dv, staged=True))
    prepare.max_dynamic_shared_size_bytes = shared
    tokens = prompts * length
    starts, lengths, _ = chunk_layout(np.arange(prompts + 1) * length)
    num_chunks = len(starts)
    conv_out, proj = bf16((tokens, config.conv_dim), 0.5), bf16((tokens, layer.features))
    buffers = [cupy.empty((tokens, nk, dk), cupy.uint16), cupy.empty((tokens, nk, dk), cupy.uint16),
               cupy.empty((tokens, nv, dk), cupy.uint16), cupy.empty((tokens, nv, dv), cupy.uint16),
               cupy.empty((num_chunks, nv, 64, 64), cupy.uint16), cupy.empty((tokens, nv), cupy.float32)]
    args = (conv_out, proj, np.int32(proj.shape[1]), weights.neg_decay_rate, weights.dt_bias,
            cupy.asarray(starts.astype(np.int32)), cupy.asarray(lengths.astype(np.int32)), *buffers, np.int32(nk),
            np.int32(nv), np.int32(dv))
    counters = cupy.ndarray((8,), cupy.uint64, module.get_global("gdn_phase_cycles"))
    grid = (num_chunks, nk if grouped else nv)
    prepare(grid, (128,), args, shared_mem=shared)  # warm
    counters[...] = 0
    prepare(grid, (128,), args, shared_mem=shared)
    cupy.cuda.runtime.deviceSynchronize()
    cycles = cupy.asnumpy(counters).astype(float)
    blocks = cycles[0]
    clock_mhz = cupy.cuda.Device().attributes["ClockRate"] / 1000
    per_block = {phase: cycles[k + 1] / blocks for k, phase in enumerate(PREPARE_PHASES[name])}
    return {"kernel": name, "step": f"{prompts}x{length}", "blocks": int(blocks), "clock_mhz": clock_mhz,
            "cycles_per_block": per_block, "us_per_block": {k: v / clock_mhz for k, v in per_block.items()},
            "total_us_per_block": sum(per_block.values()) / clock_mhz}


SPLIT_PHASES = {"gdn_chunk_prepare_split": ("raw q / k / v staged, gates", "cumulative decay", "l2 norms",
                                            "scores (tensor cores), A and P stored", "T = (I + A)^-1",
                                            "U (tensor cores) stored", "W (tensor cores) stored"),
                "gdn_chunk_walk_split": ("state loaded, planes", "chunk operands staged (W / P fragments, q / k^T / U)",
                                         "V' = U - W S and Q S (tensor cores)", "P V' (tensor cores), O stored",
                                         "state update (tensor cores), planes", "state stored")}
SPLIT_PHASES["gdn_chunk_prepare_split_f16"] = SPLIT_PHASES["gdn_chunk_prepare_split"]
SPLIT_PHASES["gdn_chunk_walk_split_f16"] = SPLIT_PHASES["gdn_chunk_walk_split"]
SPLIT_CHAINS = {"chunked_split": ("gdn_chunk_prepare_split", "gdn_chunk_walk_split"),  # (prepare, walk)
                "chunked_split_f16": ("gdn_chunk_prepare_split_f16", "gdn_chunk_walk_split_f16")}


def split_phase_cycles(prompts: int = 8, length: int = 1024, chain: str = "chunked_split") -> dict:
    """Where a block of a split-operand chain (gdn_chunked_split.cu: SPLIT_CHAINS[chain]) spends its time,
    ``prompts`` x ``length`` fresh tokens at the 4B shape: both kernels built with GDN_PHASE_CLOCKS (lane 0 of
    each block's last warp adds each phase's SM clock cycles to a device counter; a walk's phases summed over
    its chunks), each launched once on random inputs after a warm launch; mean cycles a block per phase, and µs
    at the device's clock rate, per kernel."""
    import cupy
    import numpy as np
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.gated_deltanet import chunk_layout

    from openinfer.backend.cuda import kernel_include_options

    layer = random_gdn_layer()
    config, bf16, weights = layer.config, layer.bf16, layer.weights
    nk, nv, dk, dv = config.linear_num_key_heads, layer.nv, layer.dk, layer.dv
    module = cupy.RawModule(code=(cuda_ops.KERNEL_DIR / "gdn_chunked_split.cu").read_text(),
                            options=("-std=c++17", *kernel_include_options(cuda_ops.KERNEL_DIR), f"-DDK={dk}",
                                     f"-DSPLIT={cuda_ops.SPLIT}", "-DGDN_PHASE_CLOCKS"))
    prepare_name, walk_name = SPLIT_CHAINS[chain]
    prepare_bytes, walk_bytes = cuda_ops.chunked_split_shared_bytes(dk, dv, walk_name)
    prepare, walk = module.get_function(prepare_name), module.get_function(walk_name)
    prepare.max_dynamic_shared_size_bytes, walk.max_dynamic_shared_size_bytes = prepare_bytes, walk_bytes
    tokens = prompts * length
    starts, lengths, per_seq = (cupy.asarray(a.astype(np.int32)) for a in chunk_layout(np.arange(prompts + 1) * length))
    num_chunks = len(starts)
    conv_out, proj = bf16((tokens, config.conv_dim), 0.5), bf16((tokens, layer.features))
    norms = cupy.empty((tokens, nk, 2), cupy.float32)
    w32, u32 = cupy.empty((tokens, nv, dk), cupy.float32), cupy.empty((tokens, nv, dv), cupy.float32)
    p32, cum32 = cupy.empty((num_chunks, nv, 64, 64), cupy.float32), cupy.empty((tokens, nv), cupy.float32)
    slots, fresh = cupy.arange(prompts, dtype=cupy.int32), cupy.ones(prompts, dtype=cupy.int32)
    ssm_state = cupy.zeros((prompts, nv, dk, dv), cupy.float32)
    core = cupy.empty((tokens, nv * dv), cupy.uint16)
    launches = {prepare_name: (prepare, (num_chunks, nv), prepare_bytes,
                                            (conv_out, proj, np.int32(proj.shape[1]), weights.neg_decay_rate,
                                             weights.dt_bias, starts, lengths, norms, w32, u32, p32, cum32,
                                             np.int32(nk), np.int32(nv), np.int32(dv))),
                walk_name: (walk, (dv // cuda_ops.SPLIT_WALK_TILE, prompts, nv), walk_bytes,
                                         (conv_out, norms, w32, u32, p32, cum32, starts, lengths, per_seq, slots,
                                          fresh, ssm_state, core, np.int32(nk), np.int32(nv), np.int32(dv)))}
    counters = cupy.ndarray((16,), cupy.uint64, module.get_global("gdn_split_phase_cycles"))
    clock_mhz = cupy.cuda.Device().attributes["ClockRate"] / 1000
    results = {}
    for name, (function, grid, shared, args) in launches.items():
        function(grid, (cuda_ops.SPLIT_THREADS,), args, shared_mem=shared)  # warm
        counters[...] = 0
        function(grid, (cuda_ops.SPLIT_THREADS,), args, shared_mem=shared)
        cupy.cuda.runtime.deviceSynchronize()
        cycles = cupy.asnumpy(counters).astype(float)
        per_block = {phase: cycles[k + 1] / cycles[0] for k, phase in enumerate(SPLIT_PHASES[name])}
        results[name] = {"step": f"{prompts}x{length}", "blocks": int(cycles[0]), "clock_mhz": clock_mhz,
                         "cycles_per_block": per_block, "us_per_block": {k: v / clock_mhz for k, v in per_block.items()},
                         "total_us_per_block": sum(per_block.values()) / clock_mhz}
    return results


def parse_prefill_step(text: str) -> tuple[int, int, int]:
    """``PxL`` or ``PxL+D`` (P prompts of L tokens, D decode rows) as GDN_PREFILL_STEPS' (P, L, D)."""
    try:
        prompts_tokens, _, decodes = text.strip().partition("+")
        prompts, tokens = prompts_tokens.split("x")
        step = (int(prompts), int(tokens), int(decodes or 0))
    except ValueError:
        raise ValueError(f"--prefill-steps: {text!r} is not PxL or PxL+D (e.g. 8x1024+48)") from None
    if step[0] < 1 or step[1] < 1 or step[2] < 0:
        raise ValueError(f"--prefill-steps: {text!r}: prompts and tokens >= 1, decode rows >= 0")
    return step


def run_gdn_prefill_only(args: argparse.Namespace) -> dict:
    """One GDN layer's prefill path at the 4B shape, kernel by kernel, for each ``--prefill-variants``
    choice (OPENINFER_QWEN35_GDN_PREFILL) at GDN_PREFILL_STEPS (results/gpu_qwen35_gdn_prefill.json)."""
    variants = tuple(args.prefill_variants.split(","))
    results: dict = {"shape": "Qwen3.5-4B GDN layer (16 key / 32 value heads of 128, fp32 128x128 state)",
                     "device": device_name("cuda"), "prefill_variants": {v: PREFILL_VARIANTS[v] for v in variants}}
    steps = tuple(parse_prefill_step(step) for step in args.prefill_steps.split(","))
    results["prefill_kernels"] = prefill_kernel_timings(steps=steps, variants=variants)
    base = variants[0]
    results["total_speedup_over"] = base
    results["total_speedup"] = {
        v: {step: results["prefill_kernels"][base][step]["total_ms"] / timed["total_ms"] for step, timed in steps.items()}
        for v, steps in results["prefill_kernels"].items()}
    print(json.dumps(results["total_speedup"]), flush=True)
    write_results(results, "gpu_qwen35_gdn_prefill", plot_gdn_prefill)
    for variant in variants:
        if variant not in SPLIT_CHAINS:
            continue
        for prompts, length in ((8, 1024), (1, 1024)):
            phases = split_phase_cycles(prompts, length, variant)
            results.setdefault("split_phases", {}).setdefault(variant, {})[f"{prompts}x{length}"] = phases
            print(f"split phases {variant} {prompts}x{length}: {json.dumps(phases)}", flush=True)
        write_results(results, "gpu_qwen35_gdn_prefill", plot_gdn_prefill)
    if args.skip_prepare_phases:
        return results
    results["prepare_phases"] = {}
    for name in PREPARE_PHASES:
        results["prepare_phases"][name] = prepare_phase_cycles(name=name)
        print(f"prepare phases: {json.dumps(results['prepare_phases'][name])}", flush=True)
        write_results(results, "gpu_qwen35_gdn_prefill", plot_gdn_prefill)
    return results


def plot_gdn_kernels(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (decode, prefill) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [1, 2]})
    for variant, measured in results["decode_replay_us"].items():
        decode.plot([int(r) for r in measured], list(measured.values()), marker="o", label=variant)
    decode.set_xscale("log", base=2)
    decode.set_yscale("log")
    decode.set_xlabel("decode rows")
    decode.set_ylabel("µs per layer (CUDA-graph replay)")
    decode.set_title("GDN decode step, one layer")
    decode.legend()
    timed = results.get("prefill_kernels") or {}
    bars = [(f"{variant}\n{step}", entry["kernel_ms"]) for variant, steps in timed.items()
            for step, entry in steps.items()]
    names = sorted({name for _, kernels in bars for name in kernels})
    bottoms = [0.0] * len(bars)
    for name in names:
        values = [kernels.get(name, 0.0) for _, kernels in bars]
        prefill.bar([label for label, _ in bars], values, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    prefill.set_ylabel("ms per layer (CUDA events per kernel)")
    prefill.set_title("GDN prefill path (fresh prompts, + continuing decode rows)")
    prefill.tick_params(axis="x", labelsize=7)
    if names:
        prefill.legend(fontsize=7)
    fig.suptitle(f"{results['shape']}, {results['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def plot_gdn_prefill(results: dict, path: Path) -> None:
    """The prefill path's kernels stacked per variant and step, and each prepare kernel's phases."""
    plt = pyplot()
    if plt is None:
        return
    fig, (kernels_axis, phases_axis) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [2, 1]})
    bars = [(f"{variant}\n{step}", entry["kernel_ms"]) for variant, steps in results["prefill_kernels"].items()
            for step, entry in steps.items()]
    names = sorted({name for _, kernels in bars for name in kernels})
    bottoms = [0.0] * len(bars)
    for name in names:
        values = [kernels.get(name, 0.0) for _, kernels in bars]
        kernels_axis.bar([label for label, _ in bars], values, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    kernels_axis.set_ylabel("ms per layer (CUDA events per kernel)")
    kernels_axis.set_title("GDN prefill path per OPENINFER_QWEN35_GDN_PREFILL")
    kernels_axis.tick_params(axis="x", labelsize=7)
    kernels_axis.legend(fontsize=7)
    for k, (name, phases) in enumerate((results.get("prepare_phases") or {}).items()):
        bottom = 0.0
        for phase, us in phases["us_per_block"].items():
            phases_axis.bar([name.removeprefix("gdn_chunk_prepare_")], [us], bottom=bottom, label=f"{k}: {phase}")
            bottom += us
    phases_axis.set_ylabel("µs a block (SM clock, thread 0)")
    phases_axis.set_title("prepare phases at 8 x 1k")
    phases_axis.legend(fontsize=6)
    fig.suptitle(f"{results['shape']}, {results['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def write_dummy_config(path: Path, shape: str) -> None:
    """Only a config.json (the multimodal layout's, without torch): the engine then loads random
    weights at the real shapes (``load_format="dummy"``), so a timing needs no checkpoint write."""
    text, vision = SHAPES[shape]
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": vision,
              "tie_word_embeddings": text["tie_word_embeddings"], "vocab_size": text["vocab_size"]}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))


def run_decode_tpot_only(args: argparse.Namespace) -> dict:
    """Decode TPOT through the default engine (CUDA graphs) at 1 / 16 / 64 streams, for each
    ``--decode-variants`` environment (``OPENINFER_QWEN35_GDN_DECODE``; each variant's engine
    captures its own graphs; speed-ups over the first), on random weights at the ``--shape``'s
    real shapes (results/gpu_qwen35_decode_tpot.json)."""
    import openinfer

    path = Path(args.checkpoint)
    write_dummy_config(path, args.shape)
    args.vocab_size = SHAPES[args.shape][0]["vocab_size"]
    streams = (1, 16, 64)
    results: dict = {"shape": f"Qwen3.5 {args.shape} (random weights, load_format dummy)",
                     "device": device_name(args.device), "prompt_tokens": 512, "new_tokens": 64,
                     "decode_tpot_ms": {}, "engine_start_s": {}}
    variants = tuple(args.decode_variants.split(","))
    for variant in variants:
        set_kernels(variant)
        start = time.perf_counter()
        engine = openinfer.create_engine(path, device=args.device, max_model_len=1024, max_num_seqs=64,
                                         load_format="dummy")
        results["engine_start_s"][variant] = time.perf_counter() - start
        try:
            prompts = Prompts(args.vocab_size)
            tpot(engine, prompts, 2, 64, 8, f"warm-{variant}")
            results["decode_tpot_ms"][variant] = {str(n): tpot(engine, prompts, n, 512, 64, f"{variant}-{n}")
                                                  for n in streams}
            print(f"{variant}: TPOT ms {results['decode_tpot_ms'][variant]}", flush=True)
        finally:
            engine.close_sync()
            del engine  # its device memory back before the next variant's engine plans its KV cache
            gc.collect()
            if args.device == "cuda":
                import cupy

                cupy.get_default_memory_pool().free_all_blocks()
    set_kernels("after")
    timed, baseline = results["decode_tpot_ms"], variants[0]
    results["speedup_over"] = baseline
    results["speedup"] = {v: {n: timed[baseline][n] / ms for n, ms in timed[v].items()} for v in variants}
    print(f"speed-up over {baseline}: {results['speedup']}", flush=True)
    write_results(results, "gpu_qwen35_decode_tpot" + ("_cpu_dry_run" if args.device == "cpu" else ""), None)
    return results


# --step-ledger-only: a mixed step of the 64-stream burst (8 fresh ~1k prompts beside 48 decodes, as
# the burst's steps 3-8 in the step logs) and a decode step of 64 streams at ~1.1k context
LEDGER_PROMPTS, LEDGER_PROMPT_LEN, LEDGER_DECODES, LEDGER_DECODE_CONTEXT = 8, 1008, 48, 1100
LEDGER_PREFILL_VARIANTS = ("registers", "grouped_staged", "grouped_coalesced")


def run_step_ledger_only(args: argparse.Namespace) -> dict:
    """Where a 64-stream burst's device time goes: the engine's op ledger (``openinfer.tools.ledger``:
    each op's device time in a real step's order, kernels, bytes, % roofline) of one mixed step
    (LEDGER_PROMPTS x LEDGER_PROMPT_LEN fresh prompt tokens + LEDGER_DECODES decodes) per
    ``OPENINFER_QWEN35_GDN_PREFILL`` choice of LEDGER_PREFILL_VARIANTS, and of a 64-row decode step
    (graph replay), on random weights at the ``--shape``'s real shapes
    (results/gpu_qwen35_step_ledger.json)."""
    import openinfer
    from openinfer.tools.ledger import HostTimer, Ledger, StepLayout, Timer, ceilings
    from openinfer.tools.ledger.batches import step_batch

    path = Path(args.checkpoint)
    write_dummy_config(path, args.shape)
    prompt_len = min(LEDGER_PROMPT_LEN, 96) if args.device == "cpu" else LEDGER_PROMPT_LEN
    decode_context = min(LEDGER_DECODE_CONTEXT, 128) if args.device == "cpu" else LEDGER_DECODE_CONTEXT
    prompts, decodes = (2, 4) if args.device == "cpu" else (LEDGER_PROMPTS, LEDGER_DECODES)
    engine = openinfer.create_engine(path, device=args.device, max_model_len=2048, max_num_seqs=64,
                                     enable_prefix_cache=False, load_format="dummy")
    results: dict = {"shape": f"Qwen3.5 {args.shape} (random weights, load_format dummy)",
                     "device": device_name(args.device),
                     "mixed_step": f"{prompts} x {prompt_len} fresh prompt tokens + {decodes} decodes at "
                                   f"{decode_context} context",
                     "decode_step": f"64 decodes at {decode_context} context", "steps": {}}
    name_of_results = "gpu_qwen35_step_ledger" + ("_cpu_dry_run" if args.device == "cpu" else "")
    try:
        timer = Timer() if args.device == "cuda" else HostTimer()
        ledger = Ledger(engine, timer, ceilings(timer), args.repeats)
        layout = StepLayout.of(engine)
        mixed = step_batch([prompt_len] * prompts + [1] * decodes,
                           [prompt_len] * prompts + [decode_context] * decodes, layout)
        steps = [(f"mixed {variant}", variant, mixed) for variant in LEDGER_PREFILL_VARIANTS]
        steps.insert(1, ("decode 64", None, ledger.decode(64, decode_context)))  # before the other variants
        for name, variant, batch in steps:
            os.environ.pop(PREFILL_ENV, None)
            if variant:
                os.environ[PREFILL_ENV] = variant
            entry = ledger.measure("step", batch)
            ops = [{"op": row["op"], "kernels": row["kernels"], "calls": row["calls"],
                    "ms": row["time_s"] * 1e3, "roofline_pct": row.get("roofline_pct")} for row in entry["ops"]]
            results["steps"][name] = {"measured_ms": entry["measured_s"] * 1e3, "measured_how": entry["measured_how"],
                                      "ops_sum_ms": entry["sum_device_s"] * 1e3, "ops": ops}
            print(f"{name}: measured {entry['measured_s'] * 1e3:.3f} ms ({entry['measured_how']}), ops sum "
                  f"{entry['sum_device_s'] * 1e3:.3f} ms", flush=True)
            for op in ops[:12]:
                pct = "" if op["roofline_pct"] is None else f" {op['roofline_pct']:.0f} %"
                print(f"  {op['op']:<34} {op['ms']:8.3f} ms x{op['calls']:<3} {','.join(op['kernels'])}{pct}",
                      flush=True)
            write_results(results, name_of_results, None)  # what was measured survives a later time limit
    finally:
        os.environ.pop(PREFILL_ENV, None)
        engine.close_sync()
    return results


def plot_decode_kernels(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axis = plt.subplots(figsize=(6, 4))
    for variant, label in (("plain", "plain"), ("early_loads", "early loads (scalars beside the state)")):
        measured = {int(r): us for r, us in results["gdn_layer_core"][variant]["decode_graph_us"].items() if us}
        axis.plot(list(measured), list(measured.values()), marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("decode rows")
    axis.set_ylabel("µs per layer (CUDA-graph replay)")
    axis.set_title(f"GDN decode step, one layer, {results['device']}", fontsize=9)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/qwen35-4b-mm")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="4b",
                        help="the checkpoint written when missing (tiny: toy widths for a CPU dry run)")
    parser.add_argument("--write-checkpoint-only", action="store_true",
                        help="write the checkpoint (if missing) and exit: for gpu_concurrency.py and vLLM")
    parser.add_argument("--multi-turn-only", action="store_true",
                        help="engine start, idle RSS, bs=1 TPOT and the warm vs cold second turn only "
                             "(results/gpu_qwen35_multi_turn.json)")
    parser.add_argument("--decode-kernels-only", action="store_true",
                        help="one GDN layer's decode step, plain vs early-loads kernel, at 1-256 rows "
                             "(results/gpu_qwen35_decode_kernels.json; no checkpoint)")
    parser.add_argument("--decode-tpot-only", action="store_true",
                        help="engine decode TPOT at 1/16/64 streams per --decode-variants GDN decode kernel, on random "
                             "weights (writes only CHECKPOINT/config.json; results/gpu_qwen35_decode_tpot.json)")
    parser.add_argument("--gdn-kernels-only", action="store_true",
                        help="one GDN layer kernel by kernel: every fused decode kernel at 1-256 rows and the "
                             "prefill path's kernels at 8 x 1k (results/gpu_qwen35_gdn_kernels.json; no checkpoint)")
    parser.add_argument("--step-ledger-only", action="store_true",
                        help="op ledger of a 64-stream burst's mixed step per GDN prefill choice and of a 64-row "
                             "decode step, random weights (writes only CHECKPOINT/config.json; "
                             "results/gpu_qwen35_step_ledger.json)")
    parser.add_argument("--gdn-decode-only", action="store_true",
                        help="one GDN layer's fused decode step per --decode-variants kernel at 1-256 rows, graph "
                             "replay, against a copy (results/gpu_qwen35_gdn_decode.json; no checkpoint)")
    parser.add_argument("--gdn-prefill-only", action="store_true",
                        help="one GDN layer's prefill kernels per --prefill-variants choice at 8 x 1k (+ 48 decode rows) "
                             "and 1 x 1k (results/gpu_qwen35_gdn_prefill.json; no checkpoint)")
    parser.add_argument("--prefill-variants", default="registers,grouped_mma,grouped_staged,grouped_coalesced",
                        help="--gdn-prefill-only: comma list of OPENINFER_QWEN35_GDN_PREFILL choices (the first is the "
                             f"baseline; of {', '.join(PREFILL_VARIANTS)})")
    parser.add_argument("--skip-prepare-phases", action="store_true",
                        help="--gdn-prefill-only: without the default chain's prepare phase clocks")
    parser.add_argument("--prefill-steps", default=",".join(f"{p}x{n}" + (f"+{d}" if d else "")
                                                         for p, n, d in GDN_PREFILL_STEPS),
                        help="--gdn-prefill-only: comma list of steps PxL[+D] (P prompts of L tokens, D decode rows)")
    parser.add_argument("--decode-variants", default=",".join(DECODE_VARIANTS),
                        help="--decode-tpot-only: comma list of GDN decode kernels to compare (the first is the "
                             f"baseline; of {', '.join(GDN_DECODE_VARIANTS)})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: only with --multi-turn-only or --decode-tpot-only (a dry run on the NumPy backend)")
    parser.add_argument("--history", type=int, default=4000, help="--multi-turn-only: history tokens")
    parser.add_argument("--new-turn", type=int, default=50, help="--multi-turn-only: new tokens of the turn")
    parser.add_argument("--quick", action="store_true", help="1k/4k prefill, 1/16 streams, 32 new tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeline", action="store_true",
                        help="--multi-turn-only: the engine traces (a temporary trace_dir) and each warm turn's engine "
                             "spans (queue, prefill chunks, decode steps) go into the results")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="--multi-turn-only: freeze the start-up heap (gc.freeze) as `openinfer serve`'s engine core does")
    parser.add_argument("--tag", default="", help="--multi-turn-only: the results' name (default gpu_qwen35_multi_turn)")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not (args.multi_turn_only or args.decode_tpot_only or args.step_ledger_only):
        parser.error("--device cpu runs only with --multi-turn-only, --decode-tpot-only or --step-ledger-only "
                     "(a dry run)")
    if not args.decode_variants or any(v not in GDN_DECODE_VARIANTS for v in args.decode_variants.split(",")):
        parser.error(f"--decode-variants: a comma list of {', '.join(GDN_DECODE_VARIANTS)}")
    if not args.prefill_variants or any(v not in PREFILL_VARIANTS for v in args.prefill_variants.split(",")):
        parser.error(f"--prefill-variants: a comma list of {', '.join(PREFILL_VARIANTS)}")
    try:
        [parse_prefill_step(step) for step in args.prefill_steps.split(",")]
    except ValueError as error:
        parser.error(str(error))
    if args.repeats < 1 or args.history < 64 or args.new_turn < 1:
        parser.error("--repeats and --new-turn must be >= 1, --history >= 64")
    if args.decode_kernels_only:
        run_decode_kernels_only(args)
        return 0
    if args.gdn_kernels_only:
        run_gdn_kernels_only(args)
        return 0
    if args.gdn_prefill_only:
        run_gdn_prefill_only(args)
        return 0
    if args.gdn_decode_only:
        run_gdn_decode_only(args)
        return 0
    if args.decode_tpot_only:
        run_decode_tpot_only(args)
        return 0
    if args.step_ledger_only:
        run_step_ledger_only(args)
        return 0
    path = Path(args.checkpoint)
    if args.write_checkpoint_only:
        if not (path / "config.json").exists():
            print(f"wrote {path} in {write_checkpoint(path, *SHAPES[args.shape]):.1f} s", flush=True)
        elif add_release_fields(path):
            print(f"{path}/config.json: added mamba_ssm_dtype float32 (as the released configs)", flush=True)
        return 0
    checkpoint_write_s = ensure_checkpoint(path, args.shape)
    add_release_fields(path)
    args.vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    if args.multi_turn_only:
        run_multi_turn_only(path, args)
        return 0
    args.prefill = (1024, 4096) if args.quick else (1024, 4096, 16384)
    args.streams = (1, 16) if args.quick else (1, 16, 64)
    args.new_tokens = 32 if args.quick else 64
    results: dict = {"shape": "Qwen3.5-4B (multimodal layout, random bf16)", "engine_start_s": {},
                     "prefill_ttft_ms": {v: {} for v in VARIANTS}, "decode_tpot_ms": {v: {} for v in VARIANTS},
                     "variants": {"after": "chunked tensor-core prefill + fused decode step (default)",
                                  "before": f"{KERNELS_ENV}=recurrent: token-by-token prefill, 4 decode kernels"},
                     "checkpoint_write_s": checkpoint_write_s, "device": device_name("cuda")}
    results["gdn_layer_core"] = layer_core_timings(args)
    save(results)
    for variant in VARIANTS:
        run_variant(path, variant, args, results)
        save(results)  # what was measured survives a later failure or time limit
    print(json.dumps(results, indent=2))
    return 0


def save(results: dict) -> None:
    """gpu_qwen35.json + .png, with the before/after ratios of whatever both variants measured."""
    results["speedup"] = {
        kind: {key: results[kind]["before"][key] / value for key, value in results[kind]["after"].items()
               if key in results[kind]["before"]}
        for kind in ("prefill_ttft_ms", "decode_tpot_ms")}
    write_results(results, "gpu_qwen35", plot)


def write_results(results: dict, name: str, plot_results) -> None:
    """NAME.json (and NAME.png when ``plot_results`` draws one) under $OUT when it is set (a device
    job's results folder), else under benchmarks/results."""
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    if plot_results is not None:
        plot_results(results, out / f"{name}.png")


if __name__ == "__main__":
    sys.exit(main())
