"""The Hopper short-query kernel (prefill_attention_sm90_short.cu through
attention.short_query_attention_sm90) against a float64 NumPy causal attention over the same paged
cache: warm-prefix tails of 16 tokens over 1k / 4k / 16k cached tokens at the Qwen3-4B heads (32
query, 8 KV, head_dim 128), ragged batches whose last 64-key tile or whole last split holds keys
only some tokens see, GQA 8 / 16 (several row groups), a group that does not divide 64 (padding
rows), MHA, split counts 1, 3, 7, 32 and the default, K/V rings of 2 to 6 stages, and tiles of
consecutive KV blocks in one TMA box (kv_runs, whole and broken runs), and clusters of 2-8 splits
combining their partials in the kernel. Cache slots past each sequence's last
key and the free blocks hold NaN bits, and the output is poisoned with NaN, so a V row that is not
zeroed or an unwritten output element shows. Also: the OPENINFER_SM90_SHORT_QUERY switch and the
routing through attend(), and (CPU, with nvcc) the source, and prefill_attention_sm90.cu's KV_RUNS
variants, build for sm_90a without spills."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from openinfer.backend.cuda.bf16 import bf16_bits_to_float, float_to_bf16_bits
from tests.gpu.conftest import BLOCK_SIZE, relative_error

KERNEL_DIR = Path(__file__).resolve().parents[2] / "core" / "kernels"
BF16_NAN = 0x7FC0

CASES = {
    # name: (num_heads, num_kv_heads, cached tokens per sequence, new tokens per sequence)
    "warm-tail-1k": (32, 8, [1008], [16]),
    "warm-tail-4k": (32, 8, [4080], [16]),
    "warm-tail-16k": (32, 8, [16368], [16]),
    "one-token-16k": (32, 8, [16383], [1]),
    # 16050 + 16 and 50 + 16: the last tile starts past token 0's last key (at 1 key per split, 50 + 16's
    # second split holds only keys of its last tokens, its third none); 37 + 5 and 59 + 9 end mid-tile
    "ragged-tails": (32, 8, [16050, 37, 2100, 59, 0, 50], [16, 5, 9, 9, 3, 16]),
    "gqa8-two-row-groups": (32, 4, [3000, 200], [16, 11]),
    "gqa16-row-groups": (16, 1, [3000, 200], [16, 11]),
    "gqa3-padding-rows": (6, 2, [900, 64], [16, 16]),
    "mha": (4, 4, [130, 0], [16, 7]),
}


def poisoned_caches(cupy, cuda_backend, batch, k_cache, v_cache):
    """The caches on the device with NaN bits in every slot no sequence owns: the free blocks and
    each sequence's last block past its last key."""
    k, v = cuda_backend.upload(k_cache), cuda_backend.upload(v_cache)
    tables = np.asarray(batch.block_tables)
    lengths = np.asarray(batch.context_lens)
    owned = np.zeros(k.shape[0], bool)
    for row, length in zip(tables, lengths, strict=True):
        blocks = -(-int(length) // BLOCK_SIZE)
        owned[row[:blocks]] = True
        if length % BLOCK_SIZE:
            for cache in (k, v):
                cache[int(row[blocks - 1]), int(length) % BLOCK_SIZE:] = BF16_NAN
    for cache in (k, v):
        cache[cupy.asarray(np.flatnonzero(~owned))] = BF16_NAN
    return k, v


@functools.cache
def problem(case: str) -> tuple:
    """The case's paged step and NumPy reference, made once for all its split counts."""
    from tests.gpu.test_prefill_attention import paged_problem

    num_heads, num_kv_heads, cached, new = CASES[case]
    return paged_problem(np.random.default_rng(zlib.crc32(case.encode())), 128, num_heads, num_kv_heads,
                         cached, new)


@pytest.fixture
def sm90(cuda_backend):
    cupy = pytest.importorskip("cupy")
    from openinfer.backend.cuda.attention import _compute_capability

    if _compute_capability(cupy.cuda.Device().id) != "90":
        pytest.skip("the sm90 short-query kernel needs a compute capability 9.0 GPU")
    return cupy


def run_case(cupy, cuda_backend, case, splits, stages=3, cluster=1):
    from openinfer.backend.cuda.attention import short_query_attention_sm90

    num_heads = CASES[case][0]
    batch, k_cache, v_cache, q, scale, expected = problem(case)
    device_batch = cuda_backend.prepare_batch(batch)
    k, v = poisoned_caches(cupy, cuda_backend, batch, k_cache, v_cache)
    out = cupy.full((batch.num_tokens, num_heads * 128), BF16_NAN, dtype=cupy.uint16)
    result = short_query_attention_sm90(cupy.asarray(float_to_bf16_bits(q)), k, v, device_batch.block_tables,
                                        device_batch.context_lens, device_batch.query_start, batch.max_query_len,
                                        scale, cuda_backend.num_sms, splits=splits, stages=stages, cluster=cluster,
                                        out=out)
    assert result is out
    return bf16_bits_to_float(cupy.asnumpy(out)), expected


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3, 7, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_sm90_short_query_matches_numpy(sm90, cuda_backend, case, splits):
    ours, expected = run_case(sm90, cuda_backend, case, splits)
    assert relative_error(ours, expected) < 1e-2
    rows = np.abs(ours - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-6)
    assert rows.max() < 0.1, int(rows.argmax())


@pytest.mark.gpu
@pytest.mark.parametrize(("cluster", "splits"), [(2, None), (4, 4), (8, None), (8, 8), (8, 32), (4, 3), (2, 1)])
@pytest.mark.parametrize("case", ["warm-tail-16k", "ragged-tails", "gqa16-row-groups", "gqa3-padding-rows"])
def test_sm90_short_query_split_clusters(sm90, cuda_backend, case, cluster, splits):
    """Clusters of splits combining in the kernel (DSMEM): a partial per cluster for the merge, or the
    output when one cluster holds every split; a cluster that does not divide the splits shrinks."""
    ours, expected = run_case(sm90, cuda_backend, case, splits, cluster=cluster)
    assert relative_error(ours, expected) < 1e-2
    rows = np.abs(ours - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-6)
    assert rows.max() < 0.1, int(rows.argmax())


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 4, 6])
@pytest.mark.parametrize("case", ["warm-tail-16k", "ragged-tails", "gqa16-row-groups"])
def test_sm90_short_query_ring_depths(sm90, cuda_backend, case, stages):
    """The K/V ring at 2 stages and at the one-CTA-per-SM depths (their default split count)."""
    ours, expected = run_case(sm90, cuda_backend, case, None, stages)
    assert relative_error(ours, expected) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("case", ["warm-tail-4k", "ragged-tails", "gqa16-row-groups"])
