"""The Hopper grouped expert GEMM for bf16 experts (``openinfer/kernels/moe_sm90.cu``, sm_90a).

One persistent launch multiplies every expert's slots (``moe_sort``'s expert order) by its weight:
128 slots x 256 weight rows per tile, wgmma from shared memory fed by a producer warpgroup (the
gathered token rows by cp.async, the weight rows by TMA from one tensor map of the whole
``[E, N, K]`` stack), fp32 accumulation, bf16 out; optionally gate_up with SiLU·mul fused
(``[T·k, I]`` out). The tile list is counted from the routing's offsets on the device, so a step
reads nothing back and can be captured in a CUDA graph (the cuBLAS-per-expert path cannot).

The weight's tensor map (one per weight array, kept by address and shape) views ``[E·N, K]`` as the
3-d tensor (element, 1, weight row) that ``tensor_maps.encode_page_map`` encodes, with a box of
64 elements (the 128-byte swizzle wgmma reads) x 128 rows::

    weight  [E, N, K] bf16  ->  rows e·N + n, K contiguous; box (k0 .. k0 + 63, rows r0 .. r0 + 127)

On by default since E1 (H200, 2026-11-24; OPENINFER_MOE_SM90=0 reverts) for bf16 experts on a
compute capability 9.0 GPU above SM90_ABOVE_ROWS_PER_EXPERT slots per expert, ahead of cuBLAS per
expert and the pipelined kernel. Moonlight's routed experts, one layer, gate_up + SiLU·mul + down
(benchmarks/gpu_kimi.py experts, results/kimi_experts_sm90_e1_h200.json), against what shipped:
8192 tokens 3059 -> 1517 us (cuBLAS per expert, eager; 278 -> 561 TFLOP/s, gate_up alone 575, down
524), 4096 2636 -> 837 us, 1024 820 -> 340 us (CUDA graph), 256 403 -> 313 us, 64 329 -> 290 us.

Decode steps (up to 24 slots per expert) run a smaller build since E1 of 2026-11-24 (SM90_SHAPE_CHOICE):
64-slot tiles on one consumer warpgroup, 128 weight rows per tile, stages of two 64-wide k sub-tiles
(256 contiguous bytes of each weight row per stage): 87-90 % -> 92-93 % of the copy bandwidth; since s12 D2b
two such CTAs per SM, each a ring of four 64-wide k stages (m64_n128_s4_x2). Opt-in
builds: stream-K (SM90_STREAM_K); programmatic dependent launch of down after gate_up (SM90_PDL) is on by
default since D2 of 2026-11-24 (see SM90_PDL_ENV).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cupy
import numpy as np

from openinfer.backend.cuda.loader import arch_kernel
from openinfer.backend.cuda.pdl_launch import launch
from openinfer.backend.cuda.tensor_maps import TENSOR_MAP_PARAM, PageBoxLayout, encode_page_map

if TYPE_CHECKING:
    from openinfer.backend.cuda.moe import ExpertGroupingDevice, ExpertLinear

SM90_ENV = "OPENINFER_MOE_SM90"
DEFAULT_SM90 = True
# moe_sm90.cu's shape: 128-slot x 256-weight-row tiles (fused: 128 gate + the same 128 up rows),
# 64-wide k-tiles, 3 warpgroups, at most 512 experts (their offsets and tile counts in shared memory)
SM90_TILE_M, SM90_TILE_N, SM90_BOX_ROWS, SM90_TILE_K = 128, 256, 128, 64
SM90_THREADS = 384
SM90_STAGES = 4
SM90_MAX_EXPERTS = 512
SM90_MAX_SHARED_BYTES = 227 * 1024 - 2 * 513 * 4  # an H100's opt-in limit less the kernel's static arrays
# Down to 1.5 slots per expert (16 tokens x top-6 of 64) measured ahead in E2 (H200, CUDA graphs; vs what
# ran before: 239 vs 257 us at 16 tokens (moe_gemv_wide), 276 vs 307 at 32, 285 vs 316 at 48, 287 vs 318
# at 64); below, unmeasured: the decode GEMVs keep those steps.
SM90_ABOVE_ROWS_PER_EXPERT = 1.4
# CTA pairs (clusters of 2) on 256-slot units of one expert, each weight tile copied once for both by
# TMA multicast (a lone CTA's 128 x 256 tile reads 768 bytes from L2 per k column for 64 K MMAs, a
# pair's CTA 512), from this many slots per expert on (a pair's unit is 256 slots: fewer leave its
# second CTA idle). Off (infinite): E1 (H200) measured the pairs behind single CTAs at every step,
# 2709 vs 1517 us at 8192 tokens, 794 vs 340 at 1024, 764 vs 313 at 256.
SM90_MULTICAST_MIN_ROWS_PER_EXPERT = float("inf")


@dataclass(frozen=True)
class Sm90Shape:
    """One build of moe_sm90.cu: slots x weight rows per tile, ring stages, whether a consumer
    warpgroup with no slot in its 64 rows skips its wgmmas (SM90_SKIP_EMPTY; same bits), and whether
    the CTAs split units x k-tiles evenly (SM90_STREAM_K; cut units summed through an fp32 workspace), and
    how many 64-wide k sub-tiles a stage holds (SM90_K_SUB: 2 reads 256 contiguous bytes of each weight row
    per stage)."""

    tile_m: int = SM90_TILE_M
    tile_n: int = SM90_TILE_N
    stages: int = SM90_STAGES
    skip_empty: bool = False
    stream_k: bool = False
    k_sub: int = 1
    ctas_per_sm: int = 1  # persistent CTAs per SM (sm90_grid): 2 run two producers' rings side by side

    @property
    def threads(self) -> int:
        return 128 * (1 + self.tile_m // 64)

    def shared_bytes(self) -> int:
        """Dynamic shared memory: the stages' A and B tiles, the mbarriers, 1024 of alignment."""
        return self.stages * (self.tile_m + self.tile_n) * 128 * self.k_sub + 16 * self.stages + 1024


