"""An in-process fake of NCCL: N ranks as threads exchanging NumPy arrays.

The CPU CI runs the parallel code paths with it: each rank is a thread with its own model
shard and its own ``ThreadCommunicator``; a collective publishes the rank's array in a shared
slot, waits for every rank (a barrier), computes the result from all slots in rank order (so
every rank gets bit-identical sums), and waits again before the slots are reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

COLLECTIVE_TIMEOUT_S = 120.0  # a rank that never arrives fails the others instead of hanging CI


class ThreadGroup:
    """The shared state of ``world_size`` thread ranks."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"a group needs at least one rank, got world_size={world_size}")
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=COLLECTIVE_TIMEOUT_S)
        self._slots: list[Any] = [None] * world_size

    def communicators(self) -> list[ThreadCommunicator]:
        return [ThreadCommunicator(self, rank) for rank in range(self.world_size)]

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()
        return values

    def abort(self) -> None:
        """Wake every rank blocked in a collective with ``BrokenBarrierError`` (a rank failed)."""
        self._barrier.abort()


class ThreadCommunicator:
    """One thread rank's view of a ``ThreadGroup`` (the ``Communicator`` protocol)."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        values = self.group.exchange(self.rank, x)
        total = np.array(values[0], copy=True)
        for value in values[1:]:
            total += value
        return total

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate(self.group.exchange(self.rank, x), axis=0)

    def reduce_scatter(self, x: np.ndarray) -> np.ndarray:
        total = self.all_reduce(x)
        return _split_rows(total, self.world_size, "reduce_scatter")[self.rank].copy()

    def all_to_all(self, x: np.ndarray) -> np.ndarray:
        blocks = [_split_rows(v, self.world_size, "all_to_all") for v in self.group.exchange(self.rank, x)]
        return np.concatenate([blocks[source][self.rank] for source in range(self.world_size)], axis=0)

    def broadcast(self, x: np.ndarray, root: int = 0) -> np.ndarray:
        return np.array(self.group.exchange(self.rank, x)[root], copy=True)

    def barrier(self) -> None:
        self.group.exchange(self.rank, None)


def _split_rows(x: np.ndarray, parts: int, op: str) -> list[np.ndarray]:
    if x.shape[0] % parts:
        raise ValueError(f"{op}: axis 0 of shape {x.shape} does not split into {parts} equal parts")
    return np.split(x, parts, axis=0)


def run_ranks(world_size: int, fn: Callable[[ThreadCommunicator], Any]) -> list[Any]:
    """Run ``fn(comm)`` on ``world_size`` thread ranks; the results in rank order. A rank that
    raises breaks the group's barrier so the others fail fast, and its error is re-raised."""
    group = ThreadGroup(world_size)

    def guarded(comm: ThreadCommunicator) -> Any:
        try:
            return fn(comm)
        except BaseException:
            group.abort()
            raise

    with ThreadPoolExecutor(max_workers=world_size, thread_name_prefix="openinfer-rank") as pool:
        futures = [pool.submit(guarded, comm) for comm in group.communicators()]
        wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:  # the failing rank's own error, not the broken barrier it caused in the others
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return [f.result() for f in futures]
