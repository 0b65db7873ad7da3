"""Gated DeltaNet in NumPy fp32: the causal conv, the chunked delta-rule prefill (chunk 64),
the recurrent decode step and the gated RMSNorm — the reference the CUDA kernels are tested
against.

One token's path through a linear-attention layer (``nk`` key heads, ``nv`` value heads,
``nv`` a multiple of ``nk``; value head ``h`` reads key head ``h // (nv // nk)``)::

    x ─ in_proj ─┬─ [q | k | v] ─ causal depthwise conv1d (kernel K) ─ SiLU ─┐
                 ├─ z                                                     │
                 ├─ b ─ sigmoid ─────────────────────────────── beta      │
                 └─ a ─ g = -exp(A_log) · softplus(a + dt_bias)           │
                                                                          ▼
        q, k: l2-normalised (q also × dk^-½); delta rule per value head h:
            S ← exp(g) · S
            S ← S + k ⊗ beta · (v - Sᵀk)          S: [dk, dv] fp32
            o = Sᵀ q
        o ─ RMSNorm(o) · w · silu(z) ─ out_proj ─ y

Per-request recurrent state (one state slot per request, see ``openinfer.kv.state_slots``)::

    conv_state [num_slots, K - 1, conv_dim]    the last K-1 conv inputs, oldest first
    ssm_state  [num_slots, nv, dk, dv] fp32     the delta-rule matrix S of each value head

``delta_net`` at the bottom runs a whole step's layer core (all sequences, any mix of prefill
and decode) on these pieces. The chunked algorithm (prefill) is exact: it folds C = 64
sequential updates into a unit lower-triangular solve (the UT transform) and a few matmuls per
chunk, and carries ``S`` between chunks, so a prompt split at any point gives the same state
as one pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from openinfer_qwen35.config import Qwen35Config
    from openinfer_qwen35.state import StepSequences
    from openinfer_qwen35.weights import DeltaNetWeights

CHUNK_SIZE = 64
L2_NORM_EPS = 1e-6


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives the right limit, 0
        return x / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (threshold 20: linear above it)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def l2_normalize(x: np.ndarray, eps: float = L2_NORM_EPS) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


# --- causal depthwise conv1d -------------------------------------------------------------------


def causal_conv1d(x: np.ndarray, weight: np.ndarray, conv_state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU over one sequence's new tokens.

    ``x [L, C]`` new inputs, ``weight [C, K]``, ``conv_state [K-1, C]`` the previous inputs
    (zeros at the start of a request). Returns ``(out [L, C], new_state [K-1, C])``.
    """
    width = weight.shape[1]
    window = np.concatenate([conv_state, x], axis=0)  # [K-1+L, C]
    length = x.shape[0]
    out = np.zeros_like(x)
    for j in range(width):  # out[t] = sum_j w[:, j] * window[t + j]
        out += window[j : j + length] * weight[:, j]
    return silu(out), window[window.shape[0] - (width - 1) :].copy()


