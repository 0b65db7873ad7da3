"""The absorbed MLA decode kernels (mla_attention_mma in 64- and 16-head blocks, mla_attention_mma_shared
with 32- and 64-key tiles) and the decompressed prefill against the NumPy reference: ragged batches
whose contexts end on, before and after tile and cache-block boundaries, partial head blocks,
context splits from 1 to many, and a CUDA-graph replay equal to the eager step."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.mla import MLASpec
from tests.gpu.conftest import relative_error
from tests.gpu.mla_steps import ragged_mla_step

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

REF = NumpyBackend()
BF16_TOL = 2e-2
BLOCK_SIZE = 16
# (cached, new) per sequence
DECODES = {
    # contexts ending one short of, on, and one past the 32- and 64-key tiles, a 1-token context, ~1k
    "ragged": ([0, 30, 31, 32, 62, 63, 64, 700, 1030], [1] * 9),
    # 1 decode of a long context: many splits of one sequence
    "one-long": ([2100], [1]),
}


def _step(rng, spec: MLASpec, cached: list[int], new: list[int]):
    """A paged batch over shuffled cache blocks, its inputs and the NumPy reference output."""
    return ragged_mla_step(rng, spec, cached, new, BLOCK_SIZE)[:8]


def _forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights, rope, kernel, min_query=10**6):
    from openinfer.backend.cuda.mla import mla_forward

    return mla_forward(cuda_backend.blas, cuda_backend.upload(q), cuda_backend.upload(latent), device_cache,
                       cuda_backend.weight(weights.w_uk), cuda_backend.weight(weights.w_uv), cuda_backend.weight(norm),
                       spec, cuda_backend.prepare_batch(batch), cupy.asarray(rope.cos), cupy.asarray(rope.sin), 1e-6,
                       prefill_min_query=min_query, absorbed_kernel=kernel)


def _spec(heads: int) -> MLASpec:
    return MLASpec(num_heads=heads, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, kv_lora_rank=512,
                   scale=192 ** -0.5 * 1.3)


# kernel, mma_shared's keys per tile, split policy and query fragments in registers
@pytest.mark.parametrize("kernel,keys,policy,q_regs", [
    ("mma", "", "", ""), ("mma16", "", "", ""), ("mma_shared", "32", "", "0"), ("mma_shared", "64", "", "0"),
    ("mma_shared", "32", "waves", ""), ("mma_shared", "32", "", "1"), ("mma_shared", "64", "", "1")])
@pytest.mark.parametrize("heads", [16, 20, 64])
@pytest.mark.parametrize("decodes", sorted(DECODES))
@pytest.mark.parametrize("max_splits", ["1", ""])
def test_absorbed_decode_matches_numpy(cuda_backend, rng, monkeypatch, kernel, keys, policy, q_regs, heads, decodes,
                                       max_splits):
    """Each absorbed decode kernel on a ragged batch of decodes: one context split (every key tile of a
    context in one block) and the default split count (up to 64, many splits empty at short contexts;
    mma_shared's resident and waves policies); 20 heads: a partial second 16-head block."""
    from openinfer.backend.cuda import mla as cuda_mla

    monkeypatch.setenv(cuda_mla.MAX_SPLITS_ENV, max_splits)
    monkeypatch.setenv(cuda_mla.SHARED_KEYS_ENV, keys)
    monkeypatch.setenv(cuda_mla.SHARED_SPLITS_ENV, policy)
    monkeypatch.setenv(cuda_mla.SHARED_Q_REGS_ENV, q_regs)
    spec = _spec(heads)
    cached, new = DECODES[decodes]
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, cached, new)
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    out = cuda_backend.to_host(_forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights, rope,
                                        kernel))
    assert relative_error(out, reference) < BF16_TOL
    # per token too: a wrong tile or split of one short context would hide in the whole batch's norm
    for row in range(out.shape[0]):
        assert relative_error(out[row], reference[row]) < BF16_TOL, row


def _set_tma_tile(monkeypatch, text: str) -> None:
    """A test's TMA kernel choice "KEYSxSTAGES[/barriers per tile[/rows]]" ("rows": whole-row boxes)."""
    from openinfer.backend.cuda import mla_decode_sm90

    tile, barriers, boxes = (text.split("/") + ["", ""])[:3]
    monkeypatch.setenv(mla_decode_sm90.TMA_TILE_ENV, tile)
    monkeypatch.setenv(mla_decode_sm90.TMA_BARRIERS_ENV, barriers)
    monkeypatch.setenv(mla_decode_sm90.TMA_ROW_BOXES_ENV, "1" if boxes == "rows" else "0")


def _poison_unused_slots(device_cache, batch) -> None:
    """NaN bits in every cache slot past each sequence's context in its last block, and in the blocks no
    sequence holds: the TMA kernel copies whole 16-row boxes, so these rows reach its shared memory."""
    rows = device_cache.reshape(-1, device_cache.shape[-1])
    used = np.zeros(device_cache.shape[0], bool)
    for seq, context in enumerate(batch.context_lens):
        blocks = batch.block_tables[seq, :-(-int(context) // BLOCK_SIZE)]
        used[blocks] = True
        in_last = int(context) - (len(blocks) - 1) * BLOCK_SIZE  # 1 ..= BLOCK_SIZE tokens of the context
        rows[int(blocks[-1]) * BLOCK_SIZE + in_last:(int(blocks[-1]) + 1) * BLOCK_SIZE] = 0x7FC0
    for block in np.flatnonzero(~used):
        rows[block * BLOCK_SIZE:(block + 1) * BLOCK_SIZE] = 0x7FC0


# keys per tile x ring stages [/ block barriers per tile]: 2 blocks per SM (32x2, 16x4), one deep ring (32x5),
# 64-key tiles, a 1-stage ring; one barrier per tile (two exchange buffers, refills after the next tile's barrier)
@pytest.mark.parametrize("tile", ["32x2", "16x4", "32x5", "64x2", "16x1", "32x2/1", "16x4/1", "32x2/2/rows",
                                  "16x4/1/rows", "64x2/2/rows"])
@pytest.mark.parametrize("heads", [16, 20, 64])
@pytest.mark.parametrize("decodes", sorted(DECODES))
@pytest.mark.parametrize("max_splits", ["1", ""])
def test_tma_decode_matches_numpy(cuda_backend, rng, monkeypatch, tile, heads, decodes, max_splits):
    """mla_attention_tma (Hopper) on a ragged batch of decodes whose caches hold NaN bits past every context
    (rows a 16-row TMA box brings along): one split and the default split count; 20 heads: a partial block."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90

    if not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    monkeypatch.setenv(cuda_mla.MAX_SPLITS_ENV, max_splits)
    monkeypatch.setenv(mla_decode_sm90.TMA_BALANCE_ENV, "0")  # each context split evenly (balanced: below)
    _set_tma_tile(monkeypatch, tile)
    spec = _spec(heads)
    cached, new = DECODES[decodes]
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, cached, new)
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    _poison_unused_slots(device_cache, batch)
    assert mla_decode_sm90.tma_decode_fits(spec, device_cache)
    out = cuda_backend.to_host(_forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights, rope,
                                        "tma"))
    assert relative_error(out, reference) < BF16_TOL
    for row in range(out.shape[0]):
        assert relative_error(out[row], reference[row]) < BF16_TOL, row


@pytest.mark.parametrize("tile", ["32x2", "16x4", "16x4/1", "32x2/2/rows"])
@pytest.mark.parametrize("cluster", ["2", "4", "8", "16"])
@pytest.mark.parametrize("heads", [16, 20, 64])
@pytest.mark.parametrize("decodes", sorted(DECODES))
def test_tma_decode_cluster_combine_matches_numpy(cuda_backend, rng, monkeypatch, tile, cluster, heads, decodes):
    """mla_attention_tma with a (token, head block)'s context splits combined in a cluster (2 - 16 CTAs; empty
    splits of short contexts included) on the NaN-poisoned ragged batch."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90

    if not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    monkeypatch.delenv(cuda_mla.MAX_SPLITS_ENV, raising=False)
    _set_tma_tile(monkeypatch, tile)
    monkeypatch.setenv(mla_decode_sm90.TMA_CLUSTER_ENV, cluster)
    spec = _spec(heads)
    cached, new = DECODES[decodes]
    assert mla_decode_sm90.tma_cluster(spec, 64) == int(cluster)
    if heads == 64 and cluster == "16":  # 9 tokens x 4 head blocks: at most 7 resident splits, a cluster of 4
        assert mla_decode_sm90.tma_cluster(spec, 7) == 4
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, cached, new)
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    _poison_unused_slots(device_cache, batch)
    out = cuda_backend.to_host(_forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights, rope,
                                        "tma"))
    assert relative_error(out, reference) < BF16_TOL
    for row in range(out.shape[0]):
        assert relative_error(out[row], reference[row]) < BF16_TOL, row


