"""CuPy launchers for ``kernels/dsv4.cu`` (bf16 activations and caches, fp32 math).

The core loader builds each kernel as a module of its own (``start_builds`` begins the model's
before the weights load, ``warm_up`` waits for them before any graph capture); every launcher
checks its inputs and raises ``ValueError`` naming what was wrong. Each launcher mirrors a NumPy op (named in its docstring),
and the ``gpu`` tests compare the two. Imported only on a CUDA machine.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from pathlib import Path
from typing import Any

import cupy
import numpy as np

from openinfer.backend.cuda import loader
from openinfer_deepseek_v4 import kernel_plan

KERNEL_FILE = Path(str(resources.files("openinfer_deepseek_v4") / "kernels" / "dsv4.cu"))
THREADS = 128
MIX_THREADS = 256  # dsv4_hc_mix: one (token, logit) dot product of hc·hidden per block
COLLAPSE_THREADS = 256
MAX_DIM = 1024
MAX_INDEX_QK = 8192
MAX_HC = 8
MAX_MIX = 32  # mixing logits + the norm per token the collapse kernel holds: (2 + hc)·hc + 1, so hc ≤ 4
INDEX_THREADS = 256
MAX_INDEX_HEADS = 256
ATTENTION_WARPS = 8  # heads per block (one warp each) once the step has enough tokens to fill the GPU
NULL = np.uint64(0)
ATTENTION_SPLITS = kernel_plan.attention_splits_setting(os.environ)
INDEXER_SPLIT = kernel_plan.indexer_split_setting(os.environ)
HC_SPLIT = kernel_plan.hc_split_setting(os.environ)
ATTENTION_KERNEL = kernel_plan.attention_kernel_setting(os.environ)


@functools.cache
def multiprocessors() -> int:
    """This GPU's streaming multiprocessors (the launch-shape rules of ``kernel_plan`` take it)."""
    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"])


def attention_splits(blocks: int, max_keys: int, setting: str | int | None = None) -> int:
    """``kernel_plan.attention_splits`` on this GPU (``setting`` None: ``OPENINFER_DSV4_ATTENTION_SPLITS``)."""
    return kernel_plan.attention_splits(ATTENTION_SPLITS if setting is None else setting, blocks, max_keys,
                                        multiprocessors())


def kernel(name: str) -> cupy.RawKernel:
    """Kernel ``name`` of dsv4.cu (core's common.cuh on its include path), built by the core loader."""
    return loader.kernel(KERNEL_FILE, name)


def _start_up_keys(head_dim: int) -> list[loader.KernelKey]:
    return [loader.kernel_key(KERNEL_FILE, name) for name in kernel_plan.start_up_kernels(ATTENTION_KERNEL, head_dim)]


def start_builds(head_dim: int) -> int:
    """Begin building the kernels a model of ``head_dim`` runs in background threads now, before the
    weights load (NVRTC releases the GIL); returns how many builds started."""
    return loader.start_compiling(_start_up_keys(head_dim), cupy.cuda.Device().id)


def warm_up(head_dim: int) -> None:
    """Build those kernels (or wait for ``start_builds``' builds): before any CUDA graph capture,
    which must not compile."""
    loader.compile_kernels(_start_up_keys(head_dim), cupy.cuda.Device().id)


def _check(x: Any, dtype: Any, ndim: int, what: str) -> cupy.ndarray:
    if not isinstance(x, cupy.ndarray) or x.dtype != np.dtype(dtype) or x.ndim != ndim:
        raise ValueError(f"{what} must be a {ndim}-d {np.dtype(dtype).name} CuPy array, got "
                         f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}")
    return cupy.ascontiguousarray(x)


def _dim(dim: int, what: str, limit: int = MAX_DIM) -> None:
    if not 0 < dim <= limit:
        raise ValueError(f"{what} is {dim}; the kernels handle 1..{limit}")


