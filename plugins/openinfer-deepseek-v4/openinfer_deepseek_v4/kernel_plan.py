"""Which code runs each DeepSeek-V4 op, per phase and backend — read this first.

A step is *prefill* when a sequence brings more than one new token (a prompt or a chunk of one),
*decode* when it brings one; a *mixed* step holds both. The model runs one path for all three:
every op takes the step's flattened tokens (NumPy attention works sequence by sequence).

=======================  ======================================  =====================================
op                       NumPy (the reference)                   CUDA (``cuda_model.CudaForward``)
=======================  ======================================  =====================================
embedding, norms         core ``embedding`` / ``rms_norm``       core kernels
projections              core ``linear`` (BLAS; FP8 linears      core ``linear`` (cuBLAS, bf16: FP8
                         dequantised to fp32 at load)            linears dequantised to bf16 at load);
                                                                 opt-in ``OPENINFER_DSV4_FP8_LINEAR=
                                                                 stream``: kept FP8, ``cuda_linears``
                                                                 (core ``moe_fp4.cu``
                                                                 ``fp8_stream_linear`` ≤ 256 rows)
mHC collapse + Sinkhorn  ``hyper_connection.collapse``           ``dsv4_hc_mix`` (blocks per token,
                                                                 mixing logit and slice: ``hc_mix_
                                                                 splits``) + ``dsv4_hc_collapse`` (x
                                                                 over blocks; Sinkhorn in block 0)
mHC expand / head        ``expand`` / ``collapse_head``          ``dsv4_hc_expand`` / the same two, head
q / kv head norms, RoPE  ``attention.attention``                 ``dsv4_head_norm_rope``
sliding-window write     ``SequenceLayerCache.write_keys``       ``dsv4_write_window``
compressor (entries +    ``attention.compress`` per sequence     ``dsv4_compress_step`` (entries of the
  open windows)                                                  windows that close) +
                                                                 ``dsv4_compress_state`` (state slots)
indexer scores / top-k   ``index_scores`` / ``top_k_visible``    ``dsv4_indexer_scores`` / ``dsv4_topk``
sparse attention         ``attention.attend`` (window + picked   ``dsv4_sparse_attention`` (a warp per
  + sinks + RoPE⁻¹       / all entries, K = V)                   head, keys shared in shared memory;
                                                                 few tokens: split over keys +
                                                                 ``dsv4_attention_combine``;
                                                                 ``_d512`` for head_dim 512)
grouped output proj.     einsum over ``wo_a`` groups + ``wo_b``  one cuBLAS strided-batched GEMM + GEMM
MoE routing              core ``openinfer.moe.route``            core ``moe.cu`` ``moe_route`` (hash /
  (sqrt-softplus, hash)                                          sqrt-softplus, on the device)
MoE experts              core ``run_experts`` (per expert        ``cuda_experts``: FP4 → core
                         GEMMs, clamped SwiGLU)                  ``moe_fp4.cu`` (``moe_fp4_stream_gemm``
                                                                 for ≤ 256 tokens, 4-stage activation
                                                                 staging, else the tiled
                                                                 ``moe_fp4_grouped_gemm``); FP8 / bf16
                                                                 → core ``moe.cu``; ``swiglu_clamp``
=======================  ======================================  =====================================

A step is one launch sequence for every token of every sequence; the kernels read the layout
(``query_start``, ``positions``, per-group block tables, ``state_slots``) from the device
batch, so decode steps are captured in CUDA graphs (the engine's ``CudaGraphRunner``).
``dsv4_fp4_linear`` / ``dsv4_fp8_linear`` (``cuda_ops.quantized_linear``) stay as single-matrix
references; the model runs experts through the grouped GEMMs.

Caches (``state.kv_cache_specs``): the sliding window, the compressed entries and the indexer's
keys are paged (block tables per KV cache group); each compressor's open window is a state slot.

Status: both columns serve (``device=cpu`` / ``device=cuda``). The CUDA model matches the NumPy
reference within the bf16 noise (``tests/plugins/deepseek_v4/test_dsv4_cuda_model.py``, H100/H200);
speed (``benchmarks/gpu_dsv4_kernels.py``): CSA layer at context 4k on an H200 (D2) 610 us at batch 1,
3.44 ms at batch 64 — 15 % / 21 % of its HBM roofline (README.md: the breakdown and what changed since).
Switches: every ``*_setting`` below reads one ``OPENINFER_DSV4_*`` variable; its docstring gives
the default and the measurement that set it.
"""

from __future__ import annotations

from collections.abc import Mapping

SUPPORTED_BACKENDS = ("numpy", "cuda")

# --- launch shapes of the kernels whose grid is chosen per step (pure rules; cuda_ops applies them) ---

MIN_KEYS_PER_RUN = 32  # split attention: a run of keys is worth a block only past this many
MAX_ATTENTION_SPLITS = 16
INDEX_ENTRIES_PER_BLOCK = 256  # the indexer's fixed split: entries scored per block
INDEX_MIN_ENTRIES_PER_BLOCK = 8  # one entry per warp of the 8-warp block


