"""Publication and read-back throughput of the Redis store, beside raw redis-py.

Starts its own redis-server and 6-node cluster on free loopback ports, then, for
each, measures in the same run:

  r3cache put      store.put(blocks, retain_keys=...) in batches of --batch blocks
                   (lz4 codec, Lua holds, one script call per node per batch)
  raw SET          a redis-py pipeline of SET of the same encoded bytes
  r3cache get      store.get_concatenated(keys) per request of --request-tokens tokens
  raw MGET         MGET of the same keys (mget_nonatomic on the cluster)

and the stored bytes per token (MEMORY USAGE of sampled block keys, plus their
reference-count hashes while held) against raw uint8 and int32 rows.

    python scripts/bench_store.py [--blocks 4096]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import redis

from r3cache import RoutingLayout, codec, open_store
from r3cache.sim import oracle_rows
from r3cache.testing import RedisClusterProcesses, RedisServer

LAYOUT = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)
BLOCK_TOKENS = LAYOUT.block_size


def make_blocks(count: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Routing rows of random sequences, as the oracle routes them."""
    rng = np.random.default_rng(seed)
    rows = oracle_rows(rng.integers(0, 151_936, count * BLOCK_TOKENS), LAYOUT)
    return {f"{seed:02x}{i:014x}": rows[i * 16 : (i + 1) * 16] for i in range(count)}


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def rate_row(name: str, blocks: int, nbytes: int, seconds: float) -> str:
    tokens = blocks * BLOCK_TOKENS
    return (f"{name:34s} {blocks / seconds:12,.0f} {tokens / seconds:14,.0f} "
            f"{nbytes / seconds / 1e6:9.1f}")


def bench(label: str, url: str, raw, blocks: dict[str, np.ndarray], batch: int,
          request_blocks: int, repeats: int) -> tuple[list[str], str]:
    """Median of ``repeats`` runs, each into a fresh namespace and fresh raw keys."""
    runs = [run(f"{label}-{r}", url, raw, blocks, batch, request_blocks) for r in range(repeats)]
    seconds = np.median(np.array([times for times, _ in runs]), axis=0)
    keys, stored = len(blocks), runs[0][1]
    raw_bytes = keys * LAYOUT.block_nbytes
    rows = [
        rate_row(f"{label}: r3cache put (+hold)", keys, raw_bytes, seconds[0]),
        rate_row(f"{label}: raw pipelined SET", keys, stored, seconds[1]),
        rate_row(f"{label}: r3cache get", keys, raw_bytes, seconds[2]),
        rate_row(f"{label}: raw MGET", keys, stored, seconds[3]),
    ]
    return rows, memory_line(label, url, blocks)


def run(label: str, url: str, raw, blocks: dict[str, np.ndarray], batch: int,
        request_blocks: int) -> tuple[list[float], int]:
    keys = list(blocks)
    store = open_store(url, layout=LAYOUT, namespace=f"bench-{label}", idle_ttl=600)

    def publish():
        for at in range(0, len(keys), batch):
            chunk = keys[at : at + batch]
            store.put({k: blocks[k] for k in chunk}, retain_keys=chunk)

    put_s = timed(publish)
    encoded = {f"raw:{label}:{{{k}}}".encode(): codec.encode_rows(blocks[k], LAYOUT)
               for k in keys}
    raw_keys = list(encoded)

    def raw_set():
        for at in range(0, len(raw_keys), batch):
            pipe = raw.pipeline(transaction=False)
            for k in raw_keys[at : at + batch]:
                pipe.set(k, encoded[k])
            pipe.execute()

    set_s = timed(raw_set)
    requests = [keys[at : at + request_blocks] for at in range(0, len(keys), request_blocks)]
    store.get_concatenated(requests[0])  # warm the connection pool
    get_s = timed(lambda: [store.get_concatenated(r) for r in requests])
    raw_requests = [raw_keys[at : at + request_blocks]
                    for at in range(0, len(raw_keys), request_blocks)]
    mget = raw.mget_nonatomic if hasattr(raw, "mget_nonatomic") else raw.mget
    mget_s = timed(lambda: [mget(r) for r in raw_requests])
    stored = sum(len(v) for v in encoded.values())
    store.put({}, release_keys=keys)
    store.close()
    return [put_s, set_s, get_s, mget_s], stored


def memory_line(label: str, url: str, blocks: dict[str, np.ndarray]) -> str:
    """Stored bytes per token, idle and held, from MEMORY USAGE of sampled keys."""
    store = open_store(url, layout=LAYOUT, namespace=f"bench-{label}-0", idle_ttl=600)
    sample = list(blocks)[:: max(1, len(blocks) // 256)]
    store.put({}, retain_keys=sample)
    block_usage = np.mean([store.client_for(store.keys.block(k)).memory_usage(
        store.keys.block(k)) for k in sample])
    refs_usage = np.mean([store.client_for(store.keys.refs(k)).memory_usage(
        store.keys.refs(k)) for k in sample])
    payloads = [codec.encode_rows(blocks[k], LAYOUT) for k in sample]
    payload = np.mean([len(p) for p in payloads])
    # The same bytes under a one-byte key: what Redis and its allocator cost anyway.
    probe = store.client_for(b"~")
    bare = []
    for data in payloads:
        probe.set(b"~", data)
        bare.append(probe.memory_usage(b"~"))
    probe.delete(b"~")
    store.close()
    return (
        f"{label}: {block_usage / BLOCK_TOKENS:.1f} B/token stored idle, "
        f"{(block_usage + refs_usage) / BLOCK_TOKENS:.1f} held (+ reference hash); raw uint8 "
        f"{LAYOUT.row_nbytes} B, int32 {LAYOUT.num_layers * LAYOUT.topk * 4} B; codec payload "
        f"{payload / BLOCK_TOKENS:.1f} B/token.\n  {label}: over the payload, "
        f"{(np.mean(bare) - payload) / payload * 100:.1f} % is Redis and allocator size "
        f"classes for any value of this size; key names add "
        f"{(block_usage - np.mean(bare)) / payload * 100:.1f} % idle, and the reference "
        f"hash {(block_usage + refs_usage - np.mean(bare)) / payload * 100:.1f} % while held"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256, help="blocks per put")
    parser.add_argument("--request-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="runs; the median is shown")
    args = parser.parse_args()
    blocks = make_blocks(args.blocks)
    request_blocks = args.request_tokens // BLOCK_TOKENS
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, redis-py {redis.__version__}, layout "
          f"{LAYOUT.fingerprint}; {args.blocks} blocks of {LAYOUT.block_nbytes} B, "
          f"{args.batch} per put, {args.request_tokens} tokens per get, median of "
          f"{args.repeats} runs")
    print(f"{'case':34s} {'blocks/s':>12s} {'tokens/s':>14s} {'MB/s':>9s}")
    memory = []
    with RedisServer() as server:
        rows, mem = bench("standalone", server.url, server.client(), blocks, args.batch,
                          request_blocks, args.repeats)
        print("\n".join(rows))
        memory.append(mem)
    with RedisClusterProcesses() as cluster:
        raw = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        rows, mem = bench("cluster", cluster.url, raw, blocks, args.batch, request_blocks,
                          args.repeats)
        print("\n".join(rows))
        memory.append(mem)
        raw.close()
    print("\n".join(memory))


if __name__ == "__main__":
    main()
