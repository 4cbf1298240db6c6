"""Opening a Redis store from a URL: schemes, options, clients, credentials kept out of sight."""

from __future__ import annotations

import operator
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import unquote

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.retry import Retry

from r3cache.checks import MAX_SECONDS, flag, url_options
from r3cache.errors import ContractError, StoreUnavailableError
from r3cache.layout import RoutingLayout
from r3cache.store.redis.errors import ACCESS_REFUSED, redis_errors
from r3cache.store.redis.keys import (
    NAME,
    NAMESPACES_KEY,
    REDIS_SCHEMES,
    KeySchema,
    check_name,
)
from r3cache.store.redis.nodes import ClusterNodes, SingleNode, command, execute, retryable
from r3cache.store.redis.store import RedisBlockStore, RedisOptions, missing_namespace
from r3cache.store.urls import display_url, url_parts


def _int(value: Any) -> int:
    """An int, or one in a URL query's digits: a float is refused, not truncated."""
    return int(value) if isinstance(value, str) else operator.index(value)


def _pool_size(value: Any) -> int:
    size = _int(value)
    if size < 1:
        raise ValueError("a pool holds one connection at least")
    return size


def _timeout(value: Any) -> float:
    """Seconds a socket waits: positive and at most MAX_SECONDS, so every wait on Redis is
    bounded (and the socket's deadline fits the platform's clock)."""
    seconds = float(value)
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError("a socket timeout is a number of seconds > 0")
    return seconds


def _at_least(least: int, value: Any) -> int:
    number = _int(value)
    if not least <= number <= MAX_SECONDS:
        raise ValueError(f"not an int from {least} to {MAX_SECONDS:g}")
    return number


def _resp2(value: Any) -> int:
    """The replies r3cache's scripts and commands read are RESP2's."""
    if _int(value) != 2:
        raise ValueError("r3cache speaks RESP2 (protocol=2)")
    return 2


# Options r3cache reads itself; everything else goes to the redis-py client.
_STORE_OPTIONS: dict[str, Callable[[Any], Any]] = {
    "idle_ttl": float, "lease_ttl": float, "manifest_ttl": float, "owner": str, "retries": _int,
    "hash_algo": str, "wait_replicas": _int, "wait_timeout": float, "codec": str,
    "janitor": partial(flag, name="janitor"), "lease": partial(flag, name="lease"),
}
_count, _positive = partial(_at_least, 0), partial(_at_least, 1)
# Parsers a bool must not reach: True would be 1 second, 1 retry or database 1.
_NUMBERS = {float, int, _int, _pool_size, _timeout, _count, _positive, _resp2}
# redis-py's client options r3cache passes on, each checked here: a value redis-py would
# take loosely (socket_keepalive=maybe as true) or refuse only at the first command is a
# ContractError before anything connects. Others redis-py's URLs know are refused: timeout
# belongs to a pool r3cache does not use, legacy_responses to replies it does not read,
# and retry_on_timeout and retry_on_error would retry inside r3cache's own tries
# (``retries``), multiplying the bound on every wait.
_CLIENT_OPTIONS: dict[str, Callable[[Any], Any]] = {
    "pool_size": _pool_size, "socket_timeout": _timeout, "socket_connect_timeout": _timeout,
    "username": str, "password": str, "db": _count, "protocol": _resp2,
    "socket_keepalive": partial(flag, name="socket_keepalive"),
    "health_check_interval": _count, "socket_read_size": _positive,
    "ssl_check_hostname": partial(flag, name="ssl_check_hostname"),
    "ssl_validate_ocsp": partial(flag, name="ssl_validate_ocsp"),
    "ssl_validate_ocsp_stapled": partial(flag, name="ssl_validate_ocsp_stapled"),
}


def _parsed(key: str, parse: Callable[[Any], Any], value: Any) -> Any:
    try:
        if isinstance(value, bool) and parse in _NUMBERS:
            raise TypeError("a bool is no number")
        return parse(value)
    except (TypeError, ValueError) as exc:
        shown = "(hidden)" if key == "password" else f"{value!r}: {exc}"
        raise ContractError(f"Redis store option {key} has an invalid value {shown}") from None