# Shapes for small steps (SM90_SHAPE_CHOICE picks one by slots per expert; OPENINFER_MOE_SM90_SHAPE=<name>
# forces one wherever the Hopper kernel runs): a decode step of 16-256 tokens has 1.5-24 slots per expert, so a 128-slot tile is
# mostly padding and the weight stream is the whole cost. "skip": the second warpgroup's padding rows
# leave the tensor cores alone; "m64_s5": one consumer warpgroup (a smaller A stage: 5 stages fit);
# "n128": 128 weight rows per tile, twice the work units (a shorter last wave). sm_90a ptxas, fused
# gate_up: 168 / 160 / 91-160 registers, no spills.
SM90_SHAPE_ENV = "OPENINFER_MOE_SM90_SHAPE"
SM90_SHAPES: dict[str, Sm90Shape] = {
    "base": Sm90Shape(),
    "skip": Sm90Shape(skip_empty=True),
    "m64_s5": Sm90Shape(tile_m=64, stages=5),
    "m64_n128_s8": Sm90Shape(tile_m=64, tile_n=128, stages=8),
    "n128_s6": Sm90Shape(tile_n=128, stages=6, skip_empty=True),
    # stream-K: every CTA the same share of the launch's units x k-tiles (no idle SMs in a last wave)
    "sk": Sm90Shape(skip_empty=True, stream_k=True),
    "m64_s5_sk": Sm90Shape(tile_m=64, stages=5, stream_k=True),
    "n128_s6_sk": Sm90Shape(tile_n=128, stages=6, skip_empty=True, stream_k=True),
    # 128-wide k stages (two 64-wide sub-tiles): 256-byte runs of each weight row per request (one consumer
    # warpgroup only: two leave the producer 72 registers, and it spills)
    "m64_n128_k2": Sm90Shape(tile_m=64, tile_n=128, k_sub=2),
    "m64_n128_k2_sk": Sm90Shape(tile_m=64, tile_n=128, k_sub=2, stream_k=True),
    # longer runs of each weight row per stage (k2: 256 bytes took 87 -> 92 % of the copy bandwidth): 384 bytes in
    # 3 stages, 512 in 2. H200 s11 (benchmarks/gpu_moe_grouped.py experts, Moonlight's routed experts, graphs): 16
    # tokens k2 / k3 / k4 228.1 / 225.4 / 251.8 us (D1); D2 with PDL 222.0 / 223.6 at 16 tokens, 273.5 / 273.2 at
    # 64; the Moonlight decode ledger unchanged (b16 8.067 vs 8.066 ms): not chosen
    "m64_n128_k3": Sm90Shape(tile_m=64, tile_n=128, k_sub=3, stages=3),
    "m64_n128_k4": Sm90Shape(tile_m=64, tile_n=128, k_sub=4, stages=2),
    # two CTAs per SM, each half the ring: the same weight bytes in flight per SM from two independent producers, so
    # one's unit boundary (its A-row index loads, the first boxes of the next unit) leaves the other streaming. s12 D1:
    # the decode shape's GEMMs read ~3.9 TB/s where a read stream reaches 4.47. s4_x2 is the decode default since D2b
    # (SM90_SHAPE_CHOICE); k2_x2 (2 stages of 128-wide k) unmeasured
    "m64_n128_k2_x2": Sm90Shape(tile_m=64, tile_n=128, k_sub=2, stages=2, ctas_per_sm=2),
    "m64_n128_s4_x2": Sm90Shape(tile_m=64, tile_n=128, stages=4, ctas_per_sm=2),
    # Measured in s13 (H200, gpu_moe_grouped.py experts at 16 tokens / gpu_step_timeline.py) and deleted, all slower than
    # m64_n128_s4_x2: its stream-K build (gate_up 163 vs 146 us, down 89 vs 77; Moonlight b16 step 0.90x); the weights
    # repacked at load so each unit's k-tiles are one contiguous run (gate_up 151.9 vs 145.9 us, in one 16 KB TMA box a
    # stage or two of 8 KB; step 0.979x); each unit's k-tiles rotated to start at unit % k_tiles (147.8 vs 146.9 us;
    # step 0.985x); the weight boxes copied with an L2 evict-first policy (step b16 / b64 0.987 / 0.994x); this kernel at
    # one token in place of the decode GEMV (step b1 0.96x). The row layout's 128-byte row pieces from 264 CTAs already
    # read at ~94 % of a read-only stream (gate_up; down ~89 %: its last of ~3.2 waves).
}
# The shape by slots per expert (the first entry whose bound holds). Default since E1 (H200, 2026-11-24,
# benchmarks/results/moe_grouped_experts_e1_h200.json; OPENINFER_MOE_SM90_SHAPE=base reverts): up to 24 slots
# per expert m64_n128_k2 (one consumer warpgroup, 128 weight rows x 128-wide k stages), the same bits as
# "base". Moonlight's routed experts per layer, gate_up + down, graphs, copy bandwidth 4.25 TB/s: 16 tokens
# 240 -> 227 us (87 -> 92 %), 64 tokens 289 -> 280 us (90 -> 93 %), 256 tokens 309 -> 284 us (84 -> 92 %);
# m64_s5 229 / 279 / 292; stream-K (sk*) and 128-row tiles with two warpgroups (n128*) no faster than base.
# Above 24 slots per expert (prefill) unmeasured: base.
# Base-only for s8's last hours (E2's Moonlight fault), cleared by s9 D1's bisect (the fault was the MoE decode
# routing). Forcing m64_n128_k2 at every size (prefill included) in a Moonlight burst (s9 D1b): TPOT 16 streams
# 8.56 vs 8.88 ms, but TTFT p50 at 64 streams 606 vs 504 ms (prefill steps) and 256 streams 6,284 vs 7,095 tok/s:
# it stays within 24 slots per expert.
# Since s12 D2b (H200, 2026-11-24, benchmarks/gpu_step_timeline.py, results/timeline_moonlight_moon13_d2b_h200.json;
# Moonlight decode graphs re-captured in one process, 2 rounds; OPENINFER_MOE_SM90_SHAPE=m64_n128_k2 reverts): up to 24
# slots per expert m64_n128_s4_x2, two CTAs per SM each with a 4-stage ring of 64-wide k-tiles (the same weight bytes
# in flight per SM, two producers; the down projection's PDL-launched CTAs start beside gate_up's last ones): steps b16 /
# b64 8.293 -> 8.149 / 10.149 -> 9.880 ms (1.018 / 1.027x); b1 runs the decode GEMV (unchanged: 2.865 vs 2.906, noise).
SM90_SHAPE_CHOICE: tuple[tuple[float, str], ...] = ((24, "m64_n128_s4_x2"), (float("inf"), "base"))


