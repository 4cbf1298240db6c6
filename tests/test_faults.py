"""Faults on real servers: restarts with AOF, memory pressure."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis

from r3cache import R3Reader, RoutingLayout, open_store
from r3cache.errors import R3Error, StoreFullError
from r3cache.sim import SimConfig, grpo_workload, simulate
from r3cache.testing import RedisServer

LAYOUT = RoutingLayout(num_layers=8, topk=2, num_experts=32, block_size=16)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_restart_with_aof_loses_nothing_and_the_run_completes(tmp_path, sig, reliability):
    server = RedisServer("--appendonly", "yes", "--appendfsync", "everysec",
                         directory=tmp_path).start()
    port = server.port
    workload = grpo_workload(num_prompts=4, samples=4, system_len=32, prompt_len=(16, 80),
                             output_len=(16, 120), vocab=5000, seed=1)
    restarted = threading.Event()

    def restart():
        time.sleep(0.4)
        if sig == signal.SIGKILL:
            # Acknowledged writes are on disk once fsynced: force it, then crash.
            server.client().execute_command("BGREWRITEAOF")
            time.sleep(0.3)
        server.kill(sig)
        time.sleep(0.2)
        server.port = port
        server.process = None
        server.start()
        restarted.set()

    threading.Thread(target=restart, daemon=True).start()
    config = SimConfig(max_num_seqs=8, max_num_batched_tokens=128, num_spec_tokens=2,
                       keep_manifests=True, seed=1)
    report = simulate(workload, LAYOUT, config, store_url=server.url, namespace="restart",
                      retries=8)
    assert restarted.wait(10)
    assert report.failures == []
    assert report.manifests_verified == len(workload)
    client = server.client()
    assert [o for k in client.scan_iter(match="r3:restart:r:*") for o in client.hkeys(k)
            if not o.startswith(b"m:")] == []
    with R3Reader(server.url, namespace="restart") as reader:
        for request_id, rows in zip(sorted(report.online),
                                    reader.get_many(sorted(report.online))):
            assert rows.tobytes() == report.online[request_id].tobytes()
    reliability(f"standalone Redis (AOF everysec) stopped with {signal.Signals(sig).name}"
                + (" after an AOF rewrite" if sig == signal.SIGKILL else "")
                + ", restarted 0.2 s later", "simulator, 16 requests, spec decode",
                "run completes; every manifest reads back byte-identical",
                f"{report.manifests_verified}/{len(workload)} requests identical, "
                f"{report.rows_verified} rows, 0 bytes lost")
    server.stop()


def test_memory_pressure_evicts_only_idle_blocks_and_refuses_when_pinned(tmp_path, reliability):
    with RedisServer("--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru") as server:
        layout = RoutingLayout(48, 8, 128, 16)  # 6 KiB blocks
        store = open_store(server.url, layout=layout, namespace="pressure", idle_ttl=600)
        block = np.random.default_rng(0).integers(0, 128, layout.block_shape).astype(np.uint8)
        pinned = [f"p{i}" for i in range(200)]
        store.put({k: block for k in pinned}, retain_keys=pinned)
        idle = [f"i{i}" for i in range(1000)]
        for at in range(0, len(idle), 100):  # more idle blocks than fit: eviction
            store.put({k: block for k in idle[at : at + 100]})
        client = redis.Redis(port=server.port)
        assert client.info("stats")["evicted_keys"] > 0
        np.testing.assert_array_equal(store.get_concatenated(pinned)[:16], block)
        evicted = client.info("stats")["evicted_keys"]
        with pytest.raises(StoreFullError):
            for round_ in range(100):  # pinned blocks only: nothing may be evicted
                keys = [f"x{round_}-{i}" for i in range(100)]
                store.put({k: block for k in keys}, retain_keys=keys)
        for key in client.scan_iter(match="r3:pressure:b:*"):
            value = client.get(key)
            assert value is None or len(value) > 6000  # no half-written block
        assert all(store.refcount(k) == 1 for k in pinned[:20])
        reliability("maxmemory 4 MB, volatile-lru; then pinned writes only",
                    "200 pinned + 1000 idle 6 KiB blocks",
                    "only idle blocks evicted; a full store refuses with StoreFullError; no "
                    "half-written value", f"{evicted} idle blocks evicted, 200/200 pinned "
                    f"intact, refused after {round_} pinned batches")
        store.close()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_redis_full_of_unread_manifests_takes_writes_again_once_a_trainer_reads_them(
        writer, caplog, reliability):
    """Trainers fall behind: manifests they have not read fill maxmemory, and Redis
    refuses the engine's next batch. The engine goes on (its calls refused, typed, once
    the writer is behind), and once the trainer releases what it read, the writer writes
    the refused batch and the engine's carried calls: every request from the refused one
    on reads back identical."""
    import hashlib

    from r3cache import StepBatch, StepMetadata, WorkerConnector
    from r3cache.errors import StoreUnavailableError
    from r3cache.sim import oracle_rows
    from tests.conftest import wait_for

    layout = RoutingLayout(48, 8, 128, 16)  # 6 KiB blocks
    bs, blocks = layout.block_size, 8
    oracle = oracle_rows(list(range(blocks * bs)), layout)
    refused = []

    def request(worker, n: int) -> None:
        """Request n: 8 new whole blocks in one step, then it finishes with a manifest."""
        r = f"r{n}"
        hashes = {r: [hashlib.sha256(f"{n}/{b}".encode()).digest() for b in range(blocks)]}
        for call in (lambda: worker.begin_step(StepMetadata(0, {r: 0}, hashes, ())),
                     lambda: worker.prepare_output(StepBatch(
                         [r], np.array([0]), np.array([0, blocks * bs])), oracle),
                     lambda: worker.begin_step(StepMetadata(0, {}, {}, [r],
                                                            {r: (0, blocks * bs + 1)}))):
            try:
                pending = call()
                if pending is not None:
                    pending.enqueue_cpu_copy([1], [0])
                    pending.process_output()
            except StoreUnavailableError:
                refused.append(n)

    # Room for the batches a writer holds when it first meets the full Redis, once the
    # trainer has released what it read (the helper's ring holds 64 MiB).
    with RedisServer("--maxmemory", "32mb", "--maxmemory-policy", "volatile-lru") as server:
        store = open_store(server.url, layout=layout, namespace=f"full-{writer}")
        worker = WorkerConnector(layout=layout, store=store, writer=writer, max_num_seqs=2,
                                 store_wait=0.5)
        n = 0
        with caplog.at_level("WARNING", logger="r3cache.store"):
            while "refused a batch" not in caplog.text and not refused:
                request(worker, n)
                n += 1
        first = n - 1  # its batch (or a later one, written before it) was refused
        assert server.client().info("errorstats")["errorstat_OOM"]["count"] > 0
        with R3Reader(server.url, namespace=f"full-{writer}") as trainer:
            read = trainer.release(*(f"r{j}" for j in range(first)))
            for j in range(n, n + 10):
                request(worker, j)

            def carried() -> bool:
                """A step with nothing to run, as an engine's next: it carries the calls
                that were refused; then whether the writer has written everything."""
                try:
                    worker.begin_step(StepMetadata(0, {}, {}, ()))
                    worker.store.flush()
                except StoreUnavailableError:
                    return False
                return True

            wait_for(carried, 15, "the writer to write the refused batches")
            ids = [f"r{j}" for j in range(first, n + 10)]
            for rows in trainer.get_many(ids):
                np.testing.assert_array_equal(rows, oracle)
        worker.close()
    reliability(f"maxmemory 32 MB filled by unread manifests, {writer} writer; the trainer "
                "then reads and releases them", f"requests of {blocks} blocks",
                "Redis refuses (StoreFullError) and the writer writes again once memory "
                "frees; every later request reads back identical",
                f"refused at request {first}; {read} manifests released; {len(ids)}/"
                f"{len(ids)} later requests identical; {len(refused)} engine call(s) "
                "refused")


def test_publication_survives_a_primary_killed_mid_run(reliability):
    from r3cache.testing import RedisClusterProcesses

    with RedisClusterProcesses() as cluster:
        workload = grpo_workload(num_prompts=8, samples=4, system_len=32, prompt_len=(16, 80),
                                 output_len=(100, 400), vocab=5000, seed=2)
        victim = cluster.primaries()[0]
        replica = next(n for n in cluster.nodes
                       if n.client().info("replication").get("master_port") == victim.port)
        killed: dict = {}

        def kill():
            time.sleep(0.15)
            killed["at"] = time.monotonic()
            victim.kill(signal.SIGKILL)
            # Once its replica is promoted, the old primary comes back (as a restart
            # policy would) and rejoins as the new primary's replica.
            while replica.client().info("replication")["role"] != "master":
                time.sleep(0.05)
            killed["promoted"] = time.monotonic()
            victim.start()

        threading.Thread(target=kill, daemon=True).start()
        config = SimConfig(max_num_seqs=4, max_num_batched_tokens=64, num_spec_tokens=2,
                           keep_manifests=True, seed=2)
        report = simulate(workload, RoutingLayout(48, 8, 128, 16), config,
                          store_url=cluster.url, namespace="failover",
                          wait_replicas=1)
        assert "at" in killed  # killed while the engine was running
        assert report.failures == []
        assert report.manifests_verified == len(workload)
        slowest = max(report.step_seconds)
        print(f"failover took {killed['promoted'] - killed['at']:.2f} s; publication "
              f"stalled at most {slowest:.2f} s; {report.store_stats.unreplicated} block(s) "
              "written while unreplicated")
        with R3Reader(cluster.url, namespace="failover") as reader:
            ids = sorted(report.online)
            for request_id, rows in zip(ids, reader.get_many(ids)):
                assert rows.tobytes() == report.online[request_id].tobytes()
        reliability("6-node cluster: a primary SIGKILLed mid-run, restarted after the "
                    "failover", "simulator, 32 requests, wait_replicas=1",
                    "publication continues without a restart; every manifest byte-identical",
                    f"failover {killed['promoted'] - killed['at']:.1f} s, publication "
                    f"stalled {slowest:.1f} s, {len(ids)}/{len(ids)} identical, "
                    f"{report.store_stats.unreplicated} unreplicated block(s), 0 lost")


def test_an_engine_starting_while_a_primary_fails_over_waits_for_the_replica(reliability):
    """The engine's store opens, then the primary serving its owner entry dies before the
    helper process takes over: the engine starts once the replica is promoted (within
    store_wait), not with an error from unregistering the store it hands over."""
    from r3cache import WorkerConnector
    from r3cache.testing import RedisClusterProcesses

    with RedisClusterProcesses() as cluster:
        store = open_store(cluster.url, layout=LAYOUT, namespace="starting")
        owners = store.keys.owners
        victim = next(n for n in cluster.primaries()
                      if n.port == store.client_for(owners).get_connection_kwargs()["port"])
        victim.kill(signal.SIGKILL)
        began = time.monotonic()
        worker = WorkerConnector(layout=LAYOUT, store=store, store_wait=20)
        started = time.monotonic() - began
        rows = np.zeros(LAYOUT.block_shape, LAYOUT.dtype)
        rows[..., 1] = 1
        worker.store.put({"ab" * 32: rows}, ["ab" * 32])
        worker.store.flush()
        reader = open_store(cluster.url, layout=LAYOUT, namespace="starting", lease=False)
        assert reader.get_concatenated(["ab" * 32]).tobytes() == rows.tobytes()
        reader.close()
        worker.close()
    reliability("6-node cluster: the primary of the engine's owner entry SIGKILLed as the "
                "engine starts", "one engine start (helper writer), one block",
                "the engine starts once the replica is promoted; the block is stored",
                f"started after {started:.1f} s; block read back exact")


class _Reshard(threading.Thread):
    """Own a run of ``redis-cli --cluster reshard``: ``slots`` slots moved between the
    cluster's primaries for each (source, target) in ``moves``, one after another."""

    def __init__(self, cluster, moves: list[tuple[int, int]], slots: int) -> None:
        super().__init__(daemon=True)
        self.cluster, self.moves, self.slots = cluster, moves, slots
        self.moved_at: list[float] = []  # when each reshard ended
        self.failed: str | None = None

    def run(self) -> None:
        primaries = self.cluster.primaries()
        ids = [n.client().execute_command("CLUSTER", "MYID").decode() for n in primaries]
        entry = f"127.0.0.1:{primaries[0].port}"
        for source, target in self.moves:
            for _ in range(5):  # redis-cli refuses to start while the nodes' views differ
                self.cluster.wait_ok()
                done = subprocess.run(
                    ["redis-cli", "--cluster", "reshard", entry, "--cluster-from", ids[source],
                     "--cluster-to", ids[target], "--cluster-slots", str(self.slots),
                     "--cluster-yes", "--cluster-pipeline", "1"],
                    capture_output=True, text=True, timeout=300)
                if not done.returncode:
                    self.moved_at.append(time.monotonic())
                    break
                time.sleep(1)
            else:
                self.failed = done.stdout[-300:]
                return


