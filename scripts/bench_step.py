"""Host time per engine step of the worker connector's hot path.

Measures begin_step + prepare_output + enqueue_cpu_copy + process_output, the calls
an inference engine makes every step, against the embedded store behind its
background writer, for:

  (a) 256 running requests decoding one token each
  (b) 8192-token prefill steps (8 new requests x 1024 prompt tokens)
  (c) 64 requests x 4 speculative tokens with random rejections

Layout: L=48, K=8, 128 experts (uint8), block size 16. Usage:

    python scripts/bench_step.py [--steps 400]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import time

import numpy as np

from r3cache import RoutingLayout, StepBatch, StepMetadata, WorkerConnector, open_store

LAYOUT = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)


def _hash(req: str, block: int) -> bytes:
    return hashlib.sha256(f"{req}/{block}".encode()).digest()


class Driver:
    """Own a worker connector and the scheduler-side bookkeeping a benchmark needs."""

    def __init__(self, max_num_seqs: int, max_tokens: int) -> None:
        store = open_store("memory://", layout=LAYOUT, namespace="bench")
        self.worker = WorkerConnector(layout=LAYOUT, store=store, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_tokens)
        self.rng = np.random.default_rng(0)
        self.rows = self.rng.integers(0, 128, (max_tokens, 48, 8)).astype(np.uint8)
        self.times: list[float] = []

    def step(self, metadata, req_ids, starts, counts, rejected=None, measure=True) -> dict:
        qsl = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        sampled = np.ones(len(req_ids), np.int64) if rejected is None else counts - rejected
        rejected = np.zeros(len(req_ids), np.int64) if rejected is None else rejected
        began = time.perf_counter()
        self.worker.begin_step(metadata)
        pending = self.worker.prepare_output(StepBatch(req_ids, starts, qsl),
                                             routed_experts=self.rows)
        pending.enqueue_cpu_copy(sampled, rejected)
        outputs = self.worker.process_output(pending)
        if measure:
            self.times.append(time.perf_counter() - began)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    cases = [
        ("(a) decode, 256 requests", bench_decode),
        ("(b) prefill, 8192 tokens", bench_prefill),
        ("(c) spec decode, 64 x 4 drafts", bench_spec),
    ]
    print(f"machine: {platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}, numpy {np.__version__}, layout {LAYOUT.fingerprint}")
    print(f"{'case':34s} {'median ms':>10s} {'p90 ms':>8s} {'steps':>6s}")
    for name, bench in cases:
        times = np.array(bench(args.steps)) * 1e3
        median, p90 = np.median(times), np.percentile(times, 90)
        print(f"{name:34s} {median:10.3f} {p90:8.3f} {len(times):6d}")


if __name__ == "__main__":
    main()
