"""RedisBlockStore: blocks, per-owner reference counts and leases in Redis or a Redis Cluster."""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from r3cache import codec
from r3cache.checks import MAX_SECONDS
from r3cache.errors import (
    BlockNotFoundError,
    ContractError,
    LayoutMismatchError,
    NamespaceNotFoundError,
    StoreClosedError,
)
from r3cache.hashing import hasher_name
from r3cache.layout import RoutingLayout
from r3cache.manifest import BlockRef, Manifest, check_request_ids
from r3cache.store.base import (
    StoreStats,
    check_key_types,
    check_keys,
    check_put,
    check_targets,
    read_concatenated,
)
from r3cache.store.redis.errors import redis_errors
from r3cache.store.redis.keys import NAMESPACES_KEY, KeySchema, check_name, manifest_owner
from r3cache.store.redis.lease import Lease
from r3cache.store.redis.nodes import (
    CHUNK,
    ClusterNodes,
    SingleNode,
    command,
    execute,
    hash_reply,
    retried,
)
from r3cache.store.redis.scripts import (
    HOLDS_SCRIPT,
    MANIFEST_HOLDS_SCRIPT,
    OPEN_NAMESPACE_SCRIPT,
    REPLACE_HASH_SCRIPT,
    SCRIPTS,
)

log = logging.getLogger("r3cache.store")

# Eviction policies that take only keys with a TTL (idle blocks), or none at all.
SAFE_POLICIES = ("volatile-lru", "volatile-lfu", "volatile-ttl", "volatile-random",
                 "noeviction")
DEFAULT_IDLE_TTL = 86_400.0
DEFAULT_LEASE_TTL = 30.0
DEFAULT_MANIFEST_TTL = 7 * 86_400.0
_WRITE_CHUNK = 64  # keys per write group: small, so encoding overlaps the server's work
_READ_CHUNK = 128
_READ_AHEAD = 2


