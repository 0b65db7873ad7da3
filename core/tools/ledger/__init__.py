"""Kernel ledger and step-time model (GPU): every op of a model's decode and prefill, timed on
the device over a grid of (batch, context), with its kernels, shape, bytes, FLOPs and % of
its roofline; from those, a predicted step time for any (batch, context) next to a measured one.

    python -m openinfer.tools.ledger --model-path DIR [--out ledger.json] [--markdown ledger.md]
    python -m openinfer.tools.ledger --random qwen3-4b --out ...     # that shape, random weights
    python -m openinfer.tools.ledger --model-path DIR --device cpu ... # the NumPy backend (host clock)

``--random`` writes only the preset's config.json and loads it with ``load_format="dummy"``
(random weights at the real shapes: speed does not depend on values). Batches follow the
engine's KV cache groups, so hybrid models (Qwen3.5: full attention in paged blocks, Gated
DeltaNet state in slots) get their group tables and one state slot per sequence.

How an op is timed (cuda): one forward runs with the model's op objects (its backend and, where it has
one, its kernel plan) wrapped, recording each top-level op call with its arguments. The
recorded calls are then replayed in order behind a spin kernel that holds the stream, with an
event between consecutive ops: the host enqueues the whole step before the device starts, so
each event gap is the op's device time in a real step's order (its weights cold in L2, its
inputs warm) and no host launch gaps. Median over ``--repeats`` replays. On the CPU (numpy) an
op's time is its host time, and the ceilings are NumPy's copy rate and fp32 matmul rate.

Model: an op's time per step is interpolated over the grid (piecewise linear in context, then
in log2 batch); a step is the sum of its ops (on the eager path: the larger of the summed
device and host times). The measured step is the graph replay (CUDA-graph models) or the eager
forward, timed with events / host clock.
"""

from __future__ import annotations

from openinfer.tools.ledger.batches import BLOCK_SIZE, StepLayout, decode_batch, prefill_batch
from openinfer.tools.ledger.cli import PRESETS, Ledger, main, write_preset_config
from openinfer.tools.ledger.recording import OpCall, OpRecorder, op_cost, op_key
from openinfer.tools.ledger.report import OP_KINDS, breakdown, markdown, op_kind, write_report
from openinfer.tools.ledger.step_model import StepModel, interpolate, predict_checks
from openinfer.tools.ledger.timing import HostTimer, Timer, ceilings, gpu_seconds

__all__ = ["BLOCK_SIZE", "OP_KINDS", "PRESETS", "HostTimer", "Ledger", "OpCall", "OpRecorder", "StepLayout",
           "StepModel", "Timer", "breakdown", "ceilings", "decode_batch", "gpu_seconds", "interpolate", "main",
           "markdown", "op_cost", "op_key", "op_kind", "predict_checks", "prefill_batch", "write_preset_config",
           "write_report"]