# OPENINFER_MOE_SM90_PDL builds the kernel with SM90_PDL (each CTA lets the next launch go at once; the
# producer sends its first weight boxes before griddepcontrol.wait) and launches the down projection
# (``overlap_previous``) with programmatic stream serialization, so down's CTAs take the SMs gate_up leaves in
# its last wave and stream their first weights while gate_up finishes. On by default since D2 of 2026-11-24
# (H200, benchmarks/results/moe_block_moe13c_d2.json, Moonlight's MoE block, graphs; =0 reverts): alone 258.1 ->
# 253.5 / 321.8 -> 319.1 us at 16 / 64 tokens (1.018 / 1.008x); with the shared experts fused 254.4 -> 251.4 /
# 306.2 -> 301.8 us.
SM90_PDL_ENV = "OPENINFER_MOE_SM90_PDL"
DEFAULT_SM90_PDL = True


# OPENINFER_MOE_GATE_UP_PDL (opt-in, measured within noise; =1 on): the gate_up projection too is launched with programmatic
# stream serialization, right after the routing's grouping kernel, built to wait for it before reading anything
# (moe_sm90.cu SM90_PDL=2): its launch, CTA start and barrier set-up overlap the grouping kernel's run. The same bits.
# s12 D1 (H200, Moonlight decode graphs, with OPENINFER_MOE_COMBINE_PDL): b1 / b16 / b64 0.979 / 0.992 / 0.998x — the
# CUPTI timeline shows ~0.1 us between graph kernels, so a launch overlapped saves next to nothing.
GATE_UP_PDL_ENV = "OPENINFER_MOE_GATE_UP_PDL"
DEFAULT_GATE_UP_PDL = False


