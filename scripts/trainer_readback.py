"""End to end, as a training job sees it: rollouts into Redis, routes read back elsewhere.

Phase 1 (this process) runs the demo's GRPO workload through the simulated engine
into the store at URL, keeping every finished request's manifest, and saves the rows
each request received online. Phase 2 runs in a fresh Python process, like a trainer
on another machine: it opens the namespace with R3Reader, reads every request back
with get_many, and compares the rows with the online ones byte for byte.

    python scripts/trainer_readback.py redis://127.0.0.1:6379/0 [--prompts 16 --samples 8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from r3cache import R3Reader, RoutingLayout
from r3cache.sim import SimConfig, grpo_workload, simulate


def produce(args: argparse.Namespace, online_file: Path) -> list[str]:
    layout = RoutingLayout(args.layers, 8, 128, 16)
    workload = grpo_workload(num_prompts=args.prompts, samples=args.samples, seed=args.seed)
    config = SimConfig(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=512,
                       num_spec_tokens=3, async_depth=2, keep_manifests=True, seed=args.seed)
    report = simulate(workload, layout, config, store_url=args.url, namespace=args.namespace)
    if not report.ok:
        sys.exit(f"the engine run failed verification: {report.failures[:5]}")
    recorded = sorted(report.online)
    np.savez(online_file, **{r: report.online[r] for r in recorded})
    print(f"engine:  {report.requests} requests, {report.rows_verified} rows, "
          f"{report.manifests_verified} manifests written to {args.url} "
          f"namespace {args.namespace!r}")
    return recorded


def check(url: str, namespace: str, online_file: Path) -> int:
    online = np.load(online_file)
    ids = sorted(online.files)
    began = time.perf_counter()
    with R3Reader(url, namespace=namespace) as reader:
        stored = reader.get_many(ids)
    seconds = time.perf_counter() - began
    rows = sum(len(r) for r in stored)
    differ = [r for r, got in zip(ids, stored) if got.tobytes() != online[r].tobytes()
              or got.shape != online[r].shape]
    print(f"trainer: read {len(ids)} requests, {rows} rows in {seconds:.3f} s "
          f"({rows / seconds:,.0f} tokens/s) in a fresh process; "
          f"{len(ids) - len(differ)} byte-identical, {len(differ)} different")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--namespace", default="readback@demo")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", metavar="ONLINE_NPZ", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check:
        return check(args.url, args.namespace, Path(args.check))
    with tempfile.TemporaryDirectory() as tmp:
        online_file = Path(tmp) / "online.npz"
        produce(args, online_file)
        return subprocess.run([sys.executable, __file__, args.url, "--namespace",
                               args.namespace, "--check", str(online_file)]).returncode


if __name__ == "__main__":
    sys.exit(main())