def _split_options(query: dict[str, str], options: dict[str, Any], tls: bool):
    """(r3cache's options, redis-py client options); unknown names are an error. A keyword
    option of None is not given (``password=os.environ.get(...)`` unset: no password,
    not the password "None")."""
    merged = {**query, **{k: v for k, v in options.items() if v is not None}}
    ours: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for key, value in merged.items():
        if key in _STORE_OPTIONS:
            ours[key] = _parsed(key, _STORE_OPTIONS[key], value)
        elif key.startswith("ssl_") and not tls:
            raise ContractError(f"Redis store option {key} needs a TLS URL (rediss:// "
                                "or rediss+cluster://)")
        elif key in _CLIENT_OPTIONS:
            client["max_connections" if key == "pool_size" else key] = _parsed(
                key, _CLIENT_OPTIONS[key], value)
        elif key.startswith("ssl_"):
            # Certificates, keys and requirements: redis-py parses the few it knows.
            parse = URL_QUERY_ARGUMENT_PARSERS.get(key)
            client[key] = value if parse is None else _parsed(key, parse, value)
        else:
            raise ContractError(f"unknown Redis store option {key!r}")
    return RedisOptions(**ours), client


def _host_port(host: str) -> tuple[str, int]:
    """One ``host:port`` of a URL; a bad port names neither (it may hold a secret)."""
    name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ContractError("the store URL has an invalid port (characters such as '#', '?', "
                            "'/' or '@' in a password must be percent-encoded)")
    return name or "127.0.0.1", int(port or 6379)


def parse(url: str, options: dict[str, Any]):
    """Every check of ``url`` and ``options`` that needs no server: (the URL's parts,
    r3cache's options, redis-py's client options, the URL without credentials)."""
    if not isinstance(url, str):
        raise ContractError(f"a store URL must be a str, not {type(url).__name__}")
    parts = url_parts(url)
    if parts.scheme not in REDIS_SCHEMES:
        raise ContractError(f"unsupported Redis URL scheme {parts.scheme!r}; use one of "
                            + ", ".join(f"{s}://" for s in REDIS_SCHEMES))
    if url[: len(parts.scheme) + 3].lower() != f"{parts.scheme}://":
        # "redis+cluster:/h:7000" would name no host, and 127.0.0.1 would be asked.
        raise ContractError(f"a store URL starts {parts.scheme}://, as in redis://host:port/db "
                            "or unix:///path/to/redis.sock")
    if parts.scheme != "unix":
        for host in parts.netloc.rpartition("@")[2].split(","):
            _host_port(host)
        database = parts.path.strip("/")
        if database and not database.isdigit():  # redis-py would take "/1O" as database 0
            raise ContractError("the path of a store URL is a database number "
                                "(redis://host:port/0)")
    if "#" in url:
        # redis-py drops it: "?password=se#cret" would send the password "se".
        raise ContractError("the store URL has a '#': percent-encode it (%23) in a password "
                            "or option")
    query = url_options(parts.query)
    if "db" in query and parts.scheme != "unix" and parts.path.strip("/"):
        # redis-py would take the path's database and drop the query's without a word.
        raise ContractError("the store URL names its database twice, in its path and as "
                            "db=; give one")
    store_options, client_options = _split_options(query, options,
                                                   tls=parts.scheme.startswith("rediss"))
    if parts.scheme.endswith("+cluster") and (int(parts.path.strip("/") or 0)
                                              or client_options.get("db", 0)):
        raise ContractError("a Redis Cluster has only database 0: its URL names no other")
    client_options.setdefault("socket_timeout", 10.0)
    client_options.setdefault("socket_connect_timeout", 5.0)
    if store_options.wait_replicas and store_options.wait_timeout >= client_options[
            "socket_timeout"]:
        # The reply to WAIT comes after wait_timeout: every write short of replicas would
        # time its socket out, be retried, and fail after retries + 1 socket timeouts.
        raise ContractError(f"wait_timeout ({store_options.wait_timeout:g} s) must be shorter "
                            f"than socket_timeout ({client_options['socket_timeout']:g} s)")
    display = display_url(url).partition("?")[0]  # for repr and errors: no options
    return parts, store_options, client_options, display