def gate_up_pdl() -> bool:
    """$OPENINFER_MOE_GATE_UP_PDL ("1"/"on" or "0"/"off"; unset: DEFAULT_GATE_UP_PDL; another value: a clear error)."""
    value = os.environ.get(GATE_UP_PDL_ENV, "").lower()
    if value not in ("", "0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{GATE_UP_PDL_ENV} must be 1 or 0 (on / off), got {value!r}")
    return DEFAULT_GATE_UP_PDL if value == "" else value in ("1", "true", "on")


# Opt-in, measured slower: OPENINFER_MOE_SM90_L2_AHEAD=P (k-tiles; 0 / unset: off) has the producer also ask L2 for
# the weight boxes P k-tiles ahead of the ones it copies (moe_sm90.cu SM90_L2_AHEAD), past the shared-memory ring;
# OPENINFER_MOE_SM90_B_FIRST=1 issues each k-tile's weight boxes before its gathered A rows. s12 D1 (H200, Moonlight
# decode graphs, CUPTI): at 16 tokens gate_up + down run ~234 us a layer for ~913 MB of expert weights, ~3.9 TB/s,
# where a plain read stream reaches 4.47 TB/s (benchmarks/gpu_step_timeline.py --read-ceilings, the same 256-byte row
# runs 4.46). D2b (same harness, k2 shape): L2_AHEAD 4 / 8 took b16 8.293 -> 10.207 / 12.554 ms (0.81 / 0.66x: the
# GEMMs ~1.7x longer, the prefetched lines apparently read twice), B_FIRST 8.337 (0.995x). Single-CTA, whole-unit
# builds only (no multicast, no stream-K); the same bits.
L2_AHEAD_ENV, B_FIRST_ENV = "OPENINFER_MOE_SM90_L2_AHEAD", "OPENINFER_MOE_SM90_B_FIRST"
L2_AHEAD_MAX = 32
DEFAULT_L2_AHEAD, DEFAULT_B_FIRST = 0, False
# the defaults apply to decode-sized launches only (at most this many slots per expert: SM90_SHAPE_CHOICE's decode
# shape); prefill-sized ones keep the plain producer unless the switches say otherwise
DEFAULT_PRODUCER_MAX_ROWS_PER_EXPERT = 24


