"""The kernel ledger's cuda attention rows (no GPU): every routing ``attend`` may take is
recorded as its own row, so a mixed step (OPENINFER_MIXED_DECODE_ATTENTION, the default from 16
decode rows) is one ``mixed_attention`` row costed over all its rows, not its inner prefill
launches each costed as the whole step with the decode rows left out."""

from __future__ import annotations

import ast
import importlib.util
import types
from pathlib import Path

import numpy as np

from openinfer.backend.base import AttentionSpec, ForwardBatch
from openinfer.tools.ledger import OpCall, OpRecorder, op_cost, op_kind
from openinfer.tools.ledger.cli import CUDA_ATTENTION_CALLS


def _functions_returned_by(source: Path, function: str) -> set[str]:
    """Names of the functions whose results ``function`` returns (``return f(...)``)."""
    tree = ast.parse(source.read_text())
    body = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function)
    return {node.value.func.id for node in ast.walk(body) if isinstance(node, ast.Return)
            and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)}


def test_every_attention_routing_is_a_ledger_row():
    source = Path(importlib.util.find_spec("openinfer.backend.cuda.attention").origin)
    routings = _functions_returned_by(source, "attend")
    assert {"decode_attention", "short_query_attention", "mixed_attention", "prefill_attention"} <= routings
    assert routings | {"write_qkv"} == set(CUDA_ATTENTION_CALLS)


def _mixed_step() -> ForwardBatch:
    cached, new = [500] * 16 + [0], [1] * 16 + [300]
    tables = np.arange(1, 17 * 40 + 1, dtype=np.int32).reshape(17, 40)
    return ForwardBatch.over_blocks(tables, cached, new, 16)


def test_a_mixed_step_is_one_row_costed_over_all_its_rows():
    """Recorded through the expansion: mixed_attention's inner prefill call is not a row of its own."""
    kernels = types.ModuleType("attention")
    inner: list[str] = []

    def prefill_attention(q, spec, kv, batch, out=None, tile_range=None):
        inner.append("prefill")
        return q

    def mixed_attention(q, spec, kv, batch, split, num_sms):
        return kernels.prefill_attention(q, spec, kv, batch, tile_range=(0, 3))  # looked up at call time

    kernels.prefill_attention, kernels.mixed_attention = prefill_attention, mixed_attention

    class Backend:
        name = "fake"

        def attention(self, q, spec, batch):
            return kernels.mixed_attention(q, spec, None, batch, None, 132)

    backend = Backend()
    recorder = OpRecorder({"backend": backend}, kernel_names=False,
                          expand={"attention": (kernels, ("prefill_attention", "mixed_attention"))})
    host = _mixed_step()
    spec = AttentionSpec(32, 8, 128, None, 128**-0.5)
    q = np.zeros((host.num_tokens, 32, 128), np.uint16)
    calls = recorder.record(lambda: backend.attention(q, spec, host))
    assert [c.name for c in calls] == ["mixed_attention"] and inner == ["prefill"]
    moved, flops = op_cost(calls[0], host)
    # the same cost a single prefill kernel over the whole step would be given: every row's keys
    whole = OpCall("attention", "prefill_attention", None, calls[0].args, {}, None)
    assert (moved, flops) == op_cost(whole, host)
    pairs = 16 * 501 + 300 * 301 / 2  # 16 decodes over 500 cached keys and their own, a causal 300-token chunk
    assert flops == 4.0 * 32 * 128 * pairs
    assert moved == 2 * q.nbytes + (16 * 501 + 300) * 2 * 8 * 128 * 2
    assert op_kind("mixed_attention") == op_kind("prefill_attention") == "attention kernels"
