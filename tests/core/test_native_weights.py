"""Weights go from a bf16 safetensors file to a bf16 backend without any float32 host copy."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

from openinfer.decoder import BackendNativeCheckpoint, DecoderConfig, DecoderLayout, load_decoder_stack
from openinfer.rope import RotaryEmbedding
from openinfer.weights import Checkpoint, float32_to_bf16

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
from tiny_checkpoints import write_tiny_qwen3  # noqa: E402


def write_bf16_copy(source: Path, target: Path) -> None:
    """The same checkpoint with every float32 tensor stored as BF16."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            (target / name).write_bytes((source / name).read_bytes())
    checkpoint = Checkpoint(source)
    header, blobs, offset = {}, [], 0
    for name in sorted(checkpoint.names()):
        data = float32_to_bf16(checkpoint.get(name)).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(checkpoint.shape(name)), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    (target / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


class RecordingBf16Backend:
    """Stands in for the CUDA backend at load time: records what it is handed."""

    activation_dtype = np.uint16

    def __init__(self):
        self.received: list[np.ndarray] = []

    def weight(self, array):
        self.received.append(array)
        return array

    def linear_weight(self, weight, bias=None):
        self.received += [weight] + ([bias] if bias is not None else [])
        return weight


def test_bf16_tensors_reach_a_bf16_backend_as_raw_bits(tmp_path):
    write_tiny_qwen3(tmp_path / "f32")
    write_bf16_copy(tmp_path / "f32", tmp_path / "bf16")
    checkpoint = Checkpoint(tmp_path / "bf16")
    config = DecoderConfig.from_dict(json.loads((tmp_path / "bf16" / "config.json").read_text()),
                                     model_type="qwen3", architectures=("Qwen3ForCausalLM",))
    backend = RecordingBf16Backend()
    native = BackendNativeCheckpoint(checkpoint, backend)
    embed = native.get("model.embed_tokens.weight")
    assert embed.dtype == np.uint16 and not embed.flags.owndata  # a view of the mmap, not a copy
    rope = RotaryEmbedding.create(config.head_dim, config.rope, 64, config.max_position_embeddings)
    load_decoder_stack(native, config, DecoderLayout(qk_norm=True), backend, rope)
    assert backend.received and all(a.dtype == np.uint16 for a in backend.received)
    # the bits are the checkpoint's, untouched
    assert np.array_equal(backend.received[0], checkpoint.raw("model.layers.0.input_layernorm.weight"))


def test_the_numpy_backend_still_gets_float32(tmp_path):
    write_tiny_qwen3(tmp_path / "f32")
    write_bf16_copy(tmp_path / "f32", tmp_path / "bf16")

    class Fp32Backend:
        activation_dtype = np.float32

    native = BackendNativeCheckpoint(Checkpoint(tmp_path / "bf16"), Fp32Backend())
    assert native.get("model.norm.weight").dtype == np.float32
    assert "model.norm.weight" in native and native.shape("model.norm.weight") == (64,)
