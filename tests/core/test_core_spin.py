"""``OPENINFER_CORE_SPIN_MS``: the engine-core transport's spin window, parsed or refused clearly."""

from __future__ import annotations

import pytest

from openinfer.engine_core.process import CORE_SPIN_ENV, spin_seconds
from openinfer.errors import OpenInferError


@pytest.mark.parametrize(("value", "seconds"), [(None, 0.025), ("0", 0.0), ("20", 0.02), ("0.5", 0.0005)])
def test_spin_window_in_seconds(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv(CORE_SPIN_ENV, raising=False)
    else:
        monkeypatch.setenv(CORE_SPIN_ENV, value)
    assert spin_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["-1", "fast", "1e9", "nan"])
def test_bad_spin_windows_are_refused_with_the_variable_named(monkeypatch, value):
    monkeypatch.setenv(CORE_SPIN_ENV, value)
    with pytest.raises(OpenInferError, match=CORE_SPIN_ENV):
        spin_seconds()
