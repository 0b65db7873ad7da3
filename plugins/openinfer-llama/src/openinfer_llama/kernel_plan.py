"""Which op runs which kernel, per phase — the index a newcomer reads first.

| op (openinfer.DecoderLayer)  | numpy (CPU, fp32)              | cuda (bf16)                                  |
|------------------------------|--------------------------------|----------------------------------------------|
| embedding                    | fancy indexing                 | embedding gather kernel                      |
| rms_norm / add_rms_norm      | NumPy, fused residual add      | fused residual-add + RMSNorm kernel          |
| linear: qkv, o_proj,         | BLAS sgemm on pre-transposed   | prefill / large batch: cuBLAS gemmEx (bf16,  |
|   gate_up, down, lm_head     | contiguous [in, out] fp32      | fp32 accumulate); decode: skinny GEMM/GEMV   |
| attention (prefill)          | RoPE + KV write, per-sequence  | RoPE + KV-write kernel, then flash attention |
|                              | causal GQA over the paged KV   | over the paged KV (varlen, chunk-aware)      |
| attention (decode)           | same code path, one query row  | split-KV flash decoding on tensor cores      |
|                              |                                | (decode_attention_mma.cu; head_dim 32 and    |
|                              |                                | groups > 16: decode_attention.cu)            |
| silu_mul                     | NumPy                          | SiLU·mul kernel                              |
| sampling                     | openinfer sampler (host)       | on-device sampler                            |

Llama differs from the shared decoder only in what it leaves out: no q/k norm (``AttentionSpec``
gets none), biases only when ``attention_bias`` / ``mlp_bias`` say so, and RoPE tables that
carry the ``llama3`` frequency scaling, so no op needs a Llama-specific kernel.
"""

from __future__ import annotations

LAYER = ["rms_norm | add_rms_norm", "linear(qkv)", "attention", "linear(o_proj)", "add_rms_norm",
         "linear(gate_up)", "silu_mul", "linear(down)"]
HEAD = ["gather_rows(logits_rows)", "add_rms_norm(final)", "linear(lm_head)", "sample"]

PLAN: dict[str, list[str]] = {
    "prefill": ["embedding", *LAYER, *HEAD],
    "decode": ["embedding", *LAYER, *HEAD],
    "mixed": ["embedding", *LAYER, *HEAD],
}
