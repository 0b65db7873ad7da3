"""INT4 expert weights repacked for the decode GEMVs (core/quant.py ``tile_int4``: the tiled and the lane-groups
layouts, moe.cu INT4_TILED 1 / 2) on the GPU, one parametrised set of tests per layout: every INT4 kernel gives
the bits it gives on the checkpoint layout (the same products in the same order; the layout's own GEMVs within
fp32 rounding), and the dequantized NumPy product; then the fused and decode-shaped forms (SiLU·mul, row
blocks) and gemv.cu's opt-in one-row GEMVs."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer import bf16_to_float32, float32_to_bf16
from openinfer.quant import dequantize_int4_group, quantize_int4_group, untile_int4
from tests.gpu.conftest import bf16_random, relative_error
from tests.gpu.test_moe_grouped import _replayed  # a CUDA-graph replay on a stream of its own

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2


def _int4_experts(rng, num_experts: int, out_features: int, in_features: int, layout: str = "rows"):
    """(device ExpertLinear in ``layout``, fp32 dequantized [E, N, K]); group 32."""
    from openinfer.backend.cuda import moe  # callers took the cuda_moe fixture (its GPU check)

    dense = [bf16_random(rng, out_features, in_features, scale=0.05) for _ in range(num_experts)]
    packed = [quantize_int4_group(w, 32) for w in dense]
    scales = [float32_to_bf16(s) for _, s in packed]
    reference = np.stack([dequantize_int4_group(p, (s.astype(np.uint32) << 16).view(np.float32),
                                                (out_features, in_features)) for (p, _), s in zip(packed, scales,
                                                                                                 strict=True)])
    weight = moe.upload_expert_linear("int4", np.stack([p for p, _ in packed]), np.stack(scales),
                                      (out_features, in_features), group=32, layout=layout)
    return weight, reference


GROUPED_KERNELS = [False, "moe_gemv", "wide", "wide_nc", "mma", "mma_nc", "mma_staged_nc", "mma_depth3", "mma_depth4", "mma_depth8", "mma_split2",
                   "mma_split4", "mma_split4_depth3", "mma1_split4", "mma_staged", "tiled", "tiled_depth6", "tiled1",
                   "tiled1_depth6", "tiled_nc", "tiled_s6", "tiled_s8", "tiled1_s6", "tiled1_nc_rot", "tiled_s6_rot",
                   "tiled1_nc_rot_d6", "tiled1_nc_rot_d6_rb2", "tiled2_nc_rot"]


LANE_GROUPS_KERNELS = [False, None, "moe_gemv", "wide", "mma", "mma_staged", "tiled1_nc_rot", "groups", "groups_d2",
                       "groups_norot_acc2", "groups_acc2", "groups_norot_acc4",
                       "groups_d6", "groups_p2", "groups_norot", "groups_s8", "groups_s8_norot", "groups_s6",
                       "groups_s8_k2", "groups_s8_p2", "groups_s8_p4", "groups_xs", "groups_xs_d2", "groups_xs1",
                       "groups_xs_rs"]


def _kernel_id(kernel) -> str:
    return "tiles" if kernel is False else "auto" if kernel is None else kernel


# (layout, decode GEMV forced or False: the per-tile GEMM, None: what the tables pick) per repacked INT4 layout
LAYOUT_EXPERT_KERNELS = [("tiled", k) for k in GROUPED_KERNELS] + [("lane_groups", k) for k in LANE_GROUPS_KERNELS]


@pytest.mark.parametrize("layout,gemv_kernel", LAYOUT_EXPERT_KERNELS,
                         ids=[f"{layout}-{_kernel_id(k)}" for layout, k in LAYOUT_EXPERT_KERNELS])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_repacked_experts_equal_checkpoint_layout(cuda_backend, cuda_moe, rng, layout, gemv_kernel, tokens):
    """Grouped over moe_sort's tiles (ragged: an idle expert, 1-2 rows per expert at 1 and 5 tokens, a 40-row
    tile at 40): weights repacked into ``layout`` (tiled, lane-groups) give the checkpoint layout's bits by the
    per-tile GEMM and every GEMV that reads them a word or 16 bytes at a time (moe_gemv_mma_staged, which reads
    checkpoint rows, and another layout's GEMVs run moe_gemv_mma there); the layout's own GEMVs
    (LAYOUT_GEMVS: moe_gemv_int4_tiled, moe_gemv_int4_groups, and what "auto" runs within LANE_GROUPS_CHOICE)
    apply the scales after the mma: fp32 rounding apart. N = 96 (six 16-row blocks: a block's last warps past
    N), K = 1152 (nine 128-weight chunks: the rings wrap); and the dequantized NumPy product."""
    from openinfer.backend.cuda import moe_routing
    moe = cuda_moe
    num_experts, top_k, out_features, in_features = 8, 2, 96, 1152
    rows_weight, reference = _int4_experts(rng, num_experts, out_features, in_features)
    repacked = moe.tiled_int4(rows_weight, layout)
    assert repacked.layout == layout and repacked.data.shape == (num_experts, 6, 9, 256)
    x = bf16_random(rng, tokens, in_features)
    ids = rng.choice([0, 2, 3, 4, 5, 6, 7], (tokens, top_k)).astype(np.int32)  # expert 1 idle
    if tokens == 40:
        ids[:, 0] = 2
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), num_experts)
    gemv = gemv_kernel is not False
    kernel = gemv_kernel or None
    outs = [cuda_backend.to_host(moe.grouped_gemm(cuda_backend.upload(x), weight, grouping, gather=True, gemv=gemv,
                                                  gemv_kernel=kernel)) for weight in (rows_weight, repacked)]
    per_expert = tokens * top_k / num_experts
    ran = gemv_kernel if gemv_kernel else moe.layout_gemv(repacked, moe.gemv_for(per_expert, True, "int4"), None,
                                                          per_expert, one_token=tokens == 1) if gemv else None
    if ran in moe.LAYOUT_GEMVS[layout]:
        assert relative_error(outs[1], outs[0]) < 5e-3
    else:
        assert np.array_equal(outs[1], outs[0])
    slots = cupy.asnumpy(grouping.sorted_slots)
    expected = np.stack([x[s // top_k] @ reference[ids.reshape(-1)[s]].T for s in slots])
    assert relative_error(outs[1], expected) < BF16_TOL


# (layout, method, GEMV) of the dense INT4 linear per repacked layout
LAYOUT_DENSE_METHODS = [("tiled", m, k) for m, k in (
    ("gemv", "moe_gemv"), ("gemv", "wide"), ("gemv", "mma"), ("gemv", "mma_depth4"), ("dequantize", None),
    ("tiles", None), ("gemv", "tiled"), ("gemv", None), (None, None))] + [("lane_groups", m, k) for m, k in (
    ("gemv", "groups"), ("gemv", "groups_p2"), ("gemv", "mma"), ("dequantize", None), ("tiles", None),
    ("gemv", None), (None, None))]


@pytest.mark.parametrize("layout,method,gemv_kernel", LAYOUT_DENSE_METHODS,
                         ids=[f"{layout}-{m}-{k}" for layout, m, k in LAYOUT_DENSE_METHODS])
@pytest.mark.parametrize("rows", [1, 2, 9, 20])
def test_repacked_dense_linear_equals_checkpoint_layout(cuda_backend, cuda_moe, rng, layout, method, gemv_kernel, rows):
    """A dense INT4 linear (E = 1) repacked into ``layout``: the checkpoint layout's bits by every method, the
    layout's own GEMV (moe_gemv_int4_tiled / moe_gemv_int4_groups: passes of 2 or 4 rows, a lone last row at 9)
    within fp32 rounding of moe_gemv_mma; the dequantized product; moe_dequantize gives the same bf16 weight."""
    moe = cuda_moe
    weight, reference = _int4_experts(rng, 1, 256, 512)
    repacked = moe.tiled_int4(weight, layout)
    x = cuda_backend.upload(bf16_random(rng, rows, 512))
    outs = [cuda_backend.to_host(moe.quantized_linear(x, w, cuda_backend.blas, method, gemv_kernel=gemv_kernel))
            for w in (weight, repacked)]
    chosen = moe.choose_gemv(rows, False, "int4") if method is None else "moe_gemv" if method == "gemv" else None
    ran = gemv_kernel if method == "gemv" and gemv_kernel else moe.layout_gemv(repacked, chosen, None, rows)
    if ran in moe.LAYOUT_GEMVS[layout]:
        assert relative_error(outs[1], outs[0]) < 5e-3
    else:
        assert np.array_equal(outs[1], outs[0])
    assert relative_error(outs[1], cuda_backend.to_host(x) @ reference[0].T) < BF16_TOL
    assert np.array_equal(cupy.asnumpy(moe.dequantize(repacked)), cupy.asnumpy(moe.dequantize(weight)))


@pytest.mark.parametrize("layout", ["tiled", "lane_groups"])
def test_int4_layout_switch(cuda_moe, rng, monkeypatch, layout):
    """$OPENINFER_INT4_LAYOUT=``layout`` repacks INT4 uploads that fit (group 32, N % 16, K % 128), the rest stay
    as stored (N = 40, K = 224: not whole 16-row blocks / 128-weight chunks); unset, uploads take
    DEFAULT_INT4_LAYOUT; the device repack is tile_int4's (untile_int4 gives the checkpoint arrays back); a
    repacked weight is not repacked again; an unknown layout is a clear error."""
    moe = cuda_moe
    monkeypatch.setenv(moe.INT4_LAYOUT_ENV, layout)
    fits, _ = _int4_experts(rng, 2, 64, 256, layout=None)
    assert fits.layout == layout
    assert _int4_experts(rng, 2, 40, 256, layout=None)[0].layout == "rows"
    assert _int4_experts(rng, 2, 64, 224, layout=None)[0].layout == "rows"
    monkeypatch.delenv(moe.INT4_LAYOUT_ENV)
    assert _int4_experts(rng, 1, 64, 256, layout=None)[0].layout == moe.DEFAULT_INT4_LAYOUT
    stored, _ = _int4_experts(rng, 2, 64, 256, layout="rows")
    assert stored.layout == "rows"
    repacked = moe.tiled_int4(stored, layout)
    words, scales = untile_int4(cupy.asnumpy(repacked.data), cupy.asnumpy(repacked.scale), 64, 256,
                                lane_groups=layout == "lane_groups")
    assert np.array_equal(words, cupy.asnumpy(stored.data)) and np.array_equal(scales, cupy.asnumpy(stored.scale))
    assert moe.tiled_int4(repacked, layout) is repacked and moe.tiled_int4(stored, "rows") is stored
    monkeypatch.setenv(moe.INT4_LAYOUT_ENV, "columns")
    with pytest.raises(ValueError, match="unknown INT4 layout"):
        _int4_experts(rng, 1, 64, 256, layout=None)
    with pytest.raises(ValueError, match="unknown INT4 layout"):
        moe.tiled_int4(stored, "columns")


def test_lane_groups_one_token_choice_and_shared_memory(cuda_moe, rng, monkeypatch):
    """LANE_GROUPS_ONE_TOKEN runs a one-token grouped step (every tile one row) ahead of LANE_GROUPS_CHOICE, and only
    there (LANE_GROUPS_ONE_TOKEN_FUSED, where set, the fused SiLU·mul gate_up); a forced kernel wins; groups_shared_bytes sizes GROUPS_XSMEM's staged rows and the shared-memory ring, and
    says clearly when a block cannot hold them."""
    from openinfer.backend.cuda import moe_routing
    moe = cuda_moe
    weight = moe.tiled_int4(_int4_experts(rng, 4, 64, 256)[0], "lane_groups")
    monkeypatch.delenv(moe.GEMV_KERNEL_ENV, raising=False)
    monkeypatch.setattr(moe, "LANE_GROUPS_ONE_TOKEN", None)
    table = moe.layout_gemv(weight, "mma_staged", None, 0.02)
    assert moe.layout_gemv(weight, "mma_staged", None, 0.02, one_token=True) == table  # None: the table's
    monkeypatch.setattr(moe, "LANE_GROUPS_ONE_TOKEN", "groups_xs1")
    assert moe.layout_gemv(weight, "mma_staged", None, 0.02, one_token=True) == "groups_xs1"
    assert moe.layout_gemv(weight, "mma_staged", None, 0.04) == table
    # a forced kernel (the name choose_gemv hands over) runs as it is
    assert moe.layout_gemv(weight, "groups_norot", "groups_norot", 0.02, one_token=True) == "groups_norot"
    x = cupy.asarray(float32_to_bf16(rng.standard_normal((1, 256)).astype(np.float32)))
    one = moe_routing.group_by_expert(cupy.asarray(np.array([[0, 2]], np.int32)), cupy.ones((1, 2), cupy.float32), 4)
    two = moe_routing.group_by_expert(cupy.asarray(np.array([[0, 2], [0, 1]], np.int32)), cupy.ones((2, 2), cupy.float32), 4)
    monkeypatch.setenv(moe.GEMV_SILU_ENV, "1")
    assert moe.gemv_silu_kernel(x, weight, one) == "groups_xs1"
    monkeypatch.setattr(moe, "LANE_GROUPS_ONE_TOKEN_FUSED", "groups_xs_d2")  # the fused gate_up's own
    assert moe.gemv_silu_kernel(x, weight, one) == "groups_xs_d2"
    assert moe.layout_gemv(weight, "mma_staged", None, 0.02, one_token=True) == "groups_xs1"
    assert moe.gemv_silu_kernel(cupy.concatenate([x, x]), weight, two) != "groups_xs1"
    assert moe.groups_shared_bytes({"GROUPS_XSMEM": 1}, 7168) == (0, (4 * 56 + 1) * 80)
    assert moe.groups_shared_bytes({"GROUPS_XSMEM": 2}, 2048) == (0, (8 * 16 + 1) * 80)
    assert moe.groups_shared_bytes({"GROUPS_STAGES": 8, "GROUPS_KSPLIT": 2}, 2048) == (4 * 8 * 1280 + 2048, 0)
    with pytest.raises(ValueError, match="shared memory"):
        moe.groups_shared_bytes({"GROUPS_XSMEM": 2}, 128 * 400)


@pytest.mark.parametrize("after_route", ["0", "1"])
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_shared_overlap_equals_inline(cuda_backend, cuda_moe, rng, monkeypatch, tokens, after_route):
    """$OPENINFER_MOE_SHARED_OVERLAP=1 (unset: up to SHARED_OVERLAP_MAX_TOKENS tokens): moe_forward runs
    the shared expert on a side stream beside the routed ones (OPENINFER_MOE_SHARED_AFTER_ROUTE=1: forked after
    the routing); the same kernels on the same inputs give the same bits as inline, eagerly and replayed from a
    CUDA graph captured across both streams."""
    from openinfer.moe import RouterSpec

    moe = cuda_moe
    hidden, inter, experts = 256, 128, 16
    gate_up, _ = _int4_experts(rng, experts, 2 * inter, hidden)
    down, _ = _int4_experts(rng, experts, hidden, inter)
    layer = moe.DeviceMoE(RouterSpec(experts, 4, "sigmoid", routed_scaling_factor=2.5),
                          cuda_backend.weight(bf16_random(rng, experts, hidden, scale=0.1)),
                          cupy.zeros(experts, cupy.float32), gate_up, down)
    shared_up = cuda_backend.linear_weight(bf16_random(rng, 2 * inter, hidden, scale=0.05))
    shared_down = cuda_backend.linear_weight(bf16_random(rng, hidden, inter, scale=0.05))
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))

    def shared_experts(h):
        return cuda_backend.silu_mul_linear(cuda_backend.linear(h, shared_up), shared_down)

    def step():
        return moe.moe_forward(cuda_backend, x, layer, shared_experts=shared_experts)

    monkeypatch.setenv(moe.SHARED_AFTER_ROUTE_ENV, after_route)
    monkeypatch.setenv(moe.SHARED_OVERLAP_ENV, "0")
    inline = cuda_backend.to_host(step())
    assert np.array_equal(inline, cuda_backend.to_host(moe.moe_forward(cuda_backend, x, layer,
                                                                        shared_experts(x))))
    monkeypatch.setenv(moe.SHARED_OVERLAP_ENV, "maybe")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        moe.shared_overlap(1)
    monkeypatch.setenv(moe.SHARED_OVERLAP_ENV, "0")
    assert not moe.shared_overlap(1) and np.array_equal(cuda_backend.to_host(step()), inline)
    monkeypatch.setenv(moe.SHARED_OVERLAP_ENV, "1")
    assert moe.shared_overlap(10**6)
    assert np.array_equal(cuda_backend.to_host(step()), inline)
    monkeypatch.delenv(moe.SHARED_OVERLAP_ENV)
    assert moe.shared_overlap(moe.SHARED_OVERLAP_MAX_TOKENS) and not moe.shared_overlap(moe.SHARED_OVERLAP_MAX_TOKENS + 1)
    assert np.array_equal(cuda_backend.to_host(step()), inline)
    monkeypatch.setenv(moe.SHARED_OVERLAP_ENV, "1")
    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(pool.malloc), stream:
        step()
        stream.synchronize()
        stream.begin_capture()
        try:
            out = step()
        finally:
            graph = stream.end_capture()
        out[...] = 0
        graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(cuda_backend.to_host(out), inline)  # both as float (to_host converts bf16)


@pytest.mark.parametrize("gemv_kernel", ["tiled1_nc_rot", "tiled1_nc_rot_d6", "tiled"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_gate_up_silu_gemv_equals_unfused(cuda_backend, cuda_moe, rng, monkeypatch, gemv_kernel, tokens):
    """OPENINFER_MOE_GEMV_SILU=1: the tiled decode GEMV with SiLU·mul fused (each warp its 16 gate rows, then
    the 16 up rows) gives the bits of the same GEMV then elementwise silu_mul; I = 48 (three 16-row blocks
    per half: a block's last warp past I), K = 1152 (nine chunks: the ring wraps across the gate/up seam);
    routed_experts takes it where the switch is on and the step's GEMV is a register-ring tiled one."""
    from openinfer.backend.cuda import moe_routing
    moe = cuda_moe
    num_experts, top_k, inter, hidden = 8, 2, 48, 1152
    gate_up = moe.tiled_int4(_int4_experts(rng, num_experts, 2 * inter, hidden)[0])
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
    ids = rng.choice([0, 2, 3, 4, 5, 6, 7], (tokens, top_k)).astype(np.int32)
    if tokens == 40:
        ids[:, 0] = 2
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), num_experts)
    unfused = cuda_backend.silu_mul(moe.grouped_gemm(x, gate_up, grouping, gather=True, gemv=True,
                                                     gemv_kernel=gemv_kernel))
    fused = moe.gate_up_silu_gemv(x, gate_up, grouping, gemv_kernel)
    assert fused.shape == (tokens * top_k, inter)
    assert np.array_equal(cupy.asnumpy(fused), cupy.asnumpy(unfused))
    monkeypatch.setenv(moe.GEMV_KERNEL_ENV, gemv_kernel)
    assert moe.gemv_silu_kernel(x, gate_up, grouping) is None  # unset: the tiled form only when asked for
    monkeypatch.setenv(moe.GEMV_SILU_ENV, "1")
    assert moe.gemv_silu_kernel(x, gate_up, grouping) == gemv_kernel
    monkeypatch.setenv(moe.GEMV_KERNEL_ENV, "tiled_s6")  # the shared-memory ring: no fused form
    assert moe.gemv_silu_kernel(x, gate_up, grouping) is None
    monkeypatch.setenv(moe.GEMV_KERNEL_ENV, "tiled2_nc_rot")  # the pair kernel: no fused form either
    assert moe.gemv_silu_kernel(x, gate_up, grouping) is None
    with pytest.raises(ValueError, match="no fused"):
        moe.gate_up_silu_gemv(x, gate_up, grouping, "tiled2_nc_rot")


