"""Trainer read-back: R3Reader.get_many against a raw MGET of the same stored bytes.

Starts its own redis-server and 6-node cluster, records --requests requests of
--tokens tokens (L=48, K=8) as manifests over stored blocks, then reads them back
--per-call requests at a time through get_many (manifests, blocks, decoding,
checksums and validation included) and, in the same run, fetches the same stored
bytes with a raw redis-py MGET (mget_nonatomic on the cluster) without decoding,
in --rounds paired rounds whose order alternates; tokens/s are medians over the
rounds, and "vs raw" is the median of the per-round ratios.
Both block codecs a namespace can choose are measured: lz4 (the default) and raw.

    python scripts/bench_read.py [--requests 256 --tokens 8192] [--codec lz4|raw]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import redis

from r3cache import Completion, R3Reader, RoutingLayout, open_store
from r3cache.manifest import BlockRef, Manifest
from r3cache.sim import oracle_rows
from r3cache.testing import RedisClusterProcesses, RedisServer

LAYOUT = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)


def record(url: str, namespace: str, requests: int, tokens: int, codec: str,
           layout: RoutingLayout = LAYOUT) -> list[str]:
    """Store each request's full blocks and a manifest naming them, as the worker does."""
    rng = np.random.default_rng(0)
    store = open_store(url, layout=layout, namespace=namespace, idle_ttl=3600, codec=codec)
    ids = []
    bs = layout.block_size
    for r in range(requests):
        rows = oracle_rows(rng.integers(0, 151_936, tokens), layout)[: tokens - 1]
        full = (tokens - 1) // bs
        keys = [f"{r:06x}{j:058x}" for j in range(full)]
        blocks = {k: rows[j * bs : (j + 1) * bs] for j, k in enumerate(keys)}
        segments = [BlockRef(k, 0, bs) for k in keys] + [rows[full * bs :]]
        manifest = Manifest(f"req-{r}", layout.fingerprint, Completion(0, tokens), segments)
        store.put(blocks, manifests=[manifest])
        ids.append(manifest.request_id)
    store.close()
    return ids


def bench(label: str, url: str, raw, args) -> list[str]:
    return [line for codec in args.codec for line in
            bench_codec(f"{label} {codec}", url, raw, args, codec)]


def bench_codec(label: str, url: str, raw, args, codec: str) -> list[str]:
    namespace = f"bench-read-{label.replace(' ', '-')}"
    ids = record(url, namespace, args.requests, args.tokens, codec)
    calls = [ids[at : at + args.per_call] for at in range(0, len(ids), args.per_call)]
    mget = raw.mget_nonatomic if hasattr(raw, "mget_nonatomic") else raw.mget
    with R3Reader(url, namespace=namespace) as reader:
        reader.get_many(calls[0])  # warm the connection pool
        keys = [reader.store.keys.block(k) for m in reader.store.get_manifests(ids)
                for k in m.block_keys]
        per_call_keys = len(keys) // len(calls)

        def ours() -> tuple[float, int]:
            began = time.perf_counter()
            rows = sum(len(r) for call in calls for r in reader.get_many(call))
            return time.perf_counter() - began, rows

        def theirs() -> tuple[float, int]:
            began = time.perf_counter()
            stored = sum(len(v) for at in range(0, len(keys), per_call_keys)
                         for v in mget(keys[at : at + per_call_keys]))
            return time.perf_counter() - began, stored

        # Rounds alternate which one goes first; a ratio is taken within a round, so a
        # slow spell of this shared VM weighs on both sides of it.
        pairs = []
        for n in range(args.rounds):
            if n % 2:
                t = theirs()
                pairs.append((ours(), t))
            else:
                pairs.append((ours(), theirs()))
    rows, stored = pairs[0][0][1], pairs[0][1][1]
    ours_s = statistics.median(o[0] for o, _ in pairs)
    theirs_s = statistics.median(t[0] for _, t in pairs)
    ratio = statistics.median(t[0] / o[0] for o, t in pairs)
    raw_bytes = rows * LAYOUT.row_nbytes
    return [
        f"{label + ': R3Reader.get_many':40s} {rows / ours_s:14,.0f} "
        f"{raw_bytes / ours_s / 1e6:9.1f} {ratio:8.2f}",
        f"{label + ': raw MGET of the blocks':40s} {rows / theirs_s:14,.0f} "
        f"{stored / theirs_s / 1e6:9.1f} {1:8.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--per-call", type=int, default=8, help="requests per get_many")
    parser.add_argument("--rounds", type=int, default=5,
                        help="paired rounds (get_many and raw MGET) per case; medians shown")
    parser.add_argument("--codec", action="append", choices=("lz4", "raw"),
                        help="the namespace's block codec (repeatable; default: both)")
    args = parser.parse_args()
    args.codec = args.codec or ["lz4", "raw"]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, redis-py {redis.__version__}; {args.requests} "
          f"requests x {args.tokens} tokens, layout {LAYOUT.fingerprint}, "
          f"{args.per_call} requests per get_many; medians of {args.rounds} paired rounds")
    print(f"{'case':40s} {'tokens/s':>14s} {'MB/s':>9s} {'vs raw':>8s}")
    with RedisServer() as server:
        print("\n".join(bench("standalone", server.url, server.client(), args)))
    with RedisClusterProcesses() as cluster:
        raw = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        print("\n".join(bench("cluster", cluster.url, raw, args)))
        raw.close()


if __name__ == "__main__":
    main()
