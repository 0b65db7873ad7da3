"""Every cuda op against its NumPy op on random bf16-representable inputs."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.cuda.bf16 import bf16_bits_to_float, round_to_bf16
from openinfer.backend.numpy_backend import NumpyBackend
from tests.gpu.conftest import bf16_random, relative_error

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

REF = NumpyBackend()
BF16_TOL = 1e-2


def test_upload_to_host_round_trip(cuda_backend, rng):
    x = bf16_random(rng, 33, 70)
    assert np.array_equal(cuda_backend.to_host(cuda_backend.upload(x)), x)


@pytest.mark.parametrize("features", [64, 2560, 1000])
def test_rms_norm(cuda_backend, rng, features):
    x, w = bf16_random(rng, 37, features), 1 + bf16_random(rng, features, scale=0.3)
    w = round_to_bf16(w)
    out = cuda_backend.to_host(cuda_backend.rms_norm(cuda_backend.upload(x), cuda_backend.weight(w), 1e-6))
    assert relative_error(out, REF.rms_norm(x, w, 1e-6)) < BF16_TOL


def test_add_rms_norm(cuda_backend, rng):
    x, r, w = bf16_random(rng, 19, 512), bf16_random(rng, 19, 512), round_to_bf16(1 + bf16_random(rng, 512, scale=0.3))
    out, residual = cuda_backend.add_rms_norm(cuda_backend.upload(x), cuda_backend.upload(r), cuda_backend.weight(w), 1e-5)
    assert np.array_equal(cuda_backend.to_host(residual), round_to_bf16(x + r))
    ref_out, _ = REF.add_rms_norm(round_to_bf16(x + r), np.zeros_like(x), w, 1e-5)
    assert relative_error(cuda_backend.to_host(out), ref_out) < BF16_TOL


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(cuda_backend, rng, rows, bias):
    k, n = 1024, 768
    x, w = bf16_random(rng, rows, k), bf16_random(rng, n, k, scale=0.05)
    b = bf16_random(rng, n) if bias else None
    layer = cuda_backend.linear_weight(w, b)
    out = cuda_backend.to_host(cuda_backend.linear(cuda_backend.upload(x), layer))
    assert relative_error(out, REF.linear(x, REF.linear_weight(w, b))) < BF16_TOL


@pytest.mark.parametrize("rows", [2, 3, 9, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_padded_to_row_buckets(cuda_backend, rng, rows, bias):
    """Rows padded up to a bucket (a kernel graph capture loaded): same [rows, n] result."""
    from openinfer.backend.cuda.linear import linear

    k, n = 1024, 768
    x, w = bf16_random(rng, rows, k), bf16_random(rng, n, k, scale=0.05)
    b = bf16_random(rng, n) if bias else None
    layer = cuda_backend.linear_weight(w, b)
    out = linear(cuda_backend.upload(x), layer, cuda_backend.blas, row_buckets=(1, 4, 16, 24, 64))
    assert out.shape == (rows, n) and out.flags.c_contiguous
    assert relative_error(cuda_backend.to_host(out), REF.linear(x, REF.linear_weight(w, b))) < BF16_TOL


def test_linear_odd_in_features_uses_cublas(cuda_backend, rng):
    x, w = bf16_random(rng, 4, 100), bf16_random(rng, 48, 100)
    out = cuda_backend.to_host(cuda_backend.linear(cuda_backend.upload(x), cuda_backend.linear_weight(w)))
    assert relative_error(out, x @ w.T) < BF16_TOL


@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_numpy_and_is_batch_invariant(cuda_backend, rng, bias):
    from openinfer.backend.cuda.linear import skinny_gemm

    x, w = bf16_random(rng, 8, 2560 + 8), bf16_random(rng, 517, 2560 + 8, scale=0.05)
    b = bf16_random(rng, 517) if bias else None
    layer = cuda_backend.linear_weight(w, b)

    def run(m):
        out = cupy.empty((m, 517), dtype=cupy.uint16)
        skinny_gemm(cuda_backend.upload(x[:m]), layer, out)
        return cuda_backend.to_host(out)

    full = run(8)
    assert relative_error(full, REF.linear(x, REF.linear_weight(w, b))) < BF16_TOL
    for m in (1, 2, 3, 4, 7):
        assert np.array_equal(run(m), full[:m])


def _eager_and_replayed(step, replays: int = 2) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """``step()``'s outputs (device arrays) as host copies, run eagerly on a stream of its own and then from the CUDA
    graph of one captured ``step()``, ``replays`` times (its outputs zeroed before each replay)."""
    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(pool.malloc), stream:
        eager = [cupy.asnumpy(a) for a in step()]
        stream.synchronize()
        stream.begin_capture()
        try:
            outs = step()
        finally:
            graph = stream.end_capture()
        replayed = []
        for _ in range(replays):
            for out in outs:
                out.fill(0)
            graph.launch(stream)
            stream.synchronize()
            replayed.append([cupy.asnumpy(a) for a in outs])
    return eager, replayed


def _same(runs: list[list[np.ndarray]], want: list[np.ndarray]) -> bool:
    return all(np.array_equal(a, b) for run in runs for a, b in zip(run, want, strict=True))


@pytest.mark.parametrize("rms_scaled", ["0", "1"])
def test_gemv_pdl_same_bits_eager_and_replayed(cuda_backend, rng, monkeypatch, rms_scaled):
    """$OPENINFER_GEMV_PDL=1 (the one-row GEMVs launched by programmatic dependent launch, their first pass of
    weights loaded before griddepcontrol.wait): a batch-1 chain shaped as Kimi-K2's attention projections — qkv_a,
    q_a_norm + q_b (rms_norm then gemv_m1, or gemv_m1_rms_scaled right after qkv_a), o_proj, a GEMV after an
    elementwise kernel — gives the bits of plain launches, eagerly on a stream of its own and replayed from a CUDA
    graph."""
    from openinfer.backend.cuda import linear as cuda_linear

    hidden, q_lora, latent, q_out = 1024, 384, 160, 1536  # 1536 / 384: a pass and a partial one; 1024: 4 steps a lane
    qkv_a = cuda_backend.linear_weight(bf16_random(rng, q_lora + latent, hidden, scale=0.05))
    q_b = cuda_backend.linear_weight(bf16_random(rng, q_out, q_lora, scale=0.05))
    o_proj = cuda_backend.linear_weight(bf16_random(rng, hidden, q_out, scale=0.05))
    up = cuda_backend.linear_weight(bf16_random(rng, 2 * 256, hidden, scale=0.05))
    down = cuda_backend.linear_weight(bf16_random(rng, hidden, 256, scale=0.05))
    norm = cuda_backend.weight(round_to_bf16(1 + bf16_random(rng, q_lora, scale=0.2)))
    x = cuda_backend.upload(bf16_random(rng, 1, hidden))
    monkeypatch.setenv(cuda_linear.RMS_SCALED_GEMV_ENV, rms_scaled)
    monkeypatch.delenv(cuda_linear.DECODE_PDL_ENV, raising=False)

    def step():
        a = cuda_backend.linear(x, qkv_a)
        q, _ = cuda_backend.add_rms_norm_linear(cupy.ascontiguousarray(a[:, :q_lora]), None, norm, 1e-6, q_b)
        h = cuda_backend.linear(q, o_proj)
        return a, q, h, cuda_backend.linear(cuda_backend.silu_mul(cuda_backend.linear(h, up)), down)

    results = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv(cuda_linear.GEMV_PDL_ENV, pdl)
        assert cuda_linear.gemv_pdl() is (pdl == "1")
        results[pdl], replayed = _eager_and_replayed(step)
        assert _same(replayed, results[pdl])
    assert _same([results["1"]], results["0"])
    q_host, h_host = (bf16_bits_to_float(results["0"][i]) for i in (1, 2))
    o_weight = cuda_backend.to_host(o_proj.weight)
    assert relative_error(h_host, REF.linear(q_host, REF.linear_weight(o_weight, None))) < BF16_TOL
    monkeypatch.setenv(cuda_linear.GEMV_PDL_ENV, "sometimes")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        cuda_linear.gemv_pdl()


# A kernel that lets the stream's next kernel launch at once (griddepcontrol.launch_dependents), then spins ~0.5 ms
# and only then writes dst: a PDL-launched reader that does not wait in griddepcontrol.wait reads dst's old value.
LATE_COPY = r"""
extern "C" __global__ void late_copy(const unsigned short* src, unsigned short* dst, int n, long long cycles) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"""


def _late_gemv(cuda_backend, rng, launch_gemv) -> tuple[list[np.ndarray], list[list[np.ndarray]], np.ndarray]:
    """``launch_gemv(dst, layer)`` right after late_copy(src -> dst), dst zeroed before: ``_eager_and_replayed``'s
    (eager, replayed) and the plain launch's bits."""
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    n, k = 1536, 7168  # Kimi-K2's qkv_a-sized row: 3 passes + a partial one; 192 blocks
    layer = cuda_backend.linear_weight(bf16_random(rng, n, k, scale=0.05))
    src = cuda_backend.upload(bf16_random(rng, 1, k))
    late = cupy.RawKernel(LATE_COPY, "late_copy")
    want = cupy.asnumpy(cuda_backend.linear(src, layer))

    def step():
        dst = cupy.zeros((1, k), cupy.uint16)
        late((1,), (256,), (src, dst, np.int32(k), np.int64(1_000_000)))
        return [launch_gemv(dst, layer)]

    return (*_eager_and_replayed(step), want)


