"""Redis memory per routed token of real MoE layouts: what `maxmemory` has to hold.

Starts its own redis-server. For each model's layout (every decoder layer recorded, as
vLLM and SGLang do) it stores --requests requests of --tokens tokens as the engine
does (full blocks, each held by its request's manifest) and reads Redis's own
`used_memory` before and after: bytes per token while held (a trainer has not read
them yet). It then releases the manifests and measures again: bytes per token of idle
blocks, which carry the idle TTL and are what `volatile-lru` may evict.

    python scripts/sizing.py [--requests 16 --tokens 4096]
"""

from __future__ import annotations

import argparse

from bench_read import record

from r3cache import R3Reader, RoutingLayout
from r3cache.testing import RedisServer

# name: (decoder layers, experts per token, routed experts), from each model's config.
MODELS = {
    "Mixtral-8x7B": (32, 2, 8),
    "gpt-oss-120b": (36, 4, 128),
    "Qwen3-30B-A3B": (48, 8, 128),
    "DeepSeek-V3": (61, 8, 256),
    "Kimi-K2": (61, 8, 384),
    "Qwen3-235B-A22B": (94, 8, 128),
}


def used_memory(client) -> int:
    return int(client.info("memory")["used_memory"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per request")
    args = parser.parse_args()
    print(f"{'model':16s} {'layout':28s} {'raw B/token':>11s} {'held B/token':>12s} "
          f"{'idle B/token':>12s} {'held/raw':>8s}")
    with RedisServer() as server:
        client = server.client()
        for name, (layers, topk, experts) in MODELS.items():
            client.flushall()
            layout = RoutingLayout(num_layers=layers, topk=topk, num_experts=experts,
                                   block_size=16)
            namespace = f"sizing-{name}"
            before = used_memory(client)
            ids = record(server.url, namespace, args.requests, args.tokens, "lz4", layout)
            held = used_memory(client) - before
            with R3Reader(server.url, namespace=namespace) as reader:
                reader.release(*ids)
            idle = used_memory(client) - before
            # Rows kept: the full blocks of each request (its last partial block is
            # stored inline in the manifest).
            tokens = args.requests * ((args.tokens - 1) // 16 * 16)
            raw = layers * topk * layout.dtype.itemsize
            print(f"{name:16s} {layout.fingerprint:28s} {raw:11d} {held / tokens:12.1f} "
                  f"{idle / tokens:12.1f} {held / tokens / raw:7.3f}x")


if __name__ == "__main__":
    main()
