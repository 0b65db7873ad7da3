"""The vectorized decode path of ``build_forward_batch`` builds exactly what the general path builds."""

from types import SimpleNamespace

import numpy as np

from openinfer.kv.table_rows import BlockTableRows
from openinfer.runtime import batch_builder
from openinfer.sampling import SamplingState
from openinfer.sched.request import Request, TokenIds
from openinfer.v1 import engine_pb2 as pb


class _KV:
    block_size = 16

    def __init__(self, tables: dict[str, list[int]]):
        self.tables = tables
        spec = SimpleNamespace(paged=True, tokens_per_entry=1)
        self.groups = SimpleNamespace(groups=[SimpleNamespace(group_id=0, paged=True, spec=spec)], has_state=False)
        self.rows = BlockTableRows(1, rows=4, width=4)
        self.row_of = {}
        for request_id, table in tables.items():
            self.row_of[request_id] = self.rows.assign()
            self.rows.write(0, self.row_of[request_id], 0, table)

    def group_tables(self, request_id: str) -> list[list[int]]:
        return [self.tables[request_id]]

    def table_rows_of(self, request_ids):
        return np.asarray([self.row_of[r] for r in request_ids], np.int64)

    def gather_tables(self, group_id, rows):
        return self.rows.gather(group_id, rows)


def test_decode_fast_path_equals_the_general_path(monkeypatch):
    rng = np.random.default_rng(0)
    chunks, tables = [], {}
    for i in range(40):
        start = int(rng.integers(0, 300))
        tables[f"r{i}"] = rng.integers(1, 1000, start // 16 + 1 + int(rng.integers(0, 3))).tolist()
        tokens = rng.integers(0, 100, start + 1).tolist()
        if i % 3 == 0:
            tokens[-1] = batch_builder.PLACEHOLDER_TOKEN  # fed from the step in flight
        # the last token is a generated one (a decode's input), or the prompt's last (its first decode)
        num_prompt = start + 1 if i % 4 == 1 else start
        request = Request(request_id=f"r{i}", token_ids=tokens, num_prompt_tokens=num_prompt,
                          stop=pb.StopConditions(), max_tokens=4, pending_sample_row=2 * i,
                          sampling=SamplingState(pb.SamplingParams(), np.random.default_rng(0), np.asarray(tokens)))
        if i % 3 == 0 and i % 4 == 1:  # a placeholder is never a prompt token
            request.token_ids = TokenIds(np.asarray(tokens[:-1]), [batch_builder.PLACEHOLDER_TOKEN])
            request.num_prompt_tokens = start
        chunks.append(SimpleNamespace(request=request, start=start, num_tokens=1, samples=True))
    kv = _KV(tables)
    assert batch_builder._is_plain_decode(chunks, kv)
    fast, fast_rows = batch_builder.build_forward_batch(chunks, kv)
    monkeypatch.setattr(batch_builder, "_is_plain_decode", lambda chunks, kv: False)
    general, general_rows = batch_builder.build_forward_batch(chunks, kv)
    for name in ("token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping",
                 "logits_rows", "token_sources"):
        assert np.array_equal(getattr(fast, name), getattr(general, name)), name
        assert getattr(fast, name).dtype == getattr(general, name).dtype, name
    assert (fast.max_context_len, fast.max_query_len) == (general.max_context_len, general.max_query_len)
    # both take the tables from the rows: they hold each request's list, null-padded
    width = max(len(t) for t in tables.values())
    expected = np.array([tables[c.request.request_id] + [0] * (width - len(tables[c.request.request_id]))
                         for c in chunks], np.int32)
    assert np.array_equal(fast.block_tables, expected)
    assert [(r.position, r.samples) for r in fast_rows] == [(r.position, r.samples) for r in general_rows]
