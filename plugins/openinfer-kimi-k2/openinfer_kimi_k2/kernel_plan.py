"""Which kernel runs each Kimi-K2 / DeepSeek-V3 op, per phase and backend — read this first.

A step is *prefill* when a sequence brings more than one new token (a prompt or a chunk of
one), *decode* when it brings exactly one; a *mixed* step holds both kinds (each sequence
takes its own path).

=====================  ================================  ================================  =======
op                     prefill                           decode                            from
=====================  ================================  ================================  =======
embedding              core ``embedding``                same                              core
norms                  core ``rms_norm`` / ``add_rms_    same                              core
                       norm``
q_a + kv_a (fused)     core ``linear``                   same                              core
q_b, o_proj            core ``linear``                   same                              core
RoPE (q_pe, k_pe)      ``mla.rotate_half_rope`` on the   same                              core
                       de-interleaved rope dims
MLA attention          ``mla.mla_naive``: expand the     ``mla.mla_absorbed``: W_UK into   core
                       context's latents per head        q, attend over 576-wide latents,
                                                         W_UV after the weighted sum
dense MLP              core ``linear`` + ``silu_mul``    same                              core
MoE router             ``moe.route`` (fp32, host)        same                              core
routed experts         ``moe.run_experts``: tokens       same                              core
                       grouped by expert, one GEMM per
                       active expert, scatter-add
shared experts         core ``linear`` + ``silu_mul``    same                              core
=====================  ================================  ================================  =======

CUDA (``cuda_ops``, kernels in core ``kernels/mla.cu`` and ``kernels/moe.cu``), bf16; a sequence
is *long* when its step brings at least ``PREFILL_MIN_QUERY`` (16) tokens:

=====================  ================================================================  =======
op                     prefill, decode and mixed steps                                   from
=====================  ================================================================  =======
projections            bf16: cuBLAS / gemv (core ``linear``); FP8 block-scaled or INT4   core
                       checkpoints stay quantized: a decode GEMV for few rows (weights
                       read once from their stored format; FP8 ``moe_gemv_wide`` up to
                       4 rows, then ``moe_gemv`` to 7; INT4 ``moe_gemv`` to 8), else
                       ``moe_dequantize`` to a bf16 scratch + cuBLAS (core ``moe.
                       choose_gemv``; ``OPENINFER_MOE_GEMV`` forces a kernel). bf16
                       q_b and shared-expert down: core ``add_rms_norm_linear`` /
                       ``silu_mul_linear`` (one launch per decode row under
                       ``OPENINFER_FUSED_DECODE``, else the two ops)
latent write + RoPE    ``mla_write_latent_q_pe`` (RMS-norm c_kv, rotate k_pe → cache     core
                       slot; every head's rotated q_pe into a buffer of its own: q is
                       read where the projection wrote it, no copy; ``OPENINFER_MLA_
                       Q_VIEW=0``: copy q and ``mla_write_latent`` rotates it in place;
                       ``OPENINFER_MLA_FUSED_WRITE=1``: folded into the TMA attention)
MLA, long sequences    decompressed: ``mla_gather_context``, kv_b by cuBLAS into         core
                       per-head k_nope / v, on Hopper ``mla_prefill_attention_sm90``
                       (wgmma, TMA producer, two ping-pong consumer warpgroups, split
                       K/V stages), elsewhere ``mla_prefill_attention_pipelined``
                       (mma.sync; ``OPENINFER_MLA_PREFILL=pipelined`` / ``=plain``)
MLA, other tokens      absorbed: W_UK (over q's row stride) / W_UV by cuBLAS strided-       core
                       batched GEMMs over heads
                       around ``mla_attention_mma_shared`` (tensor cores, <= 16 heads,
                       1 row; from 2 rows on Hopper ``mla_attention_tma``: TMA latent
                       rows, balanced splits; 17-64 heads too), off Hopper
                       ``mla_attention_mma`` (17-64 heads) or ``mla_attention`` (CUDA
                       cores, 16 heads per block); splits combined by
                       ``mla_combine_splits_flat`` (<= 4) or ``_wide`` (core
                       ``mla.choose_absorbed_kernel``; ``OPENINFER_MLA_DECODE``
                       forces one)
MoE router             ``moe_route`` (fp32 logits, scores, bias, group-limited top-k;    core
                       from 1,024 tokens the logits on tensor cores,
                       ``moe_routing.cu``)
token grouping         ``moe_sort_parallel`` (counts, segments, GEMM tile list; one      core
                       block-wide scan; ``OPENINFER_MOE_FAST_ROUTING=0``:
                       ``moe_sort``), at 1-token steps ``moe_route_sort``: top-k and
                       grouping in one block (``OPENINFER_MOE_ROUTE_SORT=0`` / ``=1``:
                       never / up to 64 tokens)
routed experts         x2 (gate_up gathering token rows; down) + core ``silu_mul``;      core
                       weights bf16 / INT4 / FP8 as stored: a decode GEMV while the
                       slots average few per expert (INT4, group-32 weights repacked at
                       upload into the GEMV's tiled layout: ``moe_gemv_int4_tiled``, 1
                       n-tile, streaming loads, rotated walks, to 11;
                       ``OPENINFER_INT4_LAYOUT=rows``: ``moe_gemv_mma_staged``; bf16:
                       ``moe_gemv_wide_nc`` to 1.5, SiLU·mul in its epilogue; FP8:
                       ``moe_gemv`` to 3),
                       else bf16 on Hopper: ``moe_grouped_gemm_sm90`` (persistent
                       wgmma, TMA weight tiles, gate_up with SiLU·mul fused; 64-slot x
                       128-row tiles, two CTAs per SM, up to 24 slots per expert;
                       ``OPENINFER_MOE_SM90=0``: off; down starts in gate_up's last
                       wave, ``OPENINFER_MOE_SM90_PDL=0``: off), elsewhere
                       ``moe_grouped_gemm_pipelined`` (SiLU·mul fused) and cuBLAS per
                       expert for eager steps from 512 slots per expert; INT4 / FP8:
                       ``moe_grouped_gemm``; ``OPENINFER_MOE_GEMV`` forces a decode
                       GEMV
shared experts         bf16 experts all on one rank: S more experts of the routed        core
                       stacks, every token routed to them with weight 1
                       (``OPENINFER_MOE_SHARED_FUSED=0``: off); else core ``linear`` +
                       ``silu_mul_linear``, run by ``moe_forward``: for steps of up to
                       16 tokens on a side stream beside the routing and the routed
                       experts, joined before the combine (same bits;
                       ``OPENINFER_MOE_SHARED_OVERLAP=1`` / ``=0``: always / never)
combine                ``moe_combine`` (fixed slot order, + shared experts); from 256    core
                       tokens ``moe_combine_vec8`` (8 columns a thread, the same bits)
=====================  ================================================================  =======

On NumPy, quantized checkpoints are dequantized to fp32 at load (``openinfer.quant``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer import Backend
from openinfer.errors import BackendUnavailableError
from openinfer.mla import MLASpec, mla_attention, rotate_half_rope
from openinfer.moe import moe_forward


@dataclass(frozen=True)
class KernelPlan:
    backend: str
    # (ops, h, attention weights, kv layer, batch, spec, rope, eps) -> [T, H·v] before o_proj
    attention: Callable[..., Any]
    moe: Callable[..., Any]  # (ops, h, MoEWeights, batch) -> [T, hidden]
    linear: Callable[..., Any]  # (ops, x, weight) -> x @ weight^T
    builder: Callable[..., Any] | None = None  # LinearBuilder subclass for load_weights; None: fp32 reference
    prepare: Callable[..., None] = lambda weights, ops: None  # once after loading (device-side tables)
    # (ops, layer MLP weights) -> a handle for ``join_prefetch`` or None: started before a layer's attention
    # (cuda: OPENINFER_MOE_L2_PREFETCH pulls the shared experts into L2 meanwhile); a hint, numbers unchanged
    start_prefetch: Callable[..., Any] = lambda ops, mlp: None
    join_prefetch: Callable[[Any], None] = lambda handle: None  # after the layer's MLP
    # (ops, h, MoEWeights, batch, residual, next layer's input norm, eps) -> (h, residual) of that norm with the
    # MoE's output, fused (cuda: OPENINFER_MOE_COMBINE_NORM), or None: run ``moe`` and the norm apart
    moe_add_norm: Callable[..., Any] = lambda ops, h, layer, batch, residual, norm, eps: None


def numpy_attention(ops: Any, qkv_a: np.ndarray, w: Any, kv: Any, batch: Any, spec: MLASpec, rope: Any,
                    q_lora_rank: int | None, eps: float) -> np.ndarray:
    """Reference MLA: RoPE on q_pe and k_pe, then ``openinfer.mla.mla_attention`` (naive for
    prefill chunks, absorbed for decode)."""
    num_tokens = qkv_a.shape[0]
    cos, sin = rope.cos[batch.positions], rope.sin[batch.positions]
    if q_lora_rank:
        q = ops.linear(ops.rms_norm(qkv_a[:, :q_lora_rank], w.q_a_norm, eps), w.q_b)
        latent = qkv_a[:, q_lora_rank:]
    else:
        q, latent = qkv_a[:, : -spec.latent_dim], qkv_a[:, -spec.latent_dim:]
    q = q.reshape(num_tokens, spec.num_heads, spec.qk_head_dim)
    q = np.concatenate([q[..., : spec.qk_nope_dim], rotate_half_rope(q[..., spec.qk_nope_dim:], cos, sin)], -1)
    c_kv = ops.rms_norm(latent[:, : spec.kv_lora_rank], w.kv_a_norm, eps)
    k_pe = rotate_half_rope(latent[:, None, spec.kv_lora_rank:], cos, sin)[:, 0]
    cache = kv.k.reshape(kv.k.shape[0], kv.k.shape[1], spec.latent_dim)
    return mla_attention(q, np.concatenate([c_kv, k_pe], axis=-1), cache, w.mla, spec, batch)


NUMPY_PLAN = KernelPlan(
    backend="numpy",
    attention=numpy_attention,
    moe=lambda ops, h, layer, batch: moe_forward(ops, h, layer, batch.token_ids),
    linear=lambda ops, x, weight: ops.linear(x, weight),
)


def plan_for(backend: Backend) -> KernelPlan:
    if backend.name == "numpy":
        return NUMPY_PLAN
    if backend.name == "cuda":
        from openinfer_kimi_k2 import cuda_ops

        return cuda_ops.CUDA_PLAN
    raise BackendUnavailableError(
        f"openinfer-kimi-k2 has no kernels for the {backend.name!r} backend (available: numpy, cuda)")
