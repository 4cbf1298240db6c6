"""The servers behind a Redis store: routing keys to nodes and one call per node at once."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

CHUNK = 512  # keys per command group: bounds how long one call occupies the server


def _chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[at : at + size] for at in range(0, len(indices), size)]


class SingleNode:
    """Own the client of a standalone server: every key lives on it."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def partition(self, keys: Sequence[bytes], by_slot: bool = False, chunk: int = CHUNK
                  ) -> dict[redis.Redis, list[list[int]]]:
        """Group key indices per node, in chunks (or per hash slot with ``by_slot``)."""
        return {self.client: _chunks(list(range(len(keys))), chunk)} if keys else {}

    def client_for(self, key: bytes) -> redis.Redis:
        return self.client

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

    def partition(self, keys: Sequence[bytes], by_slot: bool = False, chunk: int = CHUNK
                  ) -> dict[redis.Redis, list[list[int]]]:
        """Group key indices per primary, in chunks (or per hash slot with ``by_slot``)."""
        manager = self.client.nodes_manager
        groups: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        nodes = {}
        for index, key in enumerate(keys):
            slot = key_slot(key)
            node = manager.get_node_from_slot(slot)
            nodes[node.name] = node
            groups[node.name][slot if by_slot else 0].append(index)
        out = {}
        for name, per_slot in groups.items():
            lists = list(per_slot.values()) if by_slot else _chunks(per_slot[0], chunk)
            out[self.client.get_redis_connection(nodes[name])] = lists
        return out

    def client_for(self, key: bytes) -> redis.Redis:
        node = self.client.nodes_manager.get_node_from_slot(key_slot(key))
        return self.client.get_redis_connection(node)

    def primaries(self) -> list[redis.Redis]:
        return [self.client.get_redis_connection(n) for n in self.client.get_primaries()]

    def refresh(self) -> None:
        """Relearn the slot map (after MOVED, a failover or a dead connection)."""
        self.client.nodes_manager.initialize()

    def close(self) -> None:
        self.client.close()


def call_nodes(calls: Sequence[tuple[redis.Redis, Iterable[Sequence[Sequence[Any]]]]]
               ) -> list[list[Any]]:
    """Send every node its commands, then read every reply: one write burst, one read a socket.

    Each node's commands come as chunks, produced lazily and sent round-robin across
    nodes as they are produced, so the servers work while later chunks are built.
    A ResponseError comes back in place of its reply; a connection failure
    disconnects every socket used (so no reply is left unread) and is raised.
    """
    taken = []
    try:
        streams = []
        for client, chunks in calls:
            connection = client.connection_pool.get_connection()
            taken.append((client, connection))
            streams.append((connection, iter(chunks), []))
        active = list(streams)
        while active:
            for stream in list(active):
                connection, chunks, sent = stream
                chunk = next(chunks, None)
                if chunk is None:
                    active.remove(stream)
                elif chunk:
                    connection.send_packed_command(connection.pack_commands(chunk))
                    sent.append(len(chunk))
        results = []
        for connection, _, sent in streams:
            replies = []
            for _ in range(sum(sent)):
                try:
                    replies.append(connection.read_response())
                except redis.exceptions.ResponseError as exc:
                    replies.append(exc)
            results.append(replies)
        return results
    except BaseException:
        for _, connection in taken:
            connection.disconnect()
        raise
    finally:
        for client, connection in taken:
            client.connection_pool.release(connection)


# Replies that mean "ask again after relearning the slot map": the key moved, the node
# was demoted to a replica, the cluster is failing over or the node is still loading.
_TOPOLOGY = (redis.exceptions.MovedError, redis.exceptions.AskError,
             redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
             redis.exceptions.ReadOnlyError, redis.exceptions.BusyLoadingError,
             redis.exceptions.MasterDownError)
_TOPOLOGY_TEXT = ("non local key", "MOVED", "ASK", "READONLY", "CLUSTERDOWN", "TRYAGAIN",
                  "LOADING", "MASTERDOWN")


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
    by_slot: bool = False,
    chunk: int = CHUNK,
) -> Iterator[tuple[list[int], list[Any]]]:
    """Run ``build(indices)``'s commands for every group of ``keys``, one round per node.

    Yields ``(indices, replies)`` per group. A lost script (NOSCRIPT after a restart
    or failover) is loaded and that command alone re-sent; a topology change or a
    dropped connection relearns the slot map and retries the affected groups, up to
    ``retries`` times. Any other error reply is raised.
    """
    pending = list(range(len(keys)))
    for attempt in range(retries + 1):
        # One call per node, its groups' commands built and sent one group at a time.
        plan = []
        for client, lists in nodes.partition([keys[i] for i in pending], by_slot, chunk).items():
            plan.append((client, [[pending[p] for p in positions] for positions in lists], []))
        try:
            results = call_nodes([(client, _built(groups, build, commands))
                                  for client, groups, commands in plan])
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            if attempt == retries:
                raise
            _relearn(nodes, attempt)
            continue
        retry: list[int] = []
        for (client, groups, commands), replies in zip(plan, results):
            if any(is_topology_error(r) for r in replies):
                if attempt == retries:
                    raise next(r for r in replies if is_topology_error(r))
                retry += [i for indices in groups for i in indices]
                continue
            flat = [x for cmds in commands for x in cmds]
            for n, reply in enumerate(replies):
                if isinstance(reply, redis.exceptions.NoScriptError):
                    client.script_load(scripts[flat[n][1]].source)
                    replies[n] = client.execute_command(*flat[n])
                elif isinstance(reply, redis.exceptions.ResponseError):
                    raise reply
            at = 0
            for indices, cmds in zip(groups, commands):
                yield indices, replies[at : at + len(cmds)]
                at += len(cmds)
        if not retry:
            return
        pending = retry
        _relearn(nodes, attempt)


def _built(groups, build, record: list) -> Iterator[list]:
    """Build each group's commands when the sender asks for them, keeping a copy."""
    for indices in groups:
        commands = build(indices)
        record.append(commands)
        yield commands


def _relearn(nodes: SingleNode | ClusterNodes, attempt: int) -> None:
    time.sleep(min(0.05 * 2**attempt, 1.0))
    try:
        nodes.refresh()
    except redis.exceptions.RedisError:
        pass  # the next attempt reports the failure if it persists