# 150 decodes of contexts 1 .. ~700 (past 132 rows: the resident split count is 1, so balancing runs 4 splits)
MANY_DECODES = (list(np.random.default_rng(13).integers(0, 700, 150)), [1] * 150)


@pytest.mark.parametrize("tile", ["32x2", "16x4", "16x4/1", "16x4/1/rows"])
@pytest.mark.parametrize("decodes", ["ragged", "one-long", "many"])
def test_tma_decode_balanced_splits_match_numpy(cuda_backend, rng, monkeypatch, tile, decodes):
    """mla_attention_tma with splits balanced over the batch ($OPENINFER_MLA_TMA_BALANCE=1): long contexts over
    more splits, short ones whole (written by the attention kernel, skipped by the combine) on NaN-poisoned caches."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90

    if not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    monkeypatch.delenv(cuda_mla.MAX_SPLITS_ENV, raising=False)
    _set_tma_tile(monkeypatch, tile)
    monkeypatch.setenv(mla_decode_sm90.TMA_BALANCE_ENV, "1")
    spec = _spec(16)
    cached, new = MANY_DECODES if decodes == "many" else DECODES[decodes]
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, cached, new)
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    _poison_unused_slots(device_cache, batch)
    for combine in ("wide", "shared", "loop"):  # every combine kernel leaves the tokens written whole
        monkeypatch.setenv(cuda_mla.COMBINE_ENV, combine)
        out = cuda_backend.to_host(_forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights, rope,
                                            "tma"))
        assert relative_error(out, reference) < BF16_TOL, combine
        for row in range(out.shape[0]):
            assert relative_error(out[row], reference[row]) < BF16_TOL, (combine, row)


@pytest.mark.parametrize("heads", [16, 20, 64])
@pytest.mark.parametrize("decodes", ["ragged", "one-long", "sixteen"])
@pytest.mark.parametrize("kernel", ["mma_shared", "tma"])
def test_write_absorb_matches_numpy(cuda_backend, rng, monkeypatch, heads, decodes, kernel):
    """mla_write_absorb ($OPENINFER_MLA_WRITE_ABSORB=1: the latent write and W_UK in one launch for decode steps of
    at most 16 rows) gives the reference's output, and stores the reference's latent rows."""
    from openinfer.backend.cuda import mla as cuda_mla

    if kernel == "tma" and not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    monkeypatch.setenv(cuda_mla.WRITE_ABSORB_ENV, "1")
    spec = _spec(heads)
    rows = {"sixteen": 16}.get(decodes)
    cached, new = ([int(c) for c in np.arange(rows) * 37], [1] * rows) if rows else DECODES[decodes]
    assert cuda_mla.write_absorb_fits(len(new), spec)
    batch, cache, q, latent, norm, weights, rope, reference, ref_cache = ragged_mla_step(rng, spec, cached, new,
                                                                                          BLOCK_SIZE)
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    out = cuda_backend.to_host(_forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights, rope,
                                        kernel))
    assert relative_error(out, reference) < BF16_TOL
    for row in range(out.shape[0]):
        assert relative_error(out[row], reference[row]) < BF16_TOL, row
    slots = batch.slot_mapping
    stored = cuda_backend.to_host(device_cache.reshape(-1, spec.latent_dim)[cupy.asarray(slots)])
    assert relative_error(stored, ref_cache.reshape(-1, spec.latent_dim)[slots]) < 1e-2
    monkeypatch.setenv(cuda_mla.WRITE_ABSORB_ENV, "on")
    with pytest.raises(ValueError, match="OPENINFER_MLA_WRITE_ABSORB"):
        cuda_mla.write_absorb_fits(1, spec)
    monkeypatch.setenv(cuda_mla.WRITE_ABSORB_ENV, "1")
    assert not cuda_mla.write_absorb_fits(17, spec)


def test_tma_decode_beside_decompressed_prefill(cuda_backend, rng):
    """mla_attention_tma on the absorbed rows of a mixed step (token_rows: decodes beside decompressed chunks)."""
    if not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    spec = _spec(16)
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, [0, 100, 57, 3, 40], [150, 70, 1, 1, 1])
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    out = _forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights, rope, "tma", min_query=16)
    assert relative_error(cuda_backend.to_host(out), reference) < BF16_TOL


def test_tma_tile_choice(monkeypatch):
    """$OPENINFER_MLA_TMA_TILE: KEYSxSTAGES, bad text refused; shared memory and blocks per SM of the choices."""
    from openinfer.backend.cuda import mla_decode_sm90

    spec = _spec(16)
    monkeypatch.delenv(mla_decode_sm90.TMA_TILE_ENV, raising=False)
    assert mla_decode_sm90.tma_tile() == mla_decode_sm90.DEFAULT_TMA_TILE
    monkeypatch.setenv(mla_decode_sm90.TMA_TILE_ENV, "16x4")
    assert mla_decode_sm90.tma_tile() == (16, 4)
    for text in ("48x2", "32x0", "32", "x2", "32x2x1"):
        monkeypatch.setenv(mla_decode_sm90.TMA_TILE_ENV, text)
        with pytest.raises(ValueError, match="OPENINFER_MLA_TMA_TILE"):
            mla_decode_sm90.tma_tile()
    # 9 column blocks x 32 rows x 128 B per stage, 8 KB of partial scores, 1 KB of alignment
    assert mla_decode_sm90.tma_decode_smem(spec, 32, 2) == 1024 + 2 * 36864 + 8192 + 16
    assert mla_decode_sm90.tma_blocks_per_sm(mla_decode_sm90.tma_decode_smem(spec, 32, 2)) == 2
    assert mla_decode_sm90.tma_blocks_per_sm(mla_decode_sm90.tma_decode_smem(spec, 32, 5)) == 1
    # clusters: the largest of 8 / 4 / 2 within the switch and the split count; off by default; a ring too small
    # for a CTA's fp32 partial (16x1: 18 KB) never clusters
    monkeypatch.setenv(mla_decode_sm90.TMA_TILE_ENV, "32x2")
    monkeypatch.delenv(mla_decode_sm90.TMA_CLUSTER_ENV, raising=False)
    assert mla_decode_sm90.tma_cluster(spec, 64) == 1
    monkeypatch.setenv(mla_decode_sm90.TMA_CLUSTER_ENV, "8")
    assert [mla_decode_sm90.tma_cluster(spec, s) for s in (64, 8, 7, 4, 3, 2, 1)] == [8, 8, 4, 4, 2, 2, 1]
    monkeypatch.setenv(mla_decode_sm90.TMA_TILE_ENV, "16x1")
    assert mla_decode_sm90.tma_cluster(spec, 64) == 1
    monkeypatch.setenv(mla_decode_sm90.TMA_CLUSTER_ENV, "16")
    assert mla_decode_sm90.tma_cluster(spec, 64) == 1  # still the 16x1 ring
    monkeypatch.setenv(mla_decode_sm90.TMA_TILE_ENV, "32x2")
    assert [mla_decode_sm90.tma_cluster(spec, s) for s in (64, 16, 15)] == [16, 16, 8]
    monkeypatch.setenv(mla_decode_sm90.TMA_CLUSTER_ENV, "32")
    with pytest.raises(ValueError, match="OPENINFER_MLA_TMA_CLUSTER"):
        mla_decode_sm90.tma_cluster(spec, 64)
    monkeypatch.delenv(mla_decode_sm90.TMA_BARRIERS_ENV, raising=False)
    assert not mla_decode_sm90.tma_one_barrier()
    assert mla_decode_sm90.tma_decode_smem(spec, 32, 2, True) == 1024 + 2 * 36864 + 2 * 8192 + 16
    monkeypatch.setenv(mla_decode_sm90.TMA_BARRIERS_ENV, "3")
    with pytest.raises(ValueError, match="OPENINFER_MLA_TMA_BARRIERS"):
        mla_decode_sm90.tma_one_barrier()
    monkeypatch.delenv(mla_decode_sm90.TMA_ROW_BOXES_ENV, raising=False)
    assert mla_decode_sm90.tma_row_boxes()  # the default since s8 E1
    monkeypatch.setenv(mla_decode_sm90.TMA_ROW_BOXES_ENV, "rows")
    with pytest.raises(ValueError, match="OPENINFER_MLA_TMA_ROW_BOXES"):
        mla_decode_sm90.tma_row_boxes()
    monkeypatch.delenv(mla_decode_sm90.TMA_BALANCE_ENV, raising=False)
    assert mla_decode_sm90.tma_balance()  # the default since s8 E1
    monkeypatch.setenv(mla_decode_sm90.TMA_BALANCE_ENV, "yes")
    with pytest.raises(ValueError, match="OPENINFER_MLA_TMA_BALANCE"):
        mla_decode_sm90.tma_balance()


@pytest.mark.parametrize("tile,cluster,balance", [("32x2", "0", "0"), ("16x4", "0", "0"), ("32x2", "8", "0"),
                                                  ("32x2", "0", "1"), ("16x4/1", "16", "0"), ("16x4/1", "0", "1"),
                                                  ("32x2/2/rows", "0", "0")])
def test_tma_decode_graph_replay_equals_eager(cuda_backend, rng, monkeypatch, tile, cluster, balance):
    """A decode step on the TMA kernel (splits combined by the combine kernel, in a cluster, or balanced over
    the batch) captured in a CUDA graph and replayed gives the eager step's bits."""
    from openinfer.backend.cuda import mla_decode_sm90

    if not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    _set_tma_tile(monkeypatch, tile)
    monkeypatch.setenv(mla_decode_sm90.TMA_CLUSTER_ENV, cluster)
    monkeypatch.setenv(mla_decode_sm90.TMA_BALANCE_ENV, balance)
    _graph_replay_equals_eager(cuda_backend, rng, "tma")


