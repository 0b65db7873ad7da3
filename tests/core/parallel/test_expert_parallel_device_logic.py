"""The cuda expert-parallel MoE (``openinfer.parallel.expert_cuda``) on the CPU: CuPy replaced by
NumPy and the MoE kernels by stand-ins that keep their contracts — ``moe_sort`` lays the GEMM
tiles out in expert order and leaves the tile table past ``num_tiles`` unwritten, the grouped
GEMM runs tiles below ``num_tiles`` only (an expert outside the stack is an error) and never
writes other rows (NaN here). The ranks' summed outputs equal the single-rank NumPy MoE, so the
sentinel routing, the tile cut and the zeroed rows are right before any GPU runs them."""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest

from openinfer.backend.numpy_backend import NumpyBackend
from openinfer.moe import ExpertWeights, MoEWeights, RouterSpec, moe_forward, route, router_logits
from openinfer.parallel.fake import run_ranks
from openinfer.parallel.layout import ExpertShard

HIDDEN, INTER, EXPERTS, TOP_K, TILE = 16, 8, 8, 3, 4


@dataclass
class Grouping:
    ids: np.ndarray
    weights: np.ndarray
    sorted_slots: np.ndarray
    slot_pos: np.ndarray
    offsets: np.ndarray
    tile_expert: np.ndarray
    tile_row: np.ndarray
    num_tiles: np.ndarray
    max_tiles: int
    top_k: int


@dataclass
class Stacked:
    data: np.ndarray  # [E, N, K]

    @property
    def num_experts(self) -> int:
        return int(self.data.shape[0])


@dataclass
class DeviceMoE:
    router: RouterSpec
    gate: np.ndarray
    correction_bias: np.ndarray | None
    gate_up: Stacked
    down: Stacked
    tid2eid: np.ndarray | None = None


