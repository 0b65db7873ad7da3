"""The start-up prefill warm-up (``openinfer.runtime.warmup``): which synthetic steps fit the
cache, how they are laid out, and that a dry-run-safe model's kernels are discovered before each
step runs once for real."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.runtime.synthetic_batches import BLOCK_SIZE, StepLayout, blocks_needed, step_batch
from openinfer.runtime.warmup import MIXED_DECODES, warm_up_prefill, warmup_enabled, warmup_steps


def test_step_batch_lays_out_decodes_and_prompts_in_their_own_blocks() -> None:
    batch = step_batch([1, 1, 20], [40, 17, 20], StepLayout(vocab_size=50))
    assert list(batch.query_start) == [0, 1, 2, 22] and list(batch.context_lens) == [40, 17, 20]
    assert list(batch.positions[:2]) == [39, 16] and list(batch.positions[2:]) == list(range(20))
    assert list(batch.logits_rows) == [0, 1, 21] and batch.token_ids.max() < 50
    # blocks 1-3 (40 tokens), 4-5 (17), 6-7 (20): every token's slot inside its own sequence's blocks
    assert batch.block_tables.tolist() == [[1, 2, 3], [4, 5, 0], [6, 7, 0]]
    assert list(batch.slot_mapping[:2]) == [3 * BLOCK_SIZE + 39 % BLOCK_SIZE, 5 * BLOCK_SIZE + 16 % BLOCK_SIZE]
    assert blocks_needed([40, 17, 20]) == 7 and batch.max_query_len == 20
    with pytest.raises(ValueError, match="new tokens <= context"):
        step_batch([5], [4])


def test_warmup_steps_keep_what_fits_the_cache() -> None:
    steps = warmup_steps(max_model_len=4096, num_blocks=10_000, num_state_slots=0, with_state=False)
    assert [len(new) for new, _ in steps] == [1, 4, MIXED_DECODES + 1]
    assert steps[0] == ([1024], [1024]) and steps[2][0][-1] == 512 and steps[2][1][-1] == 1024
    # a short context window: prompts shrink to it; a small pool or few state slots drop the big steps
    assert warmup_steps(100, 10_000, 0, False)[0] == ([100], [100])
    assert [len(n) for n, _ in warmup_steps(4096, 200, 0, False)] == [1]
    assert [len(n) for n, _ in warmup_steps(4096, 10_000, 6, True)] == [1, 4]


def test_warm_up_discovers_kernels_then_runs_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    class Backend:
        def prepare_batch(self, batch):
            return batch

        def precompile_kernels(self, dry_run):
            events.append("discover")
            dry_run()
            events.append("compiled")
            return 3

        def synchronize(self):
            events.append("sync")

    steps = warmup_steps(2048, 10_000, 0, False)
    ran = warm_up_prefill(Backend(), lambda batch: events.append(f"run {batch.num_seqs}"),
                          lambda batch: events.append(f"dry {batch.num_seqs}"), StepLayout(), steps, dry_run_safe=True)
    assert ran == 3
    assert events == ["discover", "dry 1", "dry 4", f"dry {MIXED_DECODES + 1}", "compiled",
                      "run 1", "run 4", f"run {MIXED_DECODES + 1}", "sync"]
    events.clear()
    warm_up_prefill(Backend(), lambda batch: events.append("run"), lambda batch: events.append("dry"), StepLayout(),
                    steps[:1], dry_run_safe=False)  # a model that may not run dry: real steps only
    assert events == ["run", "sync"]
    monkeypatch.setenv("OPENINFER_PREFILL_WARMUP", "0")
    assert not warmup_enabled()
    monkeypatch.setenv("OPENINFER_PREFILL_WARMUP", "1")
    assert warmup_enabled() and np.all(np.diff(step_batch([3], [3]).positions) == 1)


def test_steps_discovered_with_the_graphs_skip_their_own_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPENINFER_ONE_COMPILE_WAVE=1 (the default): the graph runner's discovery runs ``PrefillWarmup.dry_run``
    (every step dry, prepared by the backend), after which the warm-up compiles nothing itself and
    only runs the steps; a dry run that stopped part-way leaves ``discovered`` False, so the
    warm-up discovers again."""
    events: list[str] = []

    class Backend:
        def prepare_batch(self, batch):
            events.append(f"prepare {batch.num_seqs}")
            return batch

        def precompile_kernels(self, dry_run):
            events.append("discover")
            dry_run()
            return 1

        def synchronize(self):
            events.append("sync")

    from openinfer.runtime.warmup import PrefillWarmup, one_compile_wave

    warmup = PrefillWarmup(warmup_steps(2048, 10_000, 0, False), StepLayout())
    assert not warmup.discovered
    warmup.dry_run(Backend(), lambda batch: events.append(f"dry {batch.num_seqs}"))()
    assert warmup.discovered
    assert events == ["prepare 1", "dry 1", "prepare 4", "dry 4", f"prepare {MIXED_DECODES + 1}", f"dry {MIXED_DECODES + 1}"]
    events.clear()
    warm_up_prefill(Backend(), lambda batch: events.append(f"run {batch.num_seqs}"), lambda batch: events.append("dry"),
                    warmup.layout, warmup.steps, dry_run_safe=True, discovered=warmup.discovered)
    assert events == ["run 1", "run 4", f"run {MIXED_DECODES + 1}", "sync"]

    def failing(batch):
        raise RuntimeError("a dry forward stopped")

    stopped = PrefillWarmup(warmup.steps, StepLayout())
    with pytest.raises(RuntimeError):
        stopped.dry_run(Backend(), failing)()
    assert not stopped.discovered

    monkeypatch.delenv("OPENINFER_ONE_COMPILE_WAVE", raising=False)
    assert one_compile_wave()
    monkeypatch.setenv("OPENINFER_ONE_COMPILE_WAVE", "0")
    assert not one_compile_wave()
    monkeypatch.setenv("OPENINFER_ONE_COMPILE_WAVE", "yes")
    with pytest.raises(ValueError, match="OPENINFER_ONE_COMPILE_WAVE"):
        one_compile_wave()
