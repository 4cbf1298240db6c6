"""r3cache.metrics scraped over HTTP while a simulated engine writes to a real Redis."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from r3cache import R3Reader, RoutingLayout, metrics
from r3cache.errors import ManifestNotFoundError
from r3cache.sim import SimConfig, grpo_workload, simulate
from r3cache.testing import free_port

LAYOUT = RoutingLayout(num_layers=4, topk=2, num_experts=16, block_size=4)


@pytest.fixture
def scrape():
    port = free_port()
    server = metrics.serve(port, "127.0.0.1", registry=CollectorRegistry())

    def read(namespace: str) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {sample.name: sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.labels.get("namespace") == namespace}

    yield read
    server.shutdown()


@pytest.mark.parametrize("backend", ["redis_url", "cluster_url"])
def test_engine_counters_on_metrics_equal_the_connectors_stats(request, backend, namespace,
                                                               scrape):
    url = request.getfixturevalue(backend)
    kind = "redis" if backend == "redis_url" else "cluster"
    workload = grpo_workload(num_prompts=4, samples=4, seed=1)
    done: dict = {}
    run = threading.Thread(target=lambda: done.setdefault("report", simulate(
        workload, LAYOUT, SimConfig(keep_manifests=True), store_url=url, namespace=namespace,
        idle_ttl=300)))
    run.start()
    during = []
    while run.is_alive():
        during.append(scrape(namespace).get("r3cache_engine_steps_total", 0))
        run.join(0.05)
    report = done["report"]
    assert report.ok, report.failures
    assert during == sorted(during), "a counter went back during the run"
    after = scrape(namespace)
    assert after["r3cache_engine_steps_total"] == len(report.step_seconds) > 0  # steps run
    assert after["r3cache_blocks_published_total"] == report.blocks_published > 0
    assert after["r3cache_published_bytes_total"] == \
        report.blocks_published * LAYOUT.block_nbytes
    assert after["r3cache_prefix_blocks_read_total"] == report.blocks_read
    assert after["r3cache_manifests_written_total"] == report.manifests_verified
    assert after["r3cache_dropped_batches_total"] == 0
    # Redis holds each block once (a preempted request's recomputed blocks are published
    # again and kept by their first writer) and every manifest counted.
    assert 0 < report.store_stats.blocks <= report.blocks_published
    # The helper process's own write counts reach stats(): a fresh namespace's blocks
    # were all written by it, none conflicted.
    assert report.store_stats.blocks_written == report.store_stats.blocks
    assert after["r3cache_store_conflicts_total"] == report.store_stats.conflicts == 0
    assert after["r3cache_manifests_written_total"] == report.store_stats.manifests
    with R3Reader(url, namespace=namespace) as reader:
        labels = {k for k, v in scrape(namespace).items()}
        assert "r3cache_engine_steps_total" in labels
        assert metrics.store_kind(reader.store) == kind


def test_reader_counts_requests_tokens_latency_and_failures(redis_url, namespace, scrape):
    report = simulate(grpo_workload(num_prompts=2, samples=3, seed=2), LAYOUT,
                      SimConfig(keep_manifests=True), store_url=redis_url,
                      namespace=namespace, idle_ttl=300)
    ids = sorted(report.online)
    before = scrape(namespace)  # the simulator's own verification read them once already
    with R3Reader(redis_url, namespace=namespace) as reader:
        routes = reader.get_many(ids)
        reader.get(ids[0])
        with pytest.raises(ManifestNotFoundError):
            reader.get("never-recorded")
        after = scrape(namespace)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew("r3cache_reader_requests_total") == len(ids) + 1
    assert grew("r3cache_reader_tokens_total") == sum(map(len, routes)) + len(routes[0])
    assert grew("r3cache_reader_failures_total") == 1
    assert grew("r3cache_read_seconds_count") == 2
    assert grew("r3cache_read_seconds_bucket") == 2  # the +Inf bucket, the last one parsed
    assert grew("r3cache_read_seconds_sum") > 0


def test_counts_of_a_closed_and_collected_connector_stay(redis_url, namespace, scrape):
    simulate(grpo_workload(num_prompts=2, samples=2, seed=3), LAYOUT, SimConfig(),
             store_url=redis_url, namespace=namespace, idle_ttl=300)
    import gc

    gc.collect()  # the run's connector is gone: its counts must not be
    first = scrape(namespace)["r3cache_blocks_published_total"]
    assert first > 0
    simulate(grpo_workload(num_prompts=2, samples=2, seed=4), LAYOUT, SimConfig(),
             store_url=redis_url, namespace=namespace, idle_ttl=300)
    gc.collect()
    assert scrape(namespace)["r3cache_blocks_published_total"] > first


def test_metrics_never_label_by_request_id():
    names = [n for n, _ in {**metrics.ENGINE_COUNTERS, **metrics.READER_COUNTERS}.values()]
    assert all(n.startswith("r3cache_") and not n.endswith("_total") for n in names)
    assert np.all(np.diff(metrics.READ_BUCKETS) > 0)


CHILD = """
import json, sys
from r3cache import RoutingLayout, metrics
from r3cache.sim import SimConfig, grpo_workload, simulate
metrics.export(sys.argv[1], interval=0.05)
report = simulate(grpo_workload(num_prompts=2, samples=2, seed=int(sys.argv[4])),
                  RoutingLayout(4, 2, 16, 4), SimConfig(keep_manifests=True),
                  store_url=sys.argv[2], namespace=sys.argv[3], idle_ttl=300)
