"""core's ``rms_norm.cu`` and ``qk_norm_rope.cu`` compiled with g++ against the host stand-in for the
CUDA built-ins (tests/helpers/cuda_host) and run on the CPU: the one-warp-per-row norms
(``rms_norm_rows`` / ``add_rms_norm_rows``: 16-byte accesses, the row in registers, a tail of lanes
without a vector) and the 16-byte q/k/v write (``qk_norm_rope_write_kv_vec``: HEAD_DIM / 8 lanes per
head, several heads per warp, idle lanes in the last chunk, partial RoPE, padding slots) against the
kernels they stand beside and the NumPy composition. The residual sum and v are bit-exact; the
normalised values may differ in the last bit (another fp32 summation order). GPU tests:
tests/gpu/test_elementwise_kernels.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openinfer import bf16_to_float32, float32_to_bf16
from tests.helpers.cuda_emulation import bf16, compile_harness, run_harness

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).parent / "cuda_emulation" / "norm_qkv_harness.cpp"
EPS = 1e-6


def norm_threads(features: int) -> int:
    """rms_norm.cu's block size, as the CUDA backend picks it (backend._norm_threads)."""
    return min(1024, max(32, -(-features // 64) * 32))


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    built: dict[tuple[int, int, int, int, int], Path] = {}

    def build(head_dim: int, vectors_per_lane: int, tokens_per_thread: int, prefetch_rope: int,
              scalar_rope: int) -> Path:
        key = (head_dim, vectors_per_lane, tokens_per_thread, prefetch_rope, scalar_rope)
        if key not in built:
            folder = tmp_path_factory.mktemp("norm_qkv_" + "_".join(map(str, key)))
            built[key] = compile_harness(HARNESS, REPO / "core" / "kernels", folder / "harness",
                                         {"HEAD_DIM": head_dim, "VECS_PER_LANE": vectors_per_lane,
                                          "QKV_TOKENS_PER_THREAD": tokens_per_thread,
                                          "QKV_PREFETCH_ROPE": prefetch_rope,
                                          "QKV_SCALAR_ROPE": scalar_rope})
        return built[key]
    return build


def reference_rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    inv = 1 / np.sqrt(np.mean(np.float64(x) ** 2, axis=-1, keepdims=True) + EPS)
    return bf16(bf16(x * inv) * weight)


def reference_qkv(qkv, q_norm, k_norm, cos, sin, positions, rotary_dim, num_heads, num_kv_heads, head_dim):
    """(q [T, nh, d], k [T, nkv, d], v [T, nkv, d]) as the kernels compute them, in NumPy."""
    heads = qkv.reshape(qkv.shape[0], -1, head_dim).astype(np.float32)
    out = heads.copy()
    half = rotary_dim // 2
    for h in range(num_heads + num_kv_heads):
        x = heads[:, h]
        norm = q_norm if h < num_heads else k_norm
        if norm is not None:
            x = reference_rms_norm(x, norm)
        if rotary_dim:
            c, s = cos[positions], sin[positions]
            rotated = x.copy()
            rotated[:, :half] = x[:, :half] * c - x[:, half:rotary_dim] * s
            rotated[:, half:rotary_dim] = x[:, half:rotary_dim] * c + x[:, :half] * s
            x = rotated
        out[:, h] = bf16(x)
    return out[:, :num_heads], out[:, num_heads:num_heads + num_kv_heads], out[:, num_heads + num_kv_heads:]


# rows, features: a row of 1 vector (lanes 1..31 idle), a tail of lanes (65 vectors), Qwen3-4B's 2560
NORM_CASES = [(3, 8), (5, 520), (6, 2560)]
# head_dim, num_heads, num_kv_heads, tokens, rotary_dim, with_norm, tokens per thread, cos/sin prefetched,
# cos/sin read per element
QKV_CASES = [(128, 4, 2, 5, 128, True, 1, 0, 0),  # 8 heads x 16 lanes: one block of 128 threads
             (128, 16, 4, 3, 128, True, 2, 1, 0),  # 24 heads: 2 chunks of 256 lanes, the second half idle;
                                                   # 2 tokens per thread, the last group with one
             (64, 6, 3, 4, 64, True, 4, 1, 0),    # 8 lanes per head, 4 heads per warp, 96 lanes; one group
             (128, 4, 2, 3, 64, False, 2, 0, 1),  # partial RoPE (partners 4 lanes apart), no q/k norm
             (256, 2, 1, 3, 0, True, 1, 1, 0),    # a whole warp per head, no RoPE
             (128, 4, 2, 5, 128, True, 1, 0, 1)]  # the first case with cos/sin read per element


# each q/k/v case beside one norm case (each harness run does both)
CASES = [(NORM_CASES[i % len(NORM_CASES)], qkv_case) for i, qkv_case in enumerate(QKV_CASES)]


@pytest.mark.parametrize(("norm_case", "qkv_case"), CASES)
def test_row_norms_and_vector_qkv_write_match_their_reference(harnesses, tmp_path, norm_case, qkv_case):
    rows, features = norm_case
    (head_dim, num_heads, num_kv_heads, tokens, rotary_dim, with_norm, tokens_per_thread, prefetch_rope,
     scalar_rope) = qkv_case
    rng = np.random.default_rng(rows * features + head_dim * num_heads + tokens)
    x, residual = bf16(2 * rng.standard_normal((rows, features))), bf16(rng.standard_normal((rows, features)))
    weight = bf16(1 + 0.3 * rng.standard_normal(features))

    heads = num_heads + 2 * num_kv_heads
    qkv = bf16(rng.standard_normal((tokens, heads * head_dim)))
    q_norm, k_norm = (bf16(1 + 0.3 * rng.standard_normal(head_dim)) for _ in range(2))
    max_position = 64
    angles = rng.uniform(0, 6.3, (max_position, max(rotary_dim // 2, 1))).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    positions = rng.integers(0, max_position, tokens).astype(np.int32)
    num_slots = 2 * tokens + 3
    slots = rng.permutation(num_slots)[:tokens].astype(np.int32)
    slots[-1] = -1  # padding: writes no KV
    cache = bf16(rng.standard_normal((num_slots, num_kv_heads, head_dim)))
    lanes = heads * head_dim // 8
    vec_threads = min(256, -(-lanes // 32) * 32)

    params = [rows, features, norm_threads(features), tokens, num_heads, num_kv_heads, rotary_dim, int(with_norm),
              vec_threads]
    binary = harnesses(head_dim, -(-features // 256), tokens_per_thread, prefetch_rope, scalar_rope)
    run_harness(binary, tmp_path, params=np.array(params, np.int32), x=float32_to_bf16(x),
                residual=float32_to_bf16(residual), weight=float32_to_bf16(weight), qkv=float32_to_bf16(qkv),
                q_norm=float32_to_bf16(q_norm), k_norm=float32_to_bf16(k_norm), cos=cos, sin=sin,
                positions=positions, slots=slots, cache=float32_to_bf16(cache))

    def bits(name: str, shape) -> np.ndarray:
        return np.fromfile(tmp_path / f"{name}.bin", np.uint16).reshape(shape)

    def values(name: str, shape) -> np.ndarray:
        return bf16_to_float32(bits(name, shape))

    shape = (rows, features)
    assert np.array_equal(bits("rows_sum", shape), bits("block_sum", shape))
    assert np.array_equal(values("rows_sum", shape), bf16(x + residual))
    for ours, theirs, source in (("rows_norm", "block_norm", x), ("rows_add", "block_add", bf16(x + residual))):
        expected = reference_rms_norm(source, weight)
        np.testing.assert_allclose(values(ours, shape), expected, rtol=1e-2, atol=1e-2)
        # another summation order: a bf16 step or two apart from the block kernel's result
        assert np.abs(values(ours, shape) - values(theirs, shape)).max() <= 2 ** -6 * np.abs(expected).max()

    q_ref, k_ref, v_ref = reference_qkv(qkv, q_norm if with_norm else None, k_norm if with_norm else None,
                                        cos, sin, positions, rotary_dim, num_heads, num_kv_heads, head_dim)
    q_shape, cache_shape = (tokens, num_heads, head_dim), cache.shape
    written = slots[slots >= 0]
    for variant in ("warp", "vec"):
        np.testing.assert_allclose(values(f"{variant}_q", q_shape), q_ref, rtol=2e-2, atol=2e-2)
        k, v = values(f"{variant}_k", cache_shape), values(f"{variant}_v", cache_shape)
        np.testing.assert_allclose(k[written], k_ref[slots >= 0], rtol=2e-2, atol=2e-2)
        assert np.array_equal(v[written], v_ref[slots >= 0])
        untouched = np.setdiff1d(np.arange(num_slots), written)
        assert np.array_equal(k[untouched], cache[untouched]) and np.array_equal(v[untouched], cache[untouched])
    assert np.array_equal(bits("vec_v", cache_shape), bits("warp_v", cache_shape))
    close = np.isclose(values("vec_q", q_shape), values("warp_q", q_shape), rtol=1e-2, atol=1e-2)
    assert close.all()