def compress_entries(slot_kv: cupy.ndarray, slot_gate: cupy.ndarray, norm: cupy.ndarray, inv_freq: cupy.ndarray,
                     positions: cupy.ndarray, dest_rows: cupy.ndarray, cache: cupy.ndarray, rope_dim: int,
                     eps: float) -> None:
    """``attention.pool_entries`` written into cache rows ``dest_rows`` (``cache`` [rows, d] bf16 as
    uint16; slots [W, S, d] fp32 with −3e38 for empty slots)."""
    slot_kv = _check(slot_kv, np.float32, 3, "slot_kv")
    slot_gate = _check(slot_gate, np.float32, 3, "slot_gate")
    windows, slots, dim = slot_kv.shape
    _dim(dim, "the entry width")
    if slot_gate.shape != slot_kv.shape or cache.shape[-1] != dim or dest_rows.shape != (windows,):
        raise ValueError(f"compress_entries: slots {slot_kv.shape}/{slot_gate.shape}, cache {cache.shape}, "
                         f"dest {dest_rows.shape} disagree")
    if windows == 0:
        return
    kernel("dsv4_compress_entries")(
        (windows,), (THREADS,),
        (slot_kv, slot_gate, _check(norm, np.float32, 1, "norm"), _check(inv_freq, np.float32, 1, "inv_freq"),
         _check(positions, np.int32, 1, "positions"), _check(dest_rows, np.int64, 1, "dest_rows"), cache,
         np.int32(slots), np.int32(dim), np.int32(rope_dim), np.float32(eps)))


