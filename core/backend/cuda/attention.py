"""Attention: fused q/k-norm + RoPE + paged KV write, then decode or prefill attention.

Decode steps (one new token per sequence) run ``decode_attention.py``'s split-KV kernels; the
split count depends only on the batch size, so a captured graph stays valid for every context
length. Anything else (prefill, chunked prefill, mixed batches) runs a tensor-core prefill
kernel: on Hopper (compute capability 9.0) with head_dim 128 or 256 the warp-specialised wgmma
kernel (prefill_attention_sm90.cu, built for sm_90a), elsewhere the mma.sync kernel
(prefill_attention.cu). Two routings (``attention_routing.py``) take rows away from it:
steps of at most ``SHORT_QUERY_MAX_TOKENS`` new tokens per sequence (a warm prefix's last block)
run the split-KV short-query kernel from ``SHORT_QUERY_MIN_CONTEXT`` tokens of context on
(``OPENINFER_SHORT_QUERY_ATTENTION=1`` / ``0`` forces it on / off); a mixed step's leading
1-token rows (its running decodes, ``MIXED_MIN_DECODE_ROWS`` or more) run the decode kernel and
only the prompt chunks' tiles the prefill kernel (``OPENINFER_MIXED_DECODE_ATTENTION=0``: all rows
on the prefill kernel).
``OPENINFER_PREFILL_KERNEL=mma`` forces the mma.sync kernel (for comparisons);
``OPENINFER_SM90_*`` variables pick variants of the sm90 kernel (``kernel_choices.py``: ``sm90_variant``,
``sm90_kv_loads``: TMA or cp.async K/V copies, ``sm90_schedule``: a CTA per work item or persistent CTAs;
``attention_routing.py``: ``OPENINFER_SM90_KV_RUNS``, a K/V tile of consecutive cache blocks in one TMA
box per column block, and ``OPENINFER_SM90_Q_REGISTERS``, Q K^T with Q in registers at head_dim 128;
both on by default, "0" reverts). ``OPENINFER_SM90_SHORT_QUERY`` (default on; "0" reverts) runs short
steps on the Hopper short-query kernel
(prefill_attention_sm90_short.cu: 16 tokens x 4 heads of a KV head as one wgmma M tile, TMA K/V,
split-KV) instead of decode_attention_mma.cu's, where it applies (head_dim 128, KV blocks of 8-64 tokens).

These switches are read once per process (a prefill step does not look at the environment);
``refresh_kernel_choices()`` re-reads them, for benchmarks and tests that switch in one process.
"""

from __future__ import annotations

import functools

import cupy
import numpy as np

from openinfer.backend.base import AttentionSpec, KVLayer
from openinfer.backend.cuda.attention_routing import (
    MixedSplit,
    sm90_short_query_row_groups,
    split_mixed_step,
    wanted_sm90_kv_runs,
    wanted_sm90_q_registers,
    wanted_sm90_short_query,
    wants_short_query,
)
from openinfer.backend.cuda.batch import PREFILL_TILE, CudaBatch
from openinfer.backend.cuda.decode_attention import (
    LOG2E,
    SHORT_QUERY_MAX_TOKENS,
    merge_splits,
    mma_supports,
    output_rows,
    paged_decode_attention,
    short_query_attention_mma,
)
from openinfer.backend.cuda.decode_attention_plan import MAX_SPLITS, shared_split_count
from openinfer.backend.cuda.kernel_choices import (  # noqa: F401  (re-exported for tests and benchmarks)
    MIXED_DECODE_ENV,
    PREFILL_KERNEL_ENV,
    PREFILL_KERNELS,
    SHORT_QUERY_ENV,
    SM90_BLOCK_M,
    SM90_ENV,
    SM90_HEAD_DIMS,
    SM90_KV_LOAD_MODES,
    SM90_KV_LOADS,
    SM90_PERSISTENT_MAX_CONTEXT,
    SM90_SCHEDULE,
    SM90_SCHEDULES,
    SM90_TMA_MIN_CONTEXT,
    kernel_choices,
    refresh_kernel_choices,
    sm90_head_pairs,
    sm90_kv_loads,
    sm90_schedule,
    sm90_shared_bytes,
    sm90_tma_min_context,
    sm90_variant,
)
from openinfer.backend.cuda.linear import sm_count
from openinfer.backend.cuda.loader import arch_kernel, kernel
from openinfer.backend.cuda.qkv_write import (
    vector_qkv_write_supported,
    wants_vector_qkv_write,
    write_qkv_vectorized,
)
from openinfer.backend.cuda.tensor_maps import page_maps
from openinfer.rope import RotaryEmbedding

