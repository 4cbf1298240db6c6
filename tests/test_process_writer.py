"""The helper-process writer: same results as the thread, bounded waits on a stalled Redis."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from r3cache import RoutingLayout, WorkerConnector, open_store
from r3cache.errors import StoreUnavailableError
from r3cache.sim import Engine, SimConfig, SimRequest
from r3cache.store.process import ProcessWriter
from r3cache.store.tiered import TieredBlockStore
from r3cache.testing import RedisServer

LAYOUT = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)


def test_the_simulator_verifies_with_a_process_writer(redis_url, namespace):
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace, idle_ttl=120)
    worker = WorkerConnector(layout=LAYOUT, store=store, max_concurrent_batches=2,
                             writer="process")
    assert isinstance(worker.store, TieredBlockStore)
    assert isinstance(worker.store.remote, ProcessWriter)
    workload = [SimRequest(f"r{i}", list(range(40)), list(range(i, i + 30))) for i in range(6)]
    report = Engine(LAYOUT, worker, SimConfig(num_spec_tokens=2)).run(workload)
    owner = worker.store.remote.owner
    worker.close()
    assert report.failures == [] and report.manifests_verified == 6
    check = open_store(redis_url, layout=LAYOUT, namespace=namespace, lease=False)
    assert not check.client_for(check.keys.owners).hexists(check.keys.owners, owner)
    check.close()


def test_a_paused_redis_makes_put_fail_after_max_wait(namespace):
    with RedisServer() as server:
        writer = ProcessWriter(server.url, LAYOUT, namespace, {"idle_ttl": 60},
                               max_pending=2, max_wait=0.3)
        block = np.zeros(LAYOUT.block_shape, np.uint8)
        writer.put({"warm": block})
        writer.flush()
        pause = threading.Thread(target=server.client().client_pause, args=(3000,))
        pause.start()
        pause.join()
        slowest = 0.0
        with pytest.raises(StoreUnavailableError, match="not written"):
            for i in range(10_000):
                began = time.perf_counter()
                writer.put({f"k{i}": block})
                slowest = max(slowest, time.perf_counter() - began)
        assert slowest < 1.0  # never stalled beyond the bound
        server.client().client_unpause()
        writer.close()


def test_puts_gathered_into_one_round_keep_every_effect(redis_url, namespace):
    """Rapid puts reach Redis as one round; pins crossing zero in order, first writer's
    rows, and a manifest after its block all come out as if applied one by one."""
    from r3cache import Completion, R3Reader
    from r3cache.manifest import BlockRef, Manifest

    rows = [np.broadcast_to(np.arange(8, dtype=np.uint8) + 8 * i, LAYOUT.block_shape).copy()
            for i in range(3)]
    writer = ProcessWriter(redis_url, LAYOUT, namespace, {"idle_ttl": 60})
    manifest = Manifest("req", LAYOUT.fingerprint, Completion(0, 17), [BlockRef("c", 0, 16)])
    writer.put({"a": rows[0]}, retain_keys=["a"])
    writer.put({}, release_keys=["a"])
    writer.put({}, retain_keys=["a"])
    writer.put({"b": rows[1]}, retain_keys=["b"], release_keys=["b"])
    writer.put({"c": rows[2]}, manifests=[manifest])
    writer.put({"c": rows[0]})  # a second write of "c": the first one's rows stay
    writer.flush()
    reader = writer.reader
    np.testing.assert_array_equal(reader.get_concatenated(["a", "b", "c"]),
                                  np.concatenate(rows))
    assert reader.refcount("a") == 1 and reader.refcount("b") == 0
    key = reader.keys.block("b")
    assert 0 < reader.client_for(key).pttl(key) <= 61_000  # idle: the TTL (+10 ms a rank)
    key = reader.keys.block("a")
    assert reader.client_for(key).pttl(key) == -1  # held: no TTL
    with R3Reader(redis_url, namespace=namespace) as trainer:
        np.testing.assert_array_equal(trainer.get("req"), rows[2])
        trainer.release("req")
    writer.close()
