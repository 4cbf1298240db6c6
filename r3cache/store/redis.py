"""RedisBlockStore: blocks, per-owner reference counts and leases in Redis or a Redis Cluster."""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.retry import Retry

from r3cache import codec
from r3cache.errors import (
    BlockNotFoundError,
    ContractError,
    LayoutMismatchError,
    StoreAccessError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)
from r3cache.layout import RoutingLayout
from r3cache.store.base import StoreStats
from r3cache.store.redis_keys import NAMESPACES_KEY, KeySchema, check_name
from r3cache.store.redis_nodes import ClusterNodes, SingleNode, call_nodes
from r3cache.store.redis_scripts import (
    APPLY_SCRIPT,
    OPEN_NAMESPACE_SCRIPT,
    READ_SCRIPT,
    RECLAIM_SCRIPT,
    Script,
)

HASH_ALGO = "sha256"
DEFAULT_IDLE_TTL = 86_400.0
DEFAULT_LEASE_TTL = 30.0
_CHUNK = 512  # keys per script call: bounds how long one call blocks the server
_OWN_ROWS_LIMIT = 4096
_TOPOLOGY_ERRORS = ("non local key", "MOVED", "ASK", "READONLY", "CLUSTERDOWN", "TRYAGAIN",
                    "LOADING", "MASTERDOWN")

# Options r3cache reads itself; everything else goes to the redis-py client.
_STORE_OPTIONS: dict[str, Callable[[Any], Any]] = {
    "idle_ttl": float, "lease_ttl": float, "owner": str, "retries": int,
    "janitor": lambda v: str(v).lower() not in ("0", "false", "no"),
    "lease": lambda v: str(v).lower() not in ("0", "false", "no"),
}
_CLIENT_OPTIONS: dict[str, Callable[[Any], Any]] = {
    "pool_size": int, "socket_timeout": float, "socket_connect_timeout": float,
    "username": str, "password": str,
}


@contextmanager
def redis_errors(namespace: str, what: str) -> Iterator[None]:
    """Translate redis-py's exceptions into r3cache's, at the store's one boundary."""
    try:
        yield
    except StoreError:
        raise
    except (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError) as exc:
        raise StoreAccessError(f"{what} in namespace {namespace!r} was refused: {exc}") from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
            redis.exceptions.ClusterDownError, redis.exceptions.ClusterError) as exc:
        raise StoreUnavailableError(
            f"{what} in namespace {namespace!r}: Redis unavailable ({type(exc).__name__}: {exc})"
        ) from None
    except redis.exceptions.ResponseError as exc:
        if str(exc).startswith("OOM"):
            raise StoreFullError(
                f"{what} in namespace {namespace!r}: Redis is out of memory ({exc}); "
                "nothing of the refused call was written"
            ) from None
        raise StoreError(f"{what} in namespace {namespace!r} failed: {exc}") from None
    except redis.exceptions.RedisError as exc:
        raise StoreError(f"{what} in namespace {namespace!r} failed: {exc}") from None


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


