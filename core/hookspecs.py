"""The hooks a model plugin implements — this module is the plugin author's reference.

A plugin is a module or object registered under the entry point group ``openinfer.models``::

    # pyproject.toml of your distribution
    [project.entry-points."openinfer.models"]
    llama = "openinfer_llama.plugin"

and decorates its functions with ``openinfer.hookimpl``. Core reads ``config.json``, asks
every plugin's ``openinfer_match``, and calls ``openinfer_create_engine`` on the single
plugin with the highest score only.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT_NAME = "openinfer"
ENTRY_POINT_GROUP = "openinfer.models"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def openinfer_match(config: dict[str, Any]) -> int | None:
    """Score how well this plugin serves a model, from its parsed ``config.json``.

    Return ``None`` when the plugin cannot serve it, else an int: 100 for an exact
    ``architectures`` match, lower for a generic fallback (e.g. ``model_type`` only).
    Multimodal checkpoints keep text fields under ``config["text_config"]``.
    """


@hookspec
def openinfer_create_engine(model_path: str, config: dict[str, Any], options: Any) -> Any:
    """Build the engine (an ``openinfer.EngineHandle``) for a model this plugin matched.

    ``options`` is an ``openinfer.EngineOptions``. Most plugins build a model object and
    return ``openinfer.PagedEngine(model, options)``; a plugin may return its own engine.
    Called only on the plugin whose ``openinfer_match`` won.
    """


@hookspec
def openinfer_claims() -> list[str]:
    """The architectures / model types this plugin serves, for ``openinfer plugins``."""


@hookspec
def openinfer_chat_encoder(config: dict[str, Any]) -> Any:
    """Return a chat encoder for a model whose checkpoint ships no Jinja chat template, or ``None``.

    Asked only of the plugin whose ``openinfer_match`` wins for ``config``, when the tokenizer
    directory has no ``chat_template``. The encoder is any object with
    ``encode(messages, add_generation_prompt=True, tools=None, **options) -> str`` (see
    ``openinfer.tokenizer.ChatEncoder``): ``messages`` are OpenAI chat messages as dicts, ``options`` the
    request's ``chat_template_kwargs`` (e.g. ``thinking``). It writes the model's special tokens
    itself (BOS included); raise ``openinfer.InvalidRequestError`` for messages it cannot encode.
    """


@hookspec
def openinfer_model_memory(config: dict[str, Any]) -> Any:
    """Optional: what the model holds, from ``config.json`` alone, for memory planning
    (``openinfer plan`` and the check before loading on GPUs) and ``--load-format dummy``.

    Return an ``openinfer.parallel.memory_plan.ModelMemory``: every tensor's shape, bytes per
    element and how it splits over tensor/expert-parallel ranks, and the KV bytes per token.
    Called only on the plugin whose ``openinfer_match`` won; a plugin without it gets no plan.
    """
