"""The BlockStore protocol every backend implements, and the stats it reports."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from r3cache.layout import RoutingLayout
from r3cache.manifest import Manifest


@dataclass(frozen=True)
class StoreStats:
    """A point-in-time account of one store."""

    blocks: int  # blocks stored now
    pinned_blocks: int  # stored blocks with at least one reference
    referenced_keys: int  # keys with at least one reference, stored or not yet
    bytes_used: int  # bytes the stored blocks occupy in the backend
    raw_bytes_used: int  # the same blocks as uncompressed rows
    blocks_written: int  # blocks newly stored since open
    duplicate_puts: int  # puts of a key already stored with the same rows
    conflicts: int  # puts of a key already stored with different rows
    evictions: int  # unreferenced blocks dropped to make room
    manifests: int = 0  # request manifests stored
    unreplicated: int = 0  # blocks written while no replica acknowledged (wait_replicas)


@runtime_checkable
class BlockStore(Protocol):
    """Own immutable blocks of routed-expert rows under string keys, with per-key pins.

    ``put`` applies, in this order: ``retain_keys`` (pin, even before a key is
    written), ``objects`` (first writer wins), ``manifests`` (each holds the blocks
    it names, as its own owner, until released), then ``release_keys`` (unpin; a
    key whose last pin goes becomes evictable, in the order given).
    """

    layout: RoutingLayout
    namespace: str
    hash_algo: str  # the engine's KV block hash algorithm, for lookups by tokens

    def put(
        self,
        objects: Mapping[str, np.ndarray],
        retain_keys: Collection[str] = (),
        release_keys: Sequence[str] = (),
        manifests: Sequence[Manifest] = (),
    ) -> None: ...

    def get_manifests(self, request_ids: Sequence[str]) -> list[Manifest | None]:
        """The manifests of ``request_ids`` (None where there is none)."""
        ...

    def release_manifests(self, request_ids: Sequence[str]) -> int:
        """Delete manifests and drop their holds; returns how many existed."""
        ...

    def get_concatenated(self, keys: Sequence[str]) -> np.ndarray:
        """Rows of ``keys`` in order, shape ``(len(keys) * block_size, L, K)``."""
        ...

    def read_into(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> None:
        """Block ``keys[i]`` into ``targets[i]``: whole-block, C-contiguous row arrays."""
        ...

    def flush(self) -> None:
        """Return once every earlier ``put`` is applied (or raise its error)."""
        ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...
