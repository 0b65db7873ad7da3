"""CPU CI for $OPENINFER_MLA_COMBINE_EXPAND (core/backend/cuda/mla.py imported against a stand-in CuPy): the
switch's values and where it applies (``combine_expand_columns``), and ``attend_and_expand`` running the split
combine and W_UV as one launch there and as ``combine_splits`` + ``expand_values`` elsewhere. The kernel's bits
are checked by tests/core/test_kimi_kernels_emulated.py (g++) and tests/gpu/test_mla_kernels.py."""

from __future__ import annotations

import importlib
import sys
import types
from importlib import resources

import pytest

from openinfer.mla import MLASpec

KIMI = MLASpec(num_heads=64, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, kv_lora_rank=512, scale=0.1)
MLA_MODULE = "openinfer.backend.cuda.mla"


@pytest.fixture
def cuda_mla(monkeypatch):
    """mla.py imported against a stand-in CuPy; the backend modules it pulled in removed again afterwards."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        ndarray=object, cuda=types.SimpleNamespace(Device=lambda device=None: None)))
    before = {name for name in sys.modules if name.startswith("openinfer.backend.cuda")}
    try:
        yield importlib.import_module(MLA_MODULE)
    finally:
        for name in [name for name in sys.modules if name.startswith("openinfer.backend.cuda")]:
            if name not in before:
                del sys.modules[name]


def test_switch_off_by_default(cuda_mla, monkeypatch):
    monkeypatch.delenv("OPENINFER_MLA_COMBINE_EXPAND", raising=False)
    assert cuda_mla.combine_expand_columns(1, 33, KIMI) == cuda_mla.DEFAULT_COMBINE_EXPAND == 0
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND", "0")
    assert cuda_mla.combine_expand_columns(1, 33, KIMI) == 0


def test_most_splits_where_the_fused_kernel_runs(cuda_mla, monkeypatch):
    """Where mla_combine_expand would run, heads x splits stay within OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS (unset
    or 0: no cap; 1,024: Kimi-K2's 64 heads 16 splits, Moonlight's 16 heads 64), at least 2; None where there is no cap
    or the kernel would not run; a bad value is a clear error."""
    moonlight = MLASpec(num_heads=16, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, kv_lora_rank=512, scale=0.1)
    many = MLASpec(num_heads=1024, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, kv_lora_rank=512, scale=0.1)
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND", "64")
    monkeypatch.delenv("OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS", raising=False)
    most = cuda_mla.combine_expand_most_splits
    assert most(1, KIMI) is None
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS", "0")
    assert most(1, KIMI) is None
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS", "1024")
    assert (most(1, KIMI), most(16, KIMI), most(1, moonlight), most(1, many)) == (16, 16, 64, 2)
    assert most(17, KIMI) is None  # past the fused kernel's rows
    for bad in ("-4", "many", "1.5"):
        monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS", bad)
        with pytest.raises(ValueError, match="OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS"):
            most(1, KIMI)
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS", "1024")
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND", "0")
    assert most(1, KIMI) is None  # the switch off: the kernel's own split count


@pytest.mark.parametrize("value", ["8", "128", "1", "yes", "on", " 16"])
def test_switch_rejects_other_values(cuda_mla, monkeypatch, value):
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND", value)
    with pytest.raises(ValueError, match="OPENINFER_MLA_COMBINE_EXPAND is 0 .* 16, 32, 64"):
        cuda_mla.combine_expand_columns(1, 33, KIMI)
    with pytest.raises(ValueError, match="OPENINFER_MLA_COMBINE_EXPAND"):  # even in a step with nothing to combine
        cuda_mla.combine_expand_columns(1, 1, KIMI)


@pytest.mark.parametrize("columns", [16, 32, 64])
def test_switch_applies_to_small_steps_with_splits(cuda_mla, monkeypatch, columns):
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND", str(columns))
    fits = cuda_mla.combine_expand_columns
    assert fits(1, 33, KIMI) == columns
    assert fits(16, 2, KIMI) == columns  # the row cap, the fewest splits
    assert fits(4, 64, KIMI) == columns  # COMBINE_SHARED_MAX_SPLITS
    assert fits(1, 1, KIMI) == 0  # no splits: nothing to combine
    assert fits(17, 8, KIMI) == 0  # past one mma tile of rows
    assert fits(0, 8, KIMI) == 0
    assert fits(1, 65, KIMI) == 0  # more splits than the shared combine takes (the loop: other bits)
    narrow_v = MLASpec(num_heads=16, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=48, kv_lora_rank=512, scale=0.1)
    assert fits(1, 8, narrow_v) == (columns if 48 % columns == 0 else 0)
    odd_latent = MLASpec(num_heads=16, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, kv_lora_rank=96, scale=0.1)
    assert fits(1, 8, odd_latent) == 0  # the latent not in 4 warps x 16-dim mma steps


def test_switch_reads_the_row_cap_from_the_kernel(cuda_mla):
    """COMBINE_EXPAND_MAX_TOKENS and the column choices are mla.cu's."""
    source = (resources.files("openinfer.kernels") / "mla.cu").read_text()
    assert f"#define COMBINE_EXPAND_MAX_TOKENS {cuda_mla.COMBINE_EXPAND_MAX_TOKENS} " in source
    assert "COMBINE_EXPAND_COLUMNS != 16 && COMBINE_EXPAND_COLUMNS != 32 && COMBINE_EXPAND_COLUMNS != 64" in source
    assert cuda_mla.COMBINE_EXPAND_CHOICES == (16, 32, 64)


@pytest.mark.parametrize(("switch", "splits", "expected"), [
    ("32", 33, ["attend", "combine_expand 32"]),
    ("0", 33, ["attend", "combine_splits", "expand_values"]),
    ("32", 1, ["attend", "expand_values"]),  # the kernel wrote o_latent: W_UV alone
    ("16", 80, ["attend", "combine_splits", "expand_values"]),
])
def test_attend_and_expand_dispatch(cuda_mla, monkeypatch, switch, splits, expected):
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND", switch)
    calls = []
    o_latent = types.SimpleNamespace(shape=(1, KIMI.num_heads, KIMI.kv_lora_rank))
    partials = cuda_mla.SplitPartials(object(), object(), splits) if splits > 1 else None

    def attend_splits(q_latent, q, cache, spec, batch, token_rows, num_sms, absorbed_kernel, q_pe_only,
                      latent_write, most_splits):
        calls.append("attend")
        assert (token_rows, num_sms, absorbed_kernel, q_pe_only, latent_write) == ("rows", 132, "tma", True, None)
        assert most_splits == (None if switch == "0" else 16)  # 1,024 head-splits over 64 heads (asked for below)
        return o_latent, partials

    monkeypatch.setattr(cuda_mla, "attend_splits", attend_splits)
    monkeypatch.setattr(cuda_mla, "combine_expand",
                        lambda p, o, w_uv, spec, out, columns: calls.append(f"combine_expand {columns}"))
    monkeypatch.setattr(cuda_mla, "combine_splits", lambda p, o, spec: calls.append("combine_splits"))
    monkeypatch.setattr(cuda_mla, "expand_values", lambda blas, o, w_uv, spec, out: calls.append("expand_values"))
    monkeypatch.setenv("OPENINFER_MLA_COMBINE_EXPAND_HEAD_SPLITS", "1024")
    q = types.SimpleNamespace(shape=(1, KIMI.num_heads * KIMI.qk_head_dim))
    cuda_mla.attend_and_expand(None, None, q, None, None, KIMI, None, None, "rows", 132, "tma", q_pe_only=True)
    assert calls == expected