# (cached, new) per sequence for the decompressed prefill: a 150-token prompt (3 query tiles of 64, the
# last partial), a 70-token chunk on 100 cached (key tiles not aligned to query tiles), one 64-query tile
# exactly, one past it, a 300-token chunk on 37 cached, and a decode that stays absorbed; for the wgmma
# kernel's 128-query / 128-key tiles also one tile exactly, one past it, and a 500-token chunk on 600
# cached (9 key tiles: its 2-stage ring wraps 4 times)
PREFILLS = ([0, 100, 0, 0, 37, 12], [150, 70, 64, 65, 300, 1])
WIDE_PREFILLS = ([0, 100, 0, 0, 37, 12, 0, 0, 600], [150, 70, 64, 65, 300, 1, 128, 129, 500])


def _hopper() -> bool:
    return cupy.cuda.Device().compute_capability == "90"


# kernel, and for wgmma its keys per tile, warpgroup turn-taking, split K / V barriers, TMA K / V loads and
# the softmax ordered before the previous P V's wait
@pytest.mark.parametrize("prefill_kernel,keys,pingpong,split_kv,tma,ordered", [
    ("plain", "", "", "", "", ""), ("pipelined", "", "", "", "", ""), ("wgmma", "128", "0", "0", "0", "0"),
    ("wgmma", "64", "0", "0", "0", "0"), ("wgmma", "128", "1", "1", "0", "0"), ("wgmma", "64", "1", "1", "0", "1"),
    ("wgmma", "128", "0", "0", "1", "1"), ("wgmma", "128", "1", "1", "1", "1"), ("wgmma", "64", "1", "1", "1", "0")])
@pytest.mark.parametrize("heads", [16, 20])
def test_decompressed_prefill_matches_numpy(cuda_backend, rng, monkeypatch, prefill_kernel, keys, pingpong, split_kv,
                                            tma, ordered, heads):
    """Each decompressed prefill attention kernel on ragged prompts and chunks beside a decode."""
    from openinfer.backend.cuda import mla as cuda_mla

    if prefill_kernel == "wgmma" and not _hopper():
        pytest.skip("the wgmma prefill kernel needs compute capability 9.0")
    monkeypatch.setenv(cuda_mla.PREFILL_KERNEL_ENV, prefill_kernel)
    monkeypatch.setenv(cuda_mla.SM90_KEYS_ENV, keys)
    monkeypatch.setenv(cuda_mla.SM90_PINGPONG_ENV, pingpong)
    monkeypatch.setenv(cuda_mla.SM90_SPLIT_KV_ENV, split_kv)
    monkeypatch.setenv(cuda_mla.SM90_TMA_ENV, tma)
    monkeypatch.setenv(cuda_mla.SM90_ORDERED_ENV, ordered)
    spec = _spec(heads)
    assert cuda_mla.prefill_kernel(spec) == prefill_kernel
    seqs = WIDE_PREFILLS if prefill_kernel == "wgmma" else PREFILLS
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, *seqs)
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    out = cuda_backend.to_host(_forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights, rope,
                                        None, min_query=16))
    assert relative_error(out, reference) < BF16_TOL
    for row in range(out.shape[0]):
        assert relative_error(out[row], reference[row]) < BF16_TOL, row


@pytest.mark.parametrize("kernel", ["mma", "mma_shared"])
def test_wide_combine_equals_shared(cuda_backend, rng, monkeypatch, kernel):
    """mla_combine_splits_wide (more blocks, only non-empty splits read) gives the bits of the shared
    combine on a ragged decode batch split up to 64 ways (many splits empty)."""
    from openinfer.backend.cuda import mla as cuda_mla

    spec = _spec(20)
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, *DECODES["ragged"])
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    outs = {}
    for combine in ("shared", "wide"):
        monkeypatch.setenv(cuda_mla.COMBINE_ENV, combine)
        outs[combine] = cuda_backend.to_host(_forward(cuda_backend, spec, batch, device_cache, q, latent, norm,
                                                      weights, rope, kernel))
    assert np.array_equal(outs["wide"], outs["shared"])
    assert relative_error(outs["wide"], reference) < BF16_TOL


@pytest.mark.parametrize("keys", ["32", "64"])
def test_shared_decode_query_registers_bit_equal(cuda_backend, rng, monkeypatch, keys):
    """mla_attention_mma_shared with its query fragments in registers gives the shared-memory build's bits
    (the same fragments, multiplied in the same order)."""
    from openinfer.backend.cuda import mla as cuda_mla

    monkeypatch.setenv(cuda_mla.SHARED_KEYS_ENV, keys)
    spec = _spec(20)
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, *DECODES["ragged"])
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    outs = []
    for q_regs in ("0", "1"):
        monkeypatch.setenv(cuda_mla.SHARED_Q_REGS_ENV, q_regs)
        assert cuda_mla.shared_q_regs(spec) == (q_regs == "1")
        outs.append(cuda_backend.to_host(_forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights,
                                                  rope, "mma_shared")))
    assert np.array_equal(outs[0], outs[1])
    assert relative_error(outs[1], reference) < BF16_TOL
    monkeypatch.setenv(cuda_mla.SHARED_Q_REGS_ENV, "yes")
    with pytest.raises(ValueError, match="OPENINFER_MLA_SHARED_Q_REGS"):
        cuda_mla.shared_q_regs(spec)


