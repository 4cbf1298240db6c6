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
