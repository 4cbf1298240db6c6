"""Fidelity and data safety on real redis-server processes: one test per defect class.

Rows a request receives are its own; another writer's rows are never served as ours;
live owners keep their holds under eviction, OOM and restarts, and every hold can be
reclaimed; every engine-side wait is bounded; bad input is refused before any effect.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from r3cache import (
    R3Reader,
    RequestPublisher,
    RoutingLayout,
    SchedulerConnector,
    StepBatch,
    StepMetadata,
    WorkerConnector,
    open_store,
)
from r3cache.connector import PackedHashes
from r3cache.errors import (
    ContractError,
    GenerationError,
    InvalidBatchError,
    LayoutError,
    MetadataError,
    StoreFullError,
    StoreUnavailableError,
)
from r3cache.hashing import block_hashes
from r3cache.integrations import engine
from r3cache.manifest import BlockRef, Completion, Manifest
from r3cache.sim import OracleRoutes, SimConfig, oracle_rows, random_workload, simulate
from r3cache.store import check_url
from r3cache.store.redis.janitor import holders, reclaim_dead_owners, scan_keys
from r3cache.store.writers.process import spawn_writer
from r3cache.testing import RedisServer
from tests.conftest import wait_for

LAYOUT = RoutingLayout(num_layers=3, topk=2, num_experts=16, block_size=4)
WIDE = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)  # 6 KiB blocks


def blk(seed: int, layout: RoutingLayout = LAYOUT) -> np.ndarray:
    """A valid block: distinct experts in every (token, layer), varying with ``seed``."""
    rng = np.random.default_rng(seed)
    rows = np.argsort(rng.random((layout.block_size, layout.num_layers, layout.num_experts)),
                      axis=-1)[..., : layout.topk]
    return rows.astype(layout.dtype)


def pttl(store, key: str) -> int:
    block = store.keys.block(key)
    return store.client_for(block).pttl(block)


# -- 1. rows are the request's own ----------------------------------------------------


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_outputs_do_not_alias_the_callers_buffer(request, backend, namespace, reliability):
    url = "memory://" if backend == "memory" else request.getfixturevalue("redis_url")
    store = open_store(url, layout=LAYOUT, namespace=namespace)
    worker = WorkerConnector(layout=LAYOUT, store=store, max_num_seqs=4)
    tokens = list(range(30))
    rows = oracle_rows(tokens, LAYOUT)
    buffer = np.zeros((64, *LAYOUT.row_shape), LAYOUT.dtype)  # the engine's reused buffer
    try:
        worker.begin_step(StepMetadata(0, {"r": 0}, {}, ()))
        buffer[:10] = rows[:10]
        pending = worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 10])),
                                        routed_experts=buffer)
        buffer[:] = 0xEE  # the next forward overwrites the buffer before the output is read
        pending.enqueue_cpu_copy([1], [0])
        first = worker.process_output(pending)["r"]
        buffer[:] = 0xEE  # ... and again after it was returned
        np.testing.assert_array_equal(first.rows, rows[:10])
        assert not np.shares_memory(first.rows, buffer)
        reliability(f"the engine overwrites its routed-experts buffer ({backend})",
                    "one request, 10 rows", "delivered rows are the connector's copy",
                    "rows equal the oracle after the buffer was filled with 0xEE twice")
    finally:
        worker.close()


@pytest.mark.parametrize("writer,local_tier_bytes",
                         [("process", 1 << 20), ("thread", 1 << 20), ("thread", 0)])
def test_a_request_writing_into_its_rows_never_changes_what_is_stored(
        writer, local_tier_bytes, reliability):
    tokens = list(range(13))
    rows = oracle_rows(tokens, LAYOUT)
    hashes = [bytes([n]) * 32 for n in (1, 2, 3)]
    with RedisServer("--enable-debug-command", "yes") as server:
        store = open_store(server.url, layout=LAYOUT, namespace="own")
        worker = WorkerConnector(layout=LAYOUT, store=store, writer=writer,
                                 local_tier_bytes=local_tier_bytes, store_wait=10.0)
        # Redis sleeps while the step is published: the writer still holds the blocks
        # when the request gets its rows and writes into them.
        stall = threading.Thread(target=lambda: server.client().execute_command(
            "DEBUG", "SLEEP", "0.5"))
        try:
            stall.start()
            time.sleep(0.1)
            worker.begin_step(StepMetadata(0, {"r": 0}, {"r": hashes}, ()))
            pending = worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 13])),
                                            routed_experts=rows)
            pending.enqueue_cpu_copy([1], [0])
            out = worker.process_output(pending)["r"]
            out.rows[:] = out.rows[::-1].copy()  # the request's own rows, its to change
            stall.join()
            worker.store.flush()
            reader = open_store(server.url, layout=LAYOUT, namespace="own")
            stored = reader.get_concatenated([h.hex() for h in hashes])
            reader.close()
            np.testing.assert_array_equal(stored, rows[:12])
        finally:
            stall.join()
            worker.close()
    tier = f"{local_tier_bytes >> 20} MiB local tier" if local_tier_bytes else "no local tier"
    reliability(f"a request writes into its rows before the {writer} writer stored them "
                f"({tier})", "3 blocks, Redis asleep 0.5 s",
                "the blocks in Redis", "equal the captured rows, not the request's edit")


# -- 2. another replica's rows are never served ---------------------------------------


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_conflicting_replica_never_gets_the_other_rows(redis_url, namespace, writer,
                                                         reliability):
    first = open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="replica-a")
    first.put({"k": blk(1)}, retain_keys=["k"])
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="replica-b")
    worker = WorkerConnector(layout=LAYOUT, store=store, writer=writer)
    tiered = worker.store
    try:
        tiered.put({"k": blk(2)}, retain_keys=["k"])
        tiered.flush()
        tiered.clear_local()  # the in-process tier evicted it
        np.testing.assert_array_equal(tiered.get_concatenated(["k"]), blk(2))
        assert tiered.remote_reads == 1
        # The first writer and a fresh reader still see the first writer's rows.
        np.testing.assert_array_equal(first.get_concatenated(["k"]), blk(1))
        tiered.put({}, release_keys=["k"])
        reliability(f"two replicas write different rows under one key ({writer} writer)",
                    "second writer's prefix hit after its local tier dropped the block",
                    "each writer reads its own rows", "second writer read its rows from "
                    "Redis (its variant key); first writer's rows unchanged")
    finally:
        worker.close()
        first.put({}, release_keys=["k"])
        first.close()


def _replica(url: str, namespace: str, tag: str, weights: int, writer: str, seed: int,
             results) -> None:
    """One replica's engine, in a process of its own: the workload of ``seed`` under ids
    of its own, routed by weights ``weights`` (other weights route the same tokens anew)."""
    layout = RoutingLayout(2, 2, 300, 4)
    workload = [dataclasses.replace(r, req_id=f"{tag}-{r.req_id}")
                for r in random_workload(seed, num_requests=10, block_size=4)]
    routes = OracleRoutes(layout, np.random.default_rng(seed))
    routes.weights = weights
    longest = max(len(r.tokens) for r in workload)
    config = SimConfig(max_num_seqs=6, max_num_batched_tokens=48, num_spec_tokens=2,
                       num_kv_blocks=-(-longest // 4) + 12, clear_local_tier_every=3,
                       seed=seed + weights)
    report = simulate(workload, layout, config, routes=routes, store_url=url, writer=writer,
                      namespace=namespace, idle_ttl=120)
    expected = sum(len(r.tokens) - 1 - r.prompt_start for r in workload)
    results.put((tag, report.failures, report.rows_verified, expected,
                 report.manifests_verified, len(workload)))


@pytest.mark.parametrize("backend", ["redis_url", "cluster_url"])
def test_replicas_of_other_weights_writing_one_namespace_at_once_get_their_own_rows(
        request, backend, namespace, reliability):
    """Three engines at once on one namespace with the same prompts, one on other weights
    (an async RL loop whose weight update reaches its replicas at different times): under
    every block key the replicas disagree, their tiers are dropped every third step, and
    every request, online and from its manifest, gets its own engine's rows."""
    url = request.getfixturevalue(backend)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    replicas = [context.Process(target=_replica, args=(url, namespace, tag, weights, writer,
                                                       7, results))
                for tag, weights, writer in [("a", 0, "process"), ("b", 1, "thread"),
                                             ("c", 0, "process")]]
    for process in replicas:
        process.start()
    try:
        reports = [results.get(timeout=120) for _ in replicas]
    finally:
        for process in replicas:
            process.join(30)
    reports.sort()
    assert [report[:2] for report in reports] == [(tag, []) for tag in "abc"]
    for _, _, verified, expected, manifests, requests in reports:
        assert (verified, manifests) == (expected, requests)
    store = open_store(url, layout=None, namespace=namespace)
    try:
        variants = [k for k in scan_keys(store, store.keys.blocks_pattern) if b"~" in k]
    finally:
        store.close()
    assert variants  # the replicas did write conflicting rows under the same keys
    where = "6-node cluster" if backend == "cluster_url" else "standalone Redis"
    reliability(f"three engines at once on one namespace ({where}), one on other weights, "
                "each dropping its local tier every third step",
                "the same 10 random requests each (spec decode, prefix hits), helper "
                "writer twice, thread writer once",
                "every request's rows, online and from its manifest, are its own engine's",
                f"{sum(r[2] for r in reports)} rows and {sum(r[4] for r in reports)} "
                f"manifests verified; {len(variants)} variant blocks written")


