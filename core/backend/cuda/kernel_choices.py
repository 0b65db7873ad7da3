"""The attention kernels' run-time switches, read from the environment once per process.

``OPENINFER_PREFILL_KERNEL`` ("auto" | "mma"), ``OPENINFER_SHORT_QUERY_ATTENTION`` ("auto" | "0" | "1"),
``OPENINFER_MIXED_DECODE_ATTENTION`` ("1", the default | "0": a mixed step's 1-token rows on the decode kernel),
``OPENINFER_SM90_*`` (variants of the Hopper prefill kernel) and ``OPENINFER_DECODE_ATTENTION``
("mma" | "split") are parsed and validated at their first use and then kept: a prefill step does
not look at the environment. ``refresh_kernel_choices()`` re-reads them all, for benchmarks and
tests that switch kernels within one process. No CuPy here, so CPU CI checks the parsing.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

SM90_BLOCK_M = 128  # query rows of one sm90 prefill CTA (= batch.PREFILL_TILE)
DECODE_KERNELS = ("mma", "split")
DECODE_KERNEL_ENV = "OPENINFER_DECODE_ATTENTION"


@functools.cache
def wanted_decode_kernel() -> str:
    """OPENINFER_DECODE_ATTENTION ("mma", the default, or "split"), read once per process."""
    wanted = os.environ.get(DECODE_KERNEL_ENV, "mma")
    if wanted not in DECODE_KERNELS:
        raise ValueError(f"{DECODE_KERNEL_ENV}={wanted!r}; choose one of {DECODE_KERNELS}")
    return wanted


PREFILL_KERNELS = ("auto", "sm90", "mma")
PREFILL_KERNEL_ENV = "OPENINFER_PREFILL_KERNEL"  # "auto" (default) or "mma"
SHORT_QUERY_ENV = "OPENINFER_SHORT_QUERY_ATTENTION"  # "1" / "0": force the short-query kernel on / off
# "auto": the short-query kernel for short steps from attention_routing.SHORT_QUERY_MIN_CONTEXT on
# (H100: 1.06x-1.86x the prefill kernel at 1k-4k context in W3a, 3.4x-4.1x at 16k-32k in W1)
SHORT_QUERY_DEFAULT = "auto"
SHORT_QUERY_VALUES = {"auto": "auto", "1": "on", "0": "off"}
MIXED_DECODE_ENV = "OPENINFER_MIXED_DECODE_ATTENTION"  # "0": a mixed step's decode rows stay on the prefill kernel
# on: W3a (H100, gpu_prefill_attention.py --routing) 1.47x-2.54x attention per layer for mixed steps
# of 16-256 decode rows beside a prompt chunk; "0" gives every row to the prefill kernel
MIXED_DECODE_DEFAULT = True


@dataclass(frozen=True)
class KernelChoices:
    """The attention kernel switches of the environment, read once (``kernel_choices``)."""

    prefill: str  # "auto" or "mma"
    short_query: str  # "auto", "on" or "off" (attention_routing.wants_short_query)
    mixed_decode: bool  # a mixed step's leading 1-token rows on the decode kernel


@functools.cache
def kernel_choices() -> KernelChoices:
    """OPENINFER_PREFILL_KERNEL, OPENINFER_SHORT_QUERY_ATTENTION and OPENINFER_MIXED_DECODE_ATTENTION,
    read once per process."""
    prefill = os.environ.get(PREFILL_KERNEL_ENV, "auto")
    if prefill not in ("auto", "mma"):
        raise ValueError(f"{PREFILL_KERNEL_ENV} must be 'auto' or 'mma', got {prefill!r}")
    short = os.environ.get(SHORT_QUERY_ENV, SHORT_QUERY_DEFAULT)
    if short not in SHORT_QUERY_VALUES:
        raise ValueError(f"{SHORT_QUERY_ENV} must be auto, 0 or 1, got {short!r}")
    mixed = os.environ.get(MIXED_DECODE_ENV, "1" if MIXED_DECODE_DEFAULT else "0")
    if mixed not in ("0", "1"):
        raise ValueError(f"{MIXED_DECODE_ENV} must be 0 or 1, got {mixed!r}")
    return KernelChoices(prefill=prefill, short_query=SHORT_QUERY_VALUES[short], mixed_decode=mixed == "1")


def refresh_kernel_choices() -> None:
    """Re-read every attention kernel switch (OPENINFER_PREFILL_KERNEL, OPENINFER_SHORT_QUERY_ATTENTION,
    OPENINFER_MIXED_DECODE_ATTENTION, OPENINFER_SM90_*, OPENINFER_DECODE_ATTENTION) from the
    environment at their next use."""
    kernel_choices.cache_clear()
    sm90_variant.cache_clear()
    sm90_kv_loads.cache_clear()
    sm90_schedule.cache_clear()
    sm90_tma_min_context.cache_clear()
    wanted_decode_kernel.cache_clear()


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
# Session 6's consumer / producer refinements, each its own switch, timed in E1 (H200, device time per
# call, gpu_prefill_attention --sm90-variants over 1k / 4k / 16k / 4k chunk on 12k / 8 x 2k / 8 x 1k):
# OPENINFER_SM90_PAGE_PREFETCH: with TMA K/V loads, the producer reads the next tile's block-table
#   entries before waiting for a free stage (their latency no longer follows the wait). Default at
#   head_dim 128 (SM90_PAGE_PREFETCH_HEAD_DIMS) by E1: 1.012x geomean, 1.03x at 4k and 8 x 2k, 1.01x on
#   the chunk, 1.00x at 16k; =0 turns it off, =1 on at every head size.
# Opt-in, measured slower in E1 (geomean over the six cases):
# OPENINFER_SM90_SPLIT_KV=1 (0.93x; 16k 515 vs 575 TFLOP/s): the K and V halves of a stage have their own
#   full and empty barriers (FlashAttention-3's two pipelines): Q K^T waits for K only, K is released once
#   S has landed and the producer refills it while P V still reads V (cp.async tiles: both halves together);
# OPENINFER_SM90_EARLY_RESCALE=1 (0.98x; head_dim 128, with the overlap): O is rescaled while Q K^T of the
#   next tile runs (FlashAttention-3's order) instead of after P V has landed;
# OPENINFER_SM90_LEAN_ARRIVALS=1 (1.00x; 16k 0.97x): consumers release a stage with one arrival per warp, not per thread,
#   and a TMA tile's 127 other producer arrivals come as one counted arrival from its issuing thread.
# Session 7's consumer-loop refinements. Default at head_dim 128 together (SM90_LEAN_SOFTMAX_HEAD_DIMS) by
# E1 (H200, device time, gpu_prefill_attention --sm90-variants, 3 interleaved rounds, all four against the
# session-6 kernel): 16k prompt 556 -> 616 TFLOP/s in the first round (1.11x; 1.04x / 1.06x in the two
# hotter rounds), 1k 236 -> 243 (1.03x), 4k 522 -> 540 (1.04x), 4k chunk on 12k 1.02x, 8 x 2k 453 -> 469
# (1.03x), 8 x 1k 348 -> 353 (1.02x); geomean 1.040x; output within 3.1e-3 of the old kernel's. Each one
# is its own switch (=0 turns it off, =1 on at every head size):
# OPENINFER_SM90_DESCRIPTOR_ADDS: each wgmma's shared-memory descriptor is its tile's base descriptor
#   plus a compile-time constant (the per-wgmma mask / shift / or of the address drops out: the main loop
#   goes from 534 to 461 instructions per K/V tile outside the diagonal, SASS of head_dim 128 + TMA); alone 1.024x;
# OPENINFER_SM90_SKIP_UNIT_RESCALE: a warp skips O's 64 rescaling multiplies per tile when every
#   correction of its rows is exactly 1 (their max has settled), same bits either way; alone 1.029x;
# OPENINFER_SM90_ORDERED_SOFTMAX (with the overlap): ptxas hoists the wait for tile k-1's P V above
#   tile k's softmax (nothing ties them), so the overlapped loop's softmax never ran beside its own P V;
#   a shared store of the row sums pins the softmax before the wait (SASS: 66 ex2 before it, none before);
#   alone 1.009x (16k 1.05x in the first round);
# OPENINFER_SM90_RESCALE_SLACK: a row's running max moves only when a tile's max exceeds it by more
#   than 8 (log2 units; P values stay <= 256), so with SKIP_UNIT_RESCALE nearly every tile after the
#   first skips O's rescale (FlashAttention-4's conditional rescale; other bits, same tolerance);
#   1.040x with the three above vs 1.029x without.
# Opt-in, not faster in E1: OPENINFER_SM90_HEAD_PAIRS=1 (1.001x alone, 1.024x with the three above vs their
#   1.029x; head_dim 128, an even GQA group): a CTA's two consumer warpgroups take two query heads of one KV
#   head at the same 64 queries instead of one head at 128, so each K/V tile crosses from L2 once per two
#   heads (half the K/V copy traffic per FLOP; the same number of work items). E1's timing diagnostic with
#   no K/V copies: 741 TFLOP/s at 16k with the refinements (694 without), cuDNN 657.
SM90_LEAN_SOFTMAX_HEAD_DIMS = (128,)
SM90_HEAD_PAIRS = False
SM90_PAGE_PREFETCH_HEAD_DIMS = (128,)
SM90_SPLIT_KV = False
SM90_EARLY_RESCALE = False
SM90_LEAN_ARRIVALS = False
SM90_ENV = {name: f"OPENINFER_SM90_{name.upper()}"
            for name in ("grid", "page_reads", "pingpong", "overlap", "stages", "skip_kv_loads", "kv_loads",
                         "schedule", "page_prefetch", "split_kv", "early_rescale", "lean_arrivals", "tma_min_context",
                         "descriptor_adds", "skip_unit_rescale", "ordered_softmax", "rescale_slack", "head_pairs")}


@dataclass(frozen=True)
class Sm90Variant:
    """Compile-time choices of prefill_attention_sm90.cu (see the defines at its top)."""

    kv_head_major_grid: bool
    batched_page_reads: bool
    pingpong: bool
    intra_wg_overlap: bool
    stages: int
    skip_kv_loads: bool  # a timing diagnostic only: no K/V copies, wrong output
    page_prefetch: bool = False
    split_kv: bool = False
    early_rescale: bool = False
    lean_arrivals: bool = False
    descriptor_adds: bool = False
    skip_unit_rescale: bool = False
    ordered_softmax: bool = False
    rescale_slack: bool = False
    head_pairs: bool = False  # asked for; the launch applies it where the head size and GQA group allow

    def defines(self, head_dim: int, page_size: int) -> dict[str, int]:
        # early rescale at head_dim 256 (128 O registers) would spill with the TMA producer's options
        early_rescale = self.early_rescale and self.intra_wg_overlap and head_dim == 128
        return {"HEAD_DIM": head_dim, "STAGES": self.stages, "KV_HEAD_MAJOR_GRID": int(self.kv_head_major_grid),
                "BATCHED_PAGE_READS": int(self.batched_page_reads), "PAGE_SIZE": page_size,
                "PINGPONG": int(self.pingpong), "INTRA_WG_OVERLAP": int(self.intra_wg_overlap),
                "SKIP_KV_LOADS": int(self.skip_kv_loads), "PAGE_ID_PREFETCH": int(self.page_prefetch),
                "SPLIT_KV": int(self.split_kv), "EARLY_RESCALE": int(early_rescale),
                "LEAN_ARRIVALS": int(self.lean_arrivals), "DESCRIPTOR_ADDS": int(self.descriptor_adds),
                "SKIP_UNIT_RESCALE": int(self.skip_unit_rescale),
                "ORDERED_SOFTMAX": int(self.ordered_softmax and self.intra_wg_overlap),
                "RESCALE_SLACK": int(self.rescale_slack)}


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
        stages=stages, skip_kv_loads=_env_flag("skip_kv_loads", False),
        page_prefetch=_env_flag("page_prefetch", head_dim in SM90_PAGE_PREFETCH_HEAD_DIMS),
        split_kv=_env_flag("split_kv", SM90_SPLIT_KV),
        early_rescale=_env_flag("early_rescale", SM90_EARLY_RESCALE),
        lean_arrivals=_env_flag("lean_arrivals", SM90_LEAN_ARRIVALS),
        descriptor_adds=_env_flag("descriptor_adds", head_dim in SM90_LEAN_SOFTMAX_HEAD_DIMS),
        skip_unit_rescale=_env_flag("skip_unit_rescale", head_dim in SM90_LEAN_SOFTMAX_HEAD_DIMS),
        ordered_softmax=_env_flag("ordered_softmax", head_dim in SM90_LEAN_SOFTMAX_HEAD_DIMS),
        rescale_slack=_env_flag("rescale_slack", head_dim in SM90_LEAN_SOFTMAX_HEAD_DIMS),
        head_pairs=_env_flag("head_pairs", SM90_HEAD_PAIRS))


# OPENINFER_SM90_KV_LOADS: how the sm90 kernel's producer fills the K/V ring. "cp_async": 16-byte
# cp.async copies by the producer warpgroup's 128 threads (page reads per SM90_PAGE_READS);
# "tma": one TMA box per 16-token page and 128-byte column block (tensor_maps.py), the ragged
# last tile by cp.async; "tma_multicast": the same, and CTA pairs (query heads 2i, 2i+1 of one KV
# head, same tile, a cluster of 2) copy each K/V tile once into both CTAs (KV-head-major grid, even
# GQA group and the grid schedule; otherwise "tma"). TMA needs the KV block size to divide the
# kernel's K/V tile (128 tokens at head_dim 128, 64 at 256) and to be a multiple of 8; other caches
# keep cp.async. "auto": "tma" for steps whose longest context reaches SM90_TMA_MIN_CONTEXT tokens,
# cp.async below (and where the context is not known on the host: a captured graph's batch).
# Default "auto" by E2 + E3 (H200; benchmarks/results/gpu_prefill_attention.md). TMA against cp.async
# per launch, E2: 0.80x at one 1k prompt, 0.96x at 8 x 1k, 1.05x at 8 x 2k and 4k, 1.09x at 16k, 1.23x
# for a 4k chunk on 12k cached. E3, "auto" against cp.async: 1.00x at 1k and 8 x 1k, 1.03x at 4k,
# 1.04x at 16k and 8 x 2k, 1.15x on the chunk; whole Qwen3-4B-shape model, 16k prefill attention
# 178.4 -> 155.9 ms, step 361.3 -> 350.1 ms. OPENINFER_SM90_KV_LOADS=cp_async reverts.
SM90_KV_LOADS = "auto"
SM90_KV_LOAD_MODES = ("cp_async", "tma", "tma_multicast", "auto")
# "auto"'s threshold per head size; OPENINFER_SM90_TMA_MIN_CONTEXT (tokens) sets it for every head size.
# head_dim 128: TMA at every context by E1 (H200, device time; TMA against cp.async, both with the
# session-6 refinements on: 1.09x at one 1k prompt, 1.08x at 8 x 1k on the grid, 1.05x / 1.05x with
# persistent CTAs; the 0.78-0.80x of E2 / E3 at 1k was their timer's host launch path). Was 2048.
SM90_TMA_MIN_CONTEXT = {128: 0, 256: 2048}
# OPENINFER_SM90_SCHEDULE: "grid" (one CTA per work item: 128 queries x one head) or "persistent"
# (head_dim 128: one CTA per SM claims work items from a device counter, longest first, and loads
# the next item's Q and K/V while it finishes the current one; other head sizes keep "grid");
# "auto": "persistent" for steps whose longest context is below SM90_PERSISTENT_MAX_CONTEXT tokens
# (many short items, where an item's start and end are a large share of it), "grid" from there on
# and where the context is not known on the host (a captured graph's batch).
# Default "auto" by E1 (H200, device time, persistent CTAs against the grid, auto K/V loads): 1.05x at one
# 1k prompt, 1.04x at 4k, 1.06x at 8 x 2k, 1.09x at 8 x 1k (a 256-stream burst's mixed step), 0.99x at
# 16k and 1.01x on the 4k chunk over 12k (both grid under "auto"). "grid" reverts.
SM90_SCHEDULE = "auto"
SM90_SCHEDULES = ("grid", "persistent", "auto")
SM90_PERSISTENT_MAX_CONTEXT = 8192


@functools.cache
def sm90_kv_loads() -> str:
    """OPENINFER_SM90_KV_LOADS ("auto", the default, "cp_async", "tma" or "tma_multicast"), read once per process."""
    return _env_choice("kv_loads", SM90_KV_LOADS, SM90_KV_LOAD_MODES)


@functools.cache
def sm90_tma_min_context(head_dim: int) -> int:
    """The context (tokens) from which OPENINFER_SM90_KV_LOADS=auto takes TMA K/V loads:
    OPENINFER_SM90_TMA_MIN_CONTEXT if set (a count >= 0), else SM90_TMA_MIN_CONTEXT's for the head size."""
    text = os.environ.get(SM90_ENV["tma_min_context"])
    if text is None:
        return SM90_TMA_MIN_CONTEXT.get(head_dim, 2048)
    if not text.isdigit():
        raise ValueError(f"{SM90_ENV['tma_min_context']} must be a token count >= 0, got {text!r}")
    return int(text)


@functools.cache
def sm90_schedule() -> str:
    """OPENINFER_SM90_SCHEDULE ("auto", the default, "grid" or "persistent"), read once per process."""
    return _env_choice("schedule", SM90_SCHEDULE, SM90_SCHEDULES)


def sm90_head_pairs(variant: Sm90Variant, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether a launch takes HEAD_PAIRS (asked for, head_dim 128, and an even number of query heads per KV head)."""
    return variant.head_pairs and head_dim == 128 and (num_heads // num_kv_heads) % 2 == 0


def sm90_shared_bytes(head_dim: int, stages: int) -> int:
    """SHARED_BYTES of prefill_attention_sm90.cu: Q tile, K/V stages, mbarriers, alignment slack."""
    block_n = 64 if head_dim == 256 else 128
    q_tile = SM90_BLOCK_M * head_dim * 2
    kv_tile = block_n * head_dim * 2
    return q_tile + stages * 2 * kv_tile + 8 * (1 + 4 * stages) + 1024  # mbarriers: Q, 4 per stage