@pytest.mark.parametrize("gemv_kernel", ["wide", "wide_nc", "wide2", "wide8_r1_nc"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_wide_gate_up_silu_equals_unfused(cuda_backend, cuda_moe, rng, monkeypatch, gemv_kernel, tokens):
    """OPENINFER_MOE_GEMV_SILU=1 on bf16 experts (Moonlight's decode GEMV, moe_gemv_wide): each warp's columns
    half gate, half up, SiLU·mul in its epilogue; the bits of the same GEMV then silu_mul. I = 42 (a warp
    past I), H = 264 (a partial last pass); gemv_silu_kernel names the step's wide GEMV (unset: the table's)."""
    from openinfer.backend.cuda import moe_routing
    moe = cuda_moe
    num_experts, top_k, inter, hidden = 8, 2, 42, 264
    gate_up = moe.upload_expert_linear("bf16", float32_to_bf16(bf16_random(rng, num_experts, 2 * inter, hidden,
                                                                           scale=0.05)), None, (2 * inter, hidden))
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
    ids = rng.choice([0, 2, 3, 4, 5, 6, 7], (tokens, top_k)).astype(np.int32)
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), num_experts)
    unfused = cuda_backend.silu_mul(moe.grouped_gemm(x, gate_up, grouping, gather=True, gemv=True,
                                                     gemv_kernel=gemv_kernel))
    fused = moe.gate_up_silu_gemv(x, gate_up, grouping, gemv_kernel)
    assert fused.shape == (tokens * top_k, inter)
    assert np.array_equal(cupy.asnumpy(fused), cupy.asnumpy(unfused))
    monkeypatch.setenv(moe.GEMV_SILU_ENV, "1")
    if tokens == 1:  # 0.25 slots per expert: the table's bf16 GEMV
        assert moe.gemv_silu_kernel(x, gate_up, grouping) == moe.choose_gemv(0.25, True, "bf16")
    monkeypatch.setenv(moe.GEMV_KERNEL_ENV, gemv_kernel)
    # a forced GEMV runs only within its row limit (40 tokens: 10 slots per expert, past it: a GEMM)
    within_limit = tokens * top_k / num_experts <= moe.GEMV_ROW_LIMITS[gemv_kernel][1]
    assert moe.gemv_silu_kernel(x, gate_up, grouping) == (gemv_kernel if within_limit else None)
    monkeypatch.setenv(moe.GEMV_KERNEL_ENV, "mma")  # no fused form
    assert moe.gemv_silu_kernel(x, gate_up, grouping) is None


