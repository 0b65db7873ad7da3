"""``--load-format dummy``: a checkpoint made of random values at the real shapes.

``DummyCheckpoint`` answers the reader interface of ``openinfer.Checkpoint`` (``names``,
``shape``, ``get``, ``raw``, ``expect_shape``) from a table of tensor shapes that a model
family derives from config.json alone, so the ordinary loader (fusing, sharding, placing)
runs unchanged with no file on disk. Values are views into one shared pool of normal noise
at a per-name offset (no per-tensor generation: loading a 100-GB shape costs what copying it
to the device costs); norm weights are ``1 + noise`` so activations keep their scale.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from openinfer.errors import WeightLoadError

NOISE_SCALE = 0.02
_POOL_SLACK = 1 << 16  # distinct offsets per tensor


class DummyCheckpoint:
    def __init__(self, shapes: Mapping[str, tuple[int, ...]], seed: int = 0, dtype: str = "BF16"):
        self.model_dir = Path("<dummy>")
        self.shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        self._dtype = dtype
        largest = max((int(np.prod(s, dtype=np.int64)) for s in self.shapes.values()), default=1)
        rng = np.random.default_rng(seed)
        noise = rng.standard_normal(largest + _POOL_SLACK, dtype=np.float32) * NOISE_SCALE
        # The pool holds bf16-representable values (low 16 bits cleared) and their bf16 bits, so
        # ``raw`` is a view too: converting every tensor float32 -> bf16 on one core was most of
        # a dummy start (~25 s for Qwen3-4B); ``raw(name)`` stays equal to bf16(``get(name)``).
        bits = noise.view(np.uint32)
        bits &= np.uint32(0xFFFF0000)
        self._pool = noise
        self._pool_bf16 = (bits >> np.uint32(16)).astype(np.uint16)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def names(self) -> Iterable[str]:
        return self.shapes.keys()

    def items_with_prefix(self, prefix: str) -> Iterator[str]:
        return (n for n in self.shapes if n.startswith(prefix))

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise WeightLoadError(f"tensor {name!r} is not part of the dummy checkpoint")
        return self.shapes[name]

    def dtype(self, name: str) -> str:
        self.shape(name)
        return self._dtype

    def expect_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if self.shape(name) != tuple(shape):
            raise WeightLoadError(f"dummy tensor {name!r} has shape {self.shape(name)}, expected {tuple(shape)}")

    def _window(self, name: str) -> tuple[tuple[int, ...], slice]:
        shape = self.shape(name)
        offset = zlib.crc32(name.encode()) % _POOL_SLACK
        return shape, slice(offset, offset + int(np.prod(shape, dtype=np.int64)))

    @staticmethod
    def _is_norm(name: str) -> bool:
        return name.endswith("norm.weight")  # layernorm.weight too

    def get(self, name: str) -> np.ndarray:
        shape, window = self._window(name)
        values = self._pool[window].reshape(shape)
        return values + 1.0 if self._is_norm(name) else values

    def raw(self, name: str) -> np.ndarray:
        from openinfer.weights import float32_to_bf16

        if self._is_norm(name):  # 1 + noise: small vectors, converted
            return float32_to_bf16(self.get(name))
        shape, window = self._window(name)
        return self._pool_bf16[window].reshape(shape)
