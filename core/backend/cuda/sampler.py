"""Sampling on the GPU, behind the engine's ``backend.sample_rows(logits, rows, eos_token_ids)``.

Rows that sample plainly (temperature, top-k, top-p, min-p, seeds) run in one kernel
(``sampling.cu``): one small host-to-device copy of the per-row parameters and one
device-to-host copy of the chosen ids. The others are copied to the host alone and go through
the NumPy reference (``openinfer.runtime.sampler``): prompt-logprob rows, rows asking for
top-N logprobs, rows with repetition/presence/frequency penalties, and rows whose stop ids are
banned this step (min_tokens). Each random row consumes exactly one ``generator.random()``
per step, as the NumPy sampler does, so a seeded request reproduces alone or in a batch.

``logit_bias`` and structured-output masks are applied on the device before the sampling kernel
(``logit_constraints.cu``) to a copy of the rows: the bias as sparse (id, value) lists, the masks
as the step's compact int32 bitmasks (``structured.StepMasks``: one row per constrained logits
row and each row's index into them), computed on the CPU during the forward. The host arrays
are built by ``runtime.sampler.device_sampling_inputs``.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import cupy
import numpy as np

from openinfer.backend.cuda.loader import kernel
from openinfer.runtime.batch_builder import LogitsRow
from openinfer.runtime.sampler import (
    DeviceSamplingInputs,
    GrammarMasks,
    RowSample,
    device_sampling_inputs,
    kernel_can_sample,
)
from openinfer.runtime.sampler import sample_rows as sample_rows_on_host
from openinfer.sampling import SamplingState


def samples_on_device(row: LogitsRow) -> bool:
    """True when the GPU kernel implements everything this row asks for
    (``openinfer.runtime.sampler.kernel_can_sample``: grammar rows included, their masks
    applied on the device)."""
    return row.samples and kernel_can_sample(row.request)


def sample_device_rows(logits: cupy.ndarray, states: Sequence[SamplingState],
                       masks: GrammarMasks | None = None) -> np.ndarray:
    """Token ids [rows] for ``logits [rows, vocab]`` (bf16), row i following ``states[i]``;
    ``masks``: grammar masks of these rows (``masks.row(i)`` for row i) or None."""
    return launch_device_sampling(logits, states, masks).get()


def empty_pinned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``cupyx.empty_pinned`` without importing ``cupyx``: its package imports cupyx.linalg and with
    it SciPy (0.4 s of every engine start on an H200 host, s12 D1), for this one function."""
    dtype = np.dtype(dtype)
    memory = cupy.cuda.alloc_pinned_memory(max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize))
    return np.ndarray(shape, dtype=dtype, buffer=memory)


