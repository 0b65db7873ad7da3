"""The CUDA launch-shape rules of ``kernel_plan`` (pure Python, so they are checked on the CPU): the
switches' defaults and errors, and the grids they pick at DeepSeek-V4-Flash shapes on an H100 (132 SMs)."""

import pytest
from openinfer_deepseek_v4 import kernel_plan

H100_SMS = 132


def test_attention_splits_default_is_auto_and_one_forces_a_single_run():
    assert kernel_plan.attention_splits_setting({}) == "auto"
    assert kernel_plan.attention_splits_setting({"OPENINFER_DSV4_ATTENTION_SPLITS": "1"}) == "1"
    # batch 1, 64 heads in 2-warp blocks: 32 blocks, so split until 2 × 132 blocks (9 runs), capped by keys
    assert kernel_plan.attention_splits("auto", 32, 128 + 512, H100_SMS) == 9
    assert kernel_plan.attention_splits("auto", 32, 40, H100_SMS) == 2  # a run needs 32 keys
    assert kernel_plan.attention_splits("auto", 64 * 8, 640, H100_SMS) == 1  # batch 64 fills the GPU
    assert kernel_plan.attention_splits("1", 32, 640, H100_SMS) == 1
    assert kernel_plan.attention_splits(4, 32, 640, H100_SMS) == 4


@pytest.mark.parametrize("value", ["0", "17", "two", ""])
def test_attention_splits_bad_setting_is_a_clear_error(value):
    with pytest.raises(ValueError, match="OPENINFER_DSV4_ATTENTION_SPLITS"):
        kernel_plan.attention_splits_setting({"OPENINFER_DSV4_ATTENTION_SPLITS": value})


