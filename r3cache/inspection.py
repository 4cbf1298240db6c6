"""What a Redis holds, read for a person: per-namespace views and the server's memory.

`r3cache inspect` prints one look; `r3cache top` repeats it. Both scan keys (SCAN,
never KEYS), O(blocks) a look: for people, not for the engine's loop.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from r3cache.errors import NamespaceNotFoundError
from r3cache.store.base import StoreStats
from r3cache.store.redis.connect import connect, list_namespaces, open_redis_store
from r3cache.store.redis.errors import redis_errors
from r3cache.store.redis.janitor import owner_liveness
from r3cache.store.redis.nodes import retried


@dataclass(frozen=True)
class NamespaceView:
    """One namespace as seen at one moment: its layout, stats, owners and bad manifests."""

    namespace: str
    fingerprint: str
    hash_algo: str
    stats: StoreStats
    live_owners: list[str]
    dead_owners: list[str]
    unreadable: list[str]


@dataclass(frozen=True)
class ServerView:
    """The server's (or the cluster primaries' summed) memory and read counters."""

    used_memory: int
    maxmemory: int  # 0: no limit
    policy: str
    key_reads: int  # keyspace hits + misses since the server started


def look(url: str, namespace: str) -> NamespaceView:
    store = open_redis_store(url, layout=None, namespace=namespace, lease=False,
                             janitor=False)
    try:
        stats = store.stats()
        owners = owner_liveness(store)
        unreadable = store.call(store.keys.unreadable, "HKEYS", store.keys.unreadable)
    finally:
        store.close()
    return NamespaceView(
        namespace, store.layout.fingerprint, store.hash_algo, stats,
        sorted(o for o, alive in owners.items() if alive),
        sorted(o for o, alive in owners.items() if not alive),
        [r.decode(errors="replace") for r in unreadable])


def server(url: str) -> ServerView:
    nodes, options, _ = connect(url, None, {})
    try:
        with redis_errors(None, "reading INFO"):
            infos = retried(nodes, lambda: [c.info() for c in nodes.primaries()],
                            retries=options.retries)
    finally:
        nodes.close()
    return ServerView(
        used_memory=sum(int(i.get("used_memory", 0)) for i in infos),
        maxmemory=sum(int(i.get("maxmemory", 0)) for i in infos),
        policy=",".join(sorted({str(i.get("maxmemory_policy", "?")) for i in infos})),
        key_reads=sum(int(i.get("keyspace_hits", 0)) + int(i.get("keyspace_misses", 0))
                      for i in infos))


def describe(view: NamespaceView) -> list[str]:
    """The lines `r3cache inspect` prints for one namespace."""
    stats = view.stats
    lines = [f"{view.namespace}  layout {view.fingerprint}  hash {view.hash_algo}",
             f"  blocks     {stats.blocks} ({stats.pinned_blocks} pinned, "
             f"{stats.blocks - stats.pinned_blocks} idle)",
             f"  bytes      {stats.bytes_used:,} stored for {stats.raw_bytes_used:,} raw",
             f"  manifests  {stats.manifests}"]
    if view.unreadable:
        lines.append(f"  unreadable manifests {len(view.unreadable)} (released by the "
                     f"janitor: {', '.join(view.unreadable[:5])})")
    live, dead = view.live_owners, view.dead_owners
    lines.append(f"  owners     {len(live)} live{': ' + ', '.join(live) if live else ''}; "
                 f"{len(dead)} dead{': ' + ', '.join(dead) if dead else ''}")
    return lines


@dataclass(frozen=True)
class Snapshot:
    """Everything `top` shows at one moment."""

    at: float
    server: ServerView
    namespaces: list[NamespaceView]


def looks(url: str, namespace: str | None = None) -> list[NamespaceView]:
    """A look at ``namespace``, or at every namespace listed: one deleted between the
    listing and its look is passed over, not the end of the others' (or of `top`)."""
    if namespace:
        return [look(url, namespace)]
    views = []
    for name in list_namespaces(url):
        with contextlib.suppress(NamespaceNotFoundError):
            views.append(look(url, name))
    return views


def snapshot(url: str, namespace: str | None = None) -> Snapshot:
    return Snapshot(time.monotonic(), server(url), looks(url, namespace))
