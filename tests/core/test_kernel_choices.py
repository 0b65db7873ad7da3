"""The attention kernels' environment switches (openinfer.backend.cuda.kernel_choices, no CuPy
needed): defaults, validation with the variable's name in the error, read once per process until
refresh_kernel_choices(), and the sm90 shared-memory budget."""

from __future__ import annotations

import itertools

import pytest

from openinfer.backend.cuda import kernel_choices as choices
from openinfer.backend.cuda.kernel_choices import (
    DECODE_KERNEL_ENV,
    MIXED_DECODE_ENV,
    PREFILL_KERNEL_ENV,
    SHORT_QUERY_ENV,
    SM90_ENV,
    kernel_choices,
    refresh_kernel_choices,
    sm90_head_pairs,
    sm90_kv_loads,
    sm90_schedule,
    sm90_shared_bytes,
    sm90_tma_min_context,
    sm90_variant,
    wanted_decode_kernel,
)

ALL_ENV = [PREFILL_KERNEL_ENV, SHORT_QUERY_ENV, MIXED_DECODE_ENV, DECODE_KERNEL_ENV, *SM90_ENV.values()]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    refresh_kernel_choices()
    yield
    monkeypatch.undo()
    refresh_kernel_choices()


def test_defaults_where_the_environment_is_silent():
    assert kernel_choices() == choices.KernelChoices(
        prefill="auto", short_query=choices.SHORT_QUERY_VALUES[choices.SHORT_QUERY_DEFAULT],
        mixed_decode=choices.MIXED_DECODE_DEFAULT)
    assert wanted_decode_kernel() == "mma"
    default = sm90_variant(128)
    assert default.kv_head_major_grid == (choices.SM90_GRID == "kv_head")
    assert default.batched_page_reads == (choices.SM90_PAGE_READS == "batched")
    assert (default.pingpong, default.intra_wg_overlap) == (choices.SM90_PINGPONG, choices.SM90_OVERLAP)
    assert default.stages == choices.SM90_STAGES[128] and not default.skip_kv_loads
    assert (sm90_kv_loads(), sm90_schedule()) == (choices.SM90_KV_LOADS, choices.SM90_SCHEDULE)
    defines = default.defines(128, 16)
    assert (defines["PAGE_ID_PREFETCH"], defines["SPLIT_KV"], defines["EARLY_RESCALE"],
            defines["LEAN_ARRIVALS"]) == (int(128 in choices.SM90_PAGE_PREFETCH_HEAD_DIMS), int(choices.SM90_SPLIT_KV),
                                         int(choices.SM90_EARLY_RESCALE), int(choices.SM90_LEAN_ARRIVALS))
    assert (defines["DESCRIPTOR_ADDS"], defines["SKIP_UNIT_RESCALE"], defines["ORDERED_SOFTMAX"],
            defines["RESCALE_SLACK"]) == (int(128 in choices.SM90_LEAN_SOFTMAX_HEAD_DIMS),) * 2 + (
                int(128 in choices.SM90_LEAN_SOFTMAX_HEAD_DIMS and choices.SM90_OVERLAP),
                int(128 in choices.SM90_LEAN_SOFTMAX_HEAD_DIMS))
    assert sm90_variant(256).defines(256, 16)["SKIP_UNIT_RESCALE"] == int(256 in choices.SM90_LEAN_SOFTMAX_HEAD_DIMS)
    for head_dim, stages in choices.SM90_STAGES.items():  # the default rings fit the shared memory
        assert sm90_shared_bytes(head_dim, stages) <= choices.SM90_MAX_SHARED_BYTES


def test_switches_are_read_once_until_refreshed(monkeypatch):
    before = (kernel_choices(), wanted_decode_kernel(), sm90_variant(128))
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "mma")
    monkeypatch.setenv(SHORT_QUERY_ENV, "1")
    monkeypatch.setenv(MIXED_DECODE_ENV, "1")
    monkeypatch.setenv(DECODE_KERNEL_ENV, "split")
    for key, value in {"grid": "head", "page_reads": "row", "pingpong": "0", "stages": "2"}.items():
        monkeypatch.setenv(SM90_ENV[key], value)
    assert (kernel_choices(), wanted_decode_kernel(), sm90_variant(128)) == before  # no re-read per call
    refresh_kernel_choices()
    assert kernel_choices() == choices.KernelChoices(prefill="mma", short_query="on", mixed_decode=True)
    monkeypatch.setenv(SHORT_QUERY_ENV, "0")
    refresh_kernel_choices()
    assert kernel_choices().short_query == "off"
    assert wanted_decode_kernel() == "split"
    chosen = sm90_variant(128)
    assert not chosen.kv_head_major_grid and not chosen.batched_page_reads and not chosen.pingpong
    assert chosen.stages == 2 and chosen.defines(128, 16)["KV_HEAD_MAJOR_GRID"] == 0


@pytest.mark.parametrize("name,value", [(PREFILL_KERNEL_ENV, "sm80"), (SHORT_QUERY_ENV, "yes"),
                                        (MIXED_DECODE_ENV, "on"),
                                        (DECODE_KERNEL_ENV, "flash"), (SM90_ENV["grid"], "tile"),
                                        (SM90_ENV["pingpong"], "true"), (SM90_ENV["stages"], "1"),
                                        (SM90_ENV["stages"], "x"), (SM90_ENV["kv_loads"], "bulk"),
                                        (SM90_ENV["schedule"], "dynamic"), (SM90_ENV["early_rescale"], "yes"),
                                        (SM90_ENV["skip_unit_rescale"], "on"), (SM90_ENV["descriptor_adds"], "2"),
                                        (SM90_ENV["ordered_softmax"], "true"), (SM90_ENV["head_pairs"], "2"),
                                        (SM90_ENV["tma_min_context"], "-1"), (SM90_ENV["tma_min_context"], "2k")])
