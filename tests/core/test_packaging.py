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


def package_directory(project: Path, package: str, package_dirs: dict[str, str]) -> Path:
    """Where setuptools finds ``package``: its longest prefix in ``package-dir``, or the project root."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dirs:
            return project / package_dirs[prefix] / Path(*parts[n:])
    return project / Path(*parts)


def test_every_kernel_source_and_header_is_package_data():
    """A wheel ships core's and each plugin's kernels/*.cu and *.cuh: kernels compile at run time
    from the installed package (plugin kernels include core's headers, e.g. common.cuh, mma.cuh)."""
    projects = [ROOT, *sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())]
    checked = 0
    for project in projects:
        config = tomllib.loads((project / "pyproject.toml").read_text())["tool"]["setuptools"]
        for package, patterns in config.get("package-data", {}).items():
            directory = package_directory(project, package, config.get("package-dir", {}))
            shipped = {path for pattern in patterns for path in directory.glob(pattern)}
            sources = {path for path in directory.rglob("*") if path.suffix in (".cu", ".cuh")}
            assert sources <= shipped, f"{project.name}: package data misses {sorted(map(str, sources - shipped))}"
            checked += len(sources)
    assert checked >= len(list((ROOT / "core" / "kernels").glob("*.cu*")))
