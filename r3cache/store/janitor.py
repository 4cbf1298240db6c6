"""The janitor: finds owners whose lease expired and drops their holds."""

from __future__ import annotations

import time
from dataclasses import dataclass

from r3cache.store.redis_scripts import RECLAIM_SCRIPT

_SCAN_COUNT = 1000


@dataclass(frozen=True)
class JanitorReport:
    """What one janitor pass found and did."""

    live_owners: tuple[str, ...]
    dead_owners: tuple[str, ...]
    holds_dropped: int
    manifests_expired: int = 0


def scan_keys(store, pattern: bytes) -> list[bytes]:
    """Every key matching ``pattern`` on every primary (SCAN, never KEYS)."""
    found: list[bytes] = []
    for client in store.primaries():
        found.extend(client.scan_iter(match=pattern, count=_SCAN_COUNT))
    return found


def owner_liveness(store) -> dict[str, bool]:
    """Every owner that ever opened the namespace, and whether its lease is alive."""
    keys = store.keys
    registry = store.call(keys.owners, "HKEYS", keys.owners)
    owners = [o.decode() for o in registry]
    leases = [keys.lease(o) for o in owners]
    alive = store.per_key(leases, lambda k: ("EXISTS", k))
    return {owner: bool(a) for owner, a in zip(owners, alive)}


def reclaim_dead_owners(store) -> JanitorReport:
    """Drop every hold of owners whose heartbeat expired, then forget those owners.

    Blocks left with no holder get the idle TTL, so a crashed engine never pins
    anything forever. Safe to run concurrently with live owners: it only touches
    the dead owners' fields.
    """
    liveness = owner_liveness(store)
    dead = [o for o, alive in liveness.items() if not alive]
    dropped = 0
    if dead:
        dropped = drop_holds(store, dead, scan_keys(store, store.keys.refs_pattern))
        owners_key = store.keys.owners
        store.call(owners_key, "HDEL", owners_key, *dead)
    live = tuple(o for o, alive in liveness.items() if alive)
    return JanitorReport(live, tuple(dead), dropped, expire_manifests(store))


def expire_manifests(store) -> int:
    """Release manifests past their expiry (the trainer never released them)."""
    index = store.keys.manifest_index
    expired = store.call(index, "ZRANGEBYSCORE", index, "-inf", time.time())
    if not expired:
        return 0
    store.release_manifests([r.decode() for r in expired])
    # Index entries whose manifest is already gone are dropped as well.
    store.call(index, "ZREM", index, *expired)
    return len(expired)


def drop_holds(store, owners: list[str], refs: list[bytes]) -> int:
    """Remove ``owners``' holds from the reference hashes ``refs``; settle the blocks' TTLs."""
    if not refs:
        return 0
    head = [store._idle_ms, len(owners), *owners]

    def argv(indices):
        args = list(head)
        for i in indices:
            args += (refs[i], store.keys.block_of_refs(refs[i]))
        return args

    return sum(int(count) for _, (count,) in
               store._execute(refs, lambda idx: [RECLAIM_SCRIPT.command(*argv(idx))]))


def list_namespaces(url: str) -> list[str]:
    """Every namespace ever opened on the server(s) at ``url``."""
    from r3cache.store.redis_connect import connect
    from r3cache.store.redis_errors import redis_errors
    from r3cache.store.redis_keys import NAMESPACES_KEY

    nodes, _, _ = connect(url, "-", {})
    try:
        with redis_errors("-", "listing namespaces"):
            members = nodes.client_for(NAMESPACES_KEY).smembers(NAMESPACES_KEY)
            return sorted(n.decode() for n in members)
    finally:
        nodes.close()