print(json.dumps([report.blocks_published, report.manifests_verified]))
"""


def test_metrics_exported_by_other_processes_add_up_where_they_are_served(redis_url,
                                                                         namespace, tmp_path):
    """As under vLLM: engine processes export, the serving process bridges and sums."""
    import json
    import subprocess
    import sys

    from prometheus_client import generate_latest

    children = [subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), redis_url,
                                namespace, str(seed)], capture_output=True, text=True,
                               timeout=120) for seed in (5, 6)]
    assert all(c.returncode == 0 for c in children), [c.stderr for c in children]
    counts = [json.loads(c.stdout) for c in children]
    registry = CollectorRegistry()
    registry.register(metrics.file_bridge(str(tmp_path)))
    scraped = {s.name: s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples if s.labels.get("namespace") == namespace}
    # The exits wrote the final counts: the two engines' totals, summed.
    assert scraped["r3cache_blocks_published_total"] == sum(c[0] for c in counts) > 0
    assert scraped["r3cache_manifests_written_total"] == sum(c[1] for c in counts) == 8
    assert len(list(tmp_path.glob("r3cache-*.prom"))) == 2


@pytest.mark.parametrize("policy", ["raise", "incomplete"])
def test_a_stalled_redis_shows_as_waits_drops_and_typed_errors(policy, tmp_path):
    """Redis paused for 3 s under the thread writer's small queue (tests/test_faults.py)."""
    from prometheus_client import generate_latest

    from r3cache.errors import R3Error
    from tests.test_faults import _server, _stalled_run

    (tmp_path / "pause").mkdir()
    server = _server("pause", tmp_path)
    registry = CollectorRegistry()
    metrics.register(registry)

    def scrape() -> dict:
        return {(s.name, s.labels.get("error")): s.value
                for f in text_string_to_metric_families(generate_latest(registry).decode())
                for s in f.samples if s.labels.get("namespace") == f"stall-{policy}"}

    before = scrape()  # tests/test_faults.py may have used this namespace already
    engine, worker, workload, over = _stalled_run(server, policy, "pause")
    with contextlib.suppress(R3Error):  # "raise": the typed error ends the run
        engine.run(workload)
    after = scrape()
    grew = {key: value - before.get(key, 0) for key, value in after.items()}
    assert grew[("r3cache_store_wait_seconds_count", None)] > 0  # puts found the queue full
    if policy == "raise":
        errors = {e: v for (n, e), v in grew.items() if n == "r3cache_store_errors_total" and v}
        assert sum(errors.values()) >= 1 and set(errors) <= {"StoreUnavailableError",
                                                            "WriterError"}
        assert errors == dict(worker.stats.errors)
    else:
        assert grew[("r3cache_dropped_batches_total", None)] == \
            worker.store.remote.dropped_batches > 0
    assert over.wait(10)  # the pause ends
    with contextlib.suppress(R3Error):
        worker.close()
    server.stop()


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_conflicts_with_another_replica_and_the_ring_show_on_metrics(redis_url, namespace,
                                                                     writer, scrape):
    """Another replica wrote other rows under three keys: this engine's writer counts three
    conflicts, and the metric says so. What the helper has not encoded shows: new blocks
    it reads in the tier's arena, duplicates copied into its ring; both drain to none."""
    from r3cache import open_store
    from r3cache.connector.worker import WorkerConnector

    keys = ["k1", "k2", "k3"]
    ours, theirs = (np.full(LAYOUT.block_shape, v, LAYOUT.dtype) for v in (1, 2))
    other = open_store(redis_url, layout=LAYOUT, namespace=namespace, owner="replica-a")
    other.put(dict.fromkeys(keys, theirs))
    worker = WorkerConnector(layout=LAYOUT, store=open_store(
        redis_url, layout=LAYOUT, namespace=namespace, owner="replica-b"), writer=writer)
    try:
        worker.store.put({**dict.fromkeys(keys, ours), "k4": ours})
        stats = worker.store.stats()  # after a flush: the helper has reported
        assert (stats.blocks_written, stats.conflicts) == (1, 3)
        scraped = scrape(namespace)
        assert scraped["r3cache_store_conflicts_total"] == 3
        if writer == "process":
            helper = worker.store.remote._process
            assert scraped["r3cache_writer_ring_slots_used"] == 0  # all encoded
            assert scraped["r3cache_writer_ring_slots"] == worker.store.remote.ring_slots[1]
            assert scraped["r3cache_writer_arena_blocks_unencoded"] == 0
            os.kill(helper.pid, signal.SIGSTOP)  # a helper that cannot keep up
            try:
                # Five new to the tier, two it holds already (duplicates: the caller's rows).
                worker.store.put({**{f"m{i}": ours for i in range(5)}, "k1": ours, "k4": ours})
                scraped = scrape(namespace)
                assert scraped["r3cache_writer_arena_blocks_unencoded"] == 5
                assert scraped["r3cache_writer_ring_slots_used"] == 2
            finally:
                os.kill(helper.pid, signal.SIGCONT)
            # Without a call into the store: the helper's acknowledgements in shared memory.
            gauges = ("r3cache_writer_ring_slots_used", "r3cache_writer_arena_blocks_unencoded")
            deadline = time.monotonic() + 10
            while any(scrape(namespace)[g] for g in gauges) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [scrape(namespace)[g] for g in gauges] == [0, 0]
        else:
            assert "r3cache_writer_ring_slots" not in scraped
            assert "r3cache_writer_arena_blocks_unencoded" not in scraped
    finally:
        worker.close()
        other.close()


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_writer_repeating_a_refused_batch_shows_how_long(namespace, writer, scrape):
    """Redis goes down under a put: r3cache_writer_refused_seconds grows while the writer
    repeats the batch, and is 0 again once Redis is back and takes it."""
    from r3cache import open_store
    from r3cache.connector.worker import WorkerConnector
    from r3cache.errors import StoreUnavailableError
    from r3cache.testing import RedisServer
    from tests.conftest import wait_for

    with RedisServer() as server:
        port = server.port
        worker = WorkerConnector(layout=LAYOUT, store=open_store(
            server.url, layout=LAYOUT, namespace=namespace, retries=1), writer=writer,
            store_wait=0.5)

        def refused() -> float:
            with contextlib.suppress(StoreUnavailableError):
                worker.store.flush()  # an engine's call: it reads the helper's reports
            return scrape(namespace)["r3cache_writer_refused_seconds"]

        try:
            assert refused() == 0
            server.kill()
            worker.store.put({"k": np.ones(LAYOUT.block_shape, LAYOUT.dtype)}, ["k"])
            wait_for(lambda: refused() > 0.5, 10, "the gauge to show the refusal")
            server.port = port
            server.start()
            wait_for(lambda: refused() == 0, 10, "the gauge to go back to 0")
        finally:
            worker.close()


