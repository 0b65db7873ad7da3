"""``OPENINFER_CORE_SPIN_MS``: the engine-core transport's spin window, parsed or refused clearly."""

from __future__ import annotations

import pytest

from openinfer.engine_core import process
from openinfer.engine_core.process import CORE_SPIN_ENV, spin_seconds
from openinfer.errors import OpenInferError


@pytest.mark.parametrize(("value", "seconds"), [("0", 0.0), ("20", 0.02), ("0.5", 0.0005)])
def test_spin_window_in_seconds(monkeypatch, value, seconds):
    monkeypatch.setenv(CORE_SPIN_ENV, value)
    assert spin_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["-1", "fast", "1e9", "nan"])
def test_bad_spin_windows_are_refused_with_the_variable_named(monkeypatch, value):
    monkeypatch.setenv(CORE_SPIN_ENV, value)
    with pytest.raises(OpenInferError, match=CORE_SPIN_ENV):
        spin_seconds()


@pytest.mark.parametrize(("cpus", "seconds"), [(2, 0.0), (7, 0.0), (8, 0.025), (64, 0.025)])
def test_the_default_spins_only_where_a_core_can_be_spared(monkeypatch, cpus, seconds):
    monkeypatch.delenv(CORE_SPIN_ENV, raising=False)
    monkeypatch.setattr(process, "available_cpus", lambda: cpus)
    assert spin_seconds() == pytest.approx(seconds)
