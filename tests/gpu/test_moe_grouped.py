"""The grouped-expert kernels against NumPy: moe_sm90.cu's tile shapes (SM90_SHAPES) and its switches (PDL, stream-K,
the L2 look-ahead, unit rotation), the shared-experts fusion, the combine kernels (with and
without the next layer's add_rms_norm), and the routing kernels of moe_routing.cu.

Helpers: ``_replayed`` (a CUDA-graph replay on a stream of its own), ``_shared_fusion_case`` (a Moonlight-like layer
with fused shared experts), ``_sm90_problem`` (ragged expert loads for the kernel alone)."""

from __future__ import annotations

import numpy as np
import pytest

from openinfer.moe import RouterSpec
from tests.gpu.conftest import bf16_random, moe_router_case, relative_error
from tests.gpu.test_kimi_ops import _expert_rows_reference, _expert_weights

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _sm90_builds():
    """Every moe_sm90 build these tests launch, compiled at once in parallel NVRTC threads."""
    from openinfer.backend import cuda_available

    if not cuda_available():
        return
    from openinfer.backend.cuda import moe_sm90
    from openinfer.backend.cuda.loader import compile_kernels, discover_kernels

    if not moe_sm90.sm90_supported():
        return
    with discover_kernels() as found:
        for name, tiles in moe_sm90.SM90_SHAPES.items():
            for fuse_silu in (False, True):
                moe_sm90.sm90_kernel(tiles, fuse_silu, pdl=int(moe_sm90.DEFAULT_SM90_PDL))  # what a launch builds
                if name in ("base", "n128_s6_sk"):  # test_sm90_pdl_equals_plain_launches: both
                    moe_sm90.sm90_kernel(tiles, fuse_silu, pdl=1 - int(moe_sm90.DEFAULT_SM90_PDL))
    compile_kernels(found, cupy.cuda.Device().id, threads=16)


def _host(outputs):
    return tuple(o.get() for o in outputs) if isinstance(outputs, tuple) else outputs.get()


def _replayed(run, warm: bool = True):
    """``run()`` (returning a device array or a tuple of them) on a stream and memory pool of its own: once eagerly
    (``warm``; compiles, fills the pool), then captured as a CUDA graph whose outputs are zeroed and replayed once.
    Returns (the eager outputs or None, the replay's outputs) as host arrays."""
    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(pool.malloc), stream:  # cuLaunchKernelEx (PDL) needs a stream of its own
        eager = _host(run()) if warm else None
        stream.synchronize()
        mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
        stream.begin_capture() if mode is None else stream.begin_capture(mode)
        try:
            outputs = run()
        finally:
            graph = stream.end_capture()
        for out in outputs if isinstance(outputs, tuple) else (outputs,):
            out[...] = 0
        graph.launch(stream)
        stream.synchronize()
        return eager, _host(outputs)


def _equal(ours, plain) -> bool:
    """Bit equality of host arrays or tuples of them."""
    if isinstance(plain, tuple):
        return all(np.array_equal(a, b) for a, b in zip(ours, plain, strict=True))
    return np.array_equal(ours, plain)


def _max_error(ours, reference) -> float:
    ours = np.asarray(ours, np.float64)
    assert np.isfinite(ours).all()
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def _shared_fusion_case(cuda_backend, rng, num_experts, top_k, shared, hidden, inter, num_groups=1, topk_groups=1):
    """A bf16 MoE layer with ``shared`` shared experts of ``inter`` rows each (one SwiGLU MLP of shared x
    inter), its NumPy weights, and the fused layer (``fuse_shared_experts``)."""
    from openinfer.backend.cuda import moe

    gate_up, gate_up_ref = _expert_weights(rng, "bf16", num_experts, 2 * inter, hidden)
    down, down_ref = _expert_weights(rng, "bf16", num_experts, hidden, inter)
    spec = RouterSpec(num_experts, top_k, "sigmoid", num_groups=num_groups, topk_groups=topk_groups,
                      routed_scaling_factor=2.446)
    gate_host = bf16_random(rng, num_experts, hidden, scale=0.1)
    bias = (0.3 * rng.standard_normal(num_experts)).astype(np.float32)
    layer = moe.DeviceMoE(spec, cuda_backend.weight(gate_host), cupy.asarray(bias), gate_up, down)
    shared_gate_up_ref = bf16_random(rng, 2 * shared * inter, hidden, scale=0.05)
    shared_down_ref = bf16_random(rng, hidden, shared * inter, scale=0.05)
    shared_gate_up = cuda_backend.linear_weight(shared_gate_up_ref)
    shared_down = cuda_backend.linear_weight(shared_down_ref)
    fused = moe.fuse_shared_experts(layer, shared_gate_up.weight, shared_down.weight)
    host = (gate_host, bias, gate_up_ref, down_ref, shared_gate_up_ref, shared_down_ref)
    return moe, layer, fused, (shared_gate_up, shared_down), host


def _fused_grouping(moe, x, fused):
    """The fused layer's routing of ``x`` (shared experts appended), grouped by expert."""
    from openinfer.backend.cuda import moe_routing
    ids, weights = moe_routing.route(x, fused.gate, fused.router, fused.correction_bias, shared_experts=fused.shared_experts)
    return moe_routing.group_by_expert(ids, weights, fused.gate_up.num_experts)


def _moe_reference(x, spec, host):
    """NumPy fp32: routed experts (core's reference ops) + the shared SwiGLU MLP."""
    from openinfer.backend.numpy_backend import NumpyBackend
    from openinfer.moe import ExpertWeights, group_by_expert, route, run_experts

    ref = NumpyBackend()
    gate_host, bias, gate_up_ref, down_ref, shared_gate_up_ref, shared_down_ref = host
    weights, ids = route(x @ gate_host.T, spec, bias)
    experts = [ExpertWeights(ref.linear_weight(gate_up_ref[e]), ref.linear_weight(down_ref[e]))
               for e in range(spec.num_experts)]
    routed = run_experts(ref, x, weights, group_by_expert(ids, spec.num_experts), experts)
    hidden = x @ shared_gate_up_ref.T
    half = hidden.shape[1] // 2
    return routed + (hidden[:, :half] / (1 + np.exp(-hidden[:, :half])) * hidden[:, half:]) @ shared_down_ref.T


