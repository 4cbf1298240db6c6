"""Session fixtures of the real-engine suites (tests_vllm, tests_sglang): a standalone Redis
and a 6-node cluster, with the suite's session prefix for the namespaces it deletes."""

from __future__ import annotations

import pytest

from r3cache.testing import RedisClusterProcesses, machine_redis


def redis_fixtures(prefix: str):
    """``redis_url`` and ``cluster_url`` fixtures; a conftest binds them to those names."""

    @pytest.fixture(scope="session")
    def redis_url():
        with machine_redis(prefix) as url:
            yield url

    @pytest.fixture(scope="session")
    def cluster_url():
        with RedisClusterProcesses() as processes:
            yield processes.url

    return redis_url, cluster_url
