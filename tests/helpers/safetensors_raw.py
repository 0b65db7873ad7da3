"""Write safetensors files with any dtype tag (F8_E4M3, F8_E8M0, BF16 …), which
``safetensors.numpy`` cannot spell: each value is ``(dtype, array of the stored bytes)``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_TAGS = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
         np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8", np.dtype(np.float16): "F16"}


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray | tuple[str, np.ndarray]]) -> None:
    header: dict[str, dict] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, value in tensors.items():
        dtype, array = value if isinstance(value, tuple) else (_TAGS[np.asarray(value).dtype], value)
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(np.shape(array)), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
