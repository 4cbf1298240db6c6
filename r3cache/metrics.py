"""Prometheus metrics of the engines' connectors and the readers in this process.

Counters are read at scrape time from the objects that keep them (``WorkerStats``, the
writer's queue and drop counts, ``ReaderStats``), so an engine step pays nothing for
them. Connectors and readers announce themselves here when made; when one is
collected, its final counts are kept under its labels, so a counter never goes back.
Labels are the namespace and the store kind (memory, redis, cluster), never request ids.

    from r3cache import metrics
    metrics.serve(9400)   # http://host:9400/metrics (needs prometheus_client)

prometheus_client is imported only by ``collector`` and ``serve``: the core runs
without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections import defaultdict, deque
from typing import Any

from r3cache.checks import is_int, seconds
from r3cache.errors import ContractError

# Where each engine counter comes from, and its help text.
ENGINE_COUNTERS = {
    "steps": ("r3cache_engine_steps", "engine steps the connector processed"),
    "rows_captured": ("r3cache_rows_captured", "routed-expert rows delivered to requests"),
    "blocks_published": ("r3cache_blocks_published", "blocks handed to the store"),
    "bytes_published": ("r3cache_published_bytes",
                        "row bytes of the blocks handed to the store (before lz4)"),
    "blocks_read": ("r3cache_prefix_blocks_read",
                    "blocks read back to serve prefix-cache hits"),
    "manifests": ("r3cache_manifests_written", "finished requests recorded for read-back"),
    "remote_reads": ("r3cache_prefix_blocks_read_remote",
                     "prefix-hit blocks the in-process tier lacked, read from the store"),
    "conflicts": ("r3cache_store_conflicts",
                  "blocks written under a key the store held with other rows (another "
                  "replica's; this engine's rows went to a variant key)"),
    "dropped_batches": ("r3cache_dropped_batches",
                        "write batches lost to an unavailable store (on_unavailable="
                        "incomplete): their requests' read-back fails"),
}
READER_COUNTERS = {
    "requests": ("r3cache_reader_requests", "requests read back"),
    "tokens": ("r3cache_reader_tokens", "rows (tokens) read back"),
    "failures": ("r3cache_reader_failures",
                 "reads that raised (missing, corrupt or invalid data)"),
}
# Read latency buckets in seconds: one request of a few hundred rows to a large batch.
READ_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# How long a put waited for the writer (a full queue or ring): up to store_wait.
WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class Timings:
    """A histogram of durations: cumulative counts per bound, their sum and count."""

    bounds: tuple[float, ...]
    buckets: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.buckets = self.buckets or [0] * len(self.bounds)

    def observe(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.buckets[i] += 1

    def add(self, other: Timings) -> None:
        self.total += other.total
        self.count += other.count
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets)]

    def copy(self) -> Timings:
        return Timings(self.bounds, list(self.buckets), self.total, self.count)


@dataclasses.dataclass
class ReaderStats:
    """Counters of what a reader did since it opened, and its read times."""

    requests: int = 0
    tokens: int = 0
    failures: int = 0
    seconds: Timings = dataclasses.field(default_factory=lambda: Timings(READ_BUCKETS))

    def observe(self, seconds: float, requests: int, tokens: int) -> None:
        self.requests += requests
        self.tokens += tokens
        self.seconds.observe(seconds)

    def add(self, other: ReaderStats) -> None:
        """Fold another reader's counts into these."""
        self.requests += other.requests
        self.tokens += other.tokens
        self.failures += other.failures
        self.seconds.add(other.seconds)

    def copy(self) -> ReaderStats:
        return dataclasses.replace(self, seconds=self.seconds.copy())


def store_kind(store: Any) -> str:
    """memory, redis or cluster: the durable store under any tier or writer."""
    from r3cache.store.memory import MemoryBlockStore
    from r3cache.store.redis.nodes import ClusterNodes, SingleNode

    # Tiers hold their durable store as .remote, the writer thread as .inner, the helper
    # process's handle as .reader.
    while (inner := next((getattr(store, a) for a in ("remote", "inner", "reader")
                          if hasattr(store, a)), None)) is not None:
        store = inner
    nodes = getattr(store, "_nodes", None)
    if isinstance(nodes, ClusterNodes):
        return "cluster"
    if isinstance(nodes, SingleNode):
        return "redis"
    return "memory" if isinstance(store, MemoryBlockStore) else type(store).__name__


