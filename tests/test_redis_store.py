"""Redis-only behaviour of the store, against real redis-server processes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from functools import partial
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import pytest
import redis

from r3cache import R3Reader, RoutingLayout, open_store
from r3cache.errors import (
    ContractError,
    CorruptBlockError,
    LayoutMismatchError,
    StoreAccessError,
    StoreUnavailableError,
)
from r3cache.manifest import BlockRef, Completion, Manifest
from r3cache.store.redis.janitor import reclaim_dead_owners
from r3cache.store.redis.keys import NAMESPACES_KEY
from r3cache.testing import RedisServer

LAYOUT = RoutingLayout(num_layers=3, topk=2, num_experts=16, block_size=4)


def blk(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16, LAYOUT.block_shape).astype(np.uint8)


@pytest.fixture(params=["redis", "cluster"])
def url(request) -> str:
    return request.getfixturevalue("redis_url" if request.param == "redis" else "cluster_url")


@pytest.fixture
def store(url, namespace):
    s = open_store(url, layout=LAYOUT, namespace=namespace)
    yield s
    s.close()


@pytest.fixture(params=["redis", "cluster"])
def counted_store(request, namespace):
    """A store whose servers' command counts are this test's own: a redis-server of its
    own (the machine's is shared with the other test worker), or this worker's cluster."""
    with contextlib.ExitStack() as stack:
        url = (request.getfixturevalue("cluster_url") if request.param == "cluster"
               else stack.enter_context(RedisServer()).url)
        s = open_store(url, layout=LAYOUT, namespace=namespace)
        stack.callback(s.close)
        yield s


def command_calls(store, name: str) -> int:
    return sum(command_calls_of(c, name) for c in store.primaries())


def command_calls_of(client: redis.Redis, name: str) -> int:
    return client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0)


def test_options_come_from_the_url_query_or_keywords(redis_url, namespace):
    url = f"{redis_url}?idle_ttl=5&owner=engine-a&pool_size=4&socket_timeout=2"
    s = open_store(url, layout=LAYOUT, namespace=namespace, lease_ttl=7)
    try:
        assert s.owner == "engine-a" and s.options.idle_ttl == 5 and s.options.lease_ttl == 7
        pool = s._nodes.client.connection_pool
        assert pool.max_connections == 4 and pool.connection_kwargs["socket_timeout"] == 2
        s.put({"k": blk(1)})
        assert 0 < s.client_for(s.keys.block("k")).pttl(s.keys.block("k")) <= 5000
    finally:
        s.close()
    with pytest.raises(ContractError, match="unknown Redis store option .idle_tl."):
        open_store(f"{redis_url}?idle_tl=5", layout=LAYOUT, namespace=namespace)
    # An empty owner would open the store under the process's default owner name, and the
    # first of two under the second's: each is refused, naming no value (a password may be
    # one).
    for query, problem in (("owner=", "'owner' has no value"), ("owner", "'owner' has no value"),
                           ("owner=a&owner=b", "'owner' is given twice"),
                           ("password=s3cret&password=s3cret", "'password' is given twice")):
        with pytest.raises(ContractError, match=f"option {problem}$") as info:
            open_store(f"{redis_url}?{query}", layout=LAYOUT, namespace=namespace)
        assert "s3cret" not in str(info.value)
    with pytest.raises(ContractError, match="has a '#'") as info:
        open_store(f"{redis_url}?password=s3#cret", layout=LAYOUT, namespace=namespace)
    assert "cret" not in str(info.value)
    # redis-py would open the path's database and drop db= without a word.
    with pytest.raises(ContractError, match="names its database twice"):
        open_store(urlunsplit(urlsplit(redis_url)._replace(path="/0", query="db=3")),
                   layout=LAYOUT, namespace=namespace)


def test_namespace_metadata_is_written_once_and_guards_the_layout(url, namespace):
    s = open_store(url, layout=LAYOUT, namespace=namespace)
    client = s.client_for(s.keys.meta)
    meta = {k.decode(): v.decode() for k, v in client.hgetall(s.keys.meta).items()}
    assert meta["fingerprint"] == LAYOUT.fingerprint and meta["codec"] == "lz4"
    assert meta["dtype"] == "uint8" and meta["hash_algo"] == "sha256" and meta["created_at"]
    assert {"num_layers": "3", "topk": "2", "num_experts": "16", "block_size": "4"}.items() \
        <= meta.items()
    assert s.client_for(NAMESPACES_KEY).sismember(NAMESPACES_KEY, namespace)
    s.close()
    with pytest.raises(LayoutMismatchError, match="new namespace"):
        open_store(url, layout=RoutingLayout(3, 2, 17, 4), namespace=namespace)
    again = open_store(url, layout=None, namespace=namespace)  # the stored layout
    assert again.layout == LAYOUT
    again.close()
    with pytest.raises(ContractError, match="no namespace"):
        open_store(url, layout=None, namespace=namespace + "-absent")


def test_a_batch_is_one_round_per_node(counted_store, monkeypatch):
    from r3cache.store.redis import nodes as redis_nodes

    store = counted_store
    rounds = []
    real = redis_nodes.Round

    def spy(calls, *window):
        rounds.append([client for client, _ in calls])
        return real(calls, *window)

    monkeypatch.setattr(redis_nodes, "Round", spy)
    blocks = {f"k{i}": blk(i) for i in range(200)}
    nodes = len(store.primaries())
    sets_before = command_calls(store, "set")
    scripts_before = command_calls(store, "evalsha")
    store.put(blocks, retain_keys=list(blocks))
    assert len(rounds) == 1 and len(rounds[0]) == len(set(rounds[0])) == nodes
    assert command_calls(store, "set") - sets_before == 200
    # One hold call before each group of up to 64 writes, not one per key; blocks this
    # batch pins are written without a TTL, so no settling call follows.
    scripts = command_calls(store, "evalsha") - scripts_before
    assert nodes <= scripts <= 200 // 64 + nodes
    client = store.client_for(store.keys.block("k0"))
    assert client.pttl(store.keys.block("k0")) == -1
    rows = store.get_concatenated(list(blocks))
    assert len(rounds) == 2 and len(set(rounds[1])) == nodes
    np.testing.assert_array_equal(rows, np.concatenate(list(blocks.values())))
    store.put({}, release_keys=list(blocks))


def test_a_read_round_keeps_a_window_of_groups_in_flight(namespace):
    """A server runs every command it has before it writes a reply: a read round sends
    ``ahead`` groups, then one more as each is read, so the server works while we decode."""
    from r3cache.store.redis.nodes import Round

    # A server of its own: its MGETs are counted, and no other test worker's are among them.
    with RedisServer() as server, contextlib.closing(server.client()) as client:
        keys = [f"r3:{namespace}:window:{i}" for i in range(6)]
        client.mset({k: i for i, k in enumerate(keys)})

        def served_since(base: int, expected: int) -> int:
            deadline = time.monotonic() + 2
            while (command_calls_of(client, "mget") - base < expected
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            time.sleep(0.1)  # long enough for any further group sent to be run
            return command_calls_of(client, "mget") - base

        base = command_calls_of(client, "mget")
        calls = Round([(client, [[("MGET", k)] for k in keys])], ahead=2)
        try:
            assert served_since(base, 2) == 2
            replies = calls.replies()
            assert next(replies) == (0, 0, [[b"0"]])
            assert served_since(base, 3) == 3
            assert [values for _, _, values in replies] == [[[str(i).encode()]]
                                                            for i in range(1, 6)]
            assert served_since(base, 6) == 6
        finally:
            calls.close()


def test_script_cache_loss_is_recovered_transparently(store):
    store.put({"a": blk(1)}, retain_keys=["a"])
    for client in store.primaries():
        client.script_flush()
    store.put({"b": blk(2)}, release_keys=["a"])
    np.testing.assert_array_equal(store.get_concatenated(["a", "b"]),
                                  np.concatenate([blk(1), blk(2)]))
    assert store.refcount("a") == 0


@pytest.mark.parametrize(
    ("value", "reason"),
    [(b"garbage that is not a block", "foreign value"), (None, "truncated")],
)
def test_corrupted_values_raise_corrupt_block_error_naming_the_key(store, value, reason):
    store.put({"k": blk(1)})
    key = store.keys.block("k")
    client = store.client_for(key)
    client.set(key, value if value is not None else client.get(key)[:12])
    with pytest.raises(CorruptBlockError, match=reason) as info:
        store.get_concatenated(["k"])
    assert info.value.key == "k"


def test_each_writer_reads_its_own_rows_when_replicas_disagree(url, namespace):
    a = open_store(url, layout=LAYOUT, namespace=namespace, owner="replica-a")
    b = open_store(url, layout=LAYOUT, namespace=namespace, owner="replica-b")
    try:
        a.put({"k": blk(1)}, retain_keys=["k"])
        b.put({"k": blk(2)}, retain_keys=["k"])
        assert b.stats().conflicts == 1 and a.stats().conflicts == 0
        np.testing.assert_array_equal(a.get_concatenated(["k"]), blk(1))
        np.testing.assert_array_equal(b.get_concatenated(["k"]), blk(2))
        fresh = open_store(url, layout=LAYOUT, namespace=namespace, lease=False)
        np.testing.assert_array_equal(fresh.get_concatenated(["k"]), blk(1))  # first writer
        fresh.close()
        assert a.refcount("k") == 1 and b.refcount("k") == 1
    finally:
        a.put({}, release_keys=["k"])
        b.put({}, release_keys=["k"])
        a.close()
        b.close()


def test_keys_released_together_expire_in_release_order(store):
    keys = ["head", "mid", "tail"]
    store.put({k: blk(i) for i, k in enumerate(keys)}, retain_keys=keys)
    store.put({}, release_keys=list(reversed(keys)))
    ttl = {k: store.client_for(store.keys.block(k)).pttl(store.keys.block(k)) for k in keys}
    assert 0 < ttl["tail"] < ttl["mid"] < ttl["head"]


CRASHING_OWNER = """
import os, sys
import numpy as np
from r3cache import RoutingLayout, open_store
layout = RoutingLayout(3, 2, 16, 4)
store = open_store(sys.argv[1], layout=layout, namespace=sys.argv[2], owner="crashed",
                   lease_ttl=1)
rows = np.zeros(layout.block_shape, np.uint8)
store.put({"k1": rows, "k2": rows}, retain_keys=["k1", "k2", "k2"])
print("held", flush=True)
os._exit(0)  # a crash: no release, no close
"""


def test_a_crashed_owners_holds_are_reclaimed_after_its_lease(url, namespace, reliability):
    survivor = open_store(url, layout=LAYOUT, namespace=namespace, owner="survivor")
    try:
        survivor.put({}, retain_keys=["k2"])
        out = subprocess.run([sys.executable, "-c", CRASHING_OWNER, url, namespace],
                             capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.strip() == "held"
        report = reclaim_dead_owners(survivor)
        assert "crashed" in report.live_owners and report.holds_dropped == 0
        time.sleep(1.3)
        report = reclaim_dead_owners(survivor)
        assert report.dead_owners == ("crashed",) and report.holds_dropped == 2
        ttl = {k: survivor.client_for(survivor.keys.block(k)).pttl(survivor.keys.block(k))
               for k in ("k1", "k2")}
        assert ttl["k1"] > 0  # nobody holds it any more: it can expire
        assert ttl["k2"] == -1 and survivor.refcount("k2") == 1  # the survivor's hold stays
        assert reclaim_dead_owners(survivor).dead_owners == ()  # forgotten once reclaimed
        reliability(f"an owner process exits without releasing ({url.split(':')[0]})",
                    "2 blocks held by the crashed owner, 1 by a live one",
                    "after the 1 s lease the janitor drops the dead owner's holds only",
                    "2 holds dropped, its block got the idle TTL, the live hold intact")
    finally:
        survivor.put({}, release_keys=["k2"])
        survivor.close()


def test_the_janitor_runs_when_a_store_opens_and_as_r3cache_gc(url, namespace):
    subprocess.run([sys.executable, "-c", CRASHING_OWNER, url, namespace],
                   capture_output=True, timeout=60, check=True)
    time.sleep(1.3)
    gc = subprocess.run([sys.executable, "-m", "r3cache.cli", "gc", url, "--namespace",
                         namespace], capture_output=True, text=True, timeout=60)
    assert gc.returncode == 0, gc.stderr
    assert (f"{namespace}: 0 live owner(s), 1 dead owner(s) reclaimed, 2 hold(s) dropped, "
            "0 expired manifest(s) released") in gc.stdout
    subprocess.run([sys.executable, "-c", CRASHING_OWNER, url, namespace],
                   capture_output=True, timeout=60, check=True)
    time.sleep(1.3)
    store = open_store(url, layout=LAYOUT, namespace=namespace)  # runs the janitor
    try:
        refs = store.keys.refs("k2")
        assert store.client_for(refs).hget(refs, "crashed") is None
    finally:
        store.close()


def test_an_engine_start_walks_the_keyspace_once_not_again_in_its_helper(namespace):
    """The janitor's search for holders SCANs the whole keyspace: the engine's store runs
    it as it opens; the helper process, opened right after, does not run it again."""
    from r3cache import WorkerConnector

    with RedisServer() as server:
        client = server.client()
        store = open_store(server.url, layout=LAYOUT, namespace=namespace)
        scans = client.info("commandstats")["cmdstat_scan"]["calls"]
        worker = WorkerConnector(layout=LAYOUT, store=store, writer="process")
        try:
            assert client.info("commandstats")["cmdstat_scan"]["calls"] == scans
        finally:
            worker.close()


def test_credentials_are_checked_and_never_shown(namespace, reliability):
    with RedisServer("--requirepass", "s3cret-pw") as server:
        url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
        s = open_store(url, layout=LAYOUT, namespace=namespace)
        s.put({"k": blk(1)})
        assert "s3cret" not in repr(s)
        s.close()
        with pytest.raises(StoreAccessError) as info:
            open_store(f"redis://:wrong@127.0.0.1:{server.port}/0", layout=LAYOUT,
                       namespace=namespace)
        assert "wrong" not in str(info.value)
        server.client(password="s3cret-pw").acl_setuser(
            "engine", enabled=True, passwords=["+engine-pw"], keys=["r3:*"],
            commands=["+@all"])
        s = open_store(f"redis://engine:engine-pw@127.0.0.1:{server.port}/0", layout=LAYOUT,
                       namespace=namespace)
        np.testing.assert_array_equal(s.get_concatenated(["k"]), blk(1))
        s.close()
        reliability("requirepass and an ACL user; a wrong password",
                    "open, put, read", "wrong credentials -> StoreAccessError; no password "
                    "in repr or errors", "checked: repr and message free of the secret")


def test_refused_credentials_are_answered_on_the_first_try(namespace, cluster, reliability):
    # A refusal is final: each retry would be refused again, after its backoff. The
    # server counts the connections each open made.
    slowest = 0.0
    with RedisServer("--requirepass", "s3cret-pw") as server:
        admin = server.client(password="s3cret-pw")
        for url in (f"redis://:wrong@127.0.0.1:{server.port}/0",
                    f"redis://127.0.0.1:{server.port}/0"):  # no password at all
            for opening in (partial(open_store, layout=LAYOUT, namespace=namespace),
                            partial(R3Reader, namespace=namespace)):
                before = admin.info("stats")["total_connections_received"]
                began = time.monotonic()
                with pytest.raises(StoreAccessError, match="refused"):
                    opening(url)
                slowest = max(slowest, time.monotonic() - began)
                assert admin.info("stats")["total_connections_received"] == before + 1
    # A cluster's startup nodes refusing the credentials: refused, not unavailable.
    nodes = [node.client() for node in cluster.nodes]
    for node in nodes:
        node.acl_setuser("r3-refused", enabled=True, passwords=["+right-pw"], keys=["*"],
                         commands=["+@all"])
    try:
        hosts = cluster.url.split("://", 1)[1]
        with pytest.raises(StoreAccessError, match="refused") as info:
            open_store(f"redis+cluster://r3-refused:wrong-pw@{hosts}", layout=LAYOUT,
                       namespace=namespace)
        assert "wrong-pw" not in str(info.value)
    finally:
        for node in nodes:
            node.acl_deluser("r3-refused")
    reliability("a wrong or missing password; a cluster refusing the ACL user",
                "open a store, open a reader", "StoreAccessError on the first try, never "
                "StoreUnavailableError", f"4/4 standalone opens refused after one "
                f"connection, slowest {slowest:.3f} s; the cluster refused")


def test_a_url_of_the_wrong_kind_of_server_is_a_contract_error_at_once(cluster, reliability):
    # A cluster node named by a redis:// URL redirects keys it does not serve, and refuses
    # scripts over keys of other nodes' slots: no wait changes that, so it is no topology
    # change to wait out (TOPOLOGY_WAIT). Which keys open touches on which node depends
    # on the namespace's slots: this name touches another primary's slots from each of
    # the three.
    namespace = "r3cache-test-wrong-scheme"
    slowest = 0.0
    try:
        for node in cluster.nodes[:3]:
            began = time.monotonic()
            with pytest.raises(ContractError, match=r"Redis Cluster node.*redis\+cluster://"):
                open_store(f"redis://127.0.0.1:{node.port}/0", layout=LAYOUT,
                           namespace=namespace)
            slowest = max(slowest, time.monotonic() - began)
    finally:
        # The namespace's metadata lands where its slot's node took it.
        client = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        client.delete(f"r3:{namespace}:meta")
        client.srem(NAMESPACES_KEY, namespace)
        client.close()
    with RedisServer() as server, pytest.raises(ContractError,
                                                match=r"not a Redis Cluster.*redis://"):
        open_store(f"redis+cluster://127.0.0.1:{server.port}", layout=LAYOUT,
                   namespace=namespace)
    reliability("a redis:// URL naming a cluster node; redis+cluster:// naming a standalone "
                "server", "open a store", "ContractError naming the URL scheme to use, "
                "without waiting", f"ContractError from 3/3 primaries (slowest {slowest:.3f} s) "
                "and from the standalone server")


def test_unix_socket_urls(tmp_path, namespace):
    sock = tmp_path / "redis.sock"
    with RedisServer("--unixsocket", str(sock), "--unixsocketperm", "700"):
        s = open_store(f"unix://{sock}?db=0&idle_ttl=9", layout=LAYOUT, namespace=namespace)
        s.put({"k": blk(3)})
        np.testing.assert_array_equal(s.get_concatenated(["k"]), blk(3))
        assert s.options.idle_ttl == 9
        s.close()


def test_an_engine_url_on_a_unix_socket_keeps_its_form(tmp_path, namespace):
    """R3CACHE_URL=unix:///...?store_wait=1: the plugins take their options out of the
    query and open the rest; that rest was written unix:/path, which redis-py refuses, so
    no engine could start on a unix socket. A store's repr names the URL in its form too."""
    from r3cache.integrations import engine

    sock = tmp_path / "redis.sock"
    with RedisServer("--unixsocket", str(sock), "--unixsocketperm", "700"):
        url, options = engine.split_url(f"unix://{sock}?store_wait=1&idle_ttl=9",
                                        {"store_wait": float})
        assert (url, options) == (f"unix://{sock}?idle_ttl=9", {"store_wait": 1.0})
        store = open_store(url, layout=LAYOUT, namespace=namespace)
        store.put({"k": blk(3)})
        np.testing.assert_array_equal(store.get_concatenated(["k"]), blk(3))
        assert f"url='unix://{sock}'" in repr(store)  # as given, without its options
        store.close()
    assert engine.split_url("memory://?writer=thread", {"writer": str}) == (
        "memory://", {"writer": "thread"})


@pytest.mark.parametrize("url", ["unix:/run/redis.sock", "redis:/127.0.0.1:6379",
                                 "redis+cluster:/127.0.0.1:7000", "redis://127.0.0.1:6379/1O",
                                 "redis://127.0.0.1:6379/db0", "redis://[::1:6379",
                                 "redis+cluster://127.0.0.1:7000,[zz]:7001",
                                 "redis://127.0.0.1:6379?janitor=flase"])
def test_a_store_url_redis_py_would_refuse_or_misread_is_a_contract_error(url, namespace):
    """A URL without its // (redis-py raises a bare ValueError; a cluster's would name
    127.0.0.1), a database path that is no number (redis-py would use database 0), a host in
    brackets that is no IPv6 address (urlsplit's bare ValueError), a flag misspelt (taken
    for true): ContractError before anything is written, from the plugins' parse too."""
    with pytest.raises(ContractError, match="starts .*://|database number|cannot be parsed|"
                                            "janitor has an invalid value"):
        open_store(url, layout=LAYOUT, namespace=namespace)
    assert not redis.Redis().exists(f"r3:{namespace}:meta")
    if "[" in url:
        from r3cache.integrations import engine

        with pytest.raises(ContractError, match="cannot be parsed"):
            engine.split_url(url + "?store_wait=1", {"store_wait": float})


@pytest.mark.parametrize("option", [{"idle_ttl": True}, {"retries": True},
                                    {"wait_replicas": True}, {"socket_timeout": True},
                                    {"db": True}, {"owner": ""}])
def test_a_bool_is_no_number_and_an_empty_owner_no_name(option, redis_url, namespace):
    """idle_ttl=True was a TTL of 1 s, retries=True one retry; owner="" fell back to the
    default name where ?owner= is refused."""
    with pytest.raises(ContractError, match="invalid value True|owner '' must be"):
        open_store(redis_url, layout=LAYOUT, namespace=namespace, **option)
    assert not redis.Redis().exists(f"r3:{namespace}:meta")
    with pytest.raises(ContractError, match="max_bytes must be a number, not True"):
        open_store("memory://", layout=LAYOUT, namespace=namespace, max_bytes=True)


def test_an_option_of_none_is_not_given(namespace):
    """password=os.environ.get("REDIS_PASSWORD") with the variable unset: no password, not
    the password "None" (AUTH refused); the URL's own password stays."""
    with RedisServer("--requirepass", "s3cret-pw") as server:
        url = server.url.replace("redis://", "redis://:s3cret-pw@")
        for options in ({"password": None}, {"username": None, "password": None},
                        {"owner": None, "idle_ttl": None}):
            store = open_store(url, layout=LAYOUT, namespace=namespace, **options)
            store.put({"k": blk(5)})
            np.testing.assert_array_equal(store.get_concatenated(["k"]), blk(5))
            store.close()


def _make_tls_files(directory) -> dict[str, str]:
    files = {name: str(directory / name) for name in ("ca.key", "ca.crt", "server.key",
                                                      "server.csr", "server.crt")}

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=r3cache-test-ca", "-keyout", files["ca.key"], "-out", files["ca.crt"])
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout",
            files["server.key"], "-out", files["server.csr"])
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", files["server.csr"], "-CA", files["ca.crt"], "-CAkey",
            files["ca.key"], "-CAcreateserial", "-days", "2", "-out", files["server.crt"],
            "-extfile", str(ext))
    return files