# --- the lane-groups layout (tile_int4(lane_groups=True), moe.cu INT4_TILED 2) and moe_int4.cu's GEMV ---


@pytest.mark.parametrize("gemv_kernel", [None, "groups_norot", "groups_xs", "groups_xs_rs"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 64])
def test_lane_groups_moe_forward_equals_rows(cuda_backend, cuda_moe, rng, monkeypatch, tokens, gemv_kernel):
    """moe_forward (routing, gate_up GEMV, SiLU·mul, down GEMV, weighted combine) with lane-groups experts:
    within bf16 rounding of the checkpoint layout's block (1-3 tokens: moe_gemv_int4_groups; 64: past
    LANE_GROUPS_CHOICE, the table's kernel; ``gemv_kernel``: that one forced), and a CUDA-graph
    replay gives the eager bits."""
    from openinfer.moe import RouterSpec

    moe = cuda_moe
    if gemv_kernel is not None:
        monkeypatch.setenv(moe.GEMV_KERNEL_ENV, gemv_kernel)
    hidden, inter, experts = 256, 128, 16
    gate_up, _ = _int4_experts(rng, experts, 2 * inter, hidden)
    down, _ = _int4_experts(rng, experts, hidden, inter)
    gate = cuda_backend.weight(bf16_random(rng, experts, hidden, scale=0.1))
    spec = RouterSpec(experts, 4, "sigmoid", routed_scaling_factor=2.5)
    rows = moe.DeviceMoE(spec, gate, cupy.zeros(experts, cupy.float32), gate_up, down)
    groups = moe.DeviceMoE(spec, gate, cupy.zeros(experts, cupy.float32), moe.tiled_int4(gate_up, "lane_groups"),
                           moe.tiled_int4(down, "lane_groups"))
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
    want = cuda_backend.to_host(moe.moe_forward(cuda_backend, x, rows))
    eager = cuda_backend.to_host(moe.moe_forward(cuda_backend, x, groups))
    assert relative_error(eager, want) < 1e-2  # two GEMVs' bf16 roundings apart, compounded by SiLU·mul
    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(pool.malloc), stream:
        moe.moe_forward(cuda_backend, x, groups)
        stream.synchronize()
        stream.begin_capture()
        try:
            out = moe.moe_forward(cuda_backend, x, groups)
        finally:
            graph = stream.end_capture()
        out[...] = 0
        graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(cuda_backend.to_host(out), eager)


