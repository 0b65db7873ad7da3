"""``openinfer.kv.state_slots.StateSlots`` (exact slot ids) and the model's slot lifecycle."""

import numpy as np
import pytest

from openinfer import OpenInferError
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


def test_a_reused_slot_starts_from_a_zero_state(tiny):
    path, _ = tiny
    model = load_model(path, max_num_seqs=1)  # one usable slot: every request reuses slot 1
    prompt = np.random.default_rng(0).integers(3, 96, 75).tolist()
    other = np.random.default_rng(1).integers(3, 96, 70).tolist()
    driver = Driver(model)
    first = driver.step({"a": prompt})[0]
    assert model.state.slots.slot_of("a") == 1
    assert np.any(model.state.ssm[0][1] != 0)
    driver.release("a")
    driver.step({"b": other})
    driver.release("b")
    again = driver.step({"c": prompt})[0]
    assert model.state.slots.owners() == {"c": 1}
    np.testing.assert_array_equal(first, again)


def test_continuing_without_a_slot_is_an_error(tiny):
    path, _ = tiny
    model = load_model(path)
    driver = Driver(model)
    driver.step({"a": [5, 6, 7]})
    model.release_request("a")  # the state is gone but the KV continues: refuse, do not guess
    with pytest.raises(OpenInferError, match="holds no state slot"):
        driver.step({"a": [8]})
