"""The engine core's sampling profiler (``OPENINFER_STACK_SAMPLES``): where threads spend wall time."""

import json
import threading
import time

import pytest

from openinfer.engine_core.stack_sampler import StackSampler


def _blocked_in_sleep(done: threading.Event) -> None:
    while not done.is_set():
        time.sleep(0.002)


def _busy_in_python(done: threading.Event) -> None:
    total = 0
    while not done.is_set():
        total += sum(range(200))


def test_stack_sampler_weights_each_thread_by_where_it_spends_time(tmp_path):
    done = threading.Event()
    sleeper = threading.Thread(target=_blocked_in_sleep, args=(done,), name="sleeper")
    worker = threading.Thread(target=_busy_in_python, args=(done,), name="worker")
    sleeper.start()
    worker.start()
    sampler = StackSampler(interval_s=0.002).start()
    time.sleep(0.4)
    sampler.stop()
    done.set()
    sleeper.join()
    worker.join()

    report = sampler.report()
    assert report["samples"] > 10
    threads = report["threads"]
    assert "stack-sampler" not in threads  # never samples itself
    for name, function in (("sleeper", "_blocked_in_sleep"), ("worker", "_busy_in_python")):
        entry = threads[name]
        # the weights are wall time between samples: about the 0.4 s sampled, each stack's share below it
        assert 0.2 < entry["seconds"] < 1.0
        heaviest = entry["stacks"][0]
        assert heaviest["stack"].split(" <- ")[0].endswith(function)  # innermost frame first
        assert sum(s["seconds"] for s in entry["stacks"]) <= entry["seconds"] + 1e-3

    path = tmp_path / "stacks.json"
    sampler.write(str(path))
    assert json.loads(path.read_text())["threads"]["worker"]["seconds"] == threads["worker"]["seconds"]


def test_stack_sampler_refuses_a_non_positive_interval():
    with pytest.raises(ValueError, match="interval"):
        StackSampler(interval_s=0)
