from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from r3cache import RoutingLayout, StepBatch, StepMetadata, WorkerConnector
from r3cache.hashing import block_hashes
from r3cache.sim import oracle_rows
from r3cache.store.memory import MemoryBlockStore
from r3cache.testing import RedisClusterProcesses, machine_redis

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture
def layout() -> RoutingLayout:
    return RoutingLayout(num_layers=3, topk=2, num_experts=16, block_size=4)


class Harness:
    """A worker connector over a real MemoryBlockStore, fed with oracle rows per request."""

    def __init__(self, layout: RoutingLayout, *, max_concurrent_batches: int = 1,
                 max_bytes: int = 1 << 20) -> None:
        self.layout = layout
        self.store = MemoryBlockStore(layout, "test", max_bytes)
        self.worker = WorkerConnector(layout=layout, store=self.store, max_num_seqs=2,
                                      max_concurrent_batches=max_concurrent_batches)
        self.tokens: dict[str, list[int]] = {}
        self.generation = 0

    def add(self, req_id: str, tokens: list[int]) -> None:
        self.tokens[req_id] = tokens

    def rows(self, req_id: str, start: int, stop: int) -> np.ndarray:
        return oracle_rows(self.tokens[req_id], self.layout)[start:stop]

    def hashes(self, req_id: str, first: int = 0, last: int | None = None) -> list[bytes]:
        return block_hashes(self.tokens[req_id], self.layout.block_size)[first:last]

    def keys(self, req_id: str, first: int = 0, last: int | None = None) -> list[str]:
        return [h.hex() for h in self.hashes(req_id, first, last)]

    def begin(self, requests=None, block_hashes=None, finished=(), generation=None, *,
              completions=None, preempted=()) -> None:
        if generation is not None:
            self.generation = generation
        self.worker.begin_step(StepMetadata(self.generation, requests or {},
                                            block_hashes or {}, tuple(finished),
                                            completions or {}, preempted=preempted))

    def prepare(self, entries, padding: int = 0, rows: np.ndarray | None = None):
        """entries: (req_id, token_start, num_tokens[, first_row_position]) in batch order."""
        counts = [e[2] for e in entries]
        qsl = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        if rows is None:
            parts = [self.rows(e[0], e[3] if len(e) > 3 else e[1],
                               (e[3] if len(e) > 3 else e[1]) + e[2]) for e in entries]
            garbage = np.full((padding, *self.layout.row_shape), 15, self.layout.dtype)
            rows = np.concatenate([self.layout.empty_rows(), *parts, garbage])
        batch = StepBatch([e[0] for e in entries], np.array([e[1] for e in entries]), qsl)
        return self.worker.prepare_output(batch, routed_experts=rows)

    def step(self, entries, sampled, rejected=None, **kwargs):
        pending = self.prepare(entries, **kwargs)
        pending.enqueue_cpu_copy(sampled, rejected if rejected is not None else [0] * len(entries))
        return self.worker.process_output(pending)

    def refcount(self, key: str) -> int:
        self.worker.store.flush()
        return self.store.refcount(key)


@pytest.fixture
def harness(layout) -> Harness:
    h = Harness(layout)
    yield h
    h.worker.close()


@pytest.fixture
def async_harness(layout) -> Harness:
    h = Harness(layout, max_concurrent_batches=2)
    yield h
    h.worker.close()


# -- real Redis servers ---------------------------------------------------------------


# Every namespace this session writes starts with SESSION; at its end the session deletes
# exactly those keys, so sessions sharing one Redis (CI beside a developer's run, two CI
# jobs) never delete each other's data mid-test.
SESSION = f"test-{uuid.uuid4().hex[:8]}"


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_url():
    """A standalone Redis: the machine's (127.0.0.1:6379), or a spawned redis-server."""
    with machine_redis(f"{SESSION}-") as url:
        yield url


@pytest.fixture(scope="session")
def cluster():
    """A 6-node Redis Cluster (3 primaries, 3 replicas) of local redis-server processes."""
    with RedisClusterProcesses() as processes:
        yield processes


@pytest.fixture(scope="session")
def cluster_url(cluster):
    return cluster.url


def _docker_engine() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
    except Exception:  # noqa: BLE001 - any failure means: no engine here
        return False
    return True


DOCKER = _docker_engine()


@pytest.fixture(scope="session")
def docker_redis_url():
    """A Redis in a testcontainers container; only requested where a Docker engine runs."""
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:
        from testcontainers.redis import RedisContainer

    with RedisContainer("redis:7") as container:
        host = container.get_container_host_ip()
        yield f"redis://{host}:{container.get_exposed_port(6379)}/0"


STORE_BACKENDS = ["memory", "redis", "cluster"] + (["docker"] if DOCKER else [])


@pytest.fixture
def namespace() -> str:
    return f"{SESSION}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=STORE_BACKENDS)
def store_url(request) -> str:
    """Each store backend in turn: the embedded store, standalone Redis, the cluster."""
    return {
        "memory": lambda: "memory://",
        "redis": lambda: request.getfixturevalue("redis_url"),
        "cluster": lambda: request.getfixturevalue("cluster_url"),
        "docker": lambda: request.getfixturevalue("docker_redis_url"),
    }[request.param]()


def log_reliability(test: str, fault: str, load: str, checked: str, figures: str) -> None:
    """Append one fault case's outcome for docs/RELIABILITY.md (scripts/reliability_report.py)."""
    import json

    path = os.environ.get("R3CACHE_RELIABILITY_LOG")
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({"test": test, "fault": fault, "load": load,
                                  "checked": checked, "figures": figures}) + "\n")


@pytest.fixture
def reliability(request):
    """``reliability(fault, load, checked, figures)`` records this test's case."""
    return lambda *fields: log_reliability(request.node.nodeid, *fields)