def l2_ahead(slots_per_expert: float = 0.0) -> int:
    """$OPENINFER_MOE_SM90_L2_AHEAD: k-tiles of L2 look-ahead, 0..L2_AHEAD_MAX (unset: DEFAULT_L2_AHEAD up to
    DEFAULT_PRODUCER_MAX_ROWS_PER_EXPERT slots per expert, else 0; another value: a clear error)."""
    default = DEFAULT_L2_AHEAD if slots_per_expert <= DEFAULT_PRODUCER_MAX_ROWS_PER_EXPERT else 0
    text = os.environ.get(L2_AHEAD_ENV) or str(default)
    if not text.isdigit() or int(text) > L2_AHEAD_MAX:
        raise ValueError(f"{L2_AHEAD_ENV} is a number of k-tiles from 0 to {L2_AHEAD_MAX}; got {text!r}")
    return int(text)


def b_first(slots_per_expert: float = 0.0) -> bool:
    """$OPENINFER_MOE_SM90_B_FIRST (1 / 0; unset: DEFAULT_B_FIRST up to DEFAULT_PRODUCER_MAX_ROWS_PER_EXPERT slots per
    expert, else off; another value: a clear error)."""
    default = DEFAULT_B_FIRST and slots_per_expert <= DEFAULT_PRODUCER_MAX_ROWS_PER_EXPERT
    text = os.environ.get(B_FIRST_ENV) or str(int(default))
    if text not in ("0", "1"):
        raise ValueError(f"{B_FIRST_ENV} is 0 or 1; got {text!r}")
    return text == "1"


def sm90_pdl() -> bool:
    """$OPENINFER_MOE_SM90_PDL ("1"/"on" or "0"/"off"; unset: DEFAULT_SM90_PDL)."""
    value = os.environ.get(SM90_PDL_ENV, "").lower()
    if value not in ("", "0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{SM90_PDL_ENV} must be 1 or 0 (on / off), got {value!r}")
    return DEFAULT_SM90_PDL if value == "" else value in ("1", "true", "on")


def launch_overlapping_previous(fn, grid: int, block: int, args: tuple, shared: int) -> None:
    """``fn((grid,), (block,), args, shared_mem=shared)`` with programmatic dependent launch (``pdl_launch``): it
    may start before the stream's previous kernel ends (its griddepcontrol.wait holds whatever depends on that
    kernel); on the legacy default stream, or under ``discover_kernels``, a plain launch."""
    launch(fn, (grid,), (block,), args, shared_mem=shared, after_previous=True)


def sm90_enabled() -> bool:
    """$OPENINFER_MOE_SM90 ("1"/"on" or "0"/"off"; unset: DEFAULT_SM90)."""
    value = os.environ.get(SM90_ENV)
    if value is None or value == "":
        return DEFAULT_SM90
    if value.lower() in ("1", "true", "on"):
        return True
    if value.lower() in ("0", "false", "off"):
        return False
    raise ValueError(f"{SM90_ENV} must be 1 or 0 (on / off), got {value!r}")


@functools.cache
def _device_traits(device_id: int) -> tuple[str, int]:
    device = cupy.cuda.Device(device_id)
    return device.compute_capability, int(device.attributes["MultiProcessorCount"])


def sm90_supported() -> bool:
    """Whether the current GPU runs sm_90a code (an H100 / H200)."""
    return _device_traits(cupy.cuda.Device().id)[0] == "90"


