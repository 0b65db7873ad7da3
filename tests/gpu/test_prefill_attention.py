"""Prefill attention kernels (the Hopper wgmma one and the mma.sync one) against a float64 NumPy
causal attention over the same paged cache: fresh and chunked (offset) queries, several sequences
of different lengths in one batch, GQA and MHA, head_dim 128 and 256, shuffled non-contiguous
blocks, and an output poisoned with NaN before each run so every unwritten element shows. The
sm90 kernel's run-time variants (OPENINFER_SM90_* environment variables, re-read through
refresh_kernel_choices: grid order, page reads, ping-pong, overlap, stages, TMA K/V loads,
persistent schedule) each pass the same cases, and persistent launches in a row each cover all
their items; runs of consecutive KV blocks in one TMA box (OPENINFER_SM90_KV_RUNS), whole and
broken; Q in registers (OPENINFER_SM90_Q_REGISTERS) over the consumer-loop variants; the short-query kernel (decode_attention.py) on short steps over long and short cached
contexts, at every split count."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.base import AttentionSpec, ForwardBatch, KVLayer
from openinfer.backend.cuda.bf16 import bf16_bits_to_float, float_to_bf16_bits
from tests.gpu.conftest import BLOCK_SIZE, bf16_random, paged_batch, relative_error

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CASES = {
    # name: (head_dim, num_heads, num_kv_heads, cached tokens per sequence, new tokens per sequence)
    "fresh-300-gqa4": (128, 8, 2, [0], [300]),
    "fresh-128-exact-tile": (128, 4, 1, [0], [128]),
    "chunk-offset-unaligned": (128, 8, 2, [200], [77]),
    "chunk-long-offset": (128, 4, 2, [1500], [1000]),
    "mixed-lengths": (128, 8, 2, [0, 50, 33, 16, 0, 700], [100, 37, 1, 130, 5, 260]),
    "mha": (128, 4, 4, [64, 0], [64, 190]),
    "gqa8-many-prompts": (128, 16, 2, [0] * 12, [80, 82, 48, 32, 26, 72, 129, 16, 30, 250, 50, 69]),
    "d256-mixed": (256, 4, 2, [0, 90, 0], [200, 70, 33]),
    "d256-chunk": (256, 8, 4, [333], [129]),
}
# sm90 kernel variants besides the default: name -> the OPENINFER_SM90_* settings (attention.SM90_ENV keys)
SM90_VARIANTS = {
    "no-overlap": {"overlap": "0"},
    "kv-head-grid": {"grid": "kv_head"},
    "batched-page-reads": {"page_reads": "batched"},
    "l2": {"grid": "kv_head", "page_reads": "batched"},
    "l2-pingpong": {"grid": "kv_head", "page_reads": "batched", "pingpong": "1"},
    "l2-no-overlap": {"grid": "kv_head", "page_reads": "batched", "overlap": "0"},
    "l2-no-overlap-pingpong": {"grid": "kv_head", "page_reads": "batched", "overlap": "0", "pingpong": "1"},
    "l2-2-stages": {"grid": "kv_head", "page_reads": "batched", "stages": "2"},
    "pingpong": {"pingpong": "1"},
    "no-overlap-pingpong": {"overlap": "0", "pingpong": "1"},
    # K/V tiles by TMA page boxes (the ragged last tile by cp.async) over the default and the others
    "tma": {"kv_loads": "tma"},
    "tma-no-overlap": {"kv_loads": "tma", "overlap": "0"},
    "tma-head-grid-no-pingpong": {"kv_loads": "tma", "grid": "head", "pingpong": "0"},
    "tma-2-stages": {"kv_loads": "tma", "stages": "2"},
    # CTA pairs share each TMA K/V tile (cluster multicast); MHA / odd groups fall back to "tma"
    "tma-multicast": {"kv_loads": "tma_multicast"},
    "tma-multicast-no-overlap": {"kv_loads": "tma_multicast", "overlap": "0"},
    "tma-auto": {"kv_loads": "auto"},  # TMA from 2048 tokens of context ("chunk-long-offset" here)
    # persistent CTAs claiming work items from a device counter (head_dim 256 keeps the grid)
    "persistent": {"schedule": "persistent"},
    "persistent-tma": {"schedule": "persistent", "kv_loads": "tma"},
    "persistent-no-overlap": {"schedule": "persistent", "overlap": "0"},
    "persistent-head-grid-no-pingpong": {"schedule": "persistent", "grid": "head", "pingpong": "0"},
    # the grid schedule and cp.async loads (the defaults take persistent CTAs and TMA loads on short steps),
    # and session 5's defaults (grid; TMA from 2k tokens; no page-id prefetch)
    "grid": {"schedule": "grid"},
    "grid-cp-async": {"schedule": "grid", "kv_loads": "cp_async"},
    "persistent-cp-async": {"schedule": "persistent", "kv_loads": "cp_async"},
    "session5-defaults": {"schedule": "grid", "page_prefetch": "0", "tma_min_context": "2048"},
    # session 6's refinements (kernel_choices.py), alone and together, over both K/V load paths
    "page-prefetch-tma": {"kv_loads": "tma", "page_prefetch": "1"},
    "split-kv": {"split_kv": "1"},
    "split-kv-tma": {"kv_loads": "tma", "split_kv": "1"},
    "split-kv-tma-no-overlap": {"kv_loads": "tma", "split_kv": "1", "overlap": "0"},
    "early-rescale": {"early_rescale": "1"},
    "lean-arrivals": {"lean_arrivals": "1"},
    "refined-tma": {"kv_loads": "tma", "page_prefetch": "1", "split_kv": "1", "early_rescale": "1",
                    "lean_arrivals": "1"},
    "refined-persistent-auto": {"schedule": "persistent", "kv_loads": "auto", "page_prefetch": "1",
                                "split_kv": "1", "early_rescale": "1", "lean_arrivals": "1"},
    "refined-persistent-tma": {"schedule": "persistent", "kv_loads": "tma", "page_prefetch": "1",
                               "split_kv": "1", "early_rescale": "1", "lean_arrivals": "1"},
    "auto-schedule-refined": {"schedule": "auto", "page_prefetch": "1", "split_kv": "1", "early_rescale": "1",
                              "lean_arrivals": "1"},  # persistent here (every case is below 8k tokens)
    "refined-multicast": {"kv_loads": "tma_multicast", "split_kv": "1", "page_prefetch": "1"},
    # session 7's consumer-loop refinements (the head_dim-128 default since E1; "1" here turns them on at
    # 256 too): alone, together on both schedules and K/V load paths, and beside session 6's
    "session6-consumer-loop": {"descriptor_adds": "0", "skip_unit_rescale": "0", "ordered_softmax": "0",
                               "rescale_slack": "0"},  # the head_dim-128 loop before session 7's defaults
    "descriptor-adds": {"descriptor_adds": "1"},
    "skip-unit-rescale": {"skip_unit_rescale": "1"},
    "ordered-softmax": {"ordered_softmax": "1"},
    "lean-ordered-persistent-tma": {"schedule": "persistent", "kv_loads": "tma", "descriptor_adds": "1",
                                    "skip_unit_rescale": "1", "ordered_softmax": "1"},
    "lean-ordered-grid-cp-async": {"schedule": "grid", "kv_loads": "cp_async", "descriptor_adds": "1",
                                   "skip_unit_rescale": "1", "ordered_softmax": "1"},
    "lean-ordered-refined": {"descriptor_adds": "1", "skip_unit_rescale": "1", "ordered_softmax": "1",
                             "split_kv": "1", "early_rescale": "1", "lean_arrivals": "1"},
    "rescale-slack": {"rescale_slack": "1"},
    "lean-ordered-slack-persistent": {"schedule": "persistent", "descriptor_adds": "1", "skip_unit_rescale": "1",
                                      "ordered_softmax": "1", "rescale_slack": "1"},
    # two query heads of one KV head per CTA, 64 queries each (MHA, odd groups and head_dim 256 keep one
    # head): both grids and schedules, both K/V load paths; ragged tiles leave empty halves
    "head-pairs": {"head_pairs": "1"},
    "head-pairs-persistent-tma": {"head_pairs": "1", "schedule": "persistent", "kv_loads": "tma"},
    "head-pairs-head-grid-cp-async": {"head_pairs": "1", "schedule": "grid", "grid": "head", "kv_loads": "cp_async"},
    "head-pairs-lean-ordered-slack": {"head_pairs": "1", "descriptor_adds": "1", "skip_unit_rescale": "1",
                                      "ordered_softmax": "1", "rescale_slack": "1"},
    "head-pairs-multicast": {"head_pairs": "1", "kv_loads": "tma_multicast", "schedule": "grid"},  # pairs win
}


def reference_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: ForwardBatch,
                        scale: float) -> np.ndarray:
    """float64 causal attention: query i of a sequence (position L - n + i) sees cache slots 0 .. its position."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    out = np.zeros((num_tokens, num_heads, head_dim))
    for b, length in enumerate(batch.context_lens):
        start, end = batch.query_start[b], batch.query_start[b + 1]
        positions = np.arange(length)
        slots = batch.block_tables[b, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].astype(np.float64)  # [L, nkv, d]
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].astype(np.float64)
        query_pos = length - (end - start) + np.arange(end - start)
        visible = positions[None, :] <= query_pos[:, None]
        for h in range(num_heads):
            scores = q[start:end, h].astype(np.float64) @ keys[:, h // group].T * scale
            scores = np.where(visible, scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            out[start:end, h] = weights @ values[:, h // group]
    return out.reshape(num_tokens, num_heads * head_dim)


@pytest.fixture(autouse=True)
def fresh_kernel_choices(monkeypatch):
    """The kernel switches are read once per process: re-read them around each test's settings."""
    from openinfer.backend.cuda.attention import refresh_kernel_choices

    refresh_kernel_choices()
    yield
    monkeypatch.undo()
    refresh_kernel_choices()


def implementations(head_dim: int) -> list[str]:
    from openinfer.backend.cuda.attention import sm90_prefill_supported

    return ["mma", "sm90"] if sm90_prefill_supported(head_dim) else ["mma"]


def check_against_numpy(cuda_backend, rng, case: str, kernels: list[str]) -> None:
    from openinfer.backend.cuda.attention import prefill_attention

    head_dim, num_heads, num_kv_heads, cached, new = CASES[case]
    num_blocks = 3 + sum(-(-(c + n) // BLOCK_SIZE) for c, n in zip(cached, new, strict=True))
    batch = paged_batch(rng, cached, new, num_blocks)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = bf16_random(rng, *shape), bf16_random(rng, *shape)
    q = bf16_random(rng, batch.num_tokens, num_heads, head_dim, scale=2.0)  # sharp softmax rows too
    scale = head_dim**-0.5
    expected = reference_attention(q, k_cache, v_cache, batch, scale)

    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, None, scale, None, None, 1e-6)
    kv = KVLayer(cuda_backend.upload(k_cache), cuda_backend.upload(v_cache))
    q_device = cupy.asarray(float_to_bf16_bits(q))
    device_batch = cuda_backend.prepare_batch(batch)
    for implementation in kernels:
        out = cupy.full((batch.num_tokens, num_heads * head_dim), 0x7FC0, dtype=cupy.uint16)  # bf16 NaN
        prefill_attention(q_device, spec, kv, device_batch, implementation=implementation, out=out)
        ours = bf16_bits_to_float(cupy.asnumpy(out))
        assert relative_error(ours, expected) < 1e-2, implementation
        rows = np.abs(ours - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-6)
        assert rows.max() < 0.1, (implementation, int(rows.argmax()))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_attention_matches_numpy(cuda_backend, rng, case, monkeypatch):
    from openinfer.backend.cuda.attention import SM90_ENV

    for name in SM90_ENV.values():  # the default variant, whatever the caller's environment
        monkeypatch.delenv(name, raising=False)
    check_against_numpy(cuda_backend, rng, case, implementations(CASES[case][0]))


@pytest.mark.parametrize("variant", list(SM90_VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_sm90_variant_matches_numpy(cuda_backend, rng, case, variant, monkeypatch):
    from openinfer.backend.cuda.attention import SM90_ENV, refresh_kernel_choices, sm90_prefill_supported

    if not sm90_prefill_supported(CASES[case][0]):
        pytest.skip("the sm90 kernel does not run here")
    for name in SM90_ENV.values():
        monkeypatch.delenv(name, raising=False)
    for key, value in SM90_VARIANTS[variant].items():
        monkeypatch.setenv(SM90_ENV[key], value)
    refresh_kernel_choices()
    check_against_numpy(cuda_backend, rng, case, ["sm90"])


@pytest.mark.parametrize("kv_loads", ["cp_async", "tma"])
def test_persistent_schedule_repeats(cuda_backend, rng, kv_loads, monkeypatch):
    """The persistent kernel's counter is back to zero after each launch: launches in a row,
    of different sizes, each cover all their work items (an item skipped leaves NaN rows)."""
    from openinfer.backend.cuda.attention import SM90_ENV, refresh_kernel_choices, sm90_prefill_supported

    if not sm90_prefill_supported(128):
        pytest.skip("the sm90 kernel does not run here")
    for name in SM90_ENV.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(SM90_ENV["schedule"], "persistent")
    monkeypatch.setenv(SM90_ENV["kv_loads"], kv_loads)
    refresh_kernel_choices()
    for case in ("gqa8-many-prompts", "fresh-128-exact-tile", "chunk-long-offset", "gqa8-many-prompts"):
        check_against_numpy(cuda_backend, rng, case, ["sm90"])


def run_tables(cached: list[int], new: list[int], broken: bool) -> np.ndarray:
    """Block tables whose sequences own consecutive blocks (as a fresh block pool hands them out),
    after a padded null entry each; ``broken``: in each sequence's second 128-token tile two pages
    swap places, so that tile is not one run (the page-by-page path) while the others are."""
    lengths = [c + n for c, n in zip(cached, new, strict=True)]
    tables = np.zeros((len(lengths), max(-(-n // BLOCK_SIZE) for n in lengths) + 1), np.int32)
    next_block = 1
    for i, length in enumerate(lengths):
        count = -(-length // BLOCK_SIZE)
        tables[i, :count] = np.arange(next_block, next_block + count)
        if broken and count >= 16:
            tables[i, [9, 12]] = tables[i, [12, 9]]
        next_block += count + 1  # a gap: runs never continue into the next sequence's blocks
    return tables


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("settings", [{}, {"schedule": "persistent"}, {"head_pairs": "1"}, {"split_kv": "1"},
                                      {"pingpong": "1", "grid": "head"},
                                      {"kv_loads": "tma_multicast", "schedule": "grid", "grid": "kv_head"}],
                         ids=lambda s: "-".join(s) or "default")
@pytest.mark.parametrize("case", ["chunk-long-offset", "mixed-lengths", "d256-chunk"])
def test_kv_runs_match_numpy(cuda_backend, case, settings, broken, monkeypatch):
    """OPENINFER_SM90_KV_RUNS=1 with TMA loads: a tile of consecutive blocks comes in one box per
    column block; tiles that are not one run, and the ragged last tile, as before."""
    from openinfer.backend.cuda.attention import SM90_ENV, prefill_attention, refresh_kernel_choices
    from openinfer.backend.cuda.attention_routing import SM90_KV_RUNS_ENV, wanted_sm90_kv_runs

    head_dim, num_heads, num_kv_heads, cached, new = CASES[case]
    if not implementations(head_dim)[-1] == "sm90":
        pytest.skip("the sm90 kernel does not run here")
    for name in SM90_ENV.values():
        monkeypatch.delenv(name, raising=False)
    for key, value in {"kv_loads": "tma", **settings}.items():
        monkeypatch.setenv(SM90_ENV[key], value)
    monkeypatch.setenv(SM90_KV_RUNS_ENV, "1")
    refresh_kernel_choices()
    wanted_sm90_kv_runs.cache_clear()
    rng = np.random.default_rng(len(case) + 7 * broken)
    tables = run_tables(cached, new, broken)
    batch = ForwardBatch.over_blocks(tables, cached, new, BLOCK_SIZE, np.zeros(sum(new)))
    shape = (int(tables.max()) + 2, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = bf16_random(rng, *shape), bf16_random(rng, *shape)
    q = bf16_random(rng, batch.num_tokens, num_heads, head_dim, scale=2.0)
    expected = reference_attention(q, k_cache, v_cache, batch, head_dim**-0.5)
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, None, head_dim**-0.5, None, None, 1e-6)
    kv = KVLayer(cuda_backend.upload(k_cache), cuda_backend.upload(v_cache))
    out = cupy.full((batch.num_tokens, num_heads * head_dim), 0x7FC0, dtype=cupy.uint16)  # bf16 NaN
    try:
        prefill_attention(cupy.asarray(float_to_bf16_bits(q)), spec, kv, cuda_backend.prepare_batch(batch),
                          implementation="sm90", out=out)
    finally:
        monkeypatch.delenv(SM90_KV_RUNS_ENV)
        wanted_sm90_kv_runs.cache_clear()
    ours = bf16_bits_to_float(cupy.asnumpy(out))
    assert relative_error(ours, expected) < 1e-2
    rows = np.abs(ours - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-6)
    assert rows.max() < 0.1, int(rows.argmax())


@pytest.mark.parametrize("settings", [{}, {"schedule": "persistent"}, {"head_pairs": "1"}, {"overlap": "0"},
                                      {"kv_loads": "tma", "split_kv": "1"}], ids=lambda s: "-".join(s) or "default")
@pytest.mark.parametrize("case", list(CASES))
def test_q_registers_match_numpy(cuda_backend, rng, case, settings, monkeypatch):
    """OPENINFER_SM90_Q_REGISTERS=1: Q K^T with Q as A fragments in registers (head_dim 128 with the
    overlapped loop; head_dim 256 and overlap=0 run without) over the variants that change the loop."""
    from openinfer.backend.cuda.attention import SM90_ENV, refresh_kernel_choices, sm90_prefill_supported
    from openinfer.backend.cuda.attention_routing import SM90_Q_REGISTERS_ENV, wanted_sm90_q_registers

    if not sm90_prefill_supported(CASES[case][0]):
        pytest.skip("the sm90 kernel does not run here")
    for name in SM90_ENV.values():
        monkeypatch.delenv(name, raising=False)
    for key, value in settings.items():
        monkeypatch.setenv(SM90_ENV[key], value)
    monkeypatch.setenv(SM90_Q_REGISTERS_ENV, "1")
    refresh_kernel_choices()
    wanted_sm90_q_registers.cache_clear()
    try:
        check_against_numpy(cuda_backend, rng, case, ["sm90"])
    finally:
        monkeypatch.delenv(SM90_Q_REGISTERS_ENV)
        wanted_sm90_q_registers.cache_clear()


def test_unsupported_sm90_request_is_a_clear_error(cuda_backend):
    from openinfer.backend.cuda.attention import prefill_attention, sm90_prefill_supported

    if sm90_prefill_supported(64):
        pytest.skip("head_dim 64 runs on the sm90 kernel here")
    batch = cuda_backend.prepare_batch(paged_batch(np.random.default_rng(0), [0], [8], 4))
    spec = AttentionSpec(2, 1, 64, None, 0.125, None, None, 1e-6)
    kv = KVLayer(cupy.zeros((4, BLOCK_SIZE, 1, 64), cupy.uint16), cupy.zeros((4, BLOCK_SIZE, 1, 64), cupy.uint16))
    with pytest.raises(ValueError, match="sm90 prefill kernel"):
        prefill_attention(cupy.zeros((8, 2, 64), cupy.uint16), spec, kv, batch, implementation="sm90")


def paged_problem(rng, head_dim, num_heads, num_kv_heads, cached, new):
    """A paged step over random bf16 K/V (three spare blocks) and its NumPy attention:
    (batch, k_cache, v_cache, q, scale, expected)."""
    num_blocks = 3 + sum(-(-(c + n) // BLOCK_SIZE) for c, n in zip(cached, new, strict=True))
    batch = paged_batch(rng, cached, new, num_blocks)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = bf16_random(rng, *shape), bf16_random(rng, *shape)
    q = bf16_random(rng, batch.num_tokens, num_heads, head_dim, scale=2.0)
    scale = head_dim**-0.5
    return batch, k_cache, v_cache, q, scale, reference_attention(q, k_cache, v_cache, batch, scale)


SHORT_QUERY_CASES = {
    # name: (head_dim, num_heads, num_kv_heads, cached tokens per sequence, new tokens per sequence)
    "warm-tail-16k-like": (128, 32, 8, [4080], [16]),
    "mixed-short": (128, 8, 2, [0, 50, 33, 700, 1], [3, 16, 1, 9, 2]),
    "gqa16": (128, 16, 1, [200], [11]),
    "mha-d64": (64, 4, 4, [130, 0], [16, 7]),
    "d256-gqa2": (256, 4, 2, [333, 17], [5, 16]),
}


@pytest.mark.parametrize("splits", [None, 1, 3, 32])
@pytest.mark.parametrize("case", list(SHORT_QUERY_CASES))
def test_short_query_kernel_matches_numpy(cuda_backend, rng, case, splits):
    from openinfer.backend.cuda.decode_attention import short_query_attention_mma

    head_dim, num_heads, num_kv_heads, cached, new = SHORT_QUERY_CASES[case]
    batch, k_cache, v_cache, q, scale, expected = paged_problem(rng, head_dim, num_heads, num_kv_heads, cached, new)
    device_batch = cuda_backend.prepare_batch(batch)
    out = cupy.full((batch.num_tokens, num_heads * head_dim), 0x7FC0, dtype=cupy.uint16)  # bf16 NaN
    short_query_attention_mma(cupy.asarray(float_to_bf16_bits(q)), cuda_backend.upload(k_cache),
                              cuda_backend.upload(v_cache), device_batch.block_tables, device_batch.context_lens,
                              device_batch.query_start, batch.max_query_len, scale, cuda_backend.num_sms,
                              splits=splits, out=out)
    ours = bf16_bits_to_float(cupy.asnumpy(out))
    assert relative_error(ours, expected) < 1e-2
    rows = np.abs(ours - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-6)
    assert rows.max() < 0.1, int(rows.argmax())


def test_short_query_kernel_rejects_long_steps(cuda_backend, rng):
    from openinfer.backend.cuda.decode_attention import SHORT_QUERY_MAX_TOKENS, short_query_attention_mma

    batch = cuda_backend.prepare_batch(paged_batch(rng, [0], [SHORT_QUERY_MAX_TOKENS + 1], 4))
    kv = cupy.zeros((4, BLOCK_SIZE, 1, 128), cupy.uint16)
    with pytest.raises(ValueError, match="new tokens per sequence"):
        short_query_attention_mma(cupy.zeros((SHORT_QUERY_MAX_TOKENS + 1, 4, 128), cupy.uint16), kv, kv,
                                  batch.block_tables, batch.context_lens, batch.query_start,
                                  SHORT_QUERY_MAX_TOKENS + 1, 0.1, cuda_backend.num_sms)


DECODE_CONTEXTS = [300, 47, 900, 16, 1, 250, 0, 33, 129, 64, 700, 5, 15, 17, 400, 90]  # MIXED_MIN_DECODE_ROWS
MIXED_CASES = {
    # name: (head_dim, num_heads, num_kv_heads, cached tokens per sequence, new tokens per sequence):
    # running decodes first (1 new token each), then prompt chunks, as the scheduler orders a step
    "decodes-then-chunk": (128, 8, 2, DECODE_CONTEXTS + [0], [1] * 16 + [300]),
    "decodes-then-chunks-and-a-late-decode": (128, 8, 2, DECODE_CONTEXTS[::-1] + [1, 0, 500, 90],
                                              [1] * 17 + [200, 130, 1]),
    "d256-decodes-then-chunk": (256, 4, 2, DECODE_CONTEXTS + [100], [1] * 16 + [129]),
    "d64-gqa4": (64, 8, 2, DECODE_CONTEXTS + [48], [1] * 16 + [260]),
}


@pytest.mark.parametrize("case", list(MIXED_CASES))
def test_mixed_step_decode_rows_on_the_decode_kernel(cuda_backend, rng, case, monkeypatch):
    """A mixed step with OPENINFER_MIXED_DECODE_ATTENTION=1 (decode rows on the decode kernel,
    only the chunks' tiles on the prefill kernel) gives the all-prefill-kernel output and NumPy's."""
    from openinfer.backend.cuda.attention import (
        MIXED_DECODE_ENV,
        SHORT_QUERY_ENV,
        attend,
        mixed_attention,
        mixed_split,
        prefill_attention,
        refresh_kernel_choices,
    )

    head_dim, num_heads, num_kv_heads, cached, new = MIXED_CASES[case]
    batch, k_cache, v_cache, q, scale, expected = paged_problem(rng, head_dim, num_heads, num_kv_heads, cached, new)
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, None, scale, None, None, 1e-6)
    kv = KVLayer(cuda_backend.upload(k_cache), cuda_backend.upload(v_cache))
    q_device = cupy.asarray(float_to_bf16_bits(q))
    device_batch = cuda_backend.prepare_batch(batch)

    monkeypatch.setenv(MIXED_DECODE_ENV, "1")
    monkeypatch.setenv(SHORT_QUERY_ENV, "0")
    refresh_kernel_choices()
    try:
        split = mixed_split(device_batch)
        leading = next(i for i, n in enumerate(new) if n > 1)
        assert split is not None and split.decode_rows == leading
        covered = sum(stop - start for start, stop in split.prefill_tile_ranges)
        assert covered == device_batch.num_tiles - leading  # every chunk tile, no decode tile
        mixed = bf16_bits_to_float(cupy.asnumpy(attend(q_device, spec, kv, device_batch, cuda_backend.num_sms)))
    finally:
        monkeypatch.undo()
        refresh_kernel_choices()
    whole = cupy.full((batch.num_tokens, num_heads * head_dim), 0x7FC0, dtype=cupy.uint16)  # bf16 NaN
    prefill_attention(q_device, spec, kv, device_batch, out=whole)
    whole = bf16_bits_to_float(cupy.asnumpy(whole))
    assert np.isfinite(mixed).all()
    assert relative_error(mixed, whole) < 1e-2
    assert relative_error(mixed, expected) < 1e-2
    # the decode rows on a side stream beside the chunks (forked and joined by events): the same bits
    side = cupy.cuda.Stream(non_blocking=True)
    overlapped = mixed_attention(q_device, spec, kv, device_batch, split, cuda_backend.num_sms, decode_stream=side)
    assert np.array_equal(bf16_bits_to_float(cupy.asnumpy(overlapped)), mixed)
    rows = np.abs(mixed - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-6)
    assert rows.max() < 0.1, int(rows.argmax())


def test_prefill_kernel_refuses_a_decode_shaped_batch(cuda_backend, rng):
    """One new token per sequence is uploaded without prefill tiles: a clear error, not an
    unwritten output (the benchmark row that once timed an empty launch)."""
    from openinfer.backend.cuda.attention import prefill_attention

    batch = cuda_backend.prepare_batch(paged_batch(rng, [40, 7], [1, 1], 8))
    spec = AttentionSpec(4, 2, 128, None, 0.1, None, None, 1e-6)
    kv = KVLayer(cupy.zeros((8, BLOCK_SIZE, 2, 128), cupy.uint16), cupy.zeros((8, BLOCK_SIZE, 2, 128), cupy.uint16))
    with pytest.raises(ValueError, match="decode kernel"):
        prefill_attention(cupy.zeros((2, 4, 128), cupy.uint16), spec, kv, batch)
