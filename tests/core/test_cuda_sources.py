"""CPU CI for the CUDA backend: every kernel source compiles for sm_90 (sm_90a where it uses wgmma) with the local nvcc
(for each HEAD_DIM / GROUP the backend instantiates), and the host bf16 conversions are exact."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from openinfer.backend.cuda.bf16 import bf16_bits_to_float, float_to_bf16_bits, round_to_bf16

REPO = Path(__file__).resolve().parents[2]
KERNEL_DIR = REPO / "core" / "kernels"
# plugins ship their own kernels next to their Python package (e.g. openinfer_qwen35/kernels/)
PLUGIN_KERNELS = sorted(REPO.glob("plugins/*/**/kernels/*.cu"))
VARIANTS = {
    "qk_norm_rope.cu": [{"HEAD_DIM": 64}, {"HEAD_DIM": 128}],
    "decode_attention.cu": [{"HEAD_DIM": 64, "GROUP": 1}, {"HEAD_DIM": 128, "GROUP": 4}, {"HEAD_DIM": 128, "GROUP": 8}],
    "decode_attention_mma.cu": [{"HEAD_DIM": 64, "GROUP": 1}, {"HEAD_DIM": 128, "GROUP": 4},
                                {"HEAD_DIM": 128, "GROUP": 16, "DECODE_WARPS": 8, "DECODE_STAGES": 3},
                                {"HEAD_DIM": 256, "GROUP": 8}],
    "prefill_attention.cu": [{"HEAD_DIM": 64}, {"HEAD_DIM": 128}],
    "moe.cu": [{"WEIGHT_FORMAT": 0}, {"WEIGHT_FORMAT": 1, "GROUP": 32}, {"WEIGHT_FORMAT": 2, "FP8_BLOCK": 128},
               # moe_gemv_wide's "wide2" shape, INT4 groups below its 32-weight chunk
               {"WEIGHT_FORMAT": 1, "GROUP": 16, "WIDE_COLUMNS": 2, "WIDE_ROWS": 4, "WIDE_MIN_BLOCKS": 4},
               # the INT4 tensor-core GEMV with two N tiles and a four-way K split (kimi13)
               {"WEIGHT_FORMAT": 1, "GROUP": 32, "MMA_GEMV_NTILES": 2, "MMA_GEMV_KSPLIT": 4},
               # INT4 in the GEMV-tiled layout: every kernel through int4_word_index, moe_gemv_int4_tiled (kimi13)
               {"WEIGHT_FORMAT": 1, "GROUP": 32, "INT4_TILED": 1, "TILED_NTILES": 2, "TILED_DEPTH": 8,
                "TILED_STREAM_LOADS": 1},
               {"WEIGHT_FORMAT": 1, "GROUP": 32, "INT4_TILED": 1, "TILED_NTILES": 2, "TILED_STAGES": 8, "TILED_ROTATE": 1},
               # the decode GEMVs' streaming weight loads (ld.global.nc / cp.async with L2::256B)
               {"WEIGHT_FORMAT": 1, "GROUP": 32, "GEMV_STREAM_LOADS": 1, "MMA_GEMV_NTILES": 2, "STAGED_CHUNKS": 4},
               # kimi13: SiLU·mul fused into the gate_up decode GEMVs (bf16 wide; tiled INT4), row-block streams
               {"WEIGHT_FORMAT": 0, "WIDE_COLUMNS": 4, "WIDE_ROWS": 4, "WIDE_MIN_BLOCKS": 3, "WIDE_FUSE_SILU": 1},
               {"WEIGHT_FORMAT": 1, "GROUP": 32, "INT4_TILED": 1, "TILED_NTILES": 1, "TILED_DEPTH": 6,
                "TILED_STREAM_LOADS": 1, "TILED_ROTATE": 1, "TILED_FUSE_SILU": 1},
               {"WEIGHT_FORMAT": 1, "GROUP": 32, "INT4_TILED": 1, "TILED_NTILES": 1, "TILED_DEPTH": 6,
                "TILED_ROW_BLOCKS": 2}],
    "mla.cu": [{"KV_LORA": 512, "ROPE_DIM": 64}, {"KV_LORA": 512, "ROPE_DIM": 64, "MLA_ASYNC_TILES": 1},
               # mla_combine_expand's wider column blocks ($OPENINFER_MLA_COMBINE_EXPAND; 16 is the default build)
               {"KV_LORA": 512, "ROPE_DIM": 64, "COMBINE_EXPAND_COLUMNS": 32},
               {"KV_LORA": 512, "ROPE_DIM": 64, "COMBINE_EXPAND_COLUMNS": 64}],
    # Qwen3.5's fused decode: the conv width compiled in (as its cuda_ops builds it) and the runtime-width build
    "gdn_decode.cu": [{}, {"CONV_WIDTH": 4}],
    "prefill_attention_sm90.cu": [{"HEAD_DIM": 128}, {"HEAD_DIM": 256},
                                  {"HEAD_DIM": 128, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1},
                                  {"HEAD_DIM": 256, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "INTRA_WG_OVERLAP": 0},
                                  {"HEAD_DIM": 128, "STAGES": 2, "SKIP_KV_LOADS": 1},
                                  # attn16's TMA K/V loads and persistent schedule, and TMA at head_dim 256
                                  {"HEAD_DIM": 128, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "TMA_KV_LOADS": 1, "PERSISTENT": 1},
                                  {"HEAD_DIM": 256, "TMA_KV_LOADS": 1},
                                  # attn16 session 6: the opt-in refinements together, both schedules and
                                  # head sizes, and split K/V barriers on the cp.async path alone
                                  {"HEAD_DIM": 128, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "TMA_KV_LOADS": 1, "PAGE_ID_PREFETCH": 1, "SPLIT_KV": 1, "EARLY_RESCALE": 1,
                                   "LEAN_ARRIVALS": 1},
                                  {"HEAD_DIM": 128, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "TMA_KV_LOADS": 1, "PAGE_ID_PREFETCH": 1, "SPLIT_KV": 1, "EARLY_RESCALE": 1,
                                   "LEAN_ARRIVALS": 1, "PERSISTENT": 1},
                                  {"HEAD_DIM": 256, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "TMA_KV_LOADS": 1, "PAGE_ID_PREFETCH": 1, "SPLIT_KV": 1, "LEAN_ARRIVALS": 1},
                                  {"HEAD_DIM": 128, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "TMA_KV_LOADS": 1, "KV_MULTICAST": 1, "SPLIT_KV": 1},
                                  {"HEAD_DIM": 128, "SPLIT_KV": 1, "INTRA_WG_OVERLAP": 0},
                                  # attn16 session 7: the consumer-loop refinements on both head sizes and schedules
                                  {"HEAD_DIM": 128, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "TMA_KV_LOADS": 1, "PAGE_ID_PREFETCH": 1, "DESCRIPTOR_ADDS": 1,
                                   "SKIP_UNIT_RESCALE": 1, "ORDERED_SOFTMAX": 1},
                                  {"HEAD_DIM": 128, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "TMA_KV_LOADS": 1, "PERSISTENT": 1, "DESCRIPTOR_ADDS": 1, "SKIP_UNIT_RESCALE": 1,
                                   "ORDERED_SOFTMAX": 1},
                                  {"HEAD_DIM": 256, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "DESCRIPTOR_ADDS": 1, "SKIP_UNIT_RESCALE": 1, "ORDERED_SOFTMAX": 1, "RESCALE_SLACK": 1},
                                  {"HEAD_DIM": 128, "TMA_KV_LOADS": 1, "SKIP_KV_LOADS": 1, "RESCALE_SLACK": 1},
                                  {"HEAD_DIM": 128, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1,
                                   "TMA_KV_LOADS": 1, "PERSISTENT": 1, "HEAD_PAIRS": 1, "ORDERED_SOFTMAX": 1},
                                  {"HEAD_DIM": 128, "HEAD_PAIRS": 1, "INTRA_WG_OVERLAP": 0},
                                  # attn16 session 8: whole runs of consecutive pages as one TMA box (default)
                                  {"HEAD_DIM": 128, "TMA_KV_LOADS": 1, "KV_RUNS": 1}],
}
# moe13's Hopper grouped expert GEMM: plain and with gate_up's SiLU·mul fused, 4 and 3 stages
VARIANTS["gemv.cu"] = [{}, {"GEMV_BATCHED_TAIL": 1}]  # kimi13: the last partial pass's loads first
# int4 (s13): the lane-groups INT4 GEMV's staged activations (with SiLU·mul)
VARIANTS["moe_int4.cu"] = [
    {}, {"GROUPS_XSMEM": 2}, {"GROUPS_XSMEM": 1, "GROUPS_FUSE_SILU": 1},
    # the one-token default (groups_xs_rs: the row stream) and its fused SiLU·mul form (groups_xs's)
    {"GROUPS_XSMEM": 2, "GROUPS_ROTATE": 0, "GROUPS_ROW_STREAM": 1, "GROUPS_ROW_BLOCKS": 2},
    {"GROUPS_XSMEM": 2, "GROUPS_ROTATE": 0, "GROUPS_FUSE_SILU": 1}]
VARIANTS["moe_sm90.cu"] = [{"SM90_FUSE_SILU": 0}, {"SM90_FUSE_SILU": 1}, {"SM90_FUSE_SILU": 1, "SM90_STAGES": 3},
                           {"SM90_FUSE_SILU": 0, "SM90_MULTICAST": 1}, {"SM90_FUSE_SILU": 1, "SM90_MULTICAST": 1}]
# sources that use sm_90a-only instructions (wgmma, setmaxnreg); the rest build for plain sm_90
# (prefill_attention_sm90_short.cu's body is empty under plain sm_90 by design, so it builds for sm_90a only)
ARCH_FLAGS = {name: ["-gencode=arch=compute_90a,code=sm_90a"]
              for name in ("prefill_attention_sm90.cu", "prefill_attention_sm90_short.cu", "moe_sm90.cu")}


def cases():
    for source in [*sorted(KERNEL_DIR.glob("*.cu")), *PLUGIN_KERNELS]:
        for defines in VARIANTS.get(source.name, [{}]):
            yield pytest.param(source, defines, id=source.parent.parent.name + "/" + source.stem
                               + "".join(f"-{k}{v}" for k, v in defines.items()))


def test_every_source_has_a_case():
    assert {p.name for p in KERNEL_DIR.glob("*.cu")} >= {
        "elementwise.cu", "rms_norm.cu", "qk_norm_rope.cu", "decode_attention.cu", "prefill_attention.cu",
        "gemv.cu", "sampling.cu"}
    assert any(p.name == "gated_deltanet.cu" for p in PLUGIN_KERNELS)


@pytest.mark.parametrize(("source", "defines"), list(cases()))
def test_kernel_compiles_for_sm90(source, defines, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    arch = ARCH_FLAGS.get(source.name, ["-arch=sm_90"])
    result = subprocess.run([nvcc, *arch, "-std=c++17", f"-I{KERNEL_DIR}", *flags, "-c", str(source),
                             "-o", str(tmp_path / "out.o")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_bf16_round_trip_and_rounding():
    values = np.array([0.0, -0.0, 1.0, -2.5, 3.1415927, 1e-30, 65504.0, np.inf, -np.inf], np.float32)
    assert np.array_equal(bf16_bits_to_float(float_to_bf16_bits(values)), round_to_bf16(values))
    # ties round to even: 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7
    assert float_to_bf16_bits(np.array([1.0 + 2**-8], np.float32))[0] == 0x3F80
    assert float_to_bf16_bits(np.array([1.0 + 3 * 2**-8], np.float32))[0] == 0x3F82
    assert np.isnan(bf16_bits_to_float(float_to_bf16_bits(np.array([np.nan], np.float32)))).all()
    bits = np.arange(0, 2**16, dtype=np.uint16)
    finite = np.isfinite(bf16_bits_to_float(bits))
    assert np.array_equal(float_to_bf16_bits(bf16_bits_to_float(bits))[finite], bits[finite])