def sm90_ready(a: cupy.ndarray, weight: ExpertLinear, fuse_silu: bool = False) -> bool:
    """moe_grouped_gemm_sm90's needs: an sm_90 GPU, bf16 weights of at most SM90_MAX_EXPERTS experts,
    K % 8 == 0 (16-byte rows for cp.async and TMA), 16-byte aligned A rows and a contiguous, 16-byte
    aligned weight (its tensor map), an even N
    (fused: N = 2I with I even), row indices within int32, K >= 64 and E·N >= 128 (a whole TMA box)."""
    return (weight.format == "bf16" and weight.num_experts <= SM90_MAX_EXPERTS and weight.in_features % 8 == 0
            and a.data.ptr % 16 == 0 and weight.data.data.ptr % 16 == 0 and weight.data.flags.c_contiguous
            and weight.out_features % (4 if fuse_silu else 2) == 0
            and weight.num_experts * weight.out_features < 2**31 and sm90_supported()
            # the tensor map's box (64 x 128) inside the weight: toy shapes keep the other kernels
            and weight.in_features >= SM90_TILE_K and weight.num_experts * weight.out_features >= SM90_BOX_ROWS)


def sm90_shared_bytes(stages: int = SM90_STAGES) -> int:
    """moe_sm90.cu's dynamic shared memory (the default tile shape): the stages' A and B tiles, the
    mbarriers, 1024 of alignment."""
    return Sm90Shape(stages=stages).shared_bytes()


def sm90_shape(slots_per_expert: float, name: str | None = None) -> Sm90Shape:
    """The tile shape: ``name``, else $OPENINFER_MOE_SM90_SHAPE, else SM90_SHAPE_CHOICE by slots per
    expert; an unknown name is a clear error."""
    name = name or os.environ.get(SM90_SHAPE_ENV) or next(
        shape for most, shape in SM90_SHAPE_CHOICE if slots_per_expert <= most)
    if name not in SM90_SHAPES:
        raise ValueError(f"unknown {SM90_SHAPE_ENV} {name!r}; one of {', '.join(SM90_SHAPES)}")
    return SM90_SHAPES[name]


def weight_box_layout(weight: ExpertLinear, box_rows: int = SM90_BOX_ROWS) -> PageBoxLayout:
    """The tensor-map layout of ``weight.data`` ``[E, N, K]``: rows of K elements, 64 x ``box_rows`` boxes
    (half a tile's weight rows)."""
    rows, k = weight.num_experts * weight.out_features, weight.in_features
    return PageBoxLayout(dims=(k, 1, rows), strides=(2 * k, 2 * k), box=(SM90_TILE_K, 1, box_rows))


class WeightMaps:
    """The tensor map of each weight array, encoded once (host bytes: a kernel parameter). Keyed by
    device address and layout, so an array freed and reallocated alike reuses a map still right."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, PageBoxLayout], np.ndarray] = {}

    def get(self, weight: ExpertLinear, box_rows: int = SM90_BOX_ROWS) -> np.ndarray:
        key = (weight.data.data.ptr, weight_box_layout(weight, box_rows))
        found = self._maps.get(key)
        if found is None:
            found = encode_page_map(*key).view(TENSOR_MAP_PARAM)
            self._maps[key] = found
        return found


weight_maps = WeightMaps()


def sm90_grid(num_slots: int, weight: ExpertLinear, fuse_silu: bool, multicast: bool = False,
              shape: Sm90Shape = SM90_SHAPES["base"]) -> int:
    """Persistent CTAs: one per SM (``multicast``: pairs), fewer when the step has fewer work units
    (bounded on the host: each active expert wastes at most one partial unit of tile_m, or 2 tile_m,
    slots)."""
    cluster = 2 if multicast else 1
    columns = shape.tile_n // 2 if fuse_silu else shape.tile_n
    out_features = weight.out_features // 2 if fuse_silu else weight.out_features
    m_units = -(-num_slots // (shape.tile_m * cluster)) + min(weight.num_experts, num_slots)
    units = m_units * -(-out_features // columns)
    return cluster * max(1, min(_device_traits(cupy.cuda.Device().id)[1] * shape.ctas_per_sm // cluster, units))


_workspaces: dict[tuple[int, int, bool, bool], tuple[cupy.ndarray, cupy.ndarray]] = {}


def _stream_k_workspace(fuse_silu: bool, gather: bool) -> tuple[cupy.ndarray, cupy.ndarray] | None:
    """The stream-K flags and fp32 partials of launches like this one (device, stream, projection), made once for
    every shape's largest grid and kept (graphs captured with them replay on them). The flags are zeros, and left zeros
    by every launch (moe_sm90.cu), so no memset sits between gate_up and down; the partials are the launch's own
    while it runs, never a pool block the launch before (which PDL lets run beside it: gate_up before down) may still
    write. None while a graph is being captured and none exists yet (the flags cannot be zeroed then)."""
    stream = cupy.cuda.get_current_stream()
    key = (cupy.cuda.Device().id, stream.ptr, fuse_silu, gather)
    found = _workspaces.get(key)
    if found is None:
        if stream.is_capturing():
            return None
        # a flag and a tile of fp32 partials per CTA of the largest grid: SMs x the most CTAs per SM of any shape
        ctas = _device_traits(key[0])[1] * max(shape.ctas_per_sm for shape in SM90_SHAPES.values())
        tile = max(shape.tile_m * shape.tile_n for shape in SM90_SHAPES.values())
        found = _workspaces[key] = (cupy.zeros(ctas, dtype=cupy.int32), cupy.empty(ctas * tile, dtype=cupy.float32))
    return found


# The launches inside ``rotated_units(S)`` take the last S experts' units first (moe_sm90.cu SM90_ROTATE; the same
# bits): a MoE layer whose fused shared experts were pulled into L2 (moe.py OPENINFER_MOE_L2_PREFETCH) reads them in
# the first wave. 0: expert order.
_rotate_units = 0


@contextlib.contextmanager
def rotated_units(last_experts: int):
    """Within the block, moe_grouped_gemm_sm90 launches start with the last ``last_experts`` experts' units."""
    global _rotate_units
    before, _rotate_units = _rotate_units, int(last_experts)
    try:
        yield
    finally:
        _rotate_units = before