def test_a_reshard_mid_run_leaves_every_hold_as_the_owner_asked(reliability):
    """Slots move between primaries (redis-cli --cluster reshard) while an owner stores
    blocks, pins each twice and releases it over two later puts. A migrating slot refuses
    its new keys until it has moved, so rounds are retried, and a group is retried whole
    though part of it ran: every put must still go through, and every hold count end as
    the owner asked, not once more (pinned for good) or once less (evictable while held).
    """
    import hashlib

    from r3cache.testing import RedisClusterProcesses

    def key(name: str) -> str:
        return hashlib.sha256(name.encode()).hexdigest()

    rows = np.zeros(LAYOUT.block_shape, LAYOUT.dtype)
    rows[..., 1] = 1
    with RedisClusterProcesses() as cluster:
        store = open_store(cluster.url, layout=LAYOUT, namespace="reshard", owner="engine")
        # Idle blocks in every slot: each slot's migration takes a while.
        store.put({key(f"idle-{i}"): rows for i in range(4000)})
        mover = _Reshard(cluster, [(0, 1), (1, 2)], 1000)
        mover.start()
        expected: dict[str, int] = {}
        windows: list[list[str]] = []
        while mover.is_alive() or len(windows) < 3:
            new = [key(f"held-{len(windows)}-{j}") for j in range(50)]
            released = [k for window in windows[-2:] for k in window]
            store.put(dict.fromkeys(new, rows), new + new, released)
            for k in new:
                expected[k] = 2
            for k in released:
                expected[k] -= 1
            windows.append(new)
        mover.join()
        assert mover.failed is None  # the slots did move
        wrong = {k: (store.refcount(k), n) for k, n in expected.items()
                 if store.refcount(k) != n}
        assert wrong == {}, f"{len(wrong)} of {len(expected)} hold counts wrong"
        store.close()
        assert all(not o.startswith(b"engine") for n in cluster.primaries()
                   for k in n.client().scan_iter(match="r3:reshard:r:*")
                   for o in n.client().hkeys(k))
    reliability("6-node cluster resharded mid-run (redis-cli --cluster reshard, 2000 slots)",
                f"{len(windows)} puts of 50 blocks, each pinned twice and released over "
                "two later puts", "every put goes through; every hold count as asked",
                f"{len(expected)}/{len(expected)} hold counts exact, 0 puts refused, "
                "no hold left after close")


