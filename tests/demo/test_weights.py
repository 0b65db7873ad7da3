"""The converted model.safetensors and config.json against transformers' reading of the same GGUF."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from openinfer.gguf_convert import unpermute_qk_rows


@pytest.fixture(scope="module")
def hf_checkpoint(demo_gguf: Path) -> dict[str, Any]:
    """transformers' dequantized, un-permuted tensors (HF names) and parsed config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(demo_gguf), return_tensors=False)
    config = transformers.LlamaConfig(**{k: v for k, v in parsed["config"].items() if k != "model_type"})
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    return load_gguf_checkpoint(str(demo_gguf), return_tensors=True, model_to_load=skeleton)


def test_weights_equal_transformers_dequantized(demo_model_dir: Path, hf_checkpoint: dict[str, Any]) -> None:
    ours = load_file(str(demo_model_dir / "model.safetensors"))
    theirs = {name: tensor.numpy() for name, tensor in hf_checkpoint["tensors"].items()}
    assert sorted(ours) == sorted(theirs)
    for name, expected in theirs.items():
        assert ours[name].dtype == np.float32, name
        np.testing.assert_array_equal(ours[name], expected, err_msg=name)


def test_config_matches_transformers_parse(demo_model_dir: Path, hf_checkpoint: dict[str, Any]) -> None:
    ours = json.loads((demo_model_dir / "config.json").read_text())
    assert ours["architectures"] == ["LlamaForCausalLM"]
    for key, value in hf_checkpoint["config"].items():
        if key in ("_model_name_or_path", "unk_token_id"):
            continue
        assert ours[key] == value, key


def test_unpermute_restores_rotate_half_order() -> None:
    # llama.cpp's permute (convert_hf_to_gguf.py): rows of each head go from [x0 x1 y0 y1] to [x0 y0 x1 y1].
    num_heads, head_dim, cols = 3, 4, 2
    hf = np.arange(num_heads * head_dim * cols, dtype=np.float32).reshape(num_heads * head_dim, cols)
    llama_cpp = hf.reshape(num_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(unpermute_qk_rows(llama_cpp, num_heads), hf)
    assert not np.array_equal(llama_cpp, hf)
