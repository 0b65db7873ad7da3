"""A worker process for the router tests: ``python agent_worker.py PORT MODEL_DIR [LOG]`` serves the
model (NumPy backend) over smg's vLLM-engine protocol on PORT; with LOG, every structured-output
constraint the router sends is appended to that file (the tests read what the router asked for)."""

from __future__ import annotations

import asyncio
import sys

import openinfer
from openinfer.frontend.grpc import start_grpc_server


class ConstraintLog:
    """Wraps an engine: appends each request's structured output (as text) to a file."""

    def __init__(self, engine, path: str):
        self._engine = engine
        self._path = path

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, request):
        with open(self._path, "a", encoding="utf-8") as log:
            log.write(repr(request.structured_output).replace("\n", " ") + "\n")
        return self._engine.generate(request)


async def main(port: int, model_dir: str, log: str | None) -> None:
    engine = openinfer.create_engine(model_dir, device="cpu", num_kv_blocks=256, max_num_seqs=8)
    served = ConstraintLog(engine, log) if log else engine
    server = await start_grpc_server(served, "127.0.0.1", port, sglang_model_name="tiny", worker_protocol="vllm")
    print(f"worker ready on {server.port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None))