def causal_conv1d_step(x: np.ndarray, weight: np.ndarray, conv_states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One decode token per sequence: ``x [B, C]``, ``conv_states [B, K-1, C]``."""
    window = np.concatenate([conv_states, x[:, None, :]], axis=1)  # [B, K, C]
    out = np.einsum("bkc,ck->bc", window, weight)
    return silu(out), window[:, 1:].copy()


# --- the gated delta rule ----------------------------------------------------------------------


def chunk_layout(query_start: np.ndarray, chunk_size: int = CHUNK_SIZE, seq_ids: np.ndarray | None = None,
                 cuts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chunks of a step's sequences (rows ``query_start[s]:query_start[s+1]``), as the CUDA
    chunked prefill walks them: ``(chunk_start [N], chunk_len [N], seq_chunks [B+1])`` int32 —
    each sequence's tokens cut into chunks of ``chunk_size`` from its first row (the last one
    shorter), sequence s owning chunks ``seq_chunks[s]:seq_chunks[s+1]``. With ``seq_ids``, only
    those sequences, in that order (``seq_chunks`` then indexes ``seq_ids``). ``cuts``: per
    sequence (of ``seq_ids`` when given), rows before a boundary where a chunk must start (0: none):
    its chunks run from its first row to the boundary, then from the boundary on — the layout of a
    run stopping there and one continuing, so the state entering chunk ``seq_chunks[s] +
    ceil(cut / chunk_size)`` is the state at the boundary (a prefix-cache snapshot's)."""
    query_start = np.asarray(query_start, np.int64)
    ids = np.arange(len(query_start) - 1) if seq_ids is None else np.asarray(seq_ids, np.int64)
    firsts, ends = query_start[ids], query_start[ids + 1]
    if cuts is None:
        piece_first, piece_end, pieces = firsts, ends, 1
    else:  # each sequence as two pieces: up to the boundary (empty when no cut), then from it
        mids = firsts + np.asarray(cuts, np.int64)
        piece_first, piece_end, pieces = np.stack([firsts, mids], 1).ravel(), np.stack([mids, ends], 1).ravel(), 2
    piece_counts = -(-(piece_end - piece_first) // chunk_size)
    counts = piece_counts.reshape(-1, pieces).sum(1)
    seq_chunks = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    piece_chunks = np.concatenate([[0], np.cumsum(piece_counts)])
    owner = np.repeat(np.arange(len(piece_counts)), piece_counts)
    index = np.arange(int(piece_chunks[-1])) - piece_chunks[owner]  # chunk number within its piece
    chunk_start = piece_first[owner] + index * chunk_size
    chunk_len = np.minimum(chunk_size, piece_end[owner] - chunk_start)
    return chunk_start.astype(np.int32), chunk_len.astype(np.int32), seq_chunks


def solve_unit_lower(lower: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """``X`` with ``(I + lower) X = rhs`` for strictly lower-triangular ``lower [..., C, C]``, by
    forward substitution (a unit triangular system: never singular, no pivoting)."""
    out = np.empty_like(rhs)
    for i in range(lower.shape[-1]):
        out[..., i, :] = rhs[..., i, :] - (lower[..., i : i + 1, :i] @ out[..., :i, :])[..., 0, :]
    return out


def chunk_gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                           state: np.ndarray, chunk_size: int = CHUNK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """The chunked (UT-transform) gated delta rule over one sequence.

    ``q, k [L, H, dk]`` already normalised (and q scaled), ``v [L, H, dv]``, ``g, beta [L, H]``,
    ``state [H, dk, dv]`` (fp32). Returns ``(out [L, H, dv], new_state [H, dk, dv])``.

    Per chunk of C tokens with cumulative log-decay ``c_t``: ``D[i,j] = exp(c_i - c_j)`` (i ≥ j),
    ``(I + tril(βK Kᵀ ∘ D, -1)) [U | W] = [βV | βK·exp(c)]``; then with the state ``S`` entering
    the chunk: ``V' = U - W S``, ``O = (Q·exp(c)) S + (Q Kᵀ ∘ D) V'``,
    ``S ← exp(c_C) S + (K·exp(c_C - c))ᵀ V'``. Arrays are chunk-major ``[N, H, C, ...]`` and
    every matmul operand is contiguous, so NumPy hands each batch to BLAS.
    """
    length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size
    num_chunks = (length + pad) // chunk_size

    def chunks(x: np.ndarray) -> np.ndarray:  # [L, H, ...] -> [N, H, C, ...]
        x = np.pad(x.astype(np.float32, copy=False), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        x = x.reshape(num_chunks, chunk_size, heads, *x.shape[2:])
        return np.ascontiguousarray(np.moveaxis(x, 2, 1))

    q_c, k_c, v_c, g_c, beta_c = (chunks(x) for x in (q, k, v, g, beta))
    # The cumulative log-decay reaches -1000 within a chunk for fast-forgetting heads; summed in
    # fp32 its rounding (~1e-4 absolute) would become a relative error of every decay factor
    # exp(c_i - c_j). Sum and subtract in fp64, then return to fp32.
    cum64 = np.cumsum(g_c, axis=-1, dtype=np.float64)  # [N, H, C]
    lower = np.tril(np.ones((chunk_size, chunk_size), dtype=bool))
    log_decay = np.where(lower, cum64[..., :, None] - cum64[..., None, :], -np.inf)
    decay = np.exp(log_decay).astype(np.float32)  # [N, H, C, C], zero above the diagonal
    cum = cum64.astype(np.float32)
    k_t = np.ascontiguousarray(np.swapaxes(k_c, -1, -2))  # [N, H, dk, C]
    k_beta = k_c * beta_c[..., None]
    v_beta = v_c * beta_c[..., None]
    system = np.tril((k_beta @ k_t) * decay, -1)
    rhs = np.concatenate([v_beta, k_beta * np.exp(cum)[..., None]], axis=-1)
    solved = solve_unit_lower(system, rhs)
    new_values = np.ascontiguousarray(solved[..., :dv])
    k_cumdecay = np.ascontiguousarray(solved[..., dv:])
    intra = (q_c @ k_t) * decay  # [N, H, C, C]
    q_decayed = q_c * np.exp(cum)[..., None]
    k_decayed_t = np.ascontiguousarray(
        np.swapaxes(k_c * np.exp(cum64[..., -1:] - cum64).astype(np.float32)[..., None], -1, -2))
    chunk_decay = np.exp(cum[..., -1])[..., None, None]  # [N, H, 1, 1]

    out = np.empty((num_chunks, heads, chunk_size, dv), dtype=np.float32)
    state = np.array(state, dtype=np.float32, copy=True)
    for i in range(num_chunks):
        v_new = new_values[i] - k_cumdecay[i] @ state
        out[i] = q_decayed[i] @ state + intra[i] @ v_new
        state = state * chunk_decay[i] + k_decayed_t[i] @ v_new
    out = np.moveaxis(out, 1, 2).reshape(num_chunks * chunk_size, heads, dv)[:length]
    return np.ascontiguousarray(out), state


def recurrent_gated_delta_rule_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                                    beta: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token per sequence: ``q, k [B, H, dk]``, ``v [B, H, dv]``, ``g, beta [B, H]``,
    ``state [B, H, dk, dv]``. Returns ``(out [B, H, dv], new_state)``."""
    state = state * np.exp(g)[..., None, None]
    predicted = (k[..., None, :] @ state)[..., 0, :]  # Sᵀk: [B, H, dv]
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``RMSNorm(x) · w · silu(gate)`` over the last axis (plain weight, not zero-centred)."""
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(variance + eps) * weight * silu(gate)


# --- the layer core on NumPy -------------------------------------------------------------------


def split_heads(conv_out: np.ndarray, config: Qwen35Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[n, q|k|v]`` → l2-normalised, scaled q and k repeated to the value heads, and v."""
    n, nk, dk = conv_out.shape[0], config.linear_num_key_heads, config.linear_key_head_dim
    key_dim, repeat = config.linear_key_dim, config.linear_num_value_heads // nk
    q = l2_normalize(conv_out[:, :key_dim].reshape(n, nk, dk)) * np.float32(dk**-0.5)
    k = l2_normalize(conv_out[:, key_dim : 2 * key_dim].reshape(n, nk, dk))
    v = conv_out[:, 2 * key_dim :].reshape(n, config.linear_num_value_heads, config.linear_value_head_dim)
    if repeat > 1:
        q, k = np.repeat(q, repeat, axis=1), np.repeat(k, repeat, axis=1)
    return q, k, v


def delta_net(proj: np.ndarray, w: DeltaNetWeights, conv_state: np.ndarray, ssm_state: np.ndarray,
              seqs: StepSequences, config: Qwen35Config, out: np.ndarray | None = None) -> np.ndarray:
    """From the fused projection ``[T, q|k|v|z|b|a]`` to the gated-normed ``[T, nv·dv]`` that
    ``out_proj`` consumes, reading and updating each sequence's slot in ``conv_state`` /
    ``ssm_state``. Decoding sequences (one new token) run batched through the recurrent step,
    the others one by one through the chunked rule."""
    conv_dim, value_dim, nv = config.conv_dim, config.linear_value_dim, config.linear_num_value_heads
    dv = config.linear_value_head_dim
    mixed = proj[:, :conv_dim]
    z = proj[:, conv_dim : conv_dim + value_dim]
    beta = sigmoid(proj[:, conv_dim + value_dim : conv_dim + value_dim + nv])
    decay = w.neg_decay_rate * softplus(proj[:, conv_dim + value_dim + nv :] + w.dt_bias)  # g ≤ 0
    core = np.empty((proj.shape[0], nv, dv), np.float32)
    query_start = seqs.query_start
    query_lens = np.diff(query_start)

    def initial(states: np.ndarray, slots: np.ndarray, fresh: np.ndarray) -> np.ndarray:
        return np.where(fresh.reshape(-1, *[1] * (states.ndim - 1)), np.float32(0), states[slots])

    decoding = np.flatnonzero(query_lens == 1)
    if decoding.size:
        rows, slots, fresh = query_start[decoding], seqs.slots[decoding], seqs.fresh[decoding]
        conv_out, conv_state[slots] = causal_conv1d_step(mixed[rows], w.conv_weight,
                                                         initial(conv_state, slots, fresh))
        q, k, v = split_heads(conv_out, config)
        core[rows], ssm_state[slots] = recurrent_gated_delta_rule_step(
            q, k, v, decay[rows], beta[rows], initial(ssm_state, slots, fresh))
    for seq in np.flatnonzero(query_lens > 1):
        start, end, slot = int(query_start[seq]), int(query_start[seq + 1]), int(seqs.slots[seq])
        fresh = seqs.fresh[seq : seq + 1]
        conv_out, conv_state[slot] = causal_conv1d(mixed[start:end], w.conv_weight,
                                                   initial(conv_state, seqs.slots[seq : seq + 1], fresh)[0])
        q, k, v = split_heads(conv_out, config)
        core[start:end], ssm_state[slot] = chunk_gated_delta_rule(
            q, k, v, decay[start:end], beta[start:end], initial(ssm_state, seqs.slots[seq : seq + 1], fresh)[0])
    normed = gated_rms_norm(core.reshape(-1, dv), z.reshape(-1, dv), w.norm, config.rms_norm_eps)
    if out is None:
        return normed.reshape(-1, value_dim)
    out[...] = normed.reshape(-1, value_dim)  # ``out``: rows of a larger array (the snapshot split's)
    return out
