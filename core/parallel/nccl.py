"""NCCL through CuPy: one process per GPU, collectives on the worker's current stream.

Start-up: rank 0 calls ``new_unique_id()`` and hands the id to every rank (the launcher sends
it through the process arguments); each rank then calls ``NcclCommunicator.create`` on its own
device, which blocks until all ranks have joined. Every collective is enqueued on CuPy's
current stream, so ops inside ``stream.begin_capture()`` are recorded into the CUDA graph and
replayed with it (NCCL ≥ 2.9 supports stream capture).

NVLink multicast (NVLS) stays off: ``NCCL_NVLS_ENABLE=0`` is set before the first NCCL call in
every process (it can take a shared host's GPUs out of service), and nothing here creates
multicast objects.
"""

from __future__ import annotations

import os
from typing import Any

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}

# ncclDataType_t / ncclRedOp_t values (nccl.h), used when CuPy lacks a named constant
_NCCL_DTYPES = {"int32": 2, "uint16": 9, "float16": 6, "float32": 7, "int64": 4, "uint8": 1, "int8": 0}
_NCCL_SUM = 0


def disable_multicast() -> None:
    """Keep NVLink multicast off in this process and every process it starts."""
    os.environ.update(NCCL_ENV)


def new_unique_id() -> Any:
    """The id the ranks of one group share (rank 0 makes it; picklable: bytes in CuPy 14,
    a tuple of ints in older CuPy — handed to ``create`` as it came)."""
    disable_multicast()
    from cupy.cuda import nccl

    return nccl.get_unique_id()


class NcclCommunicator:
    """The ``Communicator`` protocol over NCCL. Activations are bf16 held as uint16, which NCCL
    reduces as ``ncclBfloat16`` (the uint16 dtype maps to it: this backend has no other uint16
    data to reduce)."""

    def __init__(self, comm: Any, rank: int, world_size: int):
        self._comm = comm
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def create(cls, unique_id: Any, rank: int, world_size: int) -> NcclCommunicator:
        disable_multicast()
        from cupy.cuda import nccl

        return cls(nccl.NcclCommunicator(world_size, unique_id, rank), rank, world_size)

    # --- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _dtype(x: Any) -> int:
        name = str(x.dtype)
        if name not in _NCCL_DTYPES:
            raise ValueError(f"NCCL collectives here take {sorted(_NCCL_DTYPES)}, got {name}")
        return _NCCL_DTYPES[name]

    @staticmethod
    def _stream() -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr

    def _rows(self, x: Any, op: str) -> int:
        if x.shape[0] % self.world_size:
            raise ValueError(f"{op}: axis 0 of shape {tuple(x.shape)} does not split into {self.world_size} parts")
        return x.shape[0] // self.world_size

    # --- collectives -----------------------------------------------------------------------------

    def all_reduce(self, x: Any) -> Any:
        import cupy

        x = cupy.ascontiguousarray(x)
        out = cupy.empty_like(x)
        self._comm.allReduce(x.data.ptr, out.data.ptr, x.size, self._dtype(x), _NCCL_SUM, self._stream())
        return out

    def all_gather(self, x: Any) -> Any:
        import cupy

        x = cupy.ascontiguousarray(x)
        out = cupy.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        self._comm.allGather(x.data.ptr, out.data.ptr, x.size, self._dtype(x), self._stream())
        return out

    def reduce_scatter(self, x: Any) -> Any:
        import cupy

        x = cupy.ascontiguousarray(x)
        out = cupy.empty((self._rows(x, "reduce_scatter"), *x.shape[1:]), dtype=x.dtype)
        self._comm.reduceScatter(x.data.ptr, out.data.ptr, out.size, self._dtype(x), _NCCL_SUM, self._stream())
        return out

    def all_to_all(self, x: Any) -> Any:
        """Equal blocks, as grouped send/recv pairs (NCCL has no all-to-all primitive)."""
        import cupy
        from cupy.cuda import nccl

        x = cupy.ascontiguousarray(x)
        rows = self._rows(x, "all_to_all")
        out = cupy.empty_like(x)
        block = rows * (x.size // max(1, x.shape[0]))
        itemsize = x.dtype.itemsize
        dtype, stream = self._dtype(x), self._stream()
        nccl.groupStart()
        try:
            for peer in range(self.world_size):
                self._comm.send(x.data.ptr + peer * block * itemsize, block, dtype, peer, stream)
                self._comm.recv(out.data.ptr + peer * block * itemsize, block, dtype, peer, stream)
        finally:
            nccl.groupEnd()
        return out

    def broadcast(self, x: Any, root: int = 0) -> Any:
        import cupy

        x = cupy.ascontiguousarray(x)
        out = cupy.empty_like(x)
        self._comm.broadcast(x.data.ptr, out.data.ptr, x.size, self._dtype(x), root, self._stream())
        return out

    def abort(self) -> None:
        """Abort the communicator (another rank died): operations in flight, and any later one,
        fail instead of waiting. The group cannot be used again."""
        self._comm.abort()

    def barrier(self) -> None:
        import cupy

        token = cupy.zeros(1, dtype=cupy.float32)
        self.all_reduce(token)
        cupy.cuda.get_current_stream().synchronize()
