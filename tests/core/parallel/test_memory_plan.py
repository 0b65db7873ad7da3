"""The per-GPU memory plan on the CPU (``openinfer plan``), its refusals naming the flag to
change, the checks of bad layouts at start, and ``--load-format dummy`` from config.json alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openinfer.cli import main
from openinfer.errors import ParallelConfigError
from openinfer.parallel.layout import ExpertShard, ParallelLayout, check_devices
from tests.helpers.engine_utils import make_request, run_all
from tests.helpers.tiny_qwen3 import TINY_QWEN3

QWEN3_8B = {**TINY_QWEN3, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 40960}


@pytest.fixture()
def qwen3_8b_config(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_8B))
    return path


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_halves_the_weights_at_tp2(qwen3_8b_config, capsys):
    one = plan_json(capsys, "--config", str(qwen3_8b_config))["ranks"]
    two = plan_json(capsys, "--config", str(qwen3_8b_config), "--tensor-parallel-size", "2")["ranks"]
    assert len(one) == 1 and len(two) == 2
    assert 15.0 < one[0]["weight_gib"] < 15.5  # 8.2 B parameters in bf16
    assert two[0]["weight_gib"] == pytest.approx(one[0]["weight_gib"] / 2, rel=0.01)  # norms are replicated
    assert two[0]["kv_bytes_per_token"] == one[0]["kv_bytes_per_token"] / 2  # 4 of 8 KV heads per rank
    assert two[0]["kv_tokens"] > 2 * one[0]["kv_tokens"]


def test_plan_table_and_refusal_name_the_flag(qwen3_8b_config, capsys):
    assert main(["plan", "--config", str(qwen3_8b_config.parent), "--tensor-parallel-size", "2"]) == 0
    assert "weights GiB" in capsys.readouterr().out
    assert main(["plan", "--config", str(qwen3_8b_config), "--gpu-memory-gib", "16"]) == 2
    captured = capsys.readouterr()
    assert "rank 0 would hold 15.3 GiB of weights" in captured.err
    assert "raise --tensor-parallel-size" in captured.err
    assert main(["plan", "--config", str(qwen3_8b_config), "--gpu-memory-gib", "16", "--max-model-len", "4096",
                 "--tensor-parallel-size", "2"]) == 0


def test_more_ranks_than_gpus_is_refused(qwen3_8b_config, capsys, monkeypatch):
    assert main(["plan", "--config", str(qwen3_8b_config), "--tensor-parallel-size", "4", "--num-gpus", "2"]) == 2
    assert "needs 4 GPUs (one rank per GPU) but this machine has 2" in capsys.readouterr().err
    with pytest.raises(ParallelConfigError, match="lower --expert-parallel-size to at most 2"):
        check_devices(ParallelLayout(expert_parallel_size=8), 2)

    # the engine refuses before starting any rank process
    from openinfer.parallel import build

    monkeypatch.setattr(build, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(build, "gpu_count", lambda: 2)
    from openinfer import EngineOptions

    def never(*_):
        raise AssertionError("no rank may start")

    with pytest.raises(ParallelConfigError, match="--tensor-parallel-size 4 needs 4 GPUs"):
        build.create_parallel_model(never, EngineOptions(device="cuda", tensor_parallel_size=4))


def test_bad_layouts_are_refused():
    with pytest.raises(ParallelConfigError, match="exceeds the model's 4 routed experts"):
        ExpertShard(0, 8).experts(4)
    with pytest.raises(ParallelConfigError, match="do not divide by --expert-parallel-size 3"):
        ExpertShard(0, 3).experts(8)
    with pytest.raises(ParallelConfigError, match="must be equal"):
        ParallelLayout(2, 4)
    with pytest.raises(ParallelConfigError, match="at least 1"):
        ParallelLayout(0)


def test_dummy_load_format_serves_from_config_alone(tmp_path):
    """No safetensors on disk: random weights at the real shapes; TP=2 equals TP=1 on them too."""
    from tests.plugins.qwen3.conftest import build_engine

    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    outputs = []
    for tp in (1, 2):
        engine = build_engine(tmp_path, load_format="dummy", tensor_parallel_size=tp, num_kv_blocks=32)
        try:
            outputs.append(run_all(engine, [make_request("a", [3, 4, 5, 6], max_tokens=5)])[0].token_ids)
        finally:
            engine.close_sync()
    assert len(outputs[0]) == 5 and outputs[1] == outputs[0]
    with pytest.raises(ParallelConfigError, match="--load-format 'random'"):
        build_engine(tmp_path, load_format="random")


KIMI_K2_CONFIG = Path(__file__).with_name("kimi_k2_config.json")  # the released config.json's shape fields


def test_kimi_k2_plan_on_4_and_8_gpus(capsys):
    """Full-size Kimi-K2 (INT4 routed experts, replicated MLA attention): 8 H200s hold it with
    a KV budget; 4 cannot (the replicated parts alone take ~22 GiB a rank), and the refusal says
    which flag to raise."""
    eight = plan_json(capsys, "--config", str(KIMI_K2_CONFIG), "--expert-parallel-size", "8",
                      "--max-model-len", "131072")["ranks"]
    assert len(eight) == 8
    assert 85 < eight[0]["weight_gib"] < 92 and eight[0]["kv_tokens"] > 400_000
    total_experts = eight[0]["weights_by_split_gib"]["experts"] * 8
    assert 520 < total_experts < 540  # ≈ 0.57 TB of packed INT4 experts
    assert main(["plan", "--config", str(KIMI_K2_CONFIG), "--expert-parallel-size", "4"]) == 2
    assert "raise --expert-parallel-size" in capsys.readouterr().err


def test_deepseek_v4_flash_plan_on_1_and_2_gpus(capsys):
    """The whole DeepSeek-V4-Flash shape (43 layers, 256 FP4 experts, FP8 attention): ≈145 GiB of
    weights refuse one H200 and fit two at EP=2 with ~48 GiB each left for KV."""
    config = str(Path(__file__).with_name("deepseek_v4_flash_config.json"))
    two = plan_json(capsys, "--config", config, "--expert-parallel-size", "2", "--max-model-len", "131072")["ranks"]
    assert 75 < two[0]["weight_gib"] < 78 and two[0]["kv_gib"] > 40
    assert main(["plan", "--config", config]) == 2
    assert "rank 0 would hold 145.3 GiB of weights" in capsys.readouterr().err


def test_data_parallel_attention_multiplies_what_the_group_caches():
    """Kimi-K2 on 8 H200s: replicated MLA attention keeps every token's latent row on every rank;
    with data-parallel attention each rank caches its own sequences, so the group holds 8x over
    the headroom each rank keeps for uneven sequences (8 / 1.5), what the engine's pool gets."""
    from openinfer_kimi_k2.config import KimiK2Config
    from openinfer_kimi_k2.memory import kimi_model_memory

    from openinfer.parallel.data import DEFAULT_HEADROOM
    from openinfer.parallel.memory_plan import GIB, plan_memory

    memory = kimi_model_memory(KimiK2Config.from_dict(json.loads(KIMI_K2_CONFIG.read_text())))
    plans = {dp: plan_memory(memory, ParallelLayout(expert_parallel_size=8, attention_data_parallel=dp),
                             gpu_bytes=140 * GIB, max_model_len=131072) for dp in (False, True)}
    per_rank = plans[False].ranks[0].kv_tokens
    assert per_rank > 0 and plans[True].ranks[0].kv_tokens == per_rank
    group = plans[True].system_kv_tokens
    assert plans[False].system_kv_tokens == per_rank and group == pytest.approx(8 * per_rank / DEFAULT_HEADROOM, abs=1)
    assert plans[True].as_dict()["system_kv_tokens"] == group
    assert "data-parallel attention" in plans[True].render()
