"""Routes read from r3cache replayed by real Megatron-Core routers (megatron-core, on the CPU).

The stack: three decoder layers, MoE - dense - MoE, each MoE layer a Megatron ``TopKRouter``
(8 experts, top-2) with routing replay. Its gating weights are applied here, because
``TopKRouter.gating`` moves its weight to CUDA; the routing itself — scores, top-k, and the
replay of recorded indices — is Megatron's own ``TopKRouter.routing``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from r3cache import R3Reader, RoutingLayout
from r3cache.errors import ContractError, ReplayError
from r3cache.integrations.megatron import (
    ReplayBatch,
    iter_replay_targets,
    replay_targets,
    router_replay,
)
from r3cache.integrations.megatron_stack import chosen, moe_stack, process_groups
from r3cache.sim import SimConfig, SimRequest, simulate
from r3cache.testing import free_port
from tests.readme import python_block

HIDDEN, EXPERTS, TOPK = 32, 8, 2
LAYOUT = RoutingLayout(num_layers=3, topk=TOPK, num_experts=EXPERTS, block_size=4)


@pytest.fixture(scope="module")
def groups():
    return process_groups(free_port())


def Stack(groups, **config):
    """MoE, dense, MoE: Megatron TopKRouters at decoder layers 1 and 3."""
    return moe_stack(groups, num_layers=3, moe_layers=(1, 3), hidden=HIDDEN, experts=EXPERTS,
                     topk=TOPK, **config)


def _recorded(redis_url, namespace, lengths):
    """Routes of requests the simulator served through r3cache, read back by request id."""
    workload = [SimRequest(f"req-{i}", list(range(100 + i, 100 + i + n // 2)),
                           list(range(500 + i, 500 + i + n - n // 2)))
                for i, n in enumerate(lengths)]
    report = simulate(workload, LAYOUT, SimConfig(keep_manifests=True), store_url=redis_url,
                      namespace=namespace)
    assert report.failures == []
    with R3Reader(redis_url, namespace=namespace) as reader:
        return [r.req_id for r in workload], reader.get_many([r.req_id for r in workload])


def _chosen(routing_map: torch.Tensor) -> list[set[int]]:
    return [set(np.flatnonzero(row).tolist()) for row in routing_map.numpy()]


def _expected(routes, column, positions):
    """The experts each (sequence, position) token must use: recorded, or the filler."""
    out = []
    for seq, pos in positions:
        rows = routes[seq]
        out.append(set(rows[pos, column].tolist()) if pos < len(rows) else set(range(TOPK)))
    return out


def test_a_padded_batch_replays_the_recorded_experts_layer_by_layer(
        groups, redis_url, namespace):
    ids, routes = _recorded(redis_url, namespace, [9, 14, 6])
    stack = Stack(groups)
    s, b = 16, 3
    hidden = torch.randn(s, b, HIDDEN)
    own = stack(hidden)
    with router_replay(stack, routes, ReplayBatch(seq_len=s, names=ids)):
        replayed = stack(hidden)
    positions = [(i, p) for p in range(s) for i in range(b)]  # sequence-major: row p * b + i
    for router_maps, column in zip(replayed, (0, 2)):  # decoder layers 1 and 3
        assert _chosen(router_maps) == _expected(routes, column, positions)
    assert any(_chosen(a) != _chosen(c) for a, c in zip(own, replayed))  # replay changed them
    # The same targets in batch-major order (the classic slip) replay other experts.
    wrong = [(i, p) for i in range(b) for p in range(s)]
    assert _chosen(replayed[0]) != _expected(routes, 0, wrong)
    # Cleared on exit: the routers route by themselves again.
    assert [_chosen(m) for m in stack(hidden)] == [_chosen(m) for m in own]


def test_a_packed_thd_batch_replays_each_sequence_at_its_offset(
        groups, redis_url, namespace):
    ids, routes = _recorded(redis_url, namespace, [9, 14, 6])
    stack = Stack(groups)
    spans = [12, 16, 8]  # each sequence padded to a multiple of 4, as Megatron packs
    cu_seqlens = np.concatenate(([0], np.cumsum(spans)))
    hidden = torch.randn(int(cu_seqlens[-1]), 1, HIDDEN)
    with router_replay(stack, routes, ReplayBatch(cu_seqlens=cu_seqlens, names=ids)):
        replayed = stack(hidden)
    positions = [(i, p) for i, span in enumerate(spans) for p in range(span)]
    for router_maps, column in zip(replayed, (0, 2)):
        assert _chosen(router_maps) == _expected(routes, column, positions)


def test_sequence_parallel_ranks_each_replay_their_chunk(groups, redis_url, namespace):
    ids, routes = _recorded(redis_url, namespace, [9, 14, 6])
    stack = Stack(groups)
    s, b, tp = 16, 3, 2
    full = torch.randn(s, b, HIDDEN)
    positions = [(i, p) for p in range(s) for i in range(b)]
    for rank in range(tp):  # what each rank of a tensor-parallel group routes
        chunk = full[rank * s // tp : (rank + 1) * s // tp]
        with router_replay(stack, routes, ReplayBatch(seq_len=s, names=ids), tp_rank=rank,
                           tp_size=tp):
            replayed = stack(chunk)
        mine = positions[rank * s * b // tp : (rank + 1) * s * b // tp]
        assert _chosen(replayed[1]) == _expected(routes, 2, mine)


def test_routes_of_moe_layers_only_map_to_routers_in_order(groups, redis_url, namespace):
    ids, routes = _recorded(redis_url, namespace, [9, 6])
    moe_only = [r[:, [0, 2]] for r in routes]  # what a trainer keeps of all-layer routes
    stack = Stack(groups)
    targets = replay_targets(stack.routers, moe_only, ReplayBatch(seq_len=12, names=ids),
                             layers="moe")
    full = replay_targets(stack.routers, routes, ReplayBatch(seq_len=12, names=ids))
    assert all(np.array_equal(a, c) for a, c in zip(targets, full))
    assert all(t.dtype == np.int64 for t in targets)


def _refused(stack, routes, batch, match: str) -> None:
    with pytest.raises(ReplayError, match=match), router_replay(stack, routes, batch):
        pass


def test_mismatches_are_refused_before_any_target_is_set(groups, redis_url, namespace):
    ids, routes = _recorded(redis_url, namespace, [9, 14])
    stack = Stack(groups)
    # 13 recorded rows do not fit a sequence of 10 positions.
    _refused(stack, routes, ReplayBatch(seq_len=10, names=ids), "req-1")
    _refused(stack, [r[..., :1] for r in routes], ReplayBatch(seq_len=16), "shape")
    _refused(stack, [r[:, :2] for r in routes], ReplayBatch(seq_len=16), "layers")
    # Rows no router could have picked: truncated, wrapped or past the experts on a device.
    _refused(stack, [r + 0.5 for r in routes], ReplayBatch(seq_len=16), "float64")
    _refused(stack, [r.astype(np.int64) - 1 for r in routes], ReplayBatch(seq_len=16),
             "8 experts")
    _refused(stack, [np.where(r == r.max(), EXPERTS, r) for r in routes],
             ReplayBatch(seq_len=16), "8 experts")
    _refused(stack, [r[..., [0, 0]] for r in routes], ReplayBatch(seq_len=16), "twice")
    _refused(stack, routes, ReplayBatch(seq_len=16.5), "seq_len")
    _refused(stack, routes, ReplayBatch(cu_seqlens=[0.0, 12.5, 30.0]), "cu_seqlens")
    with pytest.raises(ReplayError, match="2 \\* cp_size"):  # 18 positions, 4 chunks
        replay_targets(stack.routers, routes, ReplayBatch(seq_len=18), cp_rank=1, cp_size=2)
    with pytest.raises(ReplayError, match="padded"):
        replay_targets(stack.routers, routes, ReplayBatch(cu_seqlens=[0, 12, 28]), cp_rank=0,
                       cp_size=2)
    with pytest.raises(ReplayError, match="rank 2"):
        replay_targets(stack.routers, routes, ReplayBatch(seq_len=16), cp_rank=2, cp_size=2)
    assert all(r.router_replay.target_topk_idx is None for r in stack.routers)
    _refused(Stack(groups, moe_router_fusion=True), routes, ReplayBatch(seq_len=16),
             "fusion")


MALFORMED = {  # argument -> what the ReplayError names
    "no sequences": (dict(routes=[]), "at least one"),
    "routes None": (dict(routes=None), "at least one"),
    "a sequence of another layout": (dict(layers_of_second=4), "hold 4 layers"),
    "names as one str": (dict(batch=ReplayBatch(seq_len=16, names="ab")), "not a str"),
    "tp_size a float": (dict(tp_size=2.0), "tp_size must be an int"),
    "tp_rank a float": (dict(tp_size=2, tp_rank=1.0), "tp_rank must be an int"),
    "cp_size a float": (dict(cp_size=2.0), "cp_size must be an int"),
    "cp_rank a float": (dict(cp_size=2, cp_rank=1.0), "cp_rank must be an int"),
    "tp_size a str": (dict(tp_size="2"), "tp_size must be an int"),
    "tp_rank past tp_size": (dict(tp_size=2, tp_rank=2), "tensor-parallel rank 2"),
    # Every rank would replay rank 0's tokens, or Megatron's group would override the rank.
    "tp_size without tp_rank": (dict(tp_size=2), "tp_size=2 needs tp_rank"),
    "cp_size without cp_rank": (dict(cp_size=2), "cp_size=2 needs cp_rank"),
    "tp_rank without tp_size": (dict(tp_rank=1), "tp_rank=1 needs tp_size|rank 1 of tp_size=1"),
    "cu_seqlens past int64": (dict(batch=ReplayBatch(cu_seqlens=np.array(
        [0, 12, 2**63], np.uint64))), "past 2147483647"),
    # numpy's "Maximum allowed dimension exceeded", or a MemoryError, once checked.
    "seq_len past any micro-batch": (dict(batch=ReplayBatch(seq_len=10**20)),
                                     "past 2147483647"),
    "seq_len times sequences past it": (dict(batch=ReplayBatch(seq_len=2**30)),
                                        "is 2147483648 tokens"),
    "no routers": (dict(routers=[]), "no routers"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_replay_arguments_are_replay_errors_before_any_target_is_set(groups, case):
    """Arguments of the wrong kind are refused by name, not with numpy's ValueError or
    TypeError from deep inside (a float rank or size sliced the token axis, a uint64 offset
    wrapped, sequences of two layouts failed to concatenate)."""
    stack = Stack(groups)
    change, match = MALFORMED[case]
    routes = _random_routes(5, 3, (9, 14))
    if "layers_of_second" in change:
        routes[1] = _random_routes(6, change["layers_of_second"], (14,))[0]
    args = {"routes": routes, "batch": ReplayBatch(seq_len=16),
            **{k: v for k, v in change.items() if k != "layers_of_second"}}
    routers = args.pop("routers", stack.routers)
    with pytest.raises(ReplayError, match=match):
        replay_targets(routers, **args)
    if routers is stack.routers:  # the context manager refuses them the same way
        with pytest.raises(ReplayError, match=match), router_replay(stack, **args):
            pass
    assert all(r.router_replay.target_topk_idx is None for r in stack.routers)


def test_batches_for_replay_are_refused_before_any_read_when_malformed(groups):
    stack = Stack(groups)
    reader = None  # never reached: the arguments are checked first
    with pytest.raises(ReplayError, match="tp_size must be >= 1"):
        next(iter_replay_targets(reader, [["a"]], stack.routers, tp_size=0))
    with pytest.raises(ReplayError, match="batches are a sequence of batches"):
        next(iter_replay_targets(reader, "ab", stack.routers))
    with pytest.raises(ReplayError, match="batches are a sequence of batches"):
        next(iter_replay_targets(reader, ["a", "b"], stack.routers))


def test_the_readme_training_snippets_run_as_written(groups, redis_url, namespace):
    request_ids, routes = _recorded(redis_url, namespace, [9, 14, 6])
    seq_len = 16
    context = {"url": redis_url, "namespace": namespace, "request_ids": request_ids,
               "model": Stack(groups), "seq_len": seq_len, "num_experts": EXPERTS,
               "hidden_states": torch.randn(seq_len, len(request_ids), HIDDEN)}
    exec(python_block("### Training with Megatron-Core").text, context)
    positions = [(i, p) for p in range(seq_len) for i in range(len(request_ids))]
    assert _chosen(context["routing_maps"][1]) == _expected(routes, 2, positions)
    exec(python_block("The RL frameworks' batch conventions").text, context)
    assert context["verl_batch"].shape == (3, seq_len, 3, TOPK)
    assert context["nemo_batch"].dtype == np.int8
    np.testing.assert_array_equal(context["slime_rows"], routes[0])


def test_batches_read_ahead_convert_to_the_same_targets(groups, redis_url, namespace):
    ids, routes = _recorded(redis_url, namespace, [9, 14, 6, 11])
    stack = Stack(groups)
    batches = [ids[:3], ids[3:]]
    with R3Reader(redis_url, namespace=namespace) as reader:
        got = list(iter_replay_targets(reader, batches, stack.routers))
        with pytest.raises(ReplayError, match="batch 1 holds no request ids"):
            next(iter_replay_targets(reader, (b for b in [ids[:1], []]), stack.routers))
    for names, (batch_routes, targets) in zip(batches, got):
        mine = [routes[ids.index(n)] for n in names]
        assert all(np.array_equal(a, b) for a, b in zip(batch_routes, mine))
        expected = replay_targets(stack.routers, mine,
                                  ReplayBatch(seq_len=max(map(len, mine)) + 1))
        assert all(np.array_equal(a, b) for a, b in zip(targets, expected))
    # Sequence- and context-parallel ranks: padded so that Megatron splits the batch evenly
    # (14 and 11 positions, a longest sequence's rows and last token, both padded to 16).
    with R3Reader(redis_url, namespace=namespace) as reader:
        split = list(iter_replay_targets(reader, batches, stack.routers, tp_rank=1, tp_size=2,
                                         cp_rank=1, cp_size=2))
    for names, (_, targets) in zip(batches, split):
        mine = [routes[ids.index(n)] for n in names]
        expected = replay_targets(stack.routers, mine, ReplayBatch(seq_len=16), tp_rank=1,
                                  tp_size=2, cp_rank=1, cp_size=2)
        assert len(targets[0]) == 16 // 2 // 2 * len(names)
        assert all(np.array_equal(a, b) for a, b in zip(targets, expected))


def test_batches_read_for_replay_refuse_a_rollout_recorded_from_a_later_position(
        groups, redis_url, namespace):
    # Recorded from position 5 (vLLM's routed_experts_prompt_start): replayed from
    # position 0, its rows would route other tokens.
    workload = [SimRequest("whole", list(range(100, 110)), list(range(6))),
                SimRequest("late", list(range(200, 210)), list(range(6)), prompt_start=5)]
    assert simulate(workload, LAYOUT, SimConfig(keep_manifests=True), store_url=redis_url,
                    namespace=namespace).failures == []
    stack = Stack(groups)
    with R3Reader(redis_url, namespace=namespace) as reader:
        assert len(next(iter_replay_targets(reader, [["whole"]], stack.routers))[0][0]) == 15
        with pytest.raises(ContractError, match="'late' was recorded from position 5"):
            next(iter_replay_targets(reader, [["whole", "late"]], stack.routers))


@pytest.mark.parametrize("backend", ["redis_url", "cluster_url"])
def test_the_trainer_script_replays_demo_rollouts_exactly(request, backend, namespace):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "trainer_megatron.py"
    result = subprocess.run(
        [sys.executable, str(script), request.getfixturevalue(backend), "--namespace", namespace,
         "--prompts", "2", "--samples", "3", "--layers", "4"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("100.00 % of tokens on the recorded experts") == 4


def test_routes_captured_from_a_transformers_model_replay_in_megatron(groups, redis_url,
                                                                      namespace):
    """A tiny Qwen3-MoE computes the routes (router hooks, capturer, connector, Redis);
    Megatron routers of the same width then route every recorded token the same way."""
    from r3cache.models import ModelRoutes, tiny_model

    routes_source = ModelRoutes(tiny_model("qwen3-moe-tiny", num_layers=2), 512, block_size=4)
    layout = routes_source.layout
    workload = [SimRequest(f"m{i}", list(range(5 + i, 25 + i)), list(range(40, 48 + i)))
                for i in range(3)]
    try:
        report = simulate(workload, layout, SimConfig(keep_manifests=True), store_url=redis_url,
                          namespace=namespace, routes=routes_source)
    finally:
        routes_source.close()
    assert report.failures == []
    ids = [r.req_id for r in workload]
    with R3Reader(redis_url, namespace=namespace) as reader:
        routes = reader.get_many(ids)
    stack = moe_stack(groups, num_layers=layout.num_layers,
                      moe_layers=range(1, layout.num_layers + 1), hidden=HIDDEN,
                      experts=layout.num_experts, topk=layout.topk)
    s = max(map(len, routes)) + 1
    with router_replay(stack, routes, ReplayBatch(seq_len=s, names=ids)):
        maps = stack(torch.randn(s, len(ids), HIDDEN))
    for i, rows in enumerate(routes):
        for layer, routing_map in enumerate(maps):
            got = chosen(routing_map)[np.arange(len(rows)) * len(ids) + i]
            np.testing.assert_array_equal(got, np.sort(rows[:, layer], axis=-1))


def test_a_recomputed_forward_replays_the_same_experts_again(groups, redis_url, namespace):
    ids, routes = _recorded(redis_url, namespace, [9, 6])
    stack = Stack(groups)
    hidden = torch.randn(12, 2, HIDDEN)
    with router_replay(stack, routes, ReplayBatch(seq_len=12, names=ids)) as replay:
        first = stack(hidden)
        replay.recompute()  # activation checkpointing: the backward recomputes the forward
        again = stack(torch.randn(12, 2, HIDDEN))  # other activations, same recorded routes
    assert [_chosen(m) for m in again] == [_chosen(m) for m in first]


@pytest.mark.parametrize("pattern", [1, [1, 0, 1, 1]])
def test_moe_only_routes_map_to_a_pipeline_stages_routers_by_their_layers(groups, pattern):
    """Under pipeline parallelism a stage holds some of the model's routers: with routes of
    MoE layers only, each replays its place among all the model's MoE layers (counted by
    moe_layer_freq up to its global layer number), not its place on the stage."""
    moe = [n for n in range(1, 5) if pattern == 1 or pattern[n - 1]]
    stack = moe_stack(groups, num_layers=4, moe_layers=moe, hidden=HIDDEN, experts=EXPERTS,
                      topk=TOPK, moe_layer_freq=pattern, pipeline_model_parallel_size=2,
                      pipeline_dtype=torch.float32)
    routes = _random_routes(7, 4, (9, 6))
    moe_only = [r[:, [n - 1 for n in moe]] for r in routes]
    batch = ReplayBatch(seq_len=12, names=["a", "b"])
    full = replay_targets(stack.routers, routes, batch)  # every layer: global numbers
    second = [r for r in stack.routers if r.layer_number > 2]  # the second stage's routers
    targets = replay_targets(second, moe_only, batch, layers="moe")
    assert len(targets) == len(second) >= 1
    assert all(np.array_equal(t, f) for t, f in zip(targets, full[-len(second):]))
    # A pattern that has no MoE layer where a router sits is a mismatch, not a guess.
    stack.config.moe_layer_freq = [1, 1, 1, 0]
    with pytest.raises(ReplayError, match="decoder layer 4 has a router"):
        replay_targets(second, moe_only, batch, layers="moe")


def _random_routes(seed: int, layers: int, lengths) -> list[np.ndarray]:
    """Valid routes of the given lengths: TOPK distinct experts in every (token, layer)."""
    rng = np.random.default_rng(seed)
    return [np.argsort(rng.random((n, layers, EXPERTS)), axis=-1)[..., :TOPK].astype(np.uint8)
            for n in lengths]


def _context_parallel_rank(rank: int, port: int) -> None:
    """One rank of a real two-process context-parallel group (gloo): Megatron's own
    get_batch_on_this_cp_rank slices the batch; router_replay, with its defaults, reads the
    rank from Megatron's parallel state and replays exactly the tokens this rank holds."""
    import os

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_batch_on_this_cp_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
    stack = moe_stack(ProcessGroupCollection.use_mpu_process_groups(), num_layers=3,
                      moe_layers=(1, 3), hidden=HIDDEN, experts=EXPERTS, topk=TOPK,
                      context_parallel_size=2)
    routes = _random_routes(11, 3, (9, 14, 6))
    s, b = 16, len(routes)
    local = get_batch_on_this_cp_rank({"position_ids": torch.arange(s).repeat(b, 1)})
    positions = local["position_ids"].numpy()  # [b, s / cp]: this rank's positions
    with router_replay(stack, routes, ReplayBatch(seq_len=s)):
        replayed = stack(torch.randn(positions.shape[1], b, HIDDEN))
    mine = [(i, int(positions[i, p])) for p in range(positions.shape[1]) for i in range(b)]
    for router_maps, column in zip(replayed, (0, 2)):
        assert _chosen(router_maps) == _expected(routes, column, mine)
    torch.distributed.destroy_process_group()


def test_context_parallel_ranks_each_replay_the_chunks_megatron_gives_them():
    torch.multiprocessing.spawn(_context_parallel_rank, args=(free_port(),), nprocs=2)