def test_own_rows_win_past_any_count_of_conflicts(redis_url, namespace, reliability):
    n = 5000  # more than the 4096 an in-process cache of own rows used to keep
    keys = [f"c{i}" for i in range(n)]
    a, b = blk(1), blk(2)
    first = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    second = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    try:
        first.put({k: a for k in keys})
        second.put({k: b for k in keys}, retain_keys=keys)
        assert second.stats().conflicts == n
        rows = second.get_concatenated(keys).reshape(n, *LAYOUT.block_shape)
        assert (rows == b).all()
        manifest = Manifest("req", LAYOUT.fingerprint, Completion(0, 2 * 4 + 1),
                            [BlockRef(keys[0], 0, 4), BlockRef(keys[-1], 0, 4)])
        second.put({}, manifests=[manifest], release_keys=keys)
        with R3Reader(redis_url, namespace=namespace) as reader:
            np.testing.assert_array_equal(reader.get("req"), np.concatenate([b, b]))
            assert reader.release("req") == 1
        reliability("5000 keys written first by another replica with different rows",
                    "one batch", "every read and the manifest give this writer's rows",
                    f"{n}/{n} blocks and the manifest's 8 rows are this writer's")
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("backend,writer", [
    ("memory", "inline"), ("memory", "thread"), ("redis", "thread"), ("redis", "process"),
    ("cluster", "process")])
def test_after_a_prefix_cache_reset_hits_read_the_new_generations_rows(
        request, backend, writer, namespace, reliability):
    # A weight update, then a prefix-cache reset: the prompt hashes to the same blocks,
    # but its routes are the new weights' (here: other rows for the same tokens).
    tokens = list(range(100, 113))  # three full blocks of 4
    hashes = block_hashes(tokens, LAYOUT.block_size)
    old = oracle_rows(tokens, LAYOUT)
    new = ((old + 3) % LAYOUT.num_experts).astype(LAYOUT.dtype)
    url = "memory://" if backend == "memory" else request.getfixturevalue(f"{backend}_url")
    store = open_store(url, layout=LAYOUT, namespace=namespace,
                       **({} if backend == "memory" else {"owner": f"rl-{writer}"}))
    worker = WorkerConnector(layout=LAYOUT, store=store, max_num_seqs=4,
                             writer="auto" if writer == "inline" else writer)

    def step(generation, requests, hashes_of, runs, rows, finished=()):
        worker.begin_step(StepMetadata(generation, requests, hashes_of, tuple(finished),
                                       {r: Completion(0, 13) for r in finished}))
        if not runs:
            return {}
        qsl = np.concatenate(([0], np.cumsum([n for _, _, n in runs])))
        pending = worker.prepare_output(StepBatch([r for r, _, _ in runs],
                                                  np.array([s for _, s, _ in runs]), qsl),
                                        routed_experts=rows)
        pending.enqueue_cpu_copy(np.ones(len(runs), int), np.zeros(len(runs), int))
        return worker.process_output(pending)

    try:
        step(0, {"a": 0}, {"a": hashes}, [("a", 0, 12)], old[:12])
        step(0, {}, {}, [], None, finished=["a"])
        step(1, {"b": 0}, {"b": hashes}, [("b", 0, 12)], new[:12])  # after the reset
        hit = step(1, {"c": 0}, {"c": hashes[:2]}, [("c", 8, 4)], new[8:12])["c"]
        np.testing.assert_array_equal(hit.rows, new[:12])  # its 8 hit rows and its own 4
        step(1, {}, {}, [], None, finished=["b", "c"])
        worker.store.flush()
    finally:
        worker.close()
    if backend != "memory":
        with R3Reader(url, namespace=namespace) as reader:
            a, b, c = reader.get_many(["a", "b", "c"])
            manifests = reader.store.get_manifests(["a", "b"])
            by_tokens = [reader.get_by_tokens(tokens, generation=g).rows for g in (0, 1)]
            assert reader.release("a", "b", "c") == 3
        np.testing.assert_array_equal(by_tokens[0], old[:12])
        np.testing.assert_array_equal(by_tokens[1], new[:12])
        np.testing.assert_array_equal(a, old[:12])
        np.testing.assert_array_equal(b, new[:12])
        np.testing.assert_array_equal(c, new[:12])
        assert manifests[0].block_keys == [h.hex() for h in hashes]
        assert manifests[1].block_keys == [h.hex() + ".g1" for h in hashes]
    durable = backend != "memory"  # the embedded store records no manifests to read
    reliability(f"a prefix-cache reset (weight update) between two computations of one "
                f"prompt ({backend}, {writer} writer)", "a prefix hit on the recomputed "
                "blocks" + (", then the manifests" if durable else ""),
                ("the hit and the manifests hold" if durable else "the hit holds") +
                " the new generation's rows", "hit rows new; manifests of both "
                "generations exact" if durable else "hit rows new")


@pytest.mark.parametrize("backend,writer", [
    ("redis", "thread"), ("redis", "process"), ("cluster", "process")])
