"""``DecoderLayer`` / ``DecoderStack`` with a backend that adds the o_proj and down products into
the residual in place (``linear_residual``, as cuda does under ``OPENINFER_RESIDUAL_GEMM=1``): the
same logits as the backend without it, on the NumPy backend (fp32: the sums are the same)."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer import AttentionSpec, DecoderLayer, DecoderStack
from openinfer.backend.base import ForwardBatch
from openinfer.backend.numpy_backend import NumpyBackend


class AddingBackend(NumpyBackend):
    """The NumPy backend with ``linear_residual``; ``rows_from``: the smallest batch it takes
    (below, it declines, as cuda does for a GEMV row)."""

    def __init__(self, rows_from: int = 1) -> None:
        super().__init__()
        self.rows_from = rows_from
        self.added = 0

    def linear_residual(self, x, layer, residual, silu_mul=False) -> bool:
        if x.shape[0] < self.rows_from:
            return False
        residual += self.linear(self.silu_mul(x) if silu_mul else x, layer)
        self.added += 1
        return True


def tiny_stack(backend: NumpyBackend, rng: np.random.Generator, num_layers: int = 3) -> tuple[DecoderStack, list]:
    hidden, heads, kv_heads, head_dim, inter, vocab = 64, 4, 2, 16, 96, 200

    def w(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    layers = [DecoderLayer(input_norm=norm(), qkv=backend.linear_weight(w((heads + 2 * kv_heads) * head_dim, hidden)),
                           attention=AttentionSpec(heads, kv_heads, head_dim, None, head_dim ** -0.5),
                           o_proj=backend.linear_weight(w(hidden, heads * head_dim)), post_attention_norm=norm(),
                           gate_up=backend.linear_weight(w(2 * inter, hidden)), down=backend.linear_weight(w(hidden, inter)))
              for _ in range(num_layers)]
    stack = DecoderStack(embed_tokens=w(vocab, hidden), layers=layers, final_norm=norm(),
                         lm_head=backend.linear_weight(w(vocab, hidden)), eps=1e-6)
    return stack, [backend.allocate_kv(8, 16, kv_heads, head_dim) for _ in range(num_layers)]


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("rows_from", [1, 2])
def test_adding_into_the_residual_gives_the_same_logits(tokens, rows_from):
    batch = ForwardBatch.over_blocks(np.arange(1, 4, dtype=np.int32)[None, :], [0], [tokens], 16,
                                     token_ids=np.arange(tokens) * 7 % 200)
    outputs = []
    for backend in (NumpyBackend(), AddingBackend(rows_from)):
        stack, kv = tiny_stack(backend, np.random.default_rng(12))
        outputs.append(stack.forward(backend, backend.prepare_batch(batch), kv))
    plain, adding = outputs
    assert plain.shape == adding.shape == (1, 200)
    np.testing.assert_allclose(adding, plain, rtol=1e-5, atol=1e-5)
    assert backend.added == (0 if tokens < rows_from else 2 * 3)
