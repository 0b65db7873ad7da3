"""Which code runs each DeepSeek-V4 op, per phase and backend — read this first.

A step is *prefill* when a sequence brings more than one new token (a prompt or a chunk of one),
*decode* when it brings one; a *mixed* step holds both. The model runs one path for all three:
every op takes the step's flattened tokens, attention works sequence by sequence.

=======================  ======================================  =====================================
op                       NumPy (the reference; what serves now)  CUDA kernel (``kernels/dsv4.cu``)
=======================  ======================================  =====================================
embedding, norms         core ``embedding`` / ``rms_norm``       core kernels
projections (BF16/F32)   core ``linear`` (BLAS)                  core ``linear`` (cuBLAS)
FP8 linears (e4m3,       dequantised to fp32 at load             ``dsv4_fp8_linear`` (e8m0 128×128
  e8m0 blocks)           (``openinfer.quant``)                   blocks decoded in registers)
FP4 experts (e2m1,       dequantised to fp32 at load             ``dsv4_fp4_linear`` (e8m0 per 32)
  e8m0 per 32)
mHC collapse + Sinkhorn  ``hyper_connection.collapse``           ``dsv4_hc_collapse`` (one block per
                                                                 token: rms, 24 mixes, Sinkhorn, Σ pre·H)
mHC expand               ``hyper_connection.expand``             ``dsv4_hc_expand``
mHC head                 ``hyper_connection.collapse_head``      ``dsv4_hc_collapse`` (head=1)
q / kv norms + RoPE      ``attention.attention`` (interleaved    (core rms_norm; RoPE inside the
                         pairs, last rope_dim channels)          consumers below)
compressor pooling       ``attention.compress`` (slots with the  ``dsv4_compress_entries`` (softmax
                         CSA overlap) → ``pool_entries``         over slots, RMSNorm, RoPE, paged write)
indexer scores           ``attention.index_scores``              ``dsv4_indexer_scores``
indexer top-k            ``attention.top_k_visible``             ``dsv4_topk`` (radix select)
sparse attention         ``attention.attend`` (window + picked   ``dsv4_sparse_attention`` (online
  + sinks + RoPE⁻¹       / all entries, K = V)                   softmax seeded with the sink)
grouped output proj.     einsum over ``wo_a`` groups + ``wo_b``  cuBLAS strided-batched + GEMM
MoE routing              core ``openinfer.moe.route``            core ``moe.cu`` routing (hash /
  (sqrt-softplus, hash)                                          sqrt-softplus)
MoE experts              core ``run_experts`` (per expert        core ``moe.cu`` grouped GEMM (bf16 /
                         GEMMs, clamped SwiGLU)                  FP8 blocks) still lacks an FP4 weight
                                                                 format and the swiglu clamp: until
                                                                 then ``dsv4_fp4_linear`` per expert
=======================  ======================================  =====================================

Caches (``state.kv_cache_specs``): the sliding window, the compressed entries and the indexer's
keys are paged (block tables per KV cache group); each compressor's open window is a state slot.

Status: the NumPy column is the whole model and what the plugin serves (``device=cpu``). The CUDA
kernels are written, compile for sm_90 and pass the CPU emulation tests against the NumPy ops
(``tests/plugins/deepseek_v4/test_dsv4_cuda_emulated.py``), and have CuPy launchers
(``cuda_ops``) with ``gpu`` tests; the CUDA model forward that strings them together (and decode
graphs) is not written yet, so ``device=cuda`` is refused with a clear error.
"""

from __future__ import annotations

SUPPORTED_BACKENDS = ("numpy", "cuda")