def test_preempted_requests_manifests_name_the_rows_they_were_given(
        request, backend, writer, namespace, reliability):
    # vLLM's pause_generation(mode="keep") around a weight update: running requests are
    # preempted, the prefix cache is reset, and they resume, recomputed with the new
    # weights. Each was given the old weights' rows for what it had generated; its
    # manifest must name those, not the recomputed ones. The same for a request
    # preempted (KV pressure) whose recomputation yields other rows (kernels that are not
    # batch-invariant), and for one that ends before it runs again.
    url = request.getfixturevalue(f"{backend}_url")
    store = open_store(url, layout=LAYOUT, namespace=namespace, owner=f"pause-{writer}")
    worker = WorkerConnector(layout=LAYOUT, store=store, max_num_seqs=4, writer=writer)
    tokens = {r: list(range(100 + 20 * i, 116 + 20 * i)) for i, r in enumerate("afpw")}
    hashes = {r: block_hashes(t, LAYOUT.block_size) for r, t in tokens.items()}
    old = {r: oracle_rows(t, LAYOUT) for r, t in tokens.items()}
    new = {r: ((rows + 3) % LAYOUT.num_experts).astype(LAYOUT.dtype) for r, rows in old.items()}
    given: dict[str, list[np.ndarray]] = {r: [] for r in tokens}

    def step(generation, runs=(), weights=old, requests=None, finished=(), completions=None,
             preempted=()):
        registered = requests or {}
        worker.begin_step(StepMetadata(
            generation, registered, {r: hashes[r][: (e + 1) // 4] for r, e in registered.items()},
            tuple(finished), completions or {}, preempted=tuple(preempted)))
        if not runs:
            return
        qsl = np.concatenate(([0], np.cumsum([n for _, _, n in runs])))
        rows = np.concatenate([weights[r][a : a + n] for r, a, n in runs])
        pending = worker.prepare_output(StepBatch([r for r, _, _ in runs],
                                                  np.array([a for _, a, _ in runs]), qsl),
                                        routed_experts=rows)
        pending.enqueue_cpu_copy(np.ones(len(runs), int), np.zeros(len(runs), int))
        for req_id, out in worker.process_output(pending).items():
            given[req_id].append(out.rows.copy())

    try:
        step(0, [("a", 0, 10), ("f", 0, 6), ("w", 0, 9)], requests={"a": 0, "f": 0, "w": 0})
        step(0, [("a", 10, 1), ("f", 6, 1), ("w", 9, 1)])
        step(0, finished=["w"], preempted=["w"])  # KV pressure: w waits, given rows 0..10
        step(0, [("a", 11, 1), ("f", 7, 1)])
        # f finished in that step; then the pause: a is preempted, the prefix cache reset,
        # and a resumes at once (in the same step), recomputed with the new weights.
        step(1, [("a", 0, 13)], new, requests={"a": 12}, finished=["f", "a"],
             completions={"f": Completion(0, 9)}, preempted=["a"])
        step(1, [("a", 13, 1), ("p", 0, 9)], new, requests={"p": 0})
        step(1, finished=["p"], preempted=["p"])
        # p resumes; its recomputation yields other rows than it was given.
        other = {"p": ((new["p"] + 5) % LAYOUT.num_experts).astype(LAYOUT.dtype)}
        step(1, [("p", 0, 10)], other, requests={"p": 9})
        step(1, finished=["a", "p", "w"], completions={"a": Completion(0, 15),
                                                      "p": Completion(0, 11),
                                                      "w": Completion(0, 11)})
        worker.store.flush()
        assert worker.num_requests == 0
        # A handle of its own, closed: left open, its heartbeat wrote its owner entry back
        # after the session had deleted the namespace's keys.
        admin = open_store(url, layout=LAYOUT, namespace=namespace, lease=False)
        try:
            engine_holds = holders(admin)
        finally:
            admin.close()
        assert f"pause-{writer}" not in engine_holds  # every pin the engine took is gone
    finally:
        worker.close()
    delivered = {r: np.concatenate(parts) for r, parts in given.items()}
    assert len(delivered["a"]) == 14 and (delivered["a"][:12] == old["a"][:12]).all()
    assert (delivered["a"][12:] == new["a"][12:14]).all()  # the recomputation's own
    with R3Reader(url, namespace=namespace) as reader:
        manifests = dict(zip("afpw", reader.get_many(list("afpw"))))
        assert reader.release(*"afpw") == 4
    for req_id in "afpw":
        np.testing.assert_array_equal(manifests[req_id], delivered[req_id], err_msg=req_id)
    reliability(f"requests preempted around a weight update and a prefix-cache reset, "
                f"resumed and recomputed with other rows, or ended while preempted "
                f"({backend}, {writer} writer)", "the four manifests",
                "each names exactly the rows its request was given", "4/4 exact; 0 engine "
                "holds left")


@pytest.mark.parametrize("writer", ["plain", "process"])
def test_a_block_computed_again_with_other_rows_keeps_every_manifest_exact(
        redis_url, cluster_url, namespace, writer, reliability):
    # One prompt block, computed again after each of several weight updates (or engine
    # restarts): each version's request records a manifest naming the block's key.
    versions = [blk(seed) for seed in range(4)]
    for url in (redis_url, cluster_url):
        durable = open_store(url, layout=LAYOUT, namespace=namespace, owner="rl-engine")
        store = spawn_writer(durable) if writer == "process" else durable
        try:
            for i, rows in enumerate(versions):
                store.put({"k": rows}, ["k"], manifests=[Manifest(
                    f"v{i}", LAYOUT.fingerprint, Completion(0, 5), [BlockRef("k", 0, 4)])])
                store.put({}, release_keys=["k"])
                store.flush()
                # Its later reads of the block are its own latest rows.
                np.testing.assert_array_equal(store.get_concatenated(["k"]), rows)
        finally:
            store.close()
        with R3Reader(url, namespace=namespace) as reader:
            got = reader.get_many([f"v{i}" for i in range(len(versions))])
            assert reader.release(*(f"v{i}" for i in range(len(versions)))) == len(versions)
        assert all(np.array_equal(g, v) for g, v in zip(got, versions))
        check = open_store(url, layout=LAYOUT, namespace=namespace, owner="a-look")
        assert holders(check) == {}  # no hold left on any version
        check.close()
    reliability(f"one key written with 4 different rows in turn by one writer ({writer} "
                "writer; weight updates, restarts)", "a manifest per version, standalone "
                "and cluster", "each manifest reads back its own version; no hold left",
                "4/4 versions exact on each; 0 holds after release")


# -- 3. live owners keep their holds under eviction and OOM -----------------------------


@pytest.mark.parametrize("policy", ["volatile-lru", "volatile-ttl"])
def test_a_live_owner_survives_eviction(policy, reliability):
    with RedisServer("--maxmemory", "4mb", "--maxmemory-policy", policy) as server:
        owner = open_store(server.url, layout=WIDE, namespace="evict")
        pinned = [f"p{i}" for i in range(40)]
        owner.put({k: blk(i, WIDE) for i, k in enumerate(pinned)}, retain_keys=pinned)
        writer = open_store(server.url, layout=WIDE, namespace="evict", idle_ttl=600)
        for at in range(0, 1500, 100):  # idle blocks with TTLs: volatile-lru evicts
            writer.put({f"i{at + i}": blk(i, WIDE) for i in range(100)})
        evicted = server.client().info("stats")["evicted_keys"]
        assert evicted > 0
        report = reclaim_dead_owners(writer)
        assert owner.owner in report.live_owners and report.holds_dropped == 0
        got = owner.get_concatenated(pinned).reshape(len(pinned), *WIDE.block_shape)
        assert all((got[i] == blk(i, WIDE)).all() for i in range(len(pinned)))
        owner.close()
        writer.close()
        reliability(f"maxmemory 4 MB, {policy}, 1500 idle 6 KiB blocks written",
                    "a live owner (30 s lease) holding 40 blocks",
                    "the janitor finds it live; its blocks read back",
                    f"{evicted} keys evicted, 0 holds dropped, 40/40 blocks intact")


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
def test_an_engine_opening_a_redis_that_may_evict_held_blocks_says_so(policy, caplog):
    with RedisServer("--maxmemory", "64mb", "--maxmemory-policy", policy) as server:
        with caplog.at_level("WARNING", logger="r3cache.store"):
            store = open_store(server.url, layout=LAYOUT, namespace="policy")
            reader = open_store(server.url, layout=LAYOUT, namespace="policy", lease=False,
                                janitor=False)
        store.close()
        reader.close()
    with RedisServer("--maxmemory-policy", policy) as server, \
            caplog.at_level("WARNING", logger="r3cache.store"):
        open_store(server.url, layout=LAYOUT, namespace="unbounded").close()  # evicts nothing
    said = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    if policy == "volatile-lru":
        assert said == []
    else:
        assert len(said) == 1 and "allkeys-lru" in said[0] and "volatile-lru" in said[0]


def test_an_engine_asking_for_more_replicas_than_a_primary_has_is_told(cluster_url, namespace,
                                                                         caplog):
    with RedisServer() as server, caplog.at_level("WARNING", logger="r3cache.store"):
        store = open_store(f"{server.url}?wait_replicas=1&wait_timeout=0.05", layout=LAYOUT,
                           namespace="replicas")
        store.put({"k": blk(1)})  # stored, after waiting for a replica that is not there
        assert store.stats().unreplicated == 1
        store.close()
        # The test cluster's primaries have one replica each: enough for 1, not for 2.
        for wanted in (1, 2):
            open_store(f"{cluster_url}?wait_replicas={wanted}", layout=LAYOUT,
                       namespace=f"{namespace}-{wanted}").close()
    said = [r.getMessage() for r in caplog.records if "wait_replicas" in r.getMessage()]
    assert len(said) == 2, said
    assert "0 connected replica(s), wait_replicas=1" in said[0]
    assert "1 connected replica(s), wait_replicas=2" in said[1]


def test_a_wait_or_ttl_under_a_millisecond_is_one_and_a_wait_is_shorter_than_a_socket_timeout():
    """wait_timeout=0.0004 became WAIT 1 0, which waits for ever: each put short of a
    replica then failed after (retries + 1) socket timeouts, 40 s. One as long as the
    socket timeout fails every such put the same way: refused at open."""
    with RedisServer() as server:
        store = open_store(f"{server.url}?wait_replicas=1&wait_timeout=0.0004&"
                           "socket_timeout=2&retries=0", layout=LAYOUT, namespace="wait")
        started = time.monotonic()
        store.put({"k": blk(1)})
        assert time.monotonic() - started < 1.5 and store.stats().unreplicated == 1
        store.close()
        # Likewise an idle TTL under 1 ms was PX 0, which Redis refuses: no put went in.
        store = open_store(f"{server.url}?idle_ttl=0.0004", layout=LAYOUT, namespace="wait")
        store.put({"k2": blk(2)})
        store.close()
        for query in ("wait_timeout=10", "wait_timeout=3&socket_timeout=2"):
            with pytest.raises(ContractError, match="must be shorter than socket_timeout"):
                open_store(f"{server.url}?wait_replicas=1&{query}", layout=LAYOUT,
                           namespace="wait")


def test_a_wait_or_ttl_past_what_redis_and_python_can_count_is_refused_at_once(redis_url):
    """idle_ttl=1e17 failed every put ("value is not an integer or out of range");
    lease_ttl=1e17 killed the heartbeat thread with an OverflowError; store_wait and a
    reader's wait of 1e17 would do the same in the engine's or the trainer's wait."""
    for option in ("idle_ttl", "lease_ttl", "manifest_ttl", "wait_timeout"):
        with pytest.raises(ContractError, match=f"{option} must be at most 1e\\+09 s"):
            open_store(f"{redis_url}?{option}=1e17", layout=LAYOUT, namespace="big")
    store = open_store("memory://", layout=LAYOUT, namespace="big")
    with pytest.raises(ContractError, match="store_wait must be .* at most 1e\\+09"):
        WorkerConnector(layout=LAYOUT, store=store, max_num_seqs=2,
                        max_num_batched_tokens=16, store_wait=1e17)
    with R3Reader(store) as reader, pytest.raises(ContractError, match="wait must be"):
        reader.get("r", wait=1e17)


def test_redis_clients_options_are_checked_before_anything_connects(redis_url, namespace):
    """The redis-py options a store URL may carry, each checked by r3cache: socket timeouts
    of 1e300 s overflowed the socket's deadline (an OverflowError out of a CLI command),
    health_check_interval=-5 and db=-1 failed only at the first command, as a StoreError,
    socket_keepalive=maybe was taken for true, a cluster URL's database was dropped
    without a word, protocol=3 would switch the replies r3cache reads to RESP3,
    retry_on_timeout would retry inside r3cache's own tries, and timeout= was a TypeError
    where the client was made."""
    host = redis_url.split("://")[1].split("/")[0]
    for query, problem in (("socket_timeout=1e300", "socket_timeout has an invalid value"),
                           ("socket_connect_timeout=1e17", "socket_connect_timeout has an"),
                           ("health_check_interval=-5", "health_check_interval has an"),
                           ("db=-1", "db has an invalid value"),
                           ("db=true", "db has an invalid value"),
                           ("socket_keepalive=maybe", "socket_keepalive is a flag"),
                           ("protocol=3", "r3cache speaks RESP2"),
                           ("socket_read_size=0", "socket_read_size has an invalid value"),
                           ("timeout=1", "unknown Redis store option 'timeout'"),
                           ("retry_on_error=TimeoutError", "unknown Redis store option"),
                           ("retry_on_timeout=1", "unknown Redis store option"),
                           ("ssl_check_hostname=1", "needs a TLS URL")):
        for check in (check_url, lambda url: open_store(url, layout=LAYOUT, namespace="o")):
            with pytest.raises(ContractError, match=problem):
                check(f"redis://{host}?{query}")
    for url in (f"redis+cluster://{host}/2", f"redis+cluster://{host}?db=2"):
        with pytest.raises(ContractError, match="a Redis Cluster has only database 0"):
            check_url(url)
    check_url(f"redis+cluster://{host}/0")
    check_url(f"redis+cluster://{host}?db=0")
    with pytest.raises(ContractError, match="ssl_validate_ocsp is a flag"):
        check_url(f"rediss://{host}?ssl_validate_ocsp=perhaps")
    store = open_store(f"redis://{host}?socket_keepalive=yes&health_check_interval=30&"
                       "protocol=2&db=0&socket_read_size=65536",
                       layout=LAYOUT, namespace=namespace)
    try:
        kwargs = store._nodes.client.connection_pool.connection_kwargs
        assert kwargs["socket_keepalive"] is True and kwargs["health_check_interval"] == 30
        store.put({"a": blk(1)})
        assert np.array_equal(store.get_concatenated(["a"]), blk(1))
    finally:
        store.close()


def test_a_heartbeat_goes_through_when_redis_is_out_of_memory(reliability):
    with RedisServer("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as server:
        owner = open_store(server.url, layout=WIDE, namespace="oom", lease_ttl=1)
        with pytest.raises(StoreFullError):
            for at in range(0, 2000, 50):
                keys = [f"p{at + i}" for i in range(50)]
                owner.put({k: blk(i, WIDE) for i, k in enumerate(keys)}, retain_keys=keys)
        server.client().config_set("maxmemory", "100kb")  # far over: every write refused
        time.sleep(1.5)
        janitor = open_store(server.url, layout=WIDE, namespace="oom", lease=False,
                             janitor=False)
        report = reclaim_dead_owners(janitor)
        assert owner.owner in report.live_owners and report.dead_owners == ()
        janitor.close()
        owner.close()
        reliability("Redis out of memory (noeviction) under pinned blocks",
                    "an owner with a 1 s lease", "heartbeats are accepted under OOM; the "
                    "janitor finds the owner live", "0 owners reclaimed after 1.5 s")


# -- 4. every hold can be reclaimed ----------------------------------------------------

OWNER_PROCESS = """
import sys, time
import numpy as np
from r3cache import RoutingLayout, open_store
layout = RoutingLayout(3, 2, 16, 4)
store = open_store(sys.argv[1], layout=layout, namespace=sys.argv[2], owner=sys.argv[3],
                   lease_ttl=float(sys.argv[4]))
rows = np.zeros(layout.block_shape, np.uint8)
rows[:, :, 1] = 1
store.put({"h1": rows, "h2": rows}, retain_keys=["h1", "h2"])
print(store.owner, flush=True)
time.sleep(600)
"""


def _owner_process(url: str, namespace: str, owner: str, lease: float = 1.0):
    process = subprocess.Popen([sys.executable, "-c", OWNER_PROCESS, url, namespace, owner,
                                str(lease)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == owner
    return process


def _holders_of(store, key: str) -> set[str]:
    refs = store.keys.refs(key)
    return {h.decode() for h in store.client_for(refs).hkeys(refs)}


def test_an_owner_reclaimed_while_stalled_registers_again_and_is_reclaimed_after_its_crash(
        redis_url, namespace, reliability):
    probe = open_store(redis_url, layout=LAYOUT, namespace=namespace, lease=False,
                       janitor=False)
    process = _owner_process(redis_url, namespace, "stalled")
    try:
        process.send_signal(signal.SIGSTOP)
        time.sleep(1.5)
        report = reclaim_dead_owners(probe)
        assert report.dead_owners == ("stalled",) and report.holds_dropped == 2
        process.send_signal(signal.SIGCONT)
        # Its next heartbeat finds it was reclaimed: it registers again and re-holds.
        wait_for(lambda: _holders_of(probe, "h1") == {"stalled"}, 5, "the holds to return")
        assert pttl(probe, "h1") == -1
        assert "stalled" in reclaim_dead_owners(probe).live_owners
        process.kill()
        process.wait()
        time.sleep(1.5)
        report = reclaim_dead_owners(probe)
        assert report.dead_owners == ("stalled",) and report.holds_dropped == 2
        assert pttl(probe, "h1") > 0 and pttl(probe, "h2") > 0
        reliability("an owner stalled past its lease (SIGSTOP), reclaimed, resumed, then "
                    "killed", "2 held blocks", "it re-registers and re-holds on resume; "
                    "after its crash the janitor reclaims it",
                    "2 holds dropped twice; blocks end with the idle TTL")
    finally:
        process.kill()
        probe.close()


def test_a_fixed_owner_name_reused_after_a_crash_drops_the_crashed_runs_holds(
        redis_url, namespace, reliability):
    process = _owner_process(redis_url, namespace, "engine-0", lease=30)
    process.kill()
    process.wait()
    restarted = open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="engine-0")
    try:
        assert _holders_of(restarted, "h1") == set() and pttl(restarted, "h1") > 0
        reliability("an engine with owner='engine-0' killed and restarted at once "
                    "(its 30 s lease still running)", "2 held blocks",
                    "the new incarnation drops the crashed one's holds when it registers",
                    "0 holds left; blocks got the idle TTL")
    finally:
        restarted.close()


def test_a_second_live_store_under_one_owner_name_is_refused_and_the_first_keeps_its_holds(
        redis_url, namespace, reliability):
    # Two engines given the same owner= (one URL for every data-parallel rank, say): the
    # second would take the name and overwrite the first's counts, leaving blocks the
    # first uses without a hold.
    first = open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="engine-0")
    first.put({"h3": blk(3)}, retain_keys=["h3"])
    process = _owner_process(redis_url, namespace, "engine-1", lease=3.0)
    try:
        began = time.monotonic()
        with pytest.raises(ContractError, match="in use by a live store"):
            open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="engine-0")
        same_process = time.monotonic() - began
        began = time.monotonic()
        with pytest.raises(ContractError, match="in use by a live store"):
            open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="engine-1")
        other_process = time.monotonic() - began
        # The other process proves it is alive with its next heartbeat (a third of 3 s).
        assert same_process < 0.2 and other_process < 2.5
        assert _holders_of(first, "h3") == {"engine-0"} and first.refcount("h3") == 1
        assert _holders_of(first, "h1") == {"engine-1"} and pttl(first, "h1") == -1
        reliability("a second store opened under a live store's owner name, in the same "
                    "process and in another one", "3 held blocks",
                    "the second open is refused; the live stores keep every hold",
                    f"refused after {same_process:.2f} s and {other_process:.2f} s")
    finally:
        process.kill()
        first.close()


def test_the_data_parallel_ranks_of_an_engine_given_one_owner_name_hold_apart(
        redis_url, namespace):
    # vLLM's and SGLang's ranks read one R3CACHE_URL: its owner= names each rank apart.
    url = f"{redis_url}?owner=engine-a"
    ranks = [open_store(url, layout=LAYOUT, namespace=namespace,
                        **engine.rank_owner(url, rank, 2)) for rank in range(2)]
    try:
        for store in ranks:
            store.put({"h4": blk(4)}, retain_keys=["h4"])
        assert [s.owner for s in ranks] == ["engine-a-dp0", "engine-a-dp1"]
        assert _holders_of(ranks[0], "h4") == {"engine-a-dp0", "engine-a-dp1"}
        assert engine.rank_owner(url, 0, 1) == {} and engine.rank_owner(redis_url, 1, 2) == {}
    finally:
        for store in ranks:
            store.close()


def test_an_r3cache_url_option_without_a_value_or_given_twice_is_refused(redis_url):
    # R3CACHE_URL carries the plugin's options and the store's: parse_qsl alone would drop
    # "owner=" (every rank then opens under a default name) and keep the last of two.
    known = {"store_wait": float}
    assert engine.split_url(f"{redis_url}?store_wait=2&owner=a&", known) == (
        f"{redis_url}?owner=a", {"store_wait": 2.0})
    for query in ("owner=", "owner", "store_wait=", "store_wait=1&store_wait=2"):
        with pytest.raises(ContractError, match="has no value|is given twice"):
            engine.split_url(f"{redis_url}?{query}", known)
    with pytest.raises(ContractError, match="'owner' has no value"):
        engine.rank_owner(f"{redis_url}?owner=", 0, 2)


def test_a_size_in_r3cache_url_is_read_as_the_memory_stores_max_bytes_is():
    """local_tier_bytes=1e9 was refused where memory://?max_bytes=1e9 is taken; infinity
    and NaN are refused as the option's, before anything opens."""
    from r3cache.integrations import vllm

    assert vllm.split_url("redis://h/0?local_tier_bytes=1e9&idle_ttl=9") == (
        "redis://h/0?idle_ttl=9", {"local_tier_bytes": 10**9})
    for value in ("inf", "nan", "true", "1GB"):
        with pytest.raises(ContractError, match=f"local_tier_bytes has an invalid value '{value}'"):
            vllm.split_url(f"redis://h/0?local_tier_bytes={value}")
        with pytest.raises(ContractError, match="max_bytes must be a number"):
            open_store(f"memory://?max_bytes={value}", layout=LAYOUT, namespace="n")


def test_r3cache_url_connector_options_are_checked_before_the_store_opens():
    """Opening the store writes its namespace and registers an owner: a value that only
    the connector refused, after the open, left both behind."""
    from r3cache.integrations import sglang, vllm

    bad = {"store_wait": ("inf", "nan", "-1", "1e12"), "writer": ("bogus", "Thread"),
           "on_unavailable": ("ignore",), "local_tier_bytes": ("-5", "1e20")}
    for option, values in bad.items():
        for value in values:
            with pytest.raises(ContractError, match=option):
                vllm.split_url(f"redis://h/0?{option}={value}")
    for option in ("store_wait", "writer"):
        with pytest.raises(ContractError, match=option):
            engine.split_url(f"redis://h/0?{option}={bad[option][0]}", sglang._OPTIONS)
    # Values that cannot serve together, or with the store the URL names.
    for url in ("redis://h/0?writer=process&on_unavailable=incomplete",
                "memory://?writer=process"):
        with pytest.raises(ContractError, match="writer='process'"):
            vllm.split_url(url)
    assert vllm.split_url("redis://h/0?store_wait=2.5&writer=thread&on_unavailable=incomplete"
                          "&local_tier_bytes=0&idle_ttl=9") == (
        "redis://h/0?idle_ttl=9", {"store_wait": 2.5, "writer": "thread",
                                   "on_unavailable": "incomplete", "local_tier_bytes": 0})


@pytest.mark.parametrize("variable,value,match", [
    ("R3CACHE_URL", "redis://127.0.0.1:6379/0?idle_ttl=abc", "idle_ttl"),
    ("R3CACHE_URL", "redis://127.0.0.1:6379/0?idle_tll=9", "idle_tll"),
    ("R3CACHE_URL", "redis://127.0.0.1:port/0", "invalid port"),
    ("R3CACHE_URL", "redis+cluster://h:7000,h:x", "invalid port"),
    ("R3CACHE_URL", "redis://h:6379/0?ssl_ca_certs=/ca.pem", "ssl_ca_certs"),
    ("R3CACHE_URL", "redis://h:6379/0?wait_replicas=1&wait_timeout=20", "wait_timeout"),
    ("R3CACHE_URL", "memory://?max_bytes=1GB", "max_bytes"),
    ("R3CACHE_URL", "memcached://h:11211", "scheme"),
    ("R3CACHE_URL", "redis://h:6379/0?store_wait=inf", "store_wait"),
    ("R3CACHE_NAMESPACE", "my model", "R3CACHE_NAMESPACE"),
    ("R3CACHE_INLINE", "fasle", "R3CACHE_INLINE"),
    ("R3CACHE_METRICS_PORT", "http", "R3CACHE_METRICS_PORT")])
def test_each_plugin_checks_its_variables_before_the_engine_loads_a_model(
        monkeypatch, variable, value, match):
    """What the plugins check as they load (vLLM's API process, SGLang's before a scheduler
    starts): every R3CACHE_* mistake the store or the connector would find, without a
    server. Found where the store opens, it stopped the engine after its model loaded."""
    from r3cache.integrations import sglang, vllm

    monkeypatch.setenv("R3CACHE_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv(variable, value)
    for split in (vllm.split_url, lambda url: engine.split_url(url, sglang._OPTIONS)):
        with pytest.raises(ContractError, match=match):
            engine.check_environment(split)


def test_the_plugins_variables_as_the_readme_gives_them_pass(monkeypatch):
    from r3cache.integrations import vllm

    for url, namespace in [("redis+cluster://10.0.0.5:7000,10.0.0.6:7000", "Qwen3@main"),
                           ("rediss://:secret@h:6380/2?idle_ttl=60&writer=thread", "a/b=c"),
                           ("unix:///run/redis.sock?db=1", "x"),
                           ("memory://?max_bytes=1e9", "any label at all")]:
        monkeypatch.setenv("R3CACHE_URL", url)
        monkeypatch.setenv("R3CACHE_NAMESPACE", namespace)
        engine.check_environment(vllm.split_url)


@pytest.mark.parametrize("value,inline", [("0", False), ("off", False), ("No", False),
                                          ("false", False), ("1", True), ("on", True),
                                          ("", True), (None, True)])
def test_r3cache_inline_takes_every_usual_spelling_of_a_flag(monkeypatch, value, inline):
    """R3CACHE_INLINE=off kept inline routes on: only 0, false and no turned them off."""
    if value is None:
        monkeypatch.delenv("R3CACHE_INLINE", raising=False)
    else:
        monkeypatch.setenv("R3CACHE_INLINE", value)
    assert engine.inline() is inline


def test_a_misspelt_flag_is_refused_not_taken_for_true(monkeypatch, redis_url, namespace):
    monkeypatch.setenv("R3CACHE_INLINE", "fasle")
    with pytest.raises(ContractError, match="R3CACHE_INLINE is a flag"):
        engine.inline()
    for query in ("janitor=flase", "lease=maybe"):
        with pytest.raises(ContractError, match="has an invalid value"):
            open_store(f"{redis_url}?{query}", layout=LAYOUT, namespace=namespace)
    from r3cache.store.redis.connect import list_namespaces

    assert namespace not in list_namespaces(redis_url)  # refused before it was made


STALLED_OWNER = """
import sys
import numpy as np
from r3cache import RoutingLayout, open_store
layout = RoutingLayout(3, 2, 16, 4)
store = open_store(sys.argv[1], layout=layout, namespace=sys.argv[2], owner="engine-0",
                   lease_ttl=1.0)
rows = np.zeros(layout.block_shape, np.uint8)
rows[:, :, 1] = 1
store.put({"h1": rows}, retain_keys=["h1"])
print("held", flush=True)
sys.stdin.readline()
try:
    store.put({}, retain_keys=["h1"], release_keys=["h1"])
    print("wrote", flush=True)
except Exception as exc:
    print(type(exc).__name__, flush=True)
store.close()
print("closed", flush=True)
"""


def test_an_owner_stalled_past_its_lease_yields_its_name_and_leaves_the_new_holds_alone(
        redis_url, namespace, reliability):
    process = subprocess.Popen([sys.executable, "-c", STALLED_OWNER, redis_url, namespace],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    restarted = None
    try:
        assert process.stdout.readline().strip() == "held"
        process.send_signal(signal.SIGSTOP)
        began = time.monotonic()
        # Alive as far as anyone can tell until its lease runs out without a heartbeat.
        restarted = open_store(redis_url, layout=LAYOUT, namespace=namespace,
                               owner="engine-0", lease_ttl=1.0)
        waited = time.monotonic() - began
        restarted.put({}, retain_keys=["h1"])
        process.send_signal(signal.SIGCONT)
        time.sleep(0.8)  # its next heartbeat finds the name taken
        process.stdin.write("go\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "StoreAccessError"
        assert process.stdout.readline().strip() == "closed"
        assert process.wait(10) == 0
        owners = restarted.keys.owners
        entry = restarted.client_for(owners).hget(owners, "engine-0")
        assert entry is not None and f"pid={os.getpid()} " in entry.decode()
        assert _holders_of(restarted, "h1") == {"engine-0"} and pttl(restarted, "h1") == -1
        assert restarted.refcount("h1") == 1
        assert 0.2 < waited < 3
        reliability("an owner stalled (SIGSTOP) past its 1 s lease, its name opened again, "
                    "then resumed", "1 held block",
                    "the new store waits out the lease; the resumed one refuses writes "
                    "and its close leaves the new holds and entry",
                    f"name taken after {waited:.2f} s; 1 hold left, the new store's")
    finally:
        process.kill()
        if restarted is not None:
            restarted.close()


def test_an_owner_name_a_janitor_is_reclaiming_is_taken_once_it_is_done(redis_url, namespace):
    probe = open_store(redis_url, layout=LAYOUT, namespace=namespace, lease=False,
                       janitor=False)
    owners = probe.keys.owners
    client = probe.client_for(owners)
    # A crashed process of this host, its holds being dropped by another process's janitor:
    # taking the name at once would let those drops take the new incarnation's holds. (A
    # store that runs the janitor as it opens finishes the reclaim itself.)
    client.hset(owners, "engine-0", f"0 host={socket.gethostname()} pid=999999999 started=0")
    timer = threading.Timer(0.5, client.hdel, (owners, "engine-0"))
    timer.start()
    began = time.monotonic()
    first = open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="engine-0",
                       janitor=False)
    after_janitor = time.monotonic() - began
    # A janitor that never finishes is waited for one lease.
    client.hset(owners, "engine-1", "0 host=elsewhere pid=1 started=0")
    began = time.monotonic()
    second = open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="engine-1",
                        lease_ttl=1.0, janitor=False)
    after_lease = time.monotonic() - began
    try:
        assert 0.4 < after_janitor < 2 and 0.9 < after_lease < 2.5
        assert f"pid={os.getpid()} " in client.hget(owners, "engine-1").decode()
    finally:
        timer.cancel()
        first.close()
        second.close()
        probe.close()


def test_an_owner_closing_before_it_claims_the_janitors_entry_frees_its_name(
        redis_url, namespace):
    probe = open_store(redis_url, layout=LAYOUT, namespace=namespace, lease=False,
                       janitor=False)
    owners = probe.keys.owners
    first = open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="engine-0",
                       lease_ttl=20, janitor=False)
    first.put({"h1": blk(1)}, ["h1"])
    # Its entry lost (a Redis restarted without persistence), a janitor finds its holds
    # before its next heartbeat: an entry with one lease of grace, in the janitor's name.
    probe.client_for(owners).hdel(owners, "engine-0")
    assert reclaim_dead_owners(probe).live_owners == ("engine-0",)
    first.close()  # its holds go, and the janitor's entry for them with them
    began = time.monotonic()
    second = open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="engine-0",
                        lease_ttl=20, janitor=False)
    try:
        assert time.monotonic() - began < 2  # not the 20 s the janitor's entry had left
        assert _holders_of(probe, "h1") == set() and pttl(probe, "h1") > 0
    finally:
        second.close()
        probe.close()


