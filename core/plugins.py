"""Plugin discovery (pluggy over the ``openinfer.models`` entry points) and model selection."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy

from openinfer import hookspecs
from openinfer.errors import (
    AmbiguousPluginError,
    ConfigNotFoundError,
    ConfigNotJSONError,
    ModelPathNotFoundError,
    NoPluginError,
    PluginLoadError,
)

logger = logging.getLogger(__name__)

# Where a user can get a plugin for a well-known architecture.
KNOWN_PLUGINS = {
    "Qwen3ForCausalLM": "openinfer-qwen3",
    "qwen3": "openinfer-qwen3",
    "Qwen3_5ForCausalLM": "openinfer-qwen35",
    "Qwen3_5ForConditionalGeneration": "openinfer-qwen35",
    "qwen3_5": "openinfer-qwen35",
    "qwen3_5_text": "openinfer-qwen35",
    "LlamaForCausalLM": "openinfer-llama",
    "llama": "openinfer-llama",
    "DeepseekV4ForCausalLM": "openinfer-deepseek-v4",
    "KimiK2ForCausalLM": "openinfer-kimi-k2",
}


@dataclass(frozen=True)
class InstalledPlugin:
    name: str  # entry point name
    distribution: str
    version: str
    claims: tuple[str, ...]


class PluginRegistry:
    """The plugin manager after discovery: every ``openinfer.models`` entry point, loaded."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self.plugins: dict[str, InstalledPlugin] = {}

    def register(self, plugin: object, name: str, distribution: str = "", version: str = "") -> None:
        self.manager.register(plugin, name=name)
        claims: list[str] = []
        for impl in self.manager.hook.openinfer_claims.get_hookimpls():
            if impl.plugin_name == name:
                claims = list(impl.function())
        self.plugins[name] = InstalledPlugin(name, distribution or name, version, tuple(claims))

    def discover(self) -> PluginRegistry:
        for entry_point in metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            dist = entry_point.dist
            try:
                plugin = entry_point.load()
            except Exception as exc:  # a broken plugin is an error with its name, never a skip
                raise PluginLoadError(
                    f"plugin {entry_point.name!r} ({entry_point.value}) failed to import: {exc!r}; "
                    f"reinstall or uninstall {dist.name if dist else entry_point.name}"
                ) from exc
            self.register(plugin, entry_point.name, dist.name if dist else "", dist.version if dist else "")
        try:
            self.manager.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"a plugin implements a hook openinfer does not define: {exc}") from exc
        return self

    def select(self, config: dict[str, Any], config_path: str = "config.json") -> str:
        """Return the name of the plugin with the highest ``openinfer_match`` score."""
        scores: list[tuple[int, str]] = []
        for impl in self.manager.hook.openinfer_match.get_hookimpls():
            score = impl.function(config=config)
            if score is not None:
                scores.append((int(score), impl.plugin_name))
        if not scores:
            raise NoPluginError(_no_plugin_message(config, config_path, self.plugins))
        scores.sort(reverse=True)
        if len(scores) > 1 and scores[0][0] == scores[1][0]:
            raise AmbiguousPluginError(
                f"plugins {scores[0][1]!r} and {scores[1][1]!r} both claim {config_path} with score "
                f"{scores[0][0]}; uninstall one of them"
            )
        return scores[0][1]

    def create_engine(self, plugin_name: str, model_path: str, config: dict[str, Any], options: Any) -> Any:
        for impl in self.manager.hook.openinfer_create_engine.get_hookimpls():
            if impl.plugin_name == plugin_name:
                return impl.function(model_path=model_path, config=config, options=options)
        raise PluginLoadError(f"plugin {plugin_name!r} matched the model but has no openinfer_create_engine")

    def model_memory(self, plugin_name: str, config: dict[str, Any]) -> Any:
        """The plugin's ``ModelMemory`` for ``config``, or None when it does not describe one."""
        for impl in self.manager.hook.openinfer_model_memory.get_hookimpls():
            if impl.plugin_name == plugin_name:
                return impl.function(config=config)
        return None


    def chat_encoder(self, config: dict[str, Any]) -> Any:
        """The chat encoder of the plugin that serves ``config`` (see ``openinfer_chat_encoder``),
        or ``None`` when no plugin serves it or the winner brings none."""
        try:
            plugin_name = self.select(config)
        except (NoPluginError, AmbiguousPluginError):
            return None
        for impl in self.manager.hook.openinfer_chat_encoder.get_hookimpls():
            if impl.plugin_name == plugin_name:
                return impl.function(config=config)
        return None


def _architecture_names(config: dict[str, Any]) -> tuple[list[str], str | None]:
    architectures = list(config.get("architectures") or [])
    model_type = config.get("model_type")
    text = config.get("text_config")
    if isinstance(text, dict) and not model_type:
        model_type = text.get("model_type")
    return architectures, model_type


def _no_plugin_message(config: dict[str, Any], config_path: str, plugins: dict[str, InstalledPlugin]) -> str:
    architectures, model_type = _architecture_names(config)
    installed = ", ".join(f"{p.distribution} ({'/'.join(p.claims) or '?'})" for p in plugins.values())
    hint = next((KNOWN_PLUGINS[k] for k in [*architectures, model_type or ""] if k in KNOWN_PLUGINS), None)
    message = (
        f"no installed plugin serves {config_path}: architectures={architectures}, "
        f"model_type={model_type!r}; installed plugins: {installed or 'none'}."
    )
    if hint:
        message += f" Install one with: pip install {hint}"
    else:
        message += " Write a plugin for it (see docs/writing-a-plugin.md)."
    return message


def read_model_config(model_path: str | Path) -> dict[str, Any]:
    """Parse ``<model_path>/config.json`` with the distinct errors a user can act on."""
    path = Path(model_path)
    if not path.exists():
        raise ModelPathNotFoundError(str(path))
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ConfigNotFoundError(str(path))
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigNotJSONError(str(config_file), str(exc)) from exc
    if not isinstance(config, dict):
        raise ConfigNotJSONError(str(config_file), "top level is not an object")
    return config


def discover_plugins() -> PluginRegistry:
    return PluginRegistry().discover()


def read_generation_config(model_path: str | Path) -> dict[str, Any]:
    """``generation_config.json`` if present and valid, else {} (it is optional)."""
    path = Path(model_path) / "generation_config.json"
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def score_architectures(config: dict[str, Any], architectures: tuple[str, ...], model_types: tuple[str, ...],
                        exact: int = 100, by_model_type: int = 50) -> int | None:
    """The usual ``openinfer_match``: ``exact`` when config.json's ``architectures`` names one
    of ours, ``by_model_type`` when only ``model_type`` does, else None."""
    if any(name in architectures for name in config.get("architectures") or []):
        return exact
    if config.get("model_type") in model_types:
        return by_model_type
    return None
