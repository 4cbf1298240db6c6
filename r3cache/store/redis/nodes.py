"""The servers behind a Redis store: routing keys to nodes and one call per node at once."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import redis
from hiredis import pack_command
from redis.cluster import RedisCluster
from redis.crc import key_slot

from r3cache.errors import ContractError

CHUNK = 512  # keys per command group: bounds how long one call occupies the server
# Seconds a round keeps retrying, past its retries, while replies say that the cluster is
# moving slots (a reshard: new keys of a migrating slot are refused until it has moved)
# or failing over; a dropped connection gets the retries alone.
TOPOLOGY_WAIT = 10.0
_SEND_BYTES = 64 << 10  # packed commands are sent in bursts of about this size


def _chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[at : at + size] for at in range(0, len(indices), size)]


class SingleNode:
    """Own the client of a standalone server: every key lives on it."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def partition(self, keys: Sequence[bytes], chunk: int = CHUNK
                  ) -> dict[redis.Redis, list[list[int]]]:
        """Group key indices per node, in chunks."""
        return {self.client: _chunks(list(range(len(keys))), chunk)} if keys else {}

    def client_for(self, key: bytes) -> redis.Redis:
        return self.client

    @staticmethod
    def read_commands(keys: Sequence[bytes]) -> list[tuple]:
        """Commands that return the values of ``keys`` (all on one node): one MGET."""
        return [("MGET", *keys)]

    @staticmethod
    def read_values(replies: list[Any]) -> list[Any]:
        """The values of a group read by ``read_commands``, in key order."""
        return replies[0]

    def primaries(self) -> list[redis.Redis]:
        return [self.client]

    def refresh(self) -> None:
        """Nothing to relearn: there is one node."""

    def close(self) -> None:
        self.client.close()


class ClusterNodes:
    """Own a cluster client's slot map: which primary serves each key."""

    def __init__(self, cluster: RedisCluster) -> None:
        self.client = cluster
        # Slot -> primary, read once from the client's slot map and again after refresh():
        # a per-key lookup through redis-py costs a lock and a wrapper call per key.
        self._primaries: list | None = None

    def partition(self, keys: Sequence[bytes], chunk: int = CHUNK
                  ) -> dict[redis.Redis, list[list[int]]]:
        """Group key indices per primary, in chunks."""
        primaries = self._primaries or self._slot_map()
        groups: dict[Any, list[int]] = defaultdict(list)
        for index, key in enumerate(keys):
            groups[primaries[key_slot(key)]].append(index)
        return {self.client.get_redis_connection(node): _chunks(indices, chunk)
                for node, indices in groups.items()}

    def _slot_map(self) -> list:
        manager = self.client.nodes_manager
        self._primaries = [manager.get_node_from_slot(slot) for slot in range(16384)]
        return self._primaries

    def client_for(self, key: bytes) -> redis.Redis:
        node = (self._primaries or self._slot_map())[key_slot(key)]
        return self.client.get_redis_connection(node)

    @staticmethod
    def read_commands(keys: Sequence[bytes]) -> list[tuple]:
        """Commands that return the values of ``keys`` (one node, any slots): a GET each.

        MGET needs one slot and a Lua loop of GETs copies each value twice more on the
        server; pipelined GETs read ~10 % faster than that script on this project's
        machine (scripts/bench_read.py) and leave nothing to reload after a failover.
        """
        return [("GET", key) for key in keys]

    @staticmethod
    def read_values(replies: list[Any]) -> list[Any]:
        """The values of a group read by ``read_commands``, in key order."""
        return replies

    def primaries(self) -> list[redis.Redis]:
        return [self.client.get_redis_connection(n) for n in self.client.get_primaries()]

    def refresh(self) -> None:
        """Relearn the slot map (after MOVED, a failover or a dead connection)."""
        self._primaries = None
        self.client.nodes_manager.initialize()

    def close(self) -> None:
        self.client.close()


