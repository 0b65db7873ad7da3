"""Which kernel runs each Qwen3.5 op, per phase and backend — read this first.

A step is *prefill* when a sequence brings more than one new token (a prompt or a chunk of
one), *decode* when it brings exactly one; a *mixed* step holds both kinds.

=====================  ==============================  ==============================  =======
op                     prefill                         decode                          from
=====================  ==============================  ==============================  =======
embedding              core ``embedding``              same                            core
layer / final norms    numpy: core ``rms_norm``,       same                            core /
                       ``add_rms_norm``; cuda:                                         plugin
                       ``zero_centred_rms_norm``,
                       ``zero_centred_add_rms_norm``
                       (fp32 1 + w, one rounding)
projections            core ``linear`` (BLAS/cuBLAS)   same                            core
full attention         core ``attention`` (q/k norm    same, one query per sequence    core
                       + partial RoPE + paged KV)
attention gate         ``sigmoid_mul``                 same                            plugin
GDN layer core         ``delta_net``:                                                  plugin
  numpy                conv1d + chunked delta rule     conv1d step + recurrent step
                       (UT transform, chunk 64), one   (batched over sequences)
                       sequence at a time
  cuda                 ``gdn_conv1d_vec`` (varlen) →   ``gdn_decode_step_vec4``:
                       ``gdn_conv_state`` →            conv, window, gates, l2 norm,
                       ``gdn_chunk_prepare_grouped_``  delta rule (fp32 state by
                       ``mma`` (per chunk of 64 and    16-byte accesses) and gated
                       key head: l2 norm, gates, P,    norm in one kernel per
                       T = (I + A)^-1 by 16 x 16       (sequence, value head),
                       blocks on tensor cores, U,
                       W) →
                       ``gdn_chunk_states_registers``  captured in the decode graphs
                       (chunks in order: S, V'; S in
                       mma registers; small steps:
                       ``gdn_chunk_states``) →
                       ``gdn_chunk_output_staged``
                       (O, all chunks at once;
                       tensor cores)
                       → ``gdn_gated_norm_vec``; a
                       mixed step's one-token rows:
                       ``gdn_delta_rule_rows``; rows
                       shorter than 8: the token-by-
                       token ``gdn_delta_rule``
MLP                    core ``silu_mul``               same                            core
=====================  ==============================  ==============================  =======

The cuda prefill column is ``OPENINFER_QWEN35_GDN_PREFILL=grouped_staged``, the default until
2026-11-25; the default now is ``chunked_split_f16`` (``gdn_chunked_split.cu``: the same chunk
algorithm with split fp16 hi / lo operands, teacher-forced 0.0071 / 0.0306 vs HF where
``grouped_staged`` gives 0.0173 / 0.0590; ``cuda_ops.PREFILL_KERNELS`` names each choice's kernels,
and ``=grouped_staged`` is the faster, less accurate opt-out): ``plain`` is the earlier chunked path
(``gdn_conv1d`` → ``gdn_conv_state`` → ``gdn_chunk_prepare`` → ``gdn_chunk_scan``, chunks in order
with O computed on the way → ``gdn_gated_norm``; a mixed step's one-token rows as one-row chunks);
``staged`` and ``split`` are the steps between (the same bits as plain); ``split_rows`` differs from
them only in a mixed step's one-token rows (token by token, within bf16 tolerance); ``blocked`` is
``split_rows`` with the triangular solve by 16 x 16 blocks (within bf16 tolerance); ``registers``
is ``blocked`` with the chunk walk's state in mma accumulator registers (blocked's bits); ``fused``
that with the gated norm inside the output kernel (opt-in); ``grouped_staged`` (the default from E1
2026-11-24, session 8, to 2026-11-25) is ``registers`` with ``gdn_chunk_prepare_grouped_mma`` (a prepare block per
chunk and key head, the triangular solve's block products on tensor cores; bf16 tolerance),
``gdn_chunk_output_staged`` (a block's operands loaded at once; gdn_chunk_output's bits) and
``gdn_gated_norm_vec``; ``grouped``, ``grouped_mma``, ``grouped_conv``, ``grouped_out`` are its opt-in
steps and variants. The decode
column is ``OPENINFER_QWEN35_GDN_DECODE=vec4``, the default (``cuda_ops.DECODE_KERNELS``).

A prefill step that snapshots a sequence's state at a block boundary inside its rows (the prefix
cache, ``batch.state_snapshots``): with ``OPENINFER_QWEN35_SNAPSHOT_EMIT=1`` (the default) the cuda
chunked path cuts that sequence's chunks at the boundary, ``gdn_chunk_states{,_registers}_snapshot``
store the fp32 state entering the chunk there into the snapshot slot and ``gdn_conv_snapshot`` the
conv window (``KernelPlan.writes_snapshots``); otherwise (and on numpy) the model runs each GDN
layer in two parts around the boundary (``state.split_at_snapshots``).

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
    # begin building a config's kernels in the background (before the weights load; warm_up waits)
    start_builds: Callable[[Any], int] | None = None
    # a step's host ``state.SnapshotSplit`` with its arrays on the device (None: host arrays serve)
    prepare_split: Callable[[Any], Any] | None = None
    # (tensors, ((src, dst), ...)): state rows copied between slots; None: indexed assignment
    copy_state_rows: Callable[[Any, Any], None] | None = None
    # (StepSequences, config) -> whether ``delta_net`` writes the step's in-step snapshots
    # (``seqs.snapshots``) itself in the layer's one run; None / False: the model splits the layer's
    # core around each boundary (``state.split_at_snapshots``)
    writes_snapshots: Callable[[Any, Any], bool] | None = None


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