def test_shared_decode_beside_decompressed_prefill(cuda_backend, rng, monkeypatch):
    """mla_attention_mma_shared on the absorbed rows of a mixed step (token_rows: decodes beside a
    decompressed 70-token chunk and a 150-token prompt)."""
    spec = _spec(16)
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, [0, 100, 57, 3, 40], [150, 70, 1, 1, 1])
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    out = _forward(cuda_backend, spec, batch, device_cache, q, latent, norm, weights, rope, "mma_shared", min_query=16)
    assert relative_error(cuda_backend.to_host(out), reference) < BF16_TOL


@pytest.mark.parametrize("kernel", ["mma16", "mma_shared"])
def test_absorbed_decode_graph_replay_equals_eager(cuda_backend, rng, kernel):
    """A decode step captured in a CUDA graph and replayed gives the eager step's bits (the kernel and
    split count depend on the row count only)."""
    _graph_replay_equals_eager(cuda_backend, rng, kernel)


@pytest.mark.parametrize("heads", [16, 20])
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 64])
def test_expand_small_matches_cublas(cuda_backend, rng, monkeypatch, heads, rows):
    """mla_expand_small ($OPENINFER_MLA_EXPAND_SMALL=1, W_UV on tensor cores at <= 64 rows) against cuBLAS's
    batched GEMM on the same o_latent: partial 16-row tiles, 20 heads."""
    from openinfer.backend.cuda import mla as cuda_mla
    from tests.gpu.conftest import bf16_random

    spec = _spec(heads)
    o_latent = cuda_backend.upload(bf16_random(rng, rows, heads, spec.kv_lora_rank))
    w_uv = cuda_backend.weight(bf16_random(rng, heads, spec.v_head_dim, spec.kv_lora_rank, scale=0.05))
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv(cuda_mla.EXPAND_SMALL_ENV, flag)
        assert cuda_mla.expand_small_fits(rows, spec) == (flag == "1")
        out = cupy.empty((rows, heads * spec.v_head_dim), dtype=cupy.uint16)
        cuda_mla.expand_values(cuda_backend.blas, o_latent, w_uv, spec, out)
        outs.append(cuda_backend.to_host(out))
    assert relative_error(outs[1], outs[0]) < 1e-2
    monkeypatch.setenv(cuda_mla.EXPAND_SMALL_ENV, "1")
    assert not cuda_mla.expand_small_fits(65, spec)
    monkeypatch.setenv(cuda_mla.EXPAND_SMALL_ENV, "yes")
    with pytest.raises(ValueError, match="OPENINFER_MLA_EXPAND_SMALL"):
        cuda_mla.expand_small_fits(1, spec)


def test_write_absorb_graph_replay_equals_eager(cuda_backend, rng, monkeypatch):
    """A decode step with mla_write_absorb and mla_expand_small, captured in a CUDA graph and replayed, gives the
    eager step's bits."""
    from openinfer.backend.cuda import mla as cuda_mla

    monkeypatch.setenv(cuda_mla.WRITE_ABSORB_ENV, "1")
    monkeypatch.setenv(cuda_mla.EXPAND_SMALL_ENV, "1")
    _graph_replay_equals_eager(cuda_backend, rng, "mma_shared")


def _graph_replay_equals_eager(cuda_backend, rng, kernel: str) -> None:
    from openinfer.backend.cuda.mla import mla_forward

    spec = _spec(16)
    cached, new = DECODES["ragged"]
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, cached, new)
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    args = (cuda_backend.weight(weights.w_uk), cuda_backend.weight(weights.w_uv), cuda_backend.weight(norm), spec,
            cuda_backend.prepare_batch(batch), cupy.asarray(rope.cos), cupy.asarray(rope.sin), 1e-6)
    q_dev, latent_dev = cuda_backend.upload(q), cuda_backend.upload(latent)
    eager = mla_forward(cuda_backend.blas, q_dev.copy(), latent_dev, device_cache, *args, absorbed_kernel=kernel)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q_in = q_dev.copy()
        mla_forward(cuda_backend.blas, q_in.copy(), latent_dev, device_cache, *args, absorbed_kernel=kernel)  # warm
        stream.synchronize()
        mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
        stream.begin_capture() if mode is None else stream.begin_capture(mode)
        try:
            captured = mla_forward(cuda_backend.blas, q_in, latent_dev, device_cache, *args, absorbed_kernel=kernel)
        finally:
            graph = stream.end_capture()
        q_in[...] = q_dev  # the step rotates q's rope dims in place: fresh inputs for the replay
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(cuda_backend.to_host(captured), cuda_backend.to_host(eager))
    assert relative_error(cuda_backend.to_host(captured), reference) < BF16_TOL


def test_absorbed_kernel_choice(monkeypatch):
    """The table's entries choose their kernels; a forced kernel wins; an unknown name is refused."""
    from openinfer.backend.cuda import mla as cuda_mla

    monkeypatch.delenv(cuda_mla.ABSORBED_KERNEL_ENV, raising=False)
    for most_heads, most_tokens, name in cuda_mla.ABSORBED_KERNEL_CHOICE:
        assert name in cuda_mla.ABSORBED_KERNELS
        assert cuda_mla.choose_absorbed_kernel(most_heads, most_tokens) == name
    monkeypatch.setenv(cuda_mla.ABSORBED_KERNEL_ENV, "mma_shared")
    assert cuda_mla.choose_absorbed_kernel(16, 256) == "mma_shared"
    monkeypatch.delenv(cuda_mla.SHARED_KEYS_ENV, raising=False)
    for most_rows, keys in cuda_mla.SHARED_KEYS_BY_ROWS:
        assert keys in cuda_mla.SHARED_KEYS_CHOICES and cuda_mla.shared_keys(most_rows) == keys
    monkeypatch.setenv(cuda_mla.SHARED_KEYS_ENV, "64")
    assert cuda_mla.shared_keys(1) == cuda_mla.shared_keys(256) == 64
    monkeypatch.setenv(cuda_mla.SHARED_KEYS_ENV, "48")
    with pytest.raises(ValueError, match="OPENINFER_MLA_SHARED_KEYS"):
        cuda_mla.shared_keys()
    # resident: every block in one wave (2 per SM of 32-key tiles), capped by MAX_SPLITS; waves: num_splits
    monkeypatch.delenv(cuda_mla.MAX_SPLITS_ENV, raising=False)
    monkeypatch.delenv(cuda_mla.SHARED_SPLITS_ENV, raising=False)
    assert [cuda_mla.resident_splits(t, 1, 132, 2) for t in (1, 16, 64, 256, 300)] == [64, 16, 4, 1, 1]
    assert cuda_mla.resident_splits(64, 4, 132, 1) == 1
    monkeypatch.setenv(cuda_mla.SHARED_SPLITS_ENV, "waves")
    assert cuda_mla.resident_splits(64, 1, 132, 2) == cuda_mla.num_splits(64, 1, 132) == 5
    monkeypatch.setenv(cuda_mla.SHARED_SPLITS_ENV, "often")
    with pytest.raises(ValueError, match="OPENINFER_MLA_SHARED_SPLITS"):
        cuda_mla.resident_splits(1, 1, 132, 2)
    # the defaults: wgmma on Hopper (128-key tiles, ping-pong, split K / V, TMA), query fragments in registers
    for env in (cuda_mla.PREFILL_KERNEL_ENV, cuda_mla.SM90_KEYS_ENV, cuda_mla.SM90_PINGPONG_ENV,
                cuda_mla.SM90_SPLIT_KV_ENV, cuda_mla.SM90_TMA_ENV, cuda_mla.SM90_ORDERED_ENV, cuda_mla.SHARED_Q_REGS_ENV):
        monkeypatch.delenv(env, raising=False)
    assert cuda_mla.prefill_kernel(_spec(16)) == ("wgmma" if _hopper() else "pipelined")
    assert cuda_mla.sm90_prefill_variant() == cuda_mla.Sm90PrefillVariant(128, True, True, True, True)
    assert cuda_mla.shared_q_regs(_spec(16))
    monkeypatch.setenv(cuda_mla.PREFILL_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="OPENINFER_MLA_PREFILL"):
        cuda_mla.prefill_kernel(_spec(16))
    monkeypatch.setenv(cuda_mla.PREFILL_KERNEL_ENV, "pipelined")  # nope + rope of 16-wide steps only: plain
    assert cuda_mla.prefill_kernel(MLASpec(16, 64, 16, 64, 512, 0.1)) == "plain"
    monkeypatch.setenv(cuda_mla.SM90_KEYS_ENV, "96")
    with pytest.raises(ValueError, match="OPENINFER_MLA_SM90_KEYS"):
        cuda_mla.sm90_prefill_variant()
    monkeypatch.setenv(cuda_mla.SM90_KEYS_ENV, "64")
    monkeypatch.setenv(cuda_mla.SM90_PINGPONG_ENV, "yes")
    with pytest.raises(ValueError, match="OPENINFER_MLA_SM90_PINGPONG"):
        cuda_mla.sm90_prefill_variant()
    monkeypatch.setenv(cuda_mla.SM90_PINGPONG_ENV, "1")
    monkeypatch.setenv(cuda_mla.SM90_SPLIT_KV_ENV, "2")
    with pytest.raises(ValueError, match="OPENINFER_MLA_SM90_SPLIT_KV"):
        cuda_mla.sm90_prefill_variant()
    monkeypatch.setenv(cuda_mla.SM90_SPLIT_KV_ENV, "1")
    monkeypatch.setenv(cuda_mla.SM90_TMA_ENV, "1")  # the ordered softmax stays the default
    assert cuda_mla.sm90_prefill_variant() == cuda_mla.Sm90PrefillVariant(64, True, True, True, True)
    # the ring fits one SM's 227 KB beside the 128-query tile at every keys choice (DeepSeek-V3's 192 + 128)
    assert max(cuda_mla.sm90_prefill_smem(_spec(16), k) for k in cuda_mla.SM90_PREFILL_STAGES) <= 227 * 1024
    # wgmma takes whole 64-wide K column blocks and v 128 on Hopper; else pipelined (or plain) runs
    monkeypatch.setenv(cuda_mla.PREFILL_KERNEL_ENV, "wgmma")
    assert cuda_mla.prefill_kernel(_spec(16)) == ("wgmma" if _hopper() else "pipelined")
    assert cuda_mla.prefill_kernel(MLASpec(16, 64, 32, 128, 512, 0.1)) == "pipelined"
    assert cuda_mla.prefill_kernel(MLASpec(16, 128, 64, 64, 512, 0.1)) == "pipelined"
    assert cuda_mla.prefill_kernel(MLASpec(16, 64, 16, 64, 512, 0.1)) == "plain"