def test_an_engine_runs_through_reshards_and_every_manifest_reads_back(reliability):
    """A simulated engine (helper-process writer, prefix sharing, speculative decoding)
    runs while 2000 slots move in two reshards: no step fails, and every request's
    manifest reads back byte-identical to what the engine served."""
    from r3cache.testing import RedisClusterProcesses

    workload = grpo_workload(num_prompts=8, samples=4, system_len=64, prompt_len=(16, 200),
                             output_len=(100, 400), vocab=5000, seed=5)
    config = SimConfig(max_num_seqs=8, max_num_batched_tokens=128, num_spec_tokens=2,
                       keep_manifests=True, seed=5, forward_seconds=0.004)
    with RedisClusterProcesses() as cluster:
        mover = _Reshard(cluster, [(0, 1), (1, 2)], 1000)
        mover.start()
        report = simulate(workload, RoutingLayout(48, 8, 128, 16), config,
                          store_url=cluster.url, namespace="engine-reshard")
        ended = time.monotonic()
        mover.join()
        assert mover.failed is None
        during = sum(at < ended for at in mover.moved_at)
        assert during >= 1  # slots moved while the engine ran
        assert report.failures == []
        assert report.manifests_verified == len(workload)
        with R3Reader(cluster.url, namespace="engine-reshard") as reader:
            ids = sorted(report.online)
            same = sum(rows.tobytes() == report.online[r].tobytes()
                       for r, rows in zip(ids, reader.get_many(ids)))
        assert same == len(ids)
    reliability("6-node cluster: two reshards of 1000 slots while an engine writes",
                f"simulator, {len(workload)} requests, helper writer",
                "no step fails; every manifest byte-identical",
                f"{during} reshard(s) ended during the run; {same}/{len(ids)} identical; "
                f"slowest step {max(report.step_seconds):.3f} s")


def test_a_slot_stuck_migrating_is_unavailable_after_the_wait_and_the_retry_exact(
        monkeypatch, reliability):
    """A slot left migrating (a reshard stopped halfway) refuses its new keys: the put is
    retried for TOPOLOGY_WAIT, then raises StoreUnavailableError, naming the cause; once
    the slot is stable again, the caller's retry of the same put counts each pin once."""
    import hashlib

    from r3cache.errors import StoreUnavailableError
    from r3cache.store.redis import nodes
    from r3cache.testing import RedisClusterProcesses

    monkeypatch.setattr(nodes, "TOPOLOGY_WAIT", 0.5)
    rows = np.zeros(LAYOUT.block_shape, LAYOUT.dtype)
    rows[..., 1] = 1
    with RedisClusterProcesses() as cluster:
        store = open_store(cluster.url, layout=LAYOUT, namespace="stuck", owner="engine")
        keys = [hashlib.sha256(f"k{i}".encode()).hexdigest() for i in range(64)]
        stuck = keys[0]
        slot = int(store.call(store.keys.block(stuck), "CLUSTER", "KEYSLOT",
                              store.keys.block(stuck)))
        source = next(n for n in cluster.primaries()
                      if n.port == store.client_for(store.keys.block(stuck))
                      .get_connection_kwargs()["port"])
        target = next(n for n in cluster.primaries() if n is not source)
        target_id = target.client().execute_command("CLUSTER", "MYID").decode()
        source_id = source.client().execute_command("CLUSTER", "MYID").decode()
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        objects = dict.fromkeys(keys, rows)
        began = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="moving slots"):
            store.put(objects, keys + keys, ())
        refused_after = time.monotonic() - began
        for node in (source, target):
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        store.put(objects, keys + keys, ())  # the caller's retry
        assert [store.refcount(k) for k in keys] == [2] * len(keys)
        store.put({}, (), keys)
        assert [store.refcount(k) for k in keys] == [1] * len(keys)
        store.close()
    reliability("6-node cluster: a slot left migrating (a reshard stopped halfway)",
                "one put of 64 blocks, each pinned twice, one in that slot",
                "StoreUnavailableError after the wait; the retried put counts each pin once",
                f"refused after {refused_after:.2f} s (wait 0.5 s); 64/64 counts exact "
                "after the retry")