def test_bad_values_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    refresh_kernel_choices()
    with pytest.raises(ValueError, match=name):
        kernel_choices()
        wanted_decode_kernel()
        sm90_variant(128)
        sm90_kv_loads()
        sm90_schedule()
        sm90_tma_min_context(128)


def test_sm90_stages_must_fit_the_shared_memory(monkeypatch):
    monkeypatch.setenv(SM90_ENV["stages"], "3")
    refresh_kernel_choices()
    assert sm90_variant(128).stages == 3
    with pytest.raises(ValueError, match="shared memory"):
        sm90_variant(256)  # 3 stages of 64 KB + the 64 KB Q tile do not fit


def test_sm90_kv_loads_and_schedule_are_read_once(monkeypatch):
    """OPENINFER_SM90_KV_LOADS / OPENINFER_SM90_SCHEDULE (read here beside the other switches, used by
    attention.py): every value accepted after a refresh, then kept until the next one."""
    assert (sm90_kv_loads(), sm90_schedule()) == (choices.SM90_KV_LOADS, choices.SM90_SCHEDULE)
    for loads, schedule in itertools.product(choices.SM90_KV_LOAD_MODES, choices.SM90_SCHEDULES):
        monkeypatch.setenv(SM90_ENV["kv_loads"], loads)
        monkeypatch.setenv(SM90_ENV["schedule"], schedule)
        refresh_kernel_choices()
        assert (sm90_kv_loads(), sm90_schedule()) == (loads, schedule)
    monkeypatch.setenv(SM90_ENV["kv_loads"], "cp_async")
    monkeypatch.setenv(SM90_ENV["schedule"], "grid")
    assert (sm90_kv_loads(), sm90_schedule()) == (loads, schedule)  # no re-read before a refresh


def test_session7_refinements_turn_off_one_by_one(monkeypatch):
    for key in ("descriptor_adds", "skip_unit_rescale", "ordered_softmax", "rescale_slack"):
        monkeypatch.setenv(SM90_ENV[key], "0")
        refresh_kernel_choices()
        assert sm90_variant(128).defines(128, 16)[key.upper()] == 0


def test_sm90_refinement_switches_reach_the_defines(monkeypatch):
    for key in ("page_prefetch", "split_kv", "early_rescale", "lean_arrivals", "descriptor_adds",
                "skip_unit_rescale", "ordered_softmax", "rescale_slack"):
        monkeypatch.setenv(SM90_ENV[key], "1")
    refresh_kernel_choices()
    defines = sm90_variant(128).defines(128, 16)
    assert defines["PAGE_ID_PREFETCH"] == defines["SPLIT_KV"] == defines["LEAN_ARRIVALS"] == 1
    assert defines["DESCRIPTOR_ADDS"] == defines["SKIP_UNIT_RESCALE"] == defines["ORDERED_SOFTMAX"] == 1
    assert defines["RESCALE_SLACK"] == 1
    assert sm90_variant(256).defines(256, 16)["DESCRIPTOR_ADDS"] == 1
    assert defines["EARLY_RESCALE"] == 1
    # head_dim 256 keeps the late rescale (it would spill beside the TMA producer's options), and the
    # early rescale needs the overlapped loop
    assert sm90_variant(256).defines(256, 16)["EARLY_RESCALE"] == 0
    monkeypatch.setenv(SM90_ENV["overlap"], "0")
    refresh_kernel_choices()
    assert sm90_variant(128).defines(128, 16)["EARLY_RESCALE"] == 0
    assert sm90_variant(128).defines(128, 16)["ORDERED_SOFTMAX"] == 0  # pins the overlapped loop's order only


def test_head_pairs_only_where_two_heads_share_a_kv_head(monkeypatch):
    assert not sm90_head_pairs(sm90_variant(128), 128, 32, 8) or choices.SM90_HEAD_PAIRS
    monkeypatch.setenv(SM90_ENV["head_pairs"], "1")
    refresh_kernel_choices()
    variant = sm90_variant(128)
    assert sm90_head_pairs(variant, 128, 32, 8) and sm90_head_pairs(variant, 128, 16, 2)
    assert not sm90_head_pairs(variant, 128, 4, 4)  # MHA: each head has its own K/V
    assert not sm90_head_pairs(variant, 128, 12, 4)  # a group of 3 cannot pair up
    assert not sm90_head_pairs(sm90_variant(256), 256, 32, 8)  # built for head_dim 128


def test_tma_min_context_per_head_size_until_the_environment_sets_it(monkeypatch):
    """auto's TMA threshold: SM90_TMA_MIN_CONTEXT's per head size (every context at 128 since E1),
    OPENINFER_SM90_TMA_MIN_CONTEXT for every head size once set (read once, like the others); the
    page-id prefetch follows SM90_PAGE_PREFETCH_HEAD_DIMS unless its own variable says otherwise."""
    for head_dim, tokens in choices.SM90_TMA_MIN_CONTEXT.items():
        assert sm90_tma_min_context(head_dim) == tokens
        assert sm90_variant(head_dim).page_prefetch == (head_dim in choices.SM90_PAGE_PREFETCH_HEAD_DIMS)
    monkeypatch.setenv(SM90_ENV["tma_min_context"], "4096")
    monkeypatch.setenv(SM90_ENV["page_prefetch"], "0")
    assert sm90_tma_min_context(128) == choices.SM90_TMA_MIN_CONTEXT[128]  # not re-read yet
    refresh_kernel_choices()
    assert sm90_tma_min_context(128) == sm90_tma_min_context(256) == 4096
    assert not sm90_variant(128).page_prefetch
