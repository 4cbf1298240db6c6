"""KeySchema: every Redis key r3cache writes, named in one place.

``r3:namespaces``                  set of namespaces ever opened
``r3:{ns}:meta``                   hash: layout fingerprint and fields, dtype, codec, hash algo,
                                   created_at
``r3:{ns}:owners``                 hash: owner id -> "<lease expiry, ms on the server's clock>
                                   host= pid= started="; no TTL (expiry 0: being reclaimed)
``r3:{ns}:b:{<block hash>}``       string: one encoded block (codec header + lz4 payload)
``r3:{ns}:r:{<block hash>}``       hash: owner -> hold count; absent when nobody holds the block
``r3:{ns}:m:{<request id>}``       hash: one finished request's manifest (see r3cache.manifest)
``r3:{ns}:manifests``              sorted set: request id scored by its manifest's expiry time
``r3:{ns}:unreadable``             hash: request id -> why its expired manifest could not be
                                   parsed (the janitor released it all the same)

The block hash sits in braces, a Redis Cluster hash tag, so a block and its
reference counts share one slot and one Lua call can change both atomically.
"""

from __future__ import annotations

import re

from r3cache.errors import ContractError

NAMESPACES_KEY = b"r3:namespaces"
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
NAME = re.compile(r"[A-Za-z0-9._@+/=-]{1,200}")  # a namespace or an owner


MANIFEST_OWNER_PREFIX = "m:"  # engine owner names cannot contain ":"


def manifest_owner(request_id: str) -> str:
    """The owner name under which a request's manifest holds its blocks."""
    return MANIFEST_OWNER_PREFIX + request_id


def check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ContractError(
            f"{what} {value!r} must be 1-200 characters of letters, digits and ._@+/=-"
        )
    return value


class KeySchema:
    """Own the names of one namespace's keys."""

    def __init__(self, namespace: str) -> None:
        self.namespace = check_name(namespace, "namespace")
        base = f"r3:{namespace}:"
        self.meta = (base + "meta").encode()
        self.owners = (base + "owners").encode()
        self.refs_pattern = (base + "r:*").encode()
        self.manifests_pattern = (base + "m:*").encode()
        self.manifest_index = (base + "manifests").encode()
        self.unreadable = (base + "unreadable").encode()
        self._manifest = (base + "m:{").encode()
        self.blocks_pattern = (base + "b:*").encode()
        self._block = (base + "b:{").encode()
        self._refs = (base + "r:{").encode()

    def block(self, key: str) -> bytes:
        return self._block + key.encode() + b"}"

    def refs(self, key: str) -> bytes:
        return self._refs + key.encode() + b"}"

    def block_of_refs(self, refs_key: bytes) -> bytes:
        return self._block + refs_key[len(self._refs):]

    def manifest(self, request_id: str) -> bytes:
        return self._manifest + request_id.encode() + b"}"