# The persistent kernel's work counter and finished-CTA count, per device: zero between launches
# (the last CTA of each launch resets them), so launches on one device must not overlap (the
# engine runs a device's steps on one stream).
_schedulers: dict[int, cupy.ndarray] = {}


def _persistent_scheduler(head_dim: int, batch: CudaBatch) -> cupy.ndarray | None:
    """The device counter of a persistent launch, or None for the grid schedule (not asked for:
    "auto" with a long or unknown context; another head size, or a CUDA graph being captured before
    the counter exists)."""
    schedule = sm90_schedule()
    if schedule == "auto":
        short = batch.host is not None and batch.max_context_len < SM90_PERSISTENT_MAX_CONTEXT
        schedule = "persistent" if short else "grid"
    if schedule != "persistent" or head_dim != 128:
        return None
    device_id = cupy.cuda.Device().id
    found = _schedulers.get(device_id)
    if found is None and not cupy.cuda.get_current_stream().is_capturing():
        found = _schedulers[device_id] = cupy.zeros(2, dtype=cupy.int32)
    return found


def _tma_kv_loads(head_dim: int, kv: KVLayer, batch: CudaBatch) -> bool:
    """Whether this launch takes TMA K/V loads: asked for ("auto": a long enough context, a host
    count), and a cache layout they copy page by page."""
    block_size = int(kv.k.shape[1])
    block_n = 64 if head_dim == 256 else 128
    mode = sm90_kv_loads()
    if mode == "cp_async" or block_n % block_size or block_size % 8:
        return False
    # with K/V runs (OPENINFER_SM90_KV_RUNS) "auto" takes TMA at every host-counted context: E1, head_dim
    # 256, 8 x 1008 prompts on consecutive blocks, TMA runs 300.7 vs cp.async 270.4 TFLOP/s
    short = batch.host is not None and batch.max_context_len < sm90_tma_min_context(head_dim) \
        and not wanted_sm90_kv_runs()
    if mode == "auto" and (batch.host is None or short):
        return False
    return bool(kv.k.flags.c_contiguous and kv.v.flags.c_contiguous)


SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
NULL = np.uint64(0)
assert SM90_BLOCK_M == PREFILL_TILE, "the sm90 kernel's CTA takes one prefill tile"


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
    if wants_vector_qkv_write() and vector_qkv_write_supported(spec):  # default; OPENINFER_VECTOR_QKV_WRITE=0 reverts
        return write_qkv_vectorized(qkv, spec, kv, batch, ropes)
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


@functools.cache
def _compute_capability(device_id: int) -> str:
    return cupy.cuda.Device(device_id).compute_capability


def sm90_prefill_supported(head_dim: int) -> bool:
    """Whether this GPU and head size run the Hopper wgmma prefill kernel."""
    return _compute_capability(cupy.cuda.Device().id) == "90" and head_dim in SM90_HEAD_DIMS