def test_holds_written_after_a_restart_without_persistence_stay_reclaimable(reliability):
    with RedisServer() as server:
        process = _owner_process(server.url, "restart", "engine-r")
        port = server.port
        server.kill()
        server.port = port
        server.start()  # empty: no persistence
        probe_client = server.client()
        # The owner's heartbeat finds its entry gone: registers, writes the metadata back,
        # and holds what it held.
        wait_for(lambda: probe_client.hexists("r3:restart:owners", "engine-r")
                 and probe_client.exists("r3:restart:meta")
                 and probe_client.hexists("r3:restart:r:{h1}", "engine-r"), 5,
                 "the owner to restore its state")
        probe = open_store(server.url, layout=None, namespace="restart", lease=False,
                           janitor=False)
        process.kill()
        process.wait()
        time.sleep(1.5)
        report = reclaim_dead_owners(probe)
        assert report.dead_owners == ("engine-r",) and report.holds_dropped == 2
        assert _holders_of(probe, "h1") == set()
        probe.close()
        reliability("Redis restarted without persistence under a live owner, which then "
                    "crashes", "2 held keys", "the owner re-registers, restores the "
                    "namespace metadata and its holds; after its crash they are reclaimed",
                    "metadata back within one heartbeat; 2 holds dropped by the janitor")


