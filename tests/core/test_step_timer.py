"""StepTimer's arithmetic, with events that carry the time the test gives them."""

from types import SimpleNamespace

import pytest

from openinfer.runtime.step_timer import StepTimer


class Clock:
    now = 0.0


class FakeEvent:
    def record(self) -> None:
        self.at = Clock.now

    def synchronize(self) -> None:
        pass


def at(timer: StepTimer, t: float):
    Clock.now = t
    return timer.start()


def test_a_pause_between_forward_and_sampling_counts_as_idle():
    cupy = SimpleNamespace(cuda=SimpleNamespace(Event=FakeEvent, get_elapsed_time=lambda a, b: b.at - a.at))
    timer = StepTimer(cupy)
    # step 1: busy 0-10; step 2 starts at 12 (gap 2), its forward ends at 18, sampling waits until 21
    start, forward_end, sampling_start = at(timer, 0.0), at(timer, 8.0), at(timer, 8.0)
    Clock.now = 10.0
    timer.stop(start, (forward_end, sampling_start))
    start, forward_end, sampling_start = at(timer, 12.0), at(timer, 18.0), at(timer, 21.0)
    Clock.now = 23.0
    timer.stop(start, (forward_end, sampling_start))
    report = timer.report()
    assert report["num_steps"] == 2
    assert report["idle_gap_ms_mean"] == pytest.approx(2.0)
    assert report["pause_ms_mean"] == pytest.approx(1.5)
    assert report["busy_ms_mean"] == pytest.approx((10.0 + 8.0) / 2)
    # idle after the first step: the gap (2) and step 2's pause (3), against step 2's busy 8
    assert report["idle_fraction"] == pytest.approx(5.0 / 13.0)