class Round:
    """Own one round of calls: each node's commands sent in bursts, replies read lazily.

    Each node's commands come as groups, built on demand and sent round-robin across
    nodes, so the servers work while later groups are built. Replies are then read
    group by group, round-robin, so the caller can process one group while the
    servers send the next. A ResponseError comes back in place of its reply.

    With ``ahead=None`` every group is sent before the first reply is read: right for
    writes, whose replies are small. With ``ahead=n`` only ``n`` groups a node are sent
    up front and one more each time a group is read: right for reads, because a server
    runs every command it has received before it writes any reply, so a node sent all
    of a round's reads at once sits idle while the caller decodes, and the caller
    waits while the node reads. Keeping ``n`` groups in flight overlaps the two.
    Closing a round before every reply was read disconnects its sockets, so no
    unread reply is left on a pooled connection.
    """

    def __init__(self, calls: Sequence[tuple[redis.Redis, Iterable[Sequence[Sequence[Any]]]]],
                 ahead: int | None = None):
        self._streams: list[_Stream] = []
        self._ahead = ahead
        self._done = False
        try:
            for client, groups in calls:
                self._streams.append(_Stream(client, groups))
            active = list(self._streams)
            while active:
                for stream in list(active):
                    if (ahead is not None and len(stream.unread) >= ahead) or not stream.push():
                        active.remove(stream)
                        stream.buffer.send(stream.connection)
        except BaseException:
            self.close()
            raise

    def replies(self) -> Iterator[tuple[int, int, list[Any]]]:
        """(node index, group index, replies) for every group, round-robin over nodes."""
        while any(stream.unread for stream in self._streams):
            for n, stream in enumerate(self._streams):
                if not stream.unread:
                    continue
                if self._ahead is not None and stream.push():  # the next group, before we wait
                    stream.buffer.send(stream.connection)
                group, size = stream.unread.popleft()
                yield n, group, [_read(stream.connection) for _ in range(size)]
        self._done = True

    def close(self) -> None:
        for stream in self._streams:
            if not self._done:
                stream.connection.disconnect()
            stream.client.connection_pool.release(stream.connection)
        self._streams = []


class _Stream:
    """Own one node's part of a round: its connection, groups to send, groups unread."""

    __slots__ = ("client", "connection", "groups", "sent", "unread", "buffer")

    def __init__(self, client: redis.Redis, groups: Iterable[Sequence[Sequence[Any]]]) -> None:
        self.client = client
        self.connection = client.connection_pool.get_connection()
        self.groups = iter(groups)
        self.sent = 0  # groups built so far; a group's index on this node
        self.unread: deque[tuple[int, int]] = deque()  # (group index, command count)
        self.buffer = _Buffer()

    def push(self) -> bool:
        """Build and buffer the next group (sent once the buffer is full); False at the end."""
        group = next(self.groups, None)
        if group is None:
            return False
        if group:
            # hiredis packs a command in ~0.2 µs; redis-py's pack_commands wraps the same
            # call in ~1 µs of Python per command, which a read of 128 GETs felt.
            self.buffer.add([pack_command(command) for command in group])
            if self.buffer.size >= _SEND_BYTES:
                self.buffer.send(self.connection)
        self.unread.append((self.sent, len(group)))
        self.sent += 1
        return True


class _Buffer:
    """Own packed commands not yet sent on one connection, and their size."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list = []
        self.size = 0

    def add(self, parts: list) -> None:
        self.parts.extend(parts)
        self.size += sum(len(p) for p in parts)

    def send(self, connection) -> None:
        if self.parts:
            connection.send_packed_command([b"".join(self.parts)])  # one sendall, not one a part
            self.parts, self.size = [], 0


def _read(connection) -> Any:
    try:
        return connection.read_response()
    except redis.exceptions.ResponseError as exc:
        return exc


# Replies that mean "ask again after relearning the slot map": the key moved, the node
# was demoted to a replica, the cluster is failing over or the node is still loading.
_TOPOLOGY = (redis.exceptions.MovedError, redis.exceptions.AskError,
             redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
             redis.exceptions.ReadOnlyError, redis.exceptions.BusyLoadingError,
             redis.exceptions.MasterDownError)
# Replies no standalone server gives (READONLY, LOADING and MASTERDOWN come from replicas).
_CLUSTER_ONLY = (redis.exceptions.MovedError, redis.exceptions.AskError,
                 redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)
_CLUSTER_ONLY_TEXT = ("non local key", "cluster is down", "CLUSTERDOWN")
_TOPOLOGY_TEXT = ("non local key", "cluster is down", "MOVED", "ASK", "READONLY",
                  "CLUSTERDOWN", "TRYAGAIN", "LOADING", "MASTERDOWN")


def is_topology_error(reply: Any) -> bool:
    return isinstance(reply, _TOPOLOGY) or (
        isinstance(reply, redis.exceptions.ResponseError)
        and any(text in str(reply) for text in _TOPOLOGY_TEXT))


def execute(
    nodes: SingleNode | ClusterNodes,
    keys: Sequence[bytes],
    build: Callable[[list[int]], list[Sequence[Any]]],
    *,
    scripts: dict[str, Any],
    retries: int,
    chunk: int = CHUNK,
    ahead: int | None = None,
) -> Iterator[tuple[list[int], list[Any]]]:
    """Run ``build(indices)``'s commands for every group of ``keys``, one round per node.

    Yields ``(indices, replies)`` per group. A lost script (NOSCRIPT after a restart
    or failover) is loaded and that command alone re-sent; a topology change or a
    dropped connection relearns the slot map and retries the affected groups, up to
    ``retries`` times (and for ``TOPOLOGY_WAIT`` seconds at least while the topology
    changes). Any other error reply is raised. A retried group is sent whole, so
    its commands must be idempotent: some of them may have run already (the rest of a
    group that met a moved key, a group whose replies a dropped connection lost).
    """
    pending = list(range(len(keys)))
    attempt, moving_until = 0, None
    while True:
        plan = []  # per node: (client, groups of key indices, their commands once built)
        for client, lists in nodes.partition([keys[i] for i in pending], chunk).items():
            plan.append((client, [[pending[p] for p in positions] for positions in lists], []))
        retry: list[int] = []
        served: set[tuple[int, int]] = set()
        try:
            calls = Round([(client, _built(groups, build, built))
                           for client, groups, built in plan], ahead)
            try:
                for n, g, replies in calls.replies():
                    client, groups, built = plan[n]
                    if any(is_topology_error(r) for r in replies):
                        if isinstance(nodes, SingleNode):
                            _refuse_cluster_replies(client, replies)
                        if moving_until is None:
                            moving_until = time.monotonic() + TOPOLOGY_WAIT
                        if attempt >= retries and time.monotonic() >= moving_until:
                            raise next(r for r in replies if is_topology_error(r))
                        retry += groups[g]
                        continue
                    _reload_scripts(client, built[g], replies, scripts)
                    served.add((n, g))
                    yield groups[g], replies
            finally:
                calls.close()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            if attempt >= retries or not retryable(exc):
                raise
            retry = [i for n, (_, groups, _) in enumerate(plan) for g, idx in enumerate(groups)
                     if (n, g) not in served for i in idx]
        if not retry:
            return
        pending = retry
        _relearn(nodes, attempt)
        attempt += 1


# Connection errors that trying again cannot mend: refused credentials, a refused TLS
# certificate (redis-py raises both as ConnectionErrors).
REFUSED = (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)


def retryable(exc: Exception) -> bool:
    """Whether a connection error may pass if tried again: not a refusal, so an engine
    with a wrong password gets StoreAccessError at once, not after the retries' backoff."""
    return not isinstance(exc, REFUSED)


