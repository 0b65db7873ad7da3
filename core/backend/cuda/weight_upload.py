"""Weights from host memory (the checkpoint's memory map) to the GPU, in parallel, with no
pinned copy of the model kept on the host.

``cupy.asarray(host)`` stages every array in a pinned block from CuPy's pinned pool, which keeps
each block for reuse: loading a model that way leaves about a gigabyte pinned (one block per
distinct tensor size, the embedding's among them) and copies the model through one thread,
page-faulting the memory map 4 KiB at a time. Here each tensor is cut into chunks copied by a
few threads (NumPy releases the GIL while copying) into a small ring of pinned staging buffers,
each sent to the device on its thread's stream::

    host tensor  [ chunk 0 | chunk 1 | chunk 2 | ... ]        (bytes, from the memory map)
                     │         │         │
    staging ring  [buf 0]   [buf 1]   [buf 2] ... (STAGING_BUFFERS × CHUNK_BYTES pinned)
                     │ memcpyAsync on the buffer's stream; its event marks it free again
    device        [ out[offset : offset + nbytes] ]

``upload`` returns once the tensor is on the device (callers may use it at once). The ring
is allocated on first use and freed by ``release_staging()`` (``release_host_memory`` calls it
once the engine is built), so an idle engine holds no staging memory.

Under ``deferred_uploads()`` (start-up only; on unless ``OPENINFER_DEFERRED_WEIGHTS=0``) a 2-byte (bf16)
tensor's device array is allocated and its copy queued instead: the load returns with every
weight allocated and none copied, the queued copies run on a thread (``DeferredUploads.start``)
while the engine discovers and compiles its kernels (dry forwards read no weight for real), and
``wait_for_deferred_uploads()`` joins them before the first real forward. Only for loads that do
no device arithmetic on bf16 weights after uploading them (a dense bf16 decoder's); fp32 tensors,
which ``CudaBackend.weight`` narrows on the device, are always copied at once.

Small weights a plugin keeps as they are (fp32 norm weights, per-head parameters) go through
``upload_vector``: allocated and copied on the uploader's own non-blocking stream, so that they
never wait behind the legacy stream's work.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import cupy
import numpy as np

from openinfer.engine_core.startup import note_event, weights_join_point
from openinfer.weights import mapped_file_region

CHUNK_BYTES = 8 << 20
NUM_THREADS = 4
STAGING_BUFFERS = 2 * NUM_THREADS  # a thread fills one buffer while its previous copy runs
SMALL_BYTES = 1 << 20  # below this a tensor is copied directly (one synchronous memcpy)
UPLOAD_THREADS_ENV = "OPENINFER_UPLOAD_THREADS"  # copy threads (default NUM_THREADS)
# MiB a chunk (default CHUNK_BYTES): each chunk's copy takes the GIL back a few times, and while the main
# thread runs Python (the start-up's dry forwards, the graph capture) each take may wait out the 5 ms
# switch interval: larger chunks take it fewer times
UPLOAD_CHUNK_ENV = "OPENINFER_UPLOAD_CHUNK_MB"
# "1": a deferred load's copies go to the threads all at once (``WeightUploader.upload_all``), not one tensor
# after another with a barrier each (~400 barriers for Qwen3-4B, each a GIL round trip or more). s12 D2,
# with 32 MB chunks, one run: served cold start 3.10 vs 2.58 / 2.72 s without, restart 2.19 vs 2.05 / 2.43
# (the copies now end well before serving: OPENINFER_WEIGHTS_JOIN=serve); opt-in
UPLOAD_ALL_ENV = "OPENINFER_UPLOAD_ALL"
# how a chunk of a memory-mapped checkpoint reaches the staging buffer: "map" (default), a memcpy
# out of the map (each first touch of a page is a page fault); "read", pread() from the file into the
# staging buffer (the kernel copies out of the page cache: no faults, no page-table entries). Measured
# (s12 D1, H200 host, Qwen3-4B's 8.8 GB alone): map 15.2 / 15.1 GB/s (4 / 8 threads), read 13.2 / 14.2
UPLOAD_READS_ENV = "OPENINFER_UPLOAD_READS"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return int(value)


def _env_reads() -> bool:
    value = os.environ.get(UPLOAD_READS_ENV, "map").strip().lower() or "map"
    if value not in ("map", "read"):
        raise ValueError(f"{UPLOAD_READS_ENV}={value!r}: expected 'map' or 'read'")
    return value == "read"


@dataclass
class _Staging:
    memory: cupy.cuda.PinnedMemory
    view: np.ndarray  # uint8 [CHUNK_BYTES] over ``memory``
    stream: cupy.cuda.Stream
    copied: cupy.cuda.Event  # recorded after the last copy out of this buffer


class WeightUploader:
    """Copies host arrays into device arrays through a ring of pinned staging buffers."""

    def __init__(self, device_id: int, num_threads: int | None = None, chunk_bytes: int | None = None,
                 num_buffers: int | None = None, read_files: bool | None = None):
        """``num_threads`` copy threads (``OPENINFER_UPLOAD_THREADS``, else ``NUM_THREADS``) over
        ``num_buffers`` staging buffers (twice the threads) of ``chunk_bytes`` each
        (``OPENINFER_UPLOAD_CHUNK_MB``, else ``CHUNK_BYTES``); ``read_files``: chunks of a
        memory-mapped file are read from the file (``OPENINFER_UPLOAD_READS=read``)."""
        num_threads = _env_int(UPLOAD_THREADS_ENV, NUM_THREADS) if num_threads is None else num_threads
        chunk_bytes = _env_int(UPLOAD_CHUNK_ENV, CHUNK_BYTES >> 20) << 20 if chunk_bytes is None else chunk_bytes
        num_buffers = 2 * num_threads if num_buffers is None else num_buffers
        self.device_id = device_id
        self.chunk_bytes = chunk_bytes
        self.read_files = _env_reads() if read_files is None else read_files
        self._files: dict[str, int] = {}  # path -> descriptor, for read_files
        self._files_lock = threading.Lock()
        self._free: queue.Queue[_Staging] = queue.Queue()
        with cupy.cuda.Device(device_id):
            self._buffers = []
            for _ in range(num_buffers):
                memory = cupy.cuda.PinnedMemory(chunk_bytes)  # not from the pool: freed with this object
                view = np.frombuffer(cupy.cuda.PinnedMemoryPointer(memory, 0), np.uint8, chunk_bytes)
                staging = _Staging(memory, view, cupy.cuda.Stream(non_blocking=True),
                                   cupy.cuda.Event(block=False, disable_timing=True))
                self._buffers.append(staging)
                self._free.put(staging)
            self._vector_stream = cupy.cuda.Stream(non_blocking=True)  # upload_vector's
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="openinfer-upload",
                                        initializer=lambda: cupy.cuda.Device(device_id).use())

    def upload(self, host: np.ndarray, out: cupy.ndarray | None = None, offset_bytes: int = 0) -> cupy.ndarray:
        """Copy ``host`` into ``out`` starting ``offset_bytes`` into it (a new device array of
        ``host``'s shape and dtype when ``out`` is None); returns ``out`` once the copy is done
        (under ``deferred_uploads``, a 2-byte tensor's copy is queued instead)."""
        host = np.ascontiguousarray(host)
        if out is None and cupy.cuda.get_current_stream().is_capturing():
            return cupy.asarray(host)  # a constant made inside a graph capture: CuPy's path, as before
        if out is None:
            out = cupy.empty(host.shape, dtype=host.dtype)
        _check_destination(host, out, offset_bytes)
        deferred = getattr(_deferring, "uploads", None)
        if deferred is not None and host.dtype.itemsize == 2:
            deferred.copies.append((self.device_id, host, out, offset_bytes))
            return out
        if host.nbytes < SMALL_BYTES:
            cupy.cuda.runtime.memcpy(out.data.ptr + offset_bytes, host.ctypes.data, host.nbytes,
                                     cupy.cuda.runtime.memcpyHostToDevice)
            return out
        # the device array was allocated on the current stream: make the copies wait for that
        cupy.cuda.get_current_stream().synchronize()
        self._copy_chunks(self._chunks(host, out, offset_bytes))
        return out

    def upload_all(self, copies: list[tuple[np.ndarray, cupy.ndarray, int]]) -> None:
        """Copy each ``(host, out, offset_bytes)`` like ``upload`` (the device arrays allocated and
        the device idle beforehand), every chunk of every tensor handed to the threads at once:
        no barrier per tensor, small tensors through the staging ring too. Returns once all landed."""
        chunks = []
        for host, out, offset_bytes in copies:
            host = np.ascontiguousarray(host)
            _check_destination(host, out, offset_bytes)
            chunks += self._chunks(host, out, offset_bytes)
        self._copy_chunks(chunks)

    def upload_vector(self, host: np.ndarray) -> cupy.ndarray:
        """A new device array holding ``host`` (a small weight the engine keeps: a norm's weight, a
        head's parameters), allocated and copied on this uploader's own non-blocking stream, then
        waited for. On the legacy default stream each such copy waited for the work in flight
        (Qwen3.5's 113 fp32 vectors x ~30 ms = 3.3 s of the 4B shape's load, D1 2026-11-24). Not
        deferred; arrays of SMALL_BYTES or more take ``upload``'s path. The array's memory belongs to
        that stream's pool: for arrays kept for the engine's life, not temporaries."""
        host = np.ascontiguousarray(host)
        if host.nbytes >= SMALL_BYTES or cupy.cuda.get_current_stream().is_capturing():
            return self.upload(host)
        with self._vector_stream:
            out = cupy.asarray(host)
        self._vector_stream.synchronize()
        return out

    def _chunks(self, host: np.ndarray, out: cupy.ndarray, offset_bytes: int) -> list[tuple]:
        """``_copy``'s arguments for each chunk of ``host`` (C-contiguous) into ``out`` at ``offset_bytes``."""
        source = host.reshape(-1).view(np.uint8)
        region = mapped_file_region(host) if self.read_files else None
        where = None if region is None else (self._descriptor(region[0]), region[1])
        destination = out.data.ptr + offset_bytes
        return [(source, destination, start, min(self.chunk_bytes, host.nbytes - start), where)
                for start in range(0, host.nbytes, self.chunk_bytes)]

    def _copy_chunks(self, chunks: list[tuple]) -> None:
        """Hand ``chunks`` (``_chunks``') to the threads; returns once every one landed."""
        used = list(self._pool.map(lambda chunk: self._copy(*chunk), chunks))
        for staging in {id(s): s for s in used}.values():
            staging.copied.synchronize()

    def _descriptor(self, path: str) -> int:
        with self._files_lock:
            if path not in self._files:
                self._files[path] = os.open(path, os.O_RDONLY)
            return self._files[path]

    def _copy(self, source: np.ndarray, destination: int, start: int, nbytes: int,
              where: tuple[int, int] | None = None) -> _Staging:
        staging = self._free.get()
        try:
            staging.copied.synchronize()  # its previous copy has left the buffer
            if where is None:
                np.copyto(staging.view[:nbytes], source[start:start + nbytes])
            else:  # (descriptor, file offset of the tensor): the kernel copies out of the page cache
                _read_exactly(where[0], staging.view[:nbytes], where[1] + start)
            cupy.cuda.runtime.memcpyAsync(destination + start, staging.view.ctypes.data, nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, staging.stream.ptr)
            staging.copied.record(staging.stream)
        finally:
            self._free.put(staging)
        return staging

    def close(self) -> None:
        """Wait for every copy and free the staging buffers (and close the files read)."""
        self._pool.shutdown(wait=True)
        for staging in self._buffers:
            staging.copied.synchronize()
        self._buffers.clear()
        while not self._free.empty():
            self._free.get_nowait()
        with self._files_lock:
            for descriptor in self._files.values():
                os.close(descriptor)
            self._files.clear()


def _check_destination(host: np.ndarray, out: cupy.ndarray, offset_bytes: int) -> None:
    if not out.flags.c_contiguous or offset_bytes + host.nbytes > out.nbytes:
        raise ValueError(f"cannot copy {host.nbytes} bytes at offset {offset_bytes} into a "
                         f"{'non-contiguous ' if not out.flags.c_contiguous else ''}device array of {out.nbytes}")


def _read_exactly(descriptor: int, into: np.ndarray, offset: int) -> None:
    """Fill ``into`` (uint8) with the file's bytes from ``offset`` (pread releases the GIL)."""
    view, done = memoryview(into), 0
    while done < len(view):
        got = os.preadv(descriptor, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"the checkpoint file ended {len(view) - done} bytes early (truncated while loading?)")
        done += got


_uploaders: dict[int, WeightUploader] = {}
_lock = threading.Lock()
_deferring = threading.local()  # .uploads: the DeferredUploads a deferred_uploads() block queues into
_started: list[DeferredUploads] = []  # started and not yet waited for


class DeferredUploads:
    """Copies queued under ``deferred_uploads()``: ``start()`` runs them in order on a thread,
    ``wait()`` joins it (re-raising its error)."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, np.ndarray, cupy.ndarray, int]] = []  # (device, host, out, offset)
        self.seconds = 0.0  # how long the thread took
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return sum(host.nbytes for _, host, _, _ in self.copies)

    def start(self) -> None:
        if self._thread is not None or not self.copies:
            return

        def run() -> None:
            import time

            began = time.perf_counter()
            note_event("weight_copies_started")
            try:
                if all_at_once:
                    for device_id in dict.fromkeys(copy[0] for copy in self.copies):
                        with cupy.cuda.Device(device_id):
                            uploader(device_id).upload_all([c[1:] for c in self.copies if c[0] == device_id])
                else:
                    for device_id, host, out, offset in self.copies:
                        with cupy.cuda.Device(device_id):
                            uploader(device_id).upload(host, out, offset)
                if beside_captures:  # a device-wide sync is no call to make while another thread captures
                    for device_id in {copy[0] for copy in self.copies}:
                        with cupy.cuda.Device(device_id):
                            # large copies were waited for by upload(); small ones ran on the legacy stream
                            cupy.cuda.Stream.null.synchronize()
                else:
                    cupy.cuda.runtime.deviceSynchronize()
            except BaseException as error:  # noqa: BLE001 — handed to wait()
                self._error = error
            self.seconds = time.perf_counter() - began
            note_event("weight_copies_done")

        # OPENINFER_WEIGHTS_JOIN=serve: graph captures may run while the copies do
        beside_captures = weights_join_point() == "serve"
        all_at_once = os.environ.get(UPLOAD_ALL_ENV, "0").strip() == "1"
        # everything queued so far (kernels on memory the pool then gave to a queued ``out``) ends
        # before the thread writes; later work never touches the model's arrays
        cupy.cuda.runtime.deviceSynchronize()
        self._thread = threading.Thread(target=run, name="openinfer-deferred-weights", daemon=True)
        with _lock:
            _started.append(self)
        self._thread.start()

    def wait(self) -> None:
        """Join the copies (run them here when never started); drops the host arrays."""
        if self._thread is None:
            self.start()
        if self._thread is not None:
            self._thread.join()
        self.copies = []
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("copying the deferred weights to the GPU failed") from error


@contextlib.contextmanager
def deferred_uploads() -> Iterator[DeferredUploads]:
    """Within the block (this thread only), a 2-byte tensor's upload allocates its device array
    and queues the copy in the yielded ``DeferredUploads``."""
    previous = getattr(_deferring, "uploads", None)
    _deferring.uploads = uploads = DeferredUploads()
    try:
        yield uploads
    finally:
        _deferring.uploads = previous


def wait_for_deferred_uploads() -> None:
    """Join every started ``DeferredUploads`` (nothing when none is pending)."""
    with _lock:
        pending = list(_started)
        _started.clear()
    for uploads in pending:
        uploads.wait()


def uploader(device_id: int) -> WeightUploader:
    """The device's uploader (its staging ring allocated on first use)."""
    with _lock:
        if device_id not in _uploaders:
            _uploaders[device_id] = WeightUploader(device_id)
        return _uploaders[device_id]


def upload_vector(array: np.ndarray, dtype: np.dtype | type | None = None) -> cupy.ndarray:
    """``array`` (converted to ``dtype`` when given) on the current device through its uploader's
    ``upload_vector``: the path for the small weights a plugin keeps as they are (fp32 norm
    weights, per-head parameters) instead of ``cupy.asarray`` on the legacy stream."""
    return uploader(cupy.cuda.Device().id).upload_vector(np.ascontiguousarray(array, dtype=dtype))


def release_staging() -> None:
    """Free every staging ring (a later upload allocates one again)."""
    with _lock:
        uploaders = list(_uploaders.values())
        _uploaders.clear()
    for each in uploaders:
        each.close()