def test_sm90_short_query_kv_runs(sm90, cuda_backend, case, broken, splits):
    """kv_runs=True over consecutive blocks (a 64-key tile of them in one TMA box per column block),
    whole runs and runs broken inside two tiles (those tiles page by page)."""
    from openinfer.backend.base import ForwardBatch
    from openinfer.backend.cuda.attention import short_query_attention_sm90
    from tests.gpu.conftest import bf16_random
    from tests.gpu.test_prefill_attention import reference_attention, run_tables

    num_heads, num_kv_heads, cached, new = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()) + broken)
    tables = run_tables(cached, new, broken)
    batch = ForwardBatch.over_blocks(tables, cached, new, BLOCK_SIZE, np.zeros(sum(new)))
    shape = (int(tables.max()) + 2, BLOCK_SIZE, num_kv_heads, 128)
    k_cache, v_cache = bf16_random(rng, *shape), bf16_random(rng, *shape)
    q = bf16_random(rng, batch.num_tokens, num_heads, 128, scale=2.0)
    expected = reference_attention(q, k_cache, v_cache, batch, 128**-0.5)
    device_batch = cuda_backend.prepare_batch(batch)
    k, v = poisoned_caches(sm90, cuda_backend, batch, k_cache, v_cache)
    out = sm90.full((batch.num_tokens, num_heads * 128), BF16_NAN, dtype=sm90.uint16)
    short_query_attention_sm90(sm90.asarray(float_to_bf16_bits(q)), k, v, device_batch.block_tables,
                               device_batch.context_lens, device_batch.query_start, batch.max_query_len,
                               128**-0.5, cuda_backend.num_sms, splits=splits, kv_runs=True, out=out)
    ours = bf16_bits_to_float(sm90.asnumpy(out))
    assert relative_error(ours, expected) < 1e-2
    rows = np.abs(ours - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-6)
    assert rows.max() < 0.1, int(rows.argmax())


@pytest.mark.gpu
def test_sm90_short_query_equals_the_mma_kernel(sm90, cuda_backend):
    """Both short-query kernels agree closely (bf16 P rounding differs only in order)."""
    from openinfer.backend.cuda.decode_attention import short_query_attention_mma

    batch, k_cache, v_cache, q, scale, _ = problem("ragged-tails")
    device_batch = cuda_backend.prepare_batch(batch)
    k, v = poisoned_caches(sm90, cuda_backend, batch, k_cache, v_cache)
    reference = short_query_attention_mma(sm90.asarray(float_to_bf16_bits(q)), k, v, device_batch.block_tables,
                                          device_batch.context_lens, device_batch.query_start, batch.max_query_len,
                                          scale, cuda_backend.num_sms)
    ours, _ = run_case(sm90, cuda_backend, "ragged-tails", None)
    assert relative_error(ours, bf16_bits_to_float(sm90.asnumpy(reference))) < 1e-2


