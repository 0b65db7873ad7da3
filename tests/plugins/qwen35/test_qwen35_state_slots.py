"""``openinfer.kv.state_slots.StateSlots`` (exact slot ids) and the model's slot lifecycle."""

import numpy as np
import pytest

from openinfer.kv.state_slots import NULL_SLOT_ID, StateSlots
from tests.plugins.qwen35.qwen35_helpers import Driver, load_model


def test_slots_are_handed_out_lowest_first_and_never_the_null_slot():
    slots = StateSlots(4)
    assert slots.num_usable_slots == 3 and slots.num_free_slots == 3
    assert [slots.allocate(r) for r in ("a", "b", "c")] == [1, 2, 3]
    assert NULL_SLOT_ID not in slots.owners().values()
    assert not slots.can_allocate()
    with pytest.raises(MemoryError, match="no free state slot"):
        slots.allocate("d")


def test_freed_slots_are_reused_lowest_id_first():
    slots = StateSlots(5)
    for r in "abcd":
        slots.allocate(r)
    assert slots.free("c") and slots.free("a")
    assert slots.num_free_slots == 2
    assert slots.allocate("e") == 1
    assert slots.allocate("f") == 3
    assert slots.owners() == {"b": 2, "d": 4, "e": 1, "f": 3}


def test_allocate_is_idempotent_and_free_is_safe_to_repeat():
    slots = StateSlots(3)
    assert slots.allocate("a") == slots.allocate("a") == 1
    assert slots.num_used_slots == 1
    assert slots.free("a") is True
    assert slots.free("a") is False
    assert slots.free("never") is False
    assert slots.num_free_slots == 2 and not slots.has("a")


def test_a_pool_needs_a_usable_slot():
    with pytest.raises(ValueError, match="at least 2 slots"):
        StateSlots(1)


def test_the_state_spec_declares_each_gdn_layer(tiny):
    from openinfer_qwen35.state import bytes_per_slot

    from openinfer import FullAttentionSpec, RecurrentStateSpec, group_specs

    path, _ = tiny
    model = load_model(path)
    specs = model.kv_cache_specs()
    config = model.config
    assert len(specs) == config.num_hidden_layers
    for i, spec in enumerate(specs):
        if i in config.full_layer_ids:
            assert spec == FullAttentionSpec(config.num_key_value_heads, config.head_dim, "float32")
        else:
            assert isinstance(spec, RecurrentStateSpec)
            assert [(t.name, t.shape) for t in spec.tensors] == [
                ("conv", (config.linear_conv_kernel_dim - 1, config.conv_dim)),
                ("ssm", (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim))]
    groups = group_specs(specs)
    assert len(groups.groups) == 2 and groups.bytes_per_slot == bytes_per_slot(config)


def test_a_reused_slot_starts_from_a_zero_state(tiny):
    path, _ = tiny
    model = load_model(path)
    prompt = np.random.default_rng(0).integers(3, 96, 75).tolist()
    other = np.random.default_rng(1).integers(3, 96, 70).tolist()
    driver = Driver(model, num_slots=2)  # one usable slot: every request reuses slot 1
    gdn = next(i for i, spec in enumerate(model.kv_cache_specs()) if not spec.paged)
    first = driver.step({"a": prompt})[0]
    assert driver.kv.state_slot("a") == 1
    assert np.any(driver.kv_cache[gdn]["ssm"][1] != 0)
    driver.release("a")
    driver.step({"b": other})
    driver.release("b")
    again = driver.step({"c": prompt})[0]
    assert driver.state_slots.owners() == {"c": 1}
    np.testing.assert_array_equal(first, again)


def test_a_batch_without_state_slots_is_an_error(tiny):
    from openinfer import ForwardBatch

    path, _ = tiny
    model = load_model(path)
    driver = Driver(model)
    batch = ForwardBatch(token_ids=np.array([5], np.int32), positions=np.array([0], np.int32),
                         query_start=np.array([0, 1], np.int32), context_lens=np.array([1], np.int32),
                         block_tables=np.array([[1]], np.int32), slot_mapping=np.array([16], np.int32),
                         logits_rows=np.array([0], np.int32), max_query_len=1, max_context_len=1)
    with pytest.raises(ValueError, match="one state slot per sequence"):
        model.forward(batch, driver.kv_cache)
