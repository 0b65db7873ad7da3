"""Eager prefill warm-up at start: run a few prefill and mixed steps once, on synthetic tokens,
before the first request.

Graph capture builds every kernel a decode or short-prefill step launches, but a long prompt's
step runs eagerly, and its kernels (the prefill attention variant a step's shape picks, cuBLAS
kernels for its row counts) were built or loaded at the first request that needed them: ~0.5-2 s
of NVRTC or module loading inside that request's TTFT (a lone 1k prompt on the H200: one 570 ms
step). Here those kernels are found by a dry forward (models whose forward may run dry: compiled
in parallel with nothing launched), then each step runs once for real. The steps write KV blocks
1..N and state slots 1..B, which nothing owns at start (a fresh prompt re-initialises its state)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from openinfer.runtime.synthetic_batches import StepLayout, blocks_needed, step_batch

logger = logging.getLogger(__name__)

WARMUP_ENV = "OPENINFER_PREFILL_WARMUP"  # "0": off (the first long prompt builds what it needs)
PROMPT_TOKENS = 1024  # a typical prompt; its kernels are the ones a 1k-8k prompt picks
MIXED_DECODES = 16  # the mixed-step split sends this many leading decodes to the decode kernel


def warmup_enabled() -> bool:
    return os.environ.get(WARMUP_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def warmup_steps(max_model_len: int, num_blocks: int, num_state_slots: int, with_state: bool) -> list[tuple[list[int], list[int]]]:
    """The (new tokens, contexts) of each warm-up step that fits the cache: one prompt, four
    prompts, and a mixed step of decodes plus a prompt chunk over cached context."""
    prompt = max(2, min(PROMPT_TOKENS, max_model_len))
    candidates = [([prompt], [prompt]), ([prompt] * 4, [prompt] * 4),
                  ([1] * MIXED_DECODES + [prompt // 2], [prompt] * MIXED_DECODES + [prompt])]
    fits = []
    for new, contexts in candidates:
        if blocks_needed(contexts) >= num_blocks or (with_state and len(new) >= num_state_slots):
            continue  # block 0 and state slot 0 are the null entries
        fits.append((new, contexts))
    return fits


def warm_up_prefill(backend: Any, run: Callable[[Any], Any], forward: Callable[[Any], Any], layout: StepLayout,
                    steps: list[tuple[list[int], list[int]]], dry_run_safe: bool) -> int:
    """Build the kernels of ``steps`` (a parallel compile after a dry forward when the model may
    run dry), then run each step once through ``run`` (the engine's runner: prepare + forward).
    Returns the number of steps run."""
    batches = [step_batch(new, contexts, layout, seed=index) for index, (new, contexts) in enumerate(steps)]
    precompile = getattr(backend, "precompile_kernels", None)
    if dry_run_safe and precompile is not None and batches:
        built = precompile(lambda: [forward(backend.prepare_batch(batch)) for batch in batches])
        logger.debug("prefill warm-up: %d kernel modules built in parallel", built)
    for batch in batches:
        run(batch)
    backend.synchronize()
    return len(batches)
