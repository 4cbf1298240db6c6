"""The plugin in real SGLang servers: GRPO groups on real Redis (standalone and cluster),
inline routes against what the trainer reads by request id, keys-only responses, two
engines on one namespace."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from conftest import grpo_prompts, new_namespace, serve

from r3cache import R3Reader

WAIT = 30.0  # seconds for a manifest the helper writer has not recorded yet


@pytest.fixture(scope="module")
def standalone(model, redis_url):
    """One inline server on a standalone Redis."""
    namespace = new_namespace()
    server = serve(model, {"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace})
    try:
        yield server.wait_ready(), redis_url, namespace
    finally:
        server.stop()


@pytest.fixture(scope="module")
def replicas(model, cluster_url):
    """Two servers on one Redis Cluster namespace: inline, and keys only."""
    namespace = new_namespace()
    env = {"R3CACHE_URL": cluster_url, "R3CACHE_NAMESPACE": namespace}
    servers = [serve(model, env), serve(model, {**env, "R3CACHE_INLINE": "0"})]
    try:
        for server in servers:
            server.wait_ready()
        yield servers, cluster_url, namespace
    finally:
        for server in servers:
            server.stop()


def _keys(reader: R3Reader, ids: list[str]) -> list[list[str]]:
    return [m.block_keys for m in reader.store.get_manifests(ids)]


def _check_inline(reader: R3Reader, responses: list[dict], start_len: int = 0) -> None:
    """Each response's inline routes are, byte for byte, what the reader returns."""
    for response in responses:
        request_id = response["meta_info"]["id"]
        payload = base64.b64decode(response["meta_info"]["routed_experts"])
        rows = reader.get(request_id, dtype=np.int32, wait=WAIT)
        meta = response["meta_info"]
        assert len(rows) == meta["prompt_tokens"] + meta["completion_tokens"] - 1 - start_len
        assert rows.tobytes() == payload, request_id


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_grpo_inline_routes_are_what_the_trainer_reads(where, request):
    if where == "standalone":
        server, url, namespace = request.getfixturevalue("standalone")
    else:
        (server, _), url, namespace = request.getfixturevalue("replicas")
    prompts = grpo_prompts()
    responses = server.generate(prompts)
    assert len(responses) == len(prompts)
    with R3Reader(url, namespace=namespace) as reader:
        _check_inline(reader, responses)
        keys = _keys(reader, [r["meta_info"]["id"] for r in responses])
        shared = set.intersection(*map(set, keys))
        stored = set().union(*map(set, keys))
        # The 50-token system prompt is 3 full blocks of 16, the same in every request;
        # each group's prompt adds its own: a block is stored once, whoever sent it.
        assert len(shared) >= 3
        assert all(k[:3] == keys[0][:3] for k in keys)
        assert sum(map(len, keys)) > len(stored)
        if where == "standalone":  # the cluster's namespace is shared with another test
            assert reader.store.stats().blocks == len(stored)
        assert not any("~" in k for k in stored)  # no rows conflicted under a key
        # Routes from an unaligned position (routed_experts_start_len): the partial
        # block before the first whole one rides inline in the manifest.
        late = server.generate(prompts[:2], start_len=21)
        _check_inline(reader, late, start_len=21)
        late_keys = _keys(reader, [r["meta_info"]["id"] for r in late])
        assert all(k[0] == keys[0][2] for k in late_keys)  # blocks from the third on


def test_a_caller_rid_no_manifest_can_be_named_by_is_served_and_the_server_goes_on(
        standalone):
    """A caller's rid of over 1024 characters cannot name a manifest: its response keeps
    its routes, nothing is stored for it, and the scheduler serves the next requests."""
    server, url, namespace = standalone
    rids = ["x" * 1100, "chosen-by-the-caller"]
    responses = server.generate(grpo_prompts(1, 2), rids=rids)
    assert [r["meta_info"]["id"] for r in responses] == rids
    assert all(r["meta_info"]["routed_experts"] for r in responses)
    with R3Reader(url, namespace=namespace) as reader:
        _check_inline(reader, responses[1:])
        _check_inline(reader, server.generate(grpo_prompts(1, 1)))  # the server goes on


