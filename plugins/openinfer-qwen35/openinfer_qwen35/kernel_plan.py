"""Which kernel runs each Qwen3.5 op, per phase and backend — read this first.

A step is *prefill* when a sequence brings more than one new token (a prompt or a chunk of
one), *decode* when it brings exactly one; a *mixed* step holds both kinds.

=====================  ==============================  ==============================  =======
op                     prefill                         decode                          from
=====================  ==============================  ==============================  =======
embedding              core ``embedding``              same                            core
layer / final norms    numpy: core ``rms_norm``,       same                            core /
                       ``add_rms_norm``; cuda:                                         plugin
                       ``zero_centred_(add_)rms_norm``
                       (fp32 1 + w, one rounding)
projections            core ``linear`` (BLAS/cuBLAS)   same                            core
full attention         core ``attention`` (q/k norm    same, one query per sequence    core
                       + partial RoPE + paged KV)
attention gate         ``sigmoid_mul``                 same                            plugin
GDN layer core         ``delta_net``:                                                  plugin
  numpy                conv1d + chunked delta rule     conv1d step + recurrent step
                       (UT transform, chunk 64), one   (batched over sequences)
                       sequence at a time
  cuda                 ``gdn_conv1d`` (varlen) →       ``gdn_decode_step``: conv,
                       ``gdn_conv_state`` →            window, gates, l2 norm, delta
                       ``gdn_chunk_prepare`` (per      rule and gated norm in one
                       chunk of 64: l2 norm, gates,    kernel per (sequence, value
                       P, T = (I + A)^-1, U, W) →      head), captured in the
                       ``gdn_chunk_scan`` (chunks in   decode graphs
                       order, S in shared memory,
                       tensor cores) →
                       ``gdn_gated_norm``; rows
                       shorter than 8: the token-by-
                       token ``gdn_delta_rule``
MLP                    core ``silu_mul``               same                            core
=====================  ==============================  ==============================  =======

Opt-in variants, the same bits (``cuda_ops``): ``OPENINFER_QWEN35_GDN_DECODE=split32|split64``
(a head's state columns over several blocks) and ``OPENINFER_QWEN35_GDN_PREFILL=staged|split``
(``gdn_conv1d_vec``, ``gdn_chunk_prepare_staged``, ``gdn_gated_norm_warp``; ``split``: ``gdn_chunk_scan`` as
``gdn_chunk_states`` + ``gdn_chunk_output``); ``split_rows``: that, and a mixed step's
one-token rows token by token (``gdn_delta_rule_rows``; within bf16 tolerance).

``delta_net`` takes the fused projection ``[T, q|k|v|z|b|a]`` and returns the gated-normed
``[T, nv·dv]`` for ``out_proj``; NumPy lives in ``gated_deltanet``, CUDA in ``cuda_ops``
(kernels in ``kernels/*.cu``). ``OPENINFER_QWEN35_GDN_KERNELS=recurrent`` runs the earlier
CUDA kernels instead (token-by-token prefill, four decode kernels): the benchmarks' baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer.errors import BackendUnavailableError
from openinfer_qwen35 import gated_deltanet
from openinfer_qwen35.state import host_step_sequences


def sigmoid_mul(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``x · sigmoid(gate)`` (the output gate of Qwen3.5's full attention)."""
    with np.errstate(over="ignore"):  # exp(-gate) = inf for gate << 0 gives the right limit, 0
        return x / (1.0 + np.exp(-gate))


@dataclass(frozen=True)
class KernelPlan:
    backend: str
    sigmoid_mul: Callable[..., Any]
    delta_net: Callable[..., Any]  # (proj, weights, conv_state, ssm_state, StepSequences, config)
    fp32_vector: Callable[[np.ndarray], Any]  # small per-head parameters kept in fp32 (A, dt_bias)
    conv_state_dtype: str  # KV cache dtype name of the conv window in the state slots
    # the step's StepSequences from the (device) batch: slots from batch.state_slots
    step_sequences: Callable[..., Any] = host_step_sequences
    # Qwen3.5's zero-centred RMSNorm (weights stored as 1 + w); None: the backend's rms_norm /
    # add_rms_norm with ``backend.weight`` (exact on numpy, fp32 throughout)
    rms_norm: Callable[..., Any] | None = None
    add_rms_norm: Callable[..., Any] | None = None
    norm_weight: Callable[[np.ndarray], Any] | None = None
    # compile kernels / allocate fixed buffers for a config, before any CUDA graph capture
    warm_up: Callable[[Any], None] | None = None


NUMPY_PLAN = KernelPlan(
    backend="numpy",
    sigmoid_mul=sigmoid_mul,
    delta_net=gated_deltanet.delta_net,
    fp32_vector=lambda array: np.ascontiguousarray(array, dtype=np.float32),
    conv_state_dtype="float32",
)


def plan_for(backend: Any) -> KernelPlan:
    if backend.name == "numpy":
        return NUMPY_PLAN
    if backend.name == "cuda":
        from openinfer_qwen35 import cuda_ops

        return cuda_ops.CUDA_PLAN
    raise BackendUnavailableError(
        f"openinfer-qwen35 has no kernels for the {backend.name!r} backend (available: numpy, cuda)")
