"""Safetensors checkpoints without PyTorch: a memory-mapped reader, bf16 included.

A checkpoint is a directory with ``model.safetensors``, or shards listed by
``model.safetensors.index.json``, or any ``*.safetensors`` files. Tensors are read lazily
from mmap'd files; bf16 tensors come back as raw ``uint16`` (``raw``) or widened to float32
(``get``) by a shift, so no framework is needed.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openinfer.errors import WeightLoadError
from openinfer.quant import (
    FP8_BLOCK,
    QuantConfig,
    dequantize_fp4_e2m1,
    dequantize_fp8_block,
    dequantize_int4_group,
    e8m0_to_float32,
    fp8_e4m3_to_float32,
)

# safetensors dtype -> numpy dtype of the raw storage
_RAW_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8,
    "F4": np.uint8,  # e2m1 pairs: the header gives the logical shape, each byte holds two values
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


def mapped_file_region(host: np.ndarray) -> tuple[str, int] | None:
    """``(path, byte offset)`` of a C-contiguous array whose bytes are a plain view of a
    read-only ``np.memmap`` of a whole file (what ``Checkpoint.raw`` returns), else None."""
    if not host.flags.c_contiguous:
        return None
    root = host
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root, np.memmap) or not isinstance(root.base, mmap.mmap) or not root.filename:
        return None
    if root.flags.writeable:  # a writable map may hold bytes the file does not have yet
        return None
    start = host.ctypes.data - root.ctypes.data
    if start < 0 or start + host.nbytes > root.nbytes:
        return None
    return str(root.filename), int(root.offset) + start


_STORED_TAGS = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
                np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8", np.dtype(np.float16): "F16"}


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray | tuple[str, np.ndarray]]) -> None:
    """Write one safetensors file. A value is an array of a NumPy dtype, or ``(tag, stored bytes)``
    for the dtypes NumPy cannot spell (``("BF16", uint16 bits)``, ``("F8_E4M3", uint8)``,
    ``("F8_E8M0", uint8)``): the counterpart of ``Checkpoint`` for quantized and bf16 checkpoints."""
    header: dict[str, dict] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, value in tensors.items():
        tag, array = value if isinstance(value, tuple) else (_STORED_TAGS[np.asarray(value).dtype], value)
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": tag, "shape": list(np.shape(array)), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    Path(path).write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


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
        shape = info.shape
        if info.dtype == "F4":  # returned packed, [..., last / 2] bytes (low nibble = even element)
            if not shape or shape[-1] % 2:
                raise WeightLoadError(f"F4 tensor {name!r} has shape {shape}; its last dimension must be even")
            shape = (*shape[:-1], shape[-1] // 2)
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(mapped, dtype=raw_dtype, count=count, offset=info.start).reshape(shape)

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32: bf16/fp16 widened, FP8 e4m3 and e8m0 decoded (no scales applied;
        ``linear`` applies a quantized weight's scales)."""
        info = self._info(name)
        raw = self.raw(name)
        if info.dtype == "BF16":
            return bf16_to_float32(raw)
        if info.dtype == "F8_E4M3":
            return fp8_e4m3_to_float32(raw)
        if info.dtype == "F8_E8M0":
            return e8m0_to_float32(raw)
        if info.dtype == "F8_E5M2":
            raise WeightLoadError(f"tensor {name!r} is F8_E5M2, which no supported format uses")
        return raw.astype(np.float32)

    def stored_linear(self, module: str, quant: QuantConfig | None = None,
                      shape: tuple[int, int] | None = None) -> StoredLinear:
        """The weight of linear ``module`` (``<module>.weight`` or its quantized spelling) as
        stored, checked against ``shape`` ``[out, in]`` and ``quant`` from headers only — so a bad
        checkpoint fails before anything is read or placed on a device."""
        return _stored_linear(self, module, quant or QuantConfig(), shape)

    def linear(self, module: str, quant: QuantConfig | None = None, shape: tuple[int, int] | None = None) -> np.ndarray:
        """Linear ``module``'s weight ``[out, in]`` as float32, dequantized if stored quantized."""
        return self.stored_linear(module, quant, shape).dequantize(self)

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


