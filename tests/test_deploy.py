"""The deployment recipe: docker-compose.yml and the node settings it mounts, run for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from r3cache import RoutingLayout, open_store
from r3cache.testing import RedisClusterProcesses, RedisServer

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
NODE_CONF = ROOT / "deploy" / "redis-cluster.conf"
INIT = ROOT / "deploy" / "cluster-init.sh"


def _compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    version = [docker, "compose", "version"]
    if docker and subprocess.run(version, capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.skipif(_compose_command() is None, reason="no docker compose client installed")
def test_compose_config_validates_without_an_engine():
    result = subprocess.run([*_compose_command(), "-f", str(COMPOSE), "config"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_compose_runs_six_nodes_on_the_shared_settings_and_creates_the_cluster():
    spec = yaml.safe_load(COMPOSE.read_text())
    nodes = {name: svc for name, svc in spec["services"].items() if name.startswith("redis-")}
    assert len(nodes) == 6
    ports = set()
    for svc in nodes.values():
        command = svc["command"]
        assert command[:2] == ["redis-server", "/etc/r3cache/redis-cluster.conf"]
        ports.add(command[command.index("--port") + 1])
        assert "./deploy:/etc/r3cache:ro" in svc["volumes"]
    assert ports == {str(p) for p in range(7000, 7006)}
    init = spec["services"]["cluster-init"]
    assert set(init["depends_on"]) == set(nodes)
    assert init["command"] == ["sh", "/etc/r3cache/cluster-init.sh"]
    assert "./deploy:/etc/r3cache:ro" in init["volumes"]
    defaults = INIT.read_text().split("NODES=${R3_NODES:-")[1].split("}")[0]
    assert defaults.strip('"').split() == [f"127.0.0.1:{p}" for p in sorted(ports)]


def _cluster_init(nodes: list[RedisServer]) -> subprocess.Popen:
    env = {**os.environ, "R3_NODES": " ".join(f"127.0.0.1:{n.port}" for n in nodes),
           "R3_INIT_TIMEOUT": "60"}
    return subprocess.Popen(["sh", str(INIT)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_cluster_init_waits_for_late_nodes_and_reruns_without_change(tmp_path):
    """deploy/cluster-init.sh itself, on six nodes of deploy/redis-cluster.conf."""
    nodes = [RedisServer(directory=tmp_path / f"n{i}", config_file=NODE_CONF)
             for i in range(6)]
    for node in nodes:
        node.dir.mkdir()
    try:
        init = _cluster_init(nodes)  # before any node listens: it must wait, not fail
        time.sleep(1.5)
        assert init.poll() is None
        for node in nodes:
            node.start()
        out, _ = init.communicate(timeout=90)
        assert init.returncode == 0, out
        assert all(n.client().cluster("info")["cluster_state"] == "ok" for n in nodes)
        ids = {n.client().cluster("myid") for n in nodes}
        # Straight after a restart the cluster is not serving yet: a rerun waits, joins
        # nothing, and leaves the same six nodes.
        nodes[0].stop()
        nodes[0].start()
        again = _cluster_init(nodes)
        out, _ = again.communicate(timeout=90)
        assert again.returncode == 0, out
        assert "already form a cluster" in out
        assert {n.client().cluster("myid") for n in nodes} == ids
        assert all(int(n.client().cluster("info")["cluster_known_nodes"]) == 6 for n in nodes)
    finally:
        for node in nodes:
            node.stop()


def test_the_node_settings_make_a_working_durable_cluster():
    """Six local redis-server processes run deploy/redis-cluster.conf itself."""
    with RedisClusterProcesses(config_file=NODE_CONF) as cluster:
        client = cluster.nodes[0].client()
        config = client.config_get("*")
        assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
        assert config["maxmemory-policy"] == "volatile-lru"
        assert config["cluster-node-timeout"] == "5000"
        assert config["repl-diskless-sync-max-replicas"] == "1"
        assert int(config["maxmemory"]) == 8 << 30
        assert len(cluster.primaries()) == 3
        layout = RoutingLayout(2, 2, 8, 4)
        store = open_store(cluster.url, layout=layout, namespace="deploy-check")
        rows = np.zeros(layout.block_shape, np.uint8)
        store.put({"k": rows}, retain_keys=["k"])
        np.testing.assert_array_equal(store.get_concatenated(["k"]), rows)
        store.close()