def _decode_rows(name: str) -> tuple[list[int], list[int]]:
    """(cached, new) of DECODES[name], or of "sixteen" / "sixty-four" decodes (contexts 37 apart)."""
    rows = {"sixteen": 16, "sixty-four": 64}.get(name)
    return ([int(c) for c in np.arange(rows) * 37], [1] * rows) if rows else DECODES[name]


def _stream_forward(cuda_backend, spec, step, device_cache, kernel, graph: bool):
    """``mla_forward`` of ``step`` on a non-blocking stream, eager or captured in a CUDA graph and replayed on fresh
    inputs; the output on the host."""
    from openinfer.backend.cuda.mla import mla_forward

    batch, _, q, latent, norm, weights, rope = step[:7]
    args = (cuda_backend.weight(weights.w_uk), cuda_backend.weight(weights.w_uv), cuda_backend.weight(norm), spec,
            cuda_backend.prepare_batch(batch), cupy.asarray(rope.cos), cupy.asarray(rope.sin), 1e-6)
    q_dev, latent_dev = cuda_backend.upload(q), cuda_backend.upload(latent)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q_in = q_dev.copy()
        latent_in = latent_dev

        def forward():
            return mla_forward(cuda_backend.blas, q_in, latent_in, device_cache, *args, absorbed_kernel=kernel)

        out = forward()
        if graph:
            stream.synchronize()
            mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
            stream.begin_capture() if mode is None else stream.begin_capture(mode)
            try:
                out = forward()
            finally:
                captured = stream.end_capture()
            q_in[...] = q_dev  # the step rotates q's rope dims in place: fresh inputs for the replay
            out[...] = 0
            captured.launch(stream)
        stream.synchronize()
    return cuda_backend.to_host(out)


def test_combine_switch_and_launch_arguments(monkeypatch):
    """$OPENINFER_MLA_COMBINE's choice (a clear error for an unknown kernel); the programmatic launcher
    (pdl_launch, the MoE's) refuses Python numbers (no width)."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda.pdl_launch import kernel_argument

    with pytest.raises(TypeError, match="NumPy"):
        kernel_argument(3)
    # the combine: flat up to 4 splits, wide past them, unless forced
    monkeypatch.delenv(cuda_mla.COMBINE_ENV, raising=False)
    assert [cuda_mla.combine_kernel(z) for z in (2, 4, 5, 64)] == ["mla_combine_splits_flat"] * 2 + [
        "mla_combine_splits_wide"] * 2
    monkeypatch.setenv(cuda_mla.COMBINE_ENV, "wide")
    assert cuda_mla.combine_kernel(4) == "mla_combine_splits_wide"
    monkeypatch.setenv(cuda_mla.COMBINE_ENV, "flatter")
    with pytest.raises(ValueError, match="OPENINFER_MLA_COMBINE"):
        cuda_mla.combine_kernel(4)
    assert kernel_argument(np.int32(3)).tobytes() == np.int32(3).tobytes()


@pytest.mark.parametrize("kernel", ["mma_shared", "tma", "mma"])
@pytest.mark.parametrize("decodes", ["ragged", "one-long", "sixty-four"])
@pytest.mark.parametrize("heads", [20, 64])
@pytest.mark.parametrize("balance", ["0", "1"])
def test_flat_combine_equals_wide(cuda_backend, rng, monkeypatch, kernel, decodes, heads, balance):
    """mla_combine_splits_flat ($OPENINFER_MLA_COMBINE=flat: a thread per 4 dims, 16 splits' rows loaded together)
    gives the wide combine's bits: ragged batches split 1 to 64 ways (many splits empty, chunks of 16 splits
    partly past the last), partial head blocks, tokens the balanced tma kernel wrote whole; as a replayed CUDA
    graph too."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90

    if kernel == "tma" and not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    if balance == "1" and kernel != "tma":
        pytest.skip("balanced splits are the tma kernel's")
    monkeypatch.setenv(mla_decode_sm90.TMA_BALANCE_ENV, balance)
    monkeypatch.delenv(cuda_mla.MAX_SPLITS_ENV, raising=False)
    spec = _spec(heads)
    step = ragged_mla_step(rng, spec, *_decode_rows(decodes), BLOCK_SIZE)
    batch, cache, q, latent, norm, weights, rope, reference = step[:8]
    device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    outs = {}
    for combine in ("wide", "flat"):
        monkeypatch.setenv(cuda_mla.COMBINE_ENV, combine)
        outs[combine] = cuda_backend.to_host(_forward(cuda_backend, spec, batch, device_cache, q, latent, norm,
                                                      weights, rope, kernel))
    assert np.array_equal(outs["flat"], outs["wide"])
    assert relative_error(outs["flat"], reference) < BF16_TOL
    assert np.array_equal(_stream_forward(cuda_backend, spec, step, device_cache, kernel, graph=True), outs["wide"])


