"""Which op runs which kernel, per phase — the index a newcomer reads first.

| op (model.py)            | numpy (CPU, fp32)          | cuda (bf16)                                         |
|--------------------------|----------------------------|-----------------------------------------------------|
| embedding                | fancy indexing             | embedding gather kernel                             |
| rms_norm / add_rms_norm  | NumPy                      | fused residual-add + RMSNorm kernel                 |
| linear: qkv, o, gate_up, | BLAS sgemm on pre-         | prefill / large batch: cuBLAS gemmEx (bf16, fp32    |
|   down, lm_head          | transposed [in, out] fp32  | accumulate); decode: skinny GEMM/GEMV kernels       |
| attention (prefill)      | per-sequence causal GQA    | q/k-norm + RoPE + KV-write kernel, then flash       |
|                          | over gathered paged KV     | attention over the paged KV (varlen, chunk-aware)   |
| attention (decode)       | same code path             | split-KV flash decoding on tensor cores: one block  |
|                          |                            | per (KV head, split) for all 4 query heads          |
|                          |                            | (decode_attention_mma.cu)                           |
| silu_mul                 | NumPy                      | SiLU·mul kernel                                     |
| decode rows (M = 1)      | —                          | OPENINFER_FUSED_DECODE=1: add+RMSNorm in the qkv /  |
|                          |                            | gate_up GEMV prologue, SiLU·mul in down-proj's      |
|                          |                            | (gemv.cu; off: slower on H200, benchmarks/GPU.md)   |
| sampling                 | openinfer.sampling (host)  | on-device sampler (argmax / top-k/p, min-p, seeds)  |

Decode steps on cuda replay a CUDA graph captured per batch-size bucket (openinfer.graph).
Measured per op, per (batch, context): ``ledger.md`` / ``ledger.json`` beside this file
(``python -m openinfer.tools.ledger``).
"""

PLAN = {
    "prefill": ["embedding", "rms_norm", "linear(qkv)", "attention(prefill)", "linear(o_proj)",
                "add_rms_norm", "linear(gate_up)", "silu_mul", "linear(down)", "gather_rows",
                "add_rms_norm", "linear(lm_head)", "sample"],
    "decode": ["embedding", "rms_norm", "linear(qkv)", "attention(decode)", "linear(o_proj)",
               "add_rms_norm", "linear(gate_up)", "silu_mul", "linear(down)", "gather_rows",
               "add_rms_norm", "linear(lm_head)", "sample"],
}
