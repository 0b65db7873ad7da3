"""Turn a llama-architecture GGUF file into a Hugging Face style model directory.

A GGUF carries everything a model directory does, in llama.cpp's spelling: hyper-parameters
as ``llama.*`` metadata, the tokenizer as ``tokenizer.ggml.*`` arrays, and (possibly quantized)
tensors under ``blk.N.*`` names. The directory written here is what any openinfer plugin (and
HF transformers) reads::

    out_dir/
      config.json              LlamaForCausalLM, from the llama.* metadata
      model.safetensors        every tensor dequantized to float32, HF names, HF Q/K row order
      tokenizer.json           byte-level BPE built with `tokenizers` from the GGUF vocab + merges
      tokenizer_config.json    chat template, bos/eos/pad/unk tokens
      generation_config.json   bos/eos/pad ids

Two details make the result equal to what transformers builds from the same file:

* llama.cpp stores ``attn_q``/``attn_k`` rows permuted so that each head's rotary pairs are
  interleaved; :func:`unpermute_qk_rows` restores HF's rotate-half order.
* the tokenizer is GPT-2 byte-level BPE (``ByteLevel`` pre-tokenizer and decoder, no prefix
  space), with the tokens the file marks as CONTROL added as special tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from openinfer.errors import WeightLoadError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFModel:
    """The parts of a GGUF file a conversion needs: metadata values and the tensor list."""

    metadata: dict[str, Any]
    tensors: list[Any]  # gguf.ReaderTensor

    @classmethod
    def read(cls, path: Path) -> GGUFModel:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items()}
        return cls(metadata, list(reader.tensors))

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise WeightLoadError(f"the GGUF file has no {key!r} metadata; it is not a complete llama GGUF")
        return self.metadata[key]


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a llama GGUF tensor; None for tensors HF recomputes (``rope_freqs``)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None
    match = _LAYER_NAME.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise WeightLoadError(f"GGUF tensor {gguf_name!r} is not part of a llama model; only llama GGUFs convert")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"


def unpermute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation (as transformers' GGUF loader does for llama).

    llama.cpp reorders each head's ``head_dim`` rows from ``[x0..x(d/2-1), y0..y(d/2-1)]``
    (rotate-half, HF) to ``[x0, y0, x1, y1, ...]`` (interleaved pairs); this restores HF's order.
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def build_config(model: GGUFModel) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM, from the GGUF's ``llama.*`` metadata."""
    arch = model.require("general.architecture")
    if arch != "llama":
        raise WeightLoadError(f"GGUF architecture {arch!r} is not supported; only 'llama' GGUFs convert")
    hidden_size = int(model.require("llama.embedding_length"))
    num_heads = int(model.require("llama.attention.head_count"))
    vocab_size = int(model.metadata.get("llama.vocab_size") or len(model.require("tokenizer.ggml.tokens")))
    tensor_names = {tensor.name for tensor in model.tensors}
    eos = model.metadata.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(model.require("llama.feed_forward_length")),
        "num_hidden_layers": int(model.require("llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(model.metadata.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": int(model.metadata.get("llama.rope.dimension_count", hidden_size // num_heads)),
        "max_position_embeddings": int(model.require("llama.context_length")),
        "rms_norm_eps": float(model.require("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(model.metadata.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": any(name.endswith("attn_q.bias") for name in tensor_names),
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": model.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": model.metadata.get("tokenizer.ggml.padding_token_id", eos),
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "float32",
    }


def dequantized_tensors(model: GGUFModel, config: dict[str, Any],
                        progress: Callable[[Iterable[Any]], Iterable[Any]] = iter) -> dict[str, np.ndarray]:
    """Every tensor as float32 under its HF name, Q/K rows in HF order."""
    from gguf.quants import dequantize

    tensors: dict[str, np.ndarray] = {}
    for tensor in progress(model.tensors):
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if ".self_attn.q_proj." in name:
            weight = unpermute_qk_rows(weight, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            weight = unpermute_qk_rows(weight, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(weight)
    return tensors


def build_tokenizer(model: GGUFModel) -> Any:
    """A ``tokenizers.Tokenizer``: GPT-2 byte-level BPE over the GGUF vocabulary and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = model.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise WeightLoadError(f"GGUF tokenizer {kind!r} is not supported; only byte-level BPE ('gpt2') converts")
    tokens: list[str] = list(model.require("tokenizer.ggml.tokens"))
    token_types = _token_types(model)
    alphabet = _byte_alphabet()
    byte_spelling = dict(zip(range(256), _byte_chars(), strict=True))
    vocab = {
        token if set(token) <= alphabet else "".join(byte_spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in model.require("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    user = [t for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special_tokens(model)])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tokenizer


def special_tokens(model: GGUFModel) -> list[str]:
    """Tokens the file marks CONTROL (``<|im_start|>``...), matched whole and never split.

    In a byte-level vocabulary every real token is spelled in the byte alphabet; a CONTROL token
    that is not is a llama.cpp mislabel and is left out (as transformers does)."""
    tokens: list[str] = model.require("tokenizer.ggml.tokens")
    token_types = _token_types(model)
    alphabet = _byte_alphabet()
    return [t for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_TYPE_CONTROL and set(t) <= alphabet]


def build_tokenizer_config(model: GGUFModel, config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: chat template and the special tokens, spelled as tokens."""
    tokens: list[str] = model.require("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = model.metadata.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[int(index)]

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(model.metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(model.metadata.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(model.metadata.get("tokenizer.ggml.add_space_prefix", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "additional_special_tokens": special_tokens(model),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    template = model.metadata.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    return tokenizer_config


def build_generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
            if config.get(key) is not None}


def convert_gguf(gguf_path: Path, out_dir: Path,
                 progress: Callable[[Iterable[Any]], Iterable[Any]] = iter) -> None:
    """Write the model directory for ``gguf_path`` into ``out_dir`` (which must exist).

    ``progress`` wraps the tensor iteration (e.g. ``tqdm``) to report dequantization.
    """
    from safetensors.numpy import save_file

    model = GGUFModel.read(gguf_path)
    config = build_config(model)
    tokenizer = build_tokenizer(model)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(model, config))
    _write_json(out_dir / "generation_config.json", build_generation_config(config))
    tensors = dequantized_tensors(model, config, progress)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)
    _write_json(out_dir / "config.json", config)


def _token_types(model: GGUFModel) -> list[int]:
    """Each token's llama.cpp type; files without the array have only normal tokens (1)."""
    tokens = model.require("tokenizer.ggml.tokens")
    return list(model.metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _byte_chars() -> list[str]:
    """GPT-2's printable spelling of each byte 0..255 (``bytes_to_unicode``)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    spelling: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = 256 + extra
            extra += 1
    return [chr(spelling[b]) for b in range(256)]


def _byte_alphabet() -> set[str]:
    return set(_byte_chars())