class RedisBlockStore:
    """Own one namespace's blocks, per-owner holds and this owner's lease in Redis.

    A block is immutable (the first writer wins); a block held by any owner has
    no TTL, and the last release gives it the idle TTL. Each batch is one script
    call per node. When another writer's bytes already sit under a key, this
    store keeps its own rows for that key in process, so its requests read back
    what they computed, never another replica's rows.
    """

    def __init__(self, nodes, layout: RoutingLayout, namespace: str,
                 options: RedisOptions = RedisOptions(), display_url: str = "redis://") -> None:
        self.layout = layout
        self.namespace = namespace
        self.keys = KeySchema(namespace)
        self.owner = check_name(options.owner or default_owner(), "owner")
        self.options = options
        self._nodes = nodes
        self._display_url = display_url
        self._idle_ms = int(options.idle_ttl * 1000)
        self._own_rows: OrderedDict[str, np.ndarray] = OrderedDict()
        self._own_lock = threading.Lock()
        self._counts = {"written": 0, "duplicates": 0, "conflicts": 0}
        # What this owner holds, as it asked: close() drops exactly these holds.
        self._holds: Counter[str] = Counter()
        self._closed = False
        with redis_errors(namespace, "opening the namespace"):
            # Loaded up front so the first batch needs no NOSCRIPT round trip per node.
            for client in nodes.primaries():
                for script in (APPLY_SCRIPT, READ_SCRIPT, RECLAIM_SCRIPT, OPEN_NAMESPACE_SCRIPT):
                    client.script_load(script.source)
            self._open_namespace()
            self._lease = _Lease(self) if options.lease else None
            if options.janitor:
                from r3cache.store.janitor import reclaim_dead_owners

                reclaim_dead_owners(self)

    # -- the BlockStore protocol ----------------------------------------------------

    def put(
        self,
        objects: Mapping[str, np.ndarray],
        retain_keys: Collection[str] = (),
        release_keys: Sequence[str] = (),
    ) -> None:
        self._check_open()
        if (retain_keys or release_keys) and self._lease is None:
            raise ContractError("a store opened with lease=False cannot hold blocks")
        ops: dict[str, list] = {}  # key -> [retain, data, release, rank]
        for key in retain_keys:
            ops.setdefault(key, [0, b"", 0, 0])[0] += 1
        encoded = {key: codec.encode_rows(rows, self.layout) for key, rows in objects.items()}
        for key, data in encoded.items():
            ops.setdefault(key, [0, b"", 0, 0])[1] = data
        for rank, key in enumerate(release_keys):
            op = ops.setdefault(key, [0, b"", 0, 0])
            op[2] += 1
            op[3] = rank
        if not ops:
            return
        self._track_holds(retain_keys, release_keys)
        names = list(ops)
        block_keys = [self.keys.block(k) for k in names]
        head = (self.owner, self._idle_ms)

        def argv(indices: list[int]) -> list:
            args = list(head)
            for i in indices:
                key = names[i]
                args += (block_keys[i], self.keys.refs(key), *ops[key])
            return args

        with redis_errors(self.namespace, "writing blocks"):
            for indices, statuses in self._run(APPLY_SCRIPT, block_keys, argv):
                for i, status in zip(indices, statuses):
                    self._count(names[i], status, objects)

    def _track_holds(self, retain_keys: Collection[str], release_keys: Sequence[str]) -> None:
        holds = self._holds
        holds.update(retain_keys)
        for key in release_keys:
            if holds[key] > 1:
                holds[key] -= 1
            else:
                holds.pop(key, None)

    def _count(self, key: str, status: int, objects: Mapping[str, np.ndarray]) -> None:
        if status == 1:
            self._counts["written"] += 1
        elif status == 2:
            self._counts["duplicates"] += 1
        elif status == 3:
            self._counts["conflicts"] += 1
            with self._own_lock:
                self._own_rows[key] = np.array(objects[key], copy=True)
                while len(self._own_rows) > _OWN_ROWS_LIMIT:
                    self._own_rows.popitem(last=False)

    def get_concatenated(self, keys: Sequence[str]) -> np.ndarray:
        self._check_open()
        if not keys:
            return self.layout.empty_rows()
        unique = list(dict.fromkeys(keys))
        block_keys = [self.keys.block(k) for k in unique]
        values: list[bytes | None] = [None] * len(unique)
        with redis_errors(self.namespace, "reading blocks"):
            for indices, found in self._run(READ_SCRIPT, block_keys,
                                            lambda idx: [block_keys[i] for i in idx]):
                for i, value in zip(indices, found):
                    values[i] = value
        missing = [k for k, v in zip(unique, values) if v is None]
        if missing:
            raise BlockNotFoundError(
                missing, namespace=self.namespace,
                cause=f"idle TTL ({self.options.idle_ttl:g} s) expired, evicted under "
                "maxmemory, or never written",
            )
        with self._own_lock:
            own = {k: self._own_rows[k] for k in unique if k in self._own_rows}
        blocks = {k: own[k] if k in own else codec.decode_rows(v, self.layout, k)
                  for k, v in zip(unique, values)}
        return np.concatenate([blocks[k] for k in keys])

    def flush(self) -> None:
        self._check_open()

    def stats(self) -> StoreStats:
        """Scan the namespace (O(blocks): for inspection and tests, not the hot path)."""
        from r3cache.store.janitor import scan_keys

        self._check_open()
        with redis_errors(self.namespace, "reading stats"):
            blocks = scan_keys(self, self.keys.blocks_pattern)
            refs = scan_keys(self, self.keys.refs_pattern)
            sizes = self._per_key(blocks, lambda k: ("STRLEN", k))
            mine = self._per_key(refs, lambda k: ("HEXISTS", k, self.owner))
        held = {self.keys.block_of_refs(r) for r in refs}
        return StoreStats(
            blocks=len(blocks),
            pinned_blocks=sum(1 for b in blocks if b in held),
            referenced_keys=sum(mine),
            bytes_used=sum(sizes),
            raw_bytes_used=len(blocks) * self.layout.block_nbytes,
            blocks_written=self._counts["written"],
            duplicate_puts=self._counts["duplicates"],
            conflicts=self._counts["conflicts"],
            evictions=0,
        )

    def refcount(self, key: str) -> int:
        """This owner's holds on ``key``."""
        with redis_errors(self.namespace, "reading a reference count"):
            value = self._client_for(self.keys.refs(key)).hget(self.keys.refs(key), self.owner)
        return int(value or 0)

    def close(self) -> None:
        """Drop every hold this owner still has, then its lease and registry entry.

        Holds are dropped whole (not decremented), so a retain that a retry applied
        twice cannot outlive the owner. If Redis is unreachable, the lease expires
        and the janitor reclaims the holds instead.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._lease is not None:
                with redis_errors(self.namespace, "closing"):
                    from r3cache.store.janitor import drop_holds

                    drop_holds(self, [self.owner], [self.keys.refs(k) for k in self._holds])
                    self._holds.clear()
                    self._lease.stop()
        finally:
            self._nodes.close()

    # -- plumbing -------------------------------------------------------------------

    def _run(self, script: Script, keys: Sequence[bytes],
             argv: Callable[[list[int]], list]) -> Iterator[tuple[list[int], Any]]:
        """Call ``script`` once per node (per chunk) over ``keys``; retry topology changes."""
        pending = list(range(len(keys)))
        for attempt in range(self.options.retries + 1):
            calls = []
            for client, positions in self._nodes.partition([keys[i] for i in pending]).items():
                for at in range(0, len(positions), _CHUNK):
                    indices = [pending[p] for p in positions[at : at + _CHUNK]]
                    calls.append((client, indices))
            try:
                results = call_nodes([(c, script.command(*argv(idx))) for c, idx in calls])
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if attempt == self.options.retries:
                    raise
                self._recover(attempt)
                continue
            retry: list[int] = []
            for (client, indices), result in zip(calls, results):
                if isinstance(result, redis.exceptions.NoScriptError):
                    client.script_load(script.source)  # lost after a restart or failover
                    retry += indices
                elif isinstance(result, redis.exceptions.ResponseError):
                    if not any(marker in str(result) for marker in _TOPOLOGY_ERRORS):
                        raise result
                    if attempt == self.options.retries:
                        raise result
                    retry += indices
                else:
                    yield indices, result
            if not retry:
                return
            pending = retry
            self._recover(attempt)

    def _recover(self, attempt: int) -> None:
        time.sleep(min(0.05 * 2**attempt, 1.0))
        try:
            self._nodes.refresh()
        except redis.exceptions.RedisError:
            pass  # the next attempt reports the failure if it persists

    def _per_key(self, keys: list[bytes], command: Callable[[bytes], tuple]) -> list:
        out: list = [None] * len(keys)
        for client, indices in self._nodes.partition(keys).items():
            pipe = client.pipeline(transaction=False)
            for i in indices:
                pipe.execute_command(*command(keys[i]))
            for i, value in zip(indices, pipe.execute()):
                out[i] = value
        return out

    def _client_for(self, key: bytes):
        return next(iter(self._nodes.partition([key])))

    def _open_namespace(self) -> None:
        fields = {
            "fingerprint": self.layout.fingerprint,
            "num_layers": self.layout.num_layers,
            "topk": self.layout.topk,
            "num_experts": self.layout.num_experts,
            "block_size": self.layout.block_size,
            "dtype": str(self.layout.dtype),
            "codec": "lz4",
            "format_version": codec.FORMAT_VERSION,
            "hash_algo": HASH_ALGO,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        meta = self.keys.meta
        args = [meta, *[str(x) for kv in fields.items() for x in kv]]
        found = {}
        for _, reply in self._run(OPEN_NAMESPACE_SCRIPT, [meta], lambda idx: args):
            found = dict(zip(reply[::2], reply[1::2]))
        self._client_for(NAMESPACES_KEY).sadd(NAMESPACES_KEY, self.namespace)
        stored = {k.decode(): v.decode() for k, v in found.items()}
        for name in ("fingerprint", "codec", "format_version"):
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


class _Lease:
    """Own this owner's heartbeat key and registry entry, refreshed by a daemon thread."""

    def __init__(self, store: RedisBlockStore) -> None:
        self._store = store
        self._ttl_ms = int(store.options.lease_ttl * 1000)
        self._key = store.keys.lease(store.owner)
        self._stop = threading.Event()
        info = f"host={socket.gethostname()} pid={os.getpid()} started={int(time.time())}"
        store._client_for(store.keys.owners).hset(store.keys.owners, store.owner, info)
        self.beat()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"r3cache-lease-{store.owner}")
        self._thread.start()

    def beat(self) -> None:
        self._store._client_for(self._key).set(self._key, b"1", px=self._ttl_ms)

    def _run(self) -> None:
        while not self._stop.wait(self._ttl_ms / 3000):
            try:
                self.beat()
            except redis.exceptions.RedisError:
                pass  # retried at the next beat; the lease TTL covers short outages

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        store = self._store
        store._client_for(self._key).delete(self._key)
        store._client_for(store.keys.owners).hdel(store.keys.owners, store.owner)


