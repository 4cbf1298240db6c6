"""BackgroundBlockStore: a writer thread, so publication never blocks the inference thread."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from r3cache.errors import StoreClosedError, StoreError, StoreUnavailableError, WriterError
from r3cache.manifest import Manifest
from r3cache.metrics import WAIT_BUCKETS, Timings
from r3cache.store.base import BlockStore, StoreStats, check_put
from r3cache.store.memory import MemoryBlockStore
from r3cache.store.writers import check_policy
from r3cache.store.writers.bounded import (
    REFUSALS,
    BoundedCalls,
    Refusal,
    Stall,
    put_until_written,
    wait_while_progressing,
)

DEFAULT_MAX_PENDING = 512
_STOP = object()
log = logging.getLogger("r3cache.store")
_IDLE_POLL = 0.5  # seconds between an idle writer's looks at whether the store closed


def _net_pins(retain: Iterable[str], release: Iterable[str]) -> dict[str, int]:
    """Each key's pins less its releases, keys that net to nothing left out."""
    net = Counter(retain)
    net.subtract(release)
    return {k: n for k, n in net.items() if n}


def _with_pins(item: tuple, net: dict[str, int]) -> tuple:
    """A put's ``(objects, retain, release, manifests)`` with the ``net`` pins of batches
    dropped before it: a store sets each hold to its owner's count, so only the net of
    each key matters, not the order of the pins it took and let go."""
    objects, retain, release, manifests = item
    pinned = [k for k, n in net.items() if n > 0 for _ in range(n)]
    unpinned = [k for k, n in net.items() if n < 0 for _ in range(-n)]
    return objects, [*pinned, *retain], [*release, *unpinned], manifests