def test_holds_a_heartbeat_could_not_apply_again_are_applied_by_a_later_one(reliability):
    """Redis loses its data under a live owner, and the heartbeat that registers it again
    cannot apply its holds again (for a while its user may not touch reference counts):
    a later heartbeat applies them, though it finds the entry that one registered."""
    with RedisServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "engine", "on", ">engine-pw", "~r3:*", "+@all")
        store = open_store(f"redis://engine:engine-pw@127.0.0.1:{server.port}/0",
                           layout=LAYOUT, namespace="reapply", owner="engine-a", lease_ttl=0.6)
        try:
            store.put({"k": blk(1)}, ["k"])
            admin.execute_command("ACL", "SETUSER", "engine", "resetkeys", "~r3:namespaces",
                                  "~r3:reapply:meta", "~r3:reapply:owners", "~r3:reapply:b:*")
            admin.flushall()
            wait_for(lambda: admin.hexists("r3:reapply:owners", "engine-a"), 5,
                     "the owner to register again")
            time.sleep(0.5)  # heartbeats every 0.2 s, each refused the reference counts
            assert not admin.exists("r3:reapply:r:{k}") and store._lease.renewals == 0
            admin.execute_command("ACL", "SETUSER", "engine", "~r3:*")
            began = time.monotonic()
            wait_for(lambda: admin.hexists("r3:reapply:r:{k}", "engine-a"), 5,
                     "the holds to be applied again")
            assert store.refcount("k") == 1 and store._lease.renewals == 1
            reliability("Redis loses its data under a live owner, whose holds cannot be "
                        "applied again for 0.5 s (ACL)", "1 held block", "a later heartbeat "
                        "applies them; the renewal counts once they are back",
                        f"applied {time.monotonic() - began:.2f} s after access returned; "
                        "1/1 hold back")
        finally:
            admin.execute_command("ACL", "SETUSER", "engine", "~r3:*")
            store.close()