def prefill_attention(q: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch,
                      implementation: str = "auto", out: cupy.ndarray | None = None,
                      tile_range: tuple[int, int] | None = None) -> cupy.ndarray:
    """Causal attention of the batch's queries ``q [T, nh, d]`` over the paged cache -> ``[T, nh d]``.

    ``implementation``: "sm90" (Hopper wgmma kernel), "mma" (mma.sync kernel, any GPU) or "auto"
    (sm90 where supported, unless ``OPENINFER_PREFILL_KERNEL=mma``); ``out`` is written in place if given;
    ``tile_range`` ``(start, stop)``: only those of the batch's prefill tiles (the rows of the others
    are left as they are).
    """
    if implementation not in PREFILL_KERNELS:
        raise ValueError(f"prefill attention implementation must be one of {PREFILL_KERNELS}, got {implementation!r}")
    if batch.num_tiles == 0 and batch.num_tokens > 0:
        # a decode-shaped batch (one new token per sequence) is uploaded without prefill tiles:
        # attention() sends it to the decode kernel
        raise ValueError("this batch has no prefill tiles (one new token per sequence): use the decode kernel")
    if implementation == "auto":
        forced = kernel_choices().prefill == "mma"
        implementation = "mma" if forced or not sm90_prefill_supported(spec.head_dim) else "sm90"
    elif implementation == "sm90" and not sm90_prefill_supported(spec.head_dim):
        raise ValueError(f"the sm90 prefill kernel needs a compute capability 9.0 GPU and head_dim in "
                         f"{SM90_HEAD_DIMS}; got head_dim {spec.head_dim}")
    start, stop = (0, batch.num_tiles) if tile_range is None else tile_range
    if not 0 <= start <= stop <= batch.num_tiles:
        raise ValueError(f"tile range {tile_range} is outside the batch's {batch.num_tiles} prefill tiles")
    if out is None:
        out = cupy.empty((batch.num_tokens, spec.num_heads * spec.head_dim), dtype=cupy.uint16)
    num_tiles = stop - start
    if num_tiles == 0:
        return out
    # the kernels take tile i of the launch from tile_seq[i] / tile_query[i]: a range is a view
    args = (q, kv.k, kv.v, batch.block_tables, np.int32(batch.block_tables.shape[1]), batch.query_start,
            batch.context_lens, batch.tile_seq[start:stop], batch.tile_query[start:stop], out,
            np.int32(spec.num_heads), np.int32(spec.num_kv_heads), np.int32(kv.k.shape[1]),
            np.float32(spec.scale * LOG2E))
    if implementation == "sm90":
        variant = sm90_variant(spec.head_dim)
        shared = sm90_shared_bytes(spec.head_dim, variant.stages)
        tma = _tma_kv_loads(spec.head_dim, kv, batch)
        scheduler = _persistent_scheduler(spec.head_dim, batch)
        head_pairs = sm90_head_pairs(variant, spec.head_dim, spec.num_heads, spec.num_kv_heads)
        multicast = (tma and sm90_kv_loads() == "tma_multicast" and scheduler is None and variant.kv_head_major_grid
                     and (spec.num_heads // spec.num_kv_heads) % 2 == 0 and not head_pairs)
        # OPENINFER_SM90_KV_RUNS=1: a tile of consecutive blocks in one box per column block (the
        # define only when on, so the default build's kernel key is unchanged)
        # OPENINFER_SM90_Q_REGISTERS=1 (head_dim 128, the overlapped loop): Q K^T with Q from registers
        runs = tma and wanted_sm90_kv_runs()
        extra = ({"KV_RUNS": 1} if runs else {}) | \
            ({"Q_REGISTERS": 1} if spec.head_dim == 128 and variant.intra_wg_overlap and wanted_sm90_q_registers()
             else {})
        fn = arch_kernel("prefill_attention_sm90.cu", "prefill_attention_sm90", "sm_90a", shared,
                         **variant.defines(spec.head_dim, int(kv.k.shape[1])), TMA_KV_LOADS=int(tma),
                         PERSISTENT=int(scheduler is not None), KV_MULTICAST=int(multicast),
                         HEAD_PAIRS=int(head_pairs), **extra)
        if scheduler is not None:
            grid = (min(sm_count(cupy.cuda.Device().id), spec.num_heads * num_tiles), 1)
        elif variant.kv_head_major_grid:
            grid = (spec.num_heads // spec.num_kv_heads * num_tiles, spec.num_kv_heads)
        else:
            grid = (spec.num_heads, num_tiles)
        maps = (page_maps.get(kv.k), page_maps.get(kv.v)) if tma else (NULL, NULL)
        if runs:
            block_n = 64 if spec.head_dim == 256 else 128
            maps += (page_maps.get(kv.k, box_tokens=block_n), page_maps.get(kv.v, box_tokens=block_n))
        fn(grid, (384,), (*args, *maps, np.int32(num_tiles), NULL if scheduler is None else scheduler),
           shared_mem=shared)
        return out
    fn = kernel("prefill_attention.cu", "prefill_attention", HEAD_DIM=spec.head_dim)
    shared = 5 * 64 * (spec.head_dim + 8) * 2  # Q + two stages of K and V, 64 rows each (prefill_attention.cu)
    if fn.max_dynamic_shared_size_bytes < shared:
        fn.max_dynamic_shared_size_bytes = shared
    fn((2 * num_tiles, spec.num_heads), (128,), args, shared_mem=shared)  # one block per half tile
    return out


def runs_short_query_kernel(spec: AttentionSpec, batch: CudaBatch) -> bool:
    """Whether a step that is not plain decode takes the short-query kernel: at most
    SHORT_QUERY_MAX_TOKENS new tokens per sequence, a head size / group the mma kernel takes, and
    the switch on, or "auto" with a context where the kernel is measured faster (host counts only).
    A batch without its host step (a graph's static batch being captured) has no context to go by:
    "auto" takes the short-query kernel there, as the graph replays at every context."""
    context = batch.max_context_len if batch.host is not None else None
    return (1 <= batch.max_query_len <= SHORT_QUERY_MAX_TOKENS
            and mma_supports(spec.head_dim, spec.num_heads // spec.num_kv_heads)
            and wants_short_query(kernel_choices().short_query, context))


class _StepSplits:
    """The mixed split of the latest step seen (every layer of a step asks about the same batch):
    computed once per step on the host from the tiles the batch was uploaded with, never from
    device arrays. Only an eagerly uploaded batch (``host_tile_seq``, fixed for its life) is split;
    the static batches of CUDA graphs are not."""

    def __init__(self) -> None:
        self._batch: CudaBatch | None = None
        self._split: MixedSplit | None = None

    def get(self, batch: CudaBatch) -> MixedSplit | None:
        if batch is not self._batch:
            tiles = batch.host_tile_seq
            self._split = None if batch.host is None or tiles is None else \
                split_mixed_step(batch.host.query_start, tiles)
            self._batch = batch
        return self._split


_step_splits = _StepSplits()


def mixed_split(batch: CudaBatch) -> MixedSplit | None:
    """How ``attend`` splits this (not plain decode) step (OPENINFER_MIXED_DECODE_ATTENTION on, the default)."""
    return _step_splits.get(batch)


def mixed_attention(q: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch, split: MixedSplit,
                    num_sms: int, decode_stream: cupy.cuda.Stream | None = None) -> cupy.ndarray:
    """A mixed step: the leading ``split.decode_rows`` 1-token rows through the decode kernel, the
    prompt chunks' tiles (one range: ``prefill_tiles`` orders the decodes' tiles last) through the
    prefill kernel, both writing their rows of one ``[T, nh d]`` output in place. Both read the
    K/V that ``write_qkv`` stored before, so their order does not matter: with ``decode_stream``
    the decode rows run on it beside the chunks (forked after the current stream's work so far,
    joined before the current stream goes on)."""
    rows = split.decode_rows
    out = cupy.empty((batch.num_tokens, spec.num_heads * spec.head_dim), dtype=cupy.uint16)
    decodes = functools.partial(paged_decode_attention, q[:rows], kv.k, kv.v, batch.block_tables[:rows],
                                batch.context_lens[:rows], spec.scale, num_sms, out=out[:rows])
    if decode_stream is None:
        for tile_range in split.prefill_tile_ranges:
            prefill_attention(q, spec, kv, batch, out=out, tile_range=tile_range)
        decodes()
        return out
    main = cupy.cuda.get_current_stream()
    inputs_ready = cupy.cuda.Event(disable_timing=True)
    inputs_ready.record(main)
    decode_stream.wait_event(inputs_ready)
    with decode_stream:
        decodes()
        decodes_done = cupy.cuda.Event(disable_timing=True)
        decodes_done.record(decode_stream)
    for tile_range in split.prefill_tile_ranges:
        prefill_attention(q, spec, kv, batch, out=out, tile_range=tile_range)
    main.wait_event(decodes_done)
    return out


# prefill_attention_sm90_short.cu: 64-key K/V tiles, SQ90_STAGES of them, + 1 KB to align the ring
SM90_SHORT_QUERY_KEYS = 64
SM90_SHORT_QUERY_STAGES = 3
SM90_SHORT_QUERY_HEAD_DIMS = (128,)
SM90_SHORT_QUERY_CLUSTER = 1  # splits per thread-block cluster that combine through DSMEM (1: none)


def sm90_short_query_supported(head_dim: int, group: int, k_cache: cupy.ndarray, v_cache: cupy.ndarray) -> bool:
    """Whether the Hopper short-query kernel runs this shape: a compute capability 9.0 GPU, head_dim
    128, a GQA group of at most 64, contiguous caches whose blocks are whole TMA pages of a 64-key tile."""
    block_size = int(k_cache.shape[1])
    return (_compute_capability(cupy.cuda.Device().id) == "90" and head_dim in SM90_SHORT_QUERY_HEAD_DIMS
            and 1 <= group <= 64 and block_size % 8 == 0 and SM90_SHORT_QUERY_KEYS % block_size == 0
            and bool(k_cache.flags.c_contiguous and v_cache.flags.c_contiguous))


def short_query_attention_sm90(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray,
                               block_tables: cupy.ndarray, context_lens: cupy.ndarray, query_start: cupy.ndarray,
                               max_query_len: int, scale: float, num_sms: int, *, splits: int | None = None,
                               stages: int = SM90_SHORT_QUERY_STAGES, kv_runs: bool | None = None,
                               cluster: int = SM90_SHORT_QUERY_CLUSTER,
                               out: cupy.ndarray | None = None) -> cupy.ndarray:
    """``short_query_attention_mma``'s contract on the Hopper wgmma kernel (prefill_attention_sm90_short.cu):
    causal attention of at most SHORT_QUERY_MAX_TOKENS new tokens per sequence, ``q [T, nh, d]`` ->
    ``[T, nh * d]`` bf16, split over the keys (``splits``: default about one CTA per SM, a power of two,
    at most MAX_SPLITS), the splits merged by
    decode_attention_mma.cu's merge kernel. ``stages``: the K/V ring's depth, 2..6 (benchmarks);
    ``kv_runs``: tiles of consecutive KV blocks in one TMA box per column block (None:
    OPENINFER_SM90_KV_RUNS); ``cluster`` (1, 2, 4, 8): clusters of that many splits combine their
    partials in the kernel (distributed shared memory), so the merge reads splits / cluster of them
    (none when one cluster holds every split); the largest of 8, 4, 2, 1 up to it that divides the splits."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = int(k_cache.shape[2]), int(k_cache.shape[1])
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    if not sm90_short_query_supported(head_dim, group, k_cache, v_cache):
        raise ValueError(f"the sm90 short-query kernel needs a compute capability 9.0 GPU, head_dim in "
                         f"{SM90_SHORT_QUERY_HEAD_DIMS}, a GQA group <= 64 and contiguous caches of 8/16/32/64-token "
                         f"blocks; got head_dim {head_dim}, group {group}, block size {block_size}")
    if not 1 <= max_query_len <= SHORT_QUERY_MAX_TOKENS:
        raise ValueError(f"the short-query kernel takes 1..{SHORT_QUERY_MAX_TOKENS} new tokens per sequence, "
                         f"got {max_query_len}")
    num_seqs = int(context_lens.shape[0])
    row_groups = sm90_short_query_row_groups(max_query_len, group)
    if not 2 <= stages <= 6:
        raise ValueError(f"stages must be 2..6 (32 KB each), got {stages}")
    if splits is None:
        # about one CTA per SM (shared_split_count aims at two): E1, batch 1 at 16k, 16 splits 25.7 us vs
        # 32 splits 29.0 (4k 12.8 vs 14.9, 1k 8.8 vs 11.3)
        splits = shared_split_count(num_seqs * num_kv_heads * row_groups * 2, num_sms)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be 1..{MAX_SPLITS}, got {splits}")
    if cluster not in (1, 2, 4, 8):
        raise ValueError(f"cluster must be 1, 2, 4 or 8 splits, got {cluster}")
    while splits % cluster:
        cluster //= 2
    parts = splits // cluster  # partials the merge reads
    out = output_rows(out, num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return out
    shared = stages * 2 * SM90_SHORT_QUERY_KEYS * head_dim * 2 + 1024
    runs = wanted_sm90_kv_runs() if kv_runs is None else kv_runs
    fn = arch_kernel("prefill_attention_sm90_short.cu", "short_query_attention_sm90", "sm_90a", shared,
                     HEAD_DIM=head_dim, GROUP=group, PAGE_SIZE=block_size, SQ90_STAGES=stages, SQ90_RUNS=int(runs),
                     SQ90_CLUSTER=cluster)
    maps = (page_maps.get(k_cache), page_maps.get(v_cache))
    if runs:
        maps += (page_maps.get(k_cache, box_tokens=SM90_SHORT_QUERY_KEYS),
                 page_maps.get(v_cache, box_tokens=SM90_SHORT_QUERY_KEYS))
    if parts == 1:
        partial_out = partial_ml = out  # unused: the kernel writes ``out``
    else:
        partial_out = cupy.empty((num_tokens, num_heads, parts, head_dim), dtype=cupy.float32)
        partial_ml = cupy.empty((num_tokens, num_heads, parts, 2), dtype=cupy.float32)
    fn((splits * row_groups, num_kv_heads, num_seqs), (160,),
       (q, k_cache, v_cache, block_tables, np.int32(block_tables.shape[1]), context_lens, query_start,
        np.int32(row_groups), out, partial_out, partial_ml, np.int32(num_kv_heads), np.int32(block_size),
        np.int32(splits), np.float32(scale * LOG2E), *maps),
       shared_mem=shared)
    # decode_attention_mma.cu's merge: partials of token rows in place of sequences
    merge_splits(partial_out, partial_ml, out, num_heads, head_dim, group, parts)
    return out


def short_query_attention(q: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch,
                          num_sms: int) -> cupy.ndarray:
    """A few new tokens per sequence: ``q [T, nh, d] -> [T, nh d]`` (``decode_attention.py``; with
    ``OPENINFER_SM90_SHORT_QUERY=1`` the Hopper kernel where it applies)."""
    if wanted_sm90_short_query() and sm90_short_query_supported(spec.head_dim, spec.num_heads // spec.num_kv_heads,
                                                                kv.k, kv.v):
        return short_query_attention_sm90(q, kv.k, kv.v, batch.block_tables, batch.context_lens, batch.query_start,
                                          batch.max_query_len, spec.scale, num_sms)
    return short_query_attention_mma(q, kv.k, kv.v, batch.block_tables, batch.context_lens, batch.query_start,
                                     batch.max_query_len, spec.scale, num_sms)


def attend(q: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch, num_sms: int) -> cupy.ndarray:
    """Attention of the step's queries ``q [T, nh, d]`` (K/V already written) -> ``[T, nh d]``, each
    row through the kernel its step shape routes it to."""
    if batch.is_decode and batch.num_tokens == batch.num_seqs:
        return decode_attention(q, spec, kv, batch, num_sms)
    if runs_short_query_kernel(spec, batch):
        return short_query_attention(q, spec, kv, batch, num_sms)
    if kernel_choices().mixed_decode:
        split = mixed_split(batch)
        if split is not None:
            return mixed_attention(q, spec, kv, batch, split, num_sms)
    return prefill_attention(q, spec, kv, batch)


def attention(qkv: cupy.ndarray, spec: AttentionSpec, kv: KVLayer, batch: CudaBatch, ropes: RopeTables,
              num_sms: int) -> cupy.ndarray:
    """``qkv [T, (nh + 2 nkv) d] -> [T, nh d]``, writing this step's K/V into the paged cache."""
    _check(spec, kv)
    return attend(write_qkv(qkv, spec, kv, batch, ropes), spec, kv, batch, num_sms)
