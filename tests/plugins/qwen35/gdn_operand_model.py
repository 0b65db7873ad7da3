"""A NumPy model of the chunked Gated DeltaNet prefill's operand rounding (gdn_chunked.cu), shared by
test_qwen35_gdn_operand_rounding.py and gdn_teacher_forced_emulation.py (issue #17).

``chunked`` runs the kernels' chunk algorithm (chunks of 64; the UT transform; the state carried
between chunks) in fp64 with each tensor-core operand passed through a rounding function at the point
where the kernels hold it in 16 bits. The rounding points, by name (ROUNDING_POINTS):

    qk   the l2-normed q (x dk^-1/2) and k rows (qn / kn: scores, W's B operand, the walk's K, O's Q)
    Tb   T diag(beta), U's A operand          Tbe  T diag(beta exp(c)), W's A operand
    U    U = T diag(beta) V                   W    W = T diag(beta exp(c)) K
    S    the state S entering each chunk (V' = U - W S and O's Q S)
    P    P = lower(Q K^T * D)                 Vn   V' as P V's B operand
    Vd   diag(exp(c_C - c)) V', the state update's A operand

(the triangular solve and every sum stay ~fp32 in the kernels: exact here; V is the layer's bf16 conv
output, exact in either format). ``qk`` exact stands for kernels that never round the normed rows: q / k
are l2 norms times bf16 rows (the conv output), so their products can take the raw rows as exact bf16
operands and apply the norms in fp32 (to the scores, to O's rows, folded into W's and the state update's
other operand). ``recurrent`` is the token-by-token rule in fp64 (the recurrent kernels
keep fp32 and norm q / k on the fly: fp64 stands for them).

Rounding functions: ``bf16`` / ``fp16`` (one 16-bit operand: what grouped_staged / grouped_f16 do),
``bf16_hi_lo`` (x as bf16 hi + bf16 lo: three mmas hi·hi + hi·lo + lo·hi keep ~16 bits), ``fp16_hi_lo``
(the same in fp16: the lo part of values under ~0.03 falls into fp16's subnormals), ``fp16_hi_scaled_lo``
(fp16 hi + the remainder x 2^11 as fp16, its products scaled back by 2^-11 in fp32: ~21 bits over the
whole range the operands take) and ``bf16_hi_mid_lo`` (three bf16 parts, ~24 bits)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from openinfer import bf16_to_float32, float32_to_bf16

CHUNK = 64
ROUNDING_POINTS = ("qk", "Tb", "Tbe", "U", "W", "S", "P", "Vn", "Vd")
LO_SCALE = 2.0**11  # fp16_hi_scaled_lo: the remainder of an fp16 rounding is below 2^-11 of the value

Rounding = Callable[[np.ndarray], np.ndarray]
Product = Callable[[np.ndarray, np.ndarray], np.ndarray]
PRODUCTS = ("WS", "PV")  # the products of two fp32 operands that a split kernel may take in fewer part products


def exact(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64)


def bf16(x: np.ndarray) -> np.ndarray:
    return bf16_to_float32(float32_to_bf16(np.asarray(x, np.float32))).astype(np.float64)


def fp16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def bf16_hi_lo(x: np.ndarray) -> np.ndarray:
    hi = bf16(x)
    return hi + bf16(exact(x) - hi)


def fp16_hi_lo(x: np.ndarray) -> np.ndarray:
    hi = fp16(x)
    return hi + fp16(exact(x) - hi)


def fp16_hi_scaled_lo(x: np.ndarray) -> np.ndarray:
    hi = fp16(x)
    return hi + fp16((exact(x) - hi) * LO_SCALE) / LO_SCALE


def bf16_hi_mid_lo(x: np.ndarray) -> np.ndarray:
    hi = bf16(x)
    mid = bf16(exact(x) - hi)
    return hi + mid + bf16(exact(x) - hi - mid)


def bf16_parts(x: np.ndarray, parts: int) -> list[np.ndarray]:
    """x as ``parts`` bf16 parts hi, mid, lo, ... (each the bf16 rounding of what the earlier ones leave)."""
    rest, out = exact(x), []
    for _ in range(parts):
        out.append(bf16(rest))
        rest = rest - out[-1]
    return out


def split_product(a_parts: int, b_parts: int, terms: tuple[tuple[int, int], ...]) -> Product:
    """A @ B as the kernels' split mmas take it (gdn_chunked_split.cu): A in ``a_parts`` bf16 parts, B in
    ``b_parts``, the sum of part products (i, j) in ``terms`` (each exact, as the mma's fp32 accumulate
    of exact bf16 products is to ~fp32)."""
    def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        pa, pb = bf16_parts(a, a_parts), bf16_parts(b, b_parts)
        return sum(pa[i] @ pb[j] for i, j in terms)
    return product


def fp16_scaled_parts(x: np.ndarray) -> list[np.ndarray]:
    """x as fp16 hi + lo, lo the remainder x 2^11 rounded to fp16 and scaled back (gdn_chunked_split.cu's fp16 parts)."""
    hi = fp16(x)
    return [hi, fp16((exact(x) - hi) * LO_SCALE) / LO_SCALE]


def fp16_split_product(terms: tuple[tuple[int, int], ...] = ((0, 0), (0, 1), (1, 0))) -> Product:
    """A @ B on fp16 parts (fp16_scaled_parts), the sum of part products (i, j) in ``terms`` (by default
    hi*hi, hi*lo, lo*hi: the 3 mmas of chunked_split_f16's split x split products)."""
    def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        pa, pb = fp16_scaled_parts(a), fp16_scaled_parts(b)
        return sum(pa[i] @ pb[j] for i, j in terms)
    return product


def everywhere(rounding: Rounding, **overrides: Rounding) -> dict[str, Rounding]:
    """``rounding`` at every point, ``overrides`` (point=function) where given."""
    unknown = set(overrides) - set(ROUNDING_POINTS)
    if unknown:
        raise ValueError(f"unknown rounding points {sorted(unknown)}; expected some of {ROUNDING_POINTS}")
    return {point: overrides.get(point, rounding) for point in ROUNDING_POINTS}


def l2_normed(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    x = exact(x)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6) * scale


def recurrent(qn: np.ndarray, kn: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """One head's token-by-token gated delta rule from a zero state (``qn`` / ``kn`` normed)."""
    state = np.zeros((kn.shape[1], v.shape[1]))
    out = np.empty((len(v), v.shape[1]))
    for t in range(len(v)):
        state *= np.exp(g[t])
        state += np.outer(kn[t], beta[t] * (v[t] - kn[t] @ state))
        out[t] = qn[t] @ state
    return out


def chunked(qn: np.ndarray, kn: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
            rounding: dict[str, Rounding] | None = None) -> np.ndarray:
    """The kernels' chunk algorithm for one head from a zero state, each point of ``rounding`` (name →
    function; missing points exact) applied where the kernels hold that operand in 16 bits; the keys of
    PRODUCTS in ``rounding`` (name → Product) replace those products (W S, P V') on their rounded operands."""
    rounding = dict(rounding or {})
    products = {name: rounding.pop(name, np.matmul) for name in PRODUCTS}
    unknown = set(rounding) - set(ROUNDING_POINTS)
    if unknown:
        raise ValueError(f"unknown rounding points {sorted(unknown)}; expected some of {ROUNDING_POINTS}")

    def at(point: str, x: np.ndarray) -> np.ndarray:
        return rounding.get(point, exact)(x)

    q, k = at("qk", qn), at("qk", kn)
    v, g, beta = exact(v), exact(g), exact(beta)
    state = np.zeros((k.shape[1], v.shape[1]))
    out = np.empty((len(v), v.shape[1]))
    for c0 in range(0, len(v), CHUNK):
        rows = slice(c0, c0 + CHUNK)
        qc, kc, vc, bc = q[rows], k[rows], v[rows], beta[rows]
        cum = np.cumsum(g[rows])
        decay = np.tril(np.exp(np.minimum(cum[:, None] - cum[None, :], 0.0)))
        system = np.tril(bc[:, None] * (kc @ kc.T) * decay, -1)
        t_inv = np.linalg.inv(np.eye(len(cum)) + system)  # the solve stays ~fp32
        u = at("U", at("Tb", t_inv * bc[None, :]) @ vc)
        w = at("W", at("Tbe", t_inv * (bc * np.exp(cum))[None, :]) @ kc)
        entering = at("S", state)
        v_new = u - products["WS"](w, entering)
        p = at("P", np.tril(qc @ kc.T * decay))
        out[rows] = np.exp(cum)[:, None] * (qc @ entering) + products["PV"](p, at("Vn", v_new))
        state = np.exp(cum[-1]) * state + kc.T @ at("Vd", np.exp(cum[-1] - cum)[:, None] * v_new)
    return out


def row_relative_error(out: np.ndarray, reference: np.ndarray) -> float:
    """Mean |out - reference| over each row's RMS of ``reference`` (the gated norm divides by it)."""
    rms = np.sqrt((exact(reference) ** 2).mean(-1, keepdims=True)) + 1e-300
    return float((np.abs(exact(out) - reference) / rms).mean())


def bf16_flips(out: np.ndarray, reference: np.ndarray) -> float:
    """The fraction of outputs whose bf16 rounding differs from the reference's (what HF's bf16 sees)."""
    return float((bf16(out) != bf16(reference)).mean())
