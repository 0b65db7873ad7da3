"""``openinfer serve`` / ``generate`` / ``plan`` flags (issue 11): every value outside its range is a
usage error naming the flag (exit 2, no traceback); the API key can come from a file or the
environment; a gRPC port in use stops the server with exit 3, as an HTTP port in use does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from tiny_checkpoints import write_tiny_qwen3

from openinfer.cli import build_parser
from openinfer.frontend import serve

BAD_SERVE_FLAGS = [
    ("--port", "99999"), ("--port", "0"), ("--port", "http"), ("--grpc-port", "99999"), ("--grpc-port", "-1"),
    ("--max-queue", "-1"), ("--max-queue", "0"), ("--max-num-seqs", "0"), ("--num-kv-blocks", "0"),
    ("--max-model-len", "-5"), ("--max-num-batched-tokens", "0"), ("--gpu-memory-utilization", "0"),
    ("--gpu-memory-utilization", "1.5"), ("--gpu-memory-utilization", "nan"), ("--engine-timeout", "0"),
    ("--shutdown-timeout", "-1"), ("--max-body-bytes", "10"), ("--max-queue-wait", "-1"),
    ("--max-queue-wait", "inf"), ("--default-max-tokens", "0"), ("--seed", "-3"), ("--engine", "localhost:1"),
    ("--host", ""), ("--api-key", ""), ("--served-model-name", " "), ("--model-path", ""), ("--tokenizer", ""),
    ("--api-key-file", ""), ("--trace-dir", ""), ("--startup-report", ""), ("--api-server-count", "0"),
    ("--tensor-parallel-size", "0"), ("--expert-parallel-size", "0"), ("--port", "1e3"),
]
BAD_GENERATE_FLAGS = [
    ("--max-tokens", "-1"), ("--max-tokens", "0"), ("--temperature", "-0.5"), ("--temperature", "nan"),
    ("--top-p", "0"), ("--top-p", "1.01"), ("--top-k", "-2"), ("--seed", "-1"), ("--max-model-len", "0"),
    ("--num-kv-blocks", "0"), ("--model-path", ""), ("--trace-dir", ""), ("--tensor-parallel-size", "0"),
    ("--expert-parallel-size", "-1"),
]
BAD_PLAN_FLAGS = [
    ("--tensor-parallel-size", "0"), ("--expert-parallel-size", "-1"), ("--gpu-memory-gib", "-1"),
    ("--gpu-memory-gib", "0"), ("--gpu-memory-gib", "inf"), ("--gpu-memory-utilization", "nan"),
    ("--gpu-memory-utilization", "1.5"), ("--max-model-len", "-5"), ("--max-num-seqs", "0"), ("--num-gpus", "0"),
    ("--config", ""),
]


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), BAD_SERVE_FLAGS)
def test_serve_flag_out_of_range_is_a_usage_error(flag, value, capsys):
    message = _usage_error(["serve", f"{flag}={value}"], capsys)
    assert f"argument {flag}" in message and "Traceback" not in message


@pytest.mark.parametrize(("flag", "value"), BAD_GENERATE_FLAGS)
def test_generate_flag_out_of_range_is_a_usage_error(flag, value, capsys):
    message = _usage_error(["generate", "--prompt", "x", f"{flag}={value}"], capsys)
    assert f"argument {flag}" in message


@pytest.mark.parametrize(("flag", "value"), BAD_PLAN_FLAGS)
def test_plan_flag_out_of_range_is_a_usage_error(flag, value, capsys):
    argv = ["plan", f"{flag}={value}"] if flag == "--config" else ["plan", "--config", "config.json", f"{flag}={value}"]
    message = _usage_error(argv, capsys)
    assert f"argument {flag}" in message and "Traceback" not in message


def test_every_numeric_flag_of_every_subcommand_has_a_range():
    """No subcommand declares a bare int/float flag: each numeric type is a range checker from
    openinfer.cli_types (a new flag without one fails here)."""
    for name, subparser in build_parser()._subparsers._group_actions[0].choices.items():
        for action in subparser._actions:
            assert action.type not in (int, float), f"openinfer {name} {action.option_strings}: no range"


@pytest.mark.parametrize("ids", ["-1", "1,-1", "", "1,x", str(2**31)])
def test_generate_prompt_token_ids_are_checked(ids, capsys):
    message = _usage_error(["generate", f"--prompt-token-ids={ids}"], capsys)
    assert "--prompt-token-ids" in message


def test_flags_in_range_parse():
    args = build_parser().parse_args(["serve", "--port", "65535", "--grpc-port", "0", "--max-queue", "1",
                                      "--gpu-memory-utilization", "1", "--max-queue-wait", "0",
                                      "--default-max-tokens", "256", "--seed", str(2**64 - 1)])
    assert (args.port, args.grpc_port, args.max_queue, args.max_queue_wait) == (65535, 0, 1, 0.0)
    assert "default 1024" in build_parser()._subparsers._group_actions[0].choices["serve"].format_help()


def test_api_key_from_flag_file_or_environment(tmp_path, monkeypatch):
    parser = build_parser()
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    assert serve.resolve_api_key(parser.parse_args(["serve"])) is None
    monkeypatch.setenv(serve.API_KEY_ENV, "from-env")
    assert serve.resolve_api_key(parser.parse_args(["serve"])) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert serve.resolve_api_key(parser.parse_args(["serve", "--api-key-file", str(key_file)])) == "from-file"
    assert serve.resolve_api_key(parser.parse_args(["serve", "--api-key", "from-flag"])) == "from-flag"
    key_file.write_text("\n")
    with pytest.raises(serve.OpenInferError, match="empty"):
        serve.resolve_api_key(parser.parse_args(["serve", "--api-key-file", str(key_file)]))
    with pytest.raises(serve.OpenInferError, match="cannot read"):
        serve.resolve_api_key(parser.parse_args(["serve", "--api-key-file", str(tmp_path / "missing")]))
    with pytest.raises(SystemExit):  # one source on the command line
        parser.parse_args(["serve", "--api-key", "a", "--api-key-file", str(key_file)])


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                                ("0.0.0.0", False), ("10.1.2.3", False), ("example.com", False)])
def test_loopback_hosts(host, loopback):
    assert serve.is_loopback(host) == loopback


def test_grpc_port_in_use_exits_3_and_public_bind_without_key_warns(tmp_path):
    model_dir = tmp_path / "tiny-qwen3"
    write_tiny_qwen3(model_dir)
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        grpc_port = holder.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            http_port = probe.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != serve.API_KEY_ENV}
        result = subprocess.run(
            [sys.executable, "-m", "openinfer.cli", "serve", "--model-path", str(model_dir), "--device", "cpu",
             "--host", "0.0.0.0", "--port", str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning"],
            capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "without an API key" in output
    assert "cannot bind" in output and "--grpc-port" in output and "Traceback" not in output


def test_policy_and_data_parallel_flags_reach_the_engine_options(capsys):
    args = build_parser().parse_args(["serve", "--scheduler-policy", "split", "--expert-parallel-size", "2",
                                      "--enable-attention-data-parallel"])
    options = serve.engine_options(args)
    assert options["scheduler_policy"] == "split" and options["attention_data_parallel"] is True
    assert "scheduler_policy" not in serve.engine_options(build_parser().parse_args(["serve"]))
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--scheduler-policy", "fastest"])
    assert exit_info.value.code == 2 and "--scheduler-policy" in capsys.readouterr().err


def test_the_serve_flags_name_the_schedulers_policies_without_importing_it():
    """`openinfer serve`'s supervisor parses the flags before it spawns the engine core: the flags
    take the policies from ``openinfer.options`` (the scheduler's own list) and the parser imports
    neither the scheduler nor NumPy (~0.3 s of every served start)."""
    import subprocess
    import sys

    from openinfer.options import SCHEDULER_POLICIES
    from openinfer.sched.scheduler import POLICIES

    assert SCHEDULER_POLICIES == POLICIES
    code = ("import sys; import openinfer.cli as cli; cli.build_parser().parse_args(['serve']); "
            "import openinfer.frontend.supervisor; "
            "print(sorted(m for m in ('numpy', 'openinfer.sched.scheduler', 'openinfer.engine', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
