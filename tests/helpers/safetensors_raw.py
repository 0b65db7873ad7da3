"""Safetensors files with any dtype tag (F8_E4M3, F8_E8M0, BF16 …), which ``safetensors.numpy``
cannot spell: the public writer, under the name the tests use."""

from openinfer.weights import write_safetensors

__all__ = ["write_safetensors"]