class _MaskGates:
    """Masks not computed yet when their step's sampling is queued (``StepMasks.is_ready``
    False: the engine samples grammar rows ahead, ``OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT``): the
    stream waits for them on the GPU, not the engine thread on the host. Each such step takes
    one of ``DEPTH`` slots in turn: a pinned buffer the masks are computed straight into (or
    copied into, when their computation had started) and a pinned flag the ``wait_for_host_flag``
    kernel polls; the host writes the step's sequence number there once the masks are in the
    buffer, and the buffer's copy to the device and the sampling follow the kernel on the stream.
    A slot is used again ``DEPTH`` steps later: its previous copy finished long before (that
    step was read back before the masks of the steps after it even started)."""

    DEPTH = 4
    TIMEOUT_NS = 10_000_000_000
    RECENT_WAITS = 8192  # the last waits kept one by one (device_wait_samples_ms)

    def __init__(self) -> None:
        # [flags | timed-out marks | waited ns (uint64)], mapped into the device's address space (kept
        # for the process)
        words, self._device_address = _mapped_host_int32(4 * self.DEPTH)
        words[...] = 0
        self._flags, self._timed_out = words[:self.DEPTH], words[self.DEPTH:2 * self.DEPTH]
        self._waited_ns = words[2 * self.DEPTH:].view(np.uint64)
        self._buffers: list[np.ndarray | None] = [None] * self.DEPTH
        self._next_slot = 0
        self._sequence = 0
        self._lock = threading.Lock()
        self._device_wait_ns = 0
        self._device_waits = 0
        self._recent_waits_ms: collections.deque[float] = collections.deque(maxlen=self.RECENT_WAITS)

    @property
    def device_wait_ms(self) -> tuple[float, int]:
        """The GPU's time spent waiting for grammar masks (ms) and the number of steps that queued
        such a wait, over the steps read back since the process started (for benchmarks: take the
        difference around a run)."""
        with self._lock:
            return self._device_wait_ns / 1e6, self._device_waits

    def device_wait_samples_ms(self, last: int) -> list[float]:
        """The GPU's waits (ms) of the ``last`` steps read back that waited for masks (at most
        ``RECENT_WAITS``), oldest first: how the waiting spreads over steps."""
        with self._lock:
            kept = list(self._recent_waits_ms)
        return kept[len(kept) - min(last, len(kept)):] if last > 0 else []

    def queue_wait(self, masks: GrammarMasks) -> tuple[cupy.ndarray, Callable[[], None]]:
        """Queue the wait for ``masks`` and their upload; returns the device bitmask and the
        check for the read-back (raises when the masks failed or the wait timed out)."""
        with self._lock:
            slot = self._next_slot
            self._next_slot = (slot + 1) % self.DEPTH
            self._sequence = self._sequence % (1 << 30) + 1
            sequence = self._sequence
        shape, size = masks.bitmask.shape, masks.bitmask.size
        buffer = self._buffers[slot]
        if buffer is None or buffer.size < size:
            buffer = self._buffers[slot] = empty_pinned((max(size, 1),), np.int32)
        host = buffer[:size].reshape(shape)
        self._timed_out[slot] = 0
        self._waited_ns[slot] = 0
        masks.compute_into(host)

        def release(ready: GrammarMasks) -> None:  # on the thread that finished the masks
            if ready.bitmask is not host:
                np.copyto(host, ready.bitmask)
            self._flags[slot] = sequence

        kernel("logit_constraints.cu", "wait_for_host_flag")(
            (1,), (1,), (np.uint64(self._device_address + 4 * slot), np.int32(sequence),
                         np.uint64(self.TIMEOUT_NS), np.uint64(self._device_address + 4 * (self.DEPTH + slot)),
                         np.uint64(self._device_address + 4 * 2 * self.DEPTH + 8 * slot)))
        device = upload_pinned(host)
        masks.when_ready(release)

        def check() -> None:  # at read-back: the wait kernel ran long before
            waited = int(self._waited_ns[slot])
            with self._lock:
                self._device_wait_ns += waited
                self._device_waits += 1
                self._recent_waits_ms.append(waited / 1e6)
            if self._timed_out[slot]:
                raise RuntimeError("the GPU gave up waiting for the step's grammar masks")
            masks.wait()

        return device, check


def _mapped_host_int32(count: int) -> tuple[np.ndarray, int]:
    """``count`` int32 of pinned host memory mapped for the device (cudaHostAllocPortable |
    cudaHostAllocMapped) and their device address (with unified addressing, the host's)."""
    address = cupy.cuda.runtime.hostAlloc(4 * count, 3)
    array = np.ctypeslib.as_array((ctypes.c_int32 * count).from_address(address))
    device_pointer = getattr(cupy.cuda.runtime, "hostGetDevicePointer", None)
    if device_pointer is not None:
        try:
            return array, int(device_pointer(address, 0))
        except Exception:  # noqa: BLE001 (an older CuPy's signature): unified addressing, the host address
            pass
    return array, address


_gates: _MaskGates | None = None
# logit_bias and grammar masks are applied by ``apply_logit_constraints_tiled`` (a row spread over
# blocks of CONSTRAINT_THREADS * CONSTRAINT_TOKENS_PER_THREAD tokens), in the engine's asynchronous
# sampling to the forward's logits in place (no copy of them); =0: one block per row on a copy (the
# former way). Default by E2 (H200, merged main d5bcefd, benchmarks/grammar_mask.py overhead, Qwen3-4B
# shape, every row under the schema, 4 alternating rounds, results/grammar_mask_cuda_e2_h200.json):
# TPOT overhead at batch 1 +5.6 % -> +0.8 % (3.248 -> 3.102 ms, plain 3.076), at batch 64 +9.8 % ->
# +5.1 % (4.282 -> 4.099 ms, plain 3.901), faster in every round; confirmed by E3 (merged main e0c0aad,
# 5 rounds, grammar_mask_cuda_e3_h200.json: batch 1 +5.2 -> +0.3 %, batch 64 +11.0 -> +7.1 %). Read at
# every step (benchmarks switch it between runs)
TILED_CONSTRAINTS_ENV = "OPENINFER_TILED_LOGIT_CONSTRAINTS"
CONSTRAINT_THREADS = 256
CONSTRAINT_TOKENS_PER_THREAD = 8  # TOKENS_PER_THREAD of logit_constraints.cu