def test_engine_steps_call_no_metrics_code_but_the_wait_timing():
    """scripts/bench_metrics.py (make bench) counts calls into r3cache/metrics.py during
    every bench_step case: only puts that waited for a full queue may make one."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "scripts/bench_metrics.py", "--steps", "20"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("memory ")]
    assert len(rows) == 4
    for *_, calls, waits, steps in rows:
        assert int(calls) <= int(waits) and int(steps) == 20
    assert "rendered once a second" in out


def test_every_new_registry_gets_the_collector():
    """A registry made after another was collected (often at the same address) still
    gets r3cache's metrics from register()."""
    from prometheus_client import generate_latest

    for _ in range(50):
        registry = metrics.register(CollectorRegistry())
        assert b"r3cache_engine_steps_total" in generate_latest(registry)
        del registry


def test_a_connector_collected_during_a_scrape_is_retired_without_a_deadlock():
    """The garbage collector runs a collected connector's finalizer wherever it happens to
    run, here inside a scrape's locked section (it hung the default suite once)."""
    import gc

    from r3cache.connector import WorkerStats
    from r3cache.store.memory import MemoryBlockStore

    class Engine:  # what add_engine reads of a connector; a cycle only gc.collect frees
        def __init__(self) -> None:
            self.store = MemoryBlockStore(RoutingLayout(2, 2, 8, 4), "collected-in-a-scrape")
            self.stats = WorkerStats(steps=7)
            self.cycle = self

    sources = metrics._Sources()
    sources.add_engine(Engine())
    scraped: list[dict] = []

    def scrape() -> None:
        with sources._lock:
            gc.collect()  # the finalizer runs here, with the lock held
        scraped.append(sources.engines())

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the scrape deadlocked on the retirement"
    assert scraped[0][("collected-in-a-scrape", "memory")].counts["steps"] == 7
    assert not sources._engines  # retired, not live


