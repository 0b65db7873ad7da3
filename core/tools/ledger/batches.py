"""The synthetic steps a ledger times (``openinfer.runtime.synthetic_batches``; the engine's
start-up warm-up builds its steps the same way)."""

from openinfer.runtime.synthetic_batches import (
    BLOCK_SIZE,
    StepLayout,
    decode_batch,
    prefill_batch,
    step_batch,
)

__all__ = ["BLOCK_SIZE", "StepLayout", "decode_batch", "prefill_batch", "step_batch"]