def tiled_logit_constraints() -> bool:
    """Whether the tiled kernel applies the constraints (now): unless ``OPENINFER_TILED_LOGIT_CONSTRAINTS=0``."""
    return os.environ.get(TILED_CONSTRAINTS_ENV, "1") != "0"


def mask_gates() -> _MaskGates:
    global _gates
    if _gates is None:
        _gates = _MaskGates()
    return _gates


def upload_pinned(host: np.ndarray) -> cupy.ndarray:
    """``host`` (pinned memory) copied to a new device array on the current stream, asynchronously."""
    device = cupy.empty(host.shape, dtype=host.dtype)
    if host.nbytes:
        device.data.copy_from_host_async(ctypes.c_void_p(host.ctypes.data), host.nbytes,
                                         cupy.cuda.get_current_stream())
    return device


def _apply_inputs(logits: cupy.ndarray, inputs: DeviceSamplingInputs,
                  checks: list[Callable[[], None]] | None = None, in_place: bool = False) -> cupy.ndarray:
    """``logits`` with the rows' logit_bias added and grammar masks applied: a new array when any
    row has either (``in_place``: ``logits`` itself when C-contiguous), ``logits`` itself
    (untouched) when none has. The host arrays go up by
    CuPy's staged asynchronous copies: nothing here waits for the device. Masks not computed
    yet are waited for on the device (``_MaskGates``; needs ``checks``, which gets the check
    to run at read-back)."""
    if not inputs.constrains:
        return logits
    rows, vocab = logits.shape
    if inputs.bias_start is not None:
        bias_start, bias_ids = cupy.asarray(inputs.bias_start), cupy.asarray(inputs.bias_ids)
        bias_values = cupy.asarray(inputs.bias_values)
    else:  # every row's list is empty
        bias_start = cupy.zeros(rows + 1, cupy.int32)
        bias_ids, bias_values = bias_start, bias_start.view(cupy.float32)
    masks = inputs.masks
    if masks is not None and masks.bitmask.shape[0]:
        if masks.mask_rows.shape[0] != rows:
            raise ValueError(f"grammar masks for {masks.mask_rows.shape[0]} rows, logits have {rows}")
        if masks.is_ready or checks is None:
            bitmask = cupy.asarray(np.ascontiguousarray(masks.wait().bitmask, np.int32))
        else:
            bitmask, check = mask_gates().queue_wait(masks)
            checks.append(check)
        mask_rows = cupy.asarray(np.ascontiguousarray(masks.mask_rows, np.int32))
        words = masks.bitmask.shape[1]
    else:
        mask_rows = cupy.full(rows, -1, cupy.int32)
        bitmask, words = mask_rows, 0
    adjusted = logits if in_place and logits.flags.c_contiguous else cupy.array(logits, copy=True, order="C")
    arguments = (adjusted, np.int32(vocab), bias_start, bias_ids, bias_values, bitmask, np.int32(words), mask_rows)
    if tiled_logit_constraints():
        tiles = -(-vocab // (CONSTRAINT_THREADS * CONSTRAINT_TOKENS_PER_THREAD))
        kernel("logit_constraints.cu", "apply_logit_constraints_tiled")((rows, tiles), (CONSTRAINT_THREADS,), arguments)
    else:
        kernel("logit_constraints.cu", "apply_logit_constraints")((rows,), (CONSTRAINT_THREADS,), arguments)
    return adjusted


def apply_logit_constraints(logits: cupy.ndarray, states: Sequence[SamplingState],
                            masks: GrammarMasks | None = None) -> cupy.ndarray:
    """``logits`` with each row's logit_bias added and its grammar mask (``masks.row(i)``)
    applied (a new array when any row has either; ``logits`` itself, untouched, when none has)."""
    return _apply_inputs(logits, device_sampling_inputs(states, masks, draws=False))


def launch_device_sampling(logits: cupy.ndarray, states: Sequence[SamplingState],
                           masks: GrammarMasks | None = None,
                           checks: list[Callable[[], None]] | None = None, in_place: bool = False) -> cupy.ndarray:
    """Queue the sampling kernel; the token ids [rows] stay on the device (int32). ``checks``:
    masks still being computed are waited for on the device, and the check to run at read-back
    is appended here (without, they are waited for here). ``in_place``: the bias and masks may be
    applied to ``logits`` itself (nothing reads them after the sampling)."""
    inputs = device_sampling_inputs(states, masks)
    logits = _apply_inputs(logits, inputs, checks, in_place)
    rows, vocab = logits.shape
    device_params = cupy.asarray(inputs.params)
    tokens = cupy.empty(rows, dtype=cupy.int32)
    logprobs = cupy.empty(rows, dtype=cupy.float32)
    kernel("sampling.cu", "sample_rows")(
        (rows,), (1024,),
        (cupy.ascontiguousarray(logits), np.int32(vocab), device_params[0], device_params[4].view(cupy.int32),
         device_params[1], device_params[2], device_params[3], tokens, logprobs))
    return tokens


class _HostLogits:
    """Lets the reference sampler read rows that are already float32 on the host."""

    name = "host"

    @staticmethod
    def to_host(x: Any) -> np.ndarray:
        return x


def sample_rows(logits: cupy.ndarray, rows: Sequence[LogitsRow], eos_token_ids: Sequence[int],
                to_host: Any, masks: GrammarMasks | None = None) -> list[RowSample]:
    """The engine's sampling step for ``logits [len(rows), vocab]`` on the GPU; ``masks``: the
    step's grammar masks (rows with and without one sample in the same kernel launch)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
    on_device = [i for i, row in enumerate(rows) if samples_on_device(row)]
    on_host = [i for i in range(len(rows)) if i not in set(on_device)]
    results: list[RowSample | None] = [None] * len(rows)
    if on_device:
        index = cupy.asarray(np.asarray(on_device, np.int32))
        tokens = sample_device_rows(logits[index], [rows[i].request.sampling for i in on_device],
                                    masks.subset(on_device) if masks is not None else None)
        for i, token in zip(on_device, tokens, strict=True):
            results[i] = RowSample(int(token))
    if on_host:
        index = cupy.asarray(np.asarray(on_host, np.int32))
        host = to_host(logits[index])
        host_masks = masks.subset(on_host) if masks is not None else None  # re-indexed to the host subset's rows
        for i, sample in zip(on_host, sample_rows_on_host(_HostLogits(), host, [rows[i] for i in on_host],
                                                          eos_token_ids, host_masks), strict=True):
            results[i] = sample
    return [r for r in results if r is not None]


def sample_rows_async(logits: cupy.ndarray, rows: Sequence[LogitsRow],
                      masks: GrammarMasks | None = None) -> tuple[cupy.ndarray, Any] | None:
    """Queue sampling of every row (``masks``: the step's grammar masks, applied on the device)
    and an asynchronous copy of the ids into pinned memory.

    Returns (device ids, read_back) — ``read_back()`` waits only for this step's copy, not for
    work queued after it — or None when some row needs the host sampler. ``masks`` not computed
    yet (the engine's device wait, on unless ``OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT=0``) are waited for on
    the GPU (``_MaskGates``); ``read_back()`` raises when they failed.
    """
    if not rows or not all(row.samples and kernel_can_sample(row.request) for row in rows):
        return None
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
    checks: list[Callable[[], None]] = []
    # the step's logits are read by this sampling only: the tiled kernel masks them in place
    tokens = launch_device_sampling(logits, [row.request.sampling for row in rows], masks, checks,
                                    in_place=tiled_logit_constraints())
    pinned = empty_pinned(tokens.shape, dtype=np.int32)
    stream = cupy.cuda.get_current_stream()
    tokens.get(stream=stream, out=pinned, blocking=False)
    copied = cupy.cuda.Event(block=True, disable_timing=True)
    copied.record(stream)

    def read_back() -> list[RowSample]:
        copied.synchronize()
        for check in checks:
            check()
        return [RowSample(int(token)) for token in pinned]

    return tokens, read_back
