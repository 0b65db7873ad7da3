"""Rotary position embeddings: inverse frequencies for every scaling type HF configs use, and
the cos/sin tables the backends read.

Config spellings handled: legacy ``rope_theta`` + ``rope_scaling`` ({"type"|"rope_type": ...})
and transformers 5.x ``rope_parameters`` ({"rope_type", "rope_theta", "partial_rotary_factor",
...}). Supported types: default, linear, yarn, llama3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer.errors import WeightLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass(frozen=True)
class RopeParameters:
    theta: float
    rope_type: str = "default"
    scaling: tuple[tuple[str, Any], ...] = ()
    partial_rotary_factor: float = 1.0

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.scaling).get(key, default)


def rope_parameters_from_config(config: dict[str, Any], default_theta: float = 10000.0) -> RopeParameters:
    """Read RoPE settings from a (text) config in either the legacy or the 5.x spelling.

    For the scaled types (yarn, llama3) ``original_max_position_embeddings`` is resolved here as
    transformers 5.x does: a top-level config field wins (Phi-3 style), else the scaling dict's
    own, else ``max_position_embeddings`` (what a config saved by transformers 5 implies).
    """
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    merged: dict[str, Any] = {}
    if isinstance(scaling, dict):
        merged.update(scaling)
    if isinstance(params, dict):
        merged.update(params)
    theta = float(merged.pop("rope_theta", config.get("rope_theta", default_theta)))
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    partial = float(merged.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise WeightLoadError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type in ("yarn", "llama3"):
        if config.get("original_max_position_embeddings"):
            merged["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif not merged.get("original_max_position_embeddings") and config.get("max_position_embeddings"):
            merged["original_max_position_embeddings"] = config["max_position_embeddings"]
    return RopeParameters(theta, rope_type, tuple(sorted(merged.items())), partial)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(params: RopeParameters, rotary_dim: int,
                        max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(inv_freq [rotary_dim/2] float64, attention scaling applied to cos and sin)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / (params.theta**exponents)
    if params.rope_type == "default":
        return inv_freq, 1.0
    configured_factor = params.get("factor")
    factor = 1.0 if configured_factor is None else float(configured_factor)
    if params.rope_type == "linear":
        return inv_freq / factor, 1.0
    if params.rope_type == "llama3":
        low_freq_factor = float(params.get("low_freq_factor", 1.0))
        high_freq_factor = float(params.get("high_freq_factor", 4.0))
        old_context = float(params.get("original_max_position_embeddings") or max_position_embeddings)
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    # yarn, as transformers 5.x computes it: the configured factor is used as given (HF only warns
    # when it disagrees with max_position_embeddings / original_max_position_embeddings); that
    # ratio stands in only for a config without a factor (DeepSeek-V3 style).
    original_max = float(params.get("original_max_position_embeddings") or max_position_embeddings)
    if configured_factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(params.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq, float(attention_factor)


@dataclass(frozen=True, eq=False)
class RotaryEmbedding:
    """cos/sin tables ``[max_positions, rotary_dim // 2]`` (float32, attention scaling folded in).

    NeoX layout: a head's first ``rotary_dim`` dims are rotated as two halves; the rest pass through.
    """

    head_dim: int
    rotary_dim: int
    cos: np.ndarray
    sin: np.ndarray

    @classmethod
    def create(cls, head_dim: int, params: RopeParameters, max_positions: int,
               max_position_embeddings: int | None = None) -> RotaryEmbedding:
        rotary_dim = int(head_dim * params.partial_rotary_factor)
        rotary_dim -= rotary_dim % 2
        inv_freq, scaling = inverse_frequencies(params, rotary_dim, max_position_embeddings or max_positions)
        # HF computes the angles in float32; do the same so long positions agree bit for bit.
        inv_freq32 = inv_freq.astype(np.float32)
        angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq32[None, :]
        return cls(head_dim, rotary_dim,
                   (np.cos(angles) * np.float32(scaling)).astype(np.float32),
                   (np.sin(angles) * np.float32(scaling)).astype(np.float32))
