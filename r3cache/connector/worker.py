"""WorkerConnector: turns each step's routed-expert rows into the rows each request is owed."""

from __future__ import annotations

import logging
import operator
import threading
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import count, filterfalse, repeat
from typing import Any

import numpy as np

from r3cache import checks
from r3cache.connector.delivered import Delivered, without
from r3cache.connector.metadata import RequestOutput, StepBatch, StepMetadata, keys_by_request
from r3cache.connector.requests import NO_CURSOR, RequestTable
from r3cache.errors import (
    BlockNotFoundError,
    ContractError,
    CursorError,
    GenerationError,
    InvalidBatchError,
    LayoutMismatchError,
    MetadataError,
    R3Error,
    StoreClosedError,
    StoreFullError,
    StoreUnavailableError,
)
from r3cache.layout import RoutingLayout
from r3cache.manifest import (
    BlockRef,
    BlockSpan,
    Completion,
    Manifest,
    check_request_id,
    is_completion,
)
from r3cache.metrics import SOURCES
from r3cache.store.base import BlockStore, check_layout_and_store
from r3cache.store.memory import MemoryBlockStore, check_capacity
from r3cache.store.tiered import TieredBlockStore
from r3cache.store.writers import choose_writer
from r3cache.store.writers.background import BackgroundBlockStore
from r3cache.store.writers.process import spawn_writer

log = logging.getLogger("r3cache.worker")

# What the connector uses of a capturer (r3cache.capture, or an engine's own behind an
# adapter).
_CAPTURER_ATTRIBUTES = ("layout", "max_num_batched_tokens", "snapshot", "host_ring")

_NOTHING = Delivered(0, [], [])  # what a preempted request keeps where no manifest is made

# Above this many rows per request a step's tails are filled request by request (two
# slices each) rather than through per-row index arrays.
_ROWS_PER_REQUEST = 16


@dataclass
class WorkerStats:
    """Counters of what the worker connector did since it started."""

    steps: int = 0
    rows_captured: int = 0
    blocks_published: int = 0
    blocks_read: int = 0  # stored blocks that served prefix hits (this step's or the store's)
    manifests: int = 0  # finished requests recorded for offline read-back
    # Typed store errors raised to the engine, by class name.
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class PendingOutput:
    """Own one step's routed-experts rows until the step is processed.

    Rows come either as an array the caller passed, or as a device snapshot of the bound
    capturer that ``enqueue_cpu_copy`` sends to pinned host memory on a copy stream;
    ``process_output`` then waits on that copy's event and nothing else.
    """

    __slots__ = (
        "connector", "req_ids", "slots", "token_starts", "query_start_loc", "counts",
        "routed_experts", "snapshot", "host_copy", "num_sampled", "num_rejected", "_slot_set",
    )

    def __init__(self, connector, req_ids, slots, token_starts, query_start_loc, counts,
                 routed_experts, snapshot=None):
        self.connector: WorkerConnector = connector
        self.req_ids: list[str] = req_ids
        self.slots: np.ndarray = slots
        self.token_starts: np.ndarray = token_starts
        self.query_start_loc: np.ndarray = query_start_loc
        self.counts: np.ndarray = counts  # rows each request ran this step
        self.routed_experts: np.ndarray | None = routed_experts
        self.snapshot: Any = snapshot  # device tensor until its host copy is enqueued
        self.host_copy: Any = None
        self.num_sampled: np.ndarray | None = None
        self.num_rejected: np.ndarray | None = None
        self._slot_set: set[int] | None = None

    def enqueue_cpu_copy(self, num_sampled: Any, num_rejected: Any) -> None:
        """Hand over the step's sampled and rejected token counts, one per request, and
        start the asynchronous host copy of a capturer snapshot.

        Their entries are only read by process_output: an engine may pass host arrays
        that its copy stream is still filling (vLLM does), complete once the step's copy
        event fires, which is before it calls process_output.
        """
        n = len(self.req_ids)
        self.num_sampled = _counts(num_sampled, n, "num_sampled")
        self.num_rejected = _counts(num_rejected, n, "num_rejected")
        if self.snapshot is not None:
            self.host_copy = self.connector._host_ring.copy(self.snapshot)
            self.snapshot = None

    def process_output(self) -> dict[str, RequestOutput]:
        return self.connector.process_output(self)

    def slot_set(self) -> set[int]:
        """The slots this step covers."""
        if self._slot_set is None:
            self._slot_set = set(self.slots.tolist())
        return self._slot_set

    def covers(self, slot: int) -> bool:
        return slot in self.slot_set()

    def _await_copy(self) -> None:
        if self.routed_experts is None:
            self.routed_experts = self.host_copy.result()


def _integer_array(values: Any, name: str) -> np.ndarray:
    """``values`` as a flat array of integers, without reading the entries (an engine's
    host buffer may still be filling); anything but integers is refused, not truncated."""
    array = np.asarray(values)
    if array.ndim != 1:
        array = array.reshape(-1)
    if array.size and array.dtype.kind not in "iu":
        raise InvalidBatchError(f"{name} must hold integers, got {array.dtype}")
    return array


def _integers(values: Any, name: str, n: int | None = None) -> np.ndarray:
    """The first ``n`` of ``values`` as int64, a copy of its own."""
    if values.__class__ is np.ndarray and values.ndim == 1 and values.dtype.kind in "iu":
        return values[:n].astype(np.int64)  # an engine's own array: the usual case
    return _integer_array(values, name)[:n].astype(np.int64)


def _int_list(values: Any, name: str) -> list[int]:
    """``values`` as a list of Python ints; anything but integers is refused."""
    out = list(values)
    if set(map(type, out)) - {int}:  # plain ints, the common case, need no numpy call
        out = _integer_array(out, name).tolist()
    return out


def _counts(values: Any, n: int, name: str) -> np.ndarray:
    """One count per request, checked by shape and dtype only (see enqueue_cpu_copy)."""
    if values.__class__ is np.ndarray and values.shape == (n,) and values.dtype.kind in "iu":
        return values  # an engine's own array: the usual case
    array = _integer_array(values, name)
    if len(array) != n:
        raise InvalidBatchError(f"{name} has {len(array)} entries for {n} requests")
    return array