def test_tls_urls_with_a_self_signed_ca(tmp_path, namespace, reliability):
    files = _make_tls_files(tmp_path)
    from r3cache.testing import free_port

    port = free_port()
    with RedisServer("--port", "0", "--tls-port", str(port), "--tls-cert-file",
                     files["server.crt"], "--tls-key-file", files["server.key"],
                     "--tls-ca-cert-file", files["ca.crt"], "--tls-auth-clients", "no",
                     port=port, ready=False):
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={files['ca.crt']}"
        s = open_store(url, layout=LAYOUT, namespace=namespace)
        s.put({"k": blk(5)}, retain_keys=["k"])
        np.testing.assert_array_equal(s.get_concatenated(["k"]), blk(5))
        s.put({}, release_keys=["k"])
        s.close()
        with pytest.raises(StoreUnavailableError):
            open_store(f"redis://127.0.0.1:{port}/0?socket_timeout=1", layout=LAYOUT,
                       namespace=namespace, retries=0)
        reliability("TLS-only redis-server with a self-signed CA", "put, hold, read, release",
                    "rediss:// with ssl_ca_certs works; plain text is refused, typed",
                    "round trip exact; plaintext -> StoreUnavailableError")


def test_an_unreachable_server_is_a_typed_error(namespace):
    from r3cache.testing import free_port

    with pytest.raises(StoreUnavailableError, match="unavailable"):
        open_store(f"redis://127.0.0.1:{free_port()}/0", layout=LAYOUT, namespace=namespace,
                   retries=0)
    with pytest.raises(StoreUnavailableError):
        open_store(f"redis+cluster://127.0.0.1:{free_port()}", layout=LAYOUT,
                   namespace=namespace, retries=0)


