"""Rollouts into Redis, then replayed by Megatron-Core routers, as a Megatron trainer does.

Phase 1 runs the demo's GRPO workload through the simulated engine into the store at URL
(manifests kept). Phase 2 reads every request back with R3Reader, builds Megatron replay
targets (padded [s, b] batches, sequence-major, int64) and replays them through a stack of
real megatron-core TopKRouters, one per layer. It prints each layer's agreement between
the experts the routers chose and the recorded ones (must be 100 %), and the read rate of
R3Reader.get_many alone against read + conversion to replay targets.

    python scripts/trainer_megatron.py redis://127.0.0.1:6379/0 [--prompts 8 --samples 4]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from r3cache import R3Reader, RoutingLayout
from r3cache.integrations.megatron import ReplayBatch, iter_replay_targets, router_replay
from r3cache.integrations.megatron_stack import chosen, moe_stack, process_groups
from r3cache.sim import SimConfig, grpo_workload, simulate
from r3cache.testing import free_port


def produce(args: argparse.Namespace, layout: RoutingLayout) -> list[str]:
    workload = grpo_workload(num_prompts=args.prompts, samples=args.samples, seed=0)
    config = SimConfig(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=512,
                       num_spec_tokens=3, async_depth=2, keep_manifests=True, seed=0)
    report = simulate(workload, layout, config, store_url=args.url, namespace=args.namespace)
    if not report.ok:
        sys.exit(f"the engine run failed verification: {report.failures[:5]}")
    return sorted(report.online)


def read_rates(reader: R3Reader, ids: list[str], routers, batch: int) -> tuple[float, float]:
    """Tokens/s of get_many alone and of iter_replay_targets (read + conversion to replay
    targets, the next batch read while one is converted), 5 paired rounds."""
    batches = [ids[at : at + batch] for at in range(0, len(ids), batch)]
    plain, converted = [], []
    for _ in range(5):
        began = time.perf_counter()
        rows = sum(len(r) for names in batches
                   for r in reader.get_many(names, prompt_start=0))
        plain.append(rows / (time.perf_counter() - began))
        began = time.perf_counter()
        for _routes, _targets in iter_replay_targets(reader, batches, routers):
            pass
        converted.append(rows / (time.perf_counter() - began))
    return float(np.median(plain)), float(np.median(converted))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--namespace", default="megatron@demo")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="sequences per training batch")
    args = parser.parse_args()
    layout = RoutingLayout(args.layers, 8, 128, 16)
    ids = produce(args, layout)
    stack = moe_stack(process_groups(free_port()), num_layers=layout.num_layers,
                      moe_layers=range(1, layout.num_layers + 1), hidden=64,
                      experts=layout.num_experts, topk=layout.topk)
    import torch

    agree = np.zeros(layout.num_layers)
    total = 0
    with R3Reader(args.url, namespace=args.namespace) as reader:
        for at in range(0, len(ids), args.batch):
            names = ids[at : at + args.batch]
            routes = reader.get_many(names, prompt_start=0)
            s, b = max(map(len, routes)) + 1, len(routes)
            with router_replay(stack, routes, ReplayBatch(seq_len=s, names=names)):
                maps = stack(torch.randn(s, b, 64))
            for i, rows in enumerate(routes):  # token (p, i) is row p * b + i
                for layer, routing_map in enumerate(maps):
                    got = chosen(routing_map)[np.arange(len(rows)) * b + i]
                    agree[layer] += (got == np.sort(rows[:, layer], axis=-1)).all(-1).sum()
                total += len(rows)
        plain, converted = read_rates(reader, ids, stack.routers, args.batch)
    print(f"{len(ids)} requests, {total} recorded tokens replayed through "
          f"{layout.num_layers} Megatron TopKRouters (top-{layout.topk} of "
          f"{layout.num_experts})")
    for layer, count in enumerate(agree):
        print(f"  layer {layer:2d}: {100 * count / total:6.2f} % of tokens on the recorded experts")
    print(f"read: get_many {plain:,.0f} tokens/s; get_many + replay targets {converted:,.0f} "
          f"tokens/s ({converted / plain:.2f}x)")
    return 0 if (agree == total).all() else 1


if __name__ == "__main__":
    sys.exit(main())