def sm90_kernel(tiles: Sm90Shape, fuse_silu: bool, multicast: bool = False, pdl: int = 0, rotate: int = 0,
                ahead: int = 0, weights_first: bool = False):
    """The moe_grouped_gemm_sm90 build for ``tiles`` (arch_kernel: compiled once; a dry run records it); ``pdl``
    (moe_sm90.cu SM90_PDL): 0 none, 1 (or True) weights before the wait, 2 the wait first; ``ahead``: SM90_L2_AHEAD;
    ``weights_first``: SM90_B_FIRST."""
    # the default build keeps its define set as before the shapes existed
    extra = {} if tiles == SM90_SHAPES["base"] else {
        "SM90_TILE_M": tiles.tile_m, "SM90_TILE_N": tiles.tile_n, "SM90_SKIP_EMPTY": int(tiles.skip_empty),
        "SM90_STREAM_K": int(tiles.stream_k), "SM90_K_SUB": tiles.k_sub}
    if rotate:
        extra["SM90_ROTATE"] = rotate
    if (tiles.stream_k or tiles.k_sub > 1 or pdl) and multicast:
        raise ValueError("moe_sm90's stream-K, wide-k and PDL builds run single CTAs: no multicast")
    if pdl not in (0, 1, 2):
        raise ValueError(f"moe_sm90's SM90_PDL build is 0, 1 or 2, got {pdl!r}")
    if pdl:
        extra["SM90_PDL"] = int(pdl)
    if ahead:
        if multicast or tiles.stream_k:
            raise ValueError("moe_sm90's L2 look-ahead build runs single CTAs over whole units: no multicast, no stream-K")
        extra["SM90_L2_AHEAD"] = int(ahead)
    if weights_first:
        extra["SM90_B_FIRST"] = 1
    return arch_kernel("moe_sm90.cu", "moe_grouped_gemm_sm90", "sm_90a", tiles.shared_bytes(), SM90_STAGES=tiles.stages,
                       SM90_FUSE_SILU=int(fuse_silu), SM90_MULTICAST=int(multicast), **extra)


