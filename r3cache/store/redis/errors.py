"""The one boundary where redis-py's exceptions become r3cache's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from r3cache.errors import (
    StoreAccessError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)
from r3cache.store.redis.nodes import REFUSED, is_topology_error

# What a server answers to credentials or an ACL user it refuses.
ACCESS_REFUSED = (*REFUSED, redis.exceptions.NoPermissionError)


@contextmanager
def redis_errors(namespace: str | None, what: str) -> Iterator[None]:
    """Translate redis-py's exceptions raised inside the block into r3cache's (``namespace``
    None: a call about the server, not one namespace)."""
    try:
        yield
    except StoreError:
        raise
    except ACCESS_REFUSED as exc:
        raise StoreAccessError(f"{_where(namespace, what)} was refused: {exc}") from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
            redis.exceptions.ClusterDownError, redis.exceptions.ClusterError,
            # Not a RedisError: redis-py raises it when no cluster node answers.
            redis.exceptions.RedisClusterException) as exc:
        raise StoreUnavailableError(
            f"{_where(namespace, what)}: Redis unavailable ({type(exc).__name__}: {exc})") from None
    except redis.exceptions.ResponseError as exc:
        if is_topology_error(exc):  # still moving once the retries ran out
            raise StoreUnavailableError(
                f"{_where(namespace, what)}: the cluster is moving slots or failing over "
                f"({type(exc).__name__}: {exc})") from None
        if "can't run this command" in str(exc) or str(exc).startswith("NOPERM"):
            # An ACL refusal inside a script arrives as a plain error reply.
            raise StoreAccessError(f"{_where(namespace, what)} was refused: {exc}") from None
        # redis-py strips the "OOM" prefix when it raises OutOfMemoryError.
        if isinstance(exc, redis.exceptions.OutOfMemoryError) or str(exc).startswith("OOM"):
            raise StoreFullError(
                f"{_where(namespace, what)}: Redis is out of memory ({exc}); "
                "nothing of the refused command was written"
            ) from None
        raise StoreError(f"{_where(namespace, what)} failed: {exc}") from None
    except redis.exceptions.RedisError as exc:
        raise StoreError(f"{_where(namespace, what)} failed: {exc}") from None


def _where(namespace: str | None, what: str) -> str:
    """What failed, for a message: built only when something did."""
    return what if namespace is None else f"{what} in namespace {namespace!r}"
