"""DeepSeek-V4 rotary embedding: *interleaved* pairs (2i, 2i+1) on the **last** ``rope_dim``
channels of a head, angles computed per call from the positions (no table: contexts reach 1M).

Sliding-only layers use the "main" parameters (θ = 1e4); CSA/HCA layers, their compressors and
the indexer use "compress" (θ = 1.6e5, YaRN without mscale). The attention output is rotated
back with the conjugate (−θ at the query position), since K = V carried the rotation into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from openinfer import RopeParameters
from openinfer.rope import inverse_frequencies


@dataclass(frozen=True, eq=False)
class InterleavedRope:
    inv_freq: np.ndarray  # [rope_dim // 2] float32
    rope_dim: int

    @classmethod
    def create(cls, params: RopeParameters, rope_dim: int) -> InterleavedRope:
        # core's YaRN derives the factor from max_position_embeddings / original; hand it the
        # product so the configured factor is the one used (as the reference does)
        original = params.get("original_max_position_embeddings") or 1
        max_positions = int(round(float(params.get("factor", 1.0)) * float(original)))
        inv_freq, scaling = inverse_frequencies(params, rope_dim, max_positions)
        if scaling != 1.0:
            raise ValueError("DeepSeek-V4 RoPE never scales cos/sin (attention_factor must be 1)")
        return cls(inv_freq.astype(np.float32), rope_dim)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        angles = np.asarray(positions, np.float32)[:, None] * self.inv_freq[None, :]
        return np.cos(angles), np.sin(angles)

    def apply(self, x: np.ndarray, positions: np.ndarray, inverse: bool = False) -> np.ndarray:
        """Rotate ``x`` ``[T, ..., dim]`` at ``positions`` ``[T]``; returns a new array."""
        cos, sin = self.cos_sin(positions)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (self.rope_dim // 2,)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        out = np.array(x, dtype=np.float32, copy=True)
        even = x[..., -self.rope_dim::2]
        odd = x[..., -self.rope_dim + 1::2]
        out[..., -self.rope_dim::2] = even * cos - odd * sin
        out[..., -self.rope_dim + 1::2] = odd * cos + even * sin
        return out
