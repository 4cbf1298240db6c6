"""ACL users as the README deploys them: an engine user and a read-only trainer user."""

from __future__ import annotations

import numpy as np
import pytest

from r3cache import R3Reader, RoutingLayout, open_store
from r3cache.errors import StoreAccessError
from r3cache.sim import SimConfig, SimRequest, simulate
from r3cache.store.redis.janitor import reclaim_dead_owners
from r3cache.testing import RedisServer
from tests.readme import blocks


def _readme_acl() -> list[str]:
    """The README's ACL lines (its Deploying section), passwords filled in."""
    block = next(b for b in blocks() if (b.lang, b.heading) == ("", "Deploying"))
    lines = [line.removeprefix("ACL SETUSER ") for line in block.text.splitlines()
             if line.startswith("ACL SETUSER ")]
    return [line.replace("ENGINE_PASSWORD", "engine-pw").replace("TRAINER_PASSWORD",
                                                                 "trainer-pw")
            for line in lines]


ENGINE_ACL, TRAINER_ACL = _readme_acl()
LAYOUT = RoutingLayout(num_layers=4, topk=2, num_experts=16, block_size=4)


@pytest.fixture
def server():
    with RedisServer() as server:
        admin = server.client()
        for line in (ENGINE_ACL, TRAINER_ACL):
            admin.execute_command("ACL", "SETUSER", *line.split())
        admin.execute_command("ACL", "SETUSER", "default", "off")
        yield server


def url(server, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_the_engine_user_runs_everything_the_engine_needs(server):
    engine = url(server, "r3-engine", "engine-pw")
    workload = [SimRequest(f"r{i}", list(range(20)), list(range(i, i + 9))) for i in range(4)]
    report = simulate(workload, LAYOUT, SimConfig(keep_manifests=True, num_spec_tokens=2),
                      store_url=engine, namespace="acl", idle_ttl=60)
    assert report.failures == [] and report.manifests_verified == 4
    store = open_store(engine, layout=LAYOUT, namespace="acl")
    reclaim_dead_owners(store)
    store.close()
    with R3Reader(engine, namespace="acl") as reader:
        assert reader.release("r0") == 1


def test_the_trainer_user_reads_but_cannot_write(server, reliability):
    engine = url(server, "r3-engine", "engine-pw")
    trainer = url(server, "r3-trainer", "trainer-pw")
    workload = [SimRequest("r0", list(range(20)), list(range(9)))]
    report = simulate(workload, LAYOUT, SimConfig(keep_manifests=True), store_url=engine,
                      namespace="acl2", idle_ttl=60)
    with R3Reader(trainer, namespace="acl2") as reader:
        np.testing.assert_array_equal(reader.get("r0"), report.online["r0"])
        with pytest.raises(StoreAccessError, match="refused"):
            reader.release("r0")
    with pytest.raises(StoreAccessError):
        open_store(trainer, layout=LAYOUT, namespace="acl3")  # would create a namespace
    with pytest.raises(StoreAccessError):
        open_store(url(server, "r3-engine", "wrong"), layout=LAYOUT, namespace="acl")
    reliability("ACL users from the README (default user off)",
                "engine: simulator, janitor, release; trainer: read-back",
                "the engine user runs everything; the trainer user reads exact rows and is "
                "refused any write, typed", "trainer release and namespace creation -> "
                "StoreAccessError")