@pytest.mark.parametrize("gemv_kernel", ["groups", "groups_d2", "groups_d6", "groups_norot", "groups_s8", "groups_s8_k2",
                                         "groups_xs", "groups_xs_d2", "groups_xs1", "groups_xs_rs"])
@pytest.mark.parametrize("tokens", [1, 2, 40])
def test_lane_groups_gate_up_silu_equals_unfused(cuda_backend, cuda_moe, rng, monkeypatch, gemv_kernel, tokens):
    """OPENINFER_MOE_GEMV_SILU=1 with lane-groups gate_up: moe_gemv_int4_groups with SiLU·mul fused (each warp
    8 gate rows and their 8 up rows, one walk of K) against the same GEMV then elementwise silu_mul, and against
    the NumPy composition; I = 40 (a block's last warp past I, gate and up rows in different 16-row blocks),
    K = 1152 (nine chunks: the ring wraps). routed_experts takes it unset up to LANE_GROUPS_SILU_MAX_SLOTS slots per
    expert, with =1 at any size, never with =0."""
    from openinfer.backend.cuda import moe_routing
    moe = cuda_moe
    num_experts, top_k, inter, hidden = 8, 2, 40, 1152
    rows_weight, reference = _int4_experts(rng, num_experts, 2 * inter, hidden)
    gate_up = moe.tiled_int4(rows_weight, "lane_groups")
    x_host = bf16_random(rng, tokens, hidden)
    x = cuda_backend.upload(x_host)
    ids = rng.choice([0, 2, 3, 4, 5, 6, 7], (tokens, top_k)).astype(np.int32)
    if tokens == 40:
        ids[:, 0] = 2
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), num_experts)
    unfused = cuda_backend.silu_mul(moe.grouped_gemm(x, gate_up, grouping, gather=True, gemv=True,
                                                     gemv_kernel=gemv_kernel))
    fused = moe.gate_up_silu_gemv(x, gate_up, grouping, gemv_kernel)
    assert fused.shape == (tokens * top_k, inter)
    got = cuda_backend.to_host(fused)
    assert relative_error(got, cuda_backend.to_host(unfused)) < 5e-3
    slots = cupy.asnumpy(grouping.sorted_slots)
    h = np.stack([x_host[s // top_k] @ reference[ids.reshape(-1)[s]].T for s in slots])
    gate, up = h[:, :inter], h[:, inter:]
    assert relative_error(got, gate / (1 + np.exp(-gate)) * up) < BF16_TOL
    monkeypatch.setenv(moe.GEMV_KERNEL_ENV, gemv_kernel)
    # unset: fused up to LANE_GROUPS_SILU_MAX_SLOTS slots per expert (1 / 2 tokens x top-2 of 8: 0.25 / 0.5), not at 40
    unset_wanted = tokens * top_k / num_experts <= moe.LANE_GROUPS_SILU_MAX_SLOTS
    assert moe.gemv_silu_kernel(x, gate_up, grouping) == (gemv_kernel if unset_wanted else None)
    monkeypatch.setenv(moe.GEMV_SILU_ENV, "0")
    assert moe.gemv_silu_kernel(x, gate_up, grouping) is None
    monkeypatch.setenv(moe.GEMV_SILU_ENV, "1")
    assert moe.gemv_silu_kernel(x, gate_up, grouping) == gemv_kernel
    with pytest.raises(ValueError, match="lane-groups"):
        moe.gate_up_silu_gemv(x, rows_weight, grouping, gemv_kernel)


@pytest.mark.parametrize("row_blocks", ["2", "3", "auto"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_lane_groups_row_blocks_equal_one(cuda_backend, cuda_moe, rng, monkeypatch, row_blocks, tokens):
    """OPENINFER_INT4_ROW_BLOCKS (moe_int4.cu GROUPS_ROW_BLOCKS: each block several column blocks in turn, the
    grid narrower): the bits of one column block per block (the same sums per row), N = 1040 (17 blocks of 64
    columns, a last block past N); "auto" picks by waves: Kimi-K2's batch-1 down (112 x 9 blocks) twice, its
    gate_up (64 x 9) and any prefill-sized grid once; a bad value is a clear error."""
    from openinfer.backend.cuda import moe_routing
    moe = cuda_moe
    num_experts, top_k, out_features, in_features = 8, 4, 1040, 256
    weight = moe.tiled_int4(_int4_experts(rng, num_experts, out_features, in_features)[0], "lane_groups")
    x = cuda_backend.upload(bf16_random(rng, tokens, in_features))
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), num_experts)
    monkeypatch.delenv(moe.INT4_ROW_BLOCKS_ENV, raising=False)
    one = cupy.asnumpy(moe.grouped_gemm(x, weight, grouping, gather=True, gemv=True, gemv_kernel="groups_norot"))
    monkeypatch.setenv(moe.INT4_ROW_BLOCKS_ENV, row_blocks)
    several = cupy.asnumpy(moe.grouped_gemm(x, weight, grouping, gather=True, gemv=True, gemv_kernel="groups_norot"))
    assert np.array_equal(several, one)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    assert moe.int4_row_blocks(112, 9, 4, "auto") == (2 if sms == 132 else moe.int4_row_blocks(112, 9, 4, "auto"))
    assert moe.int4_row_blocks(-(-sms * 4 // 9), 9, 4, "auto") == 1 and moe.int4_row_blocks(112, 392, 4, "auto") == 1
    assert moe.int4_row_blocks(112, 9, 4, "1") == 1 and moe.int4_row_blocks(3, 9, 4, "8") == 3
    with pytest.raises(ValueError, match="auto or a positive integer"):
        moe.int4_row_blocks(112, 9, 4, "two")


@pytest.fixture(scope="module")
def down_shaped_experts(cuda_backend):
    """Eight lane-groups INT4 experts of N = 7136, K = 384 (see the test below) and their dequantized fp32, made once."""
    from openinfer.backend.cuda import moe

    rows_weight, reference = _int4_experts(np.random.default_rng(14), 8, 7136, 384)
    return moe.tiled_int4(rows_weight, "lane_groups"), reference


@pytest.mark.parametrize("row_blocks", [None, "3"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_lane_groups_row_stream_equals_groups_xs(cuda_backend, cuda_moe, rng, monkeypatch, down_shaped_experts,
                                                 row_blocks, tokens):
    """groups_xs_rs (moe_int4.cu GROUPS_ROW_STREAM: a warp's column blocks walked as one chunk stream) gives
    groups_xs's bits (the same sums in the same order): eight experts every token takes, N = 7136 (Kimi-K2's down rows less 32: 112 column blocks x 9 tile rows, the last block's last
    two warps past N; unset, "auto" streams 2 column blocks a block on 132 SMs; "3": a grid of 38, blocks 0-34
    stream three, 36-37 two, 35's warps three or two), K = 384 (three chunks: the walk crosses column blocks mid-ring); 3 tokens: passes of 2 and 1. And the
    NumPy product, and a CUDA-graph replay's bits."""
    moe = cuda_moe
    num_experts, top_k, in_features = 8, 8, 384
    weight, reference = down_shaped_experts
    x_host = bf16_random(rng, tokens, in_features)
    x = cuda_backend.upload(x_host)
    ids = np.stack([rng.permutation(num_experts) for _ in range(tokens)]).astype(np.int32)
    grouping = moe.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), num_experts)
    monkeypatch.delenv(moe.INT4_ROW_BLOCKS_ENV, raising=False)
    want = cupy.asnumpy(moe.grouped_gemm(x, weight, grouping, gather=True, gemv=True, gemv_kernel="groups_xs"))
    if row_blocks is not None:
        monkeypatch.setenv(moe.INT4_ROW_BLOCKS_ENV, row_blocks)

    def run():
        return moe.grouped_gemm(x, weight, grouping, gather=True, gemv=True, gemv_kernel="groups_xs_rs")

    got = cupy.asnumpy(run())
    assert np.array_equal(got, want)
    slots = cupy.asnumpy(grouping.sorted_slots)
    expected = np.stack([x_host[s // top_k] @ reference[ids.reshape(-1)[s]].T for s in slots])
    assert relative_error(bf16_to_float32(got), expected) < BF16_TOL  # (got: the bf16 bits)
    eager, replay = _replayed(run)
    assert np.array_equal(eager, want) and np.array_equal(replay, want)


@pytest.mark.parametrize("n,k", [(12288, 1536), (100, 264), (37, 7168), (40, 2056)])
def test_gemv_m1_rms_scaled_matches_numpy(cuda_backend, rng, monkeypatch, n, k):
    """gemv.cu gemv_m1_rms_scaled (OPENINFER_RMS_SCALED_GEMV=1: add_rms_norm_linear without a residual as one
    launch, the norm a scale on each column's sum): the NumPy rms_norm then product within bf16 rounding, the
    two-launch path (rms_norm, gemv_m1) within a few bf16 ulps; Kimi-K2's q_b, a partial pass, a long row, K past
    whole passes of 8; the input row handed back; rows other than one take the two launches; a bad value errors."""
    from openinfer.backend.cuda import linear as cuda_linear

    w_host = bf16_random(rng, n, k, scale=0.02)
    x_host = bf16_random(rng, 1, k, scale=3.0)
    norm_host = bf16_random(rng, k, scale=0.3) + np.float32(1.0)
    layer = cuda_backend.linear_weight(w_host)
    norm = cuda_backend.weight(norm_host)
    x = cuda_backend.upload(x_host)
    monkeypatch.setenv(cuda_linear.RMS_SCALED_GEMV_ENV, "0")
    two, _ = cuda_backend.add_rms_norm_linear(x, None, norm, 1e-6, layer)
    monkeypatch.setenv(cuda_linear.RMS_SCALED_GEMV_ENV, "1")
    assert cuda_linear.rms_scaled_wanted(x, layer)
    one, passed = cuda_backend.add_rms_norm_linear(x, None, norm, 1e-6, layer)
    assert passed is x and one.shape == (1, n)
    normed = x_host / np.sqrt(np.mean(x_host.astype(np.float64) ** 2) + 1e-6) * norm_host
    expected = normed @ w_host.T
    assert relative_error(cuda_backend.to_host(one), expected) < BF16_TOL
    assert relative_error(cuda_backend.to_host(one), cuda_backend.to_host(two)) < 1e-2
    rows2 = cuda_backend.upload(bf16_random(rng, 2, k))
    assert not cuda_linear.rms_scaled_wanted(rows2, layer)
    monkeypatch.setenv(cuda_linear.RMS_SCALED_GEMV_ENV, "maybe")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        cuda_linear.rms_scaled_wanted(x, layer)