class WorkerConnector:
    """Own request cursors, tail rows and block publication on the output worker.

    Invariants, per request slot: rows for positions ``[owned_from, capture)`` were
    captured by this incarnation and live in exactly one place: the store (a full
    block whose key arrived; ``_unput`` until the next store call, if it was parked),
    ``unkeyed`` (a full block still waiting for its hash) or ``tail`` (the block
    containing ``capture``). Rows before ``owned_from`` come only from the store. Every
    key a request received is pinned until its teardown, which waits for the last
    in-flight step that covers the request; a preempted request's teardown keeps the rows
    it was given (``_delivered``, their keys still pinned) until the request ends, and
    its manifest names those rows.
    """

    def __init__(
        self,
        *,
        layout: RoutingLayout,
        store: BlockStore,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_concurrent_batches: int = 1,
        background: bool = True,
        local_tier_bytes: int = 1 << 30,
        writer: str = "auto",
        store_wait: float = 10.0,
        on_unavailable: str = "raise",
        capturer: Any = None,
        record_manifests: bool = True,
    ) -> None:
        check_layout_and_store(layout, store, "connector")
        # Sizes bound the writers' queues and every wait: each is checked before any starts
        # (the writer and policy by choose_writer).
        max_num_seqs = checks.count(max_num_seqs, "max_num_seqs", 1)
        max_num_batched_tokens = checks.count(max_num_batched_tokens,
                                              "max_num_batched_tokens", 1)
        max_concurrent_batches = checks.count(max_concurrent_batches,
                                              "max_concurrent_batches", 1, InvalidBatchError)
        local_tier_bytes = checks.count(local_tier_bytes, "local_tier_bytes")
        store_wait = checks.seconds(store_wait, "store_wait")
        writer = choose_writer(store, writer, on_unavailable)
        if capturer is not None:
            self._check_capturer(capturer, layout, max_num_batched_tokens)
        self.layout = layout
        layout.prepare_checks()
        # False where nothing outside this process could read or release a manifest (an
        # engine's embedded store): each would hold its blocks until the store is full.
        self.record_manifests = record_manifests
        self.max_num_batched_tokens = max_num_batched_tokens
        # Steps without explicit rows snapshot this capturer (r3cache.capture); their host
        # copies go through a ring of max_concurrent_batches pinned buffers.
        self.capturer = capturer
        self._host_ring = capturer.host_ring(max_concurrent_batches) if capturer else None
        self.max_concurrent_batches = max_concurrent_batches
        if isinstance(store, (BackgroundBlockStore, TieredBlockStore)) or writer == "inline":
            pass  # already off the inference thread, or the embedded store written in place
        elif not isinstance(store, MemoryBlockStore) and local_tier_bytes:
            # A durable store gets an in-process tier, so the engine's own prefix hits
            # never wait on the writer or the network. writer="process" moves encoding
            # and Redis I/O to a helper process, off this process's GIL.
            check_capacity(layout, local_tier_bytes)  # before a helper starts
            checks.fits_memory(local_tier_bytes, "local_tier_bytes")
            if writer == "process" and getattr(store, "reopen_args", None):
                # The tier's blocks in the helper's arena: it reads them where they are.
                store = spawn_writer(store, max_pending=2 * max_num_seqs, max_wait=store_wait,
                                     arena_bytes=local_tier_bytes)
            local = MemoryBlockStore(layout, store.namespace, local_tier_bytes,
                                     arena=getattr(store, "arena", None))
            store = TieredBlockStore(local, store, max_pending=2 * max_num_seqs,
                                     max_wait=store_wait, on_unavailable=on_unavailable)
        elif background:
            # A durable store without a tier, or the embedded store when writer="thread".
            store = BackgroundBlockStore(store, max_pending=2 * max_num_seqs,
                                         max_wait=store_wait, on_unavailable=on_unavailable)
        self.store = store
        self.stats = WorkerStats()
        SOURCES.add_engine(self)  # read at scrape time: the steps pay nothing
        self._table = RequestTable(layout, max_num_seqs)
        self._generation = 0
        # Steps prepared and not yet processed, oldest first; the engine consumes
        # them in order. Guarded by _lock against an output thread.
        self._inflight: deque[PendingOutput] = deque()
        self._lock = threading.Lock()
        self._closed = False  # close() released every pin: no step may take new ones
        self._block_offsets = np.arange(layout.block_size)
        # Keys requests received since the last store call, pinned first by the next one
        # (a step's own put at the latest; at once in a step that runs nothing): a call of
        # their own would cost a step as much again. Every read takes them first too.
        self._unpinned: list[str] = []
        # Parked blocks whose hash has arrived (speculative decoding: a block of drafts is
        # keyed once they are accepted), stored by the next store call for the same reason.
        # Until then a read finds them nowhere but here: every read puts them first.
        self._unput: dict[str, np.ndarray] = {}
        # The releases and manifests of a store call that was refused (the store changed
        # nothing), carried by the next one with its pins and blocks (kept above).
        self._unsent: tuple[list[str], list[Manifest]] | None = None
        # What preempted requests were given, by request id, until they end: a manifest
        # names these rows, which a recomputation may not reproduce (new weights after a
        # reset, kernels that are not batch-invariant). Their keys stay pinned meanwhile.
        self._delivered: dict[str, Delivered] = {}

    @staticmethod
    def _check_capturer(capturer: Any, layout: RoutingLayout, max_num_batched_tokens: int
                        ) -> None:
        """The capturer has what the connector uses of one, for this layout and step size."""
        missing = [a for a in _CAPTURER_ATTRIBUTES if not hasattr(capturer, a)]
        if missing:
            raise ContractError(f"capturer must be an r3cache.capture.RoutedExpertsCapturer "
                                f"(or have its {', '.join(missing)}), not "
                                f"{type(capturer).__name__}")
        if capturer.layout != layout:
            raise LayoutMismatchError(f"capturer layout {capturer.layout.fingerprint} != "
                                      f"connector layout {layout.fingerprint}")
        if capturer.max_num_batched_tokens < max_num_batched_tokens:
            raise ContractError(f"the capturer holds {capturer.max_num_batched_tokens} rows, a "
                                f"step may have {max_num_batched_tokens}")

    @property
    def num_requests(self) -> int:
        """Requests the worker still holds state for (deferred teardowns included)."""
        return len(self._table)

    # -- scheduler metadata -------------------------------------------------------

    def begin_step(self, metadata: StepMetadata) -> None:
        """Apply one scheduler step's registrations, block hashes and finished requests.

        A finished request that an unconsumed step still covers is torn down by
        that step's process_output instead.
        """
        self._check_open()
        if not checks.is_int(metadata.generation):
            raise GenerationError(f"the generation is an int, not {metadata.generation!r:.40}")
        if metadata.generation < self._generation:
            raise GenerationError(
                f"generation moved backwards from {self._generation} to {metadata.generation}"
            )
        for name in ("finished_requests", "preempted"):
            ids = getattr(metadata, name)
            # One id is not a list of its letters, and None is not an empty list.
            if isinstance(ids, str) or not isinstance(ids, Iterable):
                kind = "a str" if isinstance(ids, str) else type(ids).__name__
                raise MetadataError(f"{name} is a collection of request ids, not {kind}")
        for name in ("requests", "block_hashes", "completions", "record_as"):
            if not isinstance(getattr(metadata, name), Mapping):
                raise MetadataError(f"step metadata's {name} maps request ids, not "
                                    f"{type(getattr(metadata, name)).__name__}")
        finishing = list(metadata.finished_requests)
        finished = set(finishing)
        if len(finished) != len(finishing):  # a slot freed twice would serve two requests
            raise MetadataError("a request is listed as finished twice in one step")
        # In a reset step the finished requests are the generation before's.
        reset = metadata.generation > self._generation
        both = metadata.requests.keys() & finished
        if both and not reset:
            raise MetadataError(f"requests cannot run and finish in one step: {sorted(both)}")
        unfinished = metadata.completions.keys() - finished
        if unfinished:
            raise MetadataError(f"completions for requests that did not finish: "
                                f"{sorted(unfinished)}")
        preempted = self._preempted(metadata, finished)
        table = self._table
        # Every request and key is checked before anything changes.
        registered = {} if reset else table.slot_of
        if not metadata.requests.keys() <= registered.keys():  # most steps: all known
            for req_id in metadata.requests:
                if req_id not in registered:
                    check_request_id(req_id)
        req_ids = list(metadata.requests)
        emit_starts = _int_list(metadata.requests.values(), "emit starts")
        if emit_starts and min(emit_starts) < 0:
            bad = next(r for r, e in zip(req_ids, emit_starts) if e < 0)
            raise InvalidBatchError(f"request {bad!r}: the emit start must be >= 0")
        # A step that lists no request (a hash-only update) has nothing to look up.
        slots = None if reset else (self._check_emit_starts(req_ids, emit_starts)
                                    if req_ids else [])
        unknown = [r for r in metadata.block_hashes
                   if r not in metadata.requests and r not in registered]
        unknown += [r for r in finishing if r not in table.slot_of and r not in self._delivered]
        for req_id, name in metadata.record_as.items():
            check_request_id(name)
            if req_id not in metadata.completions:
                raise MetadataError(f"record_as for {req_id!r}, which has no completion")
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise MetadataError(f"request {unknown[0]!r} is not registered with the worker "
                                f"connector{more}")
        new_keys = keys_by_request(metadata.block_hashes, metadata.generation)
        with self._lock:
            if metadata.completions:  # under the lock: it reads the steps in flight
                self._check_completions(metadata.completions, new_keys)
            ended: tuple[list[str], list[Manifest]] = ([], [])
            teardown: list[int] = []
            if reset:
                # A prefix-cache reset: only legal once all model output is consumed.
                if self._inflight:
                    raise GenerationError(
                        f"generation changed to {metadata.generation} with "
                        f"{len(self._inflight)} step(s) in flight"
                    )
                # The generation before ends: its finished requests first, then every
                # other request, each keeping what it was given (it resumes in this one).
                self._finish(finishing, metadata, preempted, ended)
                live = table.live_slots()
                table.preempted.update(s for s in live if s not in table.finishing)
                self._teardown(live, *ended)
                ended = ([], [])
                self._generation = metadata.generation
            self._register(req_ids, emit_starts, slots)
            for req_id, keys in new_keys.items():
                slot = table.lookup(req_id)
                table.keys[slot].extend(keys)
                table.nkeys[slot] += len(keys)
                self._unpinned.extend(keys)
                self._collect_keyed(slot, self._unput)
            if not reset:
                teardown = self._finish(finishing, metadata, preempted, ended)
            # Most steps have nothing else to store: their own put pins the new keys and
            # stores the blocks they key.
            if not req_ids or teardown or ended[0] or ended[1]:
                self._teardown(teardown, *ended)

    def _preempted(self, metadata: StepMetadata, finished: set[str]) -> set[str]:
        """The step's preempted requests: finished ones, none of them for good."""
        if not metadata.preempted:  # most steps
            return set()
        preempted = set(metadata.preempted)
        if not preempted <= finished:
            raise MetadataError(f"preempted requests must be finished in the same step: "
                                f"{sorted(preempted - finished)}")
        if not preempted.isdisjoint(metadata.completions):
            raise MetadataError(f"preempted requests cannot finish for good: "
                                f"{sorted(preempted & metadata.completions.keys())}")
        return preempted

    def _finish(self, finishing: list[str], metadata: StepMetadata, preempted: set[str],
                ended: tuple[list[str], list[Manifest]]) -> list[int]:
        """Mark the step's finished requests; returns the slots no step in flight covers
        (torn down now). A request that ended while preempted, with no slot, is recorded
        from what it was given into ``ended`` (releases, manifests)."""
        table = self._table
        teardown: list[int] = []
        for req_id in finishing:
            completion = metadata.completions.get(req_id) if self.record_manifests else None
            if completion is not None:
                completion = Completion(*map(int, completion))
            slot = table.slot_of.get(req_id)
            if slot is None:  # given rows before its preemption, never resumed
                given = self._delivered.pop(req_id)
                if completion is not None:
                    name = metadata.record_as.get(req_id) or req_id
                    lo, hi = completion.prompt_start, completion.num_tokens - 1
                    ended[1].append(Manifest(name, self.layout.fingerprint, completion,
                                             given.between(lo, hi)))
                ended[0].extend(reversed(given.held))
                continue
            table.finishing.add(slot)
            if completion is not None:
                table.completion[slot] = completion
                table.record_as[slot] = metadata.record_as.get(req_id)
            elif req_id in preempted:
                table.preempted.add(slot)
            if not self._in_flight(slot):
                teardown.append(slot)
        return teardown

    def _check_completions(self, completions, new_keys: dict[str, list[str]]) -> None:
        """Each completion is two counts, and its manifest names no row the request will
        not have: rows captured, or to be by a step in flight, or in blocks with a hash."""
        table, bs = self._table, self.layout.block_size
        for req_id, completion in completions.items():
            if not is_completion(completion):
                raise MetadataError(f"completion of request {req_id!r}: {completion!r:.80} is "
                                    "not two counts (prompt start, number of tokens)")
            start, end = completion[0], completion[1] - 1  # the last token routes nothing
            if end <= start:
                continue
            slot = table.slot_of.get(req_id)
            if slot is None:  # ended while preempted: only what it was given
                given = self._delivered[req_id]
                have = given.end if given.start <= start else start
            else:
                keyed = (int(table.nkeys[slot]) + len(new_keys.get(req_id, ()))) * bs
                running = [int(p.token_starts[i] + p.counts[i]) for p in self._inflight
                           for i in np.flatnonzero(p.slots == slot).tolist()]
                have = max(keyed, int(table.capture[slot]), *running)
            if end > have:
                raise MetadataError(f"completion of request {req_id!r} names rows up to "
                                    f"{end}; the worker has rows up to {have}")

    def _in_flight(self, slot: int) -> bool:
        """Whether a step prepared and not yet processed covers the slot."""
        return any(p.covers(slot) for p in self._inflight)

    def _check_emit_starts(self, req_ids: list[str], emit_starts: list[int]) -> list[int]:
        """A registered request's emit start never runs ahead of the worker's; returns the
        requests' slots (-1 where none).

        Only settled requests are checked: in-flight steps leave the worker behind the
        scheduler. A request whose old incarnation is finishing registers afresh. Per
        request, in Python: a step's few hundred requests cost less so than numpy calls.
        """
        table = self._table
        slots = table.find(req_ids)
        worker = table.emit[slots].tolist()
        slots = slots.tolist()
        if not any(map(operator.gt, emit_starts, worker)):
            return slots
        # With steps in flight the scheduler runs ahead of every request they cover.
        busy = set().union(*(p.slot_set() for p in self._inflight))
        for i, (start, emit) in enumerate(zip(emit_starts, worker)):
            # A slot of -1 reads some row: only known, settled slots count.
            if (start > emit and slots[i] >= 0 and slots[i] not in table.finishing
                    and slots[i] not in busy):
                raise CursorError(f"request {req_ids[i]!r}: scheduler emit start {start} is "
                                  f"ahead of the worker's {emit}")
        return slots

    def _register(self, req_ids: list[str], emit_starts: list[int], slots) -> None:
        """Give each request that is not running yet a slot (running ones keep theirs).

        ``slots`` are the requests' slots found before the step changed anything, None
        when every request is new (after a prefix-cache reset).
        """
        table = self._table
        if slots is None:
            new = range(len(req_ids))
        else:
            new = [i for i, s in enumerate(slots) if s < 0] if -1 in slots else []
            if table.finishing:
                # Resumed while the old incarnation's teardown waits on an in-flight step.
                resumed = [i for i, s in enumerate(slots) if s in table.finishing]
                for i in resumed:
                    table.detach(slots[i])
                new += resumed
        for i in new:
            table.add(req_ids[i], emit_starts[i])
        if self._delivered:
            for i in new:
                given = self._delivered.get(req_ids[i])
                if given is not None:
                    self._delivered[req_ids[i]] = given.up_to(emit_starts[i])

    def _collect_keyed(self, slot: int, objects: dict[str, np.ndarray]) -> None:
        """Move full blocks whose hash has now arrived from ``unkeyed`` into ``objects``."""
        waiting = self._table.unkeyed.get(slot)
        if not waiting:
            return
        keys = self._table.keys[slot]
        for index in [i for i in waiting if i < len(keys)]:
            objects[keys[index]] = waiting.pop(index)

    def _put(self, objects, release=(), manifests=()) -> None:
        """One store call: the keys requests received since the last one are pinned first
        (a put pins before it stores and unpins), and the parked blocks keyed since then
        are stored with ``objects``. A refused call changes nothing in the store: all it
        carried goes with the next call, so an engine that goes on loses nothing."""
        retain, unput = self._unpinned, self._unput
        if unput:
            objects = {**unput, **objects}
        if self._unsent:
            release, manifests = (self._unsent[0] + [*release],
                                  self._unsent[1] + [*manifests])
        if objects or retain or release or manifests:
            try:
                self.store.put(objects, retain, release, manifests)
            except R3Error as exc:
                self.stats.errors[type(exc).__name__] += 1
                # Copies (parked blocks are already): blocks may be views of tails or of
                # the step's rows, manifests of a tail, which later steps write into.
                self._unput = {key: unput[key] if key in unput else block.copy()
                               for key, block in objects.items()}
                self._unsent = ([*release], [m.own_copy() for m in manifests])
                raise
            self._unpinned = []
            self._unput = {}
            self._unsent = None
            self.stats.blocks_published += len(objects)
            self.stats.manifests += len(manifests)

    def _teardown(self, slots: list[int], release=(), manifests=()) -> None:
        """Record finished requests' manifests, release their keys tail first, free them;
        a preempted request keeps what it was given. ``release`` and ``manifests`` go
        with them.

        One store call, so the manifests hold their blocks before the request lets go.
        """
        if not slots:  # most steps: no request ends
            self._put({}, release, manifests)
            return
        table = self._table
        release, manifests = list(release), list(manifests)
        for s in slots:
            req_id = table.req_id[s]
            given = self._delivered.pop(req_id, None) if self._delivered else None
            if s in table.completion:
                manifests.append(self._manifest(s, given))
            if given is None and s not in table.preempted:  # most requests: nothing kept
                release += reversed(table.keys[s])
                continue
            held = [*reversed(table.keys[s]), *reversed(given.held if given else ())]
            if s in table.preempted:
                # Kept until the request ends, running again or not (empty where no
                # manifest will name it): the scheduler tells of its end either way.
                given = self._given(s, given) if self.record_manifests else _NOTHING
                resumed = table.slot_of.get(req_id, s)  # registered again already
                if resumed != s:
                    given = given.up_to(int(table.emit_from[resumed]))
                self._delivered[req_id] = given
                held = without(held, given.held)
            release += held
        table.free(slots)  # what the call carries stays the worker's if it is refused
        self._put({}, release, manifests)

    def _given(self, slot: int, before: Delivered | None) -> Delivered:
        """What the request in ``slot`` was given: ``before`` (its earlier incarnations'),
        then its own rows up to its emit cursor, its stored blocks by key (held), the rest
        copied."""
        table = self._table
        emit = int(table.emit[slot])
        if before is None:
            before = Delivered(int(table.emit_from[slot]), [], [])
        if before.end >= emit:
            return before
        span = self._span(slot, before.end, emit, self._owned)
        return Delivered(before.start, [*before.segments, *span],
                         [*before.held, *span.block_keys])

    @classmethod
    def _owned(cls, part: tuple) -> BlockRef | np.ndarray:
        segment = cls._segment(part)
        return segment if isinstance(segment, BlockRef) else segment.copy()

    def _manifest(self, slot: int, given: Delivered | None = None) -> Manifest:
        """The request's rows by reference: keyed whole blocks in one slice of its keys,
        only the partial blocks at either end looked up one by one. Rows it was given
        before a preemption come from ``given``."""
        table = self._table
        completion = table.completion[slot]
        lo, hi = completion.prompt_start, completion.num_tokens - 1
        before: list = []
        if given is not None and lo < hi and lo >= given.start:
            before = given.between(lo, hi)
            lo = max(lo, min(given.end, hi))
        segments: list | BlockSpan = before
        if lo < hi:
            segments = self._span(slot, lo, hi, self._segment)
            segments.head[:0] = before
        return Manifest(table.record_as.get(slot) or table.req_id[slot],
                        self.layout.fingerprint, completion, segments)

    def _span(self, slot: int, lo: int, hi: int, segment) -> BlockSpan:
        """Rows ``[lo, hi)`` of the request in ``slot`` as manifest segments, each part
        at either end made by ``segment``."""
        head, keys, tail = self._spans(slot, lo, hi, {}, hi // self.layout.block_size)
        return BlockSpan([*map(segment, head)], keys, [*map(segment, tail)],
                         self.layout.block_size)

    def _spans(self, slot: int, lo: int, hi: int, own, keyed_until: int,
               req_id: str | None = None) -> tuple[list, list[str], list]:
        """Rows ``[lo, hi)`` as (head parts, keys of whole stored blocks, tail parts).

        Whole blocks before ``keyed_until`` that have keys come as one slice of the
        request's keys; only the partial or unkeyed blocks at either end are looked
        up one by one (``_sources``).
        """
        bs = self.layout.block_size
        first = min(-(-lo // bs), hi // bs)
        last = max(min(keyed_until, hi // bs, int(self._table.nkeys[slot])), first)
        head = self._sources(slot, lo, first * bs, own, req_id) if lo < first * bs else []
        tail = (self._sources(slot, max(last * bs, lo), hi, own, req_id)
                if max(last * bs, lo) < hi else [])
        return head, self._table.keys[slot][first:last], tail

    @staticmethod
    def _segment(part: tuple) -> BlockRef | np.ndarray:
        source, a, b = part
        # A view of the tail buffer, which the next request in the slot reuses: the manifest
        # goes straight to the store, and every store copies what put hands it.
        return BlockRef(source, a, b) if isinstance(source, str) else source[a:b]

    # -- model runner output ------------------------------------------------------

    def prepare_output(
        self, batch: StepBatch, routed_experts: np.ndarray | None = None
    ) -> PendingOutput:
        """Take one executed step's rows; call enqueue_cpu_copy, then process_output."""
        self._check_open()
        if isinstance(batch.req_ids, str):  # one id, not a batch of its letters
            raise InvalidBatchError("req_ids is a sequence of request ids, not a str")
        req_ids = list(batch.req_ids)
        n = len(req_ids)
        qsl = _integers(batch.query_start_loc, "query_start_loc", n + 1)
        starts = _integers(batch.num_computed_tokens, "num_computed_tokens", n)
        if len(qsl) < n + 1 or len(starts) < n:
            raise InvalidBatchError(
                f"{n} requests need {n + 1} query_start_loc and {n} num_computed_tokens "
                f"entries, got {len(qsl)} and {len(starts)}"
            )
        counts = qsl[1:] - qsl[:-1]
        bounds = qsl.tolist()
        rows_end = bounds[-1]
        # One test for the usual batch, in Python over a few hundred ints (each numpy
        # call costs more); the failing one is told apart below.
        if n and (bounds[0] < 0 or not all(map(operator.lt, bounds, bounds[1:]))
                  or min(starts.tolist()) < 0):
            if bounds[0] < 0 or starts.min() < 0:
                raise InvalidBatchError("query_start_loc and num_computed_tokens must be >= 0")
            bad = int(np.argmax(counts <= 0))
            raise InvalidBatchError(
                f"request {req_ids[bad]!r} has {int(counts[bad])} rows in the batch; "
                "query_start_loc must increase (rows must not overlap)"
            )
        snapshot = None
        if routed_experts is None:
            if self.capturer is None:
                raise InvalidBatchError("routed_experts is required: no capturer is bound")
            if rows_end > self.max_num_batched_tokens:
                raise InvalidBatchError(
                    f"the batch covers {rows_end} rows, max_num_batched_tokens is "
                    f"{self.max_num_batched_tokens}"
                )
            snapshot = self.capturer.snapshot(rows_end)
        else:
            self.layout.check_rows(routed_experts, "routed_experts")
            if n and len(routed_experts) < rows_end:
                raise InvalidBatchError(f"routed_experts has {len(routed_experts)} rows, "
                                        f"the batch covers {rows_end}")
            # One copy per step into an array the connector owns: the caller reuses its
            # buffer (a capture buffer, a pinned slot), and outputs are slices of this one.
            routed_experts = routed_experts[: rows_end if n else 0].copy()
        with self._lock:
            if len(self._inflight) >= self.max_concurrent_batches:
                raise InvalidBatchError(
                    f"{len(self._inflight)} step(s) already in flight "
                    f"(max_concurrent_batches={self.max_concurrent_batches}); "
                    "process outputs in order first"
                )
            table = self._table
            slots = table.slots(req_ids)
            if table.finishing and not table.finishing.isdisjoint(slots.tolist()):
                bad = next(r for r, s in zip(req_ids, slots.tolist()) if s in table.finishing)
                raise MetadataError(f"request {bad!r} finished and cannot run again")
            pending = PendingOutput(self, req_ids, slots, starts, qsl, counts, routed_experts,
                                    snapshot)
            self._inflight.append(pending)
        return pending

    def process_output(self, pending: PendingOutput) -> dict[str, RequestOutput]:
        """Commit one consumed step and return each request's newly owed rows.

        Teardown deferred by begin_step completes here once no in-flight step
        covers the request; its keys are released tail block first.
        """
        if pending.host_copy is not None:
            pending._await_copy()  # waits on this step's copy event, outside the lock
        with self._lock:
            self._check_open()  # close(), on any thread, dropped the steps in flight
            if not self._inflight or self._inflight[0] is not pending:
                raise InvalidBatchError("step outputs must be processed in the order prepared")
            if pending.num_sampled is None or pending.num_rejected is None:
                raise InvalidBatchError("enqueue_cpu_copy was not called for this step")
            try:
                outputs = self._commit(pending)
            except BaseException:
                self._step_done(pending)
                raise
            try:
                self._step_done(pending)
            except (StoreUnavailableError, StoreFullError) as exc:
                # The outputs are the requests' own (their emit cursors moved): returned.
                # The refused teardown stays the worker's, and the next store call carries
                # it (and raises in its turn while the store still refuses).
                log.warning("r3cache: finished requests' releases and manifests wait for "
                            "the next store call: %s", exc)
        return outputs

    def _step_done(self, pending: PendingOutput) -> None:
        """Take a processed step off the queue, and tear down the finished requests that
        only it still covered."""
        self._inflight.popleft()
        table = self._table
        if table.finishing:
            done = [s for s in pending.slots.tolist()
                    if s in table.finishing and not self._in_flight(s)]
            if done:
                self._teardown(done)

    def _commit(self, pending: PendingOutput) -> dict[str, RequestOutput]:
        table = self._table
        slots = pending.slots
        qsl, counts = pending.query_start_loc, pending.counts
        row0 = qsl[:-1]
        rows = pending.routed_experts
        sampled, rejected = pending.num_sampled, pending.num_rejected
        spec = bool(np.count_nonzero(rejected))
        if spec:
            bad = (rejected < 0) | (rejected > counts)
            if bad.any():
                i = int(np.argmax(bad))
                raise InvalidBatchError(
                    f"request {pending.req_ids[i]!r}: {int(rejected[i])} rejected of "
                    f"{int(counts[i])} tokens"
                )
        valid = counts - rejected if spec else counts
        # Decode steps keep one row per request, in batch order, and a few long requests
        # (prefill) are cheaper per request: no per-row index arrays for either.
        num_rows = int(qsl[-1] - qsl[0])
        one_each = not spec and num_rows == len(slots)
        if one_each or (not spec and num_rows > _ROWS_PER_REQUEST * len(slots)):
            req = offset = None
            kept = rows[int(qsl[0]) : int(qsl[-1])]
        else:
            # The step's kept rows, request by request (rejected draft rows are discarded).
            req = np.repeat(np.arange(len(slots)), valid)
            offset = np.arange(len(req)) - np.repeat(np.cumsum(valid) - valid, valid)
            kept = rows[row0[req] + offset] if spec else rows[int(qsl[0]) : int(qsl[-1])]
        # Checked before anything changes: rows no router could have picked would be
        # stored, shared and replayed.
        problem = self.layout.id_problem(kept)
        if problem:
            raise InvalidBatchError(f"routed_experts of this step: {problem}")
        token_starts = pending.token_starts
        start = table.capture[slots]
        first = start == NO_CURSOR
        any_first = bool(np.count_nonzero(first))
        if any_first:
            start = np.where(first, token_starts, start)
        if np.count_nonzero(token_starts != start):
            self._check_cursors(pending, start, table.scheduled[slots])
        # Capture precedes speculative acceptance: rows past `valid` are discarded, and
        # after an optimistic suffix was rejected capture re-attaches at `start`.
        end = start + valid
        if any_first:
            table.owned_from[slots[first]] = start[first]
        table.capture[slots] = end
        table.scheduled[slots] = token_starts + counts
        self.stats.steps += 1
        self.stats.rows_captured += len(kept)

        made, published, runs = self._capture(slots, start, end, row0, rows, req, offset,
                                              kept if one_each else None)

        ids = pending.req_ids
        old = table.emit[slots].tolist()
        starts, num_sampled = start.tolist(), sampled.tolist()
        new = tuple.__new__  # RequestOutput(e, rows), without the Python-level __new__
        if old == starts and min(num_sampled, default=0) > 0:
            # Every request is owed exactly the rows it kept, from where it emits (decode,
            # speculative decoding, a prompt's last chunk): the outputs are built in C
            # calls, one view per request, no Python loop.
            self._put(published)
            table.emit[slots] = end
            views = (kept[:, None] if one_each else
                     map(rows.__getitem__, map(slice, row0.tolist(), (row0 + valid).tolist())))
            return dict(zip(ids, map(new, repeat(RequestOutput), zip(old, views))))
        # Per request in Python, one pass: the few hundred requests of a step cost less so
        # than a dozen numpy calls over them would.
        emits = list(old)
        ends, firsts, kept = end.tolist(), row0.tolist(), valid.tolist()
        outputs: dict[str, RequestOutput] = {}
        later = []
        for i, (e, a, z, n) in enumerate(zip(old, starts, ends, num_sampled)):
            if n <= 0 or e > z:
                continue  # owed nothing this step
            emits[i] = z
            if e >= a:
                outputs[ids[i]] = new(RequestOutput,
                                      (e, rows[firsts[i] + e - a : firsts[i] + kept[i]]))
            else:
                later.append(i)  # owed rows from before this step's capture start
        try:
            if later:
                self._materialise(pending, later, old, ends, dict(made), published, runs,
                                  outputs)
        finally:
            # The step's blocks go to the store once its outputs are built (its own hits
            # read them from `published`): behind a writer thread, the copies and pins run
            # while the engine's thread has moved on. Emit cursors move once they are put:
            # a refused put leaves the rows owed.
            self._put(published)
            table.emit[slots] = emits
        return outputs

    def _check_cursors(self, pending: PendingOutput, cursor, scheduled) -> None:
        starts = pending.token_starts
        backwards = starts < cursor
        if backwards.any():
            i = int(np.argmax(backwards))
            raise CursorError(
                f"request {pending.req_ids[i]!r}: capture moved backwards "
                f"(step starts at {int(starts[i])}, captured up to {int(cursor[i])})"
            )
        gap = (starts > cursor) & (cursor >= scheduled)
        if gap.any():
            i = int(np.argmax(gap))
            raise CursorError(
                f"request {pending.req_ids[i]!r}: unbacked gap between captured "
                f"{int(cursor[i])} and step start {int(starts[i])}"
            )

    def _capture(self, slots, start, end, row0, rows, req, offset, one_each=None
                 ) -> tuple[Iterable[tuple[tuple[int, int], np.ndarray]], dict[str, np.ndarray],
                            list[tuple[int, int, np.ndarray]]]:
        """Write the step's valid rows into tails; key or park the blocks they complete.

        Vectorised over all rows of the step (``req``, ``offset``: each row's request and
        its place in the request's kept rows), or over requests where ``req`` is None: a few
        long ones, whose rows are contiguous. ``one_each`` holds the kept rows when every
        request kept exactly one (decode): then each row lands in its request's tail and
        completes at most that block. Returns the blocks completed here as ((slot, block
        index), rows) pairs and (those with keys) by key, for materialisation, and the
        runs of whole blocks that lie one after another in the step's rows, as (slot,
        first block index, rows).
        """
        table = self._table
        bs = self.layout.block_size
        first_block = start // bs
        if one_each is not None:
            table.tail[slots, start % bs] = one_each
            # A row completes its block when it is the block's last (`end` on a boundary).
            done_first = np.flatnonzero(end % bs == 0)
            if not len(done_first):
                return (), {}, ()
        elif req is not None and not len(req):
            return (), {}, ()
        else:
            end_block = end // bs  # block holding `end`: the tail after this step
            if req is None:
                self._to_tails(slots, start, np.minimum(end, (first_block + 1) * bs), row0,
                               rows)
            else:
                pos = start[req] + offset
                src = row0[req] + offset
                in_first = (pos // bs) == first_block[req]
                table.tail[slots[req[in_first]], pos[in_first] % bs] = rows[src[in_first]]
            # A block is done when the step's rows reach past it (no rows: end == start).
            done_first = (end_block > first_block).nonzero()[0]
        # A first block this incarnation did not capture from its start is a prefix
        # hit: the store already has it, and its tail rows before owned_from are void.
        owned = first_block[done_first] * bs >= table.owned_from[slots[done_first]]
        head = done_first[owned]
        block_req = [head]
        block_idx = [first_block[head]]
        runs: list[tuple[int, int, np.ndarray]] = []
        if one_each is not None:
            # Views: no row of this step lands in a tail after its block completed, and
            # the store copies what put hands it.
            blocks = [*map(table.tail.__getitem__, slots[head].tolist())]
            fresh = 0
        else:
            blocks = list(table.tail[slots[head]])  # copies: the last rows go into tails
            fresh = len(blocks)
            middle = np.maximum(end_block - first_block - 1, 0)
            if middle.any():
                # Whole blocks inside one request's kept rows (contiguous, rejected drafts
                # come last): views of the step's rows, an array no later step writes.
                # The store copies what it keeps.
                for i in middle.nonzero()[0].tolist():
                    m, j = int(middle[i]), int(first_block[i]) + 1
                    at = int(row0[i]) + j * bs - int(start[i])
                    run = rows[at : at + m * bs]
                    blocks.extend(run.reshape(m, *self.layout.block_shape))
                    runs.append((int(slots[i]), j, run))
                    block_req.append(np.full(m, i))
                    block_idx.append(np.arange(j, j + m))
            if req is None:
                # Rows in the block holding `end`, when it is not the first block.
                lo = np.where(end_block > first_block, end_block * bs, end)
                self._to_tails(slots, lo, end, row0 + lo - start, rows)
            else:
                in_last = ~in_first & ((pos // bs) == end_block[req])
                table.tail[slots[req[in_last]], pos[in_last] % bs] = rows[src[in_last]]
        if len(block_req) > 1:
            block_req, block_idx = np.concatenate(block_req), np.concatenate(block_idx)
        else:
            (block_req,), (block_idx,) = block_req, block_idx
        return (*self._publish(slots[block_req], block_idx, blocks, fresh), runs)

    def _to_tails(self, slots, lo, hi, src, rows) -> None:
        """Copy each request's rows for positions ``[lo, hi)``, all in one block and
        starting at row ``src`` of the step, into its tail."""
        bs, tail = self.layout.block_size, self._table.tail
        for s, a, z, r in zip(slots.tolist(), lo.tolist(), hi.tolist(), src.tolist()):
            if a < z:
                tail[s, a % bs : a % bs + z - a] = rows[r : r + z - a]

    def _publish(self, block_slots, block_idx, blocks, fresh: int
                 ) -> tuple[Iterable[tuple[tuple[int, int], np.ndarray]], dict[str, np.ndarray]]:
        """Key the blocks whose hash arrived (the caller puts them), park the others until
        theirs does. Blocks from ``fresh`` on are views (of the step's rows or of tails): a
        parked one is copied, so it neither keeps the whole step alive nor changes with its
        tail. Returns the blocks as ((slot, block index), rows) pairs, lazily (only prefix
        hits and chunked prefill read them), and the keyed ones by key."""
        table = self._table
        slots, index = block_slots.tolist(), block_idx.tolist()
        keyed = block_idx < table.nkeys[block_slots]
        if keyed.all():  # the usual case: a block's hash comes with the step that fills it
            keys = map(operator.getitem, map(table.keys.__getitem__, slots), index)
            objects = dict(zip(keys, blocks))  # built in C: no Python step per block
        else:
            objects = {}
            for n, (s, j, k, block) in enumerate(zip(slots, index, keyed.tolist(), blocks)):
                if k:
                    objects[table.keys[s][j]] = block
                else:
                    table.unkeyed.setdefault(s, {})[j] = block if n < fresh else block.copy()
        return zip(zip(slots, index), blocks), objects

    def _materialise(self, pending, later, emit, end, own, published, runs, outputs) -> None:
        """Serve rows owed before this step's capture start (prefix hits, chunked prefill).

        The whole batch was published first, so a consumer may read a block that a
        producer completed earlier in the same batch: those come from ``published``
        without waiting for the writer; the other keys in one store read, each once.
        Each request's rows are one array of its own.
        """
        bs = self.layout.block_size
        table = self._table
        plans = []
        wanted: dict[str, None] = {}  # keys to read from the store, first use first
        served = 0  # block reads the prefix hits make, wherever the block comes from
        for i in later:
            slot = int(pending.slots[i])
            # Whole blocks before this incarnation's capture exist only in the store.
            head, keys, tail = self._spans(slot, emit[i], end[i], own,
                                           int(table.owned_from[slot]) // bs,
                                           pending.req_ids[i])
            # Keys in use order; a prefix hit's hundreds of whole blocks are filtered in C.
            used = [*(p[0] for p in head if isinstance(p[0], str)), *keys,
                    *(p[0] for p in tail if isinstance(p[0], str))]
            served += len(used)
            wanted.update(dict.fromkeys(filterfalse(published.__contains__, used)))
            plans.append((i, emit[i], head, keys, tail))
        # Every whole block that lies in a run, blocks one after another in one array (a
        # producer's whole blocks in this step's rows, the store's read of the step's hits
        # in first-use order), by key: (the run's keys, the block's place in them, the
        # run's rows). A hit is copied a run at a time, not block by block.
        at: dict[str, tuple[list[str], int, np.ndarray]] = {}
        for slot, j, run in runs:
            keys = table.keys[slot][j : j + len(run) // bs]
            at.update(zip(keys, zip(repeat(keys), count(), repeat(run))))
        if wanted:
            keys = list(wanted)
            stored = self._read_store(keys, pending, plans)
            at.update(zip(keys, zip(repeat(keys), count(), repeat(stored))))

        def block(key):
            where = at.get(key)
            if where is None:  # completed in a tail this step
                return published[key]
            _, n, run = where
            return run[n * bs : (n + 1) * bs]

        def parts(head_or_tail):
            return [(block(p) if isinstance(p, str) else p)[a:b] for p, a, b in head_or_tail]

        def whole(keys):
            pieces, p = [], 0
            while p < len(keys):
                where = at.get(keys[p])
                if where is None:  # in no run: one block
                    pieces.append(block(keys[p]))
                    p += 1
                    continue
                run_keys, n, run = where
                m = min(len(run_keys) - n, len(keys) - p)
                if keys[p : p + m] != run_keys[n : n + m]:  # the hit leaves the run
                    m = 1
                    while keys[p + m] == run_keys[n + m]:
                        m += 1
                pieces.append(run[n * bs : (n + m) * bs])
                p += m
            return pieces

        for i, lo, head, keys, tail in plans:
            pieces = [*parts(head), *whole(keys), *parts(tail)]
            outputs[pending.req_ids[i]] = RequestOutput(lo, np.concatenate(pieces))
        self.stats.blocks_read += served

    def _sources(self, slot: int, lo: int, hi: int, own, req_id: str | None = None
                 ) -> list[tuple[np.ndarray | str, int, int]]:
        """Where rows ``[lo, hi)`` of a request are: per block (rows, start, stop).

        Rows come from blocks completed this step, then unkeyed blocks, then the
        tail buffer (rows this incarnation captured), and otherwise from the store:
        the block's key stands in for rows it holds.
        """
        table = self._table
        bs = self.layout.block_size
        capture = int(table.capture[slot])
        owned = int(table.owned_from[slot])
        unkeyed = table.unkeyed.get(slot, {})
        parts: list[tuple[np.ndarray | str, int, int]] = []
        for j in range(lo // bs, (hi - 1) // bs + 1):
            a, b = max(lo, j * bs) - j * bs, min(hi, (j + 1) * bs) - j * bs
            source = own.get((slot, j))
            if source is None:
                source = unkeyed.get(j)
            if (source is None and capture >= 0 and j == capture // bs
                    and owned <= j * bs + a and j * bs + b <= capture):
                source = table.tail[slot]
            if source is None:
                if j >= table.nkeys[slot]:
                    raise CursorError(
                        f"request {req_id or table.req_id[slot]!r}: rows {j * bs + a}.."
                        f"{j * bs + b} are neither captured nor backed by a block hash"
                    )
                source = table.keys[slot][j]
            parts.append((source, a, b))
        return parts

    def _read_store(self, keys: list[str], pending, plans) -> np.ndarray:
        if not keys:
            return self.layout.empty_rows()
        self._put({})  # pinned before the read, as received; keyed parked blocks stored
        try:
            stored = self.store.get_concatenated(keys)
        except R3Error as exc:
            self.stats.errors[type(exc).__name__] += 1
            if not isinstance(exc, BlockNotFoundError):
                raise
            raise BlockNotFoundError(
                exc.keys,
                namespace=exc.namespace,
                request_ids=[pending.req_ids[plan[0]] for plan in plans],
                cause="a prefix-cache hit on a block the store no longer holds "
                "(evicted after its last release, or never published)",
            ) from exc
        return stored

    # -- shutdown -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the connector of namespace {self.store.namespace!r} is "
                                   "closed: it takes no more steps")

    def close(self) -> None:
        """Release every pin this worker holds, drain the writer and close the store."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            table = self._table
            release = [k for s in table.live_slots() for k in reversed(table.keys[s])]
            release += [k for given in self._delivered.values() for k in reversed(given.held)]
            self._delivered.clear()
            table.clear()
            self._inflight.clear()
            try:
                self._put({}, release)
            finally:
                self.store.close()
