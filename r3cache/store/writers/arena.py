"""BlockArena: the in-process tier's blocks, in memory the writer process maps too.

With a helper process behind the tier, a new block would be copied twice on the engine's
thread: into the tier, and into the ring for the helper. The tier's blocks live in this
arena instead, and a put sends the helper only their slot numbers: the tier's copy is the
one the helper encodes. A slot is sent with a put's sequence number, and the helper
acknowledges each put once it has encoded it, in the mapping's last words (readable
without reading the socket, as the ring's); the tier writes into a slot again only when
every put that sent it has been acknowledged (``claim``, which waits for the helper if
need be), so the helper never reads a slot while it changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from r3cache.errors import StoreFullError
from r3cache.layout import RoutingLayout
from r3cache.store.pool import BlockPool
from r3cache.store.writers.slots import SharedSlots


class BlockArena(BlockPool):
    """Own a shared mapping of block slots, and which puts sent each to the helper."""

    def __init__(self, layout: RoutingLayout, capacity: int, fd: int | None = None) -> None:
        super().__init__(layout)
        # Not populated: pages come as the tier fills, as the heap's would. The helper
        # writes two words after the slots: the latest put it encoded (every one before
        # it is encoded too), and how many blocks of the arena it has encoded.
        self._shared = SharedSlots(layout, capacity, fd, words=2)
        self.capacity = capacity
        self.fd = self._shared.fd
        self.slots = self._shared.slots
        self._words = self._shared.words
        self._sent = np.zeros(capacity, np.int64)  # the latest put that sent each slot
        self.latest = 0  # the latest put that sent any (puts are numbered from 1)
        self._sent_blocks = 0  # blocks sent, counted as the helper counts them encoded
        # Set by the writer: returns once ``acked`` reaches its argument, or raises.
        self.await_acked: Callable[[int], None] | None = None

    @classmethod
    def sized(cls, layout: RoutingLayout, nbytes: int) -> BlockArena:
        return cls(layout, max(nbytes // layout.block_nbytes, 1))

    def _new(self, first: int, n: int) -> list[np.ndarray]:
        # A tier holds at most ``capacity`` blocks (its max_bytes is this arena's size).
        if first + n > self.capacity:
            raise StoreFullError(f"an arena of {self.capacity} blocks has no {n} more "
                                 "free (is it shared by two stores?)")
        return list(self.slots[first : first + n])

    @property
    def acked(self) -> int:
        """The latest put the helper encoded: the slots of every put up to it are free."""
        return int(self._words[0])

    @property
    def unencoded(self) -> int:
        """Blocks sent to the helper that it has not encoded yet."""
        return self._sent_blocks - int(self._words[1])

    def claim(self, slots: list[int]) -> None:
        """Return once the helper has encoded every put that sent one of ``slots``; raises
        (StoreUnavailableError after the writer's wait, WriterError) otherwise."""
        if self.latest <= self.acked or not slots:  # most claims: nothing in flight
            return
        needed = int(self._sent[np.fromiter(slots, np.int64, len(slots))].max())
        if needed > self.acked:
            self.await_acked(needed)

    def sent(self, slots: Sequence[int], sequence: int) -> None:
        """``slots`` went to the helper with put ``sequence``."""
        self._sent[np.fromiter(slots, np.int64, len(slots))] = sequence
        self.latest = sequence
        self._sent_blocks += len(slots)

    def acknowledge(self, sequence: int, blocks: int) -> None:
        """(Helper side) every put up to ``sequence`` is encoded, ``blocks`` more blocks
        of the arena with them."""
        self._words[1] += blocks
        self._words[0] = sequence

    def close(self) -> None:
        del self.slots, self.arrays, self._words
        self._shared.close()
