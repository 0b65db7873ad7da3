"""Which kernel runs each Qwen3.5 op, per phase and backend — read this first.

A step is *prefill* when a sequence brings more than one new token (a prompt or a chunk of
one), *decode* when it brings exactly one; a *mixed* step holds both kinds, and each sequence
takes its own row of the table (decode sequences are batched together, prefill sequences run
one by one because the chunked delta rule is per sequence).

=====================  ===========================  ====================================  =======
op                     prefill                      decode                                backend
=====================  ===========================  ====================================  =======
embedding / norms      core ``embedding``,          same                                  core
                       ``rms_norm``, ``add_rms_norm``
projections            core ``linear`` (BLAS/cuBLAS) same                                  core
full attention         core ``attention`` (q/k norm same, one query per sequence           core
                       + partial RoPE + paged KV)
attention gate         ``sigmoid_mul``              same                                  plugin
GDN conv1d + SiLU      ``causal_conv1d``            ``causal_conv1d_step``                plugin
GDN delta rule         ``chunk_gated_delta_rule``   ``recurrent_gated_delta_rule_step``   plugin
                       (UT transform, chunk 64)     (batched over sequences)
GDN output norm        ``gated_rms_norm``           same                                  plugin
MLP                    core ``silu_mul``            same                                  core
=====================  ===========================  ====================================  =======

Only the NumPy implementations exist so far (``gated_deltanet``); a CUDA plan adds kernels
with the same signatures and is selected here by backend name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer.errors import BackendUnavailableError
from openinfer_qwen35 import gated_deltanet


def sigmoid_mul(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``x · sigmoid(gate)`` (the output gate of Qwen3.5's full attention)."""
    return x / (1.0 + np.exp(-gate))


@dataclass(frozen=True)
class KernelPlan:
    backend: str
    sigmoid_mul: Callable[..., Any]
    causal_conv1d: Callable[..., Any]  # prefill: one sequence
    causal_conv1d_step: Callable[..., Any]  # decode: a batch of sequences
    chunk_gated_delta_rule: Callable[..., Any]
    recurrent_gated_delta_rule_step: Callable[..., Any]
    gated_rms_norm: Callable[..., Any]


NUMPY_PLAN = KernelPlan(
    backend="numpy",
    sigmoid_mul=sigmoid_mul,
    causal_conv1d=gated_deltanet.causal_conv1d,
    causal_conv1d_step=gated_deltanet.causal_conv1d_step,
    chunk_gated_delta_rule=gated_deltanet.chunk_gated_delta_rule,
    recurrent_gated_delta_rule_step=gated_deltanet.recurrent_gated_delta_rule_step,
    gated_rms_norm=gated_deltanet.gated_rms_norm,
)

PLANS = {"numpy": NUMPY_PLAN}


def plan_for(backend: Any) -> KernelPlan:
    plan = PLANS.get(backend.name)
    if plan is None:
        raise BackendUnavailableError(
            f"openinfer-qwen35 has no kernels for the {backend.name!r} backend yet "
            f"(available: {', '.join(PLANS)}); run with --device cpu")
    return plan
