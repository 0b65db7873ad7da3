"""Weights to the GPU through the staging ring, fused rows placed on the device, and kernels
found by a dry forward compiled in parallel: the same bits and kernels as the plain paths."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(3,), (1000, 17), (2048, 4096), (3001, 2561)])
def test_upload_is_bit_exact_at_every_size(cuda_backend, rng, shape):
    from openinfer.backend.cuda.weight_upload import WeightUploader

    host = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    uploader = WeightUploader(cuda_backend.device.id, num_threads=3, chunk_bytes=1 << 20, num_buffers=4)
    try:
        device = uploader.upload(host)
        assert device.dtype == cupy.uint16 and device.shape == shape
        np.testing.assert_array_equal(device.get(), host)
        offset = rng.integers(0, 64) * 2
        out = cupy.full(host.size + 64, 7, dtype=cupy.uint16)
        uploader.upload(host, out, int(offset))
        got = out.get()
        np.testing.assert_array_equal(got[offset // 2: offset // 2 + host.size], host.reshape(-1))
        assert (got[: offset // 2] == 7).all() and (got[offset // 2 + host.size:] == 7).all()
    finally:
        uploader.close()


def test_reading_chunks_from_the_file_gives_the_mapped_bits(cuda_backend, rng, tmp_path):
    """OPENINFER_UPLOAD_READS=read: a checkpoint tensor (and a row slice of it, a fused part's
    source) is read from its file into the staging ring: the same bits as a copy out of the map."""
    from openinfer.backend.cuda.weight_upload import WeightUploader
    from openinfer.weights import Checkpoint, write_safetensors

    big = rng.integers(0, 2**16, size=(3001, 2561), dtype=np.uint16)
    write_safetensors(tmp_path / "model.safetensors", {"pad": rng.standard_normal(77).astype(np.float32),
                                                        "big": ("BF16", big)})
    tensor = Checkpoint(tmp_path).raw("big")
    uploader = WeightUploader(cuda_backend.device.id, num_threads=3, chunk_bytes=1 << 20, read_files=True)
    try:
        np.testing.assert_array_equal(uploader.upload(tensor).get(), big)
        np.testing.assert_array_equal(uploader.upload(tensor[1000:]).get(), big[1000:])
        np.testing.assert_array_equal(uploader.upload(np.ascontiguousarray(tensor[:, :7])).get(), big[:, :7])
    finally:
        uploader.close()


def test_upload_refuses_a_destination_too_small(cuda_backend, rng):
    """``upload`` and ``upload_all`` check each destination alike, before any copy starts."""
    from openinfer.backend.cuda.weight_upload import WeightUploader

    uploader = WeightUploader(cuda_backend.device.id, num_threads=1, chunk_bytes=1 << 20, num_buffers=2)
    try:
        with pytest.raises(ValueError, match="cannot copy"):
            uploader.upload(np.zeros(100, np.uint16), cupy.empty(50, dtype=cupy.uint16))
        untouched = cupy.full(100, 7, dtype=cupy.uint16)
        with pytest.raises(ValueError, match="cannot copy 200 bytes at offset 2 into a device array of 200"):
            uploader.upload_all([(np.zeros(100, np.uint16), untouched, 0), (np.zeros(100, np.uint16), untouched, 2)])
        assert (untouched.get() == 7).all()
        with pytest.raises(ValueError, match="non-contiguous"):
            uploader.upload_all([(np.zeros(50, np.uint16), cupy.empty(200, dtype=cupy.uint16)[::2], 0)])
    finally:
        uploader.close()


@pytest.mark.parametrize("shape", [(0,), (7,), (128, 48), (600, 1000)])  # the last one past SMALL_BYTES
def test_upload_vector_keeps_the_values_and_converts_when_asked(cuda_backend, rng, shape):
    from openinfer.backend.cuda.weight_upload import upload_vector

    values = rng.standard_normal(shape)  # float64 on the host
    kept = upload_vector(values, np.float32)
    assert kept.dtype == cupy.float32 and kept.shape == shape
    np.testing.assert_array_equal(kept.get(), values.astype(np.float32))
    as_is = upload_vector(values[..., ::-1])  # not contiguous: copied as is, dtype kept
    assert as_is.dtype == cupy.float64
    np.testing.assert_array_equal(as_is.get(), values[..., ::-1])


def test_upload_vector_does_not_wait_for_the_legacy_stream(cuda_backend):
    """The vector's copy runs on the uploader's own non-blocking stream: it returns while a kernel
    queued on the legacy default stream still spins (on the legacy stream it would wait for it)."""
    from openinfer.backend.cuda.weight_upload import upload_vector

    spin = cupy.RawKernel(r"""
    extern "C" __global__ void spin(long long cycles) {
        const long long start = clock64();
        while (clock64() - start < cycles) {}
    }""", "spin")
    legacy = cupy.cuda.Stream.null
    warm = upload_vector(np.zeros(64, np.float32))  # the uploader made, its pools holding a block
    del warm
    with legacy:
        spin((1,), (1,), (np.int64(4_000_000_000),))  # ~2 s at 2 GHz
    kept = upload_vector(np.arange(64, dtype=np.float32))
    assert not legacy.done  # returned before the spin ended
    np.testing.assert_array_equal(kept.get(), np.arange(64, dtype=np.float32))
    legacy.synchronize()


def test_fused_linear_weight_equals_the_host_fused_matrix(cuda_backend, rng):
    from openinfer.layers import fuse_rows, fused_linear_weight

    parts = [rng.integers(0, 2**16, size=(rows, 640), dtype=np.uint16) for rows in (1024, 256, 256)]
    biases = [rng.standard_normal(p.shape[0]).astype(np.float32) for p in parts]
    fused = fused_linear_weight(cuda_backend, parts, biases)
    reference = cuda_backend.linear_weight(fuse_rows(*parts), fuse_rows(*biases))
    np.testing.assert_array_equal(fused.weight.get(), reference.weight.get())
    np.testing.assert_array_equal(fused.bias.get(), reference.bias.get())


def test_float32_weights_are_narrowed_as_before(cuda_backend, rng):
    from openinfer.backend.cuda.bf16 import float_to_bf16_bits

    values = rng.standard_normal((300, 400)).astype(np.float32)
    np.testing.assert_array_equal(cuda_backend.weight(values).get(), float_to_bf16_bits(values))


def test_discovered_kernels_are_the_ones_a_forward_compiles(cuda_backend, rng):
    from openinfer.backend.cuda import loader

    x = cupy.asarray(rng.integers(0, 2**16, size=(4, 96), dtype=np.uint16) & 0x3FFF)
    weight = cupy.asarray(rng.integers(0, 2**16, size=96, dtype=np.uint16) & 0x3FFF)
    source, defines = "rms_norm.cu", {"OPENINFER_TEST_VARIANT": int(rng.integers(1, 2**30))}  # never compiled yet
    with loader.discover_kernels() as wanted:
        assert loader.kernel(source, "rms_norm", **defines)((4,), (64,), (x, weight, x, np.int32(96),
                                                                             np.float32(1e-6))) is None
    key = (source, "rms_norm", tuple(defines.items()))
    assert wanted == {key}
    assert loader.compile_kernels(wanted, cuda_backend.device.id) == 1
    assert loader.compile_kernels(wanted, cuda_backend.device.id) == 0  # already built


@pytest.mark.parametrize("switches", [{}, {"OPENINFER_UPLOAD_ALL": "1"}, {"OPENINFER_WEIGHTS_JOIN": "serve"}])
def test_deferred_uploads_land_the_same_bits_once_waited_for(cuda_backend, rng, monkeypatch, switches):
    """OPENINFER_DEFERRED_WEIGHTS' load: under ``deferred_uploads`` bf16 weights (plain and fused
    rows) are allocated and queued, fp32 ones narrowed at once as before; after ``start`` and
    ``wait_for_deferred_uploads`` every array holds the bits a plain upload gives (also with every
    chunk handed to the threads at once, and with the legacy-stream sync of OPENINFER_WEIGHTS_JOIN=serve)."""
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    from openinfer.backend.cuda.bf16 import float_to_bf16_bits
    from openinfer.backend.cuda.weight_upload import deferred_uploads, wait_for_deferred_uploads
    from openinfer.layers import fuse_rows, fused_linear_weight

    plain = rng.integers(0, 2**16, size=(3001, 2561), dtype=np.uint16)
    small = rng.integers(0, 2**16, size=(7, 5), dtype=np.uint16)
    parts = [rng.integers(0, 2**16, size=(rows, 640), dtype=np.uint16) for rows in (1024, 256, 256)]
    wide = rng.standard_normal((300, 400)).astype(np.float32)
    with deferred_uploads() as copies:
        on_device = [cuda_backend.weight(plain), cuda_backend.weight(small)]
        fused = fused_linear_weight(cuda_backend, parts)
        narrowed = cuda_backend.weight(wide)
    assert len(copies.copies) == 2 + len(parts) and copies.nbytes == plain.nbytes + small.nbytes + sum(p.nbytes for p in parts)
    np.testing.assert_array_equal(narrowed.get(), float_to_bf16_bits(wide))  # not deferred
    copies.start()
    wait_for_deferred_uploads()
    assert not copies.copies  # host arrays dropped
    np.testing.assert_array_equal(on_device[0].get(), plain)
    np.testing.assert_array_equal(on_device[1].get(), small)
    np.testing.assert_array_equal(fused.weight.get(), fuse_rows(*parts))
    wait_for_deferred_uploads()  # nothing pending: returns at once
