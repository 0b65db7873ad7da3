"""The in-step prefix-cache snapshot written by the chunked chain's state walks (``gdn_chunked.cu``:
``gdn_chunk_states_snapshot``, ``gdn_chunk_states_registers_snapshot``) and ``gdn_conv_snapshot``
(``gated_deltanet.cu``), compiled with g++ against the host stand-in for the CUDA built-ins and run on
the CPU (mma emulated lane by lane): over a chunk layout cut at each boundary (``chunk_layout(cuts=)``)
the snapshot slot gets exactly the state a walk stopping at the boundary leaves, the live slots
exactly the plain walk's, and the conv window there the K-1 inputs before the boundary (from the
live window as it was, or zeros, when the boundary is within the first K-1 rows). The GPU tests
(``test_qwen35_warm_turn_gpu.py``) check the launch glue against the split run."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
from openinfer_qwen35 import gated_deltanet
from openinfer_qwen35.config import Qwen35Config

from openinfer import float32_to_bf16
from tests.helpers.cuda_emulation import bf16, compile_harness, read_array, run_harness
from tests.plugins.qwen35.qwen35_helpers import TINY_QWEN35

HARNESS = Path(__file__).parent / "cuda_emulation" / "snapshot_walk_harness.cpp"
KEY_DIM, VALUE_DIM = 64, 64  # the chunked kernels take dk % 64 == 0, dv % 32 == 0


def test_the_walks_write_the_state_a_run_stopping_at_the_boundary_leaves(tmp_path):
    kernels = Path(str(resources.files("openinfer_qwen35") / "kernels"))
    config = Qwen35Config.from_dict({**TINY_QWEN35, "linear_key_head_dim": KEY_DIM, "linear_value_head_dim": VALUE_DIM})
    rng = np.random.default_rng(11)
    nk, nv, width, conv_dim = (config.linear_num_key_heads, config.linear_num_value_heads,
                               config.linear_conv_kernel_dim, config.conv_dim)
    features = conv_dim + config.linear_value_dim + 2 * nv
    # a fresh prompt snapshotted 144 rows in (chunks 64, 64, 16 | 6), a continued one 2 rows in (the conv
    # window there reaches into the live slot's), a fresh one 1 row in (its window there: zeros and that row)
    lengths, fresh, slots = [150, 70, 40], np.array([True, False, True]), np.array([1, 2, 3], np.int32)
    cuts, snapshot_slots = np.array([144, 2, 1]), np.array([4, 5, 6], np.int32)
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    proj = float32_to_bf16(rng.standard_normal((query_start[-1], features)).astype(np.float32))
    conv_state = float32_to_bf16(rng.standard_normal((7, width - 1, conv_dim)).astype(np.float32))
    ssm_state = (0.3 * rng.standard_normal((7, nv, KEY_DIM, VALUE_DIM))).astype(np.float32)
    ssm_state[5] = ssm_state[2]  # the stopping run starts the continued prompt's head from its live state
    chunk_start, chunk_len, seq_chunks = gated_deltanet.chunk_layout(query_start, cuts=cuts)
    snapshot_chunk = np.where(cuts > 0, seq_chunks[:-1] + -(-cuts // gated_deltanet.CHUNK_SIZE), -1).astype(np.int32)
    snapped = np.flatnonzero(cuts > 0)
    head = [np.arange(seq_chunks[s], snapshot_chunk[s]) for s in snapped]
    directory = tmp_path
    binary = compile_harness(HARNESS, kernels, directory / "harness", {"DK": KEY_DIM})
    run_harness(binary, directory, nk, nv, VALUE_DIM, width, timeout=600,
                proj=proj, conv_weight=float32_to_bf16((0.4 * rng.standard_normal((conv_dim, width))).astype(np.float32)),
                conv_state=conv_state, ssm_state=ssm_state,
                neg_decay_rate=-np.exp(rng.uniform(np.log(0.05), np.log(4.0), nv)).astype(np.float32),
                dt_bias=bf16(0.5 * rng.standard_normal(nv)), query_start=query_start, slots=slots,
                fresh=fresh.astype(np.int32), token_seq=np.repeat(np.arange(len(lengths), dtype=np.int32), lengths),
                chunk_start=chunk_start, chunk_len=chunk_len, seq_chunks=seq_chunks,
                snapshot_chunk=snapshot_chunk, snapshot_slot=snapshot_slots,
                snapshots=np.stack([snapped, cuts[snapped], snapshot_slots[snapped]], 1).astype(np.int32),
                head_chunk_start=np.concatenate([chunk_start[h] for h in head]),
                head_chunk_len=np.concatenate([chunk_len[h] for h in head]),
                head_seq_chunks=np.concatenate([[0], np.cumsum([len(h) for h in head])]).astype(np.int32),
                head_slots=snapshot_slots[snapped], head_fresh=fresh[snapped].astype(np.int32))
    written, live = snapshot_slots[snapped], slots
    states = {}
    for walk in ("shared", "registers"):
        got = {run: read_array(directory, f"{walk}_{run}_ssm", np.float32, ssm_state.shape)
               for run in ("snapshot", "plain", "head")}
        np.testing.assert_array_equal(got["snapshot"][written], got["head"][written])
        np.testing.assert_array_equal(got["snapshot"][live], got["plain"][live])
        assert not np.array_equal(got["snapshot"][written], ssm_state[written])
        states[walk] = got["snapshot"]
    # the two walks: the same products, fp32 sums in another order
    np.testing.assert_allclose(states["registers"][written], states["shared"][written], rtol=1e-4, atol=1e-5)
    conv = np.fromfile(directory / "snapshot_conv_state.bin", np.uint16).reshape(conv_state.shape)
    for seq in snapped:
        old = np.zeros_like(conv_state[0]) if fresh[seq] else conv_state[slots[seq]]
        rows = proj[query_start[seq] : query_start[seq + 1], :conv_dim]
        np.testing.assert_array_equal(conv[snapshot_slots[seq]],
                                      np.concatenate([old, rows])[cuts[seq] : cuts[seq] + width - 1])
    untouched = np.setdiff1d(np.arange(len(conv)), written)
    np.testing.assert_array_equal(conv[untouched], conv_state[untouched])
