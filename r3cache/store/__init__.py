"""Block stores: one protocol, interchangeable backends, opened by URL."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

from r3cache.errors import ContractError
from r3cache.layout import RoutingLayout
from r3cache.store.background import BackgroundBlockStore
from r3cache.store.base import BlockStore, StoreStats
from r3cache.store.memory import MemoryBlockStore

__all__ = ["BackgroundBlockStore", "BlockStore", "MemoryBlockStore", "StoreStats", "open_store"]

_INT_OPTIONS = {"max_bytes"}


def open_store(url: str, *, layout: RoutingLayout, namespace: str, **options: Any) -> BlockStore:
    """Open the block store that ``url`` names, for one layout under one namespace.

    ``memory://`` is the embedded in-process store (options: ``max_bytes``).
    Options may also come as URL query parameters (``memory://?max_bytes=1e9``).
    """
    if not isinstance(namespace, str) or not namespace:
        raise ContractError("namespace must be a non-empty string tied to the model weights")
    parts = urlsplit(url)
    merged: dict[str, Any] = dict(parse_qsl(parts.query))
    merged.update(options)
    for name in _INT_OPTIONS & merged.keys():
        merged[name] = int(float(merged[name]))
    if parts.scheme == "memory":
        return MemoryBlockStore(layout, namespace, **merged)
    raise ContractError(f"unsupported store URL scheme {parts.scheme!r} in {url!r}; use memory://")
