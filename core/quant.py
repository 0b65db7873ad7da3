"""Quantized weight formats: decoding (NumPy reference) and encoding (tests, dummy checkpoints).

Formats, as stored in safetensors:

* **FP8 e4m3, 128×128 block scales** (DeepSeek-V3 / Kimi-K2 ``quant_method: fp8``): ``weight``
  F8_E4M3 ``[out, in]`` plus ``weight_scale_inv`` F32 ``[⌈out/128⌉, ⌈in/128⌉]``, or (DeepSeek-V4)
  ``scale`` F8_E8M0 of the same shape. ``w[r, c] = fp8(q[r, c]) · s[r // 128, c // 128]``::

        in →   0 … 127 | 128 … 255 | …
      out 0…127  s[0,0] |  s[0,1]   |
        128…255  s[1,0] |  s[1,1]   |

* **INT4 pack-quantized** (compressed-tensors ``format: pack-quantized``, symmetric, per-group):
  ``weight_packed`` I32 ``[out, in/8]``, ``weight_scale`` BF16 ``[out, in/group]``,
  ``weight_shape`` I32 ``[2]``. Element j of a row is the nibble at bits ``4·(j % 8)`` of word
  ``j // 8`` (least significant first), stored offset by 8: ``q = nibble − 8`` ∈ [−8, 7];
  ``w = q · scale[row, j // group]``.

* **FP4 e2m1 with e8m0 group scales** (DeepSeek-V4 routed experts): ``weight`` I8/U8
  ``[out, in/2]``, two codes per byte with the **low nibble the even element**, codes
  ``[0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]``; ``scale`` F8_E8M0
  ``[out, in/32]``; ``w = code · 2^(e − 127)``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from openinfer.errors import WeightLoadError

FP8_BLOCK = 128
FP4_GROUP = 32
FP8_E4M3_MAX = 448.0
FP4_E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _fp8_e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bytes (bias 7, no infinities, 0x7f/0xff = NaN)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


FP8_E4M3_VALUES = _fp8_e4m3_table()


def fp8_e4m3_to_float32(raw: np.ndarray) -> np.ndarray:
    """Decode e4m3fn bytes (stored as uint8) to float32, exactly."""
    return FP8_E4M3_VALUES[np.asarray(raw).view(np.uint8)]


def float32_to_fp8_e4m3(values: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest e4m3fn value (saturating at ±448); returns the uint8 codes."""
    finite = np.arange(256)[~np.isnan(FP8_E4M3_VALUES)]
    table = FP8_E4M3_VALUES[finite]
    order = np.argsort(table, kind="stable")
    sorted_values, sorted_codes = table[order], finite[order]
    x = np.clip(np.asarray(values, np.float32), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    upper = np.clip(np.searchsorted(sorted_values, x), 1, len(sorted_values) - 1)
    lower = upper - 1
    pick_upper = np.abs(sorted_values[upper] - x) < np.abs(x - sorted_values[lower])
    return sorted_codes[np.where(pick_upper, upper, lower)].astype(np.uint8)


def e8m0_to_float32(raw: np.ndarray) -> np.ndarray:
    """Decode e8m0 exponent bytes: ``2^(e − 127)``; 0xff is NaN."""
    exponent = np.asarray(raw).view(np.uint8)
    values = np.exp2(exponent.astype(np.float64) - 127.0)
    values[exponent == 255] = np.nan
    return values.astype(np.float32)


def _expand_blocks(scales: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    rows = np.repeat(scales, block[0], axis=0)[: shape[0]]
    return np.repeat(rows, block[1], axis=1)[:, : shape[1]]


def dequantize_fp8_block(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
                         name: str = "weight") -> np.ndarray:
    """FP8 e4m3 ``[out, in]`` times per-block fp32 scales ``[⌈out/b0⌉, ⌈in/b1⌉]`` → float32."""
    out_features, in_features = codes.shape
    expected = (-(-out_features // block[0]), -(-in_features // block[1]))
    if tuple(scales.shape) != expected:
        raise WeightLoadError(f"{name}: block scales have shape {tuple(scales.shape)}, a {tuple(codes.shape)} "
                              f"weight with {block[0]}x{block[1]} blocks needs {expected}")
    return fp8_e4m3_to_float32(codes) * _expand_blocks(np.asarray(scales, np.float32), codes.shape, block)


def quantize_fp8_block(weight: np.ndarray, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``(codes uint8 [out, in], scale_inv float32 [⌈out/b0⌉, ⌈in/b1⌉])`` with each block's
    absolute max mapped to 448."""
    weight = np.asarray(weight, np.float32)
    rows, cols = -(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])
    padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
    padded[: weight.shape[0], : weight.shape[1]] = weight
    amax = np.abs(padded.reshape(rows, block[0], cols, block[1])).max(axis=(1, 3))
    scales = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
    codes = float32_to_fp8_e4m3(weight / _expand_blocks(scales, weight.shape, block))
    return codes, scales


def unpack_int4(packed: np.ndarray, in_features: int) -> np.ndarray:
    """int32 words ``[out, ⌈in/8⌉]`` → signed int8 ``[out, in]`` (nibble − 8, LSB first)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))
    nibbles = (words[..., None] >> shifts) & 0xF  # [out, words, 8]
    return (nibbles.reshape(words.shape[0], -1)[:, :in_features].astype(np.int8) - 8)


def pack_int4(values: np.ndarray) -> np.ndarray:
    """Signed int4 values ``[out, in]`` (−8..7) → int32 words ``[out, ⌈in/8⌉]``."""
    values = np.asarray(values)
    out_features, in_features = values.shape
    padded = np.zeros((out_features, -(-in_features // 8) * 8), np.uint32)
    padded[:, :in_features] = (values.astype(np.int32) + 8).astype(np.uint32)
    words = (padded.reshape(out_features, -1, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)
    return words.view(np.int32)


def dequantize_int4_group(packed: np.ndarray, scales: np.ndarray, shape: tuple[int, int],
                          name: str = "weight") -> np.ndarray:
    """INT4 pack-quantized → float32 ``shape``; the group size is ``in / scales.shape[1]``."""
    out_features, in_features = shape
    if packed.shape != (out_features, -(-in_features // 8)):
        raise WeightLoadError(f"{name}_packed has shape {tuple(packed.shape)}, a {shape} weight packs into "
                              f"{(out_features, -(-in_features // 8))} int32 words")
    if scales.ndim != 2 or scales.shape[0] != out_features or in_features % scales.shape[1]:
        raise WeightLoadError(f"{name}_scale has shape {tuple(scales.shape)}, which is no whole number of "
                              f"groups per row of a {shape} weight")
    group = in_features // scales.shape[1]
    q = unpack_int4(packed, in_features).astype(np.float32)
    return q * np.repeat(np.asarray(scales, np.float32), group, axis=1)


# The GPU decode GEMV's INT4 layout (core/kernels/moe.cu, INT4_TILED): 16 rows x 128 weights per
# 1024-byte chunk, chunks in (row block, k block) order, so a warp of the GEMV streams contiguous
# bytes. Group-32 scales only (a lane's 32 weights share one scale).
INT4_TILE_ROWS, INT4_TILE_K, INT4_TILE_GROUP = 16, 128, 32


def int4_tiling_fits(out_features: int, in_features: int, group: int) -> bool:
    """Whether a weight of this shape and group size has a tiled INT4 layout (``tile_int4``)."""
    return group == INT4_TILE_GROUP and out_features % INT4_TILE_ROWS == 0 and in_features % INT4_TILE_K == 0


def tile_int4(words, scales, xp=np, lane_groups: bool = False):
    """Stacked checkpoint-layout INT4 ``words [E, N, K/8]`` int32 and group-32 ``scales [E, N, K/32]``
    (any 2-byte dtype) → the tiled layout: words ``[E, N/16, K/128, 256]``, scales
    ``[E, N/16, K/128, 64]``. Inside a chunk the word of row n, weights k .. k+7 sits at
    ((n/8)%2, n%8, (k/8)%4, (k/32)%4) — a GEMV lane's 16 bytes hold 8 weights of each of the
    chunk's 4 groups — and the scale of (n, k/32) at (n%8, (n/8)%2, (k/32)%4), which is where
    moe.cu's int4_word_index / int4_scale_index look. ``lane_groups``: the last two word indices
    swapped, ((n/8)%2, n%8, (k/32)%4, (k/8)%4) — a lane's 16 bytes hold one whole group (moe.cu
    INT4_TILED 2, moe_int4.cu's GEMV); scales as in the tiled layout. ``xp``: numpy or cupy (a device repack)."""
    experts, out_features, packed = words.shape
    in_features = packed * 8
    if not int4_tiling_fits(out_features, in_features, in_features // scales.shape[2]) \
            or scales.shape[:2] != (experts, out_features):
        raise ValueError(f"no tiled INT4 layout for words {tuple(words.shape)} with scales {tuple(scales.shape)}: "
                         f"want group {INT4_TILE_GROUP}, out_features % {INT4_TILE_ROWS} == 0 and "
                         f"in_features % {INT4_TILE_K} == 0")
    blocks, kblocks = out_features // INT4_TILE_ROWS, in_features // INT4_TILE_K
    # n = (block, half, row); word k/8 = (kblock, group, lane quarter); group k/32 = (kblock, group)
    w = words.reshape(experts, blocks, 2, 8, kblocks, 4, 4).transpose(0, 1, 4, 2, 3, *((5, 6) if lane_groups else (6, 5)))
    s = scales.reshape(experts, blocks, 2, 8, kblocks, 4).transpose(0, 1, 4, 3, 2, 5)
    return (xp.ascontiguousarray(w).reshape(experts, blocks, kblocks, 256),
            xp.ascontiguousarray(s).reshape(experts, blocks, kblocks, 64))


def untile_int4(words, scales, out_features: int, in_features: int, xp=np, lane_groups: bool = False):
    """``tile_int4``'s inverse: the checkpoint layout ``[E, N, K/8]`` words, ``[E, N, K/32]`` scales."""
    experts = words.shape[0]
    blocks, kblocks = out_features // INT4_TILE_ROWS, in_features // INT4_TILE_K
    w = words.reshape(experts, blocks, kblocks, 2, 8, 4, 4).transpose(0, 1, 3, 4, 2, *((5, 6) if lane_groups else (6, 5)))
    s = scales.reshape(experts, blocks, kblocks, 8, 2, 4).transpose(0, 1, 4, 3, 2, 5)
    return (xp.ascontiguousarray(w).reshape(experts, out_features, in_features // 8),
            xp.ascontiguousarray(s).reshape(experts, out_features, in_features // INT4_TILE_GROUP))


def quantize_int4_group(weight: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-group INT4: ``(packed int32 [out, in/8], scales float32 [out, in/group])`` with
    ``scale = absmax / 7`` (what compressed-tensors' symmetric int4 uses); values clipped to −8..7."""
    weight = np.asarray(weight, np.float32)
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(f"in_features {in_features} is not a multiple of the group size {group}")
    grouped = weight.reshape(out_features, in_features // group, group)
    scales = np.abs(grouped).max(axis=-1) / 7.0
    scales = np.where(scales > 0, scales, 1.0).astype(np.float32)
    q = np.clip(np.rint(grouped / scales[..., None]), -8, 7).reshape(out_features, in_features)
    return pack_int4(q), scales


def dequantize_fp4_e2m1(packed: np.ndarray, scales: np.ndarray, name: str = "weight") -> np.ndarray:
    """FP4 e2m1 bytes ``[out, in/2]`` (low nibble = even element) × e8m0 group scales ``[out, in/32]``."""
    codes = np.asarray(packed).view(np.uint8)
    out_features, in_features = codes.shape[0], codes.shape[1] * 2
    if scales.shape[0] != out_features or in_features % scales.shape[1]:
        raise WeightLoadError(f"{name}: e8m0 scales {tuple(scales.shape)} do not tile a {(out_features, in_features)} "
                              "fp4 weight into whole groups")
    group = in_features // scales.shape[1]
    values = np.empty((out_features, in_features), np.float32)
    values[:, 0::2] = FP4_E2M1_VALUES[codes & 0xF]
    values[:, 1::2] = FP4_E2M1_VALUES[codes >> 4]
    return values * np.repeat(e8m0_to_float32(scales), group, axis=1)


def quantize_fp4_e2m1(weight: np.ndarray, group: int = FP4_GROUP) -> tuple[np.ndarray, np.ndarray]:
    """``(packed uint8 [out, in/2], e8m0 scales uint8 [out, in/group])``: power-of-two scales with
    each group's absmax ≤ 6·scale, codes rounded to the nearest e2m1 value."""
    weight = np.asarray(weight, np.float32)
    out_features, in_features = weight.shape
    grouped = weight.reshape(out_features, in_features // group, group)
    amax = np.maximum(np.abs(grouped).max(axis=-1), 1e-30)
    exponent = np.clip(np.ceil(np.log2(amax / 6.0)), -127, 127).astype(np.int32)
    scaled = (grouped / np.exp2(exponent)[..., None]).reshape(out_features, in_features)
    codes = np.abs(scaled[..., None] - FP4_E2M1_VALUES[None, None, :8] * np.sign(scaled)[..., None]).argmin(-1)
    codes = np.where(np.signbit(scaled) & (codes > 0), codes + 8, codes).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, (exponent + 127).astype(np.uint8)


# --- checkpoint-level quantization config --------------------------------------------------------

@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's ``quantization_config``, reduced to what loading needs.

    ``method``: ``none`` | ``fp8`` (block-scaled e4m3) | ``int4`` (compressed-tensors pack-quantized).
    ``ignore`` lists module names (exact, or ``re:`` regexes) that stay unquantized.
    """

    method: str = "none"
    block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    group_size: int = 32
    ignore: tuple[str, ...] = ()

    def applies_to(self, module: str) -> bool:
        if self.method == "none":
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern):
                return False
        return True


SUPPORTED_QUANT_METHODS = ("fp8", "compressed-tensors")


def quant_config_from(config: Mapping[str, Any]) -> QuantConfig:
    """Parse ``config["quantization_config"]`` (or none); an unknown method or shape is an error
    naming the field, raised before any weight is read."""
    raw = config.get("quantization_config")
    if raw is None:
        return QuantConfig()
    if not isinstance(raw, Mapping):
        raise WeightLoadError("config.json quantization_config must be an object")
    method = raw.get("quant_method")
    if method == "fp8":
        if raw.get("fmt", "e4m3") != "e4m3":
            raise WeightLoadError(f"quantization_config.fmt={raw.get('fmt')!r}: only e4m3 FP8 weights are supported")
        block = raw.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK]
        if not (isinstance(block, Sequence) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise WeightLoadError(f"quantization_config.weight_block_size={block!r} must be two positive ints")
        return QuantConfig("fp8", (int(block[0]), int(block[1])), ignore=tuple(raw.get("ignored_layers") or ()))
    if method == "compressed-tensors":
        fmt = raw.get("format")
        if fmt != "pack-quantized":
            raise WeightLoadError(f"quantization_config.format={fmt!r}: only compressed-tensors "
                                  "'pack-quantized' INT4 is supported")
        groups = raw.get("config_groups") or {}
        if len(groups) != 1:
            raise WeightLoadError(f"quantization_config.config_groups has {len(groups)} groups; one is supported")
        weights = next(iter(groups.values())).get("weights") or {}
        checks = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        for key, wanted in checks.items():
            if weights.get(key) != wanted:
                raise WeightLoadError(f"quantization_config.config_groups.*.weights.{key}={weights.get(key)!r}: "
                                      f"only {key}={wanted!r} is supported")
        group_size = weights.get("group_size")
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
            raise WeightLoadError(f"quantization_config.config_groups.*.weights.group_size={group_size!r} must be "
                                  "a positive multiple of 8")
        return QuantConfig("int4", group_size=group_size, ignore=tuple(raw.get("ignore") or ()))
    raise WeightLoadError(f"quantization_config.quant_method={method!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_QUANT_METHODS)})")
