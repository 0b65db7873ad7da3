"""The warm turn on the cuda backend (``pytest -m gpu``): with snapshots inside a step
(``OPENINFER_QWEN35_SNAPSHOT_IN_STEP=1``) a prompt runs as one step whose GDN layers either write
the state at the block boundary in their one run (``OPENINFER_QWEN35_SNAPSHOT_EMIT=1``: the chunk
walk stores the state entering a chunk cut at the boundary, ``cuda_ops.writes_snapshots``) or run
around it (``state.split_at_snapshots``); the written state equals the split run's, and a
prefix-cache hit from that snapshot, alone or with other prompts in its step, equals the cold run."""

from __future__ import annotations

import numpy as np
import pytest
from openinfer_qwen35.state import SNAPSHOT_IN_STEP_ENV

from tests.helpers.engine_utils import assert_everything_returned, make_request, run_all, run_one
from tests.plugins.qwen35.test_qwen35_cuda import (  # noqa: F401 (the fixture)
    GPU_CONFIG,
    cuda_engine,
    first_real_divergence,
    gpu_checkpoint,
)

pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def spy_forwards(engine) -> list[tuple[list[int], list[tuple[int, ...]]]]:
    steps: list = []
    forward = engine.model.forward

    def spy(batch, kv_cache):
        host = getattr(batch, "host", None) or batch
        steps.append((np.diff(host.query_start).tolist(), [tuple(r) for r in host.state_snapshots.tolist()]))
        return forward(batch, kv_cache)

    engine.model.forward = spy
    return steps


@pytest.mark.parametrize("emit", ["1", "0"])
def test_in_step_snapshot_hit_equals_cold_run(gpu_checkpoint, monkeypatch, emit):  # noqa: F811
    from openinfer_qwen35 import cuda_ops

    monkeypatch.setenv(SNAPSHOT_IN_STEP_ENV, "1")
    monkeypatch.setenv(cuda_ops.SNAPSHOT_EMIT_ENV, emit)
    path, _ = gpu_checkpoint
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, GPU_CONFIG["vocab_size"], size=150).tolist()
    others = [rng.integers(3, GPU_CONFIG["vocab_size"], size=n).tolist() for n in (77, 40)]
    engine = cuda_engine(path)
    try:
        steps = spy_forwards(engine)
        with cuda_ops.kernel_timer() as launched:
            first = run_one(engine, make_request("first", prompt, max_tokens=24, logprobs=2))
        assert steps[0][0] == [150] and [r[:2] for r in steps[0][1]] == [(0, 144)]  # one step, a snapshot at 144
        # written by the walk in the layer's one run, or by a run of the 144 rows before the boundary
        assert ("gdn_conv_snapshot" in launched) == (emit == "1")
        assert any(_is_snapshot_walk(name) for name in launched) == (emit == "1")
        hit = run_one(engine, make_request("hit", prompt, max_tokens=24, logprobs=2))
        # the hit's 6 rows run alone, the first run's beside 144 others (GEMM tiles may differ): near-ties aside
        assert hit.cached_tokens == 144 and first_real_divergence(hit.token_ids, first) is None
        turn = prompt + first.token_ids[:20] + [5, 6, 7, 8]
        # the turn beside two fresh prompts in one step: snapshot rows of sequences not last
        together = run_all(engine, [make_request("turn", turn, max_tokens=16, logprobs=2)]
                           + [make_request(f"o{i}", p, max_tokens=16, logprobs=2) for i, p in enumerate(others)])
        assert together[0].cached_tokens == 160
        assert_everything_returned(engine)
    finally:
        engine.close_sync()
    cold_engine = cuda_engine(path, enable_prefix_cache=False)
    try:
        cold = run_one(cold_engine, make_request("cold", prompt, max_tokens=24, logprobs=2))
        cold_turn = run_one(cold_engine, make_request("cold-turn", turn, max_tokens=16, logprobs=2))
        cold_others = [run_one(cold_engine, make_request(f"co{i}", p, max_tokens=16, logprobs=2))
                       for i, p in enumerate(others)]
    finally:
        cold_engine.close_sync()
    assert first_real_divergence(first.token_ids, cold) is None
    assert first_real_divergence(together[0].token_ids, cold_turn) is None
    for got, want in zip(together[1:], cold_others, strict=True):
        assert first_real_divergence(got.token_ids, want) is None


