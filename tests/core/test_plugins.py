"""Plugin discovery through real installed entry points (dist-info directories on sys.path,
exactly what pip writes), including every selection error."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import openinfer
from openinfer import (
    AmbiguousPluginError,
    ConfigNotFoundError,
    ConfigNotJSONError,
    ModelPathNotFoundError,
    NoPluginError,
    PluginLoadError,
)


def install_fake_plugin(site: Path, dist: str, module: str, body: str) -> None:
    """Write a module plus ``<dist>-1.0.dist-info`` with an ``openinfer.models`` entry point."""
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[openinfer.models]\n{module} = {module}\n")


CLAIMS_QWEN3 = """
from openinfer import hookimpl

@hookimpl
def openinfer_match(config):
    return 100 if "Qwen3ForCausalLM" in config.get("architectures", []) else None

@hookimpl
def openinfer_claims():
    return ["Qwen3ForCausalLM"]

@hookimpl
def openinfer_create_engine(model_path, config, options):
    return "fake engine"
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in list(sys.modules):
        if name.startswith("fake_"):
            del sys.modules[name]


def model_dir(tmp_path: Path, config: dict | str) -> Path:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_installed_qwen3_plugin_is_discovered():
    registry = openinfer.discover_plugins()
    qwen3 = [p for p in registry.plugins.values() if p.distribution == "openinfer-qwen3"]
    assert qwen3 and "Qwen3ForCausalLM" in qwen3[0].claims
    assert registry.select({"architectures": ["Qwen3ForCausalLM"]}) == qwen3[0].name


def test_missing_path(tmp_path):
    with pytest.raises(ModelPathNotFoundError, match="does not exist"):
        openinfer.create_engine(tmp_path / "nope")


def test_no_config(tmp_path):
    with pytest.raises(ConfigNotFoundError, match="no config.json"):
        openinfer.create_engine(tmp_path)


def test_config_not_json(tmp_path):
    with pytest.raises(ConfigNotJSONError, match="not valid JSON"):
        openinfer.create_engine(model_dir(tmp_path, "{not json"))


def _known_but_not_installed() -> tuple[str, str] | None:
    """An architecture openinfer knows a plugin for, whose distribution is not installed here."""
    from importlib import metadata

    from openinfer.plugins import KNOWN_PLUGINS

    for architecture, distribution in KNOWN_PLUGINS.items():
        if architecture[0].isupper():
            try:
                metadata.distribution(distribution)
            except metadata.PackageNotFoundError:
                return architecture, distribution
    return None


def test_no_plugin_names_architecture_installed_plugins_and_pip_hint(tmp_path):
    known = _known_but_not_installed()
    if known is not None:
        architecture, distribution = known
        with pytest.raises(NoPluginError) as info:
            openinfer.create_engine(model_dir(tmp_path, {"architectures": [architecture], "model_type": "unserved"}))
        message = str(info.value)
        assert architecture in message and "'unserved'" in message
        assert "openinfer-qwen3" in message  # the installed plugins are listed
        assert f"pip install {distribution}" in message
    with pytest.raises(NoPluginError, match="Write a plugin"):
        openinfer.create_engine(model_dir(tmp_path, {"architectures": ["MadeUpForCausalLM"]}))


def test_two_plugins_tie(tmp_path, site):
    install_fake_plugin(site, "fake-qwen3-rival", "fake_rival", CLAIMS_QWEN3)
    with pytest.raises(AmbiguousPluginError) as info:
        openinfer.create_engine(model_dir(tmp_path, {"architectures": ["Qwen3ForCausalLM"]}))
    assert "fake_rival" in str(info.value)


def test_highest_score_wins(tmp_path, site):
    install_fake_plugin(site, "fake-better", "fake_better", CLAIMS_QWEN3.replace("100 if", "200 if"))
    assert openinfer.create_engine(model_dir(tmp_path, {"architectures": ["Qwen3ForCausalLM"]})) == "fake engine"


def test_broken_plugin_is_an_error_naming_it(site):
    install_fake_plugin(site, "fake-broken", "fake_broken", "raise ImportError('boom')\n")
    with pytest.raises(PluginLoadError, match="fake_broken"):
        openinfer.discover_plugins()


def test_unknown_hook_is_rejected(site):
    install_fake_plugin(site, "fake-typo", "fake_typo", """
        from openinfer import hookimpl

        @hookimpl
        def openinfer_mach(config):
            return 1
    """)
    with pytest.raises(PluginLoadError, match="does not define"):
        openinfer.discover_plugins()


def test_cli_lists_plugins():
    result = subprocess.run([sys.executable, "-m", "openinfer.cli", "plugins", "--json"], capture_output=True,
                            text=True, check=True)
    listed = {p["distribution"]: p for p in json.loads(result.stdout)}
    assert "Qwen3ForCausalLM" in listed["openinfer-qwen3"]["claims"]
    assert listed["openinfer-qwen3"]["version"]
