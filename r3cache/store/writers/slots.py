"""SharedSlots: block-sized slots in a memfd mapping that the engine and its writer
process both map (the engine creates it; the helper is given its descriptor)."""

from __future__ import annotations

import contextlib
import math
import mmap
import os

import numpy as np

from r3cache.layout import RoutingLayout


class SharedSlots:
    """Own one shared mapping: ``capacity`` block slots, then ``words`` int64 counters."""

    def __init__(self, layout: RoutingLayout, capacity: int, fd: int | None = None, *,
                 words: int = 0, populate: bool = False) -> None:
        size = capacity * layout.block_nbytes
        words_at = -(-size // 8) * 8  # aligned int64 counters after the slots
        if fd is None:
            fd = os.memfd_create("r3cache-blocks", os.MFD_CLOEXEC)
            os.ftruncate(fd, words_at + 8 * words)
        self.fd = fd
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self.map = mmap.mmap(fd, words_at + 8 * words, flags=flags)
        count = capacity * math.prod(layout.block_shape)
        self.slots = np.frombuffer(self.map, layout.dtype, count).reshape(
            capacity, *layout.block_shape)
        self.words = np.frombuffer(self.map, np.int64, words, words_at)

    def close(self) -> None:
        del self.slots, self.words
        # A view someone still holds keeps the mapping until it goes; the descriptor
        # closes now either way.
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)