@dataclass(frozen=True)
class StoredLinear:
    """How one linear weight is stored: ``format`` is ``dense`` (any float dtype), ``fp8_block``
    (e4m3 + per-block ``scale`` f32 or e8m0), ``int4_group`` (pack-quantized + bf16 group scales)
    or ``fp4_group`` (e2m1 pairs + e8m0 group scales). ``tensors`` names the checkpoint tensors;
    ``shape`` is the logical ``[out, in]``."""

    module: str
    format: str
    shape: tuple[int, int]
    tensors: tuple[tuple[str, str], ...]  # (role, checkpoint tensor name)
    block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)

    def tensor(self, role: str) -> str:
        return dict(self.tensors)[role]

    def dequantize(self, checkpoint: Checkpoint) -> np.ndarray:
        weight = self.tensor("weight")
        if self.format == "dense":
            return checkpoint.get(weight)
        if self.format == "fp8_block":
            return dequantize_fp8_block(checkpoint.raw(weight), checkpoint.get(self.tensor("scale")), self.block,
                                        name=weight)
        if self.format == "int4_group":
            return dequantize_int4_group(checkpoint.raw(weight), checkpoint.get(self.tensor("scale")), self.shape,
                                         name=self.module + ".weight")
        if self.format == "fp4_group":
            return dequantize_fp4_e2m1(checkpoint.raw(weight), checkpoint.raw(self.tensor("scale")), name=weight)
        raise WeightLoadError(f"{self.module}: unknown stored format {self.format!r}")


def _stored_linear(ckpt: Checkpoint, module: str, quant: QuantConfig, shape: tuple[int, int] | None) -> StoredLinear:
    packed = f"{module}.weight_packed"
    if packed in ckpt:
        scale, shape_name = f"{module}.weight_scale", f"{module}.weight_shape"
        for needed in (scale, shape_name):
            ckpt._info(needed)  # missing → WeightLoadError naming it
        logical = tuple(int(v) for v in ckpt.raw(shape_name).reshape(-1))
        if len(logical) != 2:
            raise WeightLoadError(f"tensor {shape_name!r} must hold [out, in], found {list(logical)}")
        if shape is not None and logical != tuple(shape):
            raise WeightLoadError(f"tensor {shape_name!r} says {list(logical)}, the config implies {list(shape)}")
        out_features, in_features = logical
        ckpt.expect_shape(packed, (out_features, -(-in_features // 8)))
        if ckpt.dtype(packed) != "I32":
            raise WeightLoadError(f"tensor {packed!r} is {ckpt.dtype(packed)}; pack-quantized words are I32")
        if quant.method == "int4" and in_features % quant.group_size == 0:
            ckpt.expect_shape(scale, (out_features, in_features // quant.group_size))
        elif quant.method == "int4":
            raise WeightLoadError(f"{module}: in_features {in_features} is not a multiple of "
                                  f"quantization_config group_size {quant.group_size}")
        else:
            raise WeightLoadError(f"{module} is INT4 pack-quantized but config.json has no compressed-tensors "
                                  "quantization_config")
        return StoredLinear(module, "int4_group", (out_features, in_features),
                            (("weight", packed), ("scale", scale)))
    weight = f"{module}.weight"
    dtype = ckpt.dtype(weight)  # missing → WeightLoadError naming it
    stored_shape = ckpt.shape(weight)
    if dtype == "F8_E4M3":
        if shape is not None:
            ckpt.expect_shape(weight, shape)
        scale = next((n for n in (f"{module}.weight_scale_inv", f"{module}.scale") if n in ckpt), None)
        if scale is None:
            raise WeightLoadError(f"FP8 tensor {weight!r} has no {module}.weight_scale_inv (or .scale) beside it")
        block = quant.block
        expected = (-(-stored_shape[0] // block[0]), -(-stored_shape[1] // block[1]))
        ckpt.expect_shape(scale, expected)
        return StoredLinear(module, "fp8_block", (stored_shape[0], stored_shape[1]),
                            (("weight", weight), ("scale", scale)), block)
    scale = f"{module}.scale"
    if dtype in ("I8", "U8") and scale in ckpt and ckpt.dtype(scale) == "F8_E8M0":
        logical = (stored_shape[0], stored_shape[1] * 2)
        if shape is not None and logical != tuple(shape):
            raise WeightLoadError(f"FP4 tensor {weight!r} holds {list(logical)} values, the config implies "
                                  f"{list(shape)}")
        if ckpt.shape(scale)[0] != logical[0] or logical[1] % ckpt.shape(scale)[1]:
            raise WeightLoadError(f"tensor {scale!r} has shape {ckpt.shape(scale)}, not whole groups of "
                                  f"a {logical} weight")
        return StoredLinear(module, "fp4_group", logical, (("weight", weight), ("scale", scale)))
    if dtype not in ("F32", "BF16", "F16", "F64"):
        raise WeightLoadError(f"tensor {weight!r} is {dtype}, which is no float dtype and has no known "
                              "quantization scales beside it")
    if shape is not None:
        ckpt.expect_shape(weight, shape)
    return StoredLinear(module, "dense", (stored_shape[0], stored_shape[1]), (("weight", weight),))
