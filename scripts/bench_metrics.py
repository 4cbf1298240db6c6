"""What r3cache's Prometheus metrics cost an engine step, counted and timed.

    make bench     # runs it after bench_step.py
    .venv/bin/python scripts/bench_metrics.py [--steps 200] [--redis]

Metrics are read when scraped, so the cost to an engine has two parts, each measured
here on bench_step.py's cases rather than inferred from paired step timings (this VM's
pairs spread ±15 %, far more than the cost):

  calls    calls into r3cache/metrics.py made while the cases run their steps, counted
           by a profile hook (the writer's wait timing, on a put that found its queue
           full, is the only one the design allows: "waits" counts those puts; the
           embedded store has no writer to wait for);
  scrape   the time one render of every metric takes in the engine's process (vLLM's
           engine core renders once a second for the API server's /metrics), with the
           connectors of all cases live; at one render a second, its share of the
           engine's time is render seconds / 1 s, whatever the step rate.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402  (this directory: its cases and driver)

from r3cache import metrics  # noqa: E402

METRICS_FILE = str(Path(metrics.__file__).resolve())


def count_calls(bench, steps: int) -> tuple[int, int]:
    """(calls into r3cache/metrics.py, steps) while ``bench`` runs its steps."""
    calls = [0]

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename == METRICS_FILE:
            calls[0] += 1

    original_step = bench_step.Driver.step

    def step(self, *args, **kwargs):  # count only inside the engine calls
        sys.setprofile(hook)
        try:
            return original_step(self, *args, **kwargs)
        finally:
            sys.setprofile(None)

    bench_step.Driver.step = step
    try:
        times = bench(steps)
    finally:
        bench_step.Driver.step = original_step
    return calls[0], len(times)


def render_seconds(renders: int = 200) -> float:
    """Median time of one render of every metric of this process (exposition format)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(metrics.collector())
    times = []
    for _ in range(renders):
        began = time.perf_counter()
        generate_latest(registry)
        times.append(time.perf_counter() - began)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--redis", action="store_true",
                        help="also on a redis-server the script starts (helper writer)")
    args = parser.parse_args()
    stores = [("memory", "memory://", "thread")]
    with contextlib.ExitStack() as servers:
        if args.redis:
            from r3cache.testing import RedisServer

            stores.append(("redis/proc", servers.enter_context(RedisServer()).url, "process"))
        print(f"{'store':12s} {'case':32s} {'metrics calls':>14s} {'waits':>6s} {'steps':>6s}")
        live = []  # keep every case's connector alive for the render below
        original_close = bench_step.Driver.close
        bench_step.Driver.close = lambda self: live.append(self)
        try:
            for label, url, writer in stores:
                bench_step.Driver.url, bench_step.Driver.writer = url, writer
                for name, bench in bench_step.CASES:
                    calls, steps = count_calls(bench, args.steps)
                    writer = metrics._writer(live[-1].worker.store)
                    waits = writer.waits.count if hasattr(writer, "waits") else 0
                    print(f"{label:12s} {name:32s} {calls:14d} {waits:6d} {steps:6d}")
            seconds = render_seconds()
            print(f"one render of every metric, {len(live)} connectors live: "
                  f"{seconds * 1e6:.0f} us; rendered once a second, "
                  f"{seconds * 100:.3f} % of the engine's time")
        finally:
            for driver in live:
                original_close(driver)
            bench_step.Driver.close = original_close


if __name__ == "__main__":
    main()
