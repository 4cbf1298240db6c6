"""TieredBlockStore: an in-process tier of recent blocks in front of a durable store."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from r3cache.errors import (
    BlockNotFoundError,
    LayoutMismatchError,
    StoreFullError,
    StoreUnavailableError,
)
from r3cache.manifest import Manifest
from r3cache.store.base import (
    BlockStore,
    StoreStats,
    check_put,
    check_targets,
    read_concatenated,
)
from r3cache.store.memory import MemoryBlockStore
from r3cache.store.writers.background import BackgroundBlockStore
from r3cache.store.writers.process import ProcessWriter


class TieredBlockStore:
    """Own a local MemoryBlockStore and the background-written durable store behind it.

    Writes land in the local tier at once (read-your-writes without waiting for the
    writer) and go to the durable store through the writer thread. Pins are counted
    locally; the durable store sees one hold per key while the local count is non-zero.
    Reads are served from the local tier; only blocks it lacks (evicted locally, written
    by another replica, or from before a restart) go to the durable store, after the
    writer queue has drained, in one batched read, and are then kept locally.

    Where the local tier keeps its blocks in the writer process's arena, a put's new
    blocks go to the writer by slot: one copy on the engine's thread, not two.
    """

    def __init__(self, local: MemoryBlockStore, remote: BlockStore,
                 max_pending: int = 512, **writer_options) -> None:
        if local.layout != remote.layout:
            raise LayoutMismatchError("the local and durable tiers must share a layout")
        self.local = local
        # A ProcessWriter is already off this process; a plain store gets a thread.
        self.remote = remote if isinstance(remote, (BackgroundBlockStore, ProcessWriter)) \
            else BackgroundBlockStore(remote, max_pending=max_pending, **writer_options)
        self.layout = remote.layout
        self.namespace = remote.namespace
        self.hash_algo = remote.hash_algo
        self.remote_reads = 0  # blocks the local tier lacked
        # Whether the writer reads the local tier's blocks in place (its arena's slots).
        self._by_slot = local.arena is not None and local.arena is getattr(
            self.remote, "arena", None)
        # A block stored locally must reach the writer before any other put may evict
        # it and reuse its slot: the arena guards only slots already sent.
        self._lock = threading.Lock()

    def put(
        self,
        objects: Mapping[str, np.ndarray],
        retain_keys: Collection[str] = (),
        release_keys: Sequence[str] = (),
        manifests: Sequence[Manifest] = (),
    ) -> None:
        # Before the local tier applies the pins; its put checks the blocks first.
        check_put(self.layout, objects, retain_keys, release_keys, manifests, blocks=False)
        with self._lock:
            try:
                changes = self.local.put(objects, retain_keys, release_keys)
            except StoreFullError:
                # The local tier is a cache: pins still count, the bytes stay remote only.
                changes = self.local.put({}, retain_keys, release_keys)
            # The local tier counts every pin; the durable store holds a key for this
            # owner while that count is above zero. Only crossings of zero travel: a
            # prompt shared by eight requests is one hold in Redis, not eight (and one
            # release).
            try:
                if self._by_slot:
                    self.remote.put(objects, changes.first, changes.last, manifests,
                                    in_arena=(changes.stored, changes.slots))
                else:
                    self.remote.put(objects, changes.first, changes.last, manifests)
            except BaseException:
                # The writer took none of the pins (they ride on a put's last message): a
                # put that raises changes no count, or the caller's retry would pin twice,
                # and the durable store would never see those keys' first pins.
                self.local.undo_pins(retain_keys, release_keys, changes)
                raise

    def get_concatenated(self, keys: Sequence[str]) -> np.ndarray:
        try:
            return self.local.get_concatenated(keys)  # the common case: all local
        except BlockNotFoundError:
            pass
        return read_concatenated(self.layout, keys, self.read_into)

    def read_into(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> None:
        check_targets(self.layout, keys, targets)
        missing = self.local.read_present(keys, targets)
        if not missing:
            return
        wanted = [keys[i] for i in missing]
        self.remote.read_into(wanted, [targets[i] for i in missing])
        self.remote_reads += len(wanted)
        # The local tier copies the blocks into its own slots: the caller keeps its targets.
        # When pinned blocks fill it, or the writer still reads the slots they would take,
        # the next read simply goes remote again.
        with self._lock, contextlib.suppress(StoreFullError, StoreUnavailableError):
            self.local.put(dict(zip(wanted, (targets[i] for i in missing))))

    def get_manifests(self, request_ids: Sequence[str]) -> list[Manifest | None]:
        return self.remote.get_manifests(request_ids)

    def release_manifests(self, request_ids: Sequence[str]) -> int:
        return self.remote.release_manifests(request_ids)

    def flush(self) -> None:
        self.remote.flush()

    def stats(self) -> StoreStats:
        return self.remote.stats()

    def clear_local(self) -> None:
        """Forget every locally cached block (pins stay): reads fall back to the durable tier."""
        self.local.drop_blocks()

    def close(self) -> None:
        # The local tier first: it lets go of the arena's slots, which the writer's close
        # unmaps once the helper has written them.
        self.local.close()
        self.remote.close()

    def __repr__(self) -> str:
        return f"TieredBlockStore(local={self.local!r}, remote={self.remote!r})"

