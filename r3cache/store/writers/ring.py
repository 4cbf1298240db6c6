"""BlockRing: shared memory through which the engine hands blocks to the writer process.

It carries the blocks that do not live in the in-process tier's arena (``arena``): a
publisher's, duplicates, blocks a tier full of pinned ones could not take. The engine
copies a put's blocks into consecutive slots of a memfd-backed mapping and
sends only their keys and slot numbers over the socket; the helper maps the same
memory, reads the rows in place, and acknowledges each put once it has encoded them.
Pickling 64 blocks for the socket cost the engine process ~0.4 ms of GIL-held copying
on this project's 2-core machine; copying them into the ring costs ~0.1 ms.

Slot numbers grow without bound; slot ``n`` lives at ``n % capacity``. The engine
owns ``head`` (the next slot it writes), the helper's acknowledgements move ``tail``
(every slot below it is free again). A put's slots are contiguous in memory: one that
would wrap past the end starts at slot 0 instead; the skipped slots are freed with the
next acknowledgement (they are cumulative), or at once if nothing is in flight. The
helper also writes its latest acknowledgement into the mapping's last 8 bytes, so the
slots in use can be read (for metrics) without reading the socket.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from r3cache.layout import RoutingLayout
from r3cache.store.writers.slots import SharedSlots

DEFAULT_RING_BYTES = 64 << 20


class BlockRing:
    """Own one shared mapping of ``capacity`` block slots, and (engine side) its cursors."""

    def __init__(self, layout: RoutingLayout, capacity: int, fd: int | None = None) -> None:
        self.capacity = capacity
        self._block_nbytes = layout.block_nbytes
        # Populated at once: a slot's first write would otherwise fault in (allocate and
        # zero) fresh shared pages in the engine's step, ~0.3 ms a step until the ring
        # has wrapped once (64 MiB: minutes of decoding). Start-up pays it instead.
        self._shared = SharedSlots(layout, capacity, fd, words=1, populate=True)
        self.fd = self._shared.fd
        self._map = self._shared.map
        self.slots = self._shared.slots
        self._acked = self._shared.words  # the helper's latest acknowledgement
        self.head = 0
        self.tail = 0

    @classmethod
    def sized(cls, layout: RoutingLayout, nbytes: int = DEFAULT_RING_BYTES) -> BlockRing:
        return cls(layout, max(nbytes // layout.block_nbytes, 1))

    def place(self, n: int) -> int | None:
        """Claim ``n`` contiguous slots (``n <= capacity``) and return the first's number,
        or None while too few are free (the helper has not acknowledged them yet)."""
        start = self.head
        if start % self.capacity + n > self.capacity:
            start += self.capacity - start % self.capacity  # wrap: begin at slot 0
        # Slots in flight are [tail, head); with none, the skipped ones hold nothing.
        tail = start if self.tail == self.head else self.tail
        if start + n - tail > self.capacity:
            return None
        self.head, self.tail = start + n, tail
        return start

    def write(self, start: int, blocks: list[np.ndarray]) -> None:
        """Copy whole blocks into the slots from ``start`` on (claimed by ``place``)."""
        try:
            # Block by block through the buffer protocol, by C iteration: np.concatenate
            # into the slots costs about 30 % more (a prefill step brings hundreds).
            self._map.seek(start % self.capacity * self._block_nbytes)
            deque(map(self._map.write, blocks), maxlen=0)
        except ValueError:  # a block that is not C-contiguous exports no plain buffer
            np.stack(blocks, out=self.view(start, len(blocks)))

    def view(self, start: int, n: int) -> np.ndarray:
        """The rows of slots ``start .. start + n - 1`` (contiguous by construction)."""
        at = start % self.capacity
        return self.slots[at : at + n]

    def freed(self, upto: int) -> None:
        """The helper is done with every slot below ``upto``."""
        self.tail = max(self.tail, upto)

    def acknowledge(self, upto: int) -> None:
        """(Helper side) every slot below ``upto`` is read: visible to ``in_use`` at once."""
        self._acked[0] = upto

    @property
    def in_use(self) -> int:
        """Slots the helper has not read yet, by its latest acknowledgement."""
        return max(self.head - max(self.tail, int(self._acked[0])), 0)

    def close(self) -> None:
        del self.slots, self._acked  # the mapping cannot close while arrays export it
        self._shared.close()
