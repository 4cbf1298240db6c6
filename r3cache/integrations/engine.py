"""What every engine plugin reads from its environment: R3CACHE_URL and its options, the
default namespace, each data-parallel rank's owner name, R3CACHE_INLINE and
R3CACHE_METRICS_PORT."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import xxhash

from r3cache import checks
from r3cache.checks import flag, url_options
from r3cache.errors import ContractError, IntegrationError
from r3cache.store import check_url
from r3cache.store.redis.keys import check_name
from r3cache.store.urls import url_parts
from r3cache.store.writers import check_policy, check_writer


def split_url(url: str, known: Mapping[str, Callable[[str], Any]]) -> tuple[str, dict[str, Any]]:
    """R3CACHE_URL as (the store URL, the plugin's own options in its query).

    ``known`` maps each option the plugin takes to its type; the rest of the query is the
    store's.
    """
    parts = url_parts(url)
    query = url_options(parts.query).items()
    options: dict[str, Any] = {}
    for key, value in query:
        if key in known:
            try:
                options[key] = known[key](value)
            except ValueError:
                raise ContractError(f"R3CACHE_URL option {key} has an invalid value "
                                    f"{value!r}") from None
    rest = urlencode([(k, v) for k, v in query if k not in known])
    # The URL before its query as given: urlunsplit would write unix:///run/redis.sock as
    # unix:/run/redis.sock, which redis-py cannot parse.
    return url.partition("?")[0] + ("?" + rest if rest else ""), options


# Parsers of the connector options a plugin takes from R3CACHE_URL's query: each value is
# checked as the connector checks it, before the store opens (opening one writes its
# namespace and registers an owner).


def store_wait(value: str) -> float:
    return checks.seconds(float(value), "store_wait")


def writer(value: str) -> str:
    check_writer(value)
    return value


def on_unavailable(value: str) -> str:
    check_policy(value)
    return value


def local_tier_bytes(value: str) -> int:
    nbytes = checks.count(checks.byte_size(value), "local_tier_bytes")
    checks.fits_memory(nbytes, "local_tier_bytes")
    return nbytes


def check_environment(split: Callable[[str], tuple[str, dict[str, Any]]]) -> None:
    """R3CACHE_URL (split by the plugin's ``split``: its store URL and the plugin's own
    options), R3CACHE_NAMESPACE, R3CACHE_INLINE and R3CACHE_METRICS_PORT, checked as the
    plugin and the store will check them, without a server. A plugin runs it as it loads,
    so that a mistake in them stops the engine before it loads its model, not after."""
    store_url, _ = split(os.environ["R3CACHE_URL"])
    check_url(store_url)
    namespace = os.environ.get("R3CACHE_NAMESPACE")
    if namespace and not embedded(store_url):  # a Redis key's part; the embedded store's
        check_name(namespace, "R3CACHE_NAMESPACE")  # namespace is only a label
    inline()
    metrics_port()


def embedded(url: str) -> bool:
    """Whether the store URL names the embedded store: inside the engine's process, where
    nothing else (a trainer, another replica) can read what it holds."""
    return url_parts(url).scheme == "memory"


def url_sets(url: str, option: str) -> bool:
    """Whether the store URL's query gives ``option``."""
    return option in url_options(url_parts(url).query)


def rank_owner(url: str, rank: int, ranks: int) -> dict[str, str]:
    """The store options that give each of an engine's data-parallel ranks an owner name of
    its own where the store URL fixes one: ``owner=X`` becomes ``X-dp<rank>`` when there
    are several ranks. The ranks share one R3CACHE_URL, and two live stores cannot share a
    name (each would overwrite the other's hold counts); a rank restarted as that rank
    still takes back its crashed predecessor's name."""
    owner = url_options(url_parts(url).query).get("owner")
    return {"owner": f"{owner}-dp{rank}"} if owner and ranks > 1 else {}


def inline() -> bool:
    """Whether responses keep their inline routes (R3CACHE_INLINE, default on)."""
    return flag(os.environ.get("R3CACHE_INLINE") or "1", "R3CACHE_INLINE")


def metrics_port(rank: int = 0) -> int | None:
    """R3CACHE_METRICS_PORT, checked, plus ``rank``: the port the plugin's process serves
    its metrics on. An engine's data-parallel ranks on one host are processes of their own,
    each on the next port, as SGLang's and vLLM's ranks number them."""
    port = os.environ.get("R3CACHE_METRICS_PORT")
    if not port:
        return None
    if not port.isdigit() or not 0 < int(port) + rank < 65536:
        raise ContractError(f"R3CACHE_METRICS_PORT must be a TCP port, not {port!r}"
                            + (f" (+ rank {rank})" if rank else ""))
    return int(port) + rank


def serve_metrics(rank: int = 0) -> Any:
    """Serve this process's metrics on metrics_port(rank), if set; returns the HTTP server
    (None if unset). A port that cannot be served stops the engine's start, naming the
    variable."""
    port = metrics_port(rank)
    if port is None:
        return None
    from r3cache import metrics

    try:
        return metrics.serve(port)
    except ContractError as exc:  # the port is taken, or not this user's to serve on
        raise IntegrationError(f"R3CACHE_METRICS_PORT: {exc}") from None


def default_namespace(served_name: str | None, model: str, revision: str | None) -> str:
    """``<served model name>@<weights revision>``: new weights, new namespace.

    The revision is the Hub revision when one was asked for, else a digest of the weight
    files' names, sizes and modification times (a local checkpoint directory).
    """
    name = served_name or model
    name = Path(str(name).rstrip("/")).name if os.path.isdir(str(name)) else str(name)
    revision = revision or _weights_digest(model)
    namespace = re.sub(r"[^A-Za-z0-9._@+/=-]", "-", f"{name}@{revision or 'main'}")
    return namespace[:200]


def _weights_digest(path: str) -> str | None:
    folder = Path(path)
    if not folder.is_dir():
        return None
    digest = xxhash.xxh3_64()
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:12]
