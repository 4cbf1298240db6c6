"""What recording a GRPO group's manifests costs the Redis store, beside its blocks' put.

Starts its own redis-server and 6-node cluster on free loopback ports. Each group is
``--samples`` requests of one ``--prompt``-token prompt, each with ``--response`` tokens
of its own, as an engine publishes them: the prompt's blocks and every response's blocks
put and held (``store.put(blocks, retain_keys=...)``), then the group's finished
requests recorded (``store.put({}, release_keys=..., manifests=...)``: each manifest
holds the prompt's blocks and its response's as its own owner). Per group, the writer's
CPU time (``time.process_time``) and wall time of each of the two puts; printed are the
medians over groups and the median of the per-group ratios (manifests / blocks).

    python scripts/bench_manifests.py [--groups 12] [--samples 16] [--prompt 8192]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from r3cache import RoutingLayout, open_store
from r3cache.manifest import BlockSpan, Completion, Manifest
from r3cache.sim import oracle_rows
from r3cache.testing import RedisClusterProcesses, RedisServer

LAYOUT = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)


def group(g: int, samples: int, prompt: int, response: int):
    """One group's blocks by key, and its manifests (whole blocks by key, the response's
    partial last block inline)."""
    bs = LAYOUT.block_size
    rng = np.random.default_rng(g)
    tokens = prompt + response
    prompt_keys = [f"g{g}p{i}" for i in range(prompt // bs)]
    rows = oracle_rows(rng.integers(0, 151_936, prompt), LAYOUT)
    blocks = {k: rows[i * bs : (i + 1) * bs] for i, k in enumerate(prompt_keys)}
    manifests = []
    for s in range(samples):
        own = oracle_rows(rng.integers(0, 151_936, response), LAYOUT)
        whole = (tokens - 1) // bs - len(prompt_keys)  # the last token routes nothing
        keys = [f"g{g}s{s}r{i}" for i in range(whole)]
        blocks.update((k, own[i * bs : (i + 1) * bs]) for i, k in enumerate(keys))
        tail = own[whole * bs : tokens - 1 - prompt]
        manifests.append(Manifest(f"g{g}-s{s}", LAYOUT.fingerprint, Completion(0, tokens),
                                  BlockSpan([], prompt_keys + keys, [tail], bs)))
    return blocks, manifests


def timed(fn, *args, **kwargs) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn(*args, **kwargs)
    return time.process_time() - cpu, time.perf_counter() - wall


def run(url: str, args) -> str:
    store = open_store(url, layout=LAYOUT, namespace=f"bench-manifests-{os.getpid()}")
    blocks_cpu, blocks_wall, manifests_cpu, manifests_wall = [], [], [], []
    recorded = []
    try:
        for g in range(args.groups):
            blocks, manifests = group(g, args.samples, args.prompt, args.response)
            keys = list(blocks)
            cpu, wall = timed(store.put, blocks, retain_keys=keys)
            blocks_cpu.append(cpu)
            blocks_wall.append(wall)
            cpu, wall = timed(store.put, {}, release_keys=keys, manifests=manifests)
            manifests_cpu.append(cpu)
            manifests_wall.append(wall)
            recorded += [m.request_id for m in manifests]
        store.release_manifests(recorded)
    finally:
        store.close()
    ratio = np.median(np.array(manifests_wall) / np.array(blocks_wall))
    return (f"blocks {np.median(blocks_cpu) * 1e3:7.1f} ms CPU {np.median(blocks_wall) * 1e3:7.1f}"
            f" ms wall; manifests {np.median(manifests_cpu) * 1e3:7.1f} ms CPU "
            f"{np.median(manifests_wall) * 1e3:7.1f} ms wall; manifests / blocks "
            f"{ratio:.2f} (wall)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--response", type=int, default=1024)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; layout "
          f"{LAYOUT.fingerprint}; {args.samples} samples of a {args.prompt}-token prompt, "
          f"{args.response} response tokens each, {args.groups} groups")
    with RedisServer() as server:
        print(f"standalone  {run(server.url, args)}")
    with RedisClusterProcesses() as cluster:
        print(f"cluster     {run(cluster.url, args)}")


if __name__ == "__main__":
    main()
