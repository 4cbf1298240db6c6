"""GPU check of the capture path: hooks inside a CUDA graph, pinned async D2H, events.

One command, well under 5 minutes on one GPU, under 2 on a CPU at its defaults:

    python scripts/gpu_check.py            # CUDA (default)
    python scripts/gpu_check.py --device cpu   # the same checks where a CPU can run them

It checks, and prints a table of figures:
1. transformers MoE families on the device: captured IDs equal each router's own top-k, and
   a replayed forward reproduces routes and logits;
2. router hooks recorded into a CUDA graph: every graph replay rewrites the static capture
   buffer with that replay's routes (equal to an eager forward on the same input);
3. the worker connector fed from the capturer, each step's completed blocks keyed and
   put into the embedded store, written in place and behind its writer thread (runs
   alternating): each step's snapshot copied on the copy stream into the pinned ring while
   the next step computes; rows delivered equal the device rows; wall time per step, and
   host time of the connector's calls, for each writer;
4. overlap: wall time of N graph steps alone, with async copies, and with synchronous
   ``.cpu()`` copies;
5. with ``--vllm`` (where vLLM is installed with CUDA), the plugin end to end: the tiny
   Qwen3-MoE of tests_vllm served by vLLM with CUDA graphs, once with vLLM's own connector
   and once with r3cache's over a local redis-server; inline routes of both runs and the
   stored routes must be byte-identical.
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import numpy as np
import torch
from torch import nn

from r3cache import RoutingLayout, StepBatch, StepMetadata, WorkerConnector, open_store
from r3cache.capture import RoutedExpertsCapturer
from r3cache.models import tiny_model, tiny_model_names
from r3cache.replay import replay
from r3cache.routers import bind, bind_router, capturer_for, router_choices

warnings.filterwarnings("ignore")
RESULTS: list[tuple[str, bool, str]] = []


STARTED = time.perf_counter()


def record(check: str, ok: bool, figures: str) -> None:
    """One line per check as it ends, with the time since the start: a run shows progress."""
    RESULTS.append((check, ok, figures))
    elapsed = time.perf_counter() - STARTED
    print(f"[{'PASS' if ok else 'FAIL'}] {elapsed:6.1f} s  {check}: {figures}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 1. transformers families -------------------------------------------------------------

def check_families(device: torch.device) -> None:
    for name in tiny_model_names():
        model = tiny_model(name, num_layers=4, dtype=torch.float32).to(device)
        capturer = capturer_for(model, 256)
        ids = torch.randint(0, 512, (2, 64), device=device)
        own = router_choices(model, ids)
        with bind(model, capturer), torch.inference_mode():
            logits = model(ids).logits
        rows = capturer.snapshot(ids.numel())
        same = all(torch.equal(rows[:, c].long(), own[layer])
                   for c, layer in enumerate(capturer.moe_layers))
        with replay(model, rows.cpu().numpy()), bind(model, capturer), torch.inference_mode():
            replayed = model(ids).logits
        same_routes = torch.equal(capturer.snapshot(ids.numel()), rows)
        diff = (replayed - logits).abs().max().item()
        record(f"{name} capture + replay", same and same_routes and diff < 1e-4,
               f"ids equal own top-k: {same}; replayed routes equal: {same_routes}; "
               f"max |logit diff| {diff:.2e}")


# -- 2. hooks inside a CUDA graph -----------------------------------------------------------

class Router(nn.Module):
    """A softmax top-k router shaped like transformers' (logits, weights, indices)."""

    def __init__(self, hidden: int, experts: int, topk: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) / hidden ** 0.5)
        self.topk = topk

    def forward(self, x):
        logits = x @ self.weight.t()
        weights, indices = torch.topk(logits.softmax(-1), self.topk, dim=-1)
        return logits, weights, indices


class RouterStack(nn.Module):
    """Layers of router + dense work: static shapes, no host syncs, graph-capturable."""

    def __init__(self, layers: int, hidden: int, experts: int, topk: int) -> None:
        super().__init__()
        self.routers = nn.ModuleList(Router(hidden, experts, topk) for _ in range(layers))
        self.mixers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x):
        for router, mixer in zip(self.routers, self.mixers):
            _, weights, _ = router(x)
            x = x + torch.tanh(mixer(x)) * weights.sum(-1, keepdim=True)
        return x


def stack_setup(device, tokens, layers=16, hidden=1024, experts=64, topk=8):
    torch.manual_seed(0)
    stack = RouterStack(layers, hidden, experts, topk).to(device).eval()
    layout = RoutingLayout(layers, topk, experts)
    capturer = RoutedExpertsCapturer(layout, tokens, moe_layers=range(layers), device=device)
    for i, router in enumerate(stack.routers):
        bind_router(router, i, capturer)
    return stack, capturer


def eager_routes(stack, x) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for router, mixer in zip(stack.routers, stack.mixers):
            logits = x @ router.weight.t()
            weights, indices = torch.topk(logits.softmax(-1), router.topk, dim=-1)
            out.append(indices)
            x = x + torch.tanh(mixer(x)) * weights.sum(-1, keepdim=True)
    return torch.stack(out, 1)


