"""The BlockStore protocol every backend implements, and the stats it reports."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from r3cache.errors import ContractError, LayoutMismatchError
from r3cache.layout import RoutingLayout
from r3cache.manifest import Manifest

# A block key: 1-256 characters of printable ASCII without spaces (manifests list keys
# separated by spaces), braces (Redis Cluster hash tags) or "~" (a writer's variant).
MAX_KEY_LENGTH = 256
_KEY_BYTES = bytes(range(0x21, 0x7B)) + b"|"


def is_key(key: object) -> bool:
    """Whether ``key`` can name a block."""
    return (isinstance(key, str) and 0 < len(key) <= MAX_KEY_LENGTH and key.isascii()
            and not key.encode().translate(None, _KEY_BYTES))


def check_keys(keys: Sequence[object]) -> None:
    """Refuse keys that cannot name a block, naming the first. In C calls over the whole
    batch (a prefill step names hundreds of keys); only a failing batch is walked."""
    if not keys:
        return
    if set(map(type, keys)) == {str}:
        joined = "".join(keys)
        lengths = set(map(len, keys))
        if (joined.isascii() and not joined.encode().translate(None, _KEY_BYTES)
                and 0 not in lengths and max(lengths) <= MAX_KEY_LENGTH):
            return
    bad = next(k for k in keys if not is_key(k))
    raise ContractError(f"{bad!r:.80} cannot name a block: a key is 1-{MAX_KEY_LENGTH} "
                        "printable ASCII characters without spaces, braces or '~'")


def check_key_types(keys: Sequence[object]) -> None:
    """Refuse keys to read that are not a sequence of str (a writer's variants may hold
    "~"): one str would be read character by character."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise ContractError(f"block keys to read are a sequence of str, not "
                            f"{type(keys).__name__}")
    if keys and set(map(type, keys)) != {str}:
        bad = next(k for k in keys if not isinstance(k, str))
        raise ContractError(f"block keys are str, not {type(bad).__name__} ({bad!r:.80})")


def check_targets(layout: RoutingLayout, keys: Sequence[str],
                  targets: Sequence[np.ndarray]) -> None:
    """Refuse read_into's targets before anything is read: one per key, each a writeable,
    C-contiguous block of the layout's shape and dtype. A store decodes a block's bytes
    into its target as they are, so another dtype would hold other numbers."""
    check_key_types(keys)
    if len(targets) != len(keys):
        raise ContractError(f"{len(targets)} targets for {len(keys)} keys")
    shape, dtype = layout.block_shape, layout.dtype
    for target in targets:
        if (target.__class__ is not np.ndarray or target.shape != shape
                or target.dtype != dtype or not target.flags.c_contiguous
                or not target.flags.writeable):
            raise ContractError(
                f"a read_into target is a writeable C-contiguous {dtype} array of shape "
                f"{shape}, not {type(target).__name__} "
                f"{getattr(target, 'shape', '')} {getattr(target, 'dtype', '')}")


def read_concatenated(layout: RoutingLayout, keys: Sequence[str],
                      read_into: Callable[[Sequence[str], list[np.ndarray]], None]
                      ) -> np.ndarray:
    """The rows of ``keys``' blocks one after another: one array, each block read into its
    place in it by ``read_into`` (a store's own)."""
    out = np.empty((len(keys) * layout.block_size, *layout.row_shape), layout.dtype)
    read_into(keys, list(out.reshape(len(keys), *layout.block_shape)))
    return out


def check_put(layout: RoutingLayout, objects: Mapping[str, np.ndarray],
              retain_keys: Collection[str], release_keys: Sequence[str],
              manifests: Sequence[Manifest], *, blocks: bool = True) -> None:
    """Refuse a put's arguments before it changes anything: a str where keys go (it would
    pin its characters), objects that are not a mapping, blocks not of the layout (unless
    ``blocks`` is False: a layer whose next one checks them first), and manifests that
    are not Manifests or that no reader could use (Manifest.check)."""
    if not isinstance(objects, Mapping):
        raise ContractError(f"objects must map keys to blocks, not {type(objects).__name__}")
    for name, keys in (("retain_keys", retain_keys), ("release_keys", release_keys),
                       ("manifests", manifests)):
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Collection):
            raise ContractError(f"{name} must be a collection, not {type(keys).__name__}")
    if blocks:
        layout.check_blocks(objects)
    for manifest in manifests:
        if not isinstance(manifest, Manifest):
            raise ContractError(f"manifests must be Manifests, not {type(manifest).__name__}")
        manifest.check(layout)


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
    key whose last pin goes becomes evictable, in the order given). Its arguments are
    checked before any of it (``check_put``; a Redis store also checks every key with
    ``check_keys``): a ContractError changes nothing.
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


def check_layout_and_store(layout: object, store: object, user: str) -> None:
    """``layout`` is a RoutingLayout and ``store`` a BlockStore of that layout, or a typed
    error (``user``: what is built on them, for the message)."""
    if not isinstance(layout, RoutingLayout):
        raise ContractError(f"layout must be a RoutingLayout, not {type(layout).__name__}")
    if not isinstance(store, BlockStore):
        raise ContractError(f"store must be a BlockStore (open_store), not "
                            f"{type(store).__name__}")
    if store.layout != layout:
        raise LayoutMismatchError(
            f"store layout {store.layout.fingerprint} != {user} layout {layout.fingerprint}")
