"""Issue #17's error budget of the chunked Gated DeltaNet prefill (gdn_chunked.cu), on the CPU: the NumPy
model of the kernels' operand rounding (gdn_operand_model.py) against the token-by-token rule in fp64.
bf16 operands (the default grouped_staged) cost several times the output's own bf16 rounding; fp16
operands (OPENINFER_QWEN35_GDN_PREFILL=grouped_f16) a fraction of it. But the teacher-forced test's
model turns every bf16 flip of the layer's output into bf16-level noise downstream (the CPU emulation,
gdn_teacher_forced_emulation.py: any one bf16 point 0.016, fp16 operands 0.0149, 16-bit hi / lo splits
0.0092, against 0.0055 for the token-by-token rule): only ~fp32 products reach the recurrent's level,
and of the split formats only those that keep ~21 bits over the operands' whole range do."""

from __future__ import annotations

import numpy as np
import pytest

from tests.plugins.qwen35 import gdn_operand_model as model


def layer_inputs(length: int, dk: int, dv: int, seed: int = 0):
    """One head's inputs as the layer makes them: l2-normed q (scaled) / k from bf16 rows, bf16 v,
    gates from a trained-looking A_log / dt_bias (dt log-uniform in [1e-3, 0.1])."""
    rng = np.random.default_rng(seed)
    q = model.bf16(rng.standard_normal((length, dk)))
    k = model.bf16(rng.standard_normal((length, dk)) + 0.5 * rng.standard_normal(dk))  # keys share a direction
    v = model.bf16(rng.standard_normal((length, dv)))
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1)))
    dt_bias = dt + np.log(-np.expm1(-dt))  # softplus^-1(dt)
    g = -np.exp(np.log(8.0)) * np.log1p(np.exp(rng.standard_normal(length) + dt_bias))
    beta = 1 / (1 + np.exp(-rng.standard_normal(length)))
    return model.l2_normed(q, dk**-0.5), model.l2_normed(k), v, g, beta


@pytest.fixture(scope="module")
def case():
    inputs = layer_inputs(384, 64, 64)
    return inputs, model.recurrent(*inputs)


def error(inputs, reference, rounding) -> float:
    return model.row_relative_error(model.chunked(*inputs, rounding), reference)


def test_fp16_operands_bring_the_chunked_error_under_the_outputs_own_rounding(case):
    inputs, reference = case
    output_rounding = model.row_relative_error(model.bf16(reference), reference)  # every path pays it
    assert error(inputs, reference, {}) < 1e-9  # the model is the token-by-token rule
    with_bf16 = error(inputs, reference, model.everywhere(model.bf16))
    with_fp16 = error(inputs, reference, model.everywhere(model.fp16))
    assert with_bf16 > 1.5 * output_rounding
    assert with_fp16 < 0.5 * output_rounding
    assert with_fp16 < with_bf16 / 4


def test_only_splits_that_keep_21_bits_everywhere_reach_fp32_level(case):
    """hi / lo bf16 splits keep ~16 bits (some bf16 outputs still flip); fp16 hi / lo loses its lo part
    to subnormals for small operands (P, T diag(beta exp c)); fp16 hi with the remainder scaled by 2^11
    and three bf16 parts keep the token-by-token kernels' fp32-level error."""
    inputs, reference = case
    fp32_level = error(inputs, reference, model.everywhere(lambda x: model.exact(x).astype(np.float32)))
    levels = {name: error(inputs, reference, model.everywhere(getattr(model, name)))
              for name in ("bf16_hi_lo", "fp16_hi_lo", "fp16_hi_scaled_lo", "bf16_hi_mid_lo")}
    assert levels["bf16_hi_lo"] > 10 * fp32_level
    assert levels["fp16_hi_scaled_lo"] < 4 * fp32_level
    assert levels["bf16_hi_mid_lo"] < 4 * fp32_level
    assert levels["fp16_hi_scaled_lo"] < levels["fp16_hi_lo"] / 4
    flips = model.bf16_flips(model.chunked(*inputs, model.everywhere(model.fp16_hi_scaled_lo)), reference)
    assert flips < 1e-3


def test_unknown_rounding_points_are_rejected():
    with pytest.raises(ValueError, match="unknown rounding points"):
        model.everywhere(model.bf16, Q=model.fp16)
    with pytest.raises(ValueError, match="unknown rounding points"):
        model.chunked(*layer_inputs(8, 4, 4), {"state": model.bf16})


def test_exact_scores_and_24_bit_splits_reach_fp32_level(case):
    """The design the issue's fix needs (issue #17): q / k never rounded once normed — the kernels' products
    with them taken on the raw bf16 rows (exact operands) with the rows' l2 norms applied in fp32 to the
    results or folded into the other operand — and three bf16 parts (~24 bits) for every other operand but
    W and T diag(beta exp c), which keep two (~16 bits). Two parts everywhere (~16 bits) do not."""
    inputs, reference = case
    fp32_level = error(inputs, reference, model.everywhere(lambda x: model.exact(x).astype(np.float32)))
    design = model.everywhere(model.bf16_hi_mid_lo, qk=model.exact, W=model.bf16_hi_lo, Tbe=model.bf16_hi_lo)
    assert error(inputs, reference, design) < 4 * fp32_level
    two_parts = model.everywhere(model.bf16_hi_lo, qk=model.exact)
    assert error(inputs, reference, two_parts) > 10 * fp32_level
