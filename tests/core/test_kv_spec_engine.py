"""The engine runs a model that declares every KV cache kind: per-group block tables, write
slots and state slots reach ``forward``; prefix hits (with a state snapshot) leave outputs
unchanged. The toy model reads its caches only through the batch, so any wrong table, slot or
state row changes its greedy tokens."""

import numpy as np

from openinfer import EngineOptions, ModelSpec, PagedEngine
from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.kv import CompressedSpec, FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec, StateTensor
from tests.helpers.engine_utils import make_request, run_all, run_one

VOCAB, DIM, WINDOW, RATIO = 32, 4, 5, 2


class ToyHybrid:
    """logits = W · (state + mean of full-attention values + mean of window values + sum of
    compressed entries); the state is s ← 0.5·s + e(token)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.embed = rng.standard_normal((VOCAB, DIM)).astype(np.float32)
        self.head = rng.standard_normal((DIM, VOCAB)).astype(np.float32)
        self.backend = NumpyBackend()
        self.spec = ModelSpec(architectures=("Toy",), model_type="toy", vocab_size=VOCAB, max_model_len=64,
                              num_layers=4, num_kv_heads=1, head_dim=DIM)
        self.seen_groups: set[int] = set()

    def kv_cache_specs(self):
        return [FullAttentionSpec(1, DIM), SlidingWindowSpec(1, DIM, window=WINDOW), CompressedSpec(DIM, RATIO),
                RecurrentStateSpec((StateTensor("s", (DIM,)),))]

    def forward(self, batch, kv_cache):
        full, window, compressed, state = kv_cache
        bs = full.k.shape[1]
        x = self.embed[batch.token_ids]
        self.seen_groups.add(len(batch.kv_block_tables))
        for layer, group in ((full, 0), (window, 1)):
            slots = batch.group_slot_mapping(group)
            layer.k.reshape(-1, DIM)[slots] = x
        entry_slots = batch.group_slot_mapping(2)
        out = np.zeros((batch.num_tokens, DIM), np.float32)
        for i in range(batch.num_seqs):
            start, end = batch.query_start[i], batch.query_start[i + 1]
            first = batch.context_lens[i] - (end - start)
            slot = batch.state_slots[i]
            s = np.zeros(DIM, np.float32) if first == 0 else state["s"][slot].copy()
            for row in range(start, end):
                p = first + row - start
                s = 0.5 * s + x[row]
                if (p + 1) % RATIO == 0:  # this token completes a compressed entry
                    pair = [row - 1, row] if row > start else None
                    value = x[row] + (x[row - 1] if pair else self._key(full, batch.block_tables[i], p - 1, bs))
                    compressed.k.reshape(-1, DIM)[entry_slots[row]] = value
                keys = np.stack([self._key(full, batch.block_tables[i], q, bs) for q in range(p + 1)])
                recent = np.stack([self._key(window, batch.group_block_tables(1)[i], q, bs)
                                   for q in range(max(0, p - WINDOW + 1), p + 1)])
                table = batch.group_block_tables(2)[i]
                entries = [compressed.k[table[e // bs], e % bs] for e in range((p + 1) // RATIO)]
                out[row] = s + keys.mean(0) + recent.mean(0) + (np.sum(entries, 0) if entries else 0)
            state["s"][slot] = s
        return out[batch.logits_rows] @ self.head

    @staticmethod
    def _key(layer, table, position, bs):
        return layer.k[table[position // bs], position % bs, 0]


def _engine(**options):
    return PagedEngine(ToyHybrid(), EngineOptions(device="cpu", block_size=2, num_kv_blocks=64, max_num_seqs=4,
                                                  **options))


def test_every_kind_through_the_engine_and_prefix_hit_unchanged():
    prompt = [3, 9, 4, 17, 8, 1, 30, 12, 5, 7, 22]
    cold = _engine(enable_prefix_cache=False)
    try:
        want = [run_one(cold, make_request("a", prompt, 8)).token_ids]
        follow = prompt + want[0][:6] + [6, 2]  # a second turn: a's history + new tokens
        want.append(run_one(cold, make_request("b", follow, 8)).token_ids)
        other = run_all(cold, [make_request(f"x{i}", [i + 1, 5, 9, 2, 7], 6) for i in range(5)])
        assert cold.model.seen_groups == {4}
        assert cold.kv.num_snapshots == 0
    finally:
        cold.close_sync()
    warm = _engine()
    try:
        first = run_one(warm, make_request("a", prompt, 8))
        assert first.token_ids == want[0] and first.cached_tokens == 0
        assert warm.kv.num_snapshots >= 1
        again = run_one(warm, make_request("a2", prompt, 8))
        # hits come in whole compressed blocks (2 blocks of 2 tokens); the prompt's first chunk
        # stopped at its last such boundary (8 tokens), where the state was snapshotted
        assert warm.kv.hit_granularity == 4
        assert again.token_ids == want[0] and again.cached_tokens == 8
        # the second turn extends a's prompt + output: a's decode state was snapshotted at 16 tokens
        second = run_one(warm, make_request("b", follow, 8))
        assert second.token_ids == want[1] and second.cached_tokens == 16
        # more requests than live slots (4): slots and blocks are reused, outputs unchanged
        again = run_all(warm, [make_request(f"x{i}", [i + 1, 5, 9, 2, 7], 6) for i in range(5)])
        assert [o.token_ids for o in again] == [o.token_ids for o in other]
        assert warm.load().kv_blocks_used == 0 and len([p for p in warm.pools if p]) == 3  # a pool per paged group
        assert warm.state_slots.num_used_slots == warm.kv.num_snapshots  # live slots all returned
    finally:
        warm.close_sync()
