"""The tree stays ruff-clean (configuration in pyproject.toml)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (it comes with the test extra: pip install -e '.[test]')")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_benchmarks_use_only_public_apis():
    """Benchmarks are what users copy: they import openinfer's public modules, never the test
    helpers, and read no private engine attributes."""
    offenders = []
    for script in sorted((REPO / "benchmarks").glob("*.py")):
        for number, line in enumerate(script.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith(("from tests", "import tests")) or "engine._" in stripped:
                offenders.append(f"{script.name}:{number}: {stripped}")
    assert not offenders, "\n".join(offenders)