def _writer(store: Any) -> Any:
    """The writer behind a two-tier store (the store itself otherwise)."""
    return getattr(store, "remote", store)


@dataclasses.dataclass
class EngineTotals:
    """What the connectors of one (namespace, store kind) did: counters, store errors by
    class, and how long puts waited for the writer."""

    counts: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(ENGINE_COUNTERS, 0))
    errors: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    waits: Timings = dataclasses.field(default_factory=lambda: Timings(WAIT_BUCKETS))
    queued: int = 0  # gauges, live connectors only: batches queued now,
    ring_used: int = 0  # and the helper process's ring slots in use, of ring_slots
    ring_slots: int = 0
    arena_unencoded: int = 0  # and the tier's blocks sent to the helper, not yet encoded
    refused: float = 0.0  # the longest a live connector's writer has repeated a batch

    def add(self, stats: Any, store: Any) -> None:
        """Fold one connector's stats and its store's writer into these."""
        for name, value in engine_counts(stats, store).items():
            self.counts[name] += value
        for name, value in stats.errors.items():
            self.errors[name] += value
        waits = getattr(_writer(store), "waits", None)
        if waits is not None:
            self.waits.add(waits)

    def copy(self) -> EngineTotals:
        return EngineTotals(dict(self.counts), defaultdict(int, self.errors),
                            self.waits.copy())


class _Sources:
    """Own the live connectors and readers of this process and the retired counts.

    A connector or reader that is collected is retired by a finalizer, which the garbage
    collector may run in any thread at any allocation, also inside this class's own
    locked sections: it only queues the key, and the queue is folded in under the lock
    by the next call (a lock taken there would deadlock a scrape).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[int, tuple[tuple[str, str], Any, Any]] = {}
        self._readers: dict[int, tuple[tuple[str, str], ReaderStats]] = {}
        self._retired_engines: dict[tuple[str, str], EngineTotals] = defaultdict(EngineTotals)
        self._retired_readers: dict[tuple[str, str], ReaderStats] = defaultdict(ReaderStats)
        self._retiring: deque[tuple[bool, int]] = deque()  # (an engine?, key); append-only

    def add_engine(self, worker: Any) -> None:
        labels = (worker.store.namespace, store_kind(worker.store))
        key = id(worker)
        with self._lock:
            # A collected object's id may be reused: its retirement is folded in first.
            self._fold()
            # The stats and the store, not the connector: they outlive it until retired.
            self._engines[key] = (labels, worker.stats, worker.store)
        # Counts fold into the retired ones when the connector is collected.
        weakref.finalize(worker, self._retiring.append, (True, key))

    def add_reader(self, reader: Any) -> None:
        labels = (reader.namespace, store_kind(reader.store))
        key = id(reader)
        with self._lock:
            self._fold()
            self._readers[key] = (labels, reader.stats)
        weakref.finalize(reader, self._retiring.append, (False, key))

    def _fold(self) -> None:
        """Move retired objects' counts into the totals; the caller holds the lock."""
        while self._retiring:
            engine, key = self._retiring.popleft()
            if engine:
                labels, stats, store = self._engines.pop(key)
                self._retired_engines[labels].add(stats, store)
            else:
                labels, stats = self._readers.pop(key)
                self._retired_readers[labels].add(stats)

    def engines(self) -> dict[tuple[str, str], EngineTotals]:
        """Every connector's totals, by (namespace, store kind)."""
        with self._lock:  # a connector is either live or retired, never both or neither
            self._fold()
            totals = {labels: t.copy() for labels, t in self._retired_engines.items()}
            for labels, stats, store in self._engines.values():
                total = totals.setdefault(labels, EngineTotals())
                total.add(stats, store)
                total.queued += writer_pending(store)
                used, slots = getattr(_writer(store), "ring_slots", (0, 0))
                total.ring_used += used
                total.ring_slots += slots
                total.arena_unencoded += getattr(_writer(store), "arena_unencoded", 0)
                total.refused = max(total.refused,
                                    getattr(_writer(store), "refused_seconds", 0.0))
        return totals

    def readers(self) -> dict[tuple[str, str], ReaderStats]:
        with self._lock:
            self._fold()
            totals = {labels: s.copy() for labels, s in self._retired_readers.items()}
            live = [(labels, s.copy()) for labels, s in self._readers.values()]
        for labels, stats in live:
            totals.setdefault(labels, ReaderStats()).add(stats)
        return totals