def test_keys_only_replica_and_two_engines_store_nothing_twice(replicas):
    (inline, keys_only), url, namespace = replicas
    # Blocks of other prompts than the GRPO test's, but for the system prompt's three.
    prompts = grpo_prompts(groups=2, samples=3, first_word=300)
    with R3Reader(url, namespace=namespace) as reader:
        before = reader.store.stats().blocks
        first = inline.generate(prompts, temperature=0)
        second = keys_only.generate(prompts, temperature=0)
        assert all("routed_experts" not in r["meta_info"] for r in second)
        _check_inline(reader, first)
        ids = [r["meta_info"]["id"] for r in first + second]
        routes = reader.get_many(ids, wait=WAIT)
        for response, rows in zip(first + second, routes):
            meta = response["meta_info"]
            assert rows.shape == (meta["prompt_tokens"] + meta["completion_tokens"] - 1,
                                  reader.layout.num_layers, reader.layout.topk)
        # The same prompts, greedy, on two engines: the same rows under the same keys,
        # each stored once in the namespace they share.
        keys = _keys(reader, ids)
        half = len(first)
        for a, b, rows_a, rows_b in zip(keys[:half], keys[half:], routes[:half],
                                        routes[half:]):
            assert a == b
            assert np.array_equal(rows_a, rows_b)
        stored = set().union(*map(set, keys))
        assert not any("~" in k for k in stored)
        system = set(keys[0][:3])
        assert reader.store.stats().blocks - before == len(stored - system)


_REGISTER = """
import json, sys
from sglang.srt.plugins.hook_registry import HookRegistry
from r3cache.errors import IntegrationError
from r3cache.integrations import sglang as plugin
if len(sys.argv) > 1:  # an SGLang without one of the hooked methods
    plugin._TARGETS = (*plugin._TARGETS[:1], plugin._SCHEDULER + ".no_such_method")
try:
    plugin.register()
    raised = None
except IntegrationError as exc:
    raised = str(exc)
print(json.dumps({"hooks": {t: [h[0].name for h in hs] for t, hs in HookRegistry._hooks.items()},
                  "raised": raised}))
"""


def _register(env: dict[str, str], *args: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    from conftest import SGLANG_ENV

    full = {k: v for k, v in os.environ.items() if not k.startswith("R3CACHE_")}
    done = subprocess.run([sys.executable, "-c", _REGISTER, *args], capture_output=True,
                          text=True, timeout=300, env={**full, **SGLANG_ENV, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_entry_point_hooks_sglang_only_when_r3cache_url_is_set():
    from importlib.metadata import entry_points

    assert any(ep.value == "r3cache.integrations.sglang:register"
               for ep in entry_points(group="sglang.srt.plugins"))
    assert _register({}) == {"hooks": {}, "raised": None}
    hooked = _register({"R3CACHE_URL": "redis://127.0.0.1:6379"})
    assert hooked["raised"] is None
    assert hooked["hooks"] == {
        "sglang.srt.managers.scheduler.Scheduler.init_batch_result_processor": ["AFTER"],
        "sglang.srt.managers.scheduler_components.batch_result_processor."
        "SchedulerBatchResultProcessor._maybe_collect_routed_experts": ["AFTER"]}


def test_an_sglang_without_the_hooked_api_cannot_start_a_scheduler():
    refused = _register({"R3CACHE_URL": "redis://127.0.0.1:6379"}, "older")
    assert "no_such_method" in refused["raised"] and "SGLang" in refused["raised"]
    assert refused["hooks"] == {"sglang.srt.managers.scheduler.Scheduler.__init__":
                                ["BEFORE"]}
