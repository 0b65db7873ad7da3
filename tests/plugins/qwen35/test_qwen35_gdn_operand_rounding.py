"""Issue #17's error budget of the chunked Gated DeltaNet prefill (gdn_chunked.cu), on the CPU: a
NumPy model of the kernels' chunk algorithm that rounds every tensor-core operand where the kernels
hold it in 16 bits (q / k normed, T diag(beta) and T diag(beta exp(c)), W, U, P, the state S^T entering
each chunk, V' and its decayed copy), against the token-by-token rule in fp64 (the recurrent kernels
keep fp32 and normalise q / k on the fly: fp64 here stands for them). bf16 operands (the default
grouped_staged) cost several times the output's own bf16 rounding; fp16 operands
(OPENINFER_QWEN35_GDN_PREFILL=grouped_f16, GDN_F16_OPERANDS) a fraction of it."""

from __future__ import annotations

import numpy as np

from openinfer import bf16_to_float32, float32_to_bf16

CHUNK = 64


def bf16(x: np.ndarray) -> np.ndarray:
    return bf16_to_float32(float32_to_bf16(np.asarray(x, np.float32))).astype(np.float64)


def fp16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def layer_inputs(length: int, dk: int, dv: int, seed: int = 0):
    """One head's inputs as the layer makes them: l2-normed q (scaled) / k from bf16 rows, bf16 v,
    gates from a trained-looking A_log / dt_bias (dt log-uniform in [1e-3, 0.1])."""
    rng = np.random.default_rng(seed)
    q = bf16(rng.standard_normal((length, dk)))
    k = bf16(rng.standard_normal((length, dk)) + 0.5 * rng.standard_normal(dk))  # keys share a direction
    v = bf16(rng.standard_normal((length, dv)))
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1)))
    dt_bias = dt + np.log(-np.expm1(-dt))  # softplus^-1(dt)
    g = -np.exp(np.log(8.0)) * np.log1p(np.exp(rng.standard_normal(length) + dt_bias))
    beta = 1 / (1 + np.exp(-rng.standard_normal(length)))
    qn = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    kn = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    return qn, kn, v, g, beta


def recurrent(qn, kn, v, g, beta) -> np.ndarray:
    state = np.zeros((kn.shape[1], v.shape[1]))
    out = np.empty_like(v)
    for t in range(len(v)):
        state *= np.exp(g[t])
        state += np.outer(kn[t], beta[t] * (v[t] - kn[t] @ state))
        out[t] = qn[t] @ state
    return out


def chunked(qn, kn, v, g, beta, operand) -> np.ndarray:
    """The kernels' products with each 16-bit operand rounded by ``operand`` (fp32-ish sums)."""
    q, k = operand(qn), operand(kn)
    state = np.zeros((k.shape[1], v.shape[1]))
    out = np.empty_like(v)
    for c0 in range(0, len(v), CHUNK):
        rows = slice(c0, c0 + CHUNK)
        qc, kc, vc, bc = q[rows], k[rows], operand(v[rows]), beta[rows]
        cum = np.cumsum(g[rows])
        decay = np.tril(np.exp(np.minimum(cum[:, None] - cum[None, :], 0.0)))
        system = np.tril(bc[:, None] * (kc @ kc.T) * decay, -1)
        t_inv = np.linalg.inv(np.eye(len(cum)) + system)  # the solve stays ~fp32
        u = operand(operand(t_inv * bc[None, :]) @ vc)
        w = operand(operand(t_inv * (bc * np.exp(cum))[None, :]) @ kc)
        entering = operand(state)
        v_new = u - w @ entering
        p = operand(np.tril(qc @ kc.T * decay))
        out[rows] = np.exp(cum)[:, None] * (qc @ entering) + p @ operand(v_new)
        state = np.exp(cum[-1]) * state + kc.T @ operand(np.exp(cum[-1] - cum)[:, None] * v_new)
    return out


def test_fp16_operands_bring_the_chunked_error_under_the_outputs_own_rounding():
    inputs = layer_inputs(384, 64, 64)
    reference = recurrent(*inputs)
    scale = np.abs(reference).mean()

    def error(out):
        return float(np.abs(out - reference).mean() / scale)

    exact, with_bf16, with_fp16 = (chunked(*inputs, f) for f in (lambda x: x, bf16, fp16))
    output_rounding = error(bf16(reference))  # what every path pays storing O as bf16
    assert error(exact) < 1e-9  # the model is the token-by-token rule
    assert error(with_bf16) > 1.5 * output_rounding
    assert error(with_fp16) < 0.5 * output_rounding
    assert error(with_fp16) < error(with_bf16) / 4