def test_inspecting_a_namespace_while_its_slot_moves_waits_for_the_move(reliability):
    """`r3cache inspect` (inspection.look) and `r3cache ls` (list_namespaces) while the slot
    of a namespace's own keys migrates to another primary: a key not yet there is
    answered with ASK, which is retried until the slot has moved, not an error."""
    from r3cache.inspection import look
    from r3cache.store.redis.connect import list_namespaces
    from r3cache.testing import RedisClusterProcesses

    with RedisClusterProcesses() as cluster:
        store = open_store(cluster.url, layout=LAYOUT, namespace="moving")
        store.put({"k": np.zeros(LAYOUT.block_shape, LAYOUT.dtype)}, ["k"])
        # The namespace's keys (owners, metadata, the unreadable list) share one slot.
        tagged = store.keys.unreadable
        slot = int(store.call(tagged, "CLUSTER", "KEYSLOT", tagged))
        port = store.client_for(tagged).get_connection_kwargs()["port"]
        source = next(n for n in cluster.primaries() if n.port == port)
        target = next(n for n in cluster.primaries() if n is not source)
        ids = {n.port: n.client().execute_command("CLUSTER", "MYID").decode()
               for n in (source, target)}
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING",
                                        ids[source.port])
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING",
                                        ids[target.port])

        def finish_the_move() -> None:
            time.sleep(1.0)
            client = source.client()
            names = client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            client.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000,
                                   "KEYS", *names)
            for node in cluster.primaries():
                node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE",
                                              ids[target.port])

        mover = threading.Thread(target=finish_the_move)
        mover.start()
        began = time.monotonic()
        view = look(cluster.url, "moving")
        took = time.monotonic() - began
        mover.join()
        assert view.live_owners == [store.owner] and view.unreadable == []
        assert view.stats.blocks == 1
        assert "moving" in list_namespaces(cluster.url)
        store.close()
    reliability("6-node cluster: the slot of a namespace's own keys migrating (1 s)",
                "r3cache inspect of that namespace", "the look waits for the move (ASK "
                "retried), then shows the namespace", f"answered after {took:.2f} s")


def test_namespace_keys_follow_a_failover_from_a_store_opened_before_it():
    """Single-key commands on the namespace's own keys (the manifest index, the owner
    registry, a refs hash) go through the same retry as batches: a store that learned
    the slot map before a failover releases, counts and reclaims after it."""
    from r3cache.manifest import Completion, Manifest
    from r3cache.store.redis.janitor import reclaim_dead_owners
    from r3cache.testing import RedisClusterProcesses

    with RedisClusterProcesses() as cluster:
        # No lease or janitor thread: nothing else relearns the slot map on the way.
        store = open_store(cluster.url, layout=LAYOUT, namespace="moved", lease=False,
                           janitor=False)
        try:
            index = store.keys.manifest_index

            def port_of(key: bytes) -> int:
                return store.client_for(key).get_connection_kwargs()["port"]

            victim = next(n for n in cluster.nodes if n.port == port_of(index))
            # A request whose manifest lives elsewhere, with no blocks: releasing it
            # touches the victim's slots through the index alone.
            request_id = next(f"req-{i}" for i in range(100)
                              if port_of(store.keys.manifest(f"req-{i}")) != victim.port)
            rows = np.zeros((3, *LAYOUT.row_shape), LAYOUT.dtype)
            writer = open_store(cluster.url, layout=LAYOUT, namespace="moved")
            writer.put({}, manifests=[Manifest(request_id, LAYOUT.fingerprint,
                                               Completion(0, 4), [rows])])
            writer.close()
            assert store.get_manifests([request_id]) != [None]
            replica = next(n for n in cluster.nodes
                           if n.client().info("replication").get("master_port") == victim.port)
            victim.kill(signal.SIGKILL)
            while replica.client().info("replication")["role"] != "master":
                time.sleep(0.05)
            victim.start()  # back as the new primary's replica: it answers MOVED

            assert store.release_manifests([request_id]) == 1
            assert store.get_manifests([request_id]) == [None]
            assert store.call(index, "ZSCORE", index, request_id) is None
            assert store.refcount("no-such-block") == 0
            assert reclaim_dead_owners(store).dead_owners == ()
        finally:
            store.close()


STALLS = {
    "pause": lambda server: server.client().execute_command("CLIENT", "PAUSE", 3000, "WRITE"),
    "sleep": lambda server: server.client(socket_timeout=10).execute_command("DEBUG", "SLEEP", 3),
    "down": lambda server: server.kill(signal.SIGKILL),
}


def _stalled_run(server, policy: str, stall: str):
    """A simulator run at 6 ms a step (about 4.5 s) while Redis stalls or goes down 0.1 s
    in, for about 3 s; the event is set once Redis answers again."""
    from r3cache import WorkerConnector
    from r3cache.sim import Engine

    store = open_store(server.url, layout=LAYOUT, namespace=f"stall-{policy}", idle_ttl=120,
                       socket_timeout=30, retries=1)
    # The thread writer's small queue is what these policies bound; the helper process
    # buffers a 3 s stall in its ring instead (its own bound: test_process_writer.py).
    worker = WorkerConnector(layout=LAYOUT, store=store, max_num_seqs=4, writer="thread",
                             max_concurrent_batches=2, store_wait=0.3, on_unavailable=policy)
    workload = grpo_workload(num_prompts=6, samples=4, system_len=32, prompt_len=(16, 80),
                             output_len=(40, 200), vocab=5000, seed=3)

    over = threading.Event()

    def fault():
        time.sleep(0.1)
        STALLS[stall](server)  # DEBUG SLEEP returns when the stall ends
        if stall != "sleep":
            time.sleep(3.1)
        if stall == "down":
            server.start()
        over.set()

    threading.Thread(target=fault, daemon=True).start()
    engine = Engine(LAYOUT, worker, SimConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                              keep_manifests=True, verify_manifests=False,
                                              seed=3, forward_seconds=0.006))
    return engine, worker, workload, over


