"""Eager prefill warm-up at start: run a few prefill and mixed steps once, on synthetic tokens,
before the first request.

Graph capture builds every kernel a decode or short-prefill step launches, but a long prompt's
step runs eagerly, and its kernels (the prefill attention variant a step's shape picks, cuBLAS
kernels for its row counts) were built or loaded at the first request that needed them: ~0.5-2 s
of NVRTC or module loading inside that request's TTFT (a lone 1k prompt on the H200: one 570 ms
step). Here those kernels are found by a dry forward (models whose forward may run dry: compiled
in parallel with nothing launched), then each step runs once for real. The steps write KV blocks
1..N and state slots 1..B, which nothing owns at start (a fresh prompt re-initialises its state).

With ``OPENINFER_ONE_COMPILE_WAVE=1`` the warm-up's dry forwards run inside the graph runner's
kernel discovery (``PrefillWarmup.dry_run``), so its kernels join the decode graphs' one parallel
compile instead of a second one after the capture (a second wave waits again for its slowest module)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from openinfer.runtime.synthetic_batches import StepLayout, blocks_needed, step_batch

logger = logging.getLogger(__name__)

WARMUP_ENV = "OPENINFER_PREFILL_WARMUP"  # "0": off (the first long prompt builds what it needs)
# "1" (default): the warm-up's kernels are found and compiled with the graph capture's (one compile
# wave: with one kernel a module, the prefill kernels compile beside the decode ones; H100, 2026-11-24
# 19:54, served cold start 6.03 / 6.41 -> 5.63 / 5.82 s, results/served_start_s11d1b_h100.json);
# "0": the warm-up discovers and compiles its own after the capture
ONE_WAVE_ENV = "OPENINFER_ONE_COMPILE_WAVE"
PROMPT_TOKENS = 1024  # a typical prompt; its kernels are the ones a 1k-8k prompt picks
MIXED_DECODES = 16  # the mixed-step split sends this many leading decodes to the decode kernel


def warmup_enabled() -> bool:
    return os.environ.get(WARMUP_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def one_compile_wave() -> bool:
    value = os.environ.get(ONE_WAVE_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ONE_WAVE_ENV}={value!r}: expected '0' or '1'")
    return value == "1"


class PrefillWarmup:
    """The warm-up's steps, whose kernels the graph runner's discovery may find (``dry_run``)
    before ``warm_up_prefill`` runs them: ``discovered`` once a dry run went through them all."""

    def __init__(self, steps: list[tuple[list[int], list[int]]], layout: StepLayout):
        self.steps = steps
        self.layout = layout
        self.discovered = False

    def dry_run(self, backend: Any, forward: Callable[[Any], Any]) -> Callable[[], None]:
        """A dry forward of every step (for ``create_runner(extra_dry_run=...)``)."""

        def run() -> None:
            for batch in _batches(self.steps, self.layout):
                forward(backend.prepare_batch(batch))
            self.discovered = True

        return run


def _batches(steps: list[tuple[list[int], list[int]]], layout: StepLayout) -> list[Any]:
    return [step_batch(new, contexts, layout, seed=index) for index, (new, contexts) in enumerate(steps)]


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
                    steps: list[tuple[list[int], list[int]]], dry_run_safe: bool, discovered: bool = False) -> int:
    """Build the kernels of ``steps`` (a parallel compile after a dry forward when the model may
    run dry and they were not ``discovered`` with the graphs' already), then run each step once
    through ``run`` (the engine's runner: prepare + forward). Returns the number of steps run."""
    batches = _batches(steps, layout)
    precompile = getattr(backend, "precompile_kernels", None)
    if dry_run_safe and not discovered and precompile is not None and batches:
        built = precompile(lambda: [forward(backend.prepare_batch(batch)) for batch in batches])
        logger.debug("prefill warm-up: %d kernel modules built in parallel", built)
    for batch in batches:
        run(batch)
    backend.synchronize()
    return len(batches)