def default_owner() -> str:
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:60] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class RedisOptions:
    """What r3cache itself reads from a Redis store URL and keyword options."""

    idle_ttl: float = DEFAULT_IDLE_TTL
    lease_ttl: float = DEFAULT_LEASE_TTL
    owner: str | None = None
    retries: int = 3
    janitor: bool = True
    lease: bool = True  # False: an admin or reader handle that holds nothing
    manifest_ttl: float = DEFAULT_MANIFEST_TTL
    hash_algo: str = "sha256"  # how the engine hashes KV blocks (vLLM's prefix-caching algo)
    wait_replicas: int = 0  # durability: a write is acknowledged once this many replicas have it
    wait_timeout: float = 2.0
    codec: str = "lz4"  # a namespace's block encoding: "lz4" (memory) or "raw" (read speed)

    def __post_init__(self) -> None:
        for name in ("idle_ttl", "lease_ttl", "manifest_ttl", "wait_timeout"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ContractError(f"{name} must be a positive number of seconds, not {value}")
            if value > MAX_SECONDS:  # Redis refuses such a TTL at the first put, and a
                # heartbeat thread cannot wait a third of it
                raise ContractError(f"{name} must be at most {MAX_SECONDS:g} s (31 years), "
                                    f"not {value:g}")
        if self.lease_ttl < 0.3:
            raise ContractError(f"lease_ttl must be at least 0.3 s, not {self.lease_ttl}")
        for name in ("retries", "wait_replicas"):
            if getattr(self, name) < 0:
                raise ContractError(f"{name} must be >= 0, not {getattr(self, name)}")


def missing_namespace(nodes, display: str, keys: KeySchema, retries: int
                      ) -> NamespaceNotFoundError:
    """The error for a namespace without metadata, naming the likely cause."""
    index = keys.manifest_index
    if (command(nodes, index, "EXISTS", index, retries=retries)
            or command(nodes, keys.owners, "HLEN", keys.owners, retries=retries)):
        return NamespaceNotFoundError(
            f"namespace {keys.namespace!r} at {display} has manifests or owners but no "
            f"metadata ({keys.meta.decode()} is gone): Redis restarted without persistence "
            "or lost the key; a live engine writes it again at its next heartbeat "
            "(lease_ttl / 3)")
    return NamespaceNotFoundError(f"no namespace {keys.namespace!r} at {display}")


class _KeyOps:
    """Own one batch's operations on one key: holds to add and drop, bytes to write."""

    __slots__ = ("retain", "release", "rank", "pinned", "held", "rows", "data")

    def __init__(self) -> None:
        self.retain = self.release = self.rank = 0
        # This owner's hold count once the batch's retains are applied, and at its end:
        # what the hold scripts set, so sending them again changes nothing.
        self.pinned = self.held = 0
        self.rows: np.ndarray | None = None
        self.data: bytes | None = None  # the encoded rows, once built


class RedisBlockStore:
    """Own one namespace's blocks, per-owner holds and this owner's lease in Redis.

    A block is immutable: written with ``SET NX``, the first writer wins. A block
    held by any owner has no TTL, and the last release gives it the idle TTL.
    Each batch is one round per node: a hold script call before the writes, the
    writes, and a settle script call after them. When another writer's bytes
    already sit under a key, this store writes its own rows under a variant key
    (the key and a digest of its rows), moves its holds there and from then on
    reads, holds and records that variant for the key: its requests read back
    what they computed, never the other writer's rows.
    """

    def __init__(self, nodes: SingleNode | ClusterNodes, layout: RoutingLayout, namespace: str,
                 options: RedisOptions = RedisOptions(), display_url: str = "redis://") -> None:
        self.layout = layout
        self.namespace = namespace
        self.keys = KeySchema(namespace)
        if options.codec not in codec.CODECS:
            raise ContractError(f"codec must be one of {codec.CODECS}, not {options.codec!r}")
        self._codec = codec.codec_for(layout, options.codec)
        self.owner = check_name(default_owner() if options.owner is None else options.owner,
                                "owner")
        self.options = options
        self.hash_algo = hasher_name(options.hash_algo)
        self._nodes = nodes
        self._display_url = display_url
        self._idle_ms = math.ceil(options.idle_ttl * 1000)  # PX 0 is an error: 1 ms at least
        # key -> this writer's variant key, for keys under which another writer's rows sit:
        # the variant of the rows it wrote last under the key. Every change, in order, is
        # also in _variant_log (what a helper process tells the engine).
        self._variants: dict[str, str] = {}
        self._variant_log: list[tuple[str, str]] = []
        self._counts = Counter()
        # What this owner holds, as it asked: close() drops exactly these holds, and a
        # lease that finds itself reclaimed applies them again. Guarded by _hold_lock.
        self._holds: Counter[str] = Counter()
        # Keys a failed put may have left held in Redis though _holds, rolled back so that
        # the caller's retry counts once, does not count them: close() drops these too.
        self._uncertain: set[str] = set()
        # Request ids of manifests a failed put may have recorded: its retry records them
        # again, which replaces nothing a caller recorded before.
        self._retried: set[str] = set()
        self._hold_lock = threading.RLock()
        self._closed = False
        self.reopen_args: tuple[str, dict] | None = None  # set by open_redis_store
        self._lease: Lease | None = None
        with redis_errors(namespace, "opening the namespace"):
            # Loaded up front so the first batch needs no NOSCRIPT round trip per node.
            self.on_primaries(lambda client: [client.script_load(script.source)
                                              for script in SCRIPTS.values()])
            self._open_namespace()
            # Once an engine: its helper process opens without the janitor and this check.
            if options.janitor:
                from r3cache.store.redis.janitor import reclaim_dead_owners

                reclaim_dead_owners(self)
                self._warn_of_settings()
            if options.lease:
                self._lease = Lease(self)

    def _warn_of_settings(self) -> None:
        """Log, once per setting, a primary whose settings undo what this store counts on:
        a maxmemory-policy that may evict keys without a TTL (held blocks, their holds,
        owners' leases: their rows then read back as missing; under the safe policies only
        idle blocks, which carry a TTL, can be evicted, and without maxmemory none are),
        and fewer replicas than ``wait_replicas`` (every write would wait ``wait_timeout``
        for acknowledgements that cannot come)."""
        def settings(client):
            try:
                return client.info("memory"), client.info("replication")
            except redis.exceptions.ResponseError:  # an ACL without INFO: nothing to tell
                return None

        evicting = short = False
        for memory, replication in filter(None, self.on_primaries(settings)):
            policy = memory.get("maxmemory_policy")
            if not evicting and int(memory.get("maxmemory", 0)) and policy not in SAFE_POLICIES:
                evicting = True
                log.warning("namespace %r: %s evicts with maxmemory-policy %s: under memory "
                            "pressure Redis may evict held blocks and the holds themselves; "
                            "set volatile-lru (deploy/redis-cluster.conf)", self.namespace,
                            self._display_url, policy)
            replicas = int(replication.get("connected_slaves", 0))
            if not short and replicas < self.options.wait_replicas:
                short = True
                log.warning("namespace %r: a primary of %s has %d connected replica(s), "
                            "wait_replicas=%d: each write waits wait_timeout (%g s) and is "
                            "counted unreplicated until enough replicas connect",
                            self.namespace, self._display_url, replicas,
                            self.options.wait_replicas, self.options.wait_timeout)

    # -- the BlockStore protocol ----------------------------------------------------

    def put(
        self,
        objects: Mapping[str, np.ndarray],
        retain_keys: Collection[str] = (),
        release_keys: Sequence[str] = (),
        manifests: Sequence[Manifest] = (),
    ) -> None:
        self._check_open()
        if (retain_keys or release_keys or manifests) and self._lease is None:
            raise ContractError("a store opened with lease=False cannot hold blocks")
        if self._lease is not None:
            self._lease.check()
        check_put(self.layout, objects, retain_keys, release_keys, manifests)
        retain_keys, release_keys = list(retain_keys), list(release_keys)  # read twice
        # Keys become Redis key names and manifest fields: each one checked before
        # anything is sent (a bad one would fail halfway through a round).
        check_keys([*objects, *retain_keys, *release_keys,
                    *(k for m in manifests for k in m.block_keys)])
        with redis_errors(self.namespace, "writing blocks"), self._hold_lock:
            journal: dict[str, int] = {}  # key -> its count in _holds before this put
            try:
                if manifests:
                    # Manifests hold their blocks before the engine releases them.
                    self._write(objects, retain_keys, (), journal)
                    self._record(manifests)
                    self._write({}, (), release_keys, journal)
                else:
                    self._write(objects, retain_keys, release_keys, journal)
            except BaseException:
                # The caller retries the whole put (the worker carries what it held): the
                # retry must count each pin once. What this one set in Redis, its retry
                # sets again, or close() drops.
                for key, count in journal.items():
                    self._set_hold(key, count)
                self._uncertain.update(journal)
                self._retried.update(m.request_id for m in manifests)
                raise
            if self._uncertain:  # the keys this put set are as _holds counts them again
                self._uncertain.difference_update(journal)
            if self._retried:
                self._retried.difference_update(m.request_id for m in manifests)

    def _variant(self, keys: Collection[str]) -> list[str]:
        """``keys`` with this writer's variant in place of each key it lost a conflict on."""
        variants = self._variants
        return [variants.get(k, k) for k in keys] if variants else list(keys)

    def _write(self, objects, retain_keys, release_keys, journal: dict[str, int]) -> None:
        """One round: this owner's retains, the blocks' bytes, its releases; then, for
        keys under which another writer's rows sit, the same for this writer's variant."""
        if self._variants:
            objects = dict(zip(self._variant(objects), objects.values()))
            retain_keys, release_keys = self._variant(retain_keys), self._variant(release_keys)
        lost = self._round(objects, retain_keys, release_keys, journal)
        if lost:
            self._move_to_variants(lost, journal)

    def _move_to_variants(self, lost: dict[str, np.ndarray], journal: dict[str, int]) -> None:
        """Write each lost key's rows under its variant, and move this owner's holds there.

        The variant's name is the block's key and a digest of the rows, so it is the same
        for every writer with these rows, and a reader of a manifest needs nothing else. A
        lost key may be this writer's variant itself: the same prompt computed again with
        other rows (after a weight update, an engine restart) gets a variant of its own,
        and the manifests recorded before keep naming theirs.
        """
        variants = {}
        for key, rows in lost.items():
            block = key.partition("~")[0]
            variants[key] = self._variants[block] = f"{block}~{codec.rows_digest(rows)}"
            self._variant_log.append((block, variants[key]))
        moved = [k for k in lost for _ in range(self._holds[k])]
        self._round({variants[k]: rows for k, rows in lost.items()},
                    [variants[k] for k in moved], moved, journal)

    def _round(self, objects, retain_keys, release_keys, journal: dict[str, int] | None
               ) -> dict[str, np.ndarray]:
        """One round of writes; returns the rows of keys whose stored bytes are another's.

        Applies the retains and releases to ``_holds``, each changed key's earlier count
        kept in ``journal``; with ``journal`` None, sends each retained key's count as
        ``_holds`` has it (re-applying every hold after a reclaim), changing nothing.
        """
        ops: dict[str, _KeyOps] = {}
        for key, rows in objects.items():
            ops.setdefault(key, _KeyOps()).rows = rows
        for key in retain_keys:
            ops.setdefault(key, _KeyOps()).retain += 1
        for rank, key in enumerate(release_keys):
            op = ops.setdefault(key, _KeyOps())
            op.release += 1
            op.rank = rank
        if not ops:
            return {}
        holds = self._holds
        for key, op in ops.items():
            count = holds.get(key, 0)
            if journal is None:
                op.pinned = op.held = count
                continue
            op.pinned = count + op.retain
            op.held = max(op.pinned - op.release, 0)  # releases never go below zero
            if op.retain or op.release:
                journal.setdefault(key, count)
                self._set_hold(key, op.held)
        names = list(ops)
        block_keys = [self.keys.block(k) for k in names]
        lost: dict[str, np.ndarray] = {}
        for indices, replies in self._execute(
            block_keys, lambda idx: self._write_commands(names, block_keys, ops, idx),
            chunk=_WRITE_CHUNK,
        ):
            written = [i for i in indices if ops[names[i]].rows is not None]
            offset = 1 if any(ops[names[i]].retain for i in indices) else 0
            for i, old in zip(written, replies[offset:]):
                op = ops[names[i]]
                if "~" in names[i]:
                    # A variant: its rows were counted where they were lost. Other rows
                    # under it are this writer's earlier version of the block.
                    if old is not None and old != op.data:
                        self._counts["conflicts"] += 1
                        lost[names[i]] = op.rows
                elif self._count(op, old):
                    lost[names[i]] = op.rows
            if self.options.wait_replicas and replies[-1] < self.options.wait_replicas:
                # Stored, but not yet on a replica (a shard lost its replica to a
                # failover): counted; if this primary dies too, reads fail typed.
                self._counts["unreplicated"] += len(written)
        return lost

    def _record(self, manifests: Sequence[Manifest]) -> None:
        """Three rounds: the holds of earlier manifests under the same request ids dropped
        (a reused id replaces its manifest), each manifest's holds on its blocks, then the
        manifests themselves."""
        from r3cache.store.redis.janitor import release_manifests

        expires = time.time() + self.options.manifest_ttl
        records = [self._own_version(m) for m in manifests]
        names = [self.keys.manifest(m.request_id) for m in records]
        replaced = [m.request_id for m, n in
                    zip(records, self.per_key(names, lambda k: ("EXISTS", k))) if n]
        again = [r for r in replaced if r not in self._retried]  # not a failed put's own
        if again:
            self._counts["manifests_replaced"] += len(again)
            log.warning("namespace %r: %d request id(s) recorded again; their earlier "
                        "manifests were released: %s", self.namespace, len(again),
                        ", ".join(map(repr, again[:8])))
        if replaced:
            release_manifests(self, replaced)
        # Each block once, with the owners taking a hold on it: the samples of one prompt
        # hold the same blocks, and a group of the round then covers all their holds.
        owners_of: dict[str, list[str]] = {}
        for record in records:
            owner = manifest_owner(record.request_id)
            for key in dict.fromkeys(record.block_keys):
                owners_of.setdefault(key, []).append(owner)
        held = list(owners_of)
        block_names = [(self.keys.block(k), self.keys.refs(k)) for k in held]

        def holds(indices):
            # The blocks by the owners holding them: one group for a prompt's blocks.
            groups: dict[tuple[str, ...], list] = {}
            for i in indices:
                groups.setdefault(tuple(owners_of[held[i]]), []).extend(block_names[i])
            args = []
            for owners, pairs in groups.items():
                args += (len(owners), *owners, len(pairs) // 2, *pairs)
            return [MANIFEST_HOLDS_SCRIPT.command(*args)]

        for _ in self._execute([block for block, _ in block_names], holds):
            pass
        for record in records:
            record.expires_at = expires
        keys = [self.keys.manifest(m.request_id) for m in records] + [self.keys.manifest_index]

        def write(indices):
            commands = []
            for i in indices:
                if i == len(records):
                    commands.append(("ZADD", keys[i], *(x for m in records
                                                        for x in (expires, m.request_id))))
                else:
                    fields = records[i].to_fields(self.layout)
                    commands.append(REPLACE_HASH_SCRIPT.command(
                        keys[i], *(x for kv in fields.items() for x in kv)))
            return commands

        for _ in self._execute(keys, write):
            pass

    def _own_version(self, manifest: Manifest) -> Manifest:
        """The manifest naming this writer's variant where another's rows sit under a key."""
        variants = self._variants
        if not variants or not any(k in variants for k in manifest.block_keys):
            return manifest
        segments = [BlockRef(variants[s.key], s.start, s.stop)
                    if isinstance(s, BlockRef) and s.key in variants else s
                    for s in manifest.segments]
        return Manifest(manifest.request_id, manifest.fingerprint, manifest.completion, segments)

    def get_manifests(self, request_ids: Sequence[str]) -> list[Manifest | None]:
        self._check_open()
        request_ids = check_request_ids(request_ids)
        keys = [self.keys.manifest(r) for r in request_ids]
        found: list[Manifest | None] = [None] * len(keys)
        with redis_errors(self.namespace, "reading manifests"):
            for indices, replies in self._execute(
                    keys, lambda idx: [("HGETALL", keys[i]) for i in idx]):
                for i, fields in zip(indices, replies):
                    if fields:
                        found[i] = self.parse_manifest(request_ids[i], fields)
        return found

    def parse_manifest(self, request_id: str, fields) -> Manifest:
        """A manifest from its HGETALL reply (CorruptBlockError if it cannot be read)."""
        return Manifest.from_fields(request_id, hash_reply(fields), self.layout)

    def release_manifests(self, request_ids: Sequence[str]) -> int:
        """Delete manifests and drop their holds, unreadable ones included."""
        from r3cache.store.redis.janitor import release_manifests

        self._check_open()
        request_ids = check_request_ids(request_ids)
        names = [self.keys.manifest(r) for r in request_ids]
        with redis_errors(self.namespace, "releasing manifests"):
            present = [r for r, n in zip(request_ids, self.per_key(names, lambda k: ("EXISTS", k)))
                       if n]
            if present:
                release_manifests(self, present)
        return len(set(present))

    def _write_commands(self, names, block_keys, ops, indices) -> list[tuple]:
        """Retains, then ``SET NX GET`` of the encoded rows, then releases and TTL settling.

        Called per group as the group is sent, so encoding overlaps the servers' work.
        """
        head = (self.owner, self._idle_ms)
        before: list = []
        writes: list = []
        after: list = []
        for i in indices:
            op = ops[names[i]]
            refs = self.keys.refs(names[i])
            if op.retain:
                before += (block_keys[i], refs, op.pinned, 0)
            if op.rows is not None:
                op.data = self._codec.encode(op.rows)
                # A block this round pins is written without a TTL and needs no settling
                # afterwards (the hold before it already exists); others get the idle TTL.
                ttl = () if op.retain else ("PX", self._idle_ms)
                writes.append(("SET", block_keys[i], op.data, "NX", "GET", *ttl))
            if op.release or (op.rows is not None and not op.retain):
                after += (block_keys[i], refs, op.held, op.rank)
        commands = [HOLDS_SCRIPT.command(*head, *before)] if before else []
        commands += writes
        if after:
            commands.append(HOLDS_SCRIPT.command(*head, *after))
        if self.options.wait_replicas:  # WAIT's 0 ms would wait for ever: 1 ms at least
            commands.append(("WAIT", self.options.wait_replicas,
                             math.ceil(self.options.wait_timeout * 1000)))
        return commands

    def _set_hold(self, key: str, count: int) -> None:
        if count:
            self._holds[key] = count
        else:
            self._holds.pop(key, None)

    def _count(self, op: _KeyOps, old: bytes | None) -> bool:
        """Count one SET NX reply; whether the stored bytes are another writer's."""
        if old is None:
            self._counts["written"] += 1
        elif old == op.data:
            self._counts["duplicates"] += 1
        else:
            self._counts["conflicts"] += 1
            return True
        return False

    @property
    def variant_log(self) -> list[tuple[str, str]]:
        """(key, this writer's variant key) for every variant it took, in order: the
        last one of a key is the variant it reads."""
        return self._variant_log

    def add_variants(self, variants: Mapping[str, str]) -> None:
        """Read ``variants[k]`` wherever ``k`` is asked for (what a writer process found)."""
        self._variants.update(variants)

    def get_concatenated(self, keys: Sequence[str]) -> np.ndarray:
        check_key_types(keys)
        return read_concatenated(self.layout, keys, self._decode_into)

    def read_into(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> None:
        """Decode block ``keys[i]`` into ``targets[i]`` (C-contiguous, ``block_shape``)."""
        check_targets(self.layout, keys, targets)
        self._decode_into(keys, targets)

    def _decode_into(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> None:
        self._check_open()
        if not keys:
            return
        first: dict[str, int] = {}  # key -> its first position in ``keys``
        for n, key in enumerate(keys):
            first.setdefault(key, n)
        unique = list(first)
        places = [targets[n] for n in first.values()]  # aligned with ``unique``
        block_keys = [self.keys.block(k) for k in self._variant(unique)]
        missing: list[str] = []
        decode = self._codec.decode_into
        with redis_errors(self.namespace, "reading blocks"):
            # Each group is decoded as it arrives, while the servers send the next ones.
            nodes = self._nodes
            for indices, replies in self._execute(
                block_keys, lambda idx: nodes.read_commands([block_keys[i] for i in idx]),
                chunk=_READ_CHUNK, ahead=_READ_AHEAD,
            ):
                for i, value in zip(indices, nodes.read_values(replies)):
                    key = unique[i]
                    if value is None:
                        missing.append(key)
                    else:
                        decode(value, key, memoryview(places[i]).cast("B"), 0)
        if missing:
            raise BlockNotFoundError(
                sorted(missing, key=first.__getitem__), namespace=self.namespace,
                cause=f"idle TTL ({self.options.idle_ttl:g} s) expired, evicted under "
                "maxmemory, or never written",
            )
        if len(unique) < len(keys):  # a key asked for twice: copy its first place
            for n, key in enumerate(keys):
                if first[key] != n:
                    targets[n][...] = targets[first[key]]

    def flush(self) -> None:
        self._check_open()

    def stats(self) -> StoreStats:
        """Scan the namespace (O(blocks): for inspection and tests, not the hot path)."""
        from r3cache.store.redis.janitor import scan_keys

        self._check_open()
        with redis_errors(self.namespace, "reading stats"):
            blocks = scan_keys(self, self.keys.blocks_pattern)
            refs = scan_keys(self, self.keys.refs_pattern)
            manifests = scan_keys(self, self.keys.manifests_pattern)
            sizes = self.per_key(blocks, lambda k: ("STRLEN", k))
            mine = self.per_key(refs, lambda k: ("HEXISTS", k, self.owner))
        held = {self.keys.block_of_refs(r) for r in refs}
        return StoreStats(
            blocks=len(blocks),
            pinned_blocks=sum(1 for b in blocks if b in held),
            referenced_keys=sum(mine),
            bytes_used=sum(sizes),
            raw_bytes_used=len(blocks) * self.layout.block_nbytes,
            evictions=0,
            manifests=len(manifests),
            **self.write_counts(),
        )

    def write_counts(self) -> dict[str, int]:
        """The StoreStats fields this writer's own puts determine, without a round trip."""
        counts = self._counts
        return {"blocks_written": counts["written"], "duplicate_puts": counts["duplicates"],
                "conflicts": counts["conflicts"], "unreplicated": counts["unreplicated"]}

    @property
    def conflicts(self) -> int:
        """Blocks put under a key another writer's different rows already held."""
        return self._counts["conflicts"]

    def refcount(self, key: str) -> int:
        """This owner's holds on ``key`` (on its variant, where it has one)."""
        refs = self.keys.refs(self._variants.get(key, key))
        with redis_errors(self.namespace, "reading a reference count"):
            return int(self.call(refs, "HGET", refs, self.owner) or 0)

    def close(self) -> None:
        """Drop every hold this owner still has, then its lease and registry entry.

        Holds are dropped whole, also on keys a failed put may have held. If Redis is
        unreachable, the lease expires and the janitor reclaims the holds instead.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._lease is not None:
                from r3cache.store.redis.janitor import drop_holds

                self._lease.stop()  # first: a heartbeat may be re-applying holds
                with redis_errors(self.namespace, "closing"), self._hold_lock:
                    held = {*self._holds, *self._uncertain}
                    # Another store that took the name after this one's lease ran out
                    # holds under it now: its holds are not this store's to drop.
                    if self._lease.ours():
                        drop_holds(self, [self.owner], [self.keys.refs(k) for k in held])
                        self._lease.unregister()
                    self._holds.clear()
                    self._uncertain.clear()
        finally:
            self._nodes.close()

    # -- plumbing shared with the janitor -------------------------------------------

    def _execute(self, keys: Sequence[bytes], build: Callable[[list[int]], list],
                 chunk: int = CHUNK, ahead: int | None = None,
                 ) -> Iterator[tuple[list[int], list[Any]]]:
        return execute(self._nodes, keys, build, scripts=SCRIPTS,
                       retries=self.options.retries, chunk=chunk, ahead=ahead)

    def per_key(self, keys: list[bytes], command: Callable[[bytes], tuple]) -> list:
        """One command per key, pipelined per node; replies in key order."""
        out: list = [None] * len(keys)
        for indices, replies in self._execute(keys, lambda idx: [command(keys[i]) for i in idx]):
            for i, value in zip(indices, replies):
                out[i] = value
        return out

    def client_for(self, key: bytes) -> redis.Redis:
        return self._nodes.client_for(key)

    def call(self, key: bytes, *args: Any) -> Any:
        """One command on the node serving ``key``, retried across a failover or MOVED."""
        return command(self._nodes, key, *args, retries=self.options.retries,
                       scripts=SCRIPTS)

    def primaries(self) -> list[redis.Redis]:
        return self._nodes.primaries()

    def on_primaries(self, call: Callable[[redis.Redis], Any]) -> list:
        """``call(client)`` on every primary, retried as one command is (``call``)."""
        return retried(self._nodes, lambda: [call(c) for c in self._nodes.primaries()],
                       retries=self.options.retries)

    def restore(self, holds: bool) -> None:
        """After Redis lost state: the namespace metadata and, with ``holds``, every hold
        this owner has."""
        with redis_errors(self.namespace, "restoring holds"), self._hold_lock:
            if not self.call(self.keys.meta, "EXISTS", self.keys.meta):
                self._counts["metadata_restored"] += 1
                log.warning("namespace %r: its metadata was gone (Redis restarted without "
                            "persistence?); written again", self.namespace)
                self._open_namespace()
            if holds and self._holds:
                self._round({}, list(self._holds), (), None)

    def _open_namespace(self) -> None:
        fields = {
            "fingerprint": self.layout.fingerprint,
            "num_layers": self.layout.num_layers,
            "topk": self.layout.topk,
            "num_experts": self.layout.num_experts,
            "block_size": self.layout.block_size,
            "dtype": str(self.layout.dtype),
            "codec": self.options.codec,
            "format_version": codec.FORMAT_VERSION,
            "hash_algo": self.hash_algo,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        meta = self.keys.meta
        # Read-only handles (trainers, admins) of an existing namespace write nothing, so
        # they open under OOM and with read-only credentials.
        reply = None if self.options.lease else self.call(meta, "HGETALL", meta)
        if not reply:
            args = [meta, *(str(x) for kv in fields.items() for x in kv)]
            # Through call(): after a restart the script cache is empty (NOSCRIPT).
            reply = self.call(meta, *OPEN_NAMESPACE_SCRIPT.command(*args))
            self.call(NAMESPACES_KEY, "SADD", NAMESPACES_KEY, self.namespace)
        stored = {k.decode(): v.decode() for k, v in hash_reply(reply).items()}
        # A read-only handle writes no block: it decodes whatever each header says.
        checked = ("fingerprint", "codec", "format_version", "hash_algo") if self.options.lease \
            else ("fingerprint", "format_version", "hash_algo")
        for name in checked:
            if stored.get(name) != str(fields[name]):
                raise LayoutMismatchError(
                    f"namespace {self.namespace!r} holds {name} {stored.get(name)!r}, this "
                    f"store was opened with {fields[name]!r}; a new model or layout needs a "
                    "new namespace"
                )

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store for namespace {self.namespace!r} is closed")

    def __repr__(self) -> str:
        return (f"RedisBlockStore(url={self._display_url!r}, namespace={self.namespace!r}, "
                f"owner={self.owner!r})")