def test_gemv_pdl_waits_for_a_late_writer(cuda_backend, rng, monkeypatch):
    """$OPENINFER_GEMV_PDL=1: gemv_m1 starts while the kernel before it still runs (that kernel lets it launch at
    once, then writes the GEMV's input ~0.5 ms later), issues its first pass of weights, waits, and reads the
    input as written: the plain launch's bits, eagerly and from a graph."""
    from openinfer.backend.cuda import linear as cuda_linear

    monkeypatch.delenv(cuda_linear.DECODE_PDL_ENV, raising=False)
    monkeypatch.setenv(cuda_linear.GEMV_PDL_ENV, "1")
    eager, replayed, want = _late_gemv(cuda_backend, rng, cuda_backend.linear)
    assert _same([eager, *replayed], [want])


def test_gemv_pdl_late_writer_control(cuda_backend, rng):
    """The control of test_gemv_pdl_waits_for_a_late_writer: gemv_m1 built WITHOUT the wait but PDL-launched after
    late_copy reads the input before it is written (so the late writer really overlaps the GEMV there)."""
    from openinfer.backend.cuda.linear import GEMV_WARPS_PER_BLOCK, NULL
    from openinfer.backend.cuda.loader import kernel
    from openinfer.backend.cuda.pdl_launch import launch

    def no_wait(x, layer):
        n, k = layer.weight.shape
        out = cupy.empty((1, n), cupy.uint16)
        launch(kernel("gemv.cu", "gemv_m1"), (-(-n // GEMV_WARPS_PER_BLOCK),), (GEMV_WARPS_PER_BLOCK * 32,),
               (x, layer.weight, NULL, out, np.int32(1), np.int32(n), np.int32(k)), after_previous=True)
        return out

    eager, replayed, want = _late_gemv(cuda_backend, rng, no_wait)
    assert all(not np.array_equal(run[0], want) for run in [eager, *replayed])


def test_silu_mul_add_gather(cuda_backend, rng):
    gate_up = bf16_random(rng, 21, 2 * 384, scale=2.0)
    out = cuda_backend.to_host(cuda_backend.silu_mul(cuda_backend.upload(gate_up)))
    assert relative_error(out, REF.silu_mul(gate_up)) < BF16_TOL
    a, b = bf16_random(rng, 5, 96), bf16_random(rng, 5, 96)
    assert np.array_equal(cuda_backend.to_host(cuda_backend.add(cuda_backend.upload(a), cuda_backend.upload(b))),
                          round_to_bf16(a + b))
    table = bf16_random(rng, 50, 72)
    ids = rng.integers(0, 50, size=13).astype(np.int32)
    assert np.array_equal(cuda_backend.to_host(cuda_backend.embedding(cuda_backend.weight(table), cupy.asarray(ids))),
                          table[ids])
    assert np.array_equal(cuda_backend.to_host(cuda_backend.gather_rows(cuda_backend.upload(table), ids)), table[ids])


@pytest.mark.parametrize("rows,half", [(1, 9728), (21, 384), (3, 100), (7, 12)])
def test_silu_mul_kernels_give_the_same_bits(cuda_backend, rng, rows, half):
    """The 8-wide kernel (half % 8 == 0) and the one-element kernel agree bit for bit."""
    from openinfer.backend.cuda.loader import kernel

    gate_up = cuda_backend.upload(bf16_random(rng, rows, 2 * half, scale=3.0))
    out = cuda_backend.silu_mul(gate_up)
    scalar = cupy.empty_like(out)
    kernel("elementwise.cu", "silu_mul")((64,), (256,), (gate_up, scalar, np.int64(rows), np.int32(half)))
    assert np.array_equal(cuda_backend.to_host(out), cuda_backend.to_host(scalar))
    assert relative_error(cuda_backend.to_host(out), REF.silu_mul(cuda_backend.to_host(gate_up))) < BF16_TOL


def test_large_float32_weight_is_narrowed_on_the_gpu(cuda_backend, rng):
    w = rng.standard_normal((300, 301)).astype(np.float32)  # not bf16-representable: rounding matters
    assert np.array_equal(cuda_backend.to_host(cuda_backend.weight(w)), round_to_bf16(w))