def stand_in_moe_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """Stand-ins of ``openinfer.backend.cuda.moe`` (expert GEMMs, combine) and ``.moe_routing`` (route, grouping)."""
    module = types.ModuleType("openinfer.backend.cuda.moe")
    routing = types.ModuleType("openinfer.backend.cuda.moe_routing")

    def route_on_device(x, gate, spec, correction_bias, token_ids=None, tid2eid=None):
        weights, ids = route(router_logits(x, gate, NumpyBackend()), spec, correction_bias, token_ids, tid2eid)
        return ids.astype(np.int32), weights.astype(np.float32)

    def group_by_expert(ids, weights, num_experts):
        flat = ids.reshape(-1)
        tiles = -(-flat.size // TILE) + min(num_experts, flat.size)
        counts = np.bincount(flat, minlength=num_experts)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        order = np.argsort(flat, kind="stable").astype(np.int32)
        slot_pos = np.empty_like(order)
        slot_pos[order] = np.arange(order.size, dtype=np.int32)
        garbage = np.random.default_rng(0).integers(0, 1 << 20, size=max(tiles, 1)).astype(np.int32)
        tile_expert, tile_row, used = garbage.copy(), garbage.copy(), 0
        for expert in range(num_experts):  # expert order, as moe_sort writes them
            for row in range(0, int(counts[expert]), TILE):
                tile_expert[used], tile_row[used] = expert, offsets[expert] + row
                used += 1
        return Grouping(ids, weights, order, slot_pos, offsets, tile_expert, tile_row,
                        np.array([used], np.int32), tiles, int(ids.shape[1]))

    def grouped_gemm(a, weight, grouping, gather):
        out = np.full((grouping.sorted_slots.size, weight.data.shape[1]), np.nan, np.float32)
        for tile in range(int(grouping.num_tiles[0])):
            expert, first = int(grouping.tile_expert[tile]), int(grouping.tile_row[tile])
            if expert >= weight.num_experts:
                raise IndexError(f"tile {tile} reads expert {expert} of a {weight.num_experts}-expert stack")
            rows = np.arange(first, min(first + TILE, int(grouping.offsets[expert + 1])))
            source = a[grouping.sorted_slots[rows] // grouping.top_k] if gather else a[rows]
            out[rows] = source @ weight.data[expert].T
        return out

    def combine(y, grouping, shared, hidden):
        picked = y[grouping.slot_pos.reshape(grouping.ids.shape)]  # [T, k, H]
        out = np.einsum("tk,tkh->th", grouping.weights, picked).astype(np.float32)
        return out if shared is None else out + shared

    routing.route, routing.group_by_expert, routing.ExpertGroupingDevice = route_on_device, group_by_expert, Grouping
    module.grouped_gemm, module.combine, module.DeviceMoE, module.ExpertLinear = grouped_gemm, combine, DeviceMoE, Stacked
    module.quantized_linear = None  # the shared experts here are plain linears
    return module, routing


@pytest.fixture
def expert_cuda(monkeypatch):
    package = types.ModuleType("openinfer.backend.cuda")
    package.moe, package.moe_routing = stand_in_moe_modules()
    monkeypatch.setitem(sys.modules, "cupy", np)
    monkeypatch.setitem(sys.modules, "openinfer.backend.cuda", package)
    monkeypatch.setitem(sys.modules, "openinfer.backend.cuda.moe", package.moe)
    monkeypatch.setitem(sys.modules, "openinfer.backend.cuda.moe_routing", package.moe_routing)
    monkeypatch.delitem(sys.modules, "openinfer.parallel.expert_cuda", raising=False)
    module = importlib.import_module("openinfer.parallel.expert_cuda")
    yield module
    sys.modules.pop("openinfer.parallel.expert_cuda", None)


def layer_and_stacks(seed: int = 0):
    rng = np.random.default_rng(seed)
    ops = NumpyBackend()
    gate_up = rng.standard_normal((EXPERTS, 2 * INTER, HIDDEN)).astype(np.float32) * 0.3
    down = rng.standard_normal((EXPERTS, HIDDEN, INTER)).astype(np.float32) * 0.3
    shared = ExpertWeights(ops.linear_weight(rng.standard_normal((4 * INTER, HIDDEN)).astype(np.float32) * 0.3),
                           ops.linear_weight(rng.standard_normal((HIDDEN, 2 * INTER)).astype(np.float32) * 0.3))
    router = RouterSpec(num_experts=EXPERTS, top_k=TOP_K, scoring="sigmoid", num_groups=4, topk_groups=2,
                        routed_scaling_factor=2.5)
    gate = rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32)
    bias = rng.standard_normal(EXPERTS).astype(np.float32) * 0.1
    layer = MoEWeights(router=router, gate=gate, correction_bias=bias, shared=shared,
                       experts=[ExpertWeights(ops.linear_weight(gate_up[e]), ops.linear_weight(down[e]))
                                for e in range(EXPERTS)])
    return layer, gate_up, down


@pytest.mark.parametrize(("ep", "tokens"), [(2, 13), (4, 13), (2, 1), (8, 5)])
def test_device_expert_parallel_equals_single_rank(expert_cuda, ep, tokens):
    layer, gate_up, down = layer_and_stacks()
    x = np.random.default_rng(tokens).standard_normal((tokens, HIDDEN)).astype(np.float32)
    expected = moe_forward(NumpyBackend(), x, layer)

    def rank(comm):
        held = ExpertShard(comm.rank, ep).experts(EXPERTS)
        device = DeviceMoE(layer.router, layer.gate, layer.correction_bias, Stacked(gate_up[held]), Stacked(down[held]))
        return expert_cuda.expert_parallel_moe_device(NumpyBackend(), x, device, layer.shared, None, comm, held)

    for out in run_ranks(ep, rank):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_local_grouping_drops_other_ranks_tiles_and_weights(expert_cuda):
    ids = np.array([[0, 5, 6], [7, 1, 4]], np.int32)
    weights = np.full((2, 3), 0.5, np.float32)
    grouping = expert_cuda.local_grouping(ids, weights, slice(4, 8))
    assert grouping.tile_expert[: int(grouping.num_tiles[0])].tolist() == [0, 1, 2, 3]  # experts 4..7, local ids
    np.testing.assert_array_equal(grouping.weights, [[0, 0.5, 0.5], [0.5, 0, 0.5]])


def test_a_stack_of_the_wrong_size_is_refused(expert_cuda):
    layer, gate_up, down = layer_and_stacks()
    device = DeviceMoE(layer.router, layer.gate, layer.correction_bias, Stacked(gate_up), Stacked(down))

    def rank(comm):
        return expert_cuda.expert_parallel_moe_device(NumpyBackend(), np.zeros((2, HIDDEN), np.float32), device,
                                                      None, None, comm, ExpertShard(comm.rank, 2).experts(EXPERTS))

    with pytest.raises(ValueError, match="holds 8 stacked experts"):
        run_ranks(2, rank)
