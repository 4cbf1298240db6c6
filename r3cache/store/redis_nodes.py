"""The servers behind a Redis store: routing keys to nodes and one call per node at once."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot


class SingleNode:
    """Own the client of a standalone server: every key lives on it."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def partition(self, keys: Sequence[bytes]) -> dict[redis.Redis, list[int]]:
        return {self.client: list(range(len(keys)))} if keys else {}

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

    def partition(self, keys: Sequence[bytes]) -> dict[redis.Redis, list[int]]:
        manager = self.client.nodes_manager
        by_node: dict[str, list[int]] = defaultdict(list)
        nodes = {}
        for index, key in enumerate(keys):
            node = manager.get_node_from_slot(key_slot(key))
            nodes[node.name] = node
            by_node[node.name].append(index)
        return {self.client.get_redis_connection(nodes[name]): idx for name, idx in by_node.items()}

    def primaries(self) -> list[redis.Redis]:
        return [self.client.get_redis_connection(n) for n in self.client.get_primaries()]

    def refresh(self) -> None:
        """Relearn the slot map (after MOVED, a failover or a dead connection)."""
        self.client.nodes_manager.initialize()

    def close(self) -> None:
        self.client.close()


def call_nodes(calls: Sequence[tuple[redis.Redis, Sequence[Any]]]) -> list[Any]:
    """Send every call first, then read every reply: one write and one read per socket.

    A ResponseError comes back in place of its result; a connection failure
    disconnects every socket used (so no reply is left unread) and is raised.
    """
    taken = []
    try:
        for client, args in calls:
            connection = client.connection_pool.get_connection()
            taken.append((client, connection))
            connection.send_command(*args)
        results = []
        for _, connection in taken:
            try:
                results.append(connection.read_response())
            except redis.exceptions.ResponseError as exc:
                results.append(exc)
        return results
    except BaseException:
        for _, connection in taken:
            connection.disconnect()
        raise
    finally:
        for client, connection in taken:
            client.connection_pool.release(connection)
