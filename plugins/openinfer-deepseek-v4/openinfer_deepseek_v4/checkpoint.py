"""Where DeepSeek-V4 tensors live: one name space over three on-disk spellings, dequantised.

Every tensor is addressed by its **official** name (DeepSeek's ``inference/model.py``; no
``model.`` prefix)::

    embed.weight  head.weight  norm.weight  hc_head_{fn,base,scale}
    layers.{i}.{attn_norm,ffn_norm}.weight   layers.{i}.hc_{attn,ffn}_{fn,base,scale}
    layers.{i}.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}.weight   layers.{i}.attn.attn_sink
    layers.{i}.attn.compressor.{wkv,wgate,norm}.weight  layers.{i}.attn.compressor.ape
    layers.{i}.attn.indexer.{wq_b,weights_proj}.weight  layers.{i}.attn.indexer.compressor.*
    layers.{i}.ffn.gate.{weight,bias,tid2eid}   layers.{i}.ffn.{experts.{e},shared_experts}.w{1,2,3}.weight

The spellings read (MODELS.md §1.2):

- **official** (the released checkpoint): as above;
- **HF-saved** (``save_pretrained``): a ``model.`` prefix, ``model.embed_tokens.weight``,
  ``model.hc_head.hc_{fn,base,scale}``, and the attention ``kv_norm`` saved as ``attn.norm``;
- **MP8** (official ``convert.py --model-parallel 8``): ``model{r}-mp8.safetensors`` per rank;
  ``embed``, ``wq_b``, ``wo_a``, ``head``, ``attn_sink``, ``weights_proj`` split on dim 0,
  ``wo_b`` on dim 1, routed experts spread over ranks (global ids kept), the rest replicated.
  Each rank's slice is dequantised on its own and the slices concatenated.

Quantised tensors are decided per tensor by the presence of ``<module>.scale``: FP8 e4m3 with
e8m0 block scales ``[⌈out/128⌉, ⌈in/128⌉]``, or FP4 e2m1 (two codes per I8 byte, low nibble
first) with e8m0 scales per 32 inputs — decoded by ``openinfer.quant``. A ``.weight`` without
``.scale`` is BF16/F32 as stored.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from openinfer import Checkpoint, WeightLoadError
from openinfer.quant import dequantize_fp4_e2m1, dequantize_fp8_block, e8m0_to_float32

_MP_FILE = re.compile(r"model(\d+)-mp(\d+)\.safetensors$")
# module leaf names the official converter splits across model-parallel ranks, and the axis
_SPLIT_DIM0 = ("embed", "wq_b", "wo_a", "head", "weights_proj")
_SPLIT_DIM1 = ("wo_b",)
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def official_name(name: str) -> str:
    """Map an HF-saved name to the official one (official names pass through unchanged)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name.startswith("hc_head.hc_"):
        return "hc_head_" + name[len("hc_head.hc_"):]
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm.", name)


class _SingleFile(Checkpoint):
    """A ``Checkpoint`` over one ``.safetensors`` file (an MP rank's file sits beside the others)."""

    def __init__(self, file: Path):
        self._file = file
        super().__init__(file.parent)

    def _files(self) -> list[Path]:
        return [self._file]