def graph_of(stack, static_x, device):
    """Record one forward into a CUDA graph (after the warm-up graphs require)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):
            stack(static_x)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        stack(static_x)
    return graph


def check_graph(device: torch.device, tokens: int) -> object:
    stack, capturer = stack_setup(device, tokens)
    static_x = torch.randn(tokens, 1024, device=device)
    graph = graph_of(stack, static_x, device)
    ok = True
    for seed in range(3):
        static_x.copy_(torch.randn(tokens, 1024, device=device,
                                   generator=torch.Generator(device).manual_seed(seed)))
        capturer.buffer.zero_()
        graph.replay()
        ok &= torch.equal(capturer.snapshot(tokens).long(), eager_routes(stack, static_x))
    record("router hooks inside a CUDA graph", ok,
           f"{tokens} tokens x 16 layers x top-8; 3 graph replays each rewrote the static "
           "buffer with the eager routes of the new input")
    return stack, capturer, static_x, graph


# -- 3 and 4. the connector fed by the capturer, async copies -------------------------------

def step_fn(device, stack, static_x, graph):
    if graph is not None:
        return graph.replay

    def eager():
        with torch.inference_mode():
            stack(static_x)
    return eager


def check_connector(device, stack, capturer, static_x, graph, steps: int, requests: int,
                    writer: str):
    """Decode-like steps through the worker connector on the embedded store, each step's
    completed blocks keyed (so put) as an engine's scheduler keys them; ``writer``: "auto"
    (written in place) or "thread". Returns the wall time per step."""
    tokens = capturer.max_num_batched_tokens
    per = tokens // requests
    bs = capturer.layout.block_size
    store = open_store("memory://", layout=capturer.layout, namespace="gpu-check")
    worker = WorkerConnector(layout=capturer.layout, store=store, max_num_seqs=requests,
                             max_num_batched_tokens=tokens, max_concurrent_batches=2,
                             capturer=capturer, writer=writer)
    ids = [f"r{i}" for i in range(requests)]
    worker.begin_step(StepMetadata(requests={r: 0 for r in ids}))
    run = step_fn(device, stack, static_x, graph)
    qsl = np.arange(requests + 1) * per
    host, checked, ok = [], 0, True  # host: seconds in the connector's calls, per step
    inflight = []
    every = max(1, steps // 8)  # steps whose rows are compared with the device's
    sync(device)
    began_all = time.perf_counter()
    for step in range(steps):
        # The hashes of the blocks this step's tokens fill, as a scheduler sends them.
        blocks = range(step * per // bs, (step + 1) * per // bs)
        began = time.perf_counter()
        worker.begin_step(StepMetadata(requests={r: step * per for r in ids},
                                       block_hashes={r: [f"gpu-{r}-{b}" for b in blocks]
                                                     for r in ids}))
        host.append(time.perf_counter() - began)
        run()
        began = time.perf_counter()
        pending = worker.prepare_output(StepBatch(ids, np.full(requests, step * per), qsl))
        pending.enqueue_cpu_copy(np.ones(requests, np.int64), np.zeros(requests, np.int64))
        host[-1] += time.perf_counter() - began
        truth = capturer.snapshot(requests * per).cpu().numpy() if step % every == 0 else None
        inflight.append((pending, truth))
        if len(inflight) == 2:
            pending, truth = inflight.pop(0)
            began = time.perf_counter()
            outputs = pending.process_output()
            host[-1] += time.perf_counter() - began
            if truth is not None:
                got = np.concatenate([outputs[r].rows for r in ids])
                ok &= bool(np.array_equal(got, truth))
                checked += 1
    for pending, _ in inflight:
        pending.process_output()
    worker.store.flush()
    wall = (time.perf_counter() - began_all) / steps
    stored = worker.stats.blocks_published
    worker.close()
    record(f"connector fed by the capturer, writer={writer}", ok and checked > 0 and stored,
           f"{steps} steps of {requests} requests x {per} tokens, {stored} blocks put; "
           f"{checked} steps' delivered rows equal the device rows; wall {wall * 1e3:.3f} ms "
           f"a step, {statistics.median(host) * 1e3:.3f} ms of it (median) in the "
           "connector's calls")
    return wall


def check_overlap(device, stack, capturer, static_x, graph, steps: int) -> None:
    tokens = capturer.max_num_batched_tokens
    run = step_fn(device, stack, static_x, graph)
    ring = capturer.host_ring(2, timing=device.type == "cuda")

    def loop(mode: str) -> tuple[float, list[float]]:
        copies, pending = [], []
        sync(device)
        began = time.perf_counter()
        for _ in range(steps):
            run()
            if mode == "async":
                pending.append(ring.copy(capturer.snapshot(tokens)))
                if len(pending) == 2:
                    done = pending.pop(0)
                    done.result()
                    if done.copy_ms() is not None:
                        copies.append(done.copy_ms())
            elif mode == "sync":
                capturer.snapshot(tokens).cpu()
        for done in pending:
            done.result()
        sync(device)
        return (time.perf_counter() - began) / steps, copies

    loop("none")  # warm-up
    alone, _ = loop("none")
    overlapped, copies = loop("async")
    blocking, _ = loop("sync")
    copy_time = (f"{statistics.median(copies):.3f} ms device time" if copies
                 else "synchronous on the CPU")
    nbytes = tokens * capturer.layout.row_nbytes
    ok = device.type != "cuda" or overlapped <= alone * 1.10 + 50e-6
    record("async D2H overlaps compute", ok,
           f"step alone {alone * 1e3:.3f} ms, with async copy {overlapped * 1e3:.3f} ms, with "
           f"blocking .cpu() {blocking * 1e3:.3f} ms; copy of {nbytes / 1e6:.2f} MB: "
           f"{copy_time}")


def check_vllm() -> None:
    """The vLLM plugin on CUDA: the same end-to-end comparison tests_vllm makes on the CPU."""
    import json
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    from r3cache import R3Reader
    from r3cache.testing import RedisServer

    tests = Path(__file__).resolve().parents[1] / "tests_vllm"
    sys.path[:0] = [str(tests), str(tests.parent)]
    from conftest import grpo_prompts

    from tests.tiny_model import build

    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        model = build(Path(tmp) / "model")
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps(grpo_prompts()))
        env = {k: v for k, v in os.environ.items() if not k.startswith("R3CACHE_")}
        env.update(VLLM_USE_V2_MODEL_RUNNER="1",
                   PYTHONPATH=os.pathsep.join([str(tests.parent), env.get("PYTHONPATH", "")]))
        runs = {}
        for name, extra in (("vllm", {}), ("r3cache", {"R3CACHE_URL": server.url,
                                                        "R3CACHE_NAMESPACE": "gpu-check"})):
            out = Path(tmp) / f"{name}.npz"
            began = time.perf_counter()
            subprocess.run([sys.executable, str(tests / "generate.py"), str(model), str(out),
                            "--prompts", str(prompts), "--max-tokens", "24", "--rounds", "2",
                            "--cuda-graphs"], env={**env, **extra}, check=True)
            with np.load(out) as data:
                runs[name] = (dict(data), time.perf_counter() - began)
        ids = json.loads((Path(tmp) / "r3cache.json").read_text())["ids"]
        own, plugin = runs["vllm"][0], runs["r3cache"][0]
        with R3Reader(server.url, namespace="gpu-check") as reader:
            stored = reader.get_many(ids, wait=15)
        same = all(own[f"routes:{r}"].tobytes() == plugin[f"routes:{r}"].tobytes()
                   == s.tobytes() for r, s in zip(ids, stored))
        record("vLLM plugin with CUDA graphs", same,
               f"{len(ids)} requests: vLLM's own inline = plugin inline = stored; runs "
               f"{runs['vllm'][1]:.0f} s / {runs['r3cache'][1]:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per step (default: 8192 on CUDA, 1024 on the CPU)")
    parser.add_argument("--steps", type=int, default=None,
                        help="engine steps per check (default: 200 on CUDA, 20 on the CPU)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per step (default: 256 on CUDA, 64 on the CPU)")
    parser.add_argument("--vllm", action="store_true",
                        help="also run the vLLM plugin end to end (needs vLLM with CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the checks a CPU can do")
        return 2
    # Full size on a GPU; on a CPU a size that runs every check in well under 2 minutes.
    full = device.type == "cuda"
    args.tokens = args.tokens or (8192 if full else 1024)
    args.steps = args.steps or (200 if full else 20)
    args.requests = args.requests or (256 if full else 64)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {name}, torch {torch.__version__}; {args.tokens} tokens x {args.steps} "
          f"steps, {args.requests} requests", flush=True)
    check_families(device)
    if device.type == "cuda":
        stack, capturer, static_x, graph = check_graph(device, args.tokens)
    else:
        print("[SKIP] router hooks inside a CUDA graph: CUDA graphs need a CUDA device")
        # A narrower stack than on CUDA: the CPU checks test routing and copies, and a
        # 1024-wide forward of 1024 tokens costs about 0.3 s a step on two cores.
        hidden = 128
        stack, capturer = stack_setup(device, args.tokens, hidden=hidden)
        static_x, graph = torch.randn(args.tokens, hidden), None
    # The embedded store written in place (the default) and behind its writer thread,
    # alternating: which suits an engine whose thread waits on the device.
    walls: dict[str, list[float]] = {"auto": [], "thread": []}
    for writer in ("auto", "thread", "thread", "auto"):
        walls[writer].append(check_connector(device, stack, capturer, static_x, graph,
                                             args.steps, args.requests, writer))
    print(f"       writer=thread step wall time / in place: "
          f"{sum(walls['thread']) / sum(walls['auto']):.3f}", flush=True)
    check_overlap(device, stack, capturer, static_x, graph, args.steps)
    if args.vllm:
        check_vllm()
    failed = [check for check, ok, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in "
          f"{time.perf_counter() - STARTED:.1f} s" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