def _split_options(query: dict[str, str], options: dict[str, Any]):
    """(r3cache's options, redis-py client options); unknown names are an error."""
    merged = {**query, **options}
    ours: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for key, value in merged.items():
        if key in _STORE_OPTIONS:
            ours[key] = _STORE_OPTIONS[key](value)
        elif key in _CLIENT_OPTIONS:
            client["max_connections" if key == "pool_size" else key] = _CLIENT_OPTIONS[key](value)
        elif key in URL_QUERY_ARGUMENT_PARSERS:
            client[key] = URL_QUERY_ARGUMENT_PARSERS[key](value)
        elif key.startswith("ssl_"):
            client[key] = value
        else:
            raise ContractError(f"unknown Redis store option {key!r}")
    return RedisOptions(**ours), client


def _display(parts) -> str:
    """The URL without credentials, for repr and errors."""
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _connect(url: str, namespace: str, options: dict[str, Any]):
    """Clients for ``url``: (nodes, r3cache's options, the URL without credentials)."""
    parts = urlsplit(url)
    store_options, client_options = _split_options(dict(parse_qsl(parts.query)), options)
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), store_options.retries)
    client_options.setdefault("socket_timeout", 10.0)
    client_options.setdefault("socket_connect_timeout", 5.0)
    display = _display(parts)
    if not parts.scheme.endswith("+cluster"):
        plain = url.split("?", 1)[0]
        client = redis.Redis.from_url(plain, retry=retry, **client_options)
        return SingleNode(client), store_options, display
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if userinfo:
        user, _, password = userinfo.partition(":")
        client_options.setdefault("username", unquote(user) or None)
        client_options.setdefault("password", unquote(password) or None)
    startup = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        startup.append(ClusterNode(name or "127.0.0.1", int(port or 6379)))
    if parts.scheme.startswith("rediss"):
        client_options["ssl"] = True
    client_options.pop("db", None)  # a cluster has only database 0
    with redis_errors(namespace, f"connecting to {display}"):
        try:
            cluster = RedisCluster(startup_nodes=startup, retry=retry, **client_options)
        except redis.exceptions.RedisClusterException as exc:
            raise StoreUnavailableError(f"no Redis Cluster at {display}: {exc}") from None
    return ClusterNodes(cluster), store_options, display


def open_redis_store(url: str, *, layout: RoutingLayout | None, namespace: str,
                     **options: Any) -> RedisBlockStore:
    """Open a Redis-backed store: ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://``.

    With ``layout=None`` the namespace must exist, and its stored layout is used.
    """
    check_name(namespace, "namespace")
    nodes, store_options, display = _connect(url, namespace, options)
    try:
        if layout is None:
            layout = _stored_layout(nodes, KeySchema(namespace), display)
        return RedisBlockStore(nodes, layout, namespace, store_options, display)
    except BaseException:
        nodes.close()
        raise


def _stored_layout(nodes, keys: KeySchema, display: str) -> RoutingLayout:
    with redis_errors(keys.namespace, "reading the namespace metadata"):
        client = next(iter(nodes.partition([keys.meta])))
        fingerprint = client.hget(keys.meta, "fingerprint")
    if fingerprint is None:
        raise ContractError(f"no namespace {keys.namespace!r} at {display}")
    return RoutingLayout.from_fingerprint(fingerprint.decode())
