"""r3cache's worker connector against vLLM's own AuxOutputWorkerConnector, step by step.

Both are driven as vLLM's model runner drives its connector (scripts/bench_vs_vllm.py
builds the steps): the same scheduler metadata, input-batch arrays and captured rows, through
vLLM's real capturer snapshot. Every step's outputs must be the same requests, token starts
and bytes, on every store r3cache runs on.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from conftest import ROOT, SESSION

_spec = importlib.util.spec_from_file_location("bench_vs_vllm",
                                               ROOT / "scripts" / "bench_vs_vllm.py")
bench = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # for its dataclass
_spec.loader.exec_module(bench)

STEPS = 24  # past every scenario's warm-up, with blocks completing and requests finishing


@pytest.fixture(scope="module")
def pool() -> torch.Tensor:
    return bench.row_pool()


@pytest.fixture(scope="module")
def theirs(pool) -> dict[str, list]:
    """vLLM's connector's outputs, step by step, per scenario."""
    out: dict[str, list] = {}
    for scenario in bench.SCENARIOS:
        out[scenario] = []
        bench.run(bench.vllm_connector, scenario, STEPS, pool, out[scenario])
    return out


@pytest.mark.parametrize("backend", ["memory", "memory-thread", "redis", "cluster"])
@pytest.mark.parametrize("scenario", list(bench.SCENARIOS))
def test_every_step_yields_the_rows_vllms_own_connector_yields(request, backend, scenario,
                                                               pool, theirs):
    # The embedded store in place (its default) and behind a writer thread.
    url = ("memory://" if backend.startswith("memory")
           else request.getfixturevalue(f"{backend}_url"))
    writer = "thread" if backend == "memory-thread" else "auto"
    ours: list = []
    bench.run(lambda c, d, m: bench.r3cache_connector(c, d, m, url, f"{SESSION}-parity",
                                                      writer),
              scenario, STEPS, pool, ours)
    assert len(ours) == len(theirs[scenario]) > STEPS
    for step, (mine, vllms) in enumerate(zip(ours, theirs[scenario])):
        assert mine == vllms, f"{scenario} on {backend}: step {step} differs"
    # Rows flowed in both: a comparison of empty outputs would prove nothing.
    assert sum(len(step) for step in ours) > STEPS