@pytest.mark.parametrize("decodes", ["ragged", "sixteen", "sixty-four", "chunks"])
@pytest.mark.parametrize("kernel", [None, "tma"])
def test_absorb_side_bit_equal_to_one_stream(cuda_backend, rng, monkeypatch, decodes, kernel):
    """$OPENINFER_MLA_ABSORB_SIDE=1: W_UK on a side stream beside the latent write (which rotates q's rope dims in
    place): the one-stream bits, eager on a stream and as a replayed CUDA graph (two parallel branches); a bad value is
    a clear error."""
    from openinfer.backend.cuda import mla as cuda_mla

    if kernel == "tma" and not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    spec = _spec(16)
    cached, new = ([40, 100, 33, 64], [3, 5, 2, 1]) if decodes == "chunks" else _decode_rows(decodes)
    step = ragged_mla_step(rng, spec, cached, new, BLOCK_SIZE)
    device_cache = cuda_backend.upload(step[1]).reshape(step[1].shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    monkeypatch.setenv(cuda_mla.FUSED_WRITE_ENV, "0")  # the one-stream chain: the copy of q and its own latent write
    monkeypatch.setenv(cuda_mla.Q_VIEW_ENV, "0")
    monkeypatch.setenv(cuda_mla.ABSORB_SIDE_ENV, "0")
    plain = _stream_forward(cuda_backend, spec, step, device_cache, kernel, graph=False)
    assert relative_error(plain, step[7]) < BF16_TOL
    monkeypatch.setenv(cuda_mla.ABSORB_SIDE_ENV, "1")
    assert np.array_equal(_stream_forward(cuda_backend, spec, step, device_cache, kernel, graph=False), plain)
    assert np.array_equal(_stream_forward(cuda_backend, spec, step, device_cache, kernel, graph=True), plain)
    monkeypatch.setenv(cuda_mla.ABSORB_SIDE_ENV, "yes")
    with pytest.raises(ValueError, match="OPENINFER_MLA_ABSORB_SIDE"):
        cuda_mla.absorb_side()


@pytest.mark.parametrize("view,write,absorb_small,staged", [("1", "0", "0", "0"), ("0", "1", "0", "0"),
                                                            ("1", "1", "0", "1"), ("1", "1", "1", "1")])
def test_tma_fused_write_graph_replay_equals_eager(cuda_backend, rng, monkeypatch, view, write, absorb_small, staged):
    """q read in place and the folded latent write (and W_UK by mla_absorb_small; the query rows staged by 16-byte
    loads) captured in a CUDA graph and replayed: the eager step's bits."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90

    if not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    monkeypatch.setenv(cuda_mla.ABSORB_SMALL_ENV, absorb_small)
    monkeypatch.setenv(cuda_mla.Q_VIEW_ENV, view)
    monkeypatch.setenv(cuda_mla.FUSED_WRITE_ENV, write)
    monkeypatch.setenv(mla_decode_sm90.Q_TILE_ENV, staged)
    _graph_replay_equals_eager(cuda_backend, rng, "tma")
    spec = _spec(16)
    step = ragged_mla_step(rng, spec, *_decode_rows("sixteen"), BLOCK_SIZE)
    device_cache = cuda_backend.upload(step[1]).reshape(step[1].shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    eager = _stream_forward(cuda_backend, spec, step, device_cache, "tma", graph=False)
    assert np.array_equal(_stream_forward(cuda_backend, spec, step, device_cache, "tma", graph=True), eager)
    assert relative_error(eager, step[7]) < BF16_TOL


@pytest.mark.parametrize("heads", [16, 20, 64])
@pytest.mark.parametrize("step", ["decodes", "sixteen", "mixed", "one"])
@pytest.mark.parametrize("kernel", ["tma", "mma_shared"])
def test_q_view_equals_copy_then_write(cuda_backend, rng, monkeypatch, heads, step, kernel):
    """$OPENINFER_MLA_Q_VIEW=1: q and the latent as row views of one fused [T, q | latent] buffer (as the kimi model
    passes Moonlight's); the latent write stores the rotated q_pe into its own buffer and W_UK reads q through its
    row stride: the same cached latent rows and (within W_UK's summation order) output as the copy + in-place rotation (decodes, 16 decodes, a
    mixed step whose decompressed rows take the copy, one row), the fused buffer left as it was where q is read in
    place, within bf16 of NumPy; a bad value is a clear error."""
    from openinfer.backend.cuda import mla as cuda_mla

    if kernel == "tma" and not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    monkeypatch.setenv(cuda_mla.FUSED_WRITE_ENV, "0")  # the separate latent write, q read in place or copied
    spec = _spec(heads)
    cached, new = {"decodes": DECODES["ragged"], "sixteen": _decode_rows("sixteen"),
                   "mixed": ([0, 100, 57, 3], [40, 1, 1, 30]), "one": ([700], [1])}[step]
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, cached, new)
    fused = cuda_backend.upload(np.concatenate([q, latent], axis=1))
    before = fused.copy()
    width = q.shape[1]
    args = (cuda_backend.weight(weights.w_uk), cuda_backend.weight(weights.w_uv), cuda_backend.weight(norm), spec,
            cuda_backend.prepare_batch(batch), cupy.asarray(rope.cos), cupy.asarray(rope.sin), 1e-6)
    results = {}
    for view in ("0", "1"):
        monkeypatch.setenv(cuda_mla.Q_VIEW_ENV, view)
        assert cuda_mla.q_view_fits(fused[:, :width], spec) is (view == "1")
        device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
        fused[...] = before
        out = cuda_mla.mla_forward(cuda_backend.blas, fused[:, :width], fused[:, width:], device_cache, *args,
                                   prefill_min_query=16, absorbed_kernel=kernel)
        results[view] = (out.get(), device_cache.get())
        if view == "1" and step != "mixed":
            assert np.array_equal(fused.get(), before.get())  # q read where it lies, never rotated in place
    assert np.array_equal(results["1"][1], results["0"][1])  # the same latent rows cached
    out = cuda_backend.to_host(cupy.asarray(results["1"][0]))
    # the same bits wherever cuBLAS runs the same W_UK kernel for q's row stride (a different one may sum the 128
    # nope dims in another order: then bf16-close)
    assert relative_error(out, cuda_backend.to_host(cupy.asarray(results["0"][0]))) < 4e-3
    assert relative_error(out, reference) < BF16_TOL
    for row in range(out.shape[0]):
        assert relative_error(out[row], reference[row]) < BF16_TOL, row
    monkeypatch.setenv(cuda_mla.Q_VIEW_ENV, "yes")
    with pytest.raises(ValueError, match="OPENINFER_MLA_Q_VIEW"):
        cuda_mla.q_view_fits(fused[:, :width], spec)


@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("step", ["decodes", "sixteen", "one", "tiles", "chunks", "mixed"])
@pytest.mark.parametrize("kernel,cluster,max_splits", [("tma", "0", ""), ("tma", "0", "1"), ("tma", "0", "2"),
                                                       ("tma", "16", ""), ("mma_shared", "0", "")])
def test_fused_write_equals_separate_write(cuda_backend, rng, monkeypatch, heads, step, kernel, cluster, max_splits):
    """$OPENINFER_MLA_FUSED_WRITE=1: in steps of one new token per sequence mla_attention_tma computes the latent rows
    itself (head block 0 stores them), rotates q's rope dims as it loads them and splits the cached keys (the own row
    added to the last split; alone in its tile where the cached keys fill whole tiles: "tiles", "one", "sixteen"'s
    first), over caches whose own slots hold NaN bits before the step (the attention never reads them from the
    cache): the cached rows' bits of the q-in-place path with its separate latent write ($OPENINFER_MLA_Q_VIEW=1; the
    same strided W_UK), its output bits with one split (the same keys per split), within bf16 of it and of NumPy per
    row with more, in clusters of 16 too; other kernels take the q_pe write first;
    steps of several tokens per sequence ("chunks") and mixed steps keep the separate write; a bad value is a clear
    error."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90

    if kernel == "tma" and not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    monkeypatch.setenv(mla_decode_sm90.TMA_CLUSTER_ENV, cluster)  # 16: splits combined on chip
    monkeypatch.setenv(cuda_mla.MAX_SPLITS_ENV, max_splits)
    monkeypatch.setenv(mla_decode_sm90.TMA_BALANCE_ENV, "0" if max_splits == "1" else "1")  # one split: truly one
    spec = _spec(heads)
    cached, new = {"decodes": DECODES["ragged"], "one": ([704], [1]), "tiles": ([64, 1024, 512, 96, 32], [1] * 5),
                   "chunks": ([40, 100, 33, 64], [3, 5, 2, 1]),
                   "mixed": ([0, 100, 57, 3], [40, 1, 1, 30])}.get(step) or _decode_rows(step)
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, cached, new)
    fused = cuda_backend.upload(np.concatenate([q, latent], axis=1))
    before = fused.copy()
    width = q.shape[1]
    prepared = cuda_backend.prepare_batch(batch)
    args = (cuda_backend.weight(weights.w_uk), cuda_backend.weight(weights.w_uv), cuda_backend.weight(norm), spec,
            prepared, cupy.asarray(rope.cos), cupy.asarray(rope.sin), 1e-6)
    own_slots = cupy.asarray(batch.slot_mapping)
    results = {}
    for fused_write in ("0", "1"):
        monkeypatch.setenv(cuda_mla.Q_VIEW_ENV, "1")
        monkeypatch.setenv(cuda_mla.FUSED_WRITE_ENV, fused_write)
        assert cuda_mla.fused_write_fits(fused[:, :width], spec, prepared) is (fused_write == "1" and step != "chunks"
                                                                                and step != "mixed")
        device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
        _poison_unused_slots(device_cache, batch)
        device_cache.reshape(-1, spec.latent_dim)[own_slots] = 0x7FC0  # the step's own rows: NaN until written
        fused[...] = before
        out = cuda_mla.mla_forward(cuda_backend.blas, fused[:, :width], fused[:, width:], device_cache, *args,
                                   prefill_min_query=16, absorbed_kernel=kernel)
        results[fused_write] = (out.get(), device_cache.get())
        if step != "mixed":
            assert np.array_equal(fused.get(), before.get())  # q read where it lies, never rotated in place
    assert np.array_equal(results["1"][1], results["0"][1])  # the same latent rows cached
    if max_splits == "1" or kernel != "tma" or step in ("chunks", "mixed"):
        assert np.array_equal(results["1"][0], results["0"][0])
    out = cuda_backend.to_host(cupy.asarray(results["1"][0]))
    assert relative_error(out, cuda_backend.to_host(cupy.asarray(results["0"][0]))) < BF16_TOL
    assert relative_error(out, reference) < BF16_TOL
    for row in range(out.shape[0]):
        assert relative_error(out[row], reference[row]) < BF16_TOL, row
    monkeypatch.setenv(cuda_mla.FUSED_WRITE_ENV, "yes")
    with pytest.raises(ValueError, match="OPENINFER_MLA_FUSED_WRITE"):
        cuda_mla.fused_write_fits(fused[:, :width], spec, prepared)


