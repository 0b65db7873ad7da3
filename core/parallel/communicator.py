"""The collective operations ranks use to cooperate, one interface for every transport.

A ``Communicator`` belongs to one rank of a group of ``world_size`` ranks. Every rank calls
the same collectives in the same order (SPMD); each call blocks (NumPy) or is enqueued on the
worker's current stream (CUDA) and returns a new array. Shapes are the caller's business:
``all_gather`` / ``reduce_scatter`` / ``all_to_all`` split or join along axis 0 in equal parts::

    all_reduce      x                      -> sum over ranks of x            (same shape)
    all_gather      x [n, ...]             -> [world * n, ...]   rank r's rows at r*n
    reduce_scatter  x [world * n, ...]     -> [n, ...]           rank r gets rows r*n.. summed
    all_to_all      x [world * n, ...]     -> [world * n, ...]   block i of the result came from
                                                                 rank i's block r
    broadcast       x                      -> root's x

Implementations: ``SingleRank`` (world 1, identity), ``openinfer.parallel.fake`` (ranks as
threads exchanging NumPy arrays, for CPU tests) and ``openinfer.parallel.nccl`` (NCCL via CuPy,
one process per GPU).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: Any) -> Any: ...
    def all_gather(self, x: Any) -> Any: ...
    def reduce_scatter(self, x: Any) -> Any: ...
    def all_to_all(self, x: Any) -> Any: ...
    def broadcast(self, x: Any, root: int = 0) -> Any: ...
    def barrier(self) -> None: ...


class SingleRank:
    """The group of one: every collective is the identity, at no cost."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: Any) -> Any:
        return x

    def all_gather(self, x: Any) -> Any:
        return x

    def reduce_scatter(self, x: Any) -> Any:
        return x

    def all_to_all(self, x: Any) -> Any:
        return x

    def broadcast(self, x: Any, root: int = 0) -> Any:
        return x

    def barrier(self) -> None:
        pass


def gather_last_axis(comm: Communicator, x: Any, xp: Any) -> Any:
    """All-gather a ``[rows, n]`` array along its last axis: ``[rows, world * n]``, rank r's
    columns at ``r*n`` (the vocab-parallel LM head's logits)."""
    if comm.world_size == 1:
        return x
    rows, cols = x.shape
    gathered = comm.all_gather(xp.ascontiguousarray(x))  # [world * rows, cols]
    return xp.ascontiguousarray(gathered.reshape(comm.world_size, rows, cols).transpose(1, 0, 2)).reshape(
        rows, comm.world_size * cols)
