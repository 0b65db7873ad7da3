"""Which sequences of a step the GPU runs in MLA's decompressed form, and how their query tiles
are laid out (``openinfer.mla.decompressed_prefill_layout``; the kernels' own test is
tests/core/test_kimi_kernels_emulated.py)."""

import numpy as np

from openinfer.backend.base import ForwardBatch
from openinfer.mla import PREFILL_TILE, MLASpec, decompressed_prefill_layout

SPEC = MLASpec(num_heads=4, qk_nope_dim=16, qk_rope_dim=16, v_head_dim=16, kv_lora_rank=32, scale=0.2)
ROW_BYTES = 2 * 4 * (16 + 16) + 2 * 48  # expanded keys + values + gathered latent of one context row


def batch(cached, new):
    query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    tokens = int(query_start[-1])
    return ForwardBatch(token_ids=np.zeros(tokens, np.int32), positions=np.zeros(tokens, np.int32),
                        query_start=query_start, context_lens=np.add(cached, new).astype(np.int32),
                        block_tables=np.zeros((len(new), 1), np.int32), slot_mapping=np.zeros(tokens, np.int32),
                        logits_rows=np.zeros(0, np.int32), max_query_len=max(new),
                        max_context_len=int(max(np.add(cached, new))))


def test_long_sequences_take_the_decompressed_form_and_the_rest_stay_absorbed():
    step = batch(cached=[0, 5, 300, 0], new=[130, 1, 20, 3])
    layout = decompressed_prefill_layout(step, SPEC, min_query=16, scratch_bytes=1 << 30)
    # rows: table row, first query token, query count, context length, first context row
    assert layout.seqs.tolist() == [[0, 0, 130, 130, 0], [2, 131, 20, 320, 130]]
    assert layout.context_rows == 450
    assert layout.query_rows.tolist() == list(range(0, 130)) + list(range(131, 151))
    assert layout.absorbed_rows.tolist() == [130, 151, 152, 153]
    # every 64-query tile once; the tile whose first query sees the most keys first
    tiles = sorted(zip(layout.tile_seq.tolist(), layout.tile_query.tolist(), strict=True))
    assert tiles == [(0, 0), (0, PREFILL_TILE), (0, 2 * PREFILL_TILE), (1, 0)]
    assert (layout.tile_seq[0], layout.tile_query[0]) == (1, 0)  # 300 keys before its first query


def test_scratch_cap_stops_at_the_sequence_that_does_not_fit_but_always_takes_one():
    step = batch(cached=[0, 0, 0], new=[100, 100, 100])
    layout = decompressed_prefill_layout(step, SPEC, min_query=16, scratch_bytes=250 * ROW_BYTES)
    assert layout.seqs[:, 0].tolist() == [0, 1] and layout.absorbed_rows.tolist() == list(range(200, 300))
    alone = decompressed_prefill_layout(step, SPEC, min_query=16, scratch_bytes=10 * ROW_BYTES)
    assert alone.seqs[:, 0].tolist() == [0]
    assert decompressed_prefill_layout(batch([0], [8]), SPEC, min_query=16, scratch_bytes=1 << 30) is None