def _server(stall: str, tmp_path) -> RedisServer:
    args = ["--enable-debug-command", "yes"] if stall == "sleep" else []
    if stall == "down":  # what was acknowledged before the crash comes back
        args += ["--appendonly", "yes", "--appendfsync", "always"]
    return RedisServer(*args, directory=tmp_path / stall).start()


@pytest.mark.parametrize("stall", sorted(STALLS))
def test_a_stalled_redis_raises_at_the_next_step_within_the_bound(stall, tmp_path,
                                                                  reliability):
    from r3cache.errors import StoreUnavailableError

    (tmp_path / stall).mkdir()
    server = _server(stall, tmp_path)
    engine, worker, workload, over = _stalled_run(server, "raise", stall)
    began = time.monotonic()
    # Not the writer's failure: it writes the refused batch again once Redis answers.
    with pytest.raises(StoreUnavailableError):
        engine.run(workload)
    raised_after = time.monotonic() - began
    slowest = max(engine.report.step_seconds, default=0)
    assert slowest < 1.0 and raised_after < 3.0  # during the stall, within the bound
    reliability(f"Redis {stall} (3 s), policy raise", "simulator, 24 requests",
                "typed error at the next step; no store call waits over the 0.3 s bound",
                f"raised after {raised_after:.2f} s; slowest step {slowest:.2f} s")
    assert over.wait(10)  # the stall ends
    with contextlib.suppress(R3Error):
        worker.close()  # what the store refused is gone; it may say so again
    server.stop()


@pytest.mark.parametrize("stall", sorted(STALLS))
def test_a_stalled_redis_marks_requests_incomplete_and_the_run_goes_on(stall, tmp_path,
                                                                      reliability):
    from r3cache.errors import BlockNotFoundError

    (tmp_path / stall).mkdir()
    server = _server(stall, tmp_path)
    engine, worker, workload, over = _stalled_run(server, "incomplete", stall)
    report = engine.run(workload)
    # Every request got its rows online, and a dropped batch's pins went with the next:
    # the store holds exactly what the engine does (nothing, once the run ends).
    assert report.failures == []
    assert report.rows_verified == sum(len(r.tokens) - 1 for r in workload)
    assert max(report.step_seconds) < 1.0  # no step waited beyond the bound (0.3 s)
    # A paused or sleeping Redis costs about one store_wait: once a put gave up, the next
    # drop their batches at once until the writer moves again (a put a step waiting 0.3 s
    # made 5 such steps). Down, the writer moves: each write fails fast on its own.
    waited = sum(s >= 0.2 for s in report.step_seconds)
    assert stall == "down" or waited <= 3, waited
    dropped = worker.store.remote.dropped_batches
    assert over.wait(10)  # the stall ends
    worker.close()
    complete = incomplete = 0
    with R3Reader(server.url, namespace="stall-incomplete") as reader:
        for request_id, online in report.online.items():
            try:
                rows = reader.get(request_id)
            except BlockNotFoundError:  # includes ManifestNotFoundError
                incomplete += 1
                continue
            assert rows.tobytes() == online.tobytes()  # never wrong rows
            complete += 1
    assert dropped > 0 and incomplete > 0 and complete + incomplete == len(workload)
    reliability(f"Redis {stall} (3 s), policy incomplete", "simulator, 24 requests",
                "run completes at its pace; no store call waits over 0.3 s, and after one "
                "has, the next drop their batch at once until the writer moves; read-back "
                "exact or a typed error; no hold left behind",
                f"{dropped} batches dropped; {complete} requests exact, {incomplete} "
                f"incomplete (typed), 0 wrong; slowest step {max(report.step_seconds):.2f} s, "
                f"{waited} step(s) over 0.2 s of {len(report.step_seconds)}")
    server.stop()


def test_a_cluster_with_no_node_answering_is_a_typed_error_and_the_lease_outlives_it(
        reliability):
    """Every node down: redis-py then raises RedisClusterException (not a RedisError). A put
    gets StoreUnavailableError, the heartbeat thread keeps beating, and once the nodes are
    back (without their data) it registers again and re-applies the owner's holds."""
    from r3cache.errors import StoreUnavailableError
    from r3cache.testing import RedisClusterProcesses

    with RedisClusterProcesses() as cluster:
        store = open_store(cluster.url, layout=LAYOUT, namespace="all-down", lease_ttl=0.6,
                           retries=2, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            store.put({"k": np.zeros(LAYOUT.block_shape, LAYOUT.dtype)}, ["k"])
            for node in cluster.nodes:
                node.kill(signal.SIGKILL)
            time.sleep(1.0)  # five heartbeats, each finding no node
            assert store._lease._thread.is_alive()
            began = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="unavailable"):
                store.put({}, ["other"])
            refused_after = time.monotonic() - began
            for node in cluster.nodes:
                node.start()
            cluster.wait_ok()
            deadline = time.monotonic() + 10
            while store._lease.renewals == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert store._lease.renewals >= 1 and store.refcount("k") == 1
            reliability("6-node cluster: every node SIGKILLed, then restarted empty",
                        "one owner holding a block",
                        "put raises StoreUnavailableError; the heartbeat survives and "
                        "re-applies the holds", f"refused after {refused_after:.2f} s; "
                        f"lease renewed {store._lease.renewals}x, hold restored")
        finally:
            with contextlib.suppress(R3Error):
                store.close()


# A reader's, a trainer's and an operator's calls on a Redis that answers nothing: 3 tries
# (retries=2) of 0.5 s each, and 0.15 s of backoff between them.
_STALLED_OPTIONS = "retries=2&socket_timeout=0.5&socket_connect_timeout=0.5"
_STALLED_CALLS = {
    "open_store": lambda url: open_store(url, layout=LAYOUT, namespace="stalled").close(),
    "R3Reader.get": lambda url: R3Reader(url, namespace="stalled").get("r0", wait=0.1),
    "r3cache inspect": lambda url: subprocess.run(
        [sys.executable, "-m", "r3cache.cli", "inspect", url], capture_output=True,
        text=True, timeout=60),
}


