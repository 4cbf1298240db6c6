"""The SGLang plugin's cost per finished request: RequestPublisher.publish against SGLang's
own inline hand-out of the same rows.

A GRPO workload (--groups prompts of --prompt tokens, --samples responses of --response
tokens each; L=48, K=8, E=128 as Qwen3-30B-A3B) as SGLang finishes it: for every request,
int32 rows ``(seqlen - 1, L, K)``, the prompt's rows shared by its group. Per request, in
paired rounds whose order alternates:

- inline: what SGLang does with the rows when r3cache is not there (base64 of the raw
  int32 bytes in its detokenizer, with pybase64 where installed, as SGLang does) and what
  its client does with them (decode, reshape);
- publish: what the plugin does on SGLang's scheduler thread (check, cast to uint8, hash
  the token ids, hand blocks and manifest to the writer), on the embedded store and on a
  standalone Redis (helper-process writer), flushed at the end of each round.

Host milliseconds per request are medians over the rounds; "vs inline" is the median of
the per-round ratios. Bytes: what the responses carry inline against what the store holds.

    OMP_NUM_THREADS=1 python scripts/bench_publish.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import base64
import os
import platform
import statistics
import time

import numpy as np

from r3cache import RoutingLayout, open_store
from r3cache.connector.publisher import RequestPublisher
from r3cache.testing import RedisServer

LAYOUT = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)

try:
    import pybase64 as b64
except ImportError:  # SGLang's choice; the standard library's is slower
    b64 = base64


def workload(args) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(request id, token ids, int32 rows) of every request, as SGLang finishes them."""
    rng = np.random.default_rng(0)
    requests = []
    for g in range(args.groups):
        prompt = rng.integers(0, 151_936, args.prompt)
        prompt_rows = _rows(rng, args.prompt)
        for s in range(args.samples):
            tokens = np.concatenate([prompt, rng.integers(0, 151_936, args.response)])
            rows = np.concatenate([prompt_rows, _rows(rng, args.response - 1)])
            requests.append((f"g{g}-s{s}", tokens, rows))
    return requests


def _rows(rng, n: int) -> np.ndarray:
    picks = rng.random((n, LAYOUT.num_layers, LAYOUT.num_experts)).argsort(axis=-1)
    return picks[..., : LAYOUT.topk].astype(np.int32)


def inline(requests) -> tuple[float, int]:
    began, sent = time.perf_counter(), 0
    for _, _, rows in requests:
        text = b64.b64encode(rows.tobytes()).decode()  # SGLang's detokenizer
        sent += len(text)
        back = np.frombuffer(b64.b64decode(text), dtype=np.int32)  # its client
        back.reshape(-1, LAYOUT.num_layers, LAYOUT.topk)
    return (time.perf_counter() - began) / len(requests), sent


def publish(publisher: RequestPublisher, requests, round_: int) -> float:
    began = time.perf_counter()
    for request_id, tokens, rows in requests:
        publisher.publish(f"{request_id}-r{round_}", tokens, rows)
    seconds = (time.perf_counter() - began) / len(requests)
    publisher.flush()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    requests = workload(args)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"{len(requests)} requests of {args.prompt}+{args.response} tokens "
          f"({args.groups} prompts x {args.samples}), base64: {b64.__name__}")
    with RedisServer() as server:
        stores = {"memory": "memory://", "redis": server.url}
        publishers = {name: RequestPublisher(layout=LAYOUT, store=open_store(
            url, layout=LAYOUT, namespace=f"bench-publish-{name}",
            **({"idle_ttl": 600} if name == "redis" else {"max_bytes": 4 << 30})))
            for name, url in stores.items()}
        times: dict[str, list[float]] = {"inline": [], **{n: [] for n in publishers}}
        for round_ in range(args.rounds):
            order = ["inline", *publishers]
            for name in order if round_ % 2 == 0 else order[::-1]:
                if name == "inline":
                    seconds, sent = inline(requests)
                else:
                    seconds = publish(publishers[name], requests, round_)
                times[name].append(seconds)
        stored = publishers["redis"].store.stats().bytes_used
        for publisher in publishers.values():
            publisher.close()
    base = statistics.median(times["inline"])
    print(f"  {'inline (base64 int32)':24} {base * 1e3:7.3f} ms/request")
    for name in publishers:
        ratio = statistics.median(t / i for t, i in zip(times[name], times["inline"]))
        print(f"  {'publish, ' + name:24} {statistics.median(times[name]) * 1e3:7.3f} "
              f"ms/request  {ratio:.2f}x inline")
    print(f"  bytes: {sent / 1e6:.1f} MB inline in the responses, {stored / 1e6:.1f} MB "
          "in Redis (lz4; a prompt's blocks once per group)")


if __name__ == "__main__":
    main()