def test_holders_unknown_to_the_registry_are_reclaimed_after_a_grace_lease(
        redis_url, namespace, reliability):
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace, lease_ttl=1,
                       janitor=False)
    client = store.client_for(store.keys.refs("x"))
    client.hset(store.keys.refs("x"), "ghost", 1)  # a holder no registry entry knows
    client.set(store.keys.block("x"), b"placeholder")
    try:
        report = reclaim_dead_owners(store)
        assert report.unregistered_holders == ("ghost",) and report.holds_dropped == 0
        time.sleep(1.2)
        report = reclaim_dead_owners(store)
        assert "ghost" in report.dead_owners and report.holds_dropped == 1
        assert pttl(store, "x") > 0
        reliability("a hold by an owner the registry does not know (registry lost)",
                    "1 hold", "registered with one lease of grace, then reclaimed",
                    "dropped by the second janitor pass 1.2 s later")
    finally:
        store.close()


# -- 5. a reused request id replaces its manifest --------------------------------------


@pytest.mark.parametrize("backend", ["memory", "redis", "cluster"])
def test_a_reused_request_id_replaces_its_manifest_and_its_holds(request, backend, namespace,
                                                                 reliability):
    url = {"memory": lambda: "memory://", "redis": lambda: request.getfixturevalue("redis_url"),
           "cluster": lambda: request.getfixturevalue("cluster_url")}[backend]()
    store = open_store(url, layout=LAYOUT, namespace=namespace)
    try:
        store.put({"a": blk(1), "b": blk(2)})
        old = Manifest("same", LAYOUT.fingerprint, Completion(0, 5), [BlockRef("a", 0, 4)])
        new = Manifest("same", LAYOUT.fingerprint, Completion(0, 5), [BlockRef("b", 0, 4)])
        store.put({}, manifests=[old])
        store.put({}, manifests=[new])
        (got,) = store.get_manifests(["same"])
        assert got.block_keys == ["b"]
        assert store.release_manifests(["same"]) == 1
        if backend == "memory":
            assert store.refcount("a") == store.refcount("b") == 0
        else:
            assert "m:same" not in holders(store)
            assert pttl(store, "a") > 0 and pttl(store, "b") > 0
        reliability(f"a request id recorded twice ({backend})", "two manifests",
                    "the second replaces the first; release leaves no hold",
                    "0 manifest holds left after release")
    finally:
        store.close()


# -- 6. unreadable manifests do not stop the namespace ---------------------------------


def test_an_unreadable_expired_manifest_is_released_without_failing_any_open(
        redis_url, namespace, reliability):
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace, manifest_ttl=0.3)
    store.put({"a": blk(1)})
    for request_id in ("bad", "good"):
        store.put({}, manifests=[Manifest(request_id, LAYOUT.fingerprint, Completion(0, 5),
                                          [BlockRef("a", 0, 4)])])
    bad = store.keys.manifest("bad")
    store.client_for(bad).hset(bad, "segments", "not a segment list")
    time.sleep(0.5)
    try:
        engine = open_store(redis_url, layout=LAYOUT, namespace=namespace)  # janitor runs
        engine.close()
        assert holders(store) == {}
        unreadable = store.client_for(store.keys.unreadable).hkeys(store.keys.unreadable)
        assert unreadable == [b"bad"]
        out = subprocess.run([sys.executable, "-m", "r3cache.cli", "inspect", redis_url,
                              "--namespace", namespace], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "unreadable manifests 1" in out.stdout
        reliability("an expired manifest whose fields were damaged", "2 expired manifests",
                    "store opens; both released, the damaged one recorded as unreadable",
                    "0 holds left; inspect reports 1 unreadable manifest")
    finally:
        store.close()


def test_a_block_hash_that_cannot_be_a_key_is_refused_before_anything_changes(
        redis_url, namespace, reliability):
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    worker = WorkerConnector(layout=LAYOUT, store=store, writer="thread")
    # A digest of over 128 bytes would be a key of over 256 hex characters, which the
    # Redis writer refuses after the step (and then stops for good).
    bad_hashes = [[h] for h in ("has space", "brace{", "tilde~", "", b"", bytes(129), 1.5,
                                None, object())] + [PackedHashes(bytes(258), 129)]
    try:
        for bad in bad_hashes:
            with pytest.raises(InvalidBatchError):
                worker.begin_step(StepMetadata(0, {"r": 0}, {"r": bad}, ()))
            assert worker.num_requests == 0
        worker.store.flush()
        assert holders(store) == {}
        # The longest digest that still makes a key is taken, and its block written.
        worker.begin_step(StepMetadata(0, {"r": 0}, {"r": [bytes(128)]}, ()))
        rows = oracle_rows(np.arange(4), LAYOUT)
        pending = worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 4])),
                                        routed_experts=rows)
        pending.enqueue_cpu_copy([1], [0])
        worker.process_output(pending)
        np.testing.assert_array_equal(worker.store.get_concatenated(["00" * 128]), rows)
        reliability("block hashes a manifest could not list (spaces, braces, '~', empty, "
                    "over 128 bytes, float, None, an object)", f"{len(bad_hashes)} step metadata",
                    "InvalidBatchError before any registration or hold",
                    f"{len(bad_hashes)}/{len(bad_hashes)} refused; 0 requests, 0 holds")
    finally:
        worker.close()


# -- 7. readers and admins open under OOM -----------------------------------------------


def test_readers_inspect_and_gc_work_when_redis_is_full(reliability):
    with RedisServer("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as server:
        store = open_store(server.url, layout=WIDE, namespace="full")
        rows = np.concatenate([blk(i, WIDE) for i in range(2)])[:20]
        manifest = Manifest("req", WIDE.fingerprint, Completion(0, 21),
                            [BlockRef("p0", 0, 16), rows[16:20]])
        store.put({"p0": blk(0, WIDE)}, manifests=[manifest])
        with pytest.raises(StoreFullError):
            for at in range(0, 2000, 50):
                keys = [f"p{at + i + 1}" for i in range(50)]
                store.put({k: blk(i, WIDE) for i, k in enumerate(keys)}, retain_keys=keys)
        with R3Reader(server.url, namespace="full") as reader:
            assert reader.get("req").shape == (20, 48, 8)
            assert reader.release("req") == 1
        for command in ("inspect", "gc"):
            out = subprocess.run([sys.executable, "-m", "r3cache.cli", command, server.url,
                                  "--namespace", "full"], capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, out.stderr
        store.close()
        reliability("Redis full of pinned blocks (noeviction)", "a trainer and an admin",
                    "R3Reader opens, reads and releases; inspect and gc exit 0",
                    "read 20 rows, 1 manifest released")


# -- 8. the namespace metadata comes back after a restart without persistence ----------


def test_a_reader_names_the_cause_when_the_metadata_is_gone(redis_url, namespace,
                                                           reliability):
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    store.put({"a": blk(1)}, manifests=[Manifest("r", LAYOUT.fingerprint, Completion(0, 5),
                                                 [BlockRef("a", 0, 4)])])
    store.client_for(store.keys.meta).delete(store.keys.meta)
    try:
        with pytest.raises(ContractError, match="restarted without persistence"):
            R3Reader(redis_url, namespace=namespace)
        store._lease.beat()  # the next heartbeat writes it again
        with R3Reader(redis_url, namespace=namespace) as reader:
            assert reader.get("r").shape == (4, 3, 2)
            reader.release("r")
        reliability("namespace metadata deleted under a live writer", "1 manifest",
                    "the reader's error names the cause; the writer's next heartbeat "
                    "writes the metadata back", "read back 4 rows after one heartbeat")
    finally:
        store.close()


# -- 9 and 10. bounded waits, quick close ----------------------------------------------


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_prefix_hit_on_a_stalled_redis_fails_within_store_wait(writer, reliability):
    with RedisServer("--enable-debug-command", "yes") as server:
        store = open_store(server.url, layout=LAYOUT, namespace="stall")
        worker = WorkerConnector(layout=LAYOUT, store=store, writer=writer, store_wait=0.5)
        tiered = worker.store
        tiered.put({"k": blk(1)}, retain_keys=["k"])
        tiered.flush()
        tiered.clear_local()
        stall = threading.Thread(target=lambda: server.client().execute_command(
            "DEBUG", "SLEEP", "3"))
        stall.start()
        time.sleep(0.1)
        began = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            tiered.get_concatenated(["k"])
        waited = time.monotonic() - began
        assert waited < 1.0
        stall.join()
        worker.close()
        reliability(f"Redis sleeps 3 s (DEBUG SLEEP) during a prefix hit ({writer} writer)",
                    "store_wait=0.5", "StoreUnavailableError within store_wait",
                    f"raised after {waited:.2f} s")


def test_closing_a_worker_does_not_wait_for_the_helper_process(redis_url, namespace,
                                                              reliability):
    times = []
    for _ in range(3):
        store = open_store(redis_url, layout=LAYOUT, namespace=namespace)
        worker = WorkerConnector(layout=LAYOUT, store=store, writer="process")
        helper = worker.store.remote._process
        worker.store.put({"k": blk(1)}, retain_keys=["k"])
        began = time.monotonic()
        worker.close()
        times.append(time.monotonic() - began)
        assert helper.poll() is not None
    # It took 0.3-1.3 s waiting on the helper's teardown; 17-20 ms on a quiet machine
    # now, and under 0.2 s with both cores busy with other work.
    assert min(times) < 0.2
    reliability("WorkerConnector.close() with the helper-process writer", "one held block",
                "holds dropped, helper gone", f"close took {min(times) * 1000:.0f}-"
                f"{max(times) * 1000:.0f} ms over 3 runs")


# -- 11 and 12. the command line -------------------------------------------------------


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "r3cache.cli", *args], capture_output=True,
                          text=True, timeout=60, **kwargs)


