"""Which code runs each DeepSeek-V4 op, per phase and backend — read this first.

A step is *prefill* when a sequence brings more than one new token (a prompt or a chunk of one),
*decode* when it brings one; a *mixed* step holds both. The model runs one path for all three:
every op takes the step's flattened tokens (NumPy attention works sequence by sequence).

=======================  ======================================  =====================================
op                       NumPy (the reference)                   CUDA (``cuda_model.CudaForward``)
=======================  ======================================  =====================================
embedding, norms         core ``embedding`` / ``rms_norm``       core kernels
projections              core ``linear`` (BLAS; FP8 linears      core ``linear`` (cuBLAS, bf16: FP8
                         dequantised to fp32 at load)            linears dequantised to bf16 at load)
mHC collapse + Sinkhorn  ``hyper_connection.collapse``           ``dsv4_hc_mix`` (a block per token and
                                                                 mixing logit) + ``dsv4_hc_collapse``
mHC expand / head        ``expand`` / ``collapse_head``          ``dsv4_hc_expand`` / the same two, head
q / kv head norms, RoPE  ``attention.attention``                 ``dsv4_head_norm_rope``
sliding-window write     ``SequenceLayerCache.write_keys``       ``dsv4_write_window``
compressor (entries +    ``attention.compress`` per sequence     ``dsv4_compress_step`` (entries of the
  open windows)                                                  windows that close) +
                                                                 ``dsv4_compress_state`` (state slots)
indexer scores / top-k   ``index_scores`` / ``top_k_visible``    ``dsv4_indexer_scores`` / ``dsv4_topk``
sparse attention         ``attention.attend`` (window + picked   ``dsv4_sparse_attention`` (a warp per
  + sinks + RoPE⁻¹       / all entries, K = V)                   head, keys shared in shared memory;
                                                                 opt-in split over keys +
                                                                 ``dsv4_attention_combine``)
grouped output proj.     einsum over ``wo_a`` groups + ``wo_b``  one cuBLAS strided-batched GEMM + GEMM
MoE routing              core ``openinfer.moe.route``            core ``moe.cu`` ``moe_route`` (hash /
  (sqrt-softplus, hash)                                          sqrt-softplus, on the device)
MoE experts              core ``run_experts`` (per expert        ``cuda_experts``: FP4 → core
                         GEMMs, clamped SwiGLU)                  ``moe_fp4.cu`` (``moe_fp4_stream_gemm``
                                                                 for ≤ 256 tokens, else the tiled
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
reference within the bf16 noise (``tests/plugins/deepseek_v4/test_dsv4_cuda_model.py``, H100);
speed (``benchmarks/gpu_dsv4_kernels.py``, H100) was 5–11 % of the HBM roofline per layer before
the FP4 stream GEMM, the tiled FP4 GEMM taking most of a step; the new kernels await a GPU run.
"""

from __future__ import annotations

SUPPORTED_BACKENDS = ("numpy", "cuda")
