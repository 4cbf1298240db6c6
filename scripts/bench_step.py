"""Host time per engine step of the worker connector's hot path, per store.

Measures begin_step + prepare_output + enqueue_cpu_copy + process_output, the calls
an inference engine makes every step, for:

  (a) 256 running requests decoding one token each
  (b) 8192-token prefill steps (8 new requests x 1024 prompt tokens)
  (c) 64 requests x 4 speculative tokens with random rejections
  (d) prefix sharing: groups of 8 requests on one 2048-token prompt, 7 of them hits

against the embedded store and, with --redis, a redis-server and a 6-node cluster
that the script starts itself (two tiers: the connector's in-process tier in front
of Redis; writes by a thread, and by a helper process: "/proc"), printing each
store's ratio to the embedded store. --store URL adds any other store. Each case runs
on every store in turn, --repeats times; a ratio is the median over repeats of the
store's median against a memory-store run of the same case right next to it.
Layout: L=48, K=8, 128 experts (uint8), block size 16.

By default steps run back to back: the connector, the writer and every redis-server
compete for the cores all the time, which no engine does (each step waits on the GPU
for its forward). --gpu-ms N sleeps N ms per step where the forward would run, not
counted in the step's host time, so background writes get the idle CPU they would get.

    python scripts/bench_step.py [--steps 400] [--repeats 4] [--redis] [--store URL]
                                 [--gpu-ms 5]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import time

import numpy as np

from r3cache import RoutingLayout, StepBatch, StepMetadata, WorkerConnector, open_store
from r3cache.sim import oracle_rows

LAYOUT = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)
_RUN = [0]  # a fresh namespace per driver, so no run reads another's blocks


def _hash(req: str, block: int) -> bytes:
    return hashlib.sha256(f"{req}/{block}".encode()).digest()


class Driver:
    """Own a worker connector and the scheduler-side bookkeeping a benchmark needs."""

    url = "memory://"
    writer = "thread"
    gpu_ms = 0.0

    def __init__(self, max_num_seqs: int, max_tokens: int) -> None:
        store = open_store(Driver.url, layout=LAYOUT, namespace=f"bench-step-{_RUN[0]}")
        _RUN[0] += 1
        self.worker = WorkerConnector(layout=LAYOUT, store=store, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_tokens, writer=Driver.writer)
        self.rng = np.random.default_rng(0)
        # Routes a router could pick (distinct experts per token and layer).
        self.rows = oracle_rows(self.rng.integers(0, 151_936, max_tokens).tolist(), LAYOUT)
        self.times: list[float] = []

    def step(self, metadata, req_ids, starts, counts, rejected=None, measure=True) -> dict:
        qsl = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        sampled = np.ones(len(req_ids), np.int64) if rejected is None else counts - rejected
        rejected = np.zeros(len(req_ids), np.int64) if rejected is None else rejected
        began = time.perf_counter()
        self.worker.begin_step(metadata)
        spent = time.perf_counter() - began
        if Driver.gpu_ms:
            time.sleep(Driver.gpu_ms / 1e3)  # the forward: the host waits on the GPU
        began = time.perf_counter()
        pending = self.worker.prepare_output(StepBatch(req_ids, starts, qsl),
                                             routed_experts=self.rows)
        pending.enqueue_cpu_copy(sampled, rejected)
        outputs = self.worker.process_output(pending)
        if measure:
            self.times.append(spent + time.perf_counter() - began)
        return outputs

    def close(self) -> None:
        self.worker.close()


def bench_decode(steps: int) -> list[float]:
    n = 256
    d = Driver(n, 8192)
    ids = [f"d{i}" for i in range(n)]
    # Staggered positions, so a sixteenth of the requests completes a block each step.
    pos = 1024 + np.arange(n, dtype=np.int64) % 16
    ones = np.ones(n, np.int64)
    # Register mid-generation (a prefix hit owed rows from `pos`): prefill is not measured.
    d.step(StepMetadata(0, {r: int(p) for r, p in zip(ids, pos)},
                        {r: [_hash(r, b) for b in range(int(p) // 16)] for r, p in zip(ids, pos)}),
           ids, pos.copy(), ones, measure=False)
    pos += 1
    for _ in range(steps + 20):
        full = pos + 1
        hashes = {r: [_hash(r, int(p) // 16 - 1)] for r, p in zip(ids, full) if p % 16 == 0}
        d.step(StepMetadata(0, {}, hashes), ids, pos.copy(), ones)
        pos += 1
    d.close()
    return d.times[20:]


def bench_prefill(steps: int) -> list[float]:
    d = Driver(16, 8192)
    counts = np.full(8, 1024, np.int64)
    previous: list[str] = []
    for s in range(steps + 5):
        ids = [f"p{s}-{i}" for i in range(8)]
        metadata = StepMetadata(0, dict.fromkeys(ids, 0),
                                {r: [_hash(r, b) for b in range(64)] for r in ids}, previous)
        d.step(metadata, ids, np.zeros(8, np.int64), counts)
        previous = ids
    d.close()
    return d.times[5:]


def bench_spec(steps: int) -> list[float]:
    n, q = 64, 5
    d = Driver(n, 8192)
    ids = [f"s{i}" for i in range(n)]
    pos = 512 + np.arange(n, dtype=np.int64) * 3 % 16
    d.step(StepMetadata(0, {r: int(p) for r, p in zip(ids, pos)}, {}), ids, pos.copy(),
           np.ones(n, np.int64), measure=False)
    pos += 1
    counts = np.full(n, q, np.int64)
    sent = pos // 16
    for _ in range(steps + 20):
        rejected = d.rng.integers(0, q, n)
        hashes = {}
        for i, r in enumerate(ids):
            blocks = int(pos[i]) // 16
            if blocks > sent[i]:
                hashes[r] = [_hash(r, b) for b in range(int(sent[i]), blocks)]
                sent[i] = blocks
        d.step(StepMetadata(0, {}, hashes), ids, pos.copy(), counts, rejected)
        pos += q - rejected
    d.close()
    return d.times[20:]


def bench_prefix(steps: int) -> list[float]:
    d = Driver(16, 8192)
    prompt_blocks = 2048 // 16
    groups = max(steps // 2, 1)
    previous: list[str] = []
    for g in range(groups + 2):
        producer, consumers = f"g{g}-0", [f"g{g}-{i}" for i in range(1, 8)]
        shared = [_hash(f"g{g}", b) for b in range(prompt_blocks)]
        d.step(StepMetadata(0, {producer: 0}, {producer: shared}, previous), [producer],
               np.zeros(1, np.int64), np.array([2048]), measure=g >= 2)
        # The other seven hit the whole prompt and run their own first 16 tokens.
        hashes = {r: shared for r in consumers}
        d.step(StepMetadata(0, dict.fromkeys(consumers, 0), hashes), consumers,
               np.full(7, 2048, np.int64), np.full(7, 16), measure=g >= 2)
        previous = [producer, *consumers]
    d.close()
    return d.times


CASES = [
    ("(a) decode, 256 requests", bench_decode),
    ("(b) prefill, 8192 tokens", bench_prefill),
    ("(c) spec decode, 64 x 4 drafts", bench_spec),
    ("(d) prefix sharing, 8 x 2048", bench_prefix),
]


def measure(stores: list[tuple[str, str, str]], steps: int, repeats: int) -> None:
    """Every case on every store, ``repeats`` times, each run paired with a memory-store
    run of the same case just before or just after it (the order alternates by round,
    so what one run leaves behind does not favour either side). A ratio is the median
    over pairs of the store's median against its partner's: this VM's speed drifts by
    ±30 % within minutes, and adjacent pairs cancel most of that drift."""
    base, others = stores[0][0], stores[1:]
    runs: dict[tuple[str, str], list[np.ndarray]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    for round_ in range(repeats):
        for name, bench in CASES:
            for store in others or [stores[0]]:
                pair = [stores[0], store][:: 1 if round_ % 2 == 0 else -1]
                medians = {}
                for label, url, writer in dict.fromkeys(pair):
                    Driver.url, Driver.writer = url, writer
                    times = np.array(bench(steps)) * 1e3
                    runs.setdefault((label, name), []).append(times)
                    medians[label] = float(np.median(times))
                ratios.setdefault((store[0], name), []).append(medians[store[0]] / medians[base])
    for label, _, _ in stores:
        for name, _ in CASES:
            medians = [np.median(t) for t in runs[label, name]]
            pooled = np.concatenate(runs[label, name])
            ratio = np.median(ratios.get((label, name), [1.0]))
            print(f"{label:12s} {name:32s} {np.median(medians):10.3f} "
                  f"{np.percentile(pooled, 90):8.3f} {ratio:7.2f}x {len(pooled):6d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--redis", action="store_true",
                        help="also run against a redis-server and a 6-node cluster")
    parser.add_argument("--store", action="append", default=[], help="another store URL")
    parser.add_argument("--repeats", type=int, default=4,
                        help="rounds of every case on every store; medians reported")
    parser.add_argument("--gpu-ms", type=float, default=0.0,
                        help="model time per step, slept between begin_step and "
                             "prepare_output and not counted (default 0: back to back)")
    args = parser.parse_args()
    Driver.gpu_ms = args.gpu_ms
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"{platform.python_implementation()} {platform.python_version()}, numpy "
          f"{np.__version__}, layout {LAYOUT.fingerprint}, model time per step "
          f"{args.gpu_ms:g} ms")
    print(f"{'store':12s} {'case':32s} {'median ms':>10s} {'p90 ms':>8s} {'vs mem':>8s} "
          f"{'steps':>6s}")
    stores = [("memory", "memory://", "thread")]
    stores += [(url.split(":")[0], url, "thread") for url in args.store]
    with contextlib.ExitStack() as servers:
        if args.redis:
            from r3cache.testing import RedisClusterProcesses, RedisServer

            server = servers.enter_context(RedisServer())
            cluster = servers.enter_context(RedisClusterProcesses())
            stores += [("redis", server.url, "thread"), ("redis/proc", server.url, "process"),
                       ("cluster", cluster.url, "thread"),
                       ("cluster/proc", cluster.url, "process")]
        measure(stores, args.steps, args.repeats)


if __name__ == "__main__":
    main()