def test_export_keeps_every_file_inside_out(redis_url, namespace, tmp_path, reliability):
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    ids = ["../escaped", str(tmp_path / "absolute"), "sub/dir", "plain"]
    store.put({"a": blk(1)}, manifests=[
        Manifest(r, LAYOUT.fingerprint, Completion(0, 5), [BlockRef("a", 0, 4)]) for r in ids])
    store.close()
    out = tmp_path / "out"
    result = _cli("export", redis_url, "--namespace", namespace, "--out", str(out))
    assert result.returncode == 0, result.stderr
    import json

    index = json.loads((out / "index.json").read_text())
    assert sorted(e["request_id"] for e in index["requests"]) == sorted(ids)
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 5 and all((out / e["file"]).exists() for e in index["requests"])
    assert not (tmp_path / "escaped.npy").exists() and not (tmp_path / "absolute.npy").exists()
    reliability("request ids that are paths ('../escaped', an absolute path, 'sub/dir')",
                "r3cache export of 4 requests", "every file inside --out, ids in index.json",
                "4 files + index.json in --out, none outside")


@pytest.mark.parametrize("args", [
    ["inspect", "redis://127.0.0.1:6379/0?idle_ttl=abc"],
    ["inspect", "redis://127.0.0.1:6379/0?retries=x"],
    ["inspect", "redis://127.0.0.1:6379/0?idle_ttl=nan"],
    ["inspect", "redis://127.0.0.1:6379/0?owner="],
    ["inspect", "redis://127.0.0.1:6379/0?password=cret-pw&password=cret-pw"],
    ["inspect", "redis://127.0.0.1:port/0"],
    ["gc", "redis+cluster://127.0.0.1:7000,127.0.0.1:port"],
    ["inspect", "mongodb://127.0.0.1:6379"],
    ["gc", "ftp://127.0.0.1"],
    ["inspect", "redis://127.0.0.1:6379/0?ssl_ca_certs=/tmp/ca.pem"],
    ["get", "REDIS", "r", "--namespace", "NS", "--out", "x.npy", "--dtype", "int65"],
    ["get", "REDIS", "r", "--namespace", "NS", "--out", "/proc/nope/x.npy"],
    ["export", "REDIS", "--namespace", "NS", "--out", "/proc/nope"],
    ["export", "REDIS", "--namespace", "NS", "--out", "OUT", "--batch", "0"],
    ["export", "REDIS", "--namespace", "NS", "--out", "OUT", "--batch", "-1"],
    ["inspect", "redis://user:se#cret-pw@127.0.0.1:6379/0"],
    ["inspect", "redis://user:cret-pw@[::1:6379/0"],  # urlsplit: "Invalid IPv6 URL"
    ["inspect", "redis://:a[cret-pw]@127.0.0.1:6379/0"],  # urlsplit quotes 'cret-pw'
    ["gc", "redis+cluster://127.0.0.1:7000,[zz]:7001"],
    ["inspect", "redis://127.0.0.1:6379/0?janitor=flase"],
    ["inspect", "REDIS?socket_timeout=1e300"],  # an OverflowError in the socket's deadline
    ["gc", "REDIS?socket_connect_timeout=1e17"],
    ["export", "REDIS", "--namespace", "NS", "--out", "OUT", "--dtype", "bool"],
    ["plot", "REDIS", "--namespace", "NS", "--out", "OUT.txt"],  # no format matplotlib has
    ["demo", "--prompts", "-1"],
    ["demo", "--spec-tokens", "-1"],
    ["demo", "--seed", "-5"],
])
def test_bad_command_lines_get_one_line_and_exit_2(redis_url, namespace, tmp_path, args,
                                                  reliability):
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    store.put({"a": blk(1)}, manifests=[Manifest("r", LAYOUT.fingerprint, Completion(0, 5),
                                                 [BlockRef("a", 0, 4)])])
    store.close()
    args = [a.replace("REDIS", redis_url).replace("NS", namespace)
            .replace("OUT", str(tmp_path / "out")) for a in args]
    result = _cli(*args, cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "unexpected" not in result.stderr  # refused by a check, not caught as it fell
    assert "se#cret" not in result.stderr and "se" + "#" not in result.stderr
    assert "cret-pw" not in result.stderr
    shown = (" ".join(args).replace(redis_url, "URL").replace(namespace, "NS")
             .replace(str(tmp_path / "out"), "OUT"))
    reliability(f"command line `r3cache {shown.replace('se#cret-pw', 'PASSWORD#')}`",
                "one run", "exit 2, one line, no traceback, no secret",
                result.stderr.strip().replace("|", "/")[:140])


# -- 13. values refused at the boundary -------------------------------------------------


def test_store_options_and_names_are_checked(redis_url, reliability):
    # A socket timeout of inf or NaN, or a pool of no connection, would make a wait on Redis
    # unbounded or every call fail; a float count would be truncated.
    for options in ({"idle_ttl": 0}, {"idle_ttl": -1}, {"lease_ttl": float("nan")},
                    {"manifest_ttl": float("inf")}, {"socket_timeout": float("inf")},
                    {"socket_timeout": -1}, {"socket_connect_timeout": float("nan")},
                    {"pool_size": 0}, {"retries": 2.5}, {"wait_replicas": 1.5}):
        with pytest.raises(ContractError):
            open_store(redis_url, layout=LAYOUT, namespace="test-opts", **options)
    with pytest.raises(ContractError):
        open_store(f"{redis_url}?socket_timeout=inf", layout=LAYOUT, namespace="test-opts")
    with pytest.raises(ContractError):
        open_store(redis_url, layout=LAYOUT, namespace="test-name\n")
    with pytest.raises(LayoutError):
        RoutingLayout(num_layers=2, topk=2, num_experts=2**40)
    reliability("idle_ttl 0 or -1, lease_ttl NaN, manifest_ttl inf, socket_timeout inf (as "
                "an option and in the URL) or -1, socket_connect_timeout NaN, pool_size 0, "
                "retries 2.5, wait_replicas 1.5, a namespace with a trailing newline, "
                "num_experts 2**40", "open_store, RoutingLayout",
                "typed errors before anything is written", "14/14 refused")


def test_connector_sizes_and_waits_are_checked_before_any_writer_starts(redis_url, namespace,
                                                                          reliability):
    """store_wait=inf or NaN would make every wait unbounded, max_num_seqs=0 the writer's
    queue unbounded (queue.Queue(0)), a float size a TypeError in the middle of setup."""
    bad = ({"store_wait": float("inf")}, {"store_wait": float("nan")}, {"store_wait": -1},
           {"max_num_seqs": 0}, {"max_num_seqs": 2.5}, {"max_num_batched_tokens": 0},
           {"max_concurrent_batches": 1.5}, {"local_tier_bytes": -1},
           {"on_unavailable": "ignore"})
    threads = threading.active_count()
    for url in ("memory://", redis_url):
        store = open_store(url, layout=LAYOUT, namespace=namespace)
        try:
            for kwargs in bad:
                with pytest.raises(ContractError):
                    WorkerConnector(layout=LAYOUT, store=store, **kwargs)
            for kwargs in (*bad[:3], bad[-1], {"max_pending": 0}):
                with pytest.raises(ContractError):
                    RequestPublisher(layout=LAYOUT, store=store, **kwargs)
            for make in (WorkerConnector, RequestPublisher):
                with pytest.raises(ContractError, match="store must be a BlockStore"):
                    make(layout=LAYOUT, store="memory://")
                with pytest.raises(ContractError, match="layout must be a RoutingLayout"):
                    make(layout=LAYOUT.fingerprint, store=store)
            with pytest.raises(ContractError, match="capturer must be"):
                WorkerConnector(layout=LAYOUT, store=store, capturer=object())
            if url != "memory://":  # a tier beyond the machine's memory (its arena is mapped)
                with pytest.raises(ContractError, match="exceeds this machine's memory"):
                    WorkerConnector(layout=LAYOUT, store=store, local_tier_bytes=10**13)
        finally:
            store.close()
    assert threading.active_count() == threads  # no writer was started
    with pytest.raises(ContractError):
        open_store(5, layout=LAYOUT, namespace=namespace)
    with pytest.raises(ContractError):
        open_store("memory://?max_bytes=inf", layout=LAYOUT, namespace=namespace)
    reliability("store_wait inf, NaN or -1, max_num_seqs 0 or 2.5, max_num_batched_tokens "
                "0, max_concurrent_batches 1.5, local_tier_bytes -1 or 1e13, on_unavailable "
                "'ignore', max_pending 0, a URL as the store; open_store(5), max_bytes=inf",
                "WorkerConnector and RequestPublisher on memory:// and Redis, open_store",
                "ContractError before any writer starts", "no thread left running")


def test_the_scheduler_refuses_what_the_worker_would_before_counting_it_sent(reliability):
    """A bad hash taken by the scheduler would be counted as sent in a step the worker
    then refuses: lost for every later step. A str is one hash, not a list of characters."""
    scheduler = SchedulerConnector()
    scheduler.add_request("r", block_hashes=[b"\x01" * 32])
    for call in (lambda: scheduler.add_request(""),
                 lambda: scheduler.add_request("p", prompt_start=1.5),
                 lambda: scheduler.add_request("h", block_hashes=[None]),
                 lambda: scheduler.add_request("s", block_hashes="abc"),
                 lambda: scheduler.update_block_hashes("r", [b"\x01" * 32, b""]),
                 lambda: scheduler.update_block_hashes("r", "ab"),
                 lambda: scheduler.finish_request("r", num_tokens=5.5),
                 lambda: scheduler.record_output("r", None)):
        with pytest.raises(ContractError):
            call()
    metadata = scheduler.build_step_metadata()
    assert metadata.requests == {"r": 0} and metadata.block_hashes == {"r": [b"\x01" * 32]}
    reliability("an empty request id, a float prompt_start or num_tokens, a None or empty "
                "block hash, a str as the hash list, record_output(None)",
                "SchedulerConnector", "ContractError before its state changes",
                "8/8 refused; the next step's metadata holds only the good request")


def test_invalid_rows_and_positions_are_refused_before_any_effect(reliability):
    store = open_store("memory://", layout=LAYOUT, namespace="rows")
    worker = WorkerConnector(layout=LAYOUT, store=store)
    good = oracle_rows(list(range(10)), LAYOUT)[:5]
    try:
        worker.begin_step(StepMetadata(0, {"r": 0}, {}, ()))
        for rows in (np.where(good == good[0, 0, 0], 16, good).astype(np.uint8),  # >= E
                     np.repeat(good[..., :1], 2, axis=-1)):  # one expert twice in a row
            pending = worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 5])),
                                            routed_experts=rows)
            pending.enqueue_cpu_copy([1], [0])
            with pytest.raises(InvalidBatchError, match="expert"):
                worker.process_output(pending)
        assert store.stats().blocks == 0
        with pytest.raises(InvalidBatchError, match="integers"):
            worker.prepare_output(StepBatch(["r"], np.array([0.5]), np.array([0, 5])),
                                  routed_experts=good)
        with pytest.raises(InvalidBatchError, match="not a str"):
            worker.prepare_output(StepBatch("r", np.array([0]), np.array([0, 5])),
                                  routed_experts=good)
        with pytest.raises(ContractError):
            worker.begin_step(StepMetadata(0, {"bad\ud800": 0}, {}, ()))
        with pytest.raises(InvalidBatchError, match="'new': the emit start must be >= 0"):
            worker.begin_step(StepMetadata(0, {"new": -3}, {}, ()))
        with pytest.raises(MetadataError, match="finished twice"):  # its slot freed twice
            worker.begin_step(StepMetadata(0, {}, {}, ("r", "r")))
        # A str or bytes of hashes would be keyed per character: keys other blocks share.
        for hashes in ("abcd", b"\x01" * 64, 5):
            with pytest.raises(InvalidBatchError, match="block hashes"):
                worker.begin_step(StepMetadata(0, {}, {"r": hashes}, ()))
        with pytest.raises(MetadataError, match="not a str"):
            worker.begin_step(StepMetadata(0, {}, {}, "r"))
        for fields in ({"finished_requests": None}, {"preempted": 5}):  # were TypeErrors
            with pytest.raises(MetadataError, match="collection of request ids"):
                worker.begin_step(StepMetadata(0, {}, {}, **fields))
        with pytest.raises(GenerationError):  # 0.5 > 0 would have reset the prefix cache
            worker.begin_step(StepMetadata(0.5, {}, {}, ()))
        for fields in ((["r"], {}), ({}, [("r", [b"\x01" * 32])])):
            with pytest.raises(MetadataError, match="maps request ids"):
                worker.begin_step(StepMetadata(0, *fields, ()))
        assert worker.num_requests == 1
        # The request is untouched: its rows still start at 0.
        pending = worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 5])),
                                        routed_experts=good)
        pending.enqueue_cpu_copy([1], [0])
        np.testing.assert_array_equal(worker.process_output(pending)["r"].rows, good)
        reliability("expert ID >= num_experts, an expert twice in a row, float positions, "
                    "a request id with a lone surrogate, a negative emit start, a request "
                    "finished twice in one step, a str, bytes or int as a request's block "
                    "hashes, a str as finished_requests or req_ids, None or an int "
                    "where request ids go, generation 0.5, "
                    "lists where the metadata maps request ids", "one request",
                    "InvalidBatchError / ContractError before any state or store change",
                    "0 blocks stored; the request then runs from position 0")
    finally:
        worker.close()


