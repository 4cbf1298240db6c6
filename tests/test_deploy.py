"""The deployment recipe: docker-compose.yml and the node settings it mounts, run for real."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from r3cache import RoutingLayout, open_store
from r3cache.testing import RedisClusterProcesses

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
NODE_CONF = ROOT / "deploy" / "redis-cluster.conf"


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
    script = " ".join(init["command"])
    assert "--cluster-replicas 1" in script
    assert all(f"127.0.0.1:{p}" in script for p in ports)


def test_the_node_settings_make_a_working_durable_cluster():
    """Six local redis-server processes run deploy/redis-cluster.conf itself."""
    with RedisClusterProcesses(config_file=NODE_CONF) as cluster:
        client = cluster.nodes[0].client()
        config = client.config_get("*")
        assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
        assert config["maxmemory-policy"] == "volatile-lru"
        assert config["cluster-node-timeout"] == "5000"
        assert int(config["maxmemory"]) == 8 << 30
        assert len(cluster.primaries()) == 3
        layout = RoutingLayout(2, 2, 8, 4)
        store = open_store(cluster.url, layout=layout, namespace="deploy-check")
        rows = np.zeros(layout.block_shape, np.uint8)
        store.put({"k": rows}, retain_keys=["k"])
        np.testing.assert_array_equal(store.get_concatenated(["k"]), rows)
        store.close()