@pytest.mark.parametrize("fault", ["stalled (SIGSTOP)", "spoken to over TLS"])
@pytest.mark.parametrize("call", sorted(_STALLED_CALLS))
def test_a_redis_that_answers_nothing_costs_a_call_its_tries_not_their_square(
        call, fault, reliability):
    """Each call is tried ``retries`` + 1 times, each try bounded by the socket timeouts.
    Retried by redis-py's client as well as by r3cache's rounds, a server that accepts
    connections and answers nothing (stopped, or a plain server behind a rediss:// URL)
    held every call (retries + 1)² timeouts: 163 s with the defaults."""
    from r3cache.errors import StoreUnavailableError

    with RedisServer() as server:
        open_store(server.url, layout=LAYOUT, namespace="stalled").close()
        url = f"{server.url}?{_STALLED_OPTIONS}"
        if fault.startswith("stalled"):
            server.process.send_signal(signal.SIGSTOP)
        else:
            url = url.replace("redis://", "rediss://", 1)
        try:
            began = time.monotonic()
            if call == "r3cache inspect":
                done = _STALLED_CALLS[call](url)
                assert done.returncode == 2 and "StoreUnavailableError" in done.stderr
                assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
            else:
                with pytest.raises(StoreUnavailableError, match="unavailable"):
                    _STALLED_CALLS[call](url)
            took = time.monotonic() - began
        finally:
            server.process.send_signal(signal.SIGCONT)
    # 1.65 s; a process of the command line's starts in under a second more. Retried in
    # both layers: 9 tries, at least 4.5 s, and redis-py's backoff between.
    assert 1.5 < took < (4.0 if call == "r3cache inspect" else 3.0)
    reliability(f"Redis {fault}: accepts connections, answers nothing",
                f"{call}, retries=2, socket timeouts 0.5 s",
                "StoreUnavailableError after retries + 1 tries of one timeout each",
                f"raised after {took:.2f} s")


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_closing_on_a_stalled_redis_is_bounded_and_the_holds_still_go(writer, layout,
                                                                     reliability):
    """An engine shut down while Redis is stalled: close() answers within store_wait, and
    once Redis answers again the engine's holds go (the writer's own late close, or the
    janitor after the lease)."""
    from r3cache import StepBatch, StepMetadata, WorkerConnector
    from r3cache.errors import StoreUnavailableError
    from r3cache.hashing import block_hashes
    from r3cache.sim import oracle_rows
    from r3cache.store.redis.janitor import holders, reclaim_dead_owners
    from tests.conftest import wait_for

    namespace = f"close-stalled-{writer}"
    with RedisServer() as server:
        store = open_store(server.url, layout=layout, namespace=namespace, lease_ttl=1,
                           idle_ttl=120)
        worker = WorkerConnector(layout=layout, store=store, writer=writer, store_wait=0.5)
        tokens = list(range(9))  # two whole blocks of 4, still running
        worker.begin_step(StepMetadata(0, {"r": 0}, {"r": block_hashes(tokens, 4)[:2]}, ()))
        pending = worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 8])),
                                        routed_experts=oracle_rows(tokens, layout)[:8])
        pending.enqueue_cpu_copy([1], [0])
        worker.process_output(pending)
        worker.store.flush()
        probe = open_store(server.url, layout=layout, namespace=namespace, lease=False,
                           janitor=False)
        assert sum(map(len, holders(probe).values())) == 2
        server.process.send_signal(signal.SIGSTOP)
        began = time.monotonic()
        try:
            with pytest.raises(StoreUnavailableError, match="while closing"):
                worker.close()
            took = time.monotonic() - began
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert 0.45 < took < 1.5
        wait_for(lambda: not reclaim_dead_owners(probe).live_owners and not holders(probe),
                 15, "the engine's holds to go")
        probe.close()
    reliability(f"engine closed while Redis is stalled (SIGSTOP), {writer} writer",
                "1 request holding 2 blocks", "close() raises a typed error within "
                "store_wait (0.5 s); the holds go once Redis answers",
                f"close() answered after {took:.2f} s; no hold left")