def test_reader_arguments_are_checked_before_reading(redis_url, namespace, reliability):
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    store.put({"a": blk(1)}, manifests=[Manifest("r", LAYOUT.fingerprint, Completion(0, 5),
                                                 [BlockRef("a", 0, 4)])])
    try:
        with R3Reader(redis_url, namespace=namespace) as reader:
            for kwargs in ({"layers": [99]}, {"layers": ["x"]}, {"dtype": "foo"},
                           {"dtype": "float32"}, {"layers": [True, False, True, True]}):
                with pytest.raises(ContractError):
                    reader.get("r", **kwargs)
            for bad in (None, 3, "", "bad\ud800"):
                with pytest.raises(ContractError):
                    reader.get(bad)
            for kwargs in ({"layers": slice("a", None)}, {"layers": slice(None, None, 0)},
                           {"wait": float("inf")}, {"wait": -1}):
                with pytest.raises(ContractError):
                    reader.get("r", **kwargs)
            for kwargs in ({"dtype": np.int32}, {"dtype": "int32"}, {"device": "nowhere"}):
                with pytest.raises(ContractError):
                    reader.get_torch("r", **kwargs)
            # Token ids no engine hashes would give another chain's routes, or none.
            for tokens, kwargs in (([1.0, 2.0, 3.0, 4.0], {}), ([-1, 2, 3, 4], {}),
                                   (np.full(4, 2**63, np.uint64), {}), ("abcd", {}),
                                   ([1, 2, 3, 4], {"seed": 0}),
                                   ([1, 2, 3, 4], {"extra_keys_per_block": 5})):
                with pytest.raises(ContractError):
                    reader.get_by_tokens(tokens, **kwargs)
            assert reader.get("r", layers=[-1], dtype="int64").shape == (4, 1, 2)
            assert reader.get("r", layers=slice(None, None, -1)).shape == (4, *LAYOUT.row_shape)
        with pytest.raises(ContractError):
            R3Reader(123)
        reliability("R3Reader calls with layers=[99], a mask of bools or slice('a'), "
                    "dtype='foo', wait=inf, a numpy dtype for torch, None or a surrogate "
                    "id, float, negative or uint64 token ids, an int seed; R3Reader(123)",
                    "one recorded request", "ContractError before anything is read",
                    "23/23 refused")
    finally:
        store.close()


def test_a_request_id_that_cannot_be_encoded_takes_no_hold(redis_url, namespace):
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    worker = WorkerConnector(layout=LAYOUT, store=store, writer="thread")
    try:
        with pytest.raises(ContractError):
            worker.begin_step(StepMetadata(0, {"x\udcff": 0}, {"x\udcff": [b"h"]}, ()))
        assert worker.num_requests == 0
        worker.store.flush()
        assert holders(store) == {}
    finally:
        worker.close()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_manifest_no_reader_could_use_is_refused_before_either_tier_changes(
        redis_url, namespace, writer, reliability):
    """A manifest naming more rows than its completion: refused on the caller's thread
    (not later in the writer), with no pin taken in the local tier and nothing sent."""
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    worker = WorkerConnector(layout=LAYOUT, store=store, writer=writer)
    tier = worker.store
    bad = Manifest("r", LAYOUT.fingerprint, Completion(0, 3), [BlockRef("k", 0, 4)])
    try:
        with pytest.raises(ContractError, match="segments hold 4 rows, the request has 2"):
            tier.put({"k": blk(1)}, ["k"], [], [bad])
        tier.flush()
        assert tier.local.refcount("k") == 0
        check = open_store(redis_url, layout=LAYOUT, namespace=namespace, lease=False)
        assert check.get_manifests(["r"]) == [None] and check.stats().blocks == 0
        check.close()
        reliability(f"a manifest whose segments do not cover its completion ({writer} writer)",
                    "one put", "ContractError on the caller's thread",
                    "0 local pins, 0 blocks and 0 manifests in Redis")
    finally:
        worker.close()


@pytest.mark.parametrize("backend", ["redis_url", "cluster_url"])
def test_keys_and_arguments_redis_cannot_take_are_refused_before_anything_is_sent(
        request, backend, namespace, reliability):
    """Keys that cannot name a block (not str, empty, too long, a space, brace, "~" or a
    character outside printable ASCII), a str where keys go, objects that are not a
    mapping, ids that are not str: a ContractError, no hold taken, and the store closes
    cleanly afterwards."""
    store = open_store(request.getfixturevalue(backend), layout=LAYOUT, namespace=namespace)
    block = blk(1)
    puts = [({1: block}, (), ()), ({b"k": block}, (), ()), ({"": block}, (), ()),
            ({"a b": block}, (), ()), ({"a{b}": block}, (), ()), ({"a~b": block}, (), ()),
            ({"k" * 257: block}, (), ()), ({"k\ud800": block}, (), ()), ({"é": block}, (), ()),
            ({"ok": block}, ["ok", 7], ()), ({"ok": block}, (), [None]),
            ({"ok": block}, "ok", ()), ([("ok", block)], (), ())]
    try:
        for objects, retain, release in puts:
            with pytest.raises(ContractError):
                store.put(objects, retain, release)
        for read in (lambda: store.get_concatenated([3]), lambda: store.get_manifests([3]),
                     lambda: store.release_manifests([None])):
            with pytest.raises(ContractError):
                read()
        assert store.stats().blocks == 0 and store.stats().referenced_keys == 0
        store.put({"ok": block}, ["ok"])  # the store works on
        assert store.refcount("ok") == 1
        reliability(f"keys Redis cannot take and arguments of the wrong kind ({backend[:-4]})",
                    f"{len(puts)} puts, 3 reads", "ContractError before anything is sent",
                    f"{len(puts) + 3}/{len(puts) + 3} refused; 0 blocks, 0 holds; close clean")
    finally:
        store.close()