@pytest.mark.gpu
def test_the_switch_routes_short_steps(sm90, cuda_backend, monkeypatch):
    """OPENINFER_SM90_SHORT_QUERY=1: attend() runs a short step on the sm90 kernel (the launch is
    seen through a wrapper); =0 on decode_attention_mma.cu's."""
    from openinfer.backend.base import AttentionSpec, KVLayer
    from openinfer.backend.cuda import attention
    from openinfer.backend.cuda.attention_routing import SM90_SHORT_QUERY_ENV, wanted_sm90_short_query

    batch, k_cache, v_cache, q, scale, expected = problem("warm-tail-4k")
    device_batch = cuda_backend.prepare_batch(batch)
    k, v = poisoned_caches(sm90, cuda_backend, batch, k_cache, v_cache)
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, rope=None, scale=scale)
    calls = []
    real = attention.short_query_attention_sm90
    monkeypatch.setattr(attention, "short_query_attention_sm90", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for value, expect_calls in (("1", 1), ("0", 1)):
        monkeypatch.setenv(SM90_SHORT_QUERY_ENV, value)
        wanted_sm90_short_query.cache_clear()
        out = attention.attend(sm90.asarray(float_to_bf16_bits(q)), spec, KVLayer(k, v), device_batch,
                               cuda_backend.num_sms)
        assert len(calls) == expect_calls
        assert relative_error(bf16_bits_to_float(sm90.asnumpy(out)), expected) < 1e-2
    wanted_sm90_short_query.cache_clear()


def test_the_switch_and_row_groups_are_checked(monkeypatch):
    from openinfer.backend.cuda.attention_routing import (
        SM90_SHORT_QUERY_ENV,
        sm90_short_query_row_groups,
        wanted_sm90_short_query,
    )

    for value, wanted in (("1", True), ("0", False), (" 1 ", True)):
        monkeypatch.setenv(SM90_SHORT_QUERY_ENV, value)
        wanted_sm90_short_query.cache_clear()
        assert wanted_sm90_short_query() is wanted
    monkeypatch.setenv(SM90_SHORT_QUERY_ENV, "yes")
    wanted_sm90_short_query.cache_clear()
    with pytest.raises(ValueError, match=SM90_SHORT_QUERY_ENV):
        wanted_sm90_short_query()
    monkeypatch.delenv(SM90_SHORT_QUERY_ENV)
    wanted_sm90_short_query.cache_clear()
    assert wanted_sm90_short_query() is True  # the default since session 8's E1
    assert sm90_short_query_row_groups(16, 4) == 1  # Qwen3-4B: 16 tokens x 4 heads = one M=64 tile
    assert sm90_short_query_row_groups(16, 8) == 2
    assert sm90_short_query_row_groups(11, 16) == 3
    assert sm90_short_query_row_groups(16, 3) == 1  # 21 tokens x 3 heads, one padding row
    for bad in ((0, 4), (16, 0), (16, 65)):
        with pytest.raises(ValueError):
            sm90_short_query_row_groups(*bad)


SM90A_BUILDS = [("prefill_attention_sm90_short.cu", {"GROUP": group, "SQ90_STAGES": stages, "SQ90_RUNS": runs})
                for group, stages, runs in ((1, 3, 0), (3, 3, 0), (4, 3, 0), (16, 3, 1), (4, 3, 1), (4, 6, 1))]
SM90A_BUILDS += [("prefill_attention_sm90_short.cu", {"GROUP": group, "SQ90_CLUSTER": cluster, "SQ90_RUNS": 1})
                 for group, cluster in ((4, 2), (4, 8), (3, 4))]
# prefill_attention_sm90.cu's K/V runs (OPENINFER_SM90_KV_RUNS) over the default consumer loop, persistent
# CTAs with split K/V barriers, head pairs, and head_dim 256; with Q in registers (OPENINFER_SM90_Q_REGISTERS)
_LEAN = {"DESCRIPTOR_ADDS": 1, "SKIP_UNIT_RESCALE": 1, "ORDERED_SOFTMAX": 1, "RESCALE_SLACK": 1, "PAGE_ID_PREFETCH": 1}
SM90A_BUILDS += [("prefill_attention_sm90.cu", {"TMA_KV_LOADS": 1, "KV_RUNS": 1, **extra})
                 for extra in ({**_LEAN, "KV_HEAD_MAJOR_GRID": 1}, {"PERSISTENT": 1, "SPLIT_KV": 1},
                               {**_LEAN, "HEAD_PAIRS": 1}, {"HEAD_DIM": 256, "STAGES": 2},
                               {**_LEAN, "KV_HEAD_MAJOR_GRID": 1, "Q_REGISTERS": 1},
                               {**_LEAN, "PERSISTENT": 1, "HEAD_PAIRS": 1, "Q_REGISTERS": 1},
                               {"KV_HEAD_MAJOR_GRID": 1, "KV_MULTICAST": 1, "SPLIT_KV": 1, "Q_REGISTERS": 1})]


@pytest.mark.parametrize(("source", "defines"), SM90A_BUILDS,
                         ids=[f"{s.split('.')[0]}-" + "-".join(f"{k}{v}" for k, v in d.items()) for s, d in SM90A_BUILDS])
def test_the_sources_build_for_sm90a_without_spills(source, defines, tmp_path):
    """ptxas on the sm_90a builds (CPU CI's test_cuda_sources builds this short-query source for
    plain sm_90, where its body is empty): no local-memory spills at the register caps."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    result = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}",
                             *(f"-D{k}={v}" for k, v in defines.items()), "-Xptxas", "-v", "-cubin",
                             "-o", str(tmp_path / "out.cubin"), str(KERNEL_DIR / source)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    spills = re.findall(r"(\d+) bytes spill stores", result.stderr)
    assert spills and all(int(s) == 0 for s in spills), result.stderr


def test_run_boxes_span_whole_pages():
    """tensor_maps.page_box_layout's box_tokens (KV_RUNS / SQ90_RUNS maps): whole pages, at most 256."""
    from openinfer.backend.cuda.tensor_maps import page_box_layout

    shape = (100, BLOCK_SIZE, 8, 128)
    strides = tuple(int(s) for s in np.empty(shape, np.uint16).strides)
    assert page_box_layout(shape, strides, 2).box == (64, 1, BLOCK_SIZE)
    assert page_box_layout(shape, strides, 2, box_tokens=128).box == (64, 1, 128)
    assert page_box_layout(shape, strides, 2, box_tokens=64).dims == page_box_layout(shape, strides, 2).dims
    for bad in (24, 0, 512):
        with pytest.raises(ValueError, match="whole pages"):
            page_box_layout(shape, strides, 2, box_tokens=bad)


Q_REGISTER_BUILDS = [{**_LEAN, "KV_HEAD_MAJOR_GRID": 1, "BATCHED_PAGE_READS": 1, "PINGPONG": 1, "Q_REGISTERS": 1,
                      "PERSISTENT": persistent, "TMA_KV_LOADS": tma, "KV_RUNS": tma, "HEAD_PAIRS": pairs}
                     for persistent in (0, 1) for tma in (0, 1) for pairs in (0, 1)]


@pytest.mark.parametrize("defines", Q_REGISTER_BUILDS, ids=lambda d: f"persistent{d['PERSISTENT']}-tma{d['TMA_KV_LOADS']}"
                         f"-pairs{d['HEAD_PAIRS']}")
def test_q_fragment_registers_stay_q(defines, tmp_path):
    """SASS of prefill_attention_sm90.cu with Q_REGISTERS: the registers Q K^T's HGMMAs read as A are
    written only by the shared-memory loads of Q (and the address each load then overwrites), never
    by the softmax or P (without the overlapped loop ptxas did exactly that: E1's failing tests)."""
    nvcc, cuobjdump = shutil.which("nvcc"), shutil.which("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("nvcc and cuobjdump needed")
    cubin = tmp_path / "out.cubin"
    subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}",
                    *(f"-D{k}={v}" for k, v in defines.items()), "-cubin", "-o", str(cubin),
                    str(KERNEL_DIR / "prefill_attention_sm90.cu")], check=True, capture_output=True, timeout=300)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in sass.splitlines()]

    def destination(line):
        m = re.match(r"^(?:@!?U?P\w+ )?([A-Z][A-Z0-9._]*) R(\d+)\b", line)
        return (m.group(1), int(m.group(2))) if m else ("", -1)

    q_regs = {int(m.group(1)) + i for line in lines if "HGMMA" in line and "tnspB" not in line
              for m in [re.search(r"HGMMA\S* R\d+, R(\d+),", line)] for i in range(4)}
    p_regs = {int(m.group(1)) + i for line in lines if "HGMMA" in line and "tnspB" in line
              for m in [re.search(r"HGMMA\S* R\d+, R(\d+),", line)] for i in range(4)}
    assert len(q_regs) == 32 and not q_regs & p_regs
    for i, line in enumerate(lines):
        op, reg = destination(line)
        if reg not in q_regs or op.startswith(("LDS", "HGMMA", "ST", "BAR", "ISETP", "FSETP", "WARP")):
            continue
        following = next((m for m in lines[i + 1:] if re.search(rf"\bR{reg}\b", m)), "")
        assert destination(following) == ("LDS", reg) or destination(following)[0].startswith("LDS") and \
            destination(following)[1] == reg, f"{line} overwrites Q fragment register R{reg}"
