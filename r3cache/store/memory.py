"""MemoryBlockStore: the bounded in-process store, vLLM's shared-memory semantics."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import filterfalse, islice, repeat
from typing import NamedTuple

import numpy as np

from r3cache.errors import BlockNotFoundError, ContractError, StoreClosedError, StoreFullError
from r3cache.hashing import hasher_name
from r3cache.layout import RoutingLayout
from r3cache.manifest import Manifest, check_request_ids
from r3cache.store.base import StoreStats, check_key_types, check_put, check_targets
from r3cache.store.pool import BlockPool

DEFAULT_MAX_BYTES = 1 << 30


def check_capacity(layout: RoutingLayout, max_bytes: int) -> None:
    """Refuse a store bound that cannot hold one block."""
    if max_bytes < layout.block_nbytes:
        raise StoreFullError(
            f"max_bytes={max_bytes} cannot hold one block of {layout.block_nbytes} bytes")


class PutChanges(NamedTuple):
    """What one put did: to the pins, in call order, and where it stored new blocks."""

    first: list[str]  # keys it pinned from no pin
    last: list[str]  # keys whose last pin it dropped, or that it released with none
    unheld: list[str]  # of those, the ones it released with none: nothing changed
    stored: list[str]  # the blocks it stored
    slots: list[int]  # their slots in the store's pool, in the same order


class MemoryBlockStore:
    """Own blocks in process memory, bounded by bytes, evicting only unpinned blocks (LRU).

    The blocks live in a BlockPool: arrays on the heap, or ``arena`` (a
    ``writers.arena.BlockArena`` of at least ``max_bytes``), slots of memory a writer
    process reads. A tier in front of that writer then sends slot numbers, not second
    copies; a slot is written again only once the writer is done with it (``claim``).
    """

    def __init__(
        self, layout: RoutingLayout, namespace: str = "default", max_bytes: int = DEFAULT_MAX_BYTES,
        hash_algo: str = "sha256", arena=None,
    ) -> None:
        check_capacity(layout, max_bytes)
        if arena is not None and arena.capacity < max_bytes // layout.block_nbytes:
            raise ContractError(f"an arena of {arena.capacity} blocks cannot hold "
                                f"max_bytes={max_bytes}")
        self.layout = layout
        self.namespace = namespace
        self.hash_algo = hasher_name(hash_algo)
        self.max_bytes = int(max_bytes)
        self._blocks: dict[str, int] = {}  # each block's slot in the pool
        self._arena = arena
        self._pool = BlockPool(layout) if arena is None else arena
        self._refs: dict[str, int] = {}
        # Stored blocks with no reference, oldest release first: the eviction order.
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._idle_bytes = 0
        self._used = 0
        self._manifests: dict[str, Manifest] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._written = self._duplicates = self._conflicts = self._evictions = 0

    @property
    def arena(self):
        """The BlockArena the blocks live in, or None (the heap)."""
        return self._arena

    def put(
        self,
        objects: Mapping[str, np.ndarray],
        retain_keys: Collection[str] = (),
        release_keys: Sequence[str] = (),
        manifests: Sequence[Manifest] = (),
    ) -> PutChanges:
        """Store blocks, then pin, then unpin; returns what that did to the pins (a tier in
        front of a durable store forwards only the first and last ones) and, with an
        arena, where the new blocks are."""
        check_put(self.layout, objects, retain_keys, release_keys, manifests)
        with self._lock:
            self._check_open()
            blocks = self._blocks
            # A step's blocks are new to the store: one C pass tells, no filtered copy.
            if blocks.keys().isdisjoint(objects):
                new, held = objects, ()
            else:
                new = {k: v for k, v in objects.items() if k not in blocks}
                held = objects.keys() - new.keys()
            nbytes = len(new) * self.layout.block_nbytes
            freed: list[str] = []
            if self._used + nbytes > self.max_bytes:  # checked above: raises, or evicts
                # Blocks the put names stay: it pins them, or compares them as duplicates.
                freed = self._reserve(nbytes, [*retain_keys, *held,
                                               *(k for m in manifests for k in m.block_keys)],
                                      release_keys)
            first = self._retain(retain_keys)
            stored, slots = self._insert(new, freed)
            for key in held:
                if np.array_equal(self._pool.arrays[self._blocks[key]], objects[key]):
                    self._duplicates += 1
                else:
                    # Immutable: the first writer wins; the caller reads its own rows.
                    self._conflicts += 1
            for manifest in manifests:
                self._retain(manifest.block_keys)
                # A reused request id replaces its manifest, and the old one's holds go.
                replaced = self._manifests.pop(manifest.request_id, None)
                if replaced is not None:
                    self._release(reversed(replaced.block_keys))
                self._manifests[manifest.request_id] = manifest.own_copy()
            last, unheld = self._release(release_keys)
        return PutChanges(first, last, unheld, stored, slots)

    def undo_pins(self, retain_keys: Collection[str], release_keys: Sequence[str],
                  changes: PutChanges) -> None:
        """Take back the pins and releases of the put (without manifests) that returned
        ``changes``; its blocks stay, as they are immutable. A tier whose durable store
        refused that put leaves the counts as they were, so the caller's retry pins each
        key once."""
        unheld = Counter(changes.unheld)
        dropped = []  # the releases that dropped a pin
        for key in release_keys:
            if unheld[key]:
                unheld[key] -= 1
            else:
                dropped.append(key)
        with self._lock:
            self._check_open()
            # Pinned again first: then no count reaches zero before the put's own pins go.
            self._retain(dropped)
            self._release(reversed(list(retain_keys)))

    def get_manifests(self, request_ids: Sequence[str]) -> list[Manifest | None]:
        request_ids = check_request_ids(request_ids)
        with self._lock:
            self._check_open()
            found = [self._manifests.get(r) for r in request_ids]
        return [m and m.own_copy() for m in found]

    def release_manifests(self, request_ids: Sequence[str]) -> int:
        request_ids = check_request_ids(request_ids)
        with self._lock:
            self._check_open()
            found = [self._manifests.pop(r) for r in request_ids if r in self._manifests]
            for manifest in found:
                self._release(reversed(manifest.block_keys))
            return len(found)

    def _reserve(self, nbytes: int, retain_keys: Collection[str],
                 release_keys: Sequence[str]) -> list[str]:
        """Evict idle blocks until ``nbytes`` fit, or raise before changing anything;
        returns the evicted keys, whose slots (still stored) the new blocks take over.

        When the idle blocks are not enough, the blocks this put's releases leave with no
        pin go too, in the order their last pins go: idle by the end of the put, they
        would be evicted next. A full store evicts a block for each it stores (a prefill
        step's hundreds): the victims are picked and removed by C iteration, the counts
        updated once.
        """
        size = self.layout.block_nbytes  # check_blocks: every block is whole
        idle = self._idle
        retained = {k for k in retain_keys if k in idle}
        evictable = self._idle_bytes - len(retained) * size
        count = -(-(self._used + nbytes - self.max_bytes) // size)
        released = []
        if count * size > evictable:
            released = self._released_for_good(release_keys, set(retain_keys))
            if count * size > evictable + len(released) * size:
                raise StoreFullError(
                    f"namespace {self.namespace!r}: {nbytes} new bytes do not fit in "
                    f"{self.max_bytes} with {self._used - evictable} bytes pinned; nothing "
                    "was written")
        # Oldest release first; blocks this batch is about to pin keep their place.
        idled = list(islice(filterfalse(retained.__contains__, idle), count))
        victims = idled + released[: count - len(idled)]
        if self._arena is not None:  # the last change that can wait, and fail
            self._arena.claim(list(map(self._blocks.__getitem__, victims)))
        deque(map(idle.__delitem__, idled), maxlen=0)
        self._idle_bytes -= len(idled) * size
        self._used -= count * size
        self._evictions += count
        return victims

    def _released_for_good(self, release_keys: Sequence[str], kept: set[str]) -> list[str]:
        """Stored, pinned keys that ``release_keys`` leave with no pin, in the order their
        last pin goes (``kept``: keys the put pins or compares, which stay)."""
        refs, blocks = self._refs, self._blocks
        left: dict[str, int] = {}
        unpinned = []
        for key in release_keys:
            if key in blocks and key not in kept:
                count = left.get(key, refs.get(key, 0))
                if count == 1:
                    unpinned.append(key)
                left[key] = count - 1
        return unpinned

    def _insert(self, new: Mapping[str, np.ndarray],
                freed: list[str]) -> tuple[list[str], list[int]]:
        """Store copies of checked whole blocks (a prefill step brings hundreds), by C
        iteration: the copies, the stores and the idle entries each one pass; returns the
        new blocks' keys and slots.

        The first ones take the slots of ``freed``, evicted keys (at most one per new
        block): a full store reuses its memory rather than freeing a block's and
        allocating another. No array of the store's leaves it (reads copy under the lock),
        so none is seen changing.
        """
        blocks, refs, idle = self._blocks, self._refs, self._idle
        keys, values = list(new), list(new.values())
        slots = list(map(blocks.pop, freed))
        if len(slots) < len(keys):
            slots += self._pool.take(len(keys) - len(slots))
        # Own the bytes: the caller may write into its arrays after put() returns.
        deque(map(np.copyto, map(self._pool.arrays.__getitem__, slots), values), maxlen=0)
        blocks.update(zip(keys, slots))
        # Unpinned new blocks are idle. None of them was stored, so none was idle before,
        # and refs holds only counts above zero.
        before = len(idle)
        idle.update(zip(filterfalse(refs.__contains__, new.keys()), repeat(None)))
        nbytes = self.layout.block_nbytes  # check_blocks: every block is whole
        self._used += len(new) * nbytes
        self._idle_bytes += (len(idle) - before) * nbytes
        self._written += len(new)
        return keys, slots

    def _retain(self, keys: Iterable[str]) -> list[str]:
        """Pin ``keys``; returns those that had no pin before. One loop for a whole put
        (a prefill step pins hundreds of keys): no call per key."""
        refs, idle = self._refs, self._idle
        first = []
        unidled = 0
        for key in keys:
            count = refs.get(key, 0)
            refs[key] = count + 1
            if count == 0:
                first.append(key)
                if key in idle:  # a test, not a call: most keys a step pins are new
                    del idle[key]
                    unidled += 1
        self._idle_bytes -= unidled * self.layout.block_nbytes  # every block is whole
        return first

    def _release(self, keys: Iterable[str]) -> tuple[list[str], list[str]]:
        """Unpin ``keys``; returns those that now have no pin, and of them the ones that had
        none before."""
        refs, blocks, idle = self._refs, self._blocks, self._idle
        last, unheld = [], []
        idled = 0
        for key in keys:
            # Counts never go negative: releasing an unheld key changes nothing.
            count = refs.pop(key, 0)
            if count > 1:
                refs[key] = count - 1
                continue
            last.append(key)
            if not count:
                unheld.append(key)
            elif key in blocks:
                idle[key] = None  # pinned until now, so not idle before
                idled += 1
        self._idle_bytes += idled * self.layout.block_nbytes
        return last, unheld

    def get_concatenated(self, keys: Sequence[str]) -> np.ndarray:
        if isinstance(keys, (str, bytes)):  # one test on an engine's prefix-hit path
            check_key_types(keys)
        with self._lock:
            self._check_open()
            missing = [k for k in keys if k not in self._blocks]
            if missing:
                check_key_types(missing)
                raise BlockNotFoundError(missing, namespace=self.namespace)
            if not keys:
                return self.layout.empty_rows()
            # Under the lock: a later put may copy another block into an evicted array.
            arrays = self._pool.arrays
            return np.concatenate([arrays[self._blocks[k]] for k in keys])

    def read_present(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> list[int]:
        """Copy the blocks held here into their targets; the indices of the others."""
        missing = []
        with self._lock:
            self._check_open()
            for n, key in enumerate(keys):
                slot = self._blocks.get(key)
                if slot is None:
                    missing.append(n)
                else:
                    targets[n][...] = self._pool.arrays[slot]
        return missing

    def drop_blocks(self) -> None:
        """Forget every stored block but keep the reference counts."""
        with self._lock:
            slots = list(self._blocks.values())
            # Free slots are never in flight: a writer reading them is done first.
            self._pool.claim(slots)
            self._pool.give_back(slots)
            self._blocks.clear()
            self._idle.clear()
            self._idle_bytes = self._used = 0

    def read_into(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> None:
        check_targets(self.layout, keys, targets)
        missing = self.read_present(keys, targets)
        if missing:
            check_key_types([keys[i] for i in missing])
            raise BlockNotFoundError([keys[i] for i in missing], namespace=self.namespace)

    def refcount(self, key: str) -> int:
        with self._lock:
            return self._refs.get(key, 0)

    def flush(self) -> None:
        with self._lock:
            self._check_open()

    @property
    def conflicts(self) -> int:
        """Blocks put under a key already held with different rows."""
        return self._conflicts

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                blocks=len(self._blocks),
                pinned_blocks=len(self._blocks) - len(self._idle),
                referenced_keys=len(self._refs),
                bytes_used=self._used,
                raw_bytes_used=self._used,
                blocks_written=self._written,
                duplicate_puts=self._duplicates,
                conflicts=self._conflicts,
                evictions=self._evictions,
                manifests=len(self._manifests),
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._blocks.clear()
            # The heap's arrays go with the pool; an arena's owner closes it.
            self._pool = BlockPool(self.layout)
            self._refs.clear()
            self._idle.clear()
            self._manifests.clear()
            self._idle_bytes = self._used = 0

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"memory store {self.namespace!r} is closed")

    def __repr__(self) -> str:
        return f"MemoryBlockStore(namespace={self.namespace!r}, max_bytes={self.max_bytes})"