def test_bad_namespaces_and_owners_are_rejected(redis_url):
    for bad in ("", "has space", "brace{x}", "star*"):
        with pytest.raises(ContractError):
            open_store(redis_url, layout=LAYOUT, namespace=bad)
    with pytest.raises(ContractError, match="owner"):
        open_store(redis_url, layout=LAYOUT, namespace="ok", owner="a b")


def test_a_handle_without_a_lease_cannot_hold_blocks(redis_url, namespace):
    s = open_store(redis_url, layout=LAYOUT, namespace=namespace, lease=False)
    with pytest.raises(ContractError, match="lease=False"):
        s.put({}, retain_keys=["k"])
    s.close()
    assert redis.Redis.from_url(redis_url).hlen(f"r3:{namespace}:owners") == 0


def test_the_samples_of_one_prompt_hold_its_blocks_once_per_manifest(counted_store):
    """GRPO's samples share their prompt's blocks: each manifest holds each block it names
    once (however often it names it), beside the engine's own hold, in one hold call per
    node for all of them; released, the manifests leave the blocks as the engine holds
    them, and idle (with a TTL) once it lets go too."""
    store = counted_store
    prompt = {f"p{i}": blk(i) for i in range(40)}
    own = {f"o{j}": blk(100 + j) for j in range(3)}
    store.put({**prompt, **own}, retain_keys=[*prompt, *own])
    names = [[*prompt, f"o{j}"] for j in range(3)]
    names[2].append("p0")  # a block named twice in one manifest: one hold
    manifests = [Manifest(f"s{j}", LAYOUT.fingerprint, Completion(0, 4 * len(keys) + 1),
                          [BlockRef(k, 0, 4) for k in keys]) for j, keys in enumerate(names)]
    nodes = len(store.primaries())
    scripts = command_calls(store, "evalsha")
    store.put({}, manifests=manifests)
    # Holds in one call per node, then each manifest's hash.
    assert command_calls(store, "evalsha") - scripts <= nodes + len(manifests)

    def holders(key):
        refs = store.keys.refs(key)
        return {k.decode(): int(v) for k, v in store.client_for(refs).hgetall(refs).items()}

    engine = store.owner
    for key in prompt:
        assert holders(key) == {engine: 1, "m:s0": 1, "m:s1": 1, "m:s2": 1}
    for j in range(3):
        assert holders(f"o{j}") == {engine: 1, f"m:s{j}": 1}
    assert store.release_manifests(["s0", "s1", "s2"]) == 3
    assert all(holders(key) == {engine: 1} for key in [*prompt, *own])
    store.put({}, release_keys=[*prompt, *own])
    for key in [*prompt, *own]:
        assert not holders(key)
        block = store.keys.block(key)
        assert store.client_for(block).pttl(block) > 0