def test_an_outage_longer_than_store_wait_reaches_the_engine_though_the_helper_has_room(
        layout, reliability):
    """Redis goes down under an engine whose helper's ring could buffer minutes of its
    steps: the engine's next call after store_wait of refusals raises, typed and naming
    the refusal (under on_unavailable="raise" an outage is the engine's to see), and once
    Redis is back its calls go through again."""
    from r3cache import StepBatch, StepMetadata, WorkerConnector
    from r3cache.errors import StoreUnavailableError
    from r3cache.hashing import block_hashes
    from r3cache.sim import oracle_rows

    with RedisServer() as server:
        port = server.port
        store = open_store(server.url, layout=layout, namespace="outage", retries=1)
        worker = WorkerConnector(layout=layout, store=store, writer="process",
                                 store_wait=0.5)

        def step(n: int) -> None:  # request n: one new whole block
            tokens = [n * 16 + t for t in range(5)]
            worker.begin_step(StepMetadata(0, {f"r{n}": 0},
                                           {f"r{n}": block_hashes(tokens, 4)[:1]}, ()))
            pending = worker.prepare_output(StepBatch([f"r{n}"], np.array([0]),
                                                      np.array([0, 4])),
                                            routed_experts=oracle_rows(tokens, layout)[:4])
            pending.enqueue_cpu_copy([1], [0])
            worker.process_output(pending)

        step(0)
        worker.store.flush()
        server.kill()
        began = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="the store refuses: "
                           "StoreUnavailableError") as info:
            for n in range(1, 100):
                step(n)
                time.sleep(0.05)
        raised_after = time.monotonic() - began
        server.port = port
        server.start()
        for later in range(n + 1, n + 100):  # the engine goes on until a step goes through
            try:
                step(later)
                break
            except StoreUnavailableError:
                time.sleep(0.05)
        worker.store.flush()
        worker.close()
    assert raised_after < 4
    reliability("Redis killed under an engine with the helper writer (64 MiB ring), "
                "store_wait 0.5 s", "one new block a step, 20 steps a second",
                "the engine's next call after store_wait of refusals raises, naming the "
                "refusal; its calls go through once Redis is back",
                f"raised after {raised_after:.2f} s; went on after the restart")
    assert "Redis unavailable" in str(info.value)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_closing_while_redis_is_down_stops_the_writer_that_was_retrying(writer, layout,
                                                                       reliability):
    """Redis is killed under a running engine, and the engine closes while it is down:
    close() gives up within store_wait, and the writer, which was writing its batch
    again and again, stops (nobody waits for it); it does not outlive the engine's
    connector waiting for a Redis that may never come back."""
    from r3cache import StepBatch, StepMetadata, WorkerConnector
    from r3cache.errors import StoreUnavailableError
    from r3cache.hashing import block_hashes
    from r3cache.sim import oracle_rows
    from tests.conftest import wait_for

    with RedisServer() as server:
        store = open_store(server.url, layout=layout, namespace=f"close-down-{writer}",
                           retries=1)
        worker = WorkerConnector(layout=layout, store=store, writer=writer, store_wait=0.5)
        remote = worker.store.remote
        server.kill()
        tokens = list(range(9))
        worker.begin_step(StepMetadata(0, {"r": 0}, {"r": block_hashes(tokens, 4)[:2]}, ()))
        pending = worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 8])),
                                        routed_experts=oracle_rows(tokens, layout)[:8])
        pending.enqueue_cpu_copy([1], [0])
        worker.process_output(pending)  # taken by the writer, which cannot write it
        time.sleep(1.0)  # past the client's retries: the writer writes it again
        began = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="while closing"):
            worker.close()
        took = time.monotonic() - began
        if writer == "thread":
            wait_for(lambda: not remote._thread.is_alive(), 5, "the writer thread to end")
        else:
            wait_for(lambda: remote._process.poll() is not None, 5,
                     "the helper process to exit")
        stopped = time.monotonic() - began
    assert took < 1.5
    reliability(f"engine closed while Redis is down (SIGKILL, not restarted), {writer} "
                "writer", "1 request, 2 blocks the writer keeps writing again",
                "close() raises a typed error within store_wait (0.5 s); the writer stops",
                f"close() answered after {took:.2f} s; the writer stopped "
                f"{stopped:.2f} s after close() began")


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_stall_costs_the_engine_one_store_wait_not_one_per_call(writer, layout,
                                                                  reliability):
    """Redis stalls under a running engine: the step whose batch finds the writer full
    waits store_wait and raises; later calls, close() included, answer at once until the
    writer moves again, instead of a store_wait each (close() made two)."""
    from r3cache import StepBatch, StepMetadata, WorkerConnector
    from r3cache.errors import StoreUnavailableError
    from r3cache.hashing import block_hashes
    from r3cache.sim import oracle_rows

    store_wait = 1.0
    with RedisServer() as server:
        store = open_store(server.url, layout=layout, namespace=f"one-wait-{writer}",
                           idle_ttl=120)
        worker = WorkerConnector(layout=layout, store=store, writer=writer, max_num_seqs=2,
                                 store_wait=store_wait)

        def step(n: int) -> None:  # request n: two new whole blocks; request n - 1 ends
            tokens = [n * 16 + t for t in range(9)]
            worker.begin_step(StepMetadata(0, {f"r{n}": 0},
                                           {f"r{n}": block_hashes(tokens, 4)[:2]},
                                           [f"r{n - 1}"] if n else ()))
            pending = worker.prepare_output(
                StepBatch([f"r{n}"], np.array([0]), np.array([0, 8])),
                routed_experts=oracle_rows(tokens, layout)[:8])
            pending.enqueue_cpu_copy([1], [0])
            worker.process_output(pending)

        step(0)
        worker.store.flush()
        server.process.send_signal(signal.SIGSTOP)
        try:
            began = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                for n in range(1, 50_000):  # until the writer's queue (or socket) is full
                    step(n)
            first = time.monotonic() - began
            began = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                step(n + 1)
            again = time.monotonic() - began
            began = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                worker.close()
            closing = time.monotonic() - began
        finally:
            server.process.send_signal(signal.SIGCONT)
    assert first >= store_wait * 0.9  # the first refusal waited its store_wait ...
    assert again < 0.3 * store_wait and closing < 0.3 * store_wait  # ... and only that one
    reliability(f"Redis stalled (SIGSTOP) under a stepping engine, {writer} writer",
                f"{n} steps of 2 new blocks until the writer is full", "the step that finds "
                "it full raises after store_wait (1 s); the next step and close() at once",
                f"refused after {first:.2f} s; next step {again:.3f} s; close() "
                f"{closing:.3f} s")


