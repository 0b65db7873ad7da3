"""``mapped_file_region``: where a checkpoint tensor's bytes lie in its file (the weight uploader
reads them from there with ``OPENINFER_UPLOAD_READS=read``)."""

import numpy as np

from openinfer.weights import Checkpoint, mapped_file_region, write_safetensors


def _checkpoint(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {
        "a": np.arange(100, dtype=np.float32),
        "b": ("BF16", np.arange(64, dtype=np.uint16).reshape(8, 8)),
    })
    return Checkpoint(tmp_path)


def test_a_tensor_and_its_row_slices_are_found_at_their_bytes(tmp_path):
    checkpoint = _checkpoint(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    for name in ("a", "b"):
        tensor = checkpoint.raw(name)
        for view in (tensor, tensor[2:], tensor[3:5]):
            path, offset = mapped_file_region(view)
            assert path == str(tmp_path / "model.safetensors")
            assert data[offset:offset + view.nbytes] == view.tobytes()


def test_arrays_not_plainly_mapped_have_no_region(tmp_path):
    tensor = _checkpoint(tmp_path).raw("b")
    assert mapped_file_region(tensor[:, :4]) is None  # not contiguous
    assert mapped_file_region(np.ascontiguousarray(tensor[:, :4])) is None  # a copy
    assert mapped_file_region(np.zeros(4)) is None
    writable = np.memmap(tmp_path / "w.bin", dtype=np.uint8, mode="w+", shape=(16,))
    assert mapped_file_region(writable) is None  # its bytes may not be in the file yet
