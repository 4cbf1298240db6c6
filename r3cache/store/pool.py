"""BlockPool: the arrays a store's blocks live in, numbered, reused as blocks come and go."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from r3cache.layout import RoutingLayout


class BlockPool:
    """Own block-sized arrays ("slots", by number) and which of them are free.

    A store keeps each block's slot number, not its array: an evicted block's slot then
    takes the next new block with no lookup, and a writer that reads the same memory
    (``writers.arena.BlockArena``) is told slot numbers.
    """

    def __init__(self, layout: RoutingLayout) -> None:
        self._shape, self._dtype = layout.block_shape, layout.dtype
        self.arrays: list[np.ndarray] = []  # slot n is arrays[n]
        self._free: list[int] = []  # slots given back

    def take(self, n: int) -> list[int]:
        """``n`` free slots: given back ones first, then new ones."""
        free = self._free
        reused = len(free) - min(n, len(free))
        slots = free[reused:]
        del free[reused:]
        first = len(self.arrays)
        self.arrays += self._new(first, n - len(slots))
        return slots + list(range(first, len(self.arrays)))

    def _new(self, first: int, n: int) -> list[np.ndarray]:
        """Arrays for ``n`` new slots from ``first`` on."""
        return [np.empty(self._shape, self._dtype) for _ in range(n)]

    def claim(self, slots: list[int]) -> None:
        """Return once nothing reads ``slots`` (in this process's memory: nothing does)."""

    def give_back(self, slots: Iterable[int]) -> None:
        """Slots no block occupies any more, claimed by the caller."""
        self._free += slots
