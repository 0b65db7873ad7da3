import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale():
    result = subprocess.run([sys.executable, "-m", "openinfer.tools.protogen", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