def test_copy_state_rows_equals_indexed_assignment():
    import cupy
    from openinfer_qwen35 import cuda_ops

    rng = np.random.default_rng(0)
    conv = cupy.asarray(rng.integers(0, 2**16, size=(6, 3, 40), dtype=np.uint16))
    ssm = cupy.asarray(rng.standard_normal((6, 2, 8, 8)).astype(np.float32))
    want_conv, want_ssm = conv.copy(), ssm.copy()
    pairs = ((1, 4), (2, 5))
    for src, dst in pairs:
        want_conv[dst] = want_conv[src]
        want_ssm[dst] = want_ssm[src]
    cuda_ops.copy_state_rows([conv, ssm], pairs)
    assert cupy.array_equal(conv, want_conv) and cupy.array_equal(ssm, want_ssm)


def _is_snapshot_walk(name: str) -> bool:
    """A chunk walk's *_snapshot twin (not gdn_conv_snapshot, the conv window's kernel)."""
    return name.endswith("_snapshot") and name.startswith(("gdn_chunk_states", "gdn_chunk_walk"))


def _split_run(layer, proj, seqs):
    """The layer core as the model runs it when the kernels do not write the snapshots: the rows
    before each boundary, the slots copied, the rest (``Qwen35Model._delta_net_snapshotting``)."""
    import cupy
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.state import split_at_snapshots

    split = cuda_ops.prepare_split(split_at_snapshots(seqs))
    rows = proj if split.order is None else proj[split.order]
    core = cupy.empty((rows.shape[0], layer.config.linear_value_dim), dtype=cupy.uint16)
    head = split.num_head_rows
    conv, ssm, w = layer.device_conv, layer.device_ssm, layer.device_weights
    cuda_ops.delta_net(rows[:head], w, conv, ssm, split.head, layer.config, out=core[:head])
    cuda_ops.copy_state_rows([conv, ssm], split.pairs)
    cuda_ops.delta_net(rows[head:], w, conv, ssm, split.tail, layer.config, out=core[head:])
    return core if split.inverse is None else core[split.inverse]