@pytest.mark.parametrize("heads", [16, 20, 64])
@pytest.mark.parametrize("rows", [1, 9, 16, 17])
@pytest.mark.parametrize("view", [False, True])
def test_absorb_small_matches_cublas(cuda_backend, rng, monkeypatch, heads, rows, view):
    """$OPENINFER_MLA_ABSORB_SMALL=1: W_UK by mla_absorb_small (at most 16 rows; q contiguous or a row view of a wider
    buffer) within bf16 of cuBLAS's batched GEMM and of NumPy; 17 rows keep cuBLAS (the same bits); a bad value is a
    clear error."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.mla import MLAWeights
    from tests.gpu.conftest import bf16_random

    spec = _spec(heads)
    q = bf16_random(rng, rows, heads * spec.qk_head_dim)
    kv_b = bf16_random(rng, heads * (spec.qk_nope_dim + spec.v_head_dim), spec.kv_lora_rank, scale=0.05)
    weights = MLAWeights.from_kv_b(kv_b, spec)
    wide = cuda_backend.upload(np.concatenate([q, bf16_random(rng, rows, 576)], axis=1))
    q_dev = wide[:, :q.shape[1]] if view else cuda_backend.upload(q)
    w_uk = cuda_backend.weight(weights.w_uk)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(cuda_mla.ABSORB_SMALL_ENV, flag)
        outs[flag] = cuda_backend.to_host(cuda_mla.absorb_queries(cuda_backend.blas, q_dev, w_uk, spec))
    q32 = np.asarray(q, np.float32).reshape(rows, heads, spec.qk_head_dim)[..., :spec.qk_nope_dim]
    reference = np.einsum("thn,hnl->thl", q32, np.asarray(weights.w_uk, np.float32))
    assert relative_error(outs["1"], reference) < BF16_TOL
    assert relative_error(outs["1"], outs["0"]) < BF16_TOL
    if rows > cuda_mla.WRITE_ABSORB_MAX_TOKENS:
        assert np.array_equal(outs["1"], outs["0"])
    monkeypatch.setenv(cuda_mla.ABSORB_SMALL_ENV, "yes")
    with pytest.raises(ValueError, match="OPENINFER_MLA_ABSORB_SMALL"):
        cuda_mla.absorb_small_fits(1, spec)


@pytest.mark.parametrize("heads", [16, 20, 64])
@pytest.mark.parametrize("step", ["decodes", "sixteen", "one", "chunks"])
@pytest.mark.parametrize("write,tile", [("0", "32x2"), ("1", "32x2"), ("1", "16x5"), ("0", "16x4/1")])
def test_tma_staged_queries_bit_equal(cuda_backend, rng, monkeypatch, heads, step, write, tile):
    """$OPENINFER_MLA_TMA_Q_TILE=1: mla_attention_tma stages its 16 query rows in shared memory by 16-byte loads (with
    the fused write: q's rope dims rotated on the way) and takes the A fragments by ldmatrix: the plain loads' bits,
    with q and the latent as row views of one fused buffer; a bad value is a clear error."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90

    if not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    _set_tma_tile(monkeypatch, tile)
    # the staged rows' 18.7 KB can leave a 16x5 ring one block per SM: the resident split count (and its balance)
    # would change with it; the same 2 even splits either way (every step here has room for 2 at one block per SM)
    monkeypatch.setenv(cuda_mla.MAX_SPLITS_ENV, "2")
    monkeypatch.setenv(mla_decode_sm90.TMA_BALANCE_ENV, "0")
    monkeypatch.setenv(cuda_mla.FUSED_WRITE_ENV, write)
    monkeypatch.setenv(cuda_mla.Q_VIEW_ENV, "1")
    spec = _spec(heads)
    cached, new = {"decodes": DECODES["ragged"], "one": ([704], [1]),
                   "chunks": ([40, 100, 33, 64], [3, 5, 2, 1])}.get(step) or _decode_rows(step)
    batch, cache, q, latent, norm, weights, rope, reference = _step(rng, spec, cached, new)
    fused = cuda_backend.upload(np.concatenate([q, latent], axis=1))
    width = q.shape[1]
    args = (cuda_backend.weight(weights.w_uk), cuda_backend.weight(weights.w_uv), cuda_backend.weight(norm), spec,
            cuda_backend.prepare_batch(batch), cupy.asarray(rope.cos), cupy.asarray(rope.sin), 1e-6)
    outs = {}
    for staged in ("0", "1"):
        monkeypatch.setenv(mla_decode_sm90.Q_TILE_ENV, staged)
        device_cache = cuda_backend.upload(cache).reshape(cache.shape[0], BLOCK_SIZE, 1, spec.latent_dim)
        _poison_unused_slots(device_cache, batch)
        out = cuda_mla.mla_forward(cuda_backend.blas, fused[:, :width], fused[:, width:], device_cache, *args,
                                   absorbed_kernel="tma")
        outs[staged] = (out.get(), device_cache.get())
    assert np.array_equal(outs["1"][0], outs["0"][0])
    assert np.array_equal(outs["1"][1], outs["0"][1])
    out = cuda_backend.to_host(cupy.asarray(outs["1"][0]))
    for row in range(out.shape[0]):
        assert relative_error(out[row], reference[row]) < BF16_TOL, row
    monkeypatch.setenv(mla_decode_sm90.Q_TILE_ENV, "yes")
    with pytest.raises(ValueError, match="OPENINFER_MLA_TMA_Q_TILE"):
        mla_decode_sm90.q_tile()


def _split_partials(rng, rows: int, heads: int, splits: int, lora: int):
    """Random fp32 partials of ``splits`` context splits per (row, head) as the attention kernels leave them: about a
    third of the splits empty (max -inf, sum 0), one head row with no keys at all, one with a single non-empty split,
    and about a fifth written whole by their one split (split 0's max +inf; their rows in ``o_latent``)."""
    maxima = (3 * rng.standard_normal((rows, heads, splits))).astype(np.float32)
    sums = rng.uniform(0.5, 4.0, (rows, heads, splits)).astype(np.float32)
    empty = rng.random((rows, heads, splits)) < 0.3
    empty[0, 0] = True
    empty[-1, 1] = np.arange(splits) != splits // 2
    maxima[empty], sums[empty] = -np.inf, 0.0
    whole = rng.random((rows, heads)) < 0.2
    whole[0, 0] = whole[-1, 1] = False
    whole[-1, -1] = True
    maxima[whole, 0] = np.inf
    partial_o = rng.standard_normal((rows, heads, splits, lora)).astype(np.float32)
    return partial_o, np.stack([maxima, sums], -1), whole


@pytest.mark.parametrize("columns", [16, 32, 64])
@pytest.mark.parametrize("splits", [5, 33, 64])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("heads", [16, 64])
def test_combine_expand_bit_equal_to_combine_then_expand_small(cuda_backend, rng, monkeypatch, columns, splits, rows,
                                                               heads):
    """mla_combine_expand ($OPENINFER_MLA_COMBINE_EXPAND=16 / 32 / 64) gives the bits of the split combine (flat and
    wide, themselves bit-equal) followed by mla_expand_small, on partials with empty splits, a head row with none,
    one with a single split and rows written whole by their one split (read from o_latent)."""
    from openinfer.backend.cuda import mla as cuda_mla
    from tests.gpu.conftest import bf16_random

    spec = _spec(heads)
    lora, v = spec.kv_lora_rank, spec.v_head_dim
    partial_o, partial_ml, whole = _split_partials(rng, rows, heads, splits, lora)
    partials = cuda_mla.SplitPartials(cupy.asarray(partial_o), cupy.asarray(partial_ml), splits)
    written = bf16_random(rng, rows, heads, lora)
    w_uv = cuda_backend.weight(bf16_random(rng, heads, v, lora, scale=0.05))
    monkeypatch.setenv(cuda_mla.EXPAND_SMALL_ENV, "1")
    outs = {}
    for combine in ("flat", "wide"):
        monkeypatch.setenv(cuda_mla.COMBINE_ENV, combine)
        o_latent = cuda_backend.upload(written)
        cuda_mla.combine_splits(partials, o_latent, spec)
        out = cupy.empty((rows, heads * v), dtype=cupy.uint16)
        cuda_mla.expand_values(cuda_backend.blas, o_latent, w_uv, spec, out)
        outs[combine] = cuda_backend.to_host(out)
        merged = cuda_backend.to_host(o_latent)
    assert np.array_equal(outs["flat"], outs["wide"])
    assert np.array_equal(merged[whole], written[whole])
    monkeypatch.setenv(cuda_mla.COMBINE_EXPAND_ENV, str(columns))
    assert cuda_mla.combine_expand_columns(rows, splits, spec) == columns
    out = cupy.full((rows, heads * v), 0xFFFF, dtype=cupy.uint16)
    o_latent = cuda_backend.upload(written)
    cuda_mla.combine_expand(partials, o_latent, w_uv, spec, out, columns)
    assert np.array_equal(cuda_backend.to_host(out), outs["flat"])
    assert np.array_equal(cuda_backend.to_host(o_latent), written)  # read (its whole rows), never written
    reference = np.einsum("thl,hvl->thv", merged, cuda_backend.to_host(w_uv)).reshape(rows, heads * v)
    assert relative_error(outs["flat"], reference) < 1e-2


@pytest.mark.parametrize("columns", ["16", "32", "64"])
@pytest.mark.parametrize("decodes", ["ragged", "one-long", "sixteen"])
@pytest.mark.parametrize("kernel", ["mma_shared", "tma"])
@pytest.mark.parametrize("heads", [16, 64])
def test_combine_expand_forward_bit_equal_to_expand_small(cuda_backend, rng, monkeypatch, columns, decodes, kernel,
                                                          heads):
    """A whole mla_forward decode step with $OPENINFER_MLA_COMBINE_EXPAND on gives the bits of the step with it off
    and $OPENINFER_MLA_EXPAND_SMALL=1 (the combine, then mla_expand_small), eager and as a replayed CUDA graph; the
    fused kernel ran (the tma kernel's balanced splits leave some rows whole: read from o_latent). With its split cap
    (1,024 head-splits) the step's bits are those of the unfused step capped alike ($OPENINFER_MLA_MAX_SPLITS)."""
    from openinfer.backend.cuda import mla as cuda_mla
    from openinfer.backend.cuda import mla_decode_sm90

    if kernel == "tma" and not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    monkeypatch.delenv(cuda_mla.MAX_SPLITS_ENV, raising=False)
    monkeypatch.setenv(mla_decode_sm90.TMA_CLUSTER_ENV, "0")  # partials to combine (a cluster combines on chip)
    monkeypatch.setenv(cuda_mla.EXPAND_SMALL_ENV, "1")
    monkeypatch.delenv(cuda_mla.COMBINE_EXPAND_HEAD_SPLITS_ENV, raising=False)  # first uncapped: the unfused splits
    spec = _spec(heads)
    step = ragged_mla_step(rng, spec, *_decode_rows(decodes), BLOCK_SIZE)
    device_cache = cuda_backend.upload(step[1]).reshape(step[1].shape[0], BLOCK_SIZE, 1, spec.latent_dim)
    monkeypatch.setenv(cuda_mla.COMBINE_EXPAND_ENV, "0")
    plain = _stream_forward(cuda_backend, spec, step, device_cache, kernel, graph=False)
    assert relative_error(plain, step[7]) < BF16_TOL
    fused_columns = []
    launch = cuda_mla.combine_expand

    def counted(partials, o_latent, w_uv, spec, out, columns):
        fused_columns.append(columns)
        launch(partials, o_latent, w_uv, spec, out, columns)

    monkeypatch.setattr(cuda_mla, "combine_expand", counted)
    monkeypatch.setenv(cuda_mla.COMBINE_EXPAND_ENV, columns)
    assert np.array_equal(_stream_forward(cuda_backend, spec, step, device_cache, kernel, graph=False), plain)
    assert fused_columns and set(fused_columns) == {int(columns)}
    assert np.array_equal(_stream_forward(cuda_backend, spec, step, device_cache, kernel, graph=True), plain)
    monkeypatch.setenv(cuda_mla.COMBINE_EXPAND_HEAD_SPLITS_ENV, "1024")
    most = cuda_mla.combine_expand_most_splits(int(step[2].shape[0]), spec)
    assert most == 1024 // heads  # the fused kernel's rows (it ran above)
    capped = _stream_forward(cuda_backend, spec, step, device_cache, kernel, graph=True)
    assert relative_error(capped, step[7]) < BF16_TOL
    monkeypatch.setenv(cuda_mla.COMBINE_EXPAND_ENV, "0")
    monkeypatch.setenv(cuda_mla.MAX_SPLITS_ENV, str(most))
    assert np.array_equal(_stream_forward(cuda_backend, spec, step, device_cache, kernel, graph=False), capped)


@pytest.mark.parametrize("columns", ["16", "64"])
@pytest.mark.parametrize("kernel", ["mma_shared", "tma"])
def test_combine_expand_graph_replay_equals_eager(cuda_backend, rng, monkeypatch, columns, kernel):
    """A decode step with mla_combine_expand captured in a CUDA graph and replayed gives the eager step's bits."""
    from openinfer.backend.cuda import mla as cuda_mla

    if kernel == "tma" and not _hopper():
        pytest.skip("the TMA decode kernel needs compute capability 9.0")
    monkeypatch.setenv(cuda_mla.COMBINE_EXPAND_ENV, columns)
    _graph_replay_equals_eager(cuda_backend, rng, kernel)