@pytest.mark.parametrize("fault", ["stall", "restart"])
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_refused_step_is_retried_whole_once_redis_is_back(writer, fault, layout, tmp_path,
                                                            reliability):
    """Redis stalls (SIGSTOP), or is killed and restarted from its AOF 3 s later (longer
    than the client's retries last), until a store call is refused (new blocks, or the
    pins of their keys); it comes back and the engine goes on. The writer writes its
    refused batch again, and the next calls carry what was refused, once: every request
    receives its exact rows, Redis holds each block it received with its rows and one
    hold of this owner (the local tier one pin), and nothing once they end."""
    import hashlib

    from r3cache import StepBatch, StepMetadata, WorkerConnector
    from r3cache.errors import StoreUnavailableError
    from r3cache.sim import oracle_rows
    from r3cache.store.redis.janitor import holders
    from tests.conftest import wait_for

    bs, steps = layout.block_size, 50_000
    requests = ["a", "b"]
    oracle = oracle_rows(list(range(steps * bs)), layout)
    keys: dict[str, list[str]] = {r: [] for r in requests}
    received: dict[str, list] = {r: [] for r in requests}
    refused: list[int] = []
    # Every write on disk before Redis acknowledges it: a restart loses none.
    with RedisServer(*(("--appendonly", "yes", "--appendfsync", "always")
                       if fault == "restart" else ()), directory=tmp_path) as server:
        port = server.port
        store = open_store(server.url, layout=layout, namespace=f"refused-{writer}",
                           idle_ttl=120, retries=1)
        worker = WorkerConnector(layout=layout, store=store, writer=writer, max_num_seqs=2,
                                 store_wait=0.5)
        remote = worker.store.remote
        owner = getattr(remote, "owner", None) or remote.inner.owner

        def stop() -> None:
            if fault == "stall":
                server.process.send_signal(signal.SIGSTOP)
            else:
                server.kill()

        def resume() -> None:
            if fault == "stall":
                server.process.send_signal(signal.SIGCONT)
            elif server.process is None:
                time.sleep(3)
                server.port = port
                server.start()

        def written() -> bool:
            """Whether the writer has written every earlier put."""
            try:
                worker.store.flush()
            except StoreUnavailableError:
                return False
            return True

        def call(n: int, method, *args):
            """The engine goes on past a refused call (its effects on the worker stand)."""
            try:
                return method(*args)
            except StoreUnavailableError:
                refused.append(n)
                resume()
                return None

        def step(n: int) -> None:  # each request runs one whole block, keyed at once
            hashes = {r: [hashlib.sha256(f"{r}{n}".encode()).digest()] for r in requests}
            call(n, worker.begin_step, StepMetadata(
                0, dict.fromkeys(requests, 0) if n == 0 else {}, hashes, ()))
            for r in requests:
                keys[r].append(hashes[r][0].hex())
            pending = worker.prepare_output(
                StepBatch(requests, np.array([n * bs] * 2), np.array([0, bs, 2 * bs])),
                routed_experts=np.concatenate([oracle[n * bs : (n + 1) * bs]] * 2))
            pending.enqueue_cpu_copy([1, 1], [0, 0])
            for r, out in (call(n, worker.process_output, pending) or {}).items():
                received[r].append((out.token_start, out.rows))

        step(0)
        worker.store.flush()
        stop()
        try:
            n = 1
            while not refused:  # until the writer's queue (or socket) is full
                step(n)
                n += 1
        finally:
            resume()
        wait_for(written, 10, "the writer to write again")
        for _ in range(3):
            step(n)
            n += 1
        n -= 1  # the last step
        worker.store.flush()
        for r in requests:
            starts = [start for start, _ in received[r]]
            rows = np.concatenate([rows for _, rows in received[r]])
            assert starts[0] == 0 and rows.shape[0] == (n + 1) * bs
            np.testing.assert_array_equal(rows, oracle[: (n + 1) * bs])
        every = [k for r in requests for k in keys[r]]
        probe = open_store(server.url, layout=layout, namespace=f"refused-{writer}",
                           lease=False, janitor=False)
        np.testing.assert_array_equal(probe.get_concatenated(keys["a"]), oracle[: (n + 1) * bs])
        assert len(holders(probe)[owner]) == len(every)
        assert {k: worker.store.local.refcount(k) for k in every} == dict.fromkeys(every, 1)
        worker.begin_step(StepMetadata(0, {}, {}, requests))
        worker.store.flush()
        assert worker.store.local.stats().referenced_keys == 0
        assert owner not in holders(probe)
        probe.close()
        worker.close()
    reliability(("Redis stalled (SIGSTOP)" if fault == "stall" else
                 "Redis killed (SIGKILL) and restarted from its AOF 3 s later")
                + f" until a store call is refused, then back; {writer} writer",
                f"2 requests, a new keyed block each a step, {n + 1} "
                "steps", "the engine goes on: exact rows online, every block in Redis with "
                "one hold (one local pin), none after the requests end",
                f"{len(refused)} call(s) refused at step {refused[0]}; "
                f"{len(every)} blocks held once each; 0 after")


def test_a_refused_deferred_teardown_keeps_the_steps_outputs(layout, reliability):
    """A request finishes while its step is in flight; Redis stalls, and the step's own
    put takes the writer queue's last place, so the teardown's call is refused. The step's
    rows are still returned (the request owns them), and the next store call writes the
    manifest the refused call held: the trainer reads exactly the rows the engine got."""
    from r3cache import StepBatch, StepMetadata, WorkerConnector
    from r3cache.manifest import Completion
    from r3cache.sim import oracle_rows

    bs = layout.block_size
    tokens = list(range(3 * bs + 1))
    rows = oracle_rows(tokens, layout)
    hashes = [bytes([b]) * 32 for b in range(3)]
    with RedisServer() as server:
        store = open_store(server.url, layout=layout, namespace="deferred", idle_ttl=120)
        # One request: the writer queue holds two puts beside the one being written.
        worker = WorkerConnector(layout=layout, store=store, writer="thread", max_num_seqs=1,
                                 max_concurrent_batches=2, store_wait=0.3)

        def prepare(block: int):
            pending = worker.prepare_output(
                StepBatch(["r"], np.array([block * bs]), np.array([0, bs])),
                routed_experts=rows[block * bs : (block + 1) * bs])
            pending.enqueue_cpu_copy([1], [0])
            return pending

        worker.begin_step(StepMetadata(0, {"r": 0}, {"r": hashes[:1]}, ()))
        first = worker.process_output(prepare(0))["r"]
        worker.store.flush()
        server.process.send_signal(signal.SIGSTOP)
        try:
            worker.begin_step(StepMetadata(0, {}, {"r": hashes[1:2]}, ()))  # taken, stuck
            time.sleep(0.2)
            in_flight = prepare(1)
            worker.begin_step(StepMetadata(0, {}, {"r": hashes[2:3]}, ()))  # queued
            # Finished while its step is in flight: torn down when that step is processed.
            worker.begin_step(StepMetadata(0, {}, {}, ("r",),
                                           completions={"r": Completion(0, 2 * bs + 1)}))
            began = time.monotonic()
            second = worker.process_output(in_flight)["r"]  # its put fills the queue
            took = time.monotonic() - began
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert took >= 0.25  # the teardown's call waited store_wait, and was refused
        assert worker.stats.errors["StoreUnavailableError"] == 1
        np.testing.assert_array_equal(np.concatenate([first.rows, second.rows]),
                                      rows[: 2 * bs])
        worker.close()  # carries the refused releases and manifest
        with R3Reader(server.url, namespace="deferred") as reader:
            np.testing.assert_array_equal(reader.get("r"), rows[: 2 * bs])
    reliability("Redis stalled (SIGSTOP) as a request finishes with its step in flight; "
                "thread writer", "1 request, the writer queue full after the step's own put",
                "the step's rows returned; the refused teardown carried by the next call",
                f"teardown refused after {took:.2f} s; {len(second.rows)} rows returned")