# ---------------------------------------------------------------- moe_sm90.cu alone

def _sm90_problem(cuda_backend, moe, rng, kind: str):
    """Expert weights, tokens and a grouping for the kernel alone. "ragged": 8 experts, an empty one, one over several
    64- and 128-slot tiles, tiles of 1-5 slots (a warpgroup all padding), K = 200 (a partial 64- and 128-wide k-stage:
    a whole 64-wide sub-tile past K for k_sub 2), N = 304 / I = 152 (partial 128- and 256-row tiles, the next expert's
    rows in the box, never stored). "many_units": Moonlight-like widths at 64 tokens over 24 experts, more units than
    SMs (stream-K cuts units between CTAs)."""
    from openinfer.backend.cuda import moe_routing
    if kind == "ragged":
        num_experts, top_k, hidden, inter, tokens = 8, 3, 200, 152, 300
        ids = np.stack([rng.choice([0, 2, 3, 5, 6], top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
        ids[:260, 0] = 1  # expert 1: 260 slots (five 64-slot tiles, three 128-slot tiles)
        ids[:5, 2] = 7  # expert 7: 5 slots; expert 4: none
    else:
        num_experts, top_k, hidden, inter, tokens = 24, 6, 1024, 704, 64
        ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    gate_up, gate_up_ref = _expert_weights(rng, "bf16", num_experts, 2 * inter, hidden)
    down, down_ref = _expert_weights(rng, "bf16", num_experts, hidden, inter)
    x_host = bf16_random(rng, tokens, hidden)
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), num_experts)
    return (gate_up, gate_up_ref), (down, down_ref), x_host, grouping


SM90_CASES = [(shape, "ragged") for shape in ("base", "skip", "m64_s5", "m64_n128_s8", "n128_s6", "sk", "n128_s6_sk",
                                              "m64_n128_k2", "m64_n128_k3", "m64_n128_k4", "m64_n128_k2_x2",
                                              "m64_n128_s4_x2")]
SM90_CASES += [(shape, "many_units") for shape in ("sk", "m64_s5_sk", "n128_s6_sk", "m64_n128_k2_sk")]


@pytest.mark.parametrize("shape,kind", SM90_CASES, ids=[f"{s}-{k}" for s, k in SM90_CASES])
def test_sm90_shapes_match_numpy(cuda_backend, cuda_moe, sm90_moe, rng, shape, kind):
    """Every SM90_SHAPES build (``_sm90_problem``): gate_up (gathered rows) and down against NumPy fp32 per expert;
    the fused SiLU·mul equal to silu_mul of its own gate_up (stream-K: within bf16 rounding, the two launches cut
    their units in other places; deterministic: twice the same bits, the flags left zeros); within bf16 rounding of
    the base shape; a graph replay equals the eager run."""
    moe, moe_sm90 = cuda_moe, sm90_moe
    (gate_up, gate_up_ref), (down, down_ref), x_host, grouping = _sm90_problem(cuda_backend, moe, rng, kind)
    x, top_k = cuda_backend.upload(x_host), grouping.top_k
    offsets, sorted_slots = grouping.offsets.get(), grouping.sorted_slots.get()
    tiles = moe_sm90.SM90_SHAPES[shape]
    if kind == "many_units":
        units = np.count_nonzero(np.diff(offsets)) * -(-(gate_up.out_features // 2) // (tiles.tile_n // 2))
        assert units > cupy.cuda.Device().attributes["MultiProcessorCount"]  # stream-K cuts units

    def gemm(a, weight, gather, fuse_silu=False, name=shape):
        return moe_sm90.grouped_gemm_sm90(a, weight, grouping, gather=gather, fuse_silu=fuse_silu, shape=name)

    h = gemm(x, gate_up, True)
    h_ref = _expert_rows_reference(x_host, gate_up_ref, sorted_slots, offsets, top_k, gather=True)
    assert _max_error(cuda_backend.to_host(h), h_ref) < 1e-2
    fused = gemm(x, gate_up, True, fuse_silu=True)
    if tiles.stream_k:
        assert _max_error(cuda_backend.to_host(fused), cuda_backend.to_host(cuda_backend.silu_mul(h))) < 1e-2
        assert np.array_equal(fused.get(), gemm(x, gate_up, True, fuse_silu=True).get())
    else:
        assert np.array_equal(fused.get(), cuda_backend.silu_mul(h).get())
    base = gemm(x, gate_up, True, fuse_silu=True, name="base")
    assert _max_error(cuda_backend.to_host(fused), cuda_backend.to_host(base).astype(np.float64)) < 1e-2
    y = gemm(fused, down, False)
    y_ref = _expert_rows_reference(cuda_backend.to_host(fused), down_ref, sorted_slots, offsets, top_k, gather=False)
    assert _max_error(cuda_backend.to_host(y), y_ref) < 1e-2
    assert _max_error(cuda_backend.to_host(y), cuda_backend.to_host(gemm(fused, down, False, name="base"))) < 1e-2
    _, replay = _replayed(lambda: gemm(gemm(x, gate_up, True, fuse_silu=True), down, False))
    assert np.array_equal(replay, y.get())
    if tiles.stream_k:  # every flag awaited was set back to zero: the next launch (or replay) waits for its own parts
        assert moe_sm90._workspaces and all(not flags.any() for flags, _ in moe_sm90._workspaces.values())


def test_sm90_shape_switch(sm90_moe, monkeypatch):
    """OPENINFER_MOE_SM90_SHAPE forces a shape; unset, SM90_SHAPE_CHOICE decides (64-slot, 128-row tiles, two CTAs
    per SM with 4-stage rings, up to 24 slots per expert; base above)."""
    moe_sm90 = sm90_moe
    monkeypatch.delenv(moe_sm90.SM90_SHAPE_ENV, raising=False)
    assert moe_sm90.sm90_shape(1.5) == moe_sm90.sm90_shape(24) == moe_sm90.SM90_SHAPES["m64_n128_s4_x2"]
    assert moe_sm90.SM90_SHAPES["m64_n128_s4_x2"].ctas_per_sm == 2
    assert moe_sm90.sm90_shape(96) == moe_sm90.SM90_SHAPES["base"]
    monkeypatch.setenv(moe_sm90.SM90_SHAPE_ENV, "m64_s5")
    assert moe_sm90.sm90_shape(6.0) == moe_sm90.SM90_SHAPES["m64_s5"]


@pytest.mark.parametrize("shape", ["base", "n128_s6_sk"])
def test_sm90_pdl_equals_plain_launches(cuda_backend, cuda_moe, sm90_moe, rng, monkeypatch, shape):
    """OPENINFER_MOE_SM90_PDL=1: gate_up built to let down launch early, down launched to overlap it
    (cuLaunchKernelEx, programmatic stream serialization): the same bits as plain launches, eagerly
    and as a CUDA graph replay, over a step where gate_up has several waves (Moonlight-like widths,
    few slots per expert) and one where most experts are empty."""
    from openinfer.backend.cuda import moe_routing
    moe, moe_sm90 = cuda_moe, sm90_moe
    num_experts, top_k, hidden, inter = 16, 6, 512, 704
    gate_up, _ = _expert_weights(rng, "bf16", num_experts, 2 * inter, hidden)
    down, _ = _expert_weights(rng, "bf16", num_experts, hidden, inter)
    monkeypatch.setenv(moe_sm90.SM90_SHAPE_ENV, shape)
    for tokens, choices in ((64, num_experts), (40, 7)):
        x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
        ids = np.stack([rng.choice(choices, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
        grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.ones(ids.shape, cupy.float32), num_experts)
        assert moe_sm90.sm90_experts(x, gate_up, ids.size, True)
        monkeypatch.setenv(moe_sm90.SM90_PDL_ENV, "0")
        plain = moe.routed_experts(cuda_backend, x, gate_up, down, grouping).get()
        monkeypatch.setenv(moe_sm90.SM90_PDL_ENV, "1")
        assert np.array_equal(moe.routed_experts(cuda_backend, x, gate_up, down, grouping).get(), plain)
        eager, replay = _replayed(lambda x=x, grouping=grouping: moe.routed_experts(cuda_backend, x, gate_up, down,
                                                                                    grouping))
        assert np.array_equal(eager, plain) and np.array_equal(replay, plain)
    monkeypatch.delenv(moe_sm90.SM90_PDL_ENV)
    assert moe_sm90.sm90_pdl() == moe_sm90.DEFAULT_SM90_PDL


# ---------------------------------------------------------------- switches that keep moe_forward's bits

# name -> (switches of the plain run, switches added for the compared run; ROTATE: inside rotated_units(shared experts))
ROTATE = "rotate"
SAME_BITS_SWITCHES = {
    # gate_up launched to overlap the grouping kernel (built to wait for it first: SM90_PDL=2), moe_combine to
    # overlap the down projection (griddepcontrol.wait); the grouping by moe_sort_parallel: a kernel of its own
    "gate_up_pdl": ({"OPENINFER_MOE_ROUTE_SORT": "0"}, {"OPENINFER_MOE_GATE_UP_PDL": "1"}),
    "combine_pdl": ({"OPENINFER_MOE_ROUTE_SORT": "0"}, {"OPENINFER_MOE_COMBINE_PDL": "1"}),
    "both_pdl": ({"OPENINFER_MOE_ROUTE_SORT": "0"},
                 {"OPENINFER_MOE_GATE_UP_PDL": "1", "OPENINFER_MOE_COMBINE_PDL": "1"}),
    # the last S experts' units first (SM90_ROTATE, for the L2 prefetch of fused shared experts), stream-K too
    "rotated_k2": ({"OPENINFER_MOE_SM90_SHAPE": "m64_n128_k2"}, {ROTATE: "1"}),
    "rotated_k2_sk": ({"OPENINFER_MOE_SM90_SHAPE": "m64_n128_k2_sk"}, {ROTATE: "1"}),
    # the producer's L2 look-ahead over its k-tiles (across its units), weight boxes before the gathered A rows
    "l2_ahead4": ({}, {ROTATE: "1", "OPENINFER_MOE_SM90_L2_AHEAD": "4"}),
    "l2_ahead8": ({}, {ROTATE: "1", "OPENINFER_MOE_SM90_L2_AHEAD": "8"}),
    "b_first": ({}, {ROTATE: "1", "OPENINFER_MOE_SM90_B_FIRST": "1"}),
    "l2_ahead6_b_first": ({}, {ROTATE: "1", "OPENINFER_MOE_SM90_L2_AHEAD": "6", "OPENINFER_MOE_SM90_B_FIRST": "1"}),
}


@pytest.mark.parametrize("tokens", [16, 64, 300])
@pytest.mark.parametrize("name", list(SAME_BITS_SWITCHES))
def test_switches_keep_moe_forward_bits(cuda_backend, sm90_moe, rng, monkeypatch, name, tokens):
    """Each SAME_BITS_SWITCHES set: moe_forward of a Moonlight-like layer (64 experts, top-6, 2 shared experts fused:
    ragged loads, the shared experts every token's) on the Hopper kernel (16 / 64 tokens the decode shape, 300 the
    base shape) gives the plain run's bits eagerly and as CUDA graphs captured before and after an eager run on their
    stream."""
    moe_sm90 = sm90_moe
    hidden, inter = 512, 192  # 192: a partial 128-row down tile, three 64-row gate / up tiles
    moe, _, fused, _, _ = _shared_fusion_case(cuda_backend, rng, 64, 6, 2, hidden, inter)
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
    plain_env, switches = SAME_BITS_SWITCHES[name]
    for key, value in plain_env.items():
        monkeypatch.setenv(key, value)
    assert moe.sm90_routed(x, fused.gate_up, _fused_grouping(moe, x, fused))
    plain = moe.moe_forward(cuda_backend, x, fused).get()
    for key, value in switches.items():
        if key != ROTATE:
            monkeypatch.setenv(key, value)

    def run():
        with moe_sm90.rotated_units(fused.shared_experts if ROTATE in switches else 0):
            return moe.moe_forward(cuda_backend, x, fused)

    assert np.array_equal(run().get(), plain)  # eager: compiles the switched builds
    _, replay = _replayed(run, warm=False)
    assert np.array_equal(replay, plain)
    eager, replay = _replayed(run)
    assert np.array_equal(eager, plain) and np.array_equal(replay, plain)


# switches that change moe_forward's fp32 sum order (not its bits): name -> env
ROUNDING_SWITCHES = {
    # stream-K shapes, down PDL-launched beside gate_up (a workspace of its own: no pool block gate_up still writes)
    "shape_sk": {"OPENINFER_MOE_SM90_SHAPE": "sk"},
    "shape_n128_s6_sk": {"OPENINFER_MOE_SM90_SHAPE": "n128_s6_sk"},
}


@pytest.mark.parametrize("tokens", [16, 64])
@pytest.mark.parametrize("name", list(ROUNDING_SWITCHES))
def test_switches_within_rounding(cuda_backend, sm90_moe, rng, monkeypatch, name, tokens):
    """Each ROUNDING_SWITCHES set: moe_forward of a Moonlight-like layer (Moonlight's gate_up / down widths over 64
    experts, 2 shared experts fused: several waves of units, gate_up PDL-overlapped by down) within fp32-sum rounding
    of the default run and of NumPy; deterministic (the eager run's bits replayed from a CUDA graph)."""
    hidden, inter = 512, 704  # 704: eleven 64-row gate / up tiles, several waves of down units
    moe, layer, fused, _, host = _shared_fusion_case(cuda_backend, rng, 64, 6, 2, hidden, inter)
    x_host = bf16_random(rng, tokens, hidden)
    x = cuda_backend.upload(x_host)
    plain = cuda_backend.to_host(moe.moe_forward(cuda_backend, x, fused))
    for key, value in ROUNDING_SWITCHES[name].items():
        monkeypatch.setenv(key, value)
    eager, replay = _replayed(lambda: moe.moe_forward(cuda_backend, x, fused))
    assert np.array_equal(replay, eager)
    switched = cuda_backend.to_host(moe.moe_forward(cuda_backend, x, fused))
    assert relative_error(switched, plain) < 1e-2
    assert relative_error(switched, _moe_reference(x_host, layer.router, host)) < 2e-2


# (module, env, a bad value, the function that reads it) -> ValueError naming the env
BAD_SWITCH_VALUES = [
    ("moe_sm90", "SM90_SHAPE_ENV", "m32", lambda m: m.sm90_shape(6.0)),
    ("moe_sm90", "SM90_PDL_ENV", "sometimes", lambda m: m.sm90_pdl()),
    ("moe_sm90", "GATE_UP_PDL_ENV", "sometimes", lambda m: m.gate_up_pdl()),
    ("moe_sm90", "L2_AHEAD_ENV", "lots", lambda m: m.l2_ahead()),
    ("moe_sm90", "B_FIRST_ENV", "2", lambda m: m.b_first()),
    ("moe", "COMBINE_PDL_ENV", "sometimes", lambda m: m.combine_pdl_wanted()),
    ("moe", "COMBINE_VEC_ENV", "sometimes", lambda m: m.combine_vec_wanted(16)),
    ("moe", "COMBINE_NORM_ENV", "sometimes", lambda m: m.combine_norm_wanted(16)),
    ("moe", "SHARED_FUSED_ENV", "yes please", lambda m: m.shared_fusion_wanted()),
    ("moe_routing", "ROUTE_SORT_ENV", "sometimes", lambda m: m.route_sort_wanted(16, RouterSpec(64, 6, "sigmoid"))),
    ("moe", "L2_PREFETCH_ENV", "sometimes", lambda m: m.l2_prefetch_mode()),
    ("moe", "L2_PREFETCH_MB_ENV", "lots", lambda m: m.l2_prefetch_bytes()),
]


@pytest.mark.parametrize("module,env,value,read", BAD_SWITCH_VALUES, ids=[row[1] for row in BAD_SWITCH_VALUES])
def test_bad_switch_values_are_clear_errors(cuda_backend, monkeypatch, module, env, value, read):
    """A switch set to something it does not take is a ValueError that names it (never a silent default)."""
    from openinfer.backend.cuda import moe, moe_routing, moe_sm90

    owner = {"moe": moe, "moe_routing": moe_routing, "moe_sm90": moe_sm90}[module]
    monkeypatch.setenv(getattr(owner, env), value)
    with pytest.raises(ValueError, match=getattr(owner, env)):
        read(owner)


# ---------------------------------------------------------------- routing (moe_routing.cu)

@pytest.mark.parametrize("tokens,experts,top_k,shared", [(1, 64, 6, 2), (16, 64, 6, 2), (64, 64, 6, 2),
                                                         (300, 384, 8, 1)])
def test_route_with_shared_experts(cuda_backend, cuda_moe, rng, tokens, experts, top_k, shared):
    """ROUTE_SHARED_EXPERTS (shared-experts fusion) in moe_route: rows of k + S, the routed part the bits of a plain
    route, then experts E .. E+S-1 with weight 1."""
    from openinfer.backend.cuda import moe_routing
    router = RouterSpec(experts, top_k, "sigmoid", routed_scaling_factor=2.446)
    x = cuda_backend.upload(bf16_random(rng, tokens, 256))
    gate = cuda_backend.weight(bf16_random(rng, experts, 256, scale=0.1))
    bias = cupy.asarray((0.3 * rng.standard_normal(experts)).astype(np.float32))
    logits = moe_routing.router_logits(x, gate, router, mma=False)
    plain = moe_routing.select_experts(x, gate, router, bias, logits)
    ids, weights = moe_routing.select_experts(x, gate, router, bias, logits, shared_experts=shared)
    assert ids.shape == (tokens, top_k + shared)
    assert np.array_equal(ids[:, :top_k].get(), plain[0].get())
    assert np.array_equal(weights[:, :top_k].get(), plain[1].get())
    assert np.array_equal(ids[:, top_k:].get(), np.broadcast_to(experts + np.arange(shared), (tokens, shared)))
    assert np.all(weights[:, top_k:].get() == 1.0)


def test_grouping_method_choice(cuda_moe, monkeypatch):
    """group_by_expert's method: the per-expert blocks from GROUP_BLOCKS_MIN_SLOTS slots (default), one block below or
    with OPENINFER_MOE_GROUP_BLOCKS=0; an unknown method is a clear error."""
    from openinfer.backend.cuda import moe_routing
    monkeypatch.delenv(moe_routing.GROUP_BLOCKS_ENV, raising=False)
    assert moe_routing.grouping_method(moe_routing.GROUP_BLOCKS_MIN_SLOTS) == "blocks"
    assert moe_routing.grouping_method(moe_routing.GROUP_BLOCKS_MIN_SLOTS - 1) == "single"
    monkeypatch.setenv(moe_routing.GROUP_BLOCKS_ENV, "0")
    assert moe_routing.grouping_method(moe_routing.GROUP_BLOCKS_MIN_SLOTS) == "single"
    ids = cupy.zeros((4, 2), cupy.int32)
    with pytest.raises(ValueError, match="grouping method"):
        moe_routing.group_by_expert(ids, cupy.ones(ids.shape, cupy.float32), 4, method="sorted")


@pytest.mark.parametrize("tokens,experts,top_k,shared,scoring", [
    (1, 64, 6, 0, "sigmoid"), (16, 64, 6, 2, "sigmoid"), (64, 64, 6, 2, "sigmoid"), (37, 60, 4, 0, "softmax"),
    (64, 384, 8, 1, "sigmoid"), (3, 512, 16, 0, "sqrtsoftplus")])
def test_route_sort_equals_route_then_sort(cuda_backend, cuda_moe, rng, monkeypatch, tokens, experts, top_k, shared,
                                           scoring):
    """moe_route_sort (OPENINFER_MOE_ROUTE_SORT=1, one block): moe_route's ids and weights (softmax: within fp32
    rounding, its sum taken in another order; the fused shared experts' columns too), moe_sort_parallel's offsets, tile list and tile count, every expert's
    segment holding exactly its slots, slot_pos its inverse; moe_forward gives the bits of the unswitched
    path, eagerly and replayed from a CUDA graph."""
    from openinfer.backend.cuda import moe_routing
    moe = cuda_moe
    hidden = 256
    layer = moe_router_case(cuda_backend, rng, experts, top_k, hidden, scoring=scoring, shared=shared, inter=64)
    router, bias = layer.router, layer.correction_bias
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
    monkeypatch.setenv(moe_routing.ROUTE_SORT_ENV, "1")
    assert moe_routing.route_sort_wanted(tokens, router, None, shared)
    grouping = moe_routing.route_and_group(x, layer)
    ids, weights = moe_routing.route(x, layer.gate, router, bias, shared_experts=shared)
    assert np.array_equal(grouping.ids.get(), ids.get())
    if scoring == "softmax":
        assert np.allclose(grouping.weights.get(), weights.get(), rtol=1e-6, atol=1e-7)
    else:
        assert np.array_equal(grouping.weights.get(), weights.get())
    reference = moe_routing.group_by_expert(ids, weights, experts + shared, method="single")
    offsets = reference.offsets.get()
    assert np.array_equal(grouping.offsets.get(), offsets)
    tiles = int(reference.num_tiles.get()[0])
    assert grouping.max_tiles == reference.max_tiles and int(grouping.num_tiles.get()[0]) == tiles
    assert np.array_equal(grouping.tile_expert.get()[:tiles], reference.tile_expert.get()[:tiles])
    assert np.array_equal(grouping.tile_row.get()[:tiles], reference.tile_row.get()[:tiles])
    sorted_slots, slot_pos, flat_ids = grouping.sorted_slots.get(), grouping.slot_pos.get(), ids.get().reshape(-1)
    assert np.array_equal(sorted_slots[slot_pos], np.arange(flat_ids.size))
    for e in range(experts + shared):
        segment = sorted_slots[offsets[e]:offsets[e + 1]]
        assert np.array_equal(np.sort(segment), np.flatnonzero(flat_ids == e))
    monkeypatch.setenv(moe_routing.ROUTE_SORT_ENV, "0")
    plain = _host(moe.moe_forward(cuda_backend, x, layer))  # bits, as _replayed returns
    monkeypatch.setenv(moe_routing.ROUTE_SORT_ENV, "1")
    eager, replay = _replayed(lambda: moe.moe_forward(cuda_backend, x, layer))
    assert np.array_equal(eager, plain) and np.array_equal(replay, plain)


def test_route_sort_switch_bounds(cuda_moe, monkeypatch):
    """moe_route_sort only where switched on and its shared arrays hold the step."""
    from openinfer.backend.cuda import moe_routing
    spec = RouterSpec(64, 6, "sigmoid")
    monkeypatch.delenv(moe_routing.ROUTE_SORT_ENV, raising=False)
    assert moe_routing.route_sort_wanted(moe_routing.ROUTE_SORT_DEFAULT_MAX_TOKENS, spec)
    assert not moe_routing.route_sort_wanted(moe_routing.ROUTE_SORT_DEFAULT_MAX_TOKENS + 1, spec)
    monkeypatch.setenv(moe_routing.ROUTE_SORT_ENV, "0")
    assert not moe_routing.route_sort_wanted(1, spec) and not moe_routing.route_sort_wanted(16, spec)
    monkeypatch.setenv(moe_routing.ROUTE_SORT_ENV, "1")
    assert moe_routing.route_sort_wanted(1, spec) and moe_routing.route_sort_wanted(moe_routing.ROUTE_SORT_MAX_TOKENS, spec, None, 2)
    assert not moe_routing.route_sort_wanted(0, spec) and not moe_routing.route_sort_wanted(moe_routing.ROUTE_SORT_MAX_TOKENS + 1, spec)
    assert not moe_routing.route_sort_wanted(16, RouterSpec(64, 6, "sigmoid", num_groups=8, topk_groups=3))
    assert not moe_routing.route_sort_wanted(16, spec, object())  # hash routing (a tid2eid table)
    assert not moe_routing.route_sort_wanted(16, RouterSpec(512, 8, "sigmoid"), None, 1)


# ---------------------------------------------------------------- combine, shared experts, the layer

def _combine_case(cuda_backend, moe, rng, tokens, hidden, top_k, with_shared, experts=32):
    """A grouping of ``tokens`` x ``top_k`` random routes with random weights, the experts' rows y (host, device) and
    a shared row per token (or None)."""
    from openinfer.backend.cuda import moe_routing
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    grouping = moe_routing.group_by_expert(cupy.asarray(ids), cupy.asarray(weights), experts)
    y_host = bf16_random(rng, tokens * top_k, hidden)
    shared_host = bf16_random(rng, tokens, hidden) if with_shared else None
    shared = None if shared_host is None else cuda_backend.upload(shared_host)
    return grouping, weights, (y_host, cuda_backend.upload(y_host)), (shared_host, shared)


@pytest.mark.parametrize("tokens,hidden,top_k,with_shared", [(1, 2048, 6, True), (77, 2048, 6, False),
                                                              (300, 7168, 8, True), (33, 264, 16, True),
                                                              (5, 260, 6, True)])
def test_combine_vec_equals_combine(cuda_backend, cuda_moe, rng, monkeypatch, tokens, hidden, top_k, with_shared):
    """moe_combine_vec8 (OPENINFER_MOE_COMBINE_VEC=1) against moe_combine: the same bits, with and
    without the shared experts' rows, k up to 16, a width not whole 256-thread passes (7168 = 3.5 x
    2048); hidden 260 (not whole 16-byte pieces) falls back to moe_combine."""
    moe = cuda_moe
    grouping, _, (_, y), (_, shared) = _combine_case(cuda_backend, moe, rng, tokens, hidden, top_k, with_shared)
    plain = moe.combine(y, grouping, shared, hidden, vectorized=False)
    assert moe.combine_vec_ready(y, shared, hidden, top_k) is (hidden % 8 == 0)
    monkeypatch.setenv(moe.COMBINE_VEC_ENV, "1")
    assert np.array_equal(moe.combine(y, grouping, shared, hidden).get(), plain.get())
    monkeypatch.delenv(moe.COMBINE_VEC_ENV)
    assert moe.combine_vec_wanted(tokens) is (tokens >= moe.COMBINE_VEC_MIN_TOKENS)
    assert np.array_equal(moe.combine(y, grouping, shared, hidden).get(), plain.get())


@pytest.mark.parametrize("tokens,hidden,top_k,with_shared", [(1, 2048, 8, False), (16, 2048, 8, False),
                                                              (16, 2048, 6, True), (64, 7168, 9, False),
                                                              (5, 260, 6, True), (128, 520, 4, False)])
def test_combine_add_rms_norm_equals_unfused(cuda_backend, cuda_moe, rng, tokens, hidden, top_k, with_shared):
    """moe_combine_add_rms_norm (OPENINFER_MOE_COMBINE_NORM) against moe_combine then the backend's add_rms_norm:
    the same bits (out and residual_out), with and without a shared row, widths not whole thread passes; and
    against the NumPy fp32 composition (Σ w·y (+ shared) + residual, RMS-normalised, times the weight) within
    bf16 rounding; a wrong residual shape is a clear error."""
    moe, eps = cuda_moe, 1e-6
    grouping, weights, (y_host, y), (shared_host, shared) = _combine_case(cuda_backend, moe, rng, tokens, hidden,
                                                                          top_k, with_shared)
    residual_host, norm_host = bf16_random(rng, tokens, hidden), bf16_random(rng, hidden, scale=0.5)
    residual, norm = cuda_backend.upload(residual_host), cuda_backend.weight(norm_host)
    plain_out, plain_residual = cuda_backend.add_rms_norm(moe.combine(y, grouping, shared, hidden, vectorized=False),
                                                          residual, norm, eps)
    out, residual_out = moe.combine_add_rms_norm(y, grouping, shared, residual, norm, eps)
    assert np.array_equal(out.get(), plain_out.get())
    assert np.array_equal(residual_out.get(), plain_residual.get())
    slot_pos = grouping.slot_pos.get().reshape(tokens, top_k)
    combined = np.einsum("tk,tkh->th", weights, y_host[slot_pos])
    summed = combined + (shared_host if with_shared else 0) + residual_host
    reference = summed / np.sqrt((summed ** 2).mean(-1, keepdims=True) + eps) * norm_host
    assert relative_error(cuda_backend.to_host(residual_out), summed) < 1e-2
    assert relative_error(cuda_backend.to_host(out), reference) < 1e-2
    with pytest.raises(ValueError, match="residual"):
        moe.combine_add_rms_norm(y, grouping, shared, residual[:, :-8], norm, eps)


@pytest.mark.parametrize("rows,features", [(1, 2048), (16, 2048), (16, 7168), (5, 260), (3, 520), (2, 9000)])
def test_add_rms_norm_block_kernel(cuda_backend, rng, rows, features):
    """rms_norm.cu add_rms_norm (the block kernel of decode-sized steps, whose sum order moe_combine_add_rms_norm
    reproduces): residual_out = bf16(x + residual) exactly, out the bits of the rms_norm
    block kernel (normalize_row: the same threads, the same sum order) on that residual_out, and NumPy's fp32 RMSNorm
    within bf16 rounding."""
    from openinfer.backend.cuda.backend import _norm_threads
    from openinfer.backend.cuda.bf16 import bf16_bits_to_float, float_to_bf16_bits
    from openinfer.backend.cuda.loader import kernel

    eps = 1e-6
    x_host, residual_host = bf16_random(rng, rows, features), bf16_random(rng, rows, features)
    norm_host = bf16_random(rng, features, scale=0.5)
    x, residual, norm = cuda_backend.upload(x_host), cuda_backend.upload(residual_host), cuda_backend.weight(norm_host)
    out, residual_out, renormed = (cupy.empty((rows, features), cupy.uint16) for _ in range(3))
    threads = _norm_threads(features)
    kernel("rms_norm.cu", "add_rms_norm")((rows,), (threads,), (x, residual, norm, out, residual_out,
                                                                np.int32(features), np.float32(eps)))
    kernel("rms_norm.cu", "rms_norm")((rows,), (threads,), (residual_out, norm, renormed, np.int32(features),
                                                            np.float32(eps)))
    summed = bf16_bits_to_float(float_to_bf16_bits((x_host + residual_host).astype(np.float32)))
    assert np.array_equal(residual_out.get(), float_to_bf16_bits(summed))
    assert np.array_equal(out.get(), renormed.get())
    reference = summed / np.sqrt((summed.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * norm_host
    assert relative_error(cuda_backend.to_host(out), reference) < 1e-2


@pytest.mark.parametrize("tokens,num_experts,top_k,shared,groups", [
    (1, 64, 6, 2, (1, 1)), (5, 64, 6, 2, (1, 1)), (16, 64, 6, 2, (1, 1)), (64, 64, 6, 2, (1, 1)),
    (33, 16, 4, 1, (4, 2)), (200, 64, 6, 2, (1, 1))])
def test_shared_experts_fused_matches_unfused_and_numpy(cuda_backend, rng, tokens, num_experts, top_k, shared,
                                                        groups):
    """Shared-experts fusion (OPENINFER_MOE_SHARED_FUSED): the stacks hold the routed experts as they were,
    then each shared expert's gate / up rows and down columns; moe_route (ROUTE_SHARED_EXPERTS) gives the same
    routed ids and weights plus the shared experts with weight 1; moe_forward of the fused layer (decode GEMV
    at 1 / 5 tokens, the Hopper grouped GEMM from 16, ragged loads: the shared experts take every token) equals
    the unfused layer with its shared MLP and NumPy fp32 within bf16 rounding; a CUDA graph replay equals the
    eager run."""
    from openinfer.backend.cuda import moe_routing
    hidden, inter = 512, 128
    moe, layer, fused, (shared_gate_up, shared_down), host = _shared_fusion_case(
        cuda_backend, rng, num_experts, top_k, shared, hidden, inter, *groups)
    assert fused.shared_experts == shared and fused.gate_up.num_experts == num_experts + shared
    assert np.array_equal(fused.gate_up.data[:num_experts].get(), layer.gate_up.data.get())
    assert np.array_equal(fused.gate_up.data[num_experts, :inter].get(), shared_gate_up.weight[:inter].get())
    assert np.array_equal(fused.gate_up.data[-1, inter:].get(), shared_gate_up.weight[-inter:].get())
    assert np.array_equal(fused.down.data[-1].get(), shared_down.weight[:, -inter:].get())
    x_host = bf16_random(rng, tokens, hidden)
    x = cuda_backend.upload(x_host)
    ids, weights = moe_routing.route(x, layer.gate, layer.router, layer.correction_bias)
    fused_ids, fused_weights = moe_routing.route(x, fused.gate, fused.router, fused.correction_bias,
                                         shared_experts=fused.shared_experts)
    assert np.array_equal(fused_ids[:, :top_k].get(), ids.get())
    assert np.array_equal(fused_weights[:, :top_k].get(), weights.get())
    assert np.array_equal(fused_ids[:, top_k:].get(), np.broadcast_to(num_experts + np.arange(shared),
                                                                      (tokens, shared)))
    assert np.all(fused_weights[:, top_k:].get() == 1.0)

    def shared_mlp(h):
        return cuda_backend.silu_mul_linear(cuda_backend.linear(h, shared_gate_up), shared_down)

    unfused = cuda_backend.to_host(moe.moe_forward(cuda_backend, x, layer, shared_experts=shared_mlp))
    out = moe.moe_forward(cuda_backend, x, fused)
    eager = cuda_backend.to_host(out)
    assert relative_error(eager, _moe_reference(x_host, layer.router, host)) < 2e-2
    assert relative_error(eager, unfused) < 2e-2
    with pytest.raises(ValueError, match="fused"):
        moe.moe_forward(cuda_backend, x, fused, shared_experts=shared_mlp)
    _, replay = _replayed(lambda: moe.moe_forward(cuda_backend, x, fused))
    assert np.array_equal(replay, out.get())


def test_shared_fusion_fits_and_switch(cuda_backend, rng, monkeypatch):
    """What fuse_shared_experts refuses (a shared intermediate not a whole number of experts, INT4 experts,
    an already fused layer) with a clear error; $OPENINFER_MOE_SHARED_FUSED parses 1 / 0."""
    moe, layer, fused, (shared_gate_up, shared_down), _ = _shared_fusion_case(cuda_backend, rng, 8, 2, 1, 256, 64)
    assert not moe.shared_fusion_fits(fused, shared_gate_up.weight, shared_down.weight)
    odd_up = cuda_backend.weight(bf16_random(rng, 2 * 96, 256))
    odd_down = cuda_backend.weight(bf16_random(rng, 256, 96))
    assert not moe.shared_fusion_fits(layer, odd_up, odd_down)
    with pytest.raises(ValueError, match="cannot fuse shared experts"):
        moe.fuse_shared_experts(layer, odd_up, odd_down)
    int4_up, _ = _expert_weights(rng, "int4", 8, 128, 256)
    int4_down, _ = _expert_weights(rng, "int4", 8, 256, 64)
    int4_layer = moe.DeviceMoE(layer.router, layer.gate, None, int4_up, int4_down)
    assert not moe.shared_fusion_fits(int4_layer, shared_gate_up.weight, shared_down.weight)
    monkeypatch.delenv(moe.SHARED_FUSED_ENV, raising=False)
    assert moe.shared_fusion_wanted() == moe.DEFAULT_SHARED_FUSED
    for value in ("0", "1"):
        monkeypatch.setenv(moe.SHARED_FUSED_ENV, value)
        assert moe.shared_fusion_wanted() is (value == "1")


@pytest.mark.parametrize("mode", ["last", "normal"])
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_l2_prefetch_leaves_moe_forward_unchanged(cuda_backend, rng, monkeypatch, mode, tokens):
    """OPENINFER_MOE_L2_PREFETCH (moe_routing.cu moe_l2_prefetch on a side stream, joined after the layer):
    moe_forward of a layer with fused shared experts gives the same bits with the prefetch started before it,
    eagerly and as a CUDA graph replay (the side stream's fork and join captured); a byte cap below the shared
    experts' size takes gate_up first, whole 16-byte pieces; without fused shared experts nothing starts."""
    hidden, inter, num_experts, shared = 512, 128, 64, 2
    moe, layer, fused, _, _ = _shared_fusion_case(cuda_backend, rng, num_experts, 6, shared, hidden, inter)
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
    plain = moe.moe_forward(cuda_backend, x, fused).get()
    monkeypatch.setenv(moe.L2_PREFETCH_ENV, mode)
    assert moe.start_l2_prefetch(layer) is None  # no fused shared experts: nothing to prefetch

    def step():
        joined = moe.start_l2_prefetch(fused)
        assert joined is not None
        out = moe.moe_forward(cuda_backend, x, fused)
        moe.join_l2_prefetch(joined)
        return out

    assert np.array_equal(step().get(), plain)
    _, replay = _replayed(step)
    assert np.array_equal(replay, plain)
    gate_up_bytes = shared * 2 * inter * hidden * 2
    monkeypatch.setenv(moe.L2_PREFETCH_MB_ENV, str((gate_up_bytes + 1000) / 2**20))
    views = moe.shared_expert_ranges(fused, moe.l2_prefetch_bytes())
    assert [v.nbytes for v in views] == [gate_up_bytes, 992]
    assert views[0].data.ptr == fused.gate_up.data[num_experts].data.ptr
    assert views[1].data.ptr == fused.down.data[num_experts].data.ptr
    assert np.array_equal(step().get(), plain)
    monkeypatch.delenv(moe.L2_PREFETCH_ENV)
    assert moe.l2_prefetch_mode() == moe.L2_PREFETCH_DEFAULT_MODE


@pytest.mark.parametrize("tokens", [1, 16, 64, 200])
def test_moe_forward_add_norm_equals_unfused(cuda_backend, rng, monkeypatch, tokens):
    """moe_forward(add_norm=...) = add_rms_norm(moe_forward(...)): with OPENINFER_MOE_COMBINE_NORM=1 fused up to
    COMBINE_NORM_MAX_TOKENS tokens (200: the two ops), the same bits either way, also as a CUDA graph replay."""
    hidden, inter, eps = 512, 128, 1e-6
    moe, _, fused, _, _ = _shared_fusion_case(cuda_backend, rng, 64, 6, 2, hidden, inter)
    x = cuda_backend.upload(bf16_random(rng, tokens, hidden))
    residual, norm = cuda_backend.upload(bf16_random(rng, tokens, hidden)), cuda_backend.weight(bf16_random(rng, hidden))
    plain = _host(cuda_backend.add_rms_norm(moe.moe_forward(cuda_backend, x, fused), residual, norm, eps))
    monkeypatch.setenv(moe.COMBINE_NORM_ENV, "1")
    assert moe.combine_norm_wanted(tokens) is (tokens <= moe.COMBINE_NORM_MAX_TOKENS)
    eager, replay = _replayed(lambda: moe.moe_forward(cuda_backend, x, fused, add_norm=(residual, norm, eps)))
    assert _equal(eager, plain) and _equal(replay, plain)


@pytest.mark.parametrize("gemv_kernel", ["mma", "mma_split4", "mma_split4_depth4", "mma_split4_depth8"])
@pytest.mark.parametrize("rows", [2, 16, 32])
def test_kimi_dense_gemv_matches_numpy(cuda_backend, rng, monkeypatch, gemv_kernel, rows):
    """OPENINFER_KIMI_DENSE_GEMV: the kimi plugin's bf16 dense projections of decode-sized steps as a tensor-core
    decode GEMV (the weight as one expert) equal NumPy's product within bf16 rounding, eagerly and as a CUDA graph
    replay (the same bits); outside its bounds (1 row, an LM-head-sized weight, a bias) cuBLAS runs; a bad name is a
    clear error."""
    from openinfer_kimi_k2 import cuda_ops

    from openinfer.backend.cuda.linear import CudaLinear

    out_features, in_features = 200, 520  # a partial 64-column block; K not a multiple of 64
    w = bf16_random(rng, out_features, in_features, scale=0.05)
    x = bf16_random(rng, rows, in_features)
    layer = CudaLinear(cuda_backend.upload(w), None)
    x_dev = cuda_backend.upload(x)
    monkeypatch.setenv(cuda_ops.DENSE_GEMV_ENV, gemv_kernel)
    assert cuda_ops.dense_gemv_kernel(x_dev, layer) == gemv_kernel
    eager = cuda_ops.cuda_linear(cuda_backend, x_dev, layer)
    reference = x.astype(np.float64) @ w.T.astype(np.float64)
    assert relative_error(cuda_backend.to_host(eager), reference) < 1e-2
    _, replay = _replayed(lambda: cuda_ops.cuda_linear(cuda_backend, x_dev, layer))
    assert np.array_equal(replay, eager.get())
    assert cuda_ops.dense_gemv_kernel(x_dev[:1], layer) is None
    assert cuda_ops.dense_gemv_kernel(x_dev, CudaLinear(layer.weight, cuda_backend.upload(w[:, 0]))) is None
    big = CudaLinear(cupy.zeros((cuda_ops.DENSE_GEMV_MAX_OUT + 64, in_features), cupy.uint16), None)
    assert cuda_ops.dense_gemv_kernel(x_dev, big) is None
    monkeypatch.setenv(cuda_ops.DENSE_GEMV_ENV, "wide")
    with pytest.raises(ValueError, match="OPENINFER_KIMI_DENSE_GEMV"):
        cuda_ops.dense_gemv_kernel(x_dev, layer)