class DeepseekV4Checkpoint:
    """Official-name access to an official, HF-saved or MP8 DeepSeek-V4 checkpoint directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        ranks = sorted((int(m.group(1)), int(m.group(2)), p) for p in model_dir.glob("*.safetensors")
                       if (m := _MP_FILE.search(p.name)))
        if ranks:
            world = ranks[0][1]
            if [r for r, _, _ in ranks] != list(range(world)) or any(w != world for _, w, _ in ranks):
                raise WeightLoadError(f"{model_dir} holds model-parallel files for ranks "
                                      f"{[r for r, _, _ in ranks]}; expected model0..model{world - 1}-mp{world}")
            self.shards = [_SingleFile(p) for _, _, p in ranks]
        else:
            self.shards = [Checkpoint(model_dir)]
        self.model_dir = model_dir
        # official name -> [(shard index, stored name)]
        self._where: dict[str, list[tuple[int, str]]] = {}
        for index, shard in enumerate(self.shards):
            for stored in shard.names():
                self._where.setdefault(official_name(stored), []).append((index, stored))

    @property
    def is_model_parallel(self) -> bool:
        return len(self.shards) > 1

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def _locate(self, name: str) -> list[tuple[int, str]]:
        found = self._where.get(name)
        if not found:
            raise WeightLoadError(f"tensor {name!r} is missing from the DeepSeek-V4 checkpoint in {self.model_dir}")
        return found

    def raw(self, name: str) -> np.ndarray:
        """An unquantised, unsplit tensor as stored (int64 ``tid2eid``, say)."""
        index, stored = self._locate(name)[0]
        return self.shards[index].raw(stored)

    def get(self, name: str) -> np.ndarray:
        """``name`` as float32: dequantised when a ``.scale`` sits beside it, MP slices joined."""
        pieces = [self._read_slice(index, stored, name) for index, stored in self._locate(name)]
        if len(pieces) == 1:
            return pieces[0]
        axis = self._split_axis(name)
        if axis is None:
            return pieces[0]  # replicated on every rank
        return np.concatenate(pieces, axis=axis)

    def weight(self, module: str, shape: tuple[int, ...]) -> np.ndarray:
        """``<module>.weight`` as float32 ``shape`` ``[out, in]``, checked before use."""
        value = self.get(f"{module}.weight")
        if tuple(value.shape) != tuple(shape):
            raise WeightLoadError(f"tensor {module}.weight has shape {tuple(value.shape)}, the config implies "
                                  f"{tuple(shape)}; config.json and the weights disagree")
        return value

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        value = self.get(name)
        if tuple(value.shape) != tuple(shape):
            raise WeightLoadError(f"tensor {name} has shape {tuple(value.shape)}, the config implies {tuple(shape)}")
        return value

    def stored_quantized(self, module: str) -> tuple[str, np.ndarray, np.ndarray] | None:
        """``(format, codes, e8m0 scales)`` of ``<module>.weight`` as stored, both uint8 — ``fp4``
        (``[out, in/2]`` packed pairs, scales ``[out, in/32]``) or ``fp8`` (e4m3 ``[out, in]``,
        scales ``[⌈out/128⌉, ⌈in/128⌉]``) — for kernels that decode in registers; None when the
        weight is not quantised or is split over model-parallel files (then use ``weight``)."""
        found = self._locate(f"{module}.weight")
        if len(found) != 1:
            return None
        index, stored = found[0]
        shard = self.shards[index]
        scale = stored[: -len(".weight")] + ".scale"
        if scale not in shard or shard.dtype(scale) != "F8_E8M0":
            return None
        dtype = shard.dtype(stored)
        kind = "fp8" if dtype == "F8_E4M3" else "fp4" if dtype in ("I8", "U8", "F4") else None
        if kind is None:
            return None
        return kind, np.asarray(shard.raw(stored)).view(np.uint8), np.asarray(shard.raw(scale)).view(np.uint8)

    @staticmethod
    def _split_axis(name: str) -> int | None:
        if _EXPERT.search(name):
            return None
        leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".scale")) else name.rsplit(".", 1)[-1]
        if leaf in _SPLIT_DIM0 or name.endswith(".attn_sink"):
            return 0
        if leaf in _SPLIT_DIM1:
            return 1
        return None

    def _read_slice(self, index: int, stored: str, name: str) -> np.ndarray:
        shard = self.shards[index]
        if not stored.endswith(".weight"):
            return shard.get(stored)
        scale = stored[: -len(".weight")] + ".scale"
        if scale not in shard:
            if shard.dtype(stored) in ("F8_E4M3", "I8", "U8", "F4"):
                raise WeightLoadError(f"tensor {name!r} is {shard.dtype(stored)} but has no {scale!r} beside it")
            return shard.get(stored)
        if shard.dtype(scale) != "F8_E8M0":
            raise WeightLoadError(f"tensor {scale!r} is {shard.dtype(scale)}; DeepSeek-V4 scales are F8_E8M0")
        dtype = shard.dtype(stored)
        if dtype == "F8_E4M3":  # 128×128 blocks
            return dequantize_fp8_block(shard.raw(stored), e8m0_to_float32(shard.raw(scale)), name=name)
        if dtype in ("I8", "U8", "F4"):  # FP4 e2m1 pairs (I8 as convert.py writes, or F4), a scale per 32
            return dequantize_fp4_e2m1(shard.raw(stored), shard.raw(scale), name=name)
        raise WeightLoadError(f"tensor {name!r} is {dtype} with a .scale; expected F8_E4M3, or FP4 packed in I8 / F4")
