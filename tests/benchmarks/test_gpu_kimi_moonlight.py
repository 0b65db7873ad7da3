"""benchmarks/gpu_kimi.py moonlight: the random checkpoint it writes for openinfer and vLLM (the
same bytes from one thread or many, the HF DeepSeek-V3 layout transformers loads with no missing
or unexpected tensor, openinfer's checkpoint reader), and the published Moonlight size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_kimi  # noqa: E402

from openinfer.weights import Checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny config written by one thread and by four."""
    one = tmp_path_factory.mktemp("one") / "ckpt"
    four = tmp_path_factory.mktemp("four") / "ckpt"
    assert gpu_kimi.write_random_checkpoint(one, gpu_kimi.MOONLIGHT_TINY, threads=1) is not None
    assert gpu_kimi.write_random_checkpoint(four, gpu_kimi.MOONLIGHT_TINY, threads=4) is not None
    return one, four


def test_threads_write_the_same_bytes_and_a_second_call_keeps_the_copy(tiny_checkpoints):
    one, four = tiny_checkpoints
    shards = sorted(p.name for p in one.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in four.glob("*.safetensors"))
    for name in shards:
        assert (one / name).read_bytes() == (four / name).read_bytes()
    before = (one / shards[0]).stat().st_mtime_ns
    assert gpu_kimi.write_random_checkpoint(one, gpu_kimi.MOONLIGHT_TINY) is None
    assert (one / shards[0]).stat().st_mtime_ns == before


def test_every_tensor_reads_back_with_its_fill(tiny_checkpoints):
    path = tiny_checkpoints[1]
    ckpt = Checkpoint(path)
    expected = gpu_kimi.deepseek_v3_tensors(gpu_kimi.MOONLIGHT_TINY)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {name for name, _, _ in expected}
    sizes = sum(gpu_kimi.tensor_bytes(shape, fill) for _, shape, fill in expected)
    assert index["metadata"]["total_size"] == sizes
    for name, shape, fill in expected:
        values = ckpt.get(name)
        assert values.shape == shape, name
        if fill == "ones":
            assert np.all(values == 1.0), name
        elif fill == "bias":
            assert ckpt.dtype(name) == "F32" and 0 < np.abs(values).max() < 0.01, name
        else:
            assert ckpt.dtype(name) == "BF16" and 0.01 < values.std() < 0.03, name


def test_transformers_loads_it_as_deepseek_v3(tiny_checkpoints):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    path = tiny_checkpoints[1]
    config = transformers.AutoConfig.from_pretrained(path)
    assert type(config).__name__ == "DeepseekV3Config" and config.q_lora_rank is None
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == gpu_kimi.MOONLIGHT_TINY["vocab_size"]


def test_moonlight_layout_is_the_published_size():
    shards, weight_map, total = gpu_kimi.checkpoint_layout(gpu_kimi.MOONLIGHT)
    params = sum(int(np.prod(shape)) for _, shape, _ in gpu_kimi.deepseek_v3_tensors(gpu_kimi.MOONLIGHT))
    assert 15.9e9 < params < 16.0e9  # Moonlight-16B-A3B: 15.96 B parameters
    assert 31.9e9 < total < 32.0e9 and len(weight_map) == 5317
    for name, header, placed in shards:
        assert len(header) % 8 == 0 and name.endswith(f"-of-{len(shards):05d}.safetensors")
        ends = [offset + gpu_kimi.tensor_bytes(shape, fill) for _, shape, fill, offset in placed]
        assert placed[0][3] == len(header) and [p[3] for p in placed[1:]] == ends[:-1]
        assert ends[-1] - len(header) <= gpu_kimi.SHARD_BYTES


def test_a_failing_layer_variant_is_noted_not_raised():
    """``noting_failure``: a variant whose call raises is noted under its label (its first error only, later calls
    skipped), so the layer bench reports it and still measures the others."""
    failures, calls = {}, []

    def broken():
        calls.append("broken")
        raise RuntimeError("cluster of 16 not allowed")

    gpu_kimi.noting_failure(failures, "auto:auto:mla_cluster16", broken)
    gpu_kimi.noting_failure(failures, "auto:auto:mla_cluster16", broken)
    gpu_kimi.noting_failure(failures, "auto:auto", lambda: calls.append("fine"))
    assert failures == {"auto:auto:mla_cluster16": "RuntimeError: cluster of 16 not allowed"}
    assert calls == ["broken", "fine"]


def test_layer_plot_skips_failed_variants(tmp_path):
    """plot_layer draws the measured points and leaves out a variant that failed (an ``error`` point)."""
    pytest.importorskip("matplotlib")
    measured = {"batch": 1, "variant": "auto:auto", "absorbed_kernel": "auto", "gemv_kernel": "auto", "step_ms": 0.168,
                "roofline_ms": 0.116, "fraction_of_roofline": 0.69, "breakdown_ms": {"qkv_a": 0.009}}
    report = {"points": [measured, {"batch": 1, "variant": "auto:auto:mla_cluster16", "error": "RuntimeError: x"}],
              "variants": ["auto:auto", "auto:auto:mla_cluster16"], "context": 1024, "device": "test"}
    gpu_kimi.plot_layer(report, tmp_path / "layer.png")
    assert (tmp_path / "layer.png").stat().st_size > 0
