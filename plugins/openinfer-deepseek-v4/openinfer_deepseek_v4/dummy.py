"""``--load-format dummy`` for DeepSeek-V4: the checkpoint interface the loader reads
(``DeepseekV4Checkpoint``), answered with noise at the shapes it asks for — no file on disk.

Benchmarks of shapes no checkpoint here holds (DeepSeek-V4-Flash: ~150 GB) load through the
ordinary ``load_weights``. Dense tensors are float32 noise (views into one shared pool, grown
to the largest request: no per-tensor generation); routed experts answer ``stored_quantized``
as FP4 e2m1 codes (random bytes from a pool) with e8m0 scales of 2^-8, so the cuda backend
keeps them packed exactly as it keeps a real FP4 checkpoint's. Norm weights are ``1 + noise``;
hash-routing tables send each token to ``top_k`` distinct experts.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import numpy as np

from openinfer import WeightLoadError
from openinfer_deepseek_v4.config import CSA, DeepseekV4Config

NOISE_SCALE = 0.02
FP4_SCALE_E8M0 = 127 - 8  # 2^-8: codes up to ±6 give weights up to ±0.023
_SLACK = 1 << 16
_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.(w1|w2|w3)$")
_INDEXER = re.compile(r"^layers\.(\d+)\.attn\.indexer\.")


class DummyDeepseekV4Checkpoint:
    def __init__(self, config: DeepseekV4Config, seed: int = 0):
        self.config = config
        self.model_dir = Path("<dummy>")
        self._rng = np.random.default_rng(seed)
        self._noise = np.zeros(0, np.float32)
        self._bytes = np.zeros(0, np.uint8)
        self.is_model_parallel = False

    def __contains__(self, name: str) -> bool:
        if name.startswith("mtp."):  # the multi-token-prediction block is not served
            return False
        indexer = _INDEXER.match(name)
        if indexer is not None:
            return self.config.layer_types[int(indexer.group(1))] == CSA
        return True

    def _pool(self, count: int) -> np.ndarray:
        if self._noise.size < count + _SLACK:
            self._noise = self._rng.standard_normal(count + _SLACK, dtype=np.float32) * NOISE_SCALE
        return self._noise

    def _values(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        offset = zlib.crc32(name.encode()) % _SLACK
        values = self._pool(count)[offset: offset + count].reshape(shape)
        return values + 1.0 if name.endswith("norm.weight") else values

    def weight(self, module: str, shape: tuple[int, ...]) -> np.ndarray:
        return self._values(f"{module}.weight", tuple(shape))

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return self._values(name, tuple(shape))

    def raw(self, name: str) -> np.ndarray:
        c = self.config
        if name.endswith("gate.tid2eid"):  # top_k distinct experts per token, spread evenly
            base = np.arange(c.vocab_size, dtype=np.int64)[:, None] * 7919
            stride = max(1, c.n_routed_experts // c.num_experts_per_tok)
            return (base + np.arange(c.num_experts_per_tok, dtype=np.int64)[None, :] * stride) % c.n_routed_experts
        raise WeightLoadError(f"the dummy DeepSeek-V4 checkpoint has no raw tensor {name!r}")

    def get(self, name: str) -> np.ndarray:
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if _EXPERT.match(module):
            return self._values(name, self._expert_shape(module))
        raise WeightLoadError(f"the dummy DeepSeek-V4 checkpoint answers {name!r} only through weight() / vector()")

    def _expert_shape(self, module: str) -> tuple[int, int]:
        c = self.config
        return ((c.hidden_size, c.moe_intermediate_size) if module.endswith("w2")
                else (c.moe_intermediate_size, c.hidden_size))

    def stored_quantized(self, module: str) -> tuple[str, np.ndarray, np.ndarray] | None:
        """Routed experts as FP4 e2m1 (packed pairs + e8m0 scales per 32 inputs); None for the rest."""
        if not _EXPERT.match(module):
            return None
        out_features, in_features = self._expert_shape(module)
        if in_features % 32:
            return None
        count = out_features * in_features // 2
        if self._bytes.size < count + _SLACK:
            self._bytes = self._rng.integers(0, 256, size=count + _SLACK, dtype=np.uint8)
        offset = zlib.crc32(module.encode()) % _SLACK
        codes = self._bytes[offset: offset + count].reshape(out_features, in_features // 2)
        scales = np.full((out_features, in_features // 32), FP4_SCALE_E8M0, np.uint8)
        return "fp4", codes, scales