def grouped_gemm_sm90(a: cupy.ndarray, weight: ExpertLinear, grouping: ExpertGroupingDevice, gather: bool,
                      fuse_silu: bool = False, stages: int | None = None, multicast: bool | None = None,
                      shape: str | None = None, overlap_previous: bool = False,
                      after_grouping: bool = False) -> cupy.ndarray:
    """``out[p] = A[row(p)] · W_e(p)^T`` (``row(p)``: slot p's token when ``gather``, else p) for
    every slot in expert order, ``[T·k, N]`` bf16; ``fuse_silu`` (gate_up): ``silu(gate)·up``,
    ``[T·k, N/2]``. ``multicast``: CTA pairs share each weight tile (TMA multicast); default from
    SM90_MULTICAST_MIN_ROWS_PER_EXPERT slots per expert. ``shape``: the tile shape (SM90_SHAPES;
    default ``sm90_shape``), ``stages`` overriding its ring depth. With $OPENINFER_MOE_SM90_PDL the
    build lets the next launch start early, and ``overlap_previous`` launches this one so (the caller
    vouches that the previous kernel on the stream started after this step's routing and grouping
    completed: gate_up before down). ``after_grouping``: the previous kernel on the stream wrote ``grouping`` (the
    gate_up projection); with $OPENINFER_MOE_GATE_UP_PDL this launch then overlaps it, built to wait for it first
    (SM90_PDL=2). The caller checks ``sm90_ready``."""
    num_slots = int(grouping.sorted_slots.size)
    if multicast is None:
        multicast = num_slots >= SM90_MULTICAST_MIN_ROWS_PER_EXPERT * weight.num_experts
    # CTA pairs run the base tiles (unless a shape is named: then sm90_kernel says what cannot pair)
    tiles = SM90_SHAPES["base"] if multicast and shape is None else sm90_shape(num_slots / weight.num_experts, shape)
    if stages is not None:
        tiles = dataclasses.replace(tiles, stages=stages)
    out_features = weight.out_features // 2 if fuse_silu else weight.out_features
    out = cupy.empty((num_slots, out_features), dtype=cupy.uint16)
    if num_slots == 0:
        return out
    a = cupy.ascontiguousarray(a)
    shared = tiles.shared_bytes()
    if shared > SM90_MAX_SHARED_BYTES:
        raise ValueError(f"moe_sm90 tiles {tiles} need {shared} bytes of shared memory (at most {SM90_MAX_SHARED_BYTES})")
    wait_first = after_grouping and not multicast and gate_up_pdl()
    pdl = 2 if wait_first else int(sm90_pdl() and not multicast)
    per_expert = num_slots / weight.num_experts
    ahead = l2_ahead(per_expert) if not (multicast or tiles.stream_k) else 0
    fn = sm90_kernel(tiles, fuse_silu, multicast, pdl, _rotate_units if _rotate_units < weight.num_experts else 0,
                     ahead, b_first(per_expert))
    grid = sm90_grid(num_slots, weight, fuse_silu, multicast, tiles)
    args = (a, grouping.sorted_slots if gather else np.uint64(0), np.int32(grouping.top_k),
            weight_maps.get(weight, tiles.tile_n // 2), grouping.offsets, np.int32(weight.num_experts), out,
            np.int32(weight.out_features), np.int32(weight.in_features))
    if tiles.stream_k:  # each CTA's part of a unit cut at its start (fp32, fragment order), and its flag
        workspace = _stream_k_workspace(fuse_silu, gather)
        if workspace is None:  # first met inside a graph capture: its own (a memset node before it; not overlapped)
            workspace = (cupy.zeros(grid, dtype=cupy.int32),
                         cupy.empty(grid * tiles.tile_m * tiles.tile_n, dtype=cupy.float32))
            overlap_previous = False
        flags, partials = workspace
        args += (partials, flags)
    if (pdl == 1 and overlap_previous) or pdl == 2:
        launch_overlapping_previous(fn, grid, tiles.threads, args, shared)
    else:
        fn((grid,), (tiles.threads,), args, shared_mem=shared)
    return out


def sm90_experts(a: cupy.ndarray, weight: ExpertLinear, num_slots: int, fuse_silu: bool = False) -> bool:
    """Whether a grouped GEMM of ``num_slots`` slots takes moe_grouped_gemm_sm90: switched on
    (``sm90_enabled``), ``sm90_ready`` and more than SM90_ABOVE_ROWS_PER_EXPERT slots per expert."""
    return (sm90_enabled() and num_slots > SM90_ABOVE_ROWS_PER_EXPERT * weight.num_experts
            and sm90_ready(a, weight, fuse_silu))