def attention_splits_setting(environ: Mapping[str, str]) -> str:
    """``OPENINFER_DSV4_ATTENTION_SPLITS``: ``auto`` (default: split while the step's blocks do not
    fill the GPU twice over; H100, batch 1, context 4k: CSA layer 1458 -> 860 us, batch 64 equal),
    ``1`` (one run of keys per block) or a fixed count."""
    value = environ.get("OPENINFER_DSV4_ATTENTION_SPLITS", "auto")
    if value != "auto" and not (value.isdigit() and 1 <= int(value) <= MAX_ATTENTION_SPLITS):
        raise ValueError(f"OPENINFER_DSV4_ATTENTION_SPLITS={value!r}: expected auto or 1..{MAX_ATTENTION_SPLITS}")
    return value


def attention_splits(setting: str | int, blocks: int, max_keys: int, multiprocessors: int) -> int:
    """Runs of keys per (token, head block) for ``dsv4_sparse_attention``: ``blocks`` = tokens ×
    head blocks, ``max_keys`` the most keys a token can attend to (window + picks or entries)."""
    if setting != "auto":
        return max(1, min(int(setting), MAX_ATTENTION_SPLITS))
    wanted = -(-2 * multiprocessors // max(blocks, 1))
    return max(1, min(wanted, -(-max_keys // MIN_KEYS_PER_RUN), MAX_ATTENTION_SPLITS))


def indexer_split_setting(environ: Mapping[str, str]) -> str:
    """``OPENINFER_DSV4_INDEXER_SPLIT``: ``auto`` (default: fewer entries per block until the step's
    blocks fill the GPU twice over; H100, CSA layer, batch 1, context 4k: scores + top-k 157 -> 43 us)
    or ``fixed`` (256 entries per block: batch 1 at context 4k scored its 1024 entries on 4 blocks)."""
    value = environ.get("OPENINFER_DSV4_INDEXER_SPLIT", "auto")
    if value not in ("fixed", "auto"):
        raise ValueError(f"OPENINFER_DSV4_INDEXER_SPLIT={value!r}: expected fixed or auto")
    return value


def indexer_entries_per_block(setting: str, tokens: int, max_entries: int, multiprocessors: int) -> int:
    """Entries each ``dsv4_indexer_scores`` block scores (grid (tokens, ⌈max_entries / this⌉))."""
    if setting == "fixed":
        return INDEX_ENTRIES_PER_BLOCK
    blocks_per_token = -(-2 * multiprocessors // max(tokens, 1))
    wanted = -(-max(max_entries, 1) // blocks_per_token)
    rounded = -(-wanted // INDEX_MIN_ENTRIES_PER_BLOCK) * INDEX_MIN_ENTRIES_PER_BLOCK
    return max(INDEX_MIN_ENTRIES_PER_BLOCK, min(rounded, INDEX_ENTRIES_PER_BLOCK))


MAX_MIX_SPLITS = 16


def attention_kernel_setting(environ: Mapping[str, str]) -> str:
    """``OPENINFER_DSV4_ATTENTION_KERNEL``: ``auto`` (default: ``dsv4_sparse_attention_d512`` for
    head_dim 512 — the same sums in the same order, 16 channels per lane fixed at compile time, 72
    registers; ptxas sm_90a) or ``generic`` (``dsv4_sparse_attention`` everywhere: per-lane arrays
    sized for head_dim 1024 with run-time guards, half the loop predicated off at 512, 127
    registers and local memory). H200 (D3, one V4-Flash layer + MoE, graph replay), generic ->
    auto: CSA at 4k 593 -> 558 / 3,416 -> 2,574 / 8,308 -> 5,113 us at batch 1 / 64 / 256; at 64k
    712 -> 660 / 5,810 -> 5,144 / 18,560 -> 15,343 us; HCA at 64k 508 -> 413 / 3,202 -> 2,460 /
    8,242 -> 5,112 us."""
    value = environ.get("OPENINFER_DSV4_ATTENTION_KERNEL", "auto")
    if value not in ("generic", "auto"):
        raise ValueError(f"OPENINFER_DSV4_ATTENTION_KERNEL={value!r}: expected generic or auto")
    return value


def attention_kernel(setting: str, head_dim: int) -> str:
    """The sparse attention kernel's name for ``head_dim``."""
    return "dsv4_sparse_attention_d512" if setting == "auto" and head_dim == 512 else "dsv4_sparse_attention"


# the kernels of kernels/dsv4.cu every CUDA forward launches (beside the sparse attention's); the others
# (dsv4_compress_entries, dsv4_fp4_linear, dsv4_fp8_linear) are single-op references the tests launch
FORWARD_KERNELS = ("dsv4_token_seq", "dsv4_hc_mix", "dsv4_hc_collapse", "dsv4_hc_expand", "dsv4_head_norm_rope",
                   "dsv4_write_window", "dsv4_compress_step", "dsv4_compress_state", "dsv4_indexer_scores",
                   "dsv4_topk", "dsv4_attention_combine")


def start_up_kernels(attention_setting: str, head_dim: int) -> tuple[str, ...]:
    """The kernels of dsv4.cu a model of ``head_dim`` runs under ``attention_setting``
    (``attention_kernel_setting``): built at start-up, each its own module of the core loader."""
    return (*FORWARD_KERNELS, attention_kernel(attention_setting, head_dim))


def hc_split_setting(environ: Mapping[str, str]) -> str:
    """``OPENINFER_DSV4_HC_SPLIT``: ``auto`` (default: dot products cut into ``hc_mix_splits``
    slices, x over ⌈hidden / 256⌉ blocks; same math, the partial sums added in slice order) or
    ``1`` (each mHC mixing dot product on one block, x of a token on one block). H200 (D2, one
    mHC use, V4-Flash widths): batch 1 30.5 -> 23.4 us, batch 64 47.8 -> 43.6 us."""
    value = environ.get("OPENINFER_DSV4_HC_SPLIT", "auto")
    if value not in ("1", "auto"):
        raise ValueError(f"OPENINFER_DSV4_HC_SPLIT={value!r}: expected 1 or auto")
    return value


def hc_mix_splits(tokens: int, num_mix: int, multiprocessors: int) -> int:
    """Slices each mHC mixing dot product (hc·hidden long) is cut into for ``dsv4_hc_mix`` (grid
    (tokens, num_mix, this)): enough blocks to fill the GPU twice over (batch 1, 24 logits, 132
    SMs: 11), one slice once the tokens do."""
    wanted = -(-2 * multiprocessors // max(tokens * num_mix, 1))
    return max(1, min(wanted, MAX_MIX_SPLITS))


MAX_FP8_SPLITS = 16
FP8_STREAM_K = 128  # moe_fp4.cu: k per stream step
FP8_STREAM_TILE = 64  # moe_fp4.cu: weight rows and token rows per stream block


def fp8_linear_splits(rows: int, out_features: int, in_features: int, multiprocessors: int) -> int:
    """K splits of ``fp8_stream_linear`` (grid z): a narrow weight at a decode step fills few blocks
    (wq_a 1024×4096: 16), so split K until the blocks fill the GPU twice over, keeping at least two
    128-k steps per split; none past one 64-row block row. H200 (D2), wq_a at batch 1: 19.7 us
    unsplit, 8.5 us in 16 splits; at batch 64 unsplit (the rule then stopped at 16 rows): 74 us."""
    if rows > FP8_STREAM_TILE:
        return 1
    blocks = -(-out_features // FP8_STREAM_TILE) * -(-rows // FP8_STREAM_TILE)
    wanted = -(-2 * multiprocessors // blocks)
    steps = -(-in_features // FP8_STREAM_K)
    splits = max(1, min(wanted, steps // 2, MAX_FP8_SPLITS))
    per_split = -(-steps // splits)
    return -(-steps // per_split)  # no empty split: 12 steps in 5 would be 3 + 3 + 3 + 3 + 0


STREAM_STAGE_SETTINGS = ("2", "4")
STREAM_STAGES_MAX_CHUNKS = 2  # a 4-deep ring of 8·chunks staged rows fits 48 KB of shared memory up to 2 chunks


def stream_stages_setting(environ: Mapping[str, str]) -> str:
    """``OPENINFER_DSV4_STREAM_STAGES``: staged activation steps of the stream GEMMs (FP4 experts,
    FP8 linears): ``4`` (default: three steps of copies in flight, for passes of at most 16 rows)
    or ``2`` (the next step's rows copied while a step multiplies). Same bits either way. H200
    (D2, V4-Flash FP4 experts alone): batch 64 gate_up 937 -> 882 us, down 470 -> 446 us; batch 1
    gate_up 37.8 -> 36.4 us, down 18.3 -> 18.9 us."""
    value = environ.get("OPENINFER_DSV4_STREAM_STAGES", "4")
    if value not in STREAM_STAGE_SETTINGS:
        raise ValueError(f"OPENINFER_DSV4_STREAM_STAGES={value!r}: expected 2 or 4")
    return value


def stream_stages(setting: str, chunks: int) -> int:
    """The ring depth a stream GEMM launch compiles with (its ``STREAM_STAGES``)."""
    return 4 if setting == "4" and chunks <= STREAM_STAGES_MAX_CHUNKS else 2


FP8_LINEAR_SETTINGS = ("bf16", "stream")


def fp8_linear_setting(environ: Mapping[str, str]) -> str:
    """``OPENINFER_DSV4_FP8_LINEAR``: ``bf16`` (default: the checkpoint's FP8 dense linears —
    attention projections, shared experts — dequantised to bf16 at load, cuBLAS) or ``stream``
    (kept FP8, half the bytes: ``cuda_linears.fp8_linear``, the codes decoded to bf16 in registers
    for the tensor cores). Opt-in until measured on a GPU."""
    value = environ.get("OPENINFER_DSV4_FP8_LINEAR", "bf16")
    if value not in FP8_LINEAR_SETTINGS:
        raise ValueError(f"OPENINFER_DSV4_FP8_LINEAR={value!r}: expected one of {', '.join(FP8_LINEAR_SETTINGS)}")
    return value
