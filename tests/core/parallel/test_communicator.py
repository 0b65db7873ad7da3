"""The fake communicator's collectives (threads exchanging NumPy arrays) match their
definitions, give every rank identical results, and fail fast when a rank fails."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.parallel.communicator import SingleRank, gather_last_axis
from openinfer.parallel.fake import run_ranks

WORLD = 4


def rank_array(rank: int) -> np.ndarray:
    return np.arange(8 * 3, dtype=np.float32).reshape(8, 3) + 100 * rank


def test_all_reduce_sums_in_rank_order_on_every_rank():
    results = run_ranks(WORLD, lambda comm: comm.all_reduce(rank_array(comm.rank)))
    expected = sum(rank_array(r) for r in range(WORLD))
    for result in results:
        np.testing.assert_array_equal(result, expected)


def test_all_gather_and_reduce_scatter():
    gathered = run_ranks(WORLD, lambda comm: comm.all_gather(rank_array(comm.rank)))
    np.testing.assert_array_equal(gathered[2], np.concatenate([rank_array(r) for r in range(WORLD)]))
    scattered = run_ranks(WORLD, lambda comm: comm.reduce_scatter(rank_array(comm.rank)))
    total = sum(rank_array(r) for r in range(WORLD))
    for rank, part in enumerate(scattered):
        np.testing.assert_array_equal(part, total[2 * rank: 2 * rank + 2])


def test_all_to_all_sends_block_i_to_rank_i():
    results = run_ranks(WORLD, lambda comm: comm.all_to_all(rank_array(comm.rank)))
    for rank, result in enumerate(results):
        expected = np.concatenate([rank_array(source)[2 * rank: 2 * rank + 2] for source in range(WORLD)])
        np.testing.assert_array_equal(result, expected)


def test_broadcast_and_gather_last_axis():
    results = run_ranks(WORLD, lambda comm: comm.broadcast(rank_array(comm.rank), root=1))
    for result in results:
        np.testing.assert_array_equal(result, rank_array(1))
    columns = run_ranks(2, lambda comm: gather_last_axis(comm, rank_array(comm.rank), np))
    np.testing.assert_array_equal(columns[0], np.concatenate([rank_array(0), rank_array(1)], axis=1))
    assert gather_last_axis(SingleRank(), rank_array(0), np) is not None


def test_a_failing_rank_fails_the_group_with_its_own_error():
    def step(comm):
        if comm.rank == 2:
            raise RuntimeError("rank 2 broke")
        return comm.all_reduce(rank_array(comm.rank))

    with pytest.raises(RuntimeError, match="rank 2 broke"):
        run_ranks(WORLD, step)


def test_uneven_all_to_all_is_refused():
    with pytest.raises(ValueError, match="does not split into 4 equal parts"):
        run_ranks(WORLD, lambda comm: comm.all_to_all(np.zeros((6, 2), np.float32)))


def test_watchdog_reports_a_rank_process_that_dies_and_check_raises():
    """A rank process that exits unexpectedly is reported once (on GPUs: rank 0's NCCL group is
    aborted so no step hangs) and the next step's check names it; ranks being closed are not."""
    import threading
    from types import SimpleNamespace

    from openinfer.errors import OpenInferError
    from openinfer.parallel.workers import ProcessRank, watch_ranks

    alive = SimpleNamespace(rank=1, closing=False, process=SimpleNamespace(exitcode=None))
    closing = SimpleNamespace(rank=2, closing=True, process=SimpleNamespace(exitcode=0))
    dead = SimpleNamespace(rank=3, closing=False, process=SimpleNamespace(exitcode=-9))
    seen = []
    watch_ranks([alive, closing, dead], seen.append, interval_s=0.01)
    assert seen == [dead]
    stop = threading.Event()
    stop.set()
    watch_ranks([alive], seen.append, stop=stop)  # nothing died: returns when stopped
    assert seen == [dead]

    rank = ProcessRank.__new__(ProcessRank)
    rank.rank, rank.closing = 3, False
    rank.connection = SimpleNamespace(poll=lambda *_: False)
    rank.process = SimpleNamespace(exitcode=-9)
    with pytest.raises(OpenInferError, match="rank 3's process exited \\(code -9\\)"):
        rank.check()