def test_a_refused_put_retried_records_its_manifest_once(store, monkeypatch, caplog):
    """A put whose last round (the engine's releases, after the manifest) is refused, then
    retried as a writer does: the manifest holds its blocks once and the engine's holds go,
    with no warning that the request was recorded again; recording it again later is one."""
    blocks = {f"k{i}": blk(i) for i in range(3)}
    manifest = Manifest("req", LAYOUT.fingerprint, Completion(0, 13),
                        [BlockRef(k, 0, 4) for k in blocks])
    write = store._write

    def refused_releases(objects, retain_keys, release_keys, journal):
        if release_keys:
            monkeypatch.setattr(store, "_write", write)  # once
            raise StoreUnavailableError("injected: the releases' round was refused")
        return write(objects, retain_keys, release_keys, journal)

    monkeypatch.setattr(store, "_write", refused_releases)
    with pytest.raises(StoreUnavailableError):
        store.put(blocks, [*blocks], [*blocks], [manifest])
    with caplog.at_level("WARNING", logger="r3cache.store"):
        store.put(blocks, [*blocks], [*blocks], [manifest])
    assert "recorded again" not in caplog.text
    for key in blocks:
        refs = store.keys.refs(key)
        assert store.client_for(refs).hgetall(refs) == {b"m:req": b"1"}
    with caplog.at_level("WARNING", logger="r3cache.store"):
        store.put({}, manifests=[manifest])
    assert "1 request id(s) recorded again" in caplog.text


