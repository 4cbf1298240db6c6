"""The README's SGLang section as a user runs it (the server line, the client's /generate,
the trainer's read by id), and the servers the plugin must stop from starting."""

from __future__ import annotations

import base64
import re
import time
import urllib.request

import numpy as np
from conftest import SYSTEM, serve
from prometheus_client.parser import text_string_to_metric_families

from r3cache.integrations.engine import default_namespace
from r3cache.store.redis.connect import list_namespaces
from r3cache.testing import free_port
from tests.readme import blocks

# The README's example model and Redis Cluster, replaced by the tiny model and the test's.
README_MODEL = "Qwen/Qwen3-30B-A3B"
README_PORT = "127.0.0.1:30000"  # SGLang's default port, which the README's client calls


def _readme(lang: str) -> str:
    return next(b.text for b in blocks() if (b.lang, b.heading) == (lang, "With SGLang"))


def test_the_readme_section_runs_as_written(model, cluster_url):
    lines = [line for line in _readme("bash").replace("\\\n", " ").splitlines()
             if "sglang.launch_server" in line]
    assert len(lines) == 1, "the README's SGLang block has one launch_server command"
    command = re.sub(r"R3CACHE_URL='[^']*'", f"R3CACHE_URL='{cluster_url}'", lines[0])
    assert README_MODEL in command and cluster_url in command
    metrics_port = free_port()
    server = serve(model, {"R3CACHE_METRICS_PORT": str(metrics_port)},
                   command=command.replace(README_MODEL, str(model)))
    try:
        server.wait_ready()
        # What the engine logs as its namespace: the served model's name and a digest
        # of its weights.
        namespace = default_namespace(str(model), str(model), None)
        assert namespace in list_namespaces(cluster_url)
        names = {"url": cluster_url, "namespace": namespace,
                 "prompt": f"{SYSTEM} w200 w201 w202"}
        code = _readme("python").replace(README_PORT, f"127.0.0.1:{server.port}")
        assert code != _readme("python"), f"the README's client calls {README_PORT}"
        exec(compile(code, "README.md (With SGLang)", "exec"), names)
        # The scheduler serves the publisher's metrics on R3CACHE_METRICS_PORT.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                    timeout=10) as response:
            scraped = {s.name: s.value for f in text_string_to_metric_families(
                response.read().decode()) for s in f.samples
                if s.labels.get("namespace") == namespace}
        assert scraped["r3cache_manifests_written_total"] == 1
    finally:
        server.stop()
    inline = np.frombuffer(base64.b64decode(names["out"]["meta_info"]["routed_experts"]),
                           dtype=np.int32)
    routes = names["routes"]
    assert routes.dtype == np.uint8 and len(routes) > 50
    assert np.array_equal(routes.reshape(-1), inline)


def _refused(model, env: dict[str, str], flags: str = "--enable-return-routed-experts") -> str:
    """The log of a server that must exit before it answers."""
    server = serve(model, env, flags)
    deadline = time.monotonic() + 300
    try:
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert server.process.poll() is not None, "the server started: " + server.log_tail()
        return server.log_tail(20000)
    finally:
        server.stop()


def test_a_store_it_cannot_reach_stops_the_server(model):
    log = _refused(model, {"R3CACHE_URL": f"redis://127.0.0.1:{free_port()}?store_wait=1"})
    assert "StoreUnavailableError" in log, log[-3000:]


def test_a_mistake_in_the_variables_stops_the_server(model, redis_url):
    """Found as the plugin loads, in the scheduler's process before it loads the model."""
    log = _refused(model, {"R3CACHE_URL": f"{redis_url}?idle_ttl=1h"})
    assert "ContractError" in log and "idle_ttl" in log, log[-3000:]
    assert "load_plugins" in log, log[-3000:]  # not where the store opens, after the model


def test_without_routed_experts_the_server_does_not_start(model, redis_url):
    log = _refused(model, {"R3CACHE_URL": redis_url}, flags="")
    assert "--enable-return-routed-experts" in log and "IntegrationError" in log, log[-3000:]


def test_an_embedded_store_stops_the_server(model):
    """memory:// would keep every request's routes inside the scheduler, read by no one."""
    log = _refused(model, {"R3CACHE_URL": "memory://"})
    assert "IntegrationError" in log and "memory://" in log, log[-3000:]
    assert "load_plugins" in log, log[-3000:]  # found as the plugin loads, before the model