def test_indexer_split():
    assert kernel_plan.indexer_split_setting({}) == "auto"
    assert kernel_plan.indexer_split_setting({"OPENINFER_DSV4_INDEXER_SPLIT": "fixed"}) == "fixed"
    with pytest.raises(ValueError, match="OPENINFER_DSV4_INDEXER_SPLIT"):
        kernel_plan.indexer_split_setting({"OPENINFER_DSV4_INDEXER_SPLIT": "many"})
    fixed = kernel_plan.indexer_entries_per_block("fixed", 1, 1024, H100_SMS)
    assert fixed == kernel_plan.INDEX_ENTRIES_PER_BLOCK
    # batch 1 at context 4k (1024 entries): 128 blocks of 8 instead of 4 blocks of 256
    assert kernel_plan.indexer_entries_per_block("auto", 1, 1024, H100_SMS) == 8
    for tokens, entries in [(1, 1), (3, 1040), (64, 1040), (256, 16384), (4096, 262144)]:
        per_block = kernel_plan.indexer_entries_per_block("auto", tokens, entries, H100_SMS)
        assert kernel_plan.INDEX_MIN_ENTRIES_PER_BLOCK <= per_block <= fixed and per_block % 8 == 0
        assert tokens * -(-entries // per_block) >= min(H100_SMS, tokens * -(-entries // 8))  # fills the GPU


def test_fp8_linear_default_is_bf16_and_stream_is_opt_in():
    assert kernel_plan.fp8_linear_setting({}) == "bf16"
    assert kernel_plan.fp8_linear_setting({"OPENINFER_DSV4_FP8_LINEAR": "stream"}) == "stream"
    with pytest.raises(ValueError, match="OPENINFER_DSV4_FP8_LINEAR"):
        kernel_plan.fp8_linear_setting({"OPENINFER_DSV4_FP8_LINEAR": "fp8"})


def test_hc_split_default_is_auto_and_auto_fills_the_gpu():
    assert kernel_plan.hc_split_setting({}) == "auto"
    assert kernel_plan.hc_split_setting({"OPENINFER_DSV4_HC_SPLIT": "1"}) == "1"
    with pytest.raises(ValueError, match="OPENINFER_DSV4_HC_SPLIT"):
        kernel_plan.hc_split_setting({"OPENINFER_DSV4_HC_SPLIT": "2"})
    # batch 1, 24 mixing logits: 11 slices each -> 264 blocks = 2 x 132; the head's 4 logits: capped at 16
    assert kernel_plan.hc_mix_splits(1, 24, H100_SMS) == 11
    assert kernel_plan.hc_mix_splits(1, 4, H100_SMS) == kernel_plan.MAX_MIX_SPLITS
    assert kernel_plan.hc_mix_splits(64, 24, H100_SMS) == 1  # 1536 blocks already


def test_fp8_linear_splits_fill_the_gpu_at_decode_and_leave_no_split_empty():
    # V4-Flash at batch 1 on 132 SMs: wq_a [1024, 4096] is 16 blocks -> 16 splits of 2 of its 32 steps
    assert kernel_plan.fp8_linear_splits(1, 1024, 4096, H100_SMS) == 16
    assert kernel_plan.fp8_linear_splits(1, 4096, 8192, H100_SMS) == 5  # wo_b: 64 blocks
    assert kernel_plan.fp8_linear_splits(1, 32768, 1024, H100_SMS) == 1  # wq_b: 512 blocks
    assert kernel_plan.fp8_linear_splits(64, 1024, 4096, H100_SMS) == 16  # one block row: as at batch 1
    assert kernel_plan.fp8_linear_splits(65, 1024, 4096, H100_SMS) == 1  # past one block row: no split
    for out_features in (64, 512, 1024, 4096):
        for in_features in (256, 1536, 4096):
            splits = kernel_plan.fp8_linear_splits(1, out_features, in_features, H100_SMS)
            steps = -(-in_features // 128)
            assert (splits - 1) * -(-steps // splits) < steps  # the last split has a step


def test_stream_stages_default_four_only_where_the_ring_fits():
    assert kernel_plan.stream_stages_setting({}) == "4"
    assert kernel_plan.stream_stages_setting({"OPENINFER_DSV4_STREAM_STAGES": "2"}) == "2"
    with pytest.raises(ValueError, match="OPENINFER_DSV4_STREAM_STAGES"):
        kernel_plan.stream_stages_setting({"OPENINFER_DSV4_STREAM_STAGES": "3"})
    assert [kernel_plan.stream_stages("4", chunks) for chunks in (1, 2, 8)] == [4, 4, 2]
    assert kernel_plan.stream_stages("2", 1) == 2


def test_attention_kernel_default_auto_specialises_head_dim_512():
    assert kernel_plan.attention_kernel_setting({}) == "auto"
    assert kernel_plan.attention_kernel_setting({"OPENINFER_DSV4_ATTENTION_KERNEL": "generic"}) == "generic"
    with pytest.raises(ValueError, match="OPENINFER_DSV4_ATTENTION_KERNEL"):
        kernel_plan.attention_kernel_setting({"OPENINFER_DSV4_ATTENTION_KERNEL": "d512"})
    assert kernel_plan.attention_kernel("auto", 512) == "dsv4_sparse_attention_d512"
    assert kernel_plan.attention_kernel("auto", 128) == "dsv4_sparse_attention"
    assert kernel_plan.attention_kernel("generic", 512) == "dsv4_sparse_attention"


def test_start_up_kernels_are_kernels_of_the_file_each_cut_out_alone(monkeypatch):
    """Every start-up kernel is defined in kernels/dsv4.cu, and the core loader can cut each out of
    the file as a module of its own (the one-kernel modules built from before the weight load);
    the attention kernel follows the setting and head dim."""
    import importlib
    import sys
    import types
    from importlib import resources

    device = types.SimpleNamespace(use=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i: device)))
    name = "openinfer.backend.cuda.loader"
    monkeypatch.delitem(sys.modules, name, raising=False)
    loader = importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)  # other tests import it against their own CuPy
    text = (resources.files("openinfer_deepseek_v4") / "kernels" / "dsv4.cu").read_text()
    defined = {found for found, _, _ in loader.kernel_definitions(text)}
    for setting, head_dim in (("auto", 512), ("auto", 128), ("generic", 512)):
        wanted = kernel_plan.start_up_kernels(setting, head_dim)
        assert set(wanted) <= defined and len(set(wanted)) == len(wanted)
        assert kernel_plan.attention_kernel(setting, head_dim) in wanted
    assert "dsv4_sparse_attention_d512" in kernel_plan.start_up_kernels("auto", 512)
    assert "dsv4_sparse_attention" in kernel_plan.start_up_kernels("generic", 512)
    for kernel in kernel_plan.FORWARD_KERNELS + ("dsv4_sparse_attention", "dsv4_sparse_attention_d512"):
        alone = loader.kernel_subset(text, (kernel,))
        assert alone is not None
        assert {found for found, _, _ in loader.kernel_definitions(alone)} == {kernel}