def test_close_drops_every_hold_and_leaves_no_owner_behind(url, namespace):
    s = open_store(url, layout=LAYOUT, namespace=namespace, owner="tidy")
    s.put({"a": blk(1), "b": blk(2)}, retain_keys=["a", "a", "b"])
    s.put({}, release_keys=["a"])
    client = s.client_for(s.keys.owners)
    assert client.hexists(s.keys.owners, "tidy")
    s.close()
    probe = open_store(url, layout=LAYOUT, namespace=namespace, lease=False)
    try:
        for key in ("a", "b"):
            assert probe.client_for(probe.keys.refs(key)).hget(probe.keys.refs(key), "tidy") \
                is None
            assert probe.client_for(probe.keys.block(key)).pttl(probe.keys.block(key)) > 0
        assert not client.hexists(probe.keys.owners, "tidy")
    finally:
        probe.close()


def test_the_namespace_records_the_engines_hash_algorithm(redis_url, namespace):
    s = open_store(redis_url, layout=LAYOUT, namespace=namespace, hash_algo="xxhash_cbor")
    assert s.hash_algo == "xxhash_cbor"
    s.close()
    with pytest.raises(LayoutMismatchError, match="hash_algo"):
        open_store(redis_url, layout=LAYOUT, namespace=namespace)  # sha256 by default
    with pytest.raises(ContractError, match="unknown block hash algorithm"):
        open_store(redis_url, layout=LAYOUT, namespace=namespace + "x", hash_algo="md5")


