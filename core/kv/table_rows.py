"""Block tables kept as rows of one int32 array per KV cache group, updated in place.

The per-request lists in ``KVCacheManager`` are the truth; this mirror lets a step's batch take
every request's table with one gather instead of converting each list every step::

    row      group g's array  [rows, width]            lengths[g][row]
     0       [ 5  6  7  8  0  0 ]   request "a"            4
     1       [ 9 12  0  0  0  0 ]   request "b"            2
     2       [ 0  0  0  0  0  0 ]   free
    gather(g, rows=[1, 0]) -> [[9 12 0 0], [5 6 7 8]]      (width = the longest table there)

Invariant: every entry past a row's length is 0, the null block, so a gathered table is
already padded. A request keeps one row (the same in every group) from ``start_request`` to
``free_request``; appending blocks writes only the new entries, a sliding window's released
entries are written as 0. Rows and width grow by doubling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableRows:
    def __init__(self, num_groups: int, rows: int = 16, width: int = 16):
        self.arrays = [np.zeros((rows, width), np.int32) for _ in range(num_groups)]
        self.lengths = [np.zeros(rows, np.int32) for _ in range(num_groups)]
        self._free = list(range(rows - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.arrays[0].shape[0] if self.arrays else 0

    def assign(self) -> int:
        """A free row (all zeros) for a new request."""
        if not self._free:
            old = self.capacity
            self.arrays = [np.concatenate([a, np.zeros_like(a)]) for a in self.arrays]
            self.lengths = [np.concatenate([n, np.zeros_like(n)]) for n in self.lengths]
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def write(self, group: int, row: int, start: int, block_ids: Sequence[int]) -> None:
        """``table[start : start + len(block_ids)] = block_ids`` for the request in ``row``."""
        end = start + len(block_ids)
        array = self.arrays[group]
        if end > array.shape[1]:
            width = max(end, 2 * array.shape[1])
            self.arrays[group] = array = np.concatenate(
                [array, np.zeros((array.shape[0], width - array.shape[1]), np.int32)], axis=1)
        array[row, start:end] = block_ids
        self.lengths[group][row] = max(int(self.lengths[group][row]), end)

    def release(self, row: int) -> None:
        """Zero the row (up to its length) and free it."""
        for array, lengths in zip(self.arrays, self.lengths, strict=True):
            array[row, : lengths[row]] = 0
            lengths[row] = 0
        self._free.append(row)

    def gather(self, group: int, rows: np.ndarray) -> np.ndarray:
        """``[len(rows), max length]`` tables of ``rows`` (at least one column), null-padded."""
        width = max(1, int(self.lengths[group][rows].max())) if len(rows) else 1
        return self.arrays[group][rows, :width]