def _refuse_cluster_replies(client: redis.Redis, replies: list[Any]) -> None:
    """A standalone URL naming a cluster node: replies only a cluster node gives (a key it
    does not serve redirected, a script's keys in slots of other nodes, the cluster
    down) are not a topology change that waiting would see through."""
    found = next((r for r in replies if isinstance(r, _CLUSTER_ONLY) or (
        isinstance(r, redis.exceptions.ResponseError)
        and any(text in str(r) for text in _CLUSTER_ONLY_TEXT))), None)
    if found is not None:
        kwargs = client.get_connection_kwargs()
        where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
        raise ContractError(
            f"{where} is a Redis Cluster node ({type(found).__name__}: {found}); open the "
            "store with a redis+cluster:// URL")


def hash_reply(reply) -> dict:
    """HGETALL's reply as a dict, whether the parser gave a dict or a flat list."""
    return reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2]))


def command(nodes: SingleNode | ClusterNodes, key: bytes, *args: Any, retries: int,
            scripts: dict[str, Any] | None = None) -> Any:
    """One command on the node serving ``key``, retried as ``execute`` retries a round:
    across a failover, a moved slot or a dropped connection (a script among ``scripts``
    reloaded if the node lost it). Its raw reply."""
    for _, replies in execute(nodes, [key], lambda _: [args], scripts=scripts or {},
                              retries=retries):
        return replies[0]


def retried(nodes: SingleNode | ClusterNodes, call: Callable[[], Any], *, retries: int
            ) -> Any:
    """What ``call()`` returns: client calls that are not one key's command (INFO or
    SCRIPT LOAD on every primary, a SCAN), retried as ``execute`` retries a round, after a
    dropped connection or a timeout, up to ``retries`` times, the slot map relearnt in
    between (``call`` looks the primaries up again)."""
    attempt = 0
    while True:
        try:
            return call()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            if attempt >= retries or not retryable(exc):
                raise
        _relearn(nodes, attempt)
        attempt += 1


def _reload_scripts(client, commands, replies: list[Any], scripts: dict[str, Any]) -> None:
    """Re-run commands whose script the node lost (NOSCRIPT); raise any other error reply."""
    for n, reply in enumerate(replies):
        if isinstance(reply, redis.exceptions.NoScriptError):
            client.script_load(scripts[commands[n][1]].source)
            replies[n] = client.execute_command(*commands[n])
        elif isinstance(reply, redis.exceptions.ResponseError):
            raise reply


def _built(groups, build, record: list) -> Iterator[list]:
    """Build each group's commands when the sender asks for them, keeping a copy."""
    for indices in groups:
        commands = build(indices)
        record.append(commands)
        yield commands


def _relearn(nodes: SingleNode | ClusterNodes, attempt: int) -> None:
    time.sleep(min(0.05 * 2**attempt, 1.0))
    # A failed refresh is not final: the next attempt reports the failure if it persists.
    # (No cluster node answering is a RedisClusterException, which is not a RedisError.)
    with contextlib.suppress(redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
        nodes.refresh()
