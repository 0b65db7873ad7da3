"""State slots: a fixed pool of per-request slots for models with recurrent state.

Attention layers grow with the context and live in the paged KV pool; a recurrent layer
(Gated DeltaNet, Mamba, RWKV) keeps a *constant-size* state per request instead (a conv
window plus a matrix state). Its tensors are allocated once by the model with a leading
``num_slots`` axis, and this pool only hands out the row indices::

    slot ids        0       1       2       3       4    ...  N-1
                 [null ] [ req A ] [free ] [ req B ] [free ] ... [free ]
    owner           -       "a"      -       "b"      -           -

    model tensors, per recurrent layer (the model picks dtype and shape):
    conv_state   [N, kernel - 1, conv_dim]   rows indexed by slot id
    ssm_state    [N, heads, dk, dv] fp32      rows indexed by slot id

Slot 0 is the *null slot*: padded batch entries (CUDA-graph buckets) point at it, so a
kernel writing state for a padding row scribbles on memory no request owns.

Invariants:
- A slot is owned by exactly one request or it is in the free list, never both; the null
  slot is never handed out.
- A slot keeps its id for the whole life of its request, so a CUDA graph captured with
  slot indices as data reads and writes fixed addresses.
- The pool never clears tensors: a model zeroes a slot's state when a request's first
  chunk runs (its context starts at position 0), so a reused slot never leaks state.
- Freed slots are reused lowest id first (deterministic, keeps live state compact).
"""

from __future__ import annotations

import heapq

NULL_SLOT_ID = 0


class StateSlots:
    """``num_slots`` slot ids (``num_slots - 1`` usable); slot 0 is the null slot."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"a state-slot pool needs at least 2 slots (one is the null slot), got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(1, num_slots))  # a min-heap of free slot ids
        heapq.heapify(self._free)
        self._owned: dict[str, int] = {}  # request id -> slot id
        self._owner_of: dict[int, str] = {}  # slot id -> request id

    # --- queries ------------------------------------------------------------------------------

    @property
    def num_usable_slots(self) -> int:
        return self.num_slots - 1

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return len(self._owned)

    def can_allocate(self, num_slots: int = 1) -> bool:
        return num_slots <= len(self._free)

    def has(self, request_id: str) -> bool:
        return request_id in self._owned

    def slot_of(self, request_id: str) -> int:
        """The slot a live request owns; KeyError when it owns none."""
        return self._owned[request_id]

    def owners(self) -> dict[str, int]:
        """A copy of the request id → slot id map (for tests and metrics)."""
        return dict(self._owned)

    # --- verbs ---------------------------------------------------------------------------------

    def allocate(self, request_id: str) -> int:
        """Give ``request_id`` a slot (the lowest free id) and return it. Allocating again for
        a request that already owns a slot returns that slot. Raises MemoryError when the pool
        is exhausted; check ``can_allocate`` first."""
        if request_id in self._owned:
            return self._owned[request_id]
        if not self._free:
            raise MemoryError(f"no free state slot for request {request_id!r} "
                              f"({self.num_usable_slots} slots, all in use)")
        slot = heapq.heappop(self._free)
        self._owned[request_id] = slot
        self._owner_of[slot] = request_id
        return slot

    def free(self, request_id: str) -> bool:
        """Return a request's slot to the pool; False when it owned none (idempotent)."""
        slot = self._owned.pop(request_id, None)
        if slot is None:
            return False
        del self._owner_of[slot]
        heapq.heappush(self._free, slot)
        return True

    def free_slot(self, slot: int) -> bool:
        """Return a slot by id (whoever owns it); False when it is not in use."""
        owner = self._owner_of.get(slot)
        return owner is not None and self.free(owner)
