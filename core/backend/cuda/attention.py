"""Attention: fused q/k-norm + RoPE + paged KV write, then decode or prefill attention.

Decode steps (one new token per sequence) run ``decode_attention.py``'s split-KV kernels; the
split count depends only on the batch size, so a captured graph stays valid for every context
length. Anything else (prefill, chunked prefill, mixed batches) runs a tensor-core prefill
kernel: on Hopper (compute capability 9.0) with head_dim 128 or 256 the warp-specialised wgmma
kernel (prefill_attention_sm90.cu, built for sm_90a), elsewhere the mma.sync kernel
(prefill_attention.cu). With ``OPENINFER_SHORT_QUERY_ATTENTION=1``, steps of at most
``SHORT_QUERY_MAX_TOKENS`` new tokens per sequence (a warm prefix's last block) run the split-KV
short-query kernel instead (off until measured on a GPU: benchmarks/gpu_prefill_attention.py
--short-queries). ``OPENINFER_PREFILL_KERNEL=mma`` forces the mma.sync kernel (for comparisons);
``OPENINFER_SM90_*`` variables pick variants of the sm90 kernel (``sm90_variant``) for measurements.

These switches are read once per process (a prefill step does not look at the environment);
``refresh_kernel_choices()`` re-reads them, for benchmarks and tests that switch in one process.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import cupy
import numpy as np

from openinfer.backend.base import AttentionSpec, KVLayer
from openinfer.backend.cuda import decode_attention as decode_kernels
from openinfer.backend.cuda.batch import PREFILL_TILE, CudaBatch
from openinfer.backend.cuda.decode_attention import (
    LOG2E,
    SHORT_QUERY_MAX_TOKENS,
    mma_supports,
    paged_decode_attention,
    short_query_attention_mma,
)
from openinfer.backend.cuda.loader import arch_kernel, kernel
from openinfer.rope import RotaryEmbedding

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
NULL = np.uint64(0)


class RopeTables:
    """Device copies of each RotaryEmbedding's cos/sin tables, uploaded once."""

    def __init__(self) -> None:
        self._tables: dict[int, tuple[RotaryEmbedding, cupy.ndarray, cupy.ndarray]] = {}

    def get(self, rope: RotaryEmbedding) -> tuple[cupy.ndarray, cupy.ndarray]:
        entry = self._tables.get(id(rope))
        if entry is None or entry[0] is not rope:
            entry = (rope, cupy.asarray(rope.cos, dtype=cupy.float32), cupy.asarray(rope.sin, dtype=cupy.float32))
            self._tables[id(rope)] = entry
        return entry[1], entry[2]


def _check(spec: AttentionSpec, kv: KVLayer) -> None:
    if spec.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"cuda attention supports head_dim {SUPPORTED_HEAD_DIMS}, got {spec.head_dim}; "
                         "use --device cpu for this model")
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
    if kv.k.dtype != cupy.uint16 or kv.k.shape[2:] != (spec.num_kv_heads, spec.head_dim):
        raise ValueError(f"KV layer {tuple(kv.k.shape)} {kv.k.dtype} does not match the attention spec "
                         f"({spec.num_kv_heads} kv heads x {spec.head_dim}, bf16)")


