"""Block stores: one protocol, interchangeable backends, opened by URL."""

from __future__ import annotations

from typing import Any

from r3cache.checks import byte_size, url_options
from r3cache.errors import ContractError
from r3cache.layout import RoutingLayout
from r3cache.store.base import BlockStore, StoreStats
from r3cache.store.memory import MemoryBlockStore
from r3cache.store.redis.keys import REDIS_SCHEMES, check_name
from r3cache.store.urls import display_url, url_parts, without_engine_options
from r3cache.store.writers.background import BackgroundBlockStore

__all__ = [
    "BackgroundBlockStore", "BlockStore", "MemoryBlockStore", "StoreStats", "check_url",
    "display_url", "open_store", "without_engine_options",
]

_INT_OPTIONS = {"max_bytes"}
_MEMORY_OPTIONS = {"max_bytes", "hash_algo"}


def open_store(
    url: str, *, layout: RoutingLayout | None, namespace: str, **options: Any
) -> BlockStore:
    """Open the block store that ``url`` names, for one layout under one namespace.

    ``memory://`` is the embedded in-process store (options: ``max_bytes``);
    ``redis://``, ``rediss://`` (TLS), ``unix://`` and ``redis+cluster://h:p,h:p``
    open a RedisBlockStore (options: ``idle_ttl``, ``lease_ttl``, ``owner``,
    ``retries``, ``janitor``, ``pool_size``, ``socket_timeout``,
    ``socket_connect_timeout``, ``username``, ``password``, ``ssl_*``).
    Options may also come as URL query parameters (``memory://?max_bytes=1e9``).
    ``layout=None`` opens an existing Redis namespace with the layout it stores.
    """
    _check_namespace(url, namespace)
    if _scheme(url) == "memory":
        if layout is None:
            raise ContractError("memory:// needs a layout")
        return MemoryBlockStore(layout, namespace, **_memory_options(url, options))
    from r3cache.store.redis.connect import open_redis_store

    return open_redis_store(url, layout=layout, namespace=namespace, **options)


def check_url(url: str, namespace: str | None = None, **options: Any) -> None:
    """Every check ``open_store`` makes of ``url``, ``namespace`` (when given) and
    ``options`` before it needs a server: an engine plugin runs it as it loads, the demo
    before it draws its workload, so that a mistake stops them before the work rather
    than after."""
    if namespace is not None:
        _check_namespace(url, namespace)
    if _scheme(url) == "memory":
        _memory_options(url, options)
    else:
        from r3cache.store.redis.connect import parse

        parse(url, options)


def _check_namespace(url: str, namespace: str) -> None:
    """Any non-empty str names an embedded store's namespace (a label); a Redis one is a
    part of its keys' names."""
    if not isinstance(namespace, str) or not namespace:
        raise ContractError("namespace must be a non-empty string tied to the model weights")
    if _scheme(url) != "memory":
        check_name(namespace, "namespace")


def _scheme(url: str) -> str:
    """The scheme of a store URL r3cache can open, or a ContractError."""
    if not isinstance(url, str):
        raise ContractError(f"a store URL is a str, not {type(url).__name__}")
    scheme = url_parts(url).scheme
    if scheme != "memory" and scheme not in REDIS_SCHEMES:
        raise ContractError(
            f"unsupported store URL scheme {scheme!r}; use memory:// or one of "
            + ", ".join(f"{s}://" for s in REDIS_SCHEMES))
    return scheme


def _memory_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The embedded store's options, from ``url``'s query and ``options``, checked."""
    parts = url_parts(url)
    if parts.netloc or parts.path.strip("/") or "#" in url:
        # "memory://1GB" would open a store of the default size.
        raise ContractError("memory:// names no host or path; size it with ?max_bytes=")
    merged: dict[str, Any] = {**url_options(parts.query), **options}
    unknown = sorted(merged.keys() - _MEMORY_OPTIONS)
    if unknown:
        raise ContractError(f"unknown memory store option(s) {', '.join(unknown)}; it "
                            f"takes {', '.join(sorted(_MEMORY_OPTIONS))}")
    for name in _INT_OPTIONS & merged.keys():
        try:
            merged[name] = byte_size(merged[name])
        except (TypeError, ValueError):
            raise ContractError(f"store option {name} must be a number, not "
                                f"{merged[name]!r}") from None
    return merged