def test_a_namespace_may_store_its_blocks_raw(url, namespace):
    from r3cache.codec import CODEC_LZ4, CODEC_RAW, read_header

    rows = np.zeros((4, 3, 2), np.uint8)
    rows[:, :, 1] = 1  # repetitive: lz4 would shrink it
    raw = open_store(f"{url}{'&' if '?' in url else '?'}codec=raw", layout=LAYOUT,
                     namespace=namespace)
    raw.put({"k": rows})
    key = raw.keys.block("k")
    assert read_header(raw.client_for(key).get(key), "k").codec == CODEC_RAW
    assert raw.client_for(raw.keys.meta).hget(raw.keys.meta, "codec") == b"raw"
    raw.close()
    with pytest.raises(LayoutMismatchError, match="codec"):
        open_store(url, layout=LAYOUT, namespace=namespace)  # lz4 by default
    with R3Reader(url, namespace=namespace) as reader:  # a reader decodes either
        np.testing.assert_array_equal(reader.store.get_concatenated(["k"]), rows)
    packed = open_store(url, layout=LAYOUT, namespace=namespace + "-lz4")
    packed.put({"k": rows})
    key = packed.keys.block("k")
    assert read_header(packed.client_for(key).get(key), "k").codec == CODEC_LZ4
    packed.close()
    with pytest.raises(ContractError, match="codec must be"):
        open_store(url, layout=LAYOUT, namespace=namespace + "-x", codec="zstd")