def indexer_topk(q: cupy.ndarray, head_weights: cupy.ndarray, keys: cupy.ndarray, tables: cupy.ndarray,
                 block_size: int, token_seq: cupy.ndarray, positions: cupy.ndarray, rate: int, max_entries: int,
                 k: int, split: str | None = None) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``attention.index_scores`` then ``top_k_visible``: (scores [T, max_entries] fp32, picks
    [T, k] int32, −1 where a query sees fewer than k entries). ``split`` (None:
    ``OPENINFER_DSV4_INDEXER_SPLIT``): ``fixed`` or ``auto`` entries per scoring block."""
    q = _check(q, np.uint16, 3, "q (bf16)")
    tokens, heads, dim = q.shape
    _dim(heads * dim, "index heads × index head dim", MAX_INDEX_QK)
    _dim(heads, "index heads", MAX_INDEX_HEADS)
    _dim(dim, "index head dim")
    tables = _check(tables, np.int32, 2, "tables")
    scores = cupy.empty((tokens, max(max_entries, 1)), np.float32)
    if tokens == 0 or max_entries == 0:
        return scores[:, :max_entries], cupy.full((tokens, k), -1, np.int32)
    selected = cupy.empty((tokens, k), np.int32)  # dsv4_topk writes all k (−1 past the visible entries)
    per_block = kernel_plan.indexer_entries_per_block(INDEXER_SPLIT if split is None else split, tokens,
                                                      max_entries, multiprocessors())
    kernel("dsv4_indexer_scores")(
        (tokens, -(-max_entries // per_block)), (INDEX_THREADS,),
        (q, _check(head_weights, np.float32, 2, "head_weights"), keys, tables, np.int32(tables.shape[1]),
         np.int32(block_size), _check(token_seq, np.int32, 1, "token_seq"), _check(positions, np.int32, 1, "positions"),
         np.int32(rate), scores, np.int32(heads), np.int32(dim), np.int32(max_entries), np.int32(per_block)))
    kernel("dsv4_topk")((tokens,), (THREADS,), (scores, positions, np.int32(rate), np.int32(max_entries), np.int32(k),
                                               selected))
    return scores, selected


def sparse_attention(q: cupy.ndarray, window_cache: cupy.ndarray, window_tables: cupy.ndarray,
                     entry_cache: cupy.ndarray | None, entry_tables: cupy.ndarray | None,
                     selected: cupy.ndarray | None, rate: int, token_seq: cupy.ndarray, positions: cupy.ndarray,
                     sinks: cupy.ndarray, inv_freq: cupy.ndarray, rope_dim: int, window: int,
                     block_size: int, splits: str | int | None = None, kernel_setting: str | None = None
                     ) -> cupy.ndarray:
    """``attention.attend`` for every token and head: [T, heads, dim] bf16. ``entry_cache`` None:
    sliding only; ``selected`` None: every visible entry (HCA); else the indexer's picks (CSA).
    ``splits`` (None: ``OPENINFER_DSV4_ATTENTION_SPLITS``): runs of keys per token and head
    block, merged by ``dsv4_attention_combine`` when more than one. ``kernel_setting`` (None:
    ``OPENINFER_DSV4_ATTENTION_KERNEL``): ``generic`` or ``auto`` (see ``kernel_plan``)."""
    q = _check(q, np.uint16, 3, "q (bf16)")
    tokens, heads, dim = q.shape
    _dim(dim, "head_dim")
    if dim % 32:
        raise ValueError(f"head_dim {dim} must be a multiple of 32 (a warp's lanes split the channels)")
    window_tables = _check(window_tables, np.int32, 2, "window_tables")
    out = cupy.empty_like(q)
    if tokens == 0:
        return out
    entry_stride = 0 if entry_tables is None else _check(entry_tables, np.int32, 2, "entry_tables").shape[1]
    num_selected = 0 if selected is None else _check(selected, np.int32, 2, "selected").shape[1]
    # few tokens: fewer heads per block, so more blocks share the work
    warps = ATTENTION_WARPS if tokens >= 16 else 2
    head_blocks = -(-heads // warps)
    max_keys = window + (0 if entry_cache is None else
                         num_selected if selected is not None else entry_stride * block_size)
    runs = attention_splits(tokens * head_blocks, max_keys, splits)
    positions = _check(positions, np.int32, 1, "positions")
    inv_freq = _check(inv_freq, np.float32, 1, "inv_freq")
    partial = cupy.empty((tokens, heads, runs, dim + 2), np.float32) if runs > 1 else None
    name = kernel_plan.attention_kernel(ATTENTION_KERNEL if kernel_setting is None else kernel_setting, dim)
    kernel(name)(
        (tokens, head_blocks, runs), (32 * warps,),
        (q, window_cache, window_tables, np.int32(window_tables.shape[1]),
         NULL if entry_cache is None else entry_cache, NULL if entry_tables is None else entry_tables,
         np.int32(entry_stride), NULL if selected is None else selected, np.int32(num_selected), np.int32(max(rate, 1)),
         _check(token_seq, np.int32, 1, "token_seq"), positions, _check(sinks, np.float32, 1, "sinks"), inv_freq,
         np.int32(rope_dim), out, np.int32(heads), np.int32(dim), np.int32(window), np.int32(block_size),
         np.float32(dim**-0.5), NULL if partial is None else partial))
    if partial is not None:
        kernel("dsv4_attention_combine")((tokens, head_blocks), (32 * warps,),
                                         (partial, np.int32(runs), positions, inv_freq, np.int32(rope_dim), out,
                                          np.int32(heads), np.int32(dim)))
    return out


def hc_collapse(streams: cupy.ndarray, fn: cupy.ndarray, base: cupy.ndarray, scale: cupy.ndarray, *,
                sinkhorn_iters: int, hc_eps: float, norm_eps: float, head: bool = False, split: str | None = None
                ) -> tuple[cupy.ndarray, cupy.ndarray | None, cupy.ndarray | None]:
    """``hyper_connection.collapse`` (``head``: ``collapse_head``): (x [T, D] bf16, post [T, hc],
    comb [T, hc, hc]; None for the head). ``split`` (None: ``OPENINFER_DSV4_HC_SPLIT``): ``1`` or
    ``auto`` (see ``kernel_plan.hc_split_setting``)."""
    streams = _check(streams, np.float32, 3, "streams")
    fn = _check(fn, np.float32, 2, "fn")
    tokens, hc, dim = streams.shape
    if hc > MAX_HC:
        raise ValueError(f"hc_mult {hc} exceeds {MAX_HC}")
    num_mix = hc if head else (2 + hc) * hc
    if num_mix + 1 > MAX_MIX:
        raise ValueError(f"hc_mult {hc}: {num_mix} mixing logits (+ the norm) exceed the kernel's {MAX_MIX}")
    if fn.shape != (num_mix, hc * dim):
        raise ValueError(f"hc fn is {tuple(fn.shape)}, expected ({num_mix}, {hc * dim})")
    x = cupy.empty((tokens, dim), np.uint16)
    post = None if head else cupy.empty((tokens, hc), np.float32)
    comb = None if head else cupy.empty((tokens, hc, hc), np.float32)
    if tokens:
        split = HC_SPLIT if split is None else split
        if split not in ("1", "auto"):
            raise ValueError(f"hc_collapse split {split!r}: expected 1 or auto")
        splits = 1 if split == "1" else kernel_plan.hc_mix_splits(tokens, num_mix, multiprocessors())
        x_blocks = 1 if split == "1" else -(-dim // COLLAPSE_THREADS)
        partial = cupy.empty((tokens, num_mix + 1, splits), np.float32)
        kernel("dsv4_hc_mix")((tokens, num_mix, splits), (MIX_THREADS,),
                              (streams, fn, partial, np.int32(hc * dim), np.int32(num_mix)))
        kernel("dsv4_hc_collapse")(
            (tokens, x_blocks), (COLLAPSE_THREADS,),
            (streams, partial, np.int32(splits), _check(base, np.float32, 1, "base"),
             _check(scale, np.float32, 1, "scale"), x, NULL if head else post, NULL if head else comb, np.int32(hc),
             np.int32(dim), np.int32(1 if head else 0), np.int32(sinkhorn_iters), np.float32(hc_eps),
             np.float32(norm_eps)))
    return x, post, comb


def hc_expand(streams: cupy.ndarray, y: cupy.ndarray, post: cupy.ndarray, comb: cupy.ndarray,
              out: cupy.ndarray | None = None) -> cupy.ndarray:
    """``hyper_connection.expand`` (``out`` may be ``streams`` itself)."""
    streams = _check(streams, np.float32, 3, "streams")
    tokens, hc, dim = streams.shape
    out = cupy.empty_like(streams) if out is None else out
    if tokens:
        kernel("dsv4_hc_expand")((tokens, -(-dim // THREADS)), (THREADS,),
                                 (streams, _check(y, np.uint16, 2, "y (bf16)"), post, comb, out, np.int32(hc),
                                  np.int32(dim)))
    return out


def quantized_linear(x: cupy.ndarray, weight: cupy.ndarray, scales: cupy.ndarray, out_features: int,
                     fmt: str) -> cupy.ndarray:
    """``x @ dequantize(W)ᵀ`` for FP4 (``weight`` [out, in/2] uint8/int8, e8m0 ``scales`` [out, in/32])
    or FP8 (``weight`` [out, in] e4m3, e8m0 ``scales`` [⌈out/128⌉, ⌈in/128⌉]): [N, out] bf16."""
    x = _check(x, np.uint16, 2, "x (bf16)")
    rows, in_features = x.shape
    expected = (out_features, in_features // 2) if fmt == "fp4" else (out_features, in_features)
    if fmt not in ("fp4", "fp8") or tuple(weight.shape) != expected:
        raise ValueError(f"quantized_linear: {fmt} weight {tuple(weight.shape)} for a [{out_features}, {in_features}] "
                         f"linear (expected {expected})")
    y = cupy.empty((rows, out_features), np.uint16)
    if rows:
        groups = THREADS // 32
        kernel("dsv4_fp4_linear" if fmt == "fp4" else "dsv4_fp8_linear")(
            (-(-out_features // groups), rows), (THREADS,),
            (x, cupy.ascontiguousarray(weight).view(np.uint8), cupy.ascontiguousarray(scales).view(np.uint8), y,
             np.int32(in_features), np.int32(out_features)))
    return y


# --- the model forward's glue (cuda_model.py): layouts read from the device batch --------------------

def token_seq(query_start: cupy.ndarray, num_tokens: int) -> cupy.ndarray:
    """``[T]`` int32: the sequence of each token, from the device ``query_start [B+1]``."""
    out = cupy.zeros(num_tokens, np.int32)
    num_seqs = int(query_start.shape[0]) - 1
    if num_tokens and num_seqs:
        kernel("dsv4_token_seq")((num_seqs,), (THREADS,), (query_start, out))
    return out


def head_norm_rope(x: cupy.ndarray, heads: int, positions: cupy.ndarray, inv_freq: cupy.ndarray, rope_dim: int,
                   *, norm: bool, weight: cupy.ndarray | None = None, eps: float = 1e-6) -> cupy.ndarray:
    """In place on bf16 ``x [T, heads·dim]``: per head RMSNorm (``weight`` None: unweighted) when
    ``norm``, then RoPE on the last ``rope_dim`` channels (``attention.attention``'s q / kv)."""
    x = _check(x, np.uint16, 2, "x (bf16)")
    tokens, width = x.shape
    dim = width // heads
    _dim(dim, "head dim")
    if tokens:
        kernel("dsv4_head_norm_rope")(
            (tokens, heads), (THREADS,),
            (x, NULL if weight is None else _check(weight, np.uint16, 1, "norm weight (bf16)"), np.int32(norm),
             _check(inv_freq, np.float32, 1, "inv_freq"), np.int32(rope_dim), _check(positions, np.int32, 1, "positions"),
             np.int32(heads), np.int32(dim), np.float32(eps)))
    return x


def write_window(kv: cupy.ndarray, cache: cupy.ndarray, tables: cupy.ndarray, block_size: int,
                 token_seq: cupy.ndarray, positions: cupy.ndarray) -> None:
    """The sliding-window cache rows of the step's tokens ← ``kv [T, D]`` (bf16)."""
    kv = _check(kv, np.uint16, 2, "kv (bf16)")
    tables = _check(tables, np.int32, 2, "tables")
    if kv.shape[0]:
        kernel("dsv4_write_window")((kv.shape[0],), (THREADS,),
                                    (kv, cache, tables, np.int32(tables.shape[1]), np.int32(block_size), token_seq,
                                     positions, np.int32(kv.shape[1])))


def compressor_step(kv_proj: cupy.ndarray, gate_proj: cupy.ndarray, ape: cupy.ndarray, state: dict[str, Any],
                    prefix: str, norm: cupy.ndarray, inv_freq: cupy.ndarray, rope_dim: int, eps: float, *,
                    token_seq: cupy.ndarray, positions: cupy.ndarray, query_start: cupy.ndarray,
                    state_slots: cupy.ndarray, cache: cupy.ndarray, tables: cupy.ndarray, block_size: int, rate: int,
                    dim: int, overlap: bool) -> None:
    """``attention.compress`` for a whole step: the entries of the windows its tokens close go
    to ``cache`` (rows via ``tables``), then the state slots' open windows (``state[prefix + "kv"]``
    ...; CSA: ``overlap_*``) move on. ``kv_proj`` / ``gate_proj``: bf16 ``[T, c·dim]``."""
    kv_proj = _check(kv_proj, np.uint16, 2, "kv_proj (bf16)")
    gate_proj = _check(gate_proj, np.uint16, 2, "gate_proj (bf16)")
    tables = _check(tables, np.int32, 2, "tables")
    _dim(dim, "compressed entry width")
    tokens, num_seqs = int(kv_proj.shape[0]), int(query_start.shape[0]) - 1
    if not tokens:
        return
    pending_kv, pending_gate = state[prefix + "kv"], state[prefix + "gate"]
    overlap_kv = state[prefix + "overlap_kv"] if overlap else None
    overlap_gate = state[prefix + "overlap_gate"] if overlap else None
    ape = _check(ape, np.float32, 2, "ape")
    kernel("dsv4_compress_step")(
        (tokens,), (THREADS,),
        (kv_proj, gate_proj, ape, pending_kv, pending_gate, NULL if overlap_kv is None else overlap_kv,
         NULL if overlap_gate is None else overlap_gate, _check(norm, np.float32, 1, "norm"),
         _check(inv_freq, np.float32, 1, "inv_freq"), np.int32(rope_dim), np.float32(eps), token_seq, positions,
         query_start, state_slots, cache, tables, np.int32(tables.shape[1]), np.int32(block_size), np.int32(rate),
         np.int32(dim), np.int32(overlap)))
    kernel("dsv4_compress_state")(
        (num_seqs,), (THREADS,),
        (kv_proj, gate_proj, ape, pending_kv, pending_gate, NULL if overlap_kv is None else overlap_kv,
         NULL if overlap_gate is None else overlap_gate, positions, query_start, state_slots, np.int32(rate),
         np.int32(dim), np.int32(overlap)))