def connect(url: str, namespace: str | None, options: dict[str, Any]):
    """Clients for ``url``: (nodes, r3cache's options, the URL without credentials)."""
    parts, store_options, client_options, display = parse(url, options)
    if not parts.scheme.endswith("+cluster"):
        plain = url.split("?", 1)[0]
        # One try per connection and command, as redis-py gives a cluster's node clients:
        # r3cache's rounds (nodes.execute, nodes.retried) retry `retries` times. Retried in
        # both layers, a stalled server would hold each call (retries + 1)² timeouts.
        try:
            client = redis.Redis.from_url(plain, retry=Retry(NoBackoff(), 0),
                                          **client_options)
        except ValueError:  # whatever else redis-py's URL parser refuses, typed here
            raise ContractError(f"redis-py cannot parse the store URL {display}") from None
        return SingleNode(client), store_options, display
    backoff = ExponentialBackoff(cap=1.0, base=0.05)
    try:
        retry = Retry(backoff, store_options.retries, is_retryable=retryable)
    except TypeError:  # redis-py before 8.2 takes no checker: it retries refusals too
        retry = Retry(backoff, store_options.retries)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if userinfo:
        user, _, password = userinfo.partition(":")
        client_options.setdefault("username", unquote(user) or None)
        client_options.setdefault("password", unquote(password) or None)
    startup = [ClusterNode(*_host_port(host)) for host in hosts.split(",")]
    if parts.scheme.startswith("rediss"):
        client_options["ssl"] = True
    client_options.pop("db", None)  # 0 (parse): a cluster's client takes no database
    with redis_errors(namespace, f"connecting to {display}"):
        try:
            cluster = RedisCluster(startup_nodes=startup, retry=retry, **client_options)
        except redis.exceptions.RedisClusterException as exc:
            # redis-py wraps what the startup nodes answered: a refusal of the credentials
            # (or of the ACL user's CLUSTER SLOTS) is StoreAccessError, not unavailability.
            if isinstance(exc.__cause__, ACCESS_REFUSED):
                raise exc.__cause__ from None
            if "Cluster mode is not enabled" in str(exc):
                raise ContractError(f"{display} is not a Redis Cluster (cluster mode is "
                                    "disabled there); open the store with a redis:// URL"
                                    ) from None
            raise StoreUnavailableError(f"no Redis Cluster at {display}: {exc}") from None
    return ClusterNodes(cluster), store_options, display


def open_redis_store(url: str, *, layout: RoutingLayout | None, namespace: str,
                     **options: Any) -> RedisBlockStore:
    """Open a Redis-backed store: ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://``.

    With ``layout=None`` the namespace must exist, and its stored layout is used.
    """
    check_name(namespace, "namespace")
    nodes, store_options, display = connect(url, namespace, options)
    try:
        if layout is None:
            layout = _stored_layout(nodes, KeySchema(namespace), display,
                                    store_options.retries)
        store = RedisBlockStore(nodes, layout, namespace, store_options, display)
        # To open the same namespace again in a helper process; holds credentials,
        # so it never appears in repr or errors.
        store.reopen_args = (url, dict(options))
        return store
    except BaseException:
        nodes.close()
        raise


def _stored_layout(nodes, keys: KeySchema, display: str, retries: int) -> RoutingLayout:
    with redis_errors(keys.namespace, "reading the namespace metadata"):
        fingerprint = command(nodes, keys.meta, "HGET", keys.meta, "fingerprint",
                              retries=retries)
        if fingerprint is None:
            raise missing_namespace(nodes, display, keys, retries)
    return RoutingLayout.from_fingerprint(fingerprint.decode())


def list_namespaces(url: str) -> list[str]:
    """Every namespace opened on the server(s) at ``url`` whose metadata is still there.
    One whose keys were deleted by hand stays in ``r3:namespaces``; listed, it would stop
    ``inspect``, ``top`` and ``gc`` of every other namespace at its missing layout."""
    nodes, store_options, _ = connect(url, None, {})
    try:
        with redis_errors(None, "listing namespaces"):
            listed = command(nodes, NAMESPACES_KEY, "SMEMBERS", NAMESPACES_KEY,
                             retries=store_options.retries)
            members = sorted(n for n in (m.decode(errors="replace") for m in listed)
                             if NAME.fullmatch(n))  # a name added by hand, r3cache's never
            metas = [KeySchema(n).meta for n in members]
            present: set[int] = set()
            rounds = execute(nodes, metas, lambda group: [("EXISTS", metas[i]) for i in group],
                             scripts={}, retries=store_options.retries)
            for indices, replies in rounds:
                present.update(i for i, found in zip(indices, replies) if found)
            return [n for i, n in enumerate(members) if i in present]
    finally:
        nodes.close()
