"""Routes read back from Redis in verl, NeMo-RL and slime conventions (documented shapes)."""

from __future__ import annotations

import numpy as np
import pytest

from r3cache import R3Reader, RoutingLayout
from r3cache.errors import ContractError
from r3cache.integrations.rl import (
    nemo_rl_dtype,
    to_nemo_rl,
    to_slime,
    to_verl,
    verl_agent_loop_routes,
)
from r3cache.sim import SimConfig, SimRequest, simulate

LAYOUT = RoutingLayout(num_layers=4, topk=2, num_experts=64, block_size=4)


@pytest.fixture
def recorded(redis_url, namespace):
    """Three requests served through r3cache; their token counts and routes read back."""
    workload = [SimRequest(f"r{i}", list(range(10 + i, 10 + i + 5 + i)), list(range(7 + 2 * i)))
                for i in range(3)]
    assert simulate(workload, LAYOUT, SimConfig(keep_manifests=True), store_url=redis_url,
                    namespace=namespace).failures == []
    with R3Reader(redis_url, namespace=namespace) as reader:
        routes = reader.get_many([r.req_id for r in workload])
    return [len(r.prompt) + len(r.output) for r in workload], routes, (redis_url, namespace)


def test_verl_batches_are_int16_aligned_to_prompt_and_response(recorded):
    lengths, routes, _ = recorded
    offsets = [3, 1, 0]  # left padding of the prompts
    batch = to_verl(routes, seq_len=30, offsets=offsets)
    assert batch.shape == (3, 30, 4, 2) and batch.dtype == np.int16
    for i, (n, rows, at) in enumerate(zip(lengths, routes, offsets)):
        assert len(rows) == n - 1
        np.testing.assert_array_equal(batch[i, at : at + n - 1], rows)
        assert not batch[i, at + n - 1].any() and not batch[i, :at].any()  # padded with 0
    moe = to_verl(routes, seq_len=30, layers=[1, 3])
    np.testing.assert_array_equal(moe[0, : lengths[0] - 1], routes[0][:, [1, 3]])
    with pytest.raises(ContractError, match="sequence 2"):
        to_verl(routes, seq_len=lengths[2] - 1)


def test_nemo_rl_uses_the_narrowest_signed_dtype_and_minus_one(recorded):
    lengths, routes, _ = recorded
    assert [nemo_rl_dtype(e) for e in (64, 128, 129, 40000)] == \
        [np.int8, np.int8, np.int16, np.int32]
    flat = to_nemo_rl(routes, 64)
    for n, rows, out in zip(lengths, routes, flat):
        assert out.shape == (n, 4, 2) and out.dtype == np.int8
        np.testing.assert_array_equal(out[:-1], rows)
        assert (out[-1] == -1).all()
    batch = to_nemo_rl(routes, 64, seq_len=32, layers=[0, 2])
    assert batch.shape == (3, 32, 2, 2)
    assert (batch[0, lengths[0] - 1 :] == -1).all()
    with pytest.raises(ContractError, match="experts"):
        to_nemo_rl(routes, 8)


def test_slime_samples_take_len_tokens_minus_one_int32_rows(recorded):
    lengths, routes, _ = recorded
    out = to_slime(routes[1], lengths[1])
    assert out.dtype == np.int32 and out.shape == (lengths[1] - 1, 4, 2)
    np.testing.assert_array_equal(out, routes[1])
    with pytest.raises(ContractError, match="slime"):
        to_slime(routes[1], lengths[1] + 1)


def test_a_verl_agent_loop_gets_one_rollouts_routes_by_request_id(recorded):
    lengths, routes, (url, namespace) = recorded
    with R3Reader(url, namespace=namespace) as reader:
        out = verl_agent_loop_routes(reader, "r2", lengths[2])
    assert out.shape == (lengths[2], 4, 2) and out.dtype == np.int16
    np.testing.assert_array_equal(out[:-1], routes[2])
    assert not out[-1].any()


def test_a_verl_agent_loop_refuses_routes_that_would_sit_at_other_tokens(recorded):
    lengths, _, (url, namespace) = recorded
    # Recorded from position 3 (vLLM's routed_experts_prompt_start): the rows of tokens
    # 3.. would land at tokens 0.. of verl's batch.
    late = SimRequest("late", list(range(40, 52)), list(range(6)), prompt_start=3)
    assert simulate([late], LAYOUT, SimConfig(keep_manifests=True), store_url=url,
                    namespace=namespace + "-late").failures == []
    with (R3Reader(url, namespace=namespace + "-late") as reader,
          pytest.raises(ContractError, match="'late' was recorded from position 3")):
        verl_agent_loop_routes(reader, "late", 18)
    with (R3Reader(url, namespace=namespace) as reader,
          pytest.raises(ContractError, match=f"'r2' has routes of {lengths[2]} tokens")):
        verl_agent_loop_routes(reader, "r2", lengths[2] + 4)


ROWS = np.ones((5, 4, 2), np.uint8)
BAD_INPUT = {
    # Rows no trainer could replay: truncated, wrapped or out of its dtype's range.
    "verl float rows": lambda: to_verl([ROWS + 0.5], 8),
    "verl negative IDs": lambda: to_verl([ROWS.astype(np.int16) - 2], 8),
    "verl IDs past int16": lambda: to_verl([ROWS.astype(np.int32) + 40000], 8),
    "verl one array": lambda: to_verl(ROWS, 8),
    "verl layer out of range": lambda: to_verl([ROWS], 8, layers=[4]),
    "verl layer not an int": lambda: to_verl([ROWS], 8, layers=["a"]),
    "verl layers as a mask": lambda: to_verl([ROWS], 8, layers=[True, False, True, False]),
    "verl seq_len not an int": lambda: to_verl([ROWS], 8.0),
    "verl offset not an int": lambda: to_verl([ROWS], 8, offsets=[0.5]),
    "verl offsets one int": lambda: to_verl([ROWS], 8, offsets=0),
    "verl routes None": lambda: to_verl(None, 8),
    "nemo routes None": lambda: to_nemo_rl(None, 64),
    "nemo float rows": lambda: to_nemo_rl([ROWS.astype(np.float64)], 64),
    "nemo negative IDs": lambda: to_nemo_rl([ROWS.astype(np.int8) - 2], 64),
    "nemo shapes differ": lambda: to_nemo_rl([ROWS, ROWS[:, :2]], 64, seq_len=8),
    "nemo num_experts not an int": lambda: to_nemo_rl([ROWS], 64.0),
    "nemo seq_len not an int": lambda: to_nemo_rl([ROWS], 64, seq_len=8.0),
    # Past any machine's memory: numpy's ValueError ("Maximum allowed dimension") or
    # MemoryError otherwise, after the rows were checked.
    "verl seq_len past memory": lambda: to_verl([ROWS], 2**40),
    "verl seq_len past numpy": lambda: to_verl([], 10**20),
    "nemo seq_len past memory": lambda: to_nemo_rl([ROWS], 64, seq_len=2**40),
    "nemo seq_len past numpy": lambda: to_nemo_rl([ROWS], 64, seq_len=10**20),
    "slime float rows": lambda: to_slime(ROWS + 0.7, 6),
    "slime IDs past int32": lambda: to_slime(ROWS.astype(np.int64) + 2**40, 6),
    "slime num_tokens not an int": lambda: to_slime(ROWS, 6.0),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_input_no_trainer_could_replay_is_a_contract_error(case):
    with pytest.raises(ContractError):
        BAD_INPUT[case]()