def write_qkv(qkv: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch,
              ropes: RopeTables) -> cupy.ndarray:
    """Norm + rotate q and k, store k/v at the batch's slots; returns q ``[T, nh, d]``."""
    num_tokens = qkv.shape[0]
    if qkv.shape[1] != spec.q_size + 2 * spec.kv_size:
        raise ValueError(f"qkv has {qkv.shape[1]} features, expected q+k+v = {spec.q_size + 2 * spec.kv_size}")
    q = cupy.empty((num_tokens, spec.num_heads, spec.head_dim), dtype=cupy.uint16)
    if spec.rope is not None:
        cos, sin = ropes.get(spec.rope)
        rotary_dim = spec.rope.rotary_dim
    else:
        cos = sin = NULL
        rotary_dim = 0
    tasks = num_tokens * (spec.num_heads + 2 * spec.num_kv_heads)
    kernel("qk_norm_rope.cu", "qk_norm_rope_write_kv", HEAD_DIM=spec.head_dim)(
        ((tasks + 3) // 4,), (128,),
        (cupy.ascontiguousarray(qkv), q, kv.k, kv.v,
         spec.q_norm if spec.q_norm is not None else NULL, spec.k_norm if spec.k_norm is not None else NULL,
         np.float32(spec.norm_eps), cos, sin, np.int32(rotary_dim), batch.positions, batch.slot_mapping,
         np.int32(num_tokens), np.int32(spec.num_heads), np.int32(spec.num_kv_heads)))
    return q


def decode_attention(q: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch,
                     num_sms: int) -> cupy.ndarray:
    """One query per sequence: ``q [B, nh, d] -> [B, nh d]`` (kernels in ``decode_attention.py``)."""
    return paged_decode_attention(q, kv.k, kv.v, batch.block_tables, batch.context_lens, spec.scale, num_sms)


PREFILL_KERNELS = ("auto", "sm90", "mma")
PREFILL_KERNEL_ENV = "OPENINFER_PREFILL_KERNEL"  # "auto" (default) or "mma"
SHORT_QUERY_ENV = "OPENINFER_SHORT_QUERY_ATTENTION"  # "1": the short-query kernel for short steps
SHORT_QUERY_DEFAULT = False  # unmeasured on a GPU so far; a measurement flips this line


@dataclass(frozen=True)
class KernelChoices:
    """The attention kernel switches of the environment, read once (``kernel_choices``)."""

    prefill: str  # "auto" or "mma"
    short_query: bool


@functools.cache
def kernel_choices() -> KernelChoices:
    """OPENINFER_PREFILL_KERNEL and OPENINFER_SHORT_QUERY_ATTENTION, read once per process."""
    prefill = os.environ.get(PREFILL_KERNEL_ENV, "auto")
    if prefill not in ("auto", "mma"):
        raise ValueError(f"{PREFILL_KERNEL_ENV} must be 'auto' or 'mma', got {prefill!r}")
    short = os.environ.get(SHORT_QUERY_ENV, "1" if SHORT_QUERY_DEFAULT else "0")
    if short not in ("0", "1"):
        raise ValueError(f"{SHORT_QUERY_ENV} must be 0 or 1, got {short!r}")
    return KernelChoices(prefill=prefill, short_query=short == "1")


def refresh_kernel_choices() -> None:
    """Re-read every attention kernel switch (OPENINFER_PREFILL_KERNEL, OPENINFER_SHORT_QUERY_ATTENTION,
    OPENINFER_SM90_*, OPENINFER_DECODE_ATTENTION) from the environment at their next use."""
    kernel_choices.cache_clear()
    sm90_variant.cache_clear()
    decode_kernels.wanted_kernel.cache_clear()
SM90_HEAD_DIMS = (128, 256)
SM90_STAGES = {128: 3, 256: 2}  # K/V ring depth of prefill_attention_sm90.cu (what fits in 227 KB)
SM90_MAX_SHARED_BYTES = 227 * 1024
# Variants of the sm90 kernel, each chosen at run time by its environment variable so that one
# device run can test and time them side by side. The defaults are the kernel measured on H100
# (benchmarks/results/gpu_prefill_attention_variants.json: KV-head-major grid + batched page reads +
# ping-pong, 1.77x the first sm90 kernel over five cases, 523 TFLOP/s at 16k on H100); a variant
# becomes the default by changing its line.
SM90_GRID = "kv_head"  # OPENINFER_SM90_GRID: "head" (heads fastest) or "kv_head" (KV head by KV head: L2-resident K/V)
SM90_PAGE_READS = "batched"  # OPENINFER_SM90_PAGE_READS: "row" (one block-table read per row) or "batched"
SM90_PINGPONG = True  # OPENINFER_SM90_PINGPONG=0: the two consumer warpgroups issue wgmmas without taking turns
SM90_OVERLAP = True  # OPENINFER_SM90_OVERLAP=0: no overlap of tile k's softmax with tile k-1's P V
SM90_GRIDS = ("head", "kv_head")
SM90_PAGE_READ_MODES = ("row", "batched")
SM90_ENV = {name: f"OPENINFER_SM90_{name.upper()}"
            for name in ("grid", "page_reads", "pingpong", "overlap", "stages", "skip_kv_loads")}


@dataclass(frozen=True)
class Sm90Variant:
    """Compile-time choices of prefill_attention_sm90.cu (see the defines at its top)."""

    kv_head_major_grid: bool
    batched_page_reads: bool
    pingpong: bool
    intra_wg_overlap: bool
    stages: int
    skip_kv_loads: bool  # a timing diagnostic only: no K/V copies, wrong output

    def defines(self, head_dim: int, page_size: int) -> dict[str, int]:
        return {"HEAD_DIM": head_dim, "STAGES": self.stages, "KV_HEAD_MAJOR_GRID": int(self.kv_head_major_grid),
                "BATCHED_PAGE_READS": int(self.batched_page_reads), "PAGE_SIZE": page_size,
                "PINGPONG": int(self.pingpong), "INTRA_WG_OVERLAP": int(self.intra_wg_overlap),
                "SKIP_KV_LOADS": int(self.skip_kv_loads)}


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(SM90_ENV[name], default)
    if value not in choices:
        raise ValueError(f"{SM90_ENV[name]} must be one of {choices}, got {value!r}")
    return value


def _env_flag(name: str, default: bool) -> bool:
    return _env_choice(name, "1" if default else "0", ("0", "1")) == "1"


@functools.cache
def sm90_variant(head_dim: int) -> Sm90Variant:
    """The sm90 kernel variant the environment asks for (the SM90_* defaults where it is silent),
    read once per process and head size (``refresh_kernel_choices`` re-reads it)."""
    stages_text = os.environ.get(SM90_ENV["stages"], str(SM90_STAGES[head_dim]))
    stages = int(stages_text) if stages_text.isdigit() else 0
    if stages < 2 or sm90_shared_bytes(head_dim, stages) > SM90_MAX_SHARED_BYTES:
        raise ValueError(f"{SM90_ENV['stages']}={stages_text!r}: head_dim {head_dim} needs 2 or more K/V stages "
                         f"that fit in {SM90_MAX_SHARED_BYTES} bytes of shared memory")
    return Sm90Variant(
        kv_head_major_grid=_env_choice("grid", SM90_GRID, SM90_GRIDS) == "kv_head",
        batched_page_reads=_env_choice("page_reads", SM90_PAGE_READS, SM90_PAGE_READ_MODES) == "batched",
        pingpong=_env_flag("pingpong", SM90_PINGPONG), intra_wg_overlap=_env_flag("overlap", SM90_OVERLAP),
        stages=stages, skip_kv_loads=_env_flag("skip_kv_loads", False))


@functools.cache
def _compute_capability(device_id: int) -> str:
    return cupy.cuda.Device(device_id).compute_capability


def sm90_prefill_supported(head_dim: int) -> bool:
    """Whether this GPU and head size run the Hopper wgmma prefill kernel."""
    return _compute_capability(cupy.cuda.Device().id) == "90" and head_dim in SM90_HEAD_DIMS


def sm90_shared_bytes(head_dim: int, stages: int) -> int:
    """SHARED_BYTES of prefill_attention_sm90.cu: Q tile, K/V stages, mbarriers, alignment slack."""
    block_n = 64 if head_dim == 256 else 128
    q_tile = PREFILL_TILE * head_dim * 2
    kv_tile = block_n * head_dim * 2
    return q_tile + stages * 2 * kv_tile + 8 * (1 + 2 * stages) + 1024


def prefill_attention(q: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch,
                      implementation: str = "auto", out: cupy.ndarray | None = None) -> cupy.ndarray:
    """Causal attention of the batch's queries ``q [T, nh, d]`` over the paged cache -> ``[T, nh d]``.

    ``implementation``: "sm90" (Hopper wgmma kernel), "mma" (mma.sync kernel, any GPU) or "auto"
    (sm90 where supported, unless ``OPENINFER_PREFILL_KERNEL=mma``); ``out`` is written in place if given.
    """
    if implementation not in PREFILL_KERNELS:
        raise ValueError(f"prefill attention implementation must be one of {PREFILL_KERNELS}, got {implementation!r}")
    if implementation == "auto":
        forced = kernel_choices().prefill == "mma"
        implementation = "mma" if forced or not sm90_prefill_supported(spec.head_dim) else "sm90"
    elif implementation == "sm90" and not sm90_prefill_supported(spec.head_dim):
        raise ValueError(f"the sm90 prefill kernel needs a compute capability 9.0 GPU and head_dim in "
                         f"{SM90_HEAD_DIMS}; got head_dim {spec.head_dim}")
    if out is None:
        out = cupy.empty((batch.num_tokens, spec.num_heads * spec.head_dim), dtype=cupy.uint16)
    if batch.num_tiles == 0:
        return out
    args = (q, kv.k, kv.v, batch.block_tables, np.int32(batch.block_tables.shape[1]), batch.query_start,
            batch.context_lens, batch.tile_seq, batch.tile_query, out, np.int32(spec.num_heads),
            np.int32(spec.num_kv_heads), np.int32(kv.k.shape[1]), np.float32(spec.scale * LOG2E))
    if implementation == "sm90":
        variant = sm90_variant(spec.head_dim)
        shared = sm90_shared_bytes(spec.head_dim, variant.stages)
        fn = arch_kernel("prefill_attention_sm90.cu", "prefill_attention_sm90", "sm_90a", shared,
                         **variant.defines(spec.head_dim, int(kv.k.shape[1])))
        if variant.kv_head_major_grid:
            grid = (spec.num_heads // spec.num_kv_heads * batch.num_tiles, spec.num_kv_heads)
        else:
            grid = (spec.num_heads, batch.num_tiles)
        fn(grid, (384,), args, shared_mem=shared)
        return out
    fn = kernel("prefill_attention.cu", "prefill_attention", HEAD_DIM=spec.head_dim)
    shared = 5 * 64 * (spec.head_dim + 8) * 2  # Q + two stages of K and V, 64 rows each (prefill_attention.cu)
    if fn.max_dynamic_shared_size_bytes < shared:
        fn.max_dynamic_shared_size_bytes = shared
    fn((2 * batch.num_tiles, spec.num_heads), (128,), args, shared_mem=shared)  # one block per half tile
    return out


def runs_short_query_kernel(spec: AttentionSpec, batch: CudaBatch) -> bool:
    """Whether a step that is not plain decode takes the short-query kernel: switched on, at most
    SHORT_QUERY_MAX_TOKENS new tokens per sequence, and a head size / group the mma kernel takes."""
    return (kernel_choices().short_query and 1 <= batch.max_query_len <= SHORT_QUERY_MAX_TOKENS
            and mma_supports(spec.head_dim, spec.num_heads // spec.num_kv_heads))


def short_query_attention(q: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch,
                          num_sms: int) -> cupy.ndarray:
    """A few new tokens per sequence: ``q [T, nh, d] -> [T, nh d]`` (``decode_attention.py``)."""
    return short_query_attention_mma(q, kv.k, kv.v, batch.block_tables, batch.context_lens, batch.query_start,
                                     batch.max_query_len, spec.scale, num_sms)


def attention(qkv: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch, ropes: RopeTables,
              num_sms: int) -> cupy.ndarray:
    """``qkv [T, (nh + 2 nkv) d] -> [T, nh d]``, writing this step's K/V into the paged cache."""
    _check(spec, kv)
    q = write_qkv(qkv, spec, kv, batch, ropes)
    if batch.is_decode and batch.num_tokens == batch.num_seqs:
        return decode_attention(q, spec, kv, batch, num_sms)
    if runs_short_query_kernel(spec, batch):
        return short_query_attention(q, spec, kv, batch, num_sms)
    return prefill_attention(q, spec, kv, batch)
