"""The simulator drives the connectors through whole workloads against the routing oracle."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3cache import RoutingLayout
from r3cache.connector.worker import WorkerConnector
from r3cache.errors import ContractError
from r3cache.hashing import block_hashes
from r3cache.sim import (
    Engine,
    SimConfig,
    SimError,
    SimRequest,
    grpo_workload,
    oracle_rows,
    random_workload,
    simulate,
)
from r3cache.store.memory import MemoryBlockStore
from tests.conftest import SESSION

SMALL = RoutingLayout(num_layers=3, topk=2, num_experts=300, block_size=16)


def test_oracle_rows_depend_on_the_whole_prefix_and_hold_distinct_experts():
    layout = RoutingLayout(4, 3, 8, 4)
    a = oracle_rows([1, 2, 3, 4, 5], layout)
    b = oracle_rows([1, 2, 9, 4, 5], layout)
    np.testing.assert_array_equal(a[:2], b[:2])
    assert all((a[p] != b[p]).any() for p in range(2, 5))
    assert all(len(set(row)) == 3 for row in a.reshape(-1, 3).tolist())
    assert a.dtype == np.uint8 and a.max() < 8


# Layout, scheduler and store settings drawn for each random workload. The layouts take
# each row width the connector treats apart: uint8, uint16 and int32 IDs, and rows of
# eight bytes (the one-pass ID check's words) among others.
WORKLOAD = dict(
    layers=st.integers(1, 4),
    topk=st.integers(1, 4),
    experts=st.sampled_from([8, 300, 70000]),
    seed=st.integers(0, 2**31),
    block_size=st.sampled_from([1, 4, 16]),
    spec=st.integers(0, 4),
    reject_prob=st.floats(0.0, 0.9),
    async_depth=st.sampled_from([1, 2]),
    budget=st.integers(8, 300),
    kv_slack=st.integers(0, 60),
    max_num_seqs=st.integers(1, 16),
    prefix_caching=st.booleans(),
    reset=st.booleans(),
    clear_every=st.sampled_from([0, 0, 3, 17]),
)
SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


def check_random_workload(store_url, writer, layers, topk, experts, seed, block_size, spec,
                          reject_prob, async_depth, budget, kv_slack, max_num_seqs,
                          prefix_caching, reset, clear_every):
    """Run one random workload end to end; every row and every manifest must verify."""
    layout = RoutingLayout(layers, topk, experts, block_size)
    workload = random_workload(seed, num_requests=10, block_size=block_size)
    longest = max(len(r.tokens) for r in workload)
    config = SimConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        num_kv_blocks=-(-longest // block_size) + 2 + kv_slack, num_spec_tokens=spec,
        reject_prob=reject_prob, async_depth=async_depth, prefix_caching=prefix_caching,
        reset_prefix_cache_when_idle=reset, seed=seed,
        clear_local_tier_every=clear_every,  # Redis backends: the in-process tier is dropped
    )
    options = {} if store_url.startswith("memory") else {"idle_ttl": 120}
    namespace = f"{SESSION}-sim-{writer}-{seed}-{layers}x{topk}x{experts}-{block_size}"
    report = simulate(workload, layout, config, store_url=store_url, writer=writer,
                      namespace=namespace, **options)
    assert report.failures == []
    assert report.rows_verified == sum(len(r.tokens) - 1 - r.prompt_start for r in workload)
    # Every request was read back from its manifest.
    assert report.manifests_verified == len(workload)


# The store URL is a plain string per backend, safe to share between examples.
@settings(max_examples=100, deadline=None, suppress_health_check=SLOW_OK)
@given(**WORKLOAD)
def test_random_workloads_get_exactly_their_oracle_rows(store_url, **drawn):
    # Redis behind a writer thread; the embedded store written in place (its default).
    check_random_workload(store_url, "auto" if store_url == "memory://" else "thread",
                          **drawn)


@pytest.mark.parametrize("backend,writer", [("redis_url", "process"),
                                            ("cluster_url", "process"), ("memory", "thread")])
@settings(max_examples=15, deadline=None, suppress_health_check=SLOW_OK)
@given(**WORKLOAD)
def test_random_workloads_verify_with_the_other_writers(request, backend, writer, **drawn):
    """Redis behind the helper process fed by the ring, with the in-process tier cleared
    mid-run in a quarter of the examples (reads go to Redis); the embedded store behind a
    writer thread."""
    url = "memory://" if backend == "memory" else request.getfixturevalue(backend)
    check_random_workload(url, writer, **drawn)


def test_a_grpo_workload_exercises_every_mechanism_and_verifies():
    config = SimConfig(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=24,
                       num_spec_tokens=3, async_depth=2, seed=3)
    workload = grpo_workload(num_prompts=4, samples=4, system_len=40, prompt_len=(8, 60),
                             output_len=(8, 90), vocab=5000, seed=3)
    report = simulate(workload, SMALL, config)
    assert report.failures == []
    assert report.prefix_hit_tokens > 0 and report.blocks_read > 0
    assert report.preemptions > 0 and report.rejected_tokens > 0
    assert report.store_stats.referenced_keys == 0 and report.store_stats.blocks > 0


def test_idle_prefix_cache_resets_change_the_generation():
    workload = [SimRequest(f"r{i}", list(range(40)), list(range(i, i + 20)), arrival_step=i * 60)
                for i in range(3)]
    report = simulate(workload, SMALL, SimConfig(reset_prefix_cache_when_idle=True))
    assert report.failures == [] and report.resets >= 2
    assert report.prefix_hit_tokens == 0  # each reset emptied the prefix cache


class TamperingWorker(WorkerConnector):
    """A real connector whose outputs are altered after the fact, to prove the checks bite."""

    def process_output(self, pending):
        outputs = super().process_output(pending)
        for req_id, out in outputs.items():
            if len(out.rows) and req_id == "victim":
                rows = out.rows.copy()
                rows[-1, 0, 0] = (int(rows[-1, 0, 0]) + 1) % 300
                outputs[req_id] = out._replace(rows=rows)
        return outputs


def test_the_verifier_catches_a_single_wrong_expert_id():
    worker = TamperingWorker(layout=SMALL, store=MemoryBlockStore(SMALL), max_concurrent_batches=2)
    workload = [SimRequest("victim", list(range(30)), list(range(30, 50))),
                SimRequest("bystander", list(range(5, 30)), list(range(7)))]
    report = Engine(SMALL, worker, SimConfig()).run(workload)
    worker.close()
    assert report.failures == ["victim: row for position 29 differs",
                               "victim: manifest rows differ from online rows"]


def test_a_request_larger_than_the_kv_pool_is_refused():
    with pytest.raises(SimError, match="more KV blocks"):
        simulate([SimRequest("big", list(range(100)), [1])], SMALL, SimConfig(num_kv_blocks=3))


@pytest.mark.parametrize("knob", [
    {"num_spec_tokens": -1}, {"reject_prob": 1.5}, {"reject_prob": float("nan")},
    {"async_depth": 0}, {"seed": -1}, {"max_steps": 0}, {"forward_seconds": -1},
    {"clear_local_tier_every": -1}, {"max_num_seqs": 1.5}, {"num_kv_blocks": True},
])
def test_engine_knobs_are_checked_when_the_config_is_made(knob):
    # Unchecked, these stalled for max_steps steps or failed inside numpy mid-run.
    with pytest.raises(ContractError, match=next(iter(knob))):
        SimConfig(**knob)


@pytest.mark.parametrize("make, args", [
    (random_workload, {"seed": -1}), (random_workload, {"seed": 1, "num_requests": 0}),
    (random_workload, {"seed": 1.5}), (grpo_workload, {"num_prompts": 0}),
    (grpo_workload, {"samples": -1}), (grpo_workload, {"prompt_len": (5, 2)}),
    (grpo_workload, {"output_len": (0, 4)}), (grpo_workload, {"prompt_len": 7}),
    (grpo_workload, {"system_len": 0, "prompt_len": (0, 4)}),
])
def test_workload_sizes_are_checked(make, args):
    with pytest.raises(ContractError):
        make(**args)


def test_sim_hashes_are_vllm_block_hashes():
    request = SimRequest("r", list(range(40)), [1, 2])
    assert block_hashes(request.tokens, 16)[0] == block_hashes(list(range(16)), 16)[0]


def test_reads_fall_back_to_redis_when_the_local_tier_is_cleared(redis_url, namespace):
    from r3cache.store import open_store

    workload = grpo_workload(num_prompts=3, samples=4, system_len=40, prompt_len=(8, 60),
                             output_len=(8, 60), vocab=5000, seed=5)
    store = open_store(redis_url, layout=SMALL, namespace=namespace, idle_ttl=120)
    worker = WorkerConnector(layout=SMALL, store=store, max_concurrent_batches=2)
    report = Engine(SMALL, worker, SimConfig(clear_local_tier_every=2, seed=5)).run(workload)
    remote_reads = worker.store.remote_reads
    worker.close()
    assert report.failures == [] and report.blocks_read > 0
    assert remote_reads > 0  # prefix hits after a clear were served by Redis