def engine_counts(stats: Any, store: Any) -> dict[str, int]:
    """A connector's counters, the bytes it published, its tier's remote reads and its
    writer's dropped batches."""
    counts = {name: getattr(stats, name, 0) for name in ENGINE_COUNTERS}
    counts["bytes_published"] = stats.blocks_published * store.layout.block_nbytes
    counts["remote_reads"] = getattr(store, "remote_reads", 0)
    counts["dropped_batches"] = getattr(_writer(store), "dropped_batches", 0)
    counts["conflicts"] = getattr(_writer(store), "conflicts", 0)
    return counts


def writer_pending(store: Any) -> int:
    return int(getattr(_writer(store), "pending", 0) or 0)


SOURCES = _Sources()


def collector():
    """A prometheus_client collector of every connector and reader of this process."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.registry import Collector

    def histogram(name: str, text: str, labels: list[str], rows) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, text, labels=labels)
        for key, timings in rows:
            buckets = [(str(b), n) for b, n in zip(timings.bounds, timings.buckets)]
            family.add_metric(list(key), buckets + [("+Inf", timings.count)], timings.total)
        return family

    class R3Collector(Collector):
        def collect(self):
            labels = ["namespace", "store"]
            engines = SOURCES.engines()
            for field, (name, text) in ENGINE_COUNTERS.items():
                family = CounterMetricFamily(name, text, labels=labels)
                for key, totals in engines.items():
                    family.add_metric(list(key), totals.counts[field])
                yield family
            errors = CounterMetricFamily(
                "r3cache_store_errors", "typed store errors the connector raised, by class",
                labels=[*labels, "error"])
            for key, totals in engines.items():
                for error, count in sorted(totals.errors.items()):
                    errors.add_metric([*key, error], count)
            yield errors
            depth = GaugeMetricFamily("r3cache_writer_queue_depth",
                                      "write batches queued for the store's writer",
                                      labels=labels)
            for key, totals in engines.items():
                depth.add_metric(list(key), totals.queued)
            yield depth
            refused = GaugeMetricFamily(
                "r3cache_writer_refused_seconds", "how long the store has refused the batch "
                "the writer repeats (0: it refuses none)", labels=labels)
            for key, totals in engines.items():
                refused.add_metric(list(key), totals.refused)
            yield refused
            ring = [(k, t) for k, t in engines.items() if t.ring_slots]
            for name, text, field in (
                    ("r3cache_writer_ring_slots_used",
                     "blocks in the helper process's shared ring not yet encoded", "ring_used"),
                    ("r3cache_writer_ring_slots",
                     "blocks the helper process's shared ring holds", "ring_slots"),
                    ("r3cache_writer_arena_blocks_unencoded",
                     "blocks of the in-process tier sent to the helper process by slot, "
                     "not yet encoded", "arena_unencoded")):
                family = GaugeMetricFamily(name, text, labels=labels)
                for key, totals in ring:
                    family.add_metric(list(key), getattr(totals, field))
                yield family
            yield histogram("r3cache_store_wait_seconds",
                            "how long a put waited for the writer (queue or ring full)",
                            labels, [(k, t.waits) for k, t in engines.items()])
            readers = SOURCES.readers()
            for field, (name, text) in READER_COUNTERS.items():
                family = CounterMetricFamily(name, text, labels=labels)
                for key, stats in readers.items():
                    family.add_metric(list(key), getattr(stats, field))
                yield family
            yield histogram("r3cache_read_seconds",
                            "wall time of one reader call (get, get_many)", labels,
                            [(k, s.seconds) for k, s in readers.items()])

    return R3Collector()


# Registries that have the collector, by the registry itself: an id would be reused by
# a new registry once an old one is collected, which then never got the collector.
_REGISTERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register(registry: Any = None) -> Any:
    """Add r3cache's collector to ``registry`` (default: prometheus_client's), once."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    if not callable(getattr(registry, "register", None)):
        raise ContractError(f"registry must be a prometheus_client CollectorRegistry, not "
                            f"{registry!r:.60}")
    if registry not in _REGISTERED:
        _REGISTERED[registry] = collector()
        registry.register(_REGISTERED[registry])
    return registry