@pytest.mark.parametrize("prefill", ["grouped_staged", "grouped_f16", "chunked_split_f16"])
def test_the_walk_writes_the_state_a_run_stopping_at_the_boundary_leaves(monkeypatch, prefill):
    """One ``delta_net`` run with in-step snapshots (``seqs.snapshots``: the chunk layout cut at each
    boundary, the state walk storing the fp32 state entering the chunk there, ``gdn_conv_snapshot``
    the conv window) against the split run: the snapshot slots hold what the rows before the boundary
    leave, and the outputs and final states are the split run's. A step of 48 fresh prompts (the
    register walk; a boundary 2 rows in: a conv window partly before the step, zeros) and a mixed step
    (24 continued prompts beside 24 decode rows: the walk over a subset, the shared-memory walk; a
    boundary 2 rows in: the live window's old rows)."""
    import cupy
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.state import StepSequences

    from tests.gpu.test_qwen35_kernels import Layer, device_bf16

    if prefill not in cuda_ops.PREFILL_KERNELS:
        pytest.skip(f"no {prefill} prefill variant in this tree")
    monkeypatch.delenv(cuda_ops.KERNELS_ENV, raising=False)
    monkeypatch.setenv(cuda_ops.PREFILL_ENV, prefill)
    monkeypatch.setenv(cuda_ops.SNAPSHOT_EMIT_ENV, "1")
    rng = np.random.default_rng(17)
    sequences = 48
    emitting, splitting = (Layer(np.random.default_rng(18), num_slots=2 * sequences + 8) for _ in range(2))
    slots = np.arange(1, sequences + 1)
    snapshot_slots = iter(range(sequences + 1, 2 * sequences + 8))
    steps = (([70] * sequences, True, {0: 64, 5: 16, 47: 2}),
             ([65] * (sequences // 2) + [1] * (sequences // 2), False, {1: 2, 10: 48}))
    for lengths, fresh, cuts in steps:
        query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        snapshots = np.array([[seq, cut, next(snapshot_slots)] for seq, cut in cuts.items()], np.int64)
        host = StepSequences(query_start, slots[: len(lengths)], np.full(len(lengths), fresh), snapshots=snapshots)
        assert cuda_ops.writes_snapshots(host, emitting.config)
        proj = device_bf16(rng.standard_normal((sum(lengths), emitting.features)))
        with cuda_ops.kernel_timer() as launched:
            got = cuda_ops.delta_net(proj, emitting.device_weights, emitting.device_conv, emitting.device_ssm,
                                     cuda_ops.prepare_sequences(host), emitting.config)
        assert "gdn_conv_snapshot" in launched and any(_is_snapshot_walk(name) for name in launched)
        want = _split_run(splitting, proj, cuda_ops.prepare_sequences(
            StepSequences(query_start, host.slots, host.fresh, snapshots=snapshots)))
        written = snapshots[:, 2]
        np.testing.assert_array_equal(cupy.asnumpy(emitting.device_conv)[written],
                                      cupy.asnumpy(splitting.device_conv)[written])
        got_ssm, want_ssm = cupy.asnumpy(emitting.device_ssm), cupy.asnumpy(splitting.device_ssm)
        # the same products on the same operands: equal up to the order of fp32 sums (the walks' choice)
        np.testing.assert_allclose(got_ssm[written], want_ssm[written], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_ssm[slots], want_ssm[slots], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(cupy.asnumpy(emitting.device_conv)[slots],
                                      cupy.asnumpy(splitting.device_conv)[slots])
        got, want = cupy.asnumpy(got).view(np.uint16), cupy.asnumpy(want).view(np.uint16)
        print(f"{prefill}, {len(lengths)} sequences: outputs differ at {int((got != want).sum())} of {got.size}, "
              f"snapshot states bit-identical: {np.array_equal(got_ssm[written], want_ssm[written])}")
        assert (got != want).mean() <= 1e-3


def test_chains_whose_walk_cannot_store_snapshots_split_the_layer(monkeypatch):
    """The bf16 split-operand walk, the fp32 chain and the plain scan have no *_snapshot twin: a step
    with an in-step snapshot runs them in two parts (``writes_snapshots`` False); switched off too."""
    from openinfer_qwen35 import cuda_ops
    from openinfer_qwen35.config import Qwen35Config
    from openinfer_qwen35.state import StepSequences

    from tests.gpu.test_qwen35_kernels import CONFIG

    config = Qwen35Config.from_dict(CONFIG)
    monkeypatch.delenv(cuda_ops.KERNELS_ENV, raising=False)
    seqs = StepSequences(np.array([0, 70]), np.array([1]), np.array([True]), snapshots=np.array([[0, 64, 2]]))
    for prefill, emits in (("grouped_staged", True), ("chunked_split_f16", True), ("chunked_split", False),
                           ("chunked_fp32", False), ("plain", False)):
        if prefill not in cuda_ops.PREFILL_KERNELS:
            continue
        monkeypatch.setenv(cuda_ops.PREFILL_ENV, prefill)
        assert cuda_ops.writes_snapshots(seqs, config) == emits, prefill
    monkeypatch.setenv(cuda_ops.PREFILL_ENV, "grouped_staged")
    monkeypatch.setenv(cuda_ops.SNAPSHOT_EMIT_ENV, "0")
    assert not cuda_ops.writes_snapshots(seqs, config)
