"""`pip install .` (not editable) ships every Python package under core/ and frontend/."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {prefix: ROOT / directory for prefix, directory in config["package-dir"].items()}
    found = set()
    for prefix, directory in roots.items():
        for init in directory.rglob("__init__.py"):
            relative = init.parent.relative_to(directory).parts
            if any(part.startswith((".", "_")) or part == "build" for part in relative):
                continue
            found.add(".".join((prefix, *relative)))
    missing = sorted(found - listed)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"
