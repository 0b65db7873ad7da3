import json
import subprocess
import sys

from tests.helpers.engine_utils import make_request, run_one
from tests.plugins.qwen3.conftest import build_engine


def openinfer_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openinfer.cli", *args], capture_output=True, text=True, timeout=120)


def test_generate_json_prints_one_object_equal_to_the_engine(tiny_qwen3_dir):
    result = openinfer_cli("generate", "--model-path", str(tiny_qwen3_dir), "--prompt-token-ids", "5,6,7,8",
                           "--max-tokens", "6", "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["text"] is None  # no tokenizer.json in this model dir
    assert payload["finish_reason"] == "length"
    engine = build_engine(tiny_qwen3_dir)
    try:
        expected = run_one(engine, make_request("x", [5, 6, 7, 8], max_tokens=6, ignore_eos=False)).token_ids
    finally:
        engine.close_sync()
    assert payload["token_ids"] == expected


def test_prompt_text_without_tokenizer_is_a_clear_error(tiny_qwen3_dir):
    result = openinfer_cli("generate", "--model-path", str(tiny_qwen3_dir), "--prompt", "hi", "--device", "cpu")
    assert result.returncode == 2
    assert "tokenizer.json" in result.stderr and "--prompt-token-ids" in result.stderr


def test_bad_token_ids_are_a_clear_error(tiny_qwen3_dir):
    result = openinfer_cli("generate", "--model-path", str(tiny_qwen3_dir), "--prompt-token-ids", "1,x",
                           "--device", "cpu")
    assert result.returncode == 2 and "comma-separated integers" in result.stderr
    result = openinfer_cli("generate", "--model-path", str(tiny_qwen3_dir), "--prompt-token-ids", "1,99999",
                           "--device", "cpu")
    assert result.returncode == 2 and "out of the vocabulary" in result.stderr


def test_attention_data_parallel_without_expert_parallel_is_a_clear_error(tiny_qwen3_dir):
    result = openinfer_cli("generate", "--model-path", str(tiny_qwen3_dir), "--prompt-token-ids", "1,2",
                           "--device", "cpu", "--enable-attention-data-parallel")
    assert result.returncode == 2 and "expert" in result.stderr.lower(), result.stderr