def test_the_plugins_serve_metrics_on_the_port_plus_their_rank_and_stop_on_a_taken_one(
        monkeypatch):
    """An engine's data-parallel ranks on one host each serve on a port of their own; a
    port that cannot be served stops the start, naming the variable."""
    from r3cache.errors import ContractError, IntegrationError
    from r3cache.integrations import engine

    base = free_port()
    monkeypatch.setenv("R3CACHE_METRICS_PORT", str(base - 1))
    server = engine.serve_metrics(rank=1)
    try:
        assert server.server_port == base
        with urllib.request.urlopen(f"http://127.0.0.1:{base}/metrics", timeout=10) as r:
            assert r.status == 200
        with pytest.raises(IntegrationError, match=f"R3CACHE_METRICS_PORT: port {base} "):
            engine.serve_metrics(rank=1)  # the rank's port is taken
    finally:
        server.shutdown()
        server.server_close()
    for value, rank in (("http", 0), ("65535", 1), ("0", 0)):
        monkeypatch.setenv("R3CACHE_METRICS_PORT", value)
        with pytest.raises(ContractError, match="R3CACHE_METRICS_PORT must be a TCP port"):
            engine.serve_metrics(rank)
    monkeypatch.delenv("R3CACHE_METRICS_PORT")
    assert engine.serve_metrics(rank=3) is None


def test_serving_and_exporting_metrics_refuse_bad_arguments_by_name(tmp_path):
    """`metrics.serve`, `register` and `export` are public: a taken port, a port that is
    no port, something that is no registry, a directory that is not there and an interval
    of 0 (a write loop without a pause) are one ContractError each, not prometheus_client's
    or the socket's gaierror, OverflowError, TypeError or OSError."""
    from r3cache.errors import ContractError

    taken = free_port()
    server = metrics.serve(taken, "127.0.0.1", registry=CollectorRegistry())
    try:
        with pytest.raises(ContractError, match=f"port {taken} of 127.0.0.1 cannot serve "
                                                "metrics .Address already in use"):
            metrics.serve(taken, "127.0.0.1", registry=CollectorRegistry())
    finally:
        server.shutdown()
        server.server_close()
    for port in ("9400", -1, 65536, True, 9400.0):
        with pytest.raises(ContractError, match="port must be a TCP port"):
            metrics.serve(port, "127.0.0.1", registry=CollectorRegistry())
    with pytest.raises(ContractError, match="no.such.host.invalid cannot serve metrics"):
        metrics.serve(0, "no.such.host.invalid", registry=CollectorRegistry())
    with pytest.raises(ContractError, match="registry must be a prometheus_client"):
        metrics.register("default")
    with pytest.raises(ContractError, match="cannot write metrics to .*No such file"):
        metrics.export(str(tmp_path / "gone"))
    with pytest.raises(ContractError, match="directory must be a path"):
        metrics.export(None)
    for interval in (0, -1, float("nan")):
        with pytest.raises(ContractError, match="interval must be"):
            metrics.export(str(tmp_path), interval)
    assert not list(tmp_path.iterdir())  # refused before anything was written
