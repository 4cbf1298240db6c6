"""The simulator driven by tiny transformers MoE models through the capture path."""

from __future__ import annotations

import pytest

from r3cache.cli import main
from r3cache.models import ModelRoutes, tiny_model, tiny_model_names
from r3cache.sim import SimConfig, grpo_workload, simulate


def small_workload(vocab: int, seed: int = 0):
    return grpo_workload(num_prompts=3, samples=3, system_len=32, prompt_len=(8, 60),
                         output_len=(4, 48), vocab=vocab, seed=seed)


def run(name: str, store_url: str = "memory://", namespace: str = "model", *, layers="moe",
        config: SimConfig | None = None):
    routes = ModelRoutes(tiny_model(name, num_layers=4), 128, layers=layers)
    config = config or SimConfig(max_num_seqs=6, max_num_batched_tokens=128, num_kv_blocks=48,
                                 num_spec_tokens=2)
    try:
        return simulate(small_workload(routes.vocab_size), routes.layout, config,
                        store_url=store_url, namespace=namespace, routes=routes)
    finally:
        routes.close()


@pytest.mark.parametrize("name", tiny_model_names())
def test_every_family_stores_routes_equal_to_a_fresh_forward(name):
    report = run(name)
    assert report.ok, report.failures
    assert report.rows_mismatched == 0  # float64 tiny models: no ties, so exact
    assert report.manifests_verified == report.requests == 9
    assert report.prefix_hit_tokens > 0 and report.rejected_tokens > 0


def test_model_routes_through_every_store(store_url, namespace):
    report = run("qwen3-moe-tiny", store_url, namespace, layers="all")
    assert report.ok, report.failures
    assert report.rows_mismatched == 0 and report.manifests_verified == 9


def test_preemption_and_recompute_with_a_model():
    config = SimConfig(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=14,
                       num_spec_tokens=3, reset_prefix_cache_when_idle=True)
    report = run("mixtral-tiny", config=config)
    assert report.ok, report.failures
    assert report.preemptions > 0 and report.rows_mismatched == 0


def test_demo_with_a_model_prints_the_comparison(capsys):
    code = main(["demo", "--model", "olmoe-tiny", "--prompts", "2", "--samples", "2",
                 "--model-layers", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "model=olmoe-tiny" in out and " 0 differ" in out and "verification: PASS" in out
