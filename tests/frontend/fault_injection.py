"""Faults injected into the processes of a real ``openinfer serve`` (supervisor, engine core, API
servers), for the multi-process hardening tests, which need a 500 that no valid request causes.

* ``create_faulty_stub_engine`` (an ``--engine-factory``): the stub engine, whose model step
  raises when a request's prompt starts with ``ENGINE_FAULT_PROMPT`` (the engine fails that
  request with an internal error; the API server answers 500).
* ``write_sitecustomize``: a ``sitecustomize.py`` that, on ``PYTHONPATH``, makes every child's
  ``Tokenizer.encode`` raise ``RuntimeError`` for text containing ``API_FAULT_TEXT`` (an
  exception no handler maps, inside an API server).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ENGINE_FAULT_PROMPT = (11, 22, 33)
API_FAULT_TEXT = "inject-an-api-server-fault"
FACTORY_SPEC = "fault_injection:create_faulty_stub_engine"


def create_faulty_stub_engine(model_path: str, **options: Any) -> Any:
    from openinfer.engine_core.stub import create_stub_engine

    engine = create_stub_engine(model_path, **options)
    backend = engine.model.backend
    sample_rows_async = backend.sample_rows_async

    def faulty_sample_rows_async(logits: Any, rows: Any) -> Any:
        if any(tuple(row.request.token_ids[:len(ENGINE_FAULT_PROMPT)]) == ENGINE_FAULT_PROMPT for row in rows):
            raise RuntimeError("injected model-step fault")
        return sample_rows_async(logits, rows)

    backend.sample_rows_async = faulty_sample_rows_async
    return engine


def install_api_server_fault() -> None:
    from openinfer.tokenizer import Tokenizer

    encode = Tokenizer.encode

    def faulty_encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        if API_FAULT_TEXT in text:
            raise RuntimeError("injected API-server fault")
        return encode(self, text, *args, **kwargs)

    Tokenizer.encode = faulty_encode


def write_sitecustomize(directory: Path) -> Path:
    """``directory/sitecustomize.py`` installing the API-server fault; put ``directory`` and this
    module's folder on the server's ``PYTHONPATH``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import fault_injection\nfault_injection.install_api_server_fault()\n")
    return directory