def export(directory: str, interval: float = 1.0) -> threading.Thread:
    """Write this process's metrics to ``directory`` every ``interval`` seconds.

    For an engine whose /metrics is served by another process (vLLM's API server serves
    them; the connector runs in its engine core): a daemon thread renders the collector
    in the exposition format to ``r3cache-<pid>.prom`` (replaced whole, never half
    written), and ``FileBridge`` in the serving process reads every such file. The
    steps pay nothing: the thread reads the counters as a scrape would.
    """
    import atexit
    import os

    from prometheus_client import CollectorRegistry, generate_latest

    if not isinstance(directory, (str, os.PathLike)):
        raise ContractError(f"directory must be a path, not {directory!r:.60}")
    if not seconds(interval, "interval"):  # a wait of 0 would write without a pause
        raise ContractError("interval must be a number of seconds > 0, not 0")
    registry = CollectorRegistry()
    registry.register(collector())
    path = os.path.join(directory, f"r3cache-{os.getpid()}.prom")

    def write() -> None:
        temporary = f"{path}.tmp"
        with open(temporary, "wb") as out:
            out.write(generate_latest(registry))
        os.replace(temporary, path)

    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval):
            try:
                write()
            except OSError:  # the directory went away with its server: nothing to feed
                return

    def last_write() -> None:  # the final counts, so the counters never go back
        stop.set()
        with contextlib.suppress(OSError):
            write()

    try:
        write()
    except OSError as exc:  # no such directory, or not this user's
        raise ContractError(f"cannot write metrics to {directory!r}: "
                            f"{exc.strerror or exc}") from None
    atexit.register(last_write)
    thread = threading.Thread(target=run, name="r3cache-metrics-export", daemon=True)
    thread.start()
    return thread


def file_bridge(directory: str):
    """A collector of the metrics ``export`` writes to ``directory``, summed over the
    processes that wrote them (engine cores of several data-parallel ranks add up)."""
    import glob
    import os

    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import Collector

    class FileBridge(Collector):
        def collect(self):
            families: dict[str, Metric] = {}
            values: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
            for path in sorted(glob.glob(os.path.join(directory, "r3cache-*.prom"))):
                try:
                    with open(path) as source:
                        text = source.read()
                except OSError:  # replaced or removed while listed: the next scrape has it
                    continue
                for family in text_string_to_metric_families(text):
                    families.setdefault(family.name, Metric(
                        family.name, family.documentation, family.type))
                    for sample in family.samples:
                        key = (sample.name, tuple(sorted(sample.labels.items())))
                        values[family.name][key] += sample.value
            for name, family in families.items():
                for (sample, labels), value in values[name].items():
                    family.add_sample(sample, dict(labels), value)
                yield family

    return FileBridge()


def serve(port: int, addr: str = "0.0.0.0", registry: Any = None) -> Any:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the server."""
    from prometheus_client import start_http_server

    if not is_int(port) or not 0 <= port < 65536:
        raise ContractError(f"port must be a TCP port (0: any free one), not {port!r:.40}")
    registry = register(registry)
    try:
        server, _ = start_http_server(int(port), addr=addr, registry=registry)
    except OSError as exc:  # taken, not permitted, or an address this host does not have
        raise ContractError(f"port {port} of {addr} cannot serve metrics "
                            f"({exc.strerror or exc})") from None
    return server