class BackgroundBlockStore:
    """Own the writer thread and bounded queue in front of another BlockStore.

    ``put`` only enqueues; when the queue is full it waits at most ``max_wait``
    seconds, then raises StoreUnavailableError (the engine never stalls for good
    on a dead store), and until the writer takes a batch again later puts wait only
    ``Stall.PUT_GRACE`` (one stall costs one wait). Operations are
    applied in order, so a read after a ``put`` sees it: reads drain the queue
    first. A batch the store refuses (unavailable, or a full Redis: ``REFUSALS``) is
    dropped under ``on_unavailable="incomplete"``; under ``"raise"`` it is written again
    until the store takes it (or a close gave up on the writer), and the writer goes on.
    Any other failure is sticky: every later call raises WriterError whose ``__cause__``
    is the original error, and nothing after it is applied.
    """

    def __init__(self, inner: BlockStore, max_pending: int = DEFAULT_MAX_PENDING,
                 max_wait: float = 10.0, on_unavailable: str = "raise") -> None:
        check_policy(on_unavailable)
        self.inner = inner
        self.max_wait = max_wait
        self.on_unavailable = on_unavailable
        self.dropped_batches = 0  # batches the store refused, lost ("incomplete")
        self.waits = Timings(WAIT_BUCKETS)  # puts that found the queue full
        self.layout = inner.layout
        self.namespace = inner.namespace
        self.hash_algo = inner.hash_algo
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._close_error: BaseException | None = None  # from the inner store's close
        self._closed = False
        self._abandoned = False  # a close gave up waiting: nobody waits for the writes
        self._refusal = Refusal()  # of the batch the writer repeats
        # The embedded store frees memory only through this writer's later batches (no
        # trainer or expiry frees any): full, it stays full, and its failure is final.
        self._refusals = ((StoreUnavailableError,) if type(inner) is MemoryBlockStore
                          else REFUSALS)
        # Pins of batches dropped under "incomplete", net per key, that the next batch
        # takes: the writer's (the store refused them) and the engine's (the queue was full).
        self._unapplied: dict[str, int] = {}
        self._unqueued: dict[str, int] = {}
        self._taken = 0  # batches the writer has taken: its progress
        self._stall = Stall(lambda: self._taken)
        self._thread = threading.Thread(
            target=self._run, name=f"r3cache-writer-{inner.namespace}", daemon=True
        )
        self._thread.start()
        # The embedded store answers from memory, never waiting on a network: its reads
        # need no helper thread to bound them.
        self._reads = (None if type(inner) is MemoryBlockStore
                       else BoundedCalls(f"r3cache-read-{inner.namespace}"))

    def put(
        self,
        objects: Mapping[str, np.ndarray],
        retain_keys: Collection[str] = (),
        release_keys: Sequence[str] = (),
        manifests: Sequence[Manifest] = (),
    ) -> None:
        self._check()
        if objects or retain_keys or release_keys or manifests:
            # Bad arguments are refused here, not in the writer (blocks by _owned).
            check_put(self.layout, objects, retain_keys, release_keys, manifests,
                      blocks=False)
            item = (self._owned(objects), retain_keys, release_keys,
                    [m.own_copy() for m in manifests])
            if self._unqueued:
                item, self._unqueued = _with_pins(item, self._unqueued), {}
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                pass  # the writer is behind: wait for it, at most max_wait
            began = time.monotonic()
            try:
                self._queue.put(item, timeout=self._stall.put_wait(self.max_wait))
            except queue.Full:
                self._stall.gave_up()
                if self.on_unavailable == "incomplete":
                    # The requests of this batch are incomplete: their read-back fails
                    # with ManifestNotFoundError or BlockNotFoundError, never wrong rows.
                    # Its pins go with the next batch.
                    self.dropped_batches += 1
                    self._unqueued = _net_pins(item[1], item[2])
                    return
                raise self._refusal.error(self.namespace, self.max_wait) from None
            finally:
                self.waits.observe(time.monotonic() - began)

    def _owned(self, objects: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The blocks as rows of their own, checked: the queue holds them until the writer
        stores them, and the caller may write into its arrays as soon as put returns (a
        request into the rows it was handed, an engine into a reused buffer)."""
        if not objects:
            return {}
        self.layout.check_blocks(objects)  # a bad block is refused here, not in the writer
        values = list(objects.values())
        try:
            # One copy for the whole batch, through the buffer protocol: a fifth of
            # np.concatenate's cost per block (a prefill step brings hundreds). Read-only,
            # as the writer only reads them.
            copies = np.frombuffer(b"".join(values), self.layout.dtype)
        except TypeError:  # a block that is not C-contiguous exports no plain buffer
            copies = np.concatenate(values)
        return dict(zip(objects, copies.reshape(len(objects), *self.layout.block_shape)))

    def get_manifests(self, request_ids: Sequence[str]) -> list[Manifest | None]:
        self.flush()
        return self.inner.get_manifests(request_ids)

    def release_manifests(self, request_ids: Sequence[str]) -> int:
        self.flush()
        return self.inner.release_manifests(request_ids)

    def get_concatenated(self, keys: Sequence[str]) -> np.ndarray:
        return self._read(self.inner.get_concatenated, keys)

    def read_into(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> None:
        """Blocks into ``targets``, all within ``max_wait`` seconds, flush included."""
        self._read(self.inner.read_into, keys, targets)

    def _read(self, call, *args):
        """``call(*args)`` on the inner store after every earlier put, within ``max_wait``."""
        deadline = time.monotonic() + self.max_wait
        self.flush(deadline)
        if self._reads is None:
            return call(*args)
        return self._reads.run(deadline, f"namespace {self.namespace!r}: reading blocks",
                               call, *args)

    def flush(self, deadline: float | None = None) -> None:
        """Wait for every earlier put, at most ``max_wait`` seconds or until ``deadline``
        (then a typed error)."""
        self._check()
        if deadline is None:
            deadline = time.monotonic() + self.max_wait
        done = self._queue.all_tasks_done
        with done:
            if not done.wait_for(lambda: not self._queue.unfinished_tasks,
                                 timeout=max(deadline - time.monotonic(), 0)):
                raise StoreUnavailableError(
                    f"namespace {self.namespace!r}: earlier writes still pending after "
                    f"{self.max_wait:g} s (store down or stalled?)")
        self._check()

    def stats(self) -> StoreStats:
        self.flush()
        return self.inner.stats()

    @property
    def pending(self) -> int:
        """Operations queued and not yet applied."""
        return self._queue.unfinished_tasks

    @property
    def refused_seconds(self) -> float:
        """How long the store has refused the batch the writer repeats (0.0: none)."""
        return self._refusal.seconds()

    @property
    def conflicts(self) -> int:
        """The inner store's conflicts so far (0 for a store that does not count them)."""
        return getattr(self.inner, "conflicts", 0)

    def close(self) -> None:
        """Drain the queue, stop the writer and close the inner store.

        Waits while the writer makes progress, but at most ``max_wait`` seconds for each
        next batch: a store that stalls or goes down raises StoreUnavailableError here
        instead of holding the engine's shutdown for the client's timeouts. The writer then
        finishes or fails the rest and closes the inner store on its own (a durable store's
        holds expire with its lease, and the janitor reclaims them).
        """
        if self._closed:
            return
        self._closed = True
        if self._reads is not None:
            self._reads.close()
        try:  # each first wait is short while the writer has not moved since a wait ran out
            self._queue.put(_STOP, timeout=self._stall.close_wait(self.max_wait))
            stop = 1
            stalled = not wait_while_progressing(self._thread,
                                                 lambda: self._queue.unfinished_tasks,
                                                 self.max_wait,
                                                 self._stall.close_wait(self.max_wait))
        except queue.Full:  # the writer took nothing for max_wait; it stops once it
            stop, stalled = 0, True  # finds the queue empty
        if stalled:
            self._abandoned = True
            # Its stop, when queued, is the last unfinished task (0 once it was taken).
            pending = max(self._queue.unfinished_tasks - stop, 0)
            message = (f"namespace {self.namespace!r}: the writer made no progress for "
                       f"{self.max_wait:g} s while closing (store down or stalled?): "
                       + (f"{pending} batch(es) not written yet" if pending else
                          "its holds not dropped yet")
                       + "; it goes on alone, and a durable store's holds expire with its "
                       "lease")
            if self.on_unavailable == "raise":
                raise StoreUnavailableError(message)
            log.warning("%s", message)  # "incomplete": the engine goes on, and so does close
            return
        self._raise_error()
        if self._close_error is not None:
            raise self._close_error

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_IDLE_POLL)
                except queue.Empty:
                    if self._closed:
                        return  # close() could not queue its stop: nothing more comes
                    continue
                self._taken += 1  # only this thread writes it
                try:
                    if item is _STOP:
                        return
                    if self._error is None and self.on_unavailable == "raise":
                        if put_until_written(self.inner, item, lambda: self._abandoned,
                                             self._retrying, self._refusals):
                            self._refusal.ended()
                    elif self._error is None:
                        if self._unapplied:
                            item, self._unapplied = _with_pins(item, self._unapplied), {}
                        self.inner.put(*item)
                except self._refusals as exc:
                    if self.on_unavailable == "incomplete":
                        # Its blocks and manifests are lost (those requests read back
                        # incomplete); its pins go with the next batch, or the store would
                        # keep holds the engine has let go, and lack ones it counts.
                        self.dropped_batches += 1
                        self._unapplied = _net_pins(item[1], item[2])
                    else:
                        self._error = exc
                except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the caller
                    self._error = exc
                finally:
                    self._queue.task_done()
        finally:
            # Here, not in close(): close() may have given up on a stalled store.
            try:
                self.inner.close()
            except BaseException as exc:  # noqa: BLE001 - re-raised by close()
                self._close_error = exc

    def _retrying(self, exc: StoreError) -> None:
        self._refusal.began(f"{type(exc).__name__}: {exc}")
        log.warning("namespace %r: the store refused a batch; the writer writes it again "
                    "until the store takes it: %s", self.namespace, self._refusal.why)

    def _check(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.namespace!r} is closed")
        self._raise_error()
        self._refusal.check(self.namespace, self.max_wait)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise WriterError(
                f"background writer for namespace {self.namespace!r} failed: {self._error}"
            ) from self._error

    def __repr__(self) -> str:
        return f"BackgroundBlockStore({self.inner!r})"
