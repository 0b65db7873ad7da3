"""Safetensors checkpoints without PyTorch: a memory-mapped reader, bf16 included.

A checkpoint is a directory with ``model.safetensors``, or shards listed by
``model.safetensors.index.json``, or any ``*.safetensors`` files. Tensors are read lazily
from mmap'd files; bf16 tensors come back as raw ``uint16`` (``raw``) or widened to float32
(``get``) by a shift, so no framework is needed.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openinfer.errors import WeightLoadError

# safetensors dtype -> numpy dtype of the raw storage
_RAW_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8,
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors spelling: "BF16", "F32", ...
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen bf16 stored as uint16 to float32 (exact)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (round-to-nearest-even), returned as uint16."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)


def _read_header(path: Path) -> dict:
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise WeightLoadError(f"{path} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > 100_000_000:
            raise WeightLoadError(f"{path} has an implausible safetensors header ({length} bytes)")
        try:
            return json.loads(handle.read(length))
        except json.JSONDecodeError as exc:
            raise WeightLoadError(f"{path} has a corrupt safetensors header: {exc}") from exc


class Checkpoint:
    """All tensors of a checkpoint directory, by name."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, np.memmap] = {}
        for file in self._files():
            header = _read_header(file)
            data_start = 8 + struct.unpack("<Q", open(file, "rb").read(8))[0]
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                begin, end = meta["data_offsets"]
                self.tensors[name] = TensorInfo(file, meta["dtype"], tuple(meta["shape"]),
                                                data_start + begin, data_start + end)
        if not self.tensors:
            raise WeightLoadError(f"no tensors found in {self.model_dir}; expected *.safetensors files")

    def _files(self) -> list[Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({self.model_dir / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise WeightLoadError(f"shards listed in {index} are missing: {missing}")
            return files
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"no *.safetensors in {self.model_dir}")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def items_with_prefix(self, prefix: str) -> Iterator[str]:
        return (n for n in self.tensors if n.startswith(prefix))

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (bf16 as uint16), memory-mapped read-only."""
        info = self._info(name)
        raw_dtype = _RAW_DTYPES.get(info.dtype)
        if raw_dtype is None:
            raise WeightLoadError(f"tensor {name!r} has unsupported dtype {info.dtype}")
        mapped = self._maps.get(info.file)
        if mapped is None:
            mapped = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        count = int(np.prod(info.shape, dtype=np.int64))
        return np.frombuffer(mapped, dtype=raw_dtype, count=count, offset=info.start).reshape(info.shape)

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (bf16/fp16 widened)."""
        info = self._info(name)
        raw = self.raw(name)
        if info.dtype == "BF16":
            return bf16_to_float32(raw)
        return raw.astype(np.float32)

    def dtype(self, name: str) -> str:
        return self._info(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def _info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise WeightLoadError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        return info

    def expect_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if self.shape(name) != tuple(shape):
            raise WeightLoadError(
                f"tensor {name!r} has shape {self.shape(name)}, the config implies {tuple(shape)}; "
                "config.json and the weights disagree")
