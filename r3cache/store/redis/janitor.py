"""The janitor: finds holders that are gone and drops their holds; releases expired manifests.

Holders are found in the reference hashes themselves, not only in the owners registry:
an owner the registry forgot (a Redis restart without persistence, a reclaim while it
was stalled) still shows up where it holds, gets a registry entry that expires after
one lease unless it beats, and is reclaimed like any other owner once that passes.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import redis

from r3cache.errors import CorruptBlockError, LayoutMismatchError
from r3cache.store.redis.keys import MANIFEST_OWNER_PREFIX, manifest_owner
from r3cache.store.redis.nodes import hash_reply
from r3cache.store.redis.scripts import FORGET_SCRIPT, RECLAIM_SCRIPT, SWEEP_SCRIPT

log = logging.getLogger("r3cache.store")
_SCAN_COUNT = 1000


@dataclass(frozen=True)
class JanitorReport:
    """What one janitor pass found and did."""

    live_owners: tuple[str, ...]
    dead_owners: tuple[str, ...]
    holds_dropped: int
    manifests_expired: int = 0
    unreadable_manifests: tuple[str, ...] = ()  # expired ones that could not be parsed
    unregistered_holders: tuple[str, ...] = ()  # holders the registry did not know


def scan_keys(store, pattern: bytes) -> list[bytes]:
    """Every key matching ``pattern`` on every primary (SCAN, never KEYS), each once: a
    key whose slot moves during the scan (a reshard) may be met on two primaries."""
    found: dict[bytes, None] = {}
    for keys in store.on_primaries(lambda c: list(c.scan_iter(match=pattern,
                                                              count=_SCAN_COUNT))):
        found.update(dict.fromkeys(keys))
    return list(found)


def _sweep(store, candidates=()) -> tuple[list[str], list[str]]:
    owners = store.keys.owners
    grace = int(store.options.lease_ttl * 1000)
    dead, live = store.call(owners, *SWEEP_SCRIPT.command(owners, grace, int(time.time() * 1000),
                                                          *candidates))
    return [o.decode() for o in dead], [o.decode() for o in live]


def owner_liveness(store) -> dict[str, bool]:
    """Every registered owner, and whether its lease is alive (read only: for inspection).

    Compared with the server's clock where the ACL user may read it, else this host's.
    """
    owners = store.keys.owners
    entries = hash_reply(store.call(owners, "HGETALL", owners))
    try:
        seconds, micros = map(int, store.call(owners, "TIME"))
        now = seconds * 1000 + micros // 1000
    except redis.exceptions.NoPermissionError:
        now = int(time.time() * 1000)
    return {o.decode(): int(e.split(b" ", 1)[0] or 0) > now for o, e in entries.items()}


def holders(store) -> dict[str, list[bytes]]:
    """Every holder in the namespace's reference hashes, with the hashes it appears in."""
    refs = scan_keys(store, store.keys.refs_pattern)
    found: dict[str, list[bytes]] = defaultdict(list)
    for ref, fields in zip(refs, store.per_key(refs, lambda k: ("HKEYS", k))):
        for field in fields or ():
            found[field.decode()].append(ref)
    return found


def reclaim_dead_owners(store) -> JanitorReport:
    """Drop every hold of owners whose lease expired, then forget those owners.

    Blocks left with no holder get the idle TTL, so a crashed engine never pins
    anything forever. Safe to run concurrently with live owners: it only touches
    the dead owners' fields, and an owner registers before it holds anything.
    """
    dead, live = _sweep(store)
    held = holders(store)
    engines = [h for h in held if not h.startswith(MANIFEST_OWNER_PREFIX)]
    unknown = [h for h in engines if h not in dead and h not in live]
    if unknown:
        # Registered (with one lease of grace) after the scan: an owner that registered
        # meanwhile is found live here, and is not touched.
        log.warning("namespace %r: %d holder(s) not in the owners registry: %s",
                    store.namespace, len(unknown), ", ".join(unknown[:8]))
        dead, live = _sweep(store, unknown)
    dropped = 0
    if dead:
        refs = list(dict.fromkeys(r for o in dead for r in held.get(o, ())))
        dropped = drop_holds(store, dead, refs)
        owners_key = store.keys.owners
        store.call(owners_key, *FORGET_SCRIPT.command(owners_key, *dead))
    expired, unreadable = expire_manifests(store, held)
    return JanitorReport(tuple(live), tuple(dead), dropped, expired, tuple(unreadable),
                         tuple(unknown))


def expire_manifests(store, held: dict[str, list[bytes]] | None = None
                     ) -> tuple[int, list[str]]:
    """Release manifests past their expiry (the trainer never released them).

    A manifest that cannot be parsed is released all the same: its holds are found
    in the reference hashes, it is deleted, and its id and reason are kept in the
    namespace's ``unreadable`` hash for ``r3cache inspect``. Returns how many
    expired and the ids of the unreadable ones.
    """
    index = store.keys.manifest_index
    expired = [r.decode() for r in store.call(index, "ZRANGEBYSCORE", index, "-inf",
                                              time.time())]
    if not expired:
        return 0, []
    unreadable = release_manifests(store, expired, held)
    # Index entries whose manifest is already gone are dropped as well.
    store.call(index, "ZREM", index, *expired)
    return len(expired), unreadable


def release_manifests(store, request_ids: list[str],
                      held: dict[str, list[bytes]] | None = None) -> list[str]:
    """Delete manifests and drop their holds; returns the ids of unreadable ones."""
    keys = store.keys
    ids = list(dict.fromkeys(request_ids))
    names = [keys.manifest(r) for r in ids]
    readable, unreadable = [], {}
    for request_id, fields in zip(ids, store.per_key(names, lambda k: ("HGETALL", k))):
        if not fields:
            continue
        try:
            readable.append(store.parse_manifest(request_id, fields))
        except (CorruptBlockError, LayoutMismatchError) as exc:
            unreadable[request_id] = str(exc)
    refs = [keys.refs(k) for m in readable for k in m.block_keys]
    if unreadable:
        log.warning("namespace %r: %d unreadable manifest(s) released: %s", store.namespace,
                    len(unreadable), "; ".join(unreadable.values())[:500])
        held = holders(store) if held is None else held
        refs += [r for request_id in unreadable for r in held.get(manifest_owner(request_id), ())]
        store.call(keys.unreadable, "HSET", keys.unreadable,
                   *(x for kv in unreadable.items() for x in kv))
    drop_holds(store, [manifest_owner(r) for r in ids], list(dict.fromkeys(refs)))
    for _ in store._execute(names, lambda idx: [("DEL", names[i]) for i in idx]):
        pass
    store.call(keys.manifest_index, "ZREM", keys.manifest_index, *ids)
    return list(unreadable)


def drop_owner_everywhere(store, owner: str) -> int:
    """Drop every hold ``owner`` has anywhere in the namespace (found by a scan)."""
    return drop_holds(store, [owner], holders(store).get(owner, []))


def drop_holds(store, owners: list[str], refs: list[bytes]) -> int:
    """Remove ``owners``' holds from the reference hashes ``refs``; settle the blocks' TTLs."""
    if not refs or not owners:
        return 0
    head = [store._idle_ms, len(owners), *owners]

    def argv(indices):
        args = list(head)
        for i in indices:
            args += (refs[i], store.keys.block_of_refs(refs[i]))
        return args

    return sum(int(count) for _, (count,) in
               store._execute(refs, lambda idx: [RECLAIM_SCRIPT.command(*argv(idx))]))

