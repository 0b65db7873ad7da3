"""The README's quickstart, typed as a new user would: in a fresh virtual environment, in a fresh
copy of the repository, with an empty model cache.

1. the serve command (install + `openinfer serve`), then the README's curl, which must answer
   with "Paris";
2. the test command (install the test extras + `pytest`), which must pass.

Both command lines are read from the README (the blocks after ``<!-- serve-command -->`` and
``<!-- test-command -->``) and run with ``bash -c`` unchanged. Slow (it installs everything,
then runs the whole suite once more), so it runs only when asked for:
``pytest -m slow tests/test_readme.py``. The inner ``pytest`` skips it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
INNER_RUN = "OPENINFER_README_TEST"
INSTALL_TIMEOUT_S = 1800

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get(INNER_RUN) == "1", reason="already inside the README test"),
]


def bash_blocks_after(marker: str, count: int = 1) -> list[str]:
    """The first ``count`` ```bash blocks that follow ``<!-- marker -->`` in the README."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"<!-- {marker} -->")
    blocks = re.findall(r"```bash\n(.*?)```", text[start:], flags=re.S)
    assert len(blocks) >= count, f"README has no ```bash block after <!-- {marker} -->"
    return [block.strip() for block in blocks[:count]]


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module", autouse=True)
def only_when_asked_for(request: pytest.FixtureRequest) -> None:
    if "slow" not in (request.config.getoption("markexpr") or "").replace("not slow", ""):
        pytest.skip("installs everything into a fresh venv; run with: pytest -m slow tests/test_readme.py")


@pytest.fixture(scope="module")
def fresh_user(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A copy of the repository's tracked files and the environment of a fresh venv in it."""
    root = tmp_path_factory.mktemp("readme")
    checkout = root / "openinfer"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, checkout / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               OPENINFER_CACHE=str(root / "cache"))
    return checkout, env


def test_serve_command_then_curl_answers_paris(fresh_user: tuple[Path, dict[str, str]]) -> None:
    checkout, env = fresh_user
    [serve] = bash_blocks_after("serve-command")
    [curl] = bash_blocks_after("serve-command", 2)[1:]
    if not port_is_free(8000):
        pytest.skip("port 8000 is in use; the README serves on 127.0.0.1:8000")
    log = (checkout.parent / "serve.log").open("w")
    server = subprocess.Popen(["bash", "-c", serve], cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + INSTALL_TIMEOUT_S
        while port_is_free(8000):
            if server.poll() is not None:
                pytest.fail(f"the serve command exited with {server.returncode}:\n"
                            f"{(checkout.parent / 'serve.log').read_text()[-5000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the serve command did not open port 8000 in time")
            time.sleep(1)
        answer = ""
        for _ in range(60):  # the port opens just before the app answers
            reply = subprocess.run(["bash", "-c", curl], cwd=checkout, env=env, capture_output=True, text=True)
            if reply.returncode == 0 and reply.stdout.strip():
                answer = json.loads(reply.stdout)["choices"][0]["message"]["content"]
                break
            time.sleep(1)
        assert "Paris" in answer, answer
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
        log.close()


def test_test_command_passes(fresh_user: tuple[Path, dict[str, str]]) -> None:
    checkout, env = fresh_user
    [command] = bash_blocks_after("test-command")
    result = subprocess.run(["bash", "-c", command], cwd=checkout, env={**env, INNER_RUN: "1"},
                            capture_output=True, text=True, timeout=2 * INSTALL_TIMEOUT_S)
    assert result.returncode == 0, (result.stdout[-8000:], result.stderr[-4000:])
