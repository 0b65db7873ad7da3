"""The engine core freezes its start-up heap, so a full collection during serving only walks what
serving allocated (a gen-2 pass over the whole heap had stalled a step's launch by 100-200 ms)."""

from __future__ import annotations

import gc

import pytest

from openinfer.engine_core.startup import GC_FREEZE_ENV, freeze_startup_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_start_up_objects_move_to_the_permanent_generation(unfrozen, monkeypatch):
    monkeypatch.delenv(GC_FREEZE_ENV, raising=False)
    survivors = [[i] for i in range(1000)]  # alive after start-up
    frozen = freeze_startup_heap()
    # other threads of the test session may unfreeze or add objects between the two reads: no equality
    assert frozen >= len(survivors) and gc.get_freeze_count() >= len(survivors)
    assert not any(gc.get_count()[1:])  # the young generations were emptied into the frozen one


def test_switch_off(unfrozen, monkeypatch):
    monkeypatch.setenv(GC_FREEZE_ENV, "0")
    assert freeze_startup_heap() == 0
    assert gc.get_freeze_count() == 0
