"""ProcessWriter: a durable store's writes applied by a helper process, off the engine's GIL."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from r3cache.errors import StoreClosedError, StoreUnavailableError, WriterError
from r3cache.layout import RoutingLayout
from r3cache.manifest import Manifest
from r3cache.metrics import WAIT_BUCKETS, Timings
from r3cache.store.base import StoreStats
from r3cache.store.writers.arena import BlockArena
from r3cache.store.writers.bounded import (
    REFUSALS,
    BoundedCalls,
    Refusal,
    Stall,
    put_until_written,
)
from r3cache.store.writers.ring import DEFAULT_RING_BYTES, BlockRing

log = logging.getLogger("r3cache.store")
_POLL = 0.5  # seconds between the helper's checks that the engine process still lives
_NICE = 10  # the helper's niceness above the engine's
_CHECK_EVERY = 0.05  # seconds between put()'s looks at the helper's replies and liveness
_LINGER = 0.001  # seconds the helper waits for more puts to write in the same round
_AWAKE = 0.1  # seconds after its last message the helper looks on a timer, not blocked
_GATHER_KEYS = 4096  # ... but no more pins than this in one round
_FEEDER_EXIT = 1.0  # seconds close() waits for the feeder thread, its socket shut down


def _open(url: str, layout: RoutingLayout, namespace: str, options: dict, patience: float):
    """Open the store, retrying for up to ``patience`` seconds while Redis is unreachable.

    The helper starts while the engine already runs: a primary may die, and its replica
    take over, while this process is still connecting. Any other failure is final.
    """
    from r3cache.store.redis.connect import open_redis_store

    deadline = time.monotonic() + patience
    delay = 0.05
    while True:
        try:
            return open_redis_store(url, layout=layout, namespace=namespace, **options)
        except StoreUnavailableError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 1.0)


def _framed(payload: bytes) -> bytes:
    """``payload`` framed as ``multiprocessing.connection`` frames a message (the helper
    reads it with ``Connection.recv``): its length as 4 bytes, big-endian, or -1 and then
    8 bytes for 2 GiB and more."""
    n = len(payload)
    return (struct.pack("!i", n) if n < 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + payload


def _pickled(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _serve(connection: Connection) -> None:
    """The helper process: open the store, apply puts in order, answer flushes."""
    (_, url, fingerprint, namespace, options, parent, ring_fd, capacity, arena_fd,
     arena_capacity, patience) = connection.recv()
    # Below the engine's priority: when both want a core, inference goes first and
    # writes wait (the bounded queue says when they waited too long).
    os.nice(_NICE)
    layout = RoutingLayout.from_fingerprint(fingerprint)
    ring = BlockRing(layout, capacity, ring_fd)
    arena = None if arena_fd is None else BlockArena(layout, arena_capacity, arena_fd)
    try:
        store = _open(url, layout, namespace, options, patience)
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
        connection.send(("error", type(exc).__name__, str(exc)))
        return
    connection.send(("ready", store.owner))
    failed = False
    variants_sent = 0
    counts_sent = store.write_counts()
    carried = None  # a message read while gathering puts, handled next
    last = time.monotonic()  # when the last message came
    while True:
        try:
            if carried is None and not connection.poll(0):
                # While messages keep coming, look again after a linger asleep on a
                # timer: a send to a process blocked on the socket wakes it, which cost
                # the engine's thread ~25 µs a put on two cores, while a send to one
                # asleep on a timer wakes nobody. Idle, block on the socket.
                if time.monotonic() - last < _AWAKE:
                    time.sleep(_LINGER)
                    continue
                if not connection.poll(_POLL):
                    if os.getppid() != parent:
                        return  # the engine died: as after a crash, the lease expires
                    continue    # and the janitor reclaims the holds
            message, carried = carried or connection.recv(), None
            last = time.monotonic()
            if message[0] == "put":
                message, carried = _gather(connection, message, ring, arena)
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind == "put":
            _, objects, retain, release, manifests, upto, sequence, shared = message
            if not failed:
                try:
                    if put_until_written(store, (objects, retain, release, manifests),
                                         lambda: _engine_gone(connection, parent),
                                         lambda exc: _tell(connection, (
                                             "refused", f"{type(exc).__name__}: {exc}"))):
                        connection.send(("taken",))  # what it refused, Redis took at last
                except REFUSALS:
                    return  # the engine hung up or died: its holds expire with the lease
                except Exception as exc:  # noqa: BLE001 - sticky, reported once
                    failed = True
                    connection.send(("error", type(exc).__name__, str(exc)))
            variants = store.variant_log
            if len(variants) > variants_sent:
                # Before "freed" and any "flushed": a read after a flush reads this
                # writer's own rows where another's sit under the key (the last variant
                # of a key wins).
                connection.send(("variants", dict(variants[variants_sent:])))
                variants_sent = len(variants)
            # Changed counts go before "flushed" too: stats() after a flush is exact.
            counts = store.write_counts()
            changed = None if counts == counts_sent else counts
            counts_sent = counts
            # put encoded the rows (views of the ring and the arena) and kept no view:
            # the slots are the engine's again, also when the write failed. One answer
            # per put: the engine pays a read and an unpickling for each.
            if upto is not None or sequence is not None:
                if upto is not None:
                    ring.acknowledge(upto)
                if sequence is not None:
                    arena.acknowledge(sequence, shared)
                connection.send(("freed", upto, changed))
            elif changed is not None:
                connection.send(("counts", changed))
        elif kind == "flush":
            connection.send(("flushed", message[1]))
        elif kind == "close":
            store.close()
            with contextlib.suppress(OSError):  # the engine gave up waiting and hung up
                connection.send(("closed",))
            return


def _engine_gone(connection: Connection, parent: int) -> bool:
    """Whether the engine died, or hung up on this helper (a close that gave up waiting
    shuts the socket down): nobody waits for this helper's writes any more. Messages
    still unread do not hide a hang-up."""
    if os.getppid() != parent:
        return True
    poller = select.poll()
    poller.register(connection.fileno(), select.POLLRDHUP)
    return bool(poller.poll(0))


def _tell(connection: Connection, message: tuple) -> None:
    with contextlib.suppress(OSError):  # the engine hung up: _engine_gone tells next
        connection.send(message)


def _gather(connection: Connection, first: tuple, ring: BlockRing,
            arena: BlockArena | None) -> tuple[tuple, tuple | None]:
    """One put made of ``first``, the puts that follow it within ``_LINGER`` seconds and
    those waiting then, for at most another ``_LINGER``.

    Waiting a moment lets the engine finish its step before this process and Redis take
    the CPU, and makes larger rounds. Merging keeps every effect: blocks are immutable
    (first writer wins), each put's pins cross zero in order, so a key retained and
    released across them ends with the same hold, and manifests still follow all blocks.
    Returns the merged put (with the ring slot below which it read everything and the
    last put of arena slots, each None if none, and how many arena blocks it names) and
    the first non-put message read, if any.
    """
    objects: dict = {}
    retain: list = []
    release: list = []
    manifests: list = []
    upto = sequence = None
    in_arena = 0
    message: tuple | None = first
    deadline = time.monotonic() + _LINGER
    while message is not None and message[0] == "put" and len(retain) < _GATHER_KEYS:
        (_, keys, start, shared, slots, put_sequence, more_retain, more_release,
         more_manifests) = message
        if keys:
            for key, rows in zip(keys, ring.view(start, len(keys))):
                objects.setdefault(key, rows)
            upto = start + len(keys)
        if shared:
            for key, slot in zip(shared, slots):
                objects.setdefault(key, arena.slots[slot])
            sequence = put_sequence
            in_arena += len(slots)
        retain += more_retain
        release += more_release
        manifests += more_manifests
        now = time.monotonic()
        if now < deadline + _LINGER and connection.poll(0):
            # There already: this round's, but at most one linger more however fast
            # puts come (the round is written only once gathered).
            message = connection.recv()
        elif now < deadline:
            time.sleep(deadline - now)  # on a timer, for the reason _serve gives
            message = connection.recv() if connection.poll(0) else None
        else:
            message = None
    return ("put", objects, retain, release, manifests, upto, sequence, in_arena), message


class ProcessWriter:
    """Own a helper process that writes to a Redis store, and a read handle in this process.

    ``put`` copies the blocks into a shared-memory ring and sends their keys and slots, the
    pins and the manifests to the helper process (``python -m
    r3cache.store.writers.helper``): itself while the socket takes them without waiting,
    otherwise through a bounded queue and a feeder thread, which pickles them. With
    ``arena_bytes``, it also owns a BlockArena for the tier in front of it: blocks the tier
    stored there go by their slot, without a copy. The helper reads the rows in place,
    encodes, writes and keeps the holds as its own owner (its lease dies with it). If the
    queue or the ring stays full for ``max_wait`` seconds (Redis down or stalled), ``put``
    raises StoreUnavailableError instead of stalling the engine. A put Redis refuses
    (unavailable, or full: ``REFUSALS``) the helper writes again until Redis takes it (or
    the engine hangs up); any other failure in the helper is sticky: every later call raises
    WriterError.
    """

    def __init__(self, url: str, layout: RoutingLayout, namespace: str, options: dict,
                 *, max_pending: int = 512, max_wait: float = 10.0,
                 ring_bytes: int = DEFAULT_RING_BYTES, arena_bytes: int = 0) -> None:
        from r3cache.store.redis.connect import open_redis_store

        self.layout = layout
        self.namespace = namespace
        self.max_wait = max_wait
        self._ring = BlockRing.sized(layout, ring_bytes)
        self.arena = BlockArena.sized(layout, arena_bytes) if arena_bytes else None
        ours, theirs = socket.socketpair()
        shared = [self._ring.fd] + ([self.arena.fd] if self.arena else [])
        self._process = subprocess.Popen(
            [sys.executable, "-m", "r3cache.store.writers.helper", str(theirs.fileno())],
            pass_fds=[theirs.fileno(), *shared])
        theirs.close()
        self._connection = Connection(ours.detach())
        # The same socket, for puts sent without waiting (_hand_over).
        self._sender = socket.socket(fileno=os.dup(self._connection.fileno()))
        self._connection.send(("open", url, layout.fingerprint, namespace, options,
                               os.getpid(), self._ring.fd, self._ring.capacity,
                               self.arena and self.arena.fd,
                               self.arena and self.arena.capacity, max_wait))
        self._outbox: queue.Queue = queue.Queue(maxsize=max_pending)
        self.waits = Timings(WAIT_BUCKETS)  # puts that found the ring or the queue full
        # The helper's own write counts (blocks written, duplicates, conflicts, ...), as
        # of its last report: the read handle here writes nothing.
        self._write_counts: dict[str, int] = {}
        self._error: str | None = None
        self._refusal = Refusal()  # of the put the helper repeats, as it reported
        self._closed = False
        self._flushes = 0
        self._next_check = 0.0
        self._replies = self._fed = 0  # the helper's answers and the feeder's sends
        self._queued = 0  # messages handed to the feeder (it has sent them all at _fed)
        self._stall = Stall(lambda: (self._replies, self._fed))
        reply = self._reply(timeout=60.0 + max_wait)
        if reply[0] != "ready":
            self._process.wait(10)
            self._sender.close()
            self._connection.close()
            self._ring.close()
            if self.arena:
                self.arena.close()
            raise WriterError(f"the writer process could not open {namespace!r}: "
                              f"{reply[1]}: {reply[2]}")
        self._feeder = threading.Thread(target=self._feed, daemon=True,
                                        name=f"r3cache-feeder-{namespace}")
        self._feeder.start()
        read_options = {k: v for k, v in options.items()
                        if k not in ("owner", "lease", "janitor")}
        self.reader = open_redis_store(url, layout=layout, namespace=namespace, lease=False,
                                       janitor=False, owner=reply[1], **read_options)
        self.hash_algo = self.reader.hash_algo
        self.owner = reply[1]
        self._reads = BoundedCalls(f"r3cache-read-{namespace}")
        if self.arena:
            self.arena.await_acked = self._await_acked

    def _feed(self) -> None:
        """Send queued messages to the helper, in order: framed bytes as they are (the rest
        of a put sent in part), puts queued behind others pickled here."""
        while True:
            message = self._outbox.get()
            try:
                if message.__class__ is bytes:
                    self._sender.sendall(message)  # framed by _hand_over
                elif message[0] == "put":
                    self._sender.sendall(_framed(_pickled(message)))
                else:
                    self._connection.send(message)
            except OSError:
                return  # the helper is gone; _check reports it
            except Exception as exc:  # noqa: BLE001 - a put that cannot be pickled
                self._failed(type(exc).__name__, str(exc))
                return
            self._fed += 1  # only this thread writes it
            if message[0] == "close":
                return

    def put(
        self,
        objects: Mapping[str, np.ndarray],
        retain_keys: Collection[str] = (),
        release_keys: Sequence[str] = (),
        manifests: Sequence[Manifest] = (),
        in_arena: tuple[list[str], list[int]] = ([], []),
    ) -> None:
        """``in_arena``: the keys of the blocks of ``objects`` that the tier stored in this
        writer's arena, and their slots; those go without a copy, the rest through the
        ring."""
        self._check()
        if not (objects or retain_keys or release_keys or manifests):
            return
        deadline = self._deadline()
        if not in_arena[0]:
            keys, rows = list(objects), list(objects.values())
        elif len(in_arena[0]) == len(objects):  # a step's blocks are all new to the tier
            keys, rows = [], []
        else:
            shared = set(in_arena[0])
            keys = [k for k in objects if k not in shared]
            rows = list(map(objects.__getitem__, keys))
        # A put larger than the ring goes as several; arena slots, pins and manifests
        # ride on the last, so they still follow every block they name.
        step = self._ring.capacity
        *earlier, last = range(0, len(keys), step) or [0]
        for at in earlier:
            self._send_blocks(keys[at : at + step], rows[at : at + step], ([], []), [], [],
                              [], deadline)
        # Copies of the caller's collections: what the helper gets is this put's own,
        # whether pickled before put returns or later by the feeder (_send_blocks).
        self._send_blocks(keys[last:], rows[last:], in_arena, list(retain_keys),
                          list(release_keys), list(manifests), deadline)

    def _send_blocks(self, keys: list[str], rows: list[np.ndarray],
                     in_arena: tuple[list[str], list[int]], retain: Collection[str],
                     release: Sequence[str], manifests: Sequence[Manifest],
                     deadline: float) -> None:
        start, began = None, None  # began: when this put first had to wait
        # Numbered only once sent: a put that fails here leaves its number to the next.
        sequence = self.arena.latest + 1 if in_arena[0] else None
        try:
            if keys:
                start = self._ring.place(len(keys))
                while start is None:  # the helper still reads the slots we need
                    began = began or time.monotonic()
                    self._await_reply(deadline)
                    start = self._ring.place(len(keys))
                # Every argument was checked by its only callers: the tier (check_put,
                # then its local put) and the publisher (its rows, manifests of its own
                # making).
                self._ring.write(start, rows)
            queued = self._queued != self._fed
            if queued:
                # Behind the puts the feeder has yet to send: it pickles this one too, off
                # the engine's step (on two cores, while the engine's numpy copies leave
                # the GIL). Nothing it pickles may change until then: the arena's lists
                # and the manifests go as copies (inline rows may be views of a buffer the
                # caller reuses).
                in_arena = ([*in_arena[0]], [*in_arena[1]])
                manifests = [m.own_copy() for m in manifests]
            message = ("put", keys, start, *in_arena, sequence, retain, release, manifests)
            item = message if queued else self._hand_over(_framed(_pickled(message)))
            if item is not None:
                try:
                    self._enqueue(item, block=False)
                except queue.Full:  # the feeder is behind: wait for it until the deadline
                    began = began or time.monotonic()
                    self._enqueue_by(item, deadline)
            if sequence is not None:  # sent (or queued): the tier waits before reusing
                self.arena.sent(in_arena[1], sequence)
        finally:
            if began is not None:
                self.waits.observe(time.monotonic() - began)

    def _hand_over(self, frame: bytes) -> bytes | None:
        """Send a framed put straight to the helper when the feeder has sent everything
        queued before it, as much as the socket takes without waiting; returns what is
        left for the feeder (None: nothing). No thread is woken for a put the socket takes
        whole: on two cores waking the feeder cost the engine's thread ~25 µs a put, and
        the feeder then took the GIL from it to send."""
        if self._queued != self._fed:
            return frame  # after the queued messages, in order
        try:
            sent = self._sender.send(frame, socket.MSG_DONTWAIT)
        except OSError:  # full (BlockingIOError), or the helper is gone: _check tells
            return frame
        # A part sent: the rest goes next, whole, through the feeder (the queue is empty).
        return frame[sent:] if sent < len(frame) else None

    def _enqueue(self, message, block: bool = True, timeout: float | None = None) -> None:
        self._outbox.put(message, block, timeout)
        self._queued += 1

    def _enqueue_by(self, message, deadline: float) -> None:
        """Queue ``message`` for the feeder once it has room, by ``deadline``. A feeder
        that stopped (the helper died under its send) never makes room: its helper's exit
        is told at once, not after the whole wait."""
        while True:
            try:
                return self._enqueue(message, timeout=min(max(deadline - time.monotonic(), 0),
                                                          _CHECK_EVERY))
            except queue.Full:
                if self._error:
                    raise WriterError(self._error) from None
                if not self._feeder.is_alive() or self._process.poll() is not None:
                    raise self._exited() from None
                if time.monotonic() >= deadline:
                    self._unavailable()

    def _await_acked(self, sequence: int) -> None:
        """Return once the helper has encoded every put up to ``sequence``: the arena's
        slots those sent may be written again. Waits as long as a put may, and counts as
        a put's wait for the writer."""
        self._check()
        began = time.monotonic()
        deadline = self._deadline()
        try:
            while self.arena.acked < sequence:
                self._await_reply(deadline)
        finally:
            self.waits.observe(time.monotonic() - began)

    def _await_reply(self, deadline: float) -> None:
        # An answer already there counts even past the deadline: a helper that moved again
        # since a put gave up shows it here.
        if not self._connection.poll(max(deadline - time.monotonic(), 0)):
            self._unavailable()
        self._reply(timeout=0)
        if self._error:
            raise WriterError(self._error)

    def _deadline(self) -> float:
        """A put's deadline: now plus ``max_wait``, or plus ``Stall.PUT_GRACE`` while the
        helper has not moved since a wait ran out (one stall costs the engine one wait)."""
        return time.monotonic() + self._stall.put_wait(self.max_wait)

    def _unavailable(self) -> None:
        self._stall.gave_up()
        raise self._refusal.error(self.namespace, self.max_wait)

    def flush(self, deadline: float | None = None) -> None:
        """Return once the helper applied every earlier put (or raise its error), waiting
        at most ``max_wait`` seconds or until ``deadline`` (then StoreUnavailableError)."""
        self._check()
        if deadline is None:
            deadline = time.monotonic() + self.max_wait
        self._flushes += 1
        self._enqueue_by(("flush", self._flushes), deadline)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._connection.poll(left):
                raise StoreUnavailableError(
                    f"namespace {self.namespace!r}: earlier writes still pending after "
                    f"{self.max_wait:g} s (Redis down or stalled?)")
            reply = self._reply(timeout=0)
            if reply[0] == "flushed" and reply[1] == self._flushes:
                break
        self._check()

    def read_into(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> None:
        """Blocks into ``targets``, all within ``max_wait`` seconds, flush included."""
        deadline = time.monotonic() + self.max_wait
        self.flush(deadline)
        self._reads.run(deadline, f"namespace {self.namespace!r}: reading blocks",
                        self.reader.read_into, keys, targets)

    def get_concatenated(self, keys: Sequence[str]) -> np.ndarray:
        deadline = time.monotonic() + self.max_wait
        self.flush(deadline)
        return self._reads.run(deadline, f"namespace {self.namespace!r}: reading blocks",
                               self.reader.get_concatenated, keys)

    def get_manifests(self, request_ids: Sequence[str]) -> list[Manifest | None]:
        self.flush()
        return self.reader.get_manifests(request_ids)

    def release_manifests(self, request_ids: Sequence[str]) -> int:
        self.flush()
        return self.reader.release_manifests(request_ids)

    def stats(self) -> StoreStats:
        self.flush()
        return dataclasses.replace(self.reader.stats(), **self._write_counts)

    @property
    def pending(self) -> int:
        """Batches queued for the helper process and not yet sent to it."""
        return self._outbox.qsize()

    @property
    def refused_seconds(self) -> float:
        """How long the store has refused the batch the writer repeats (0.0: none)."""
        return self._refusal.seconds()

    @property
    def conflicts(self) -> int:
        """The helper's conflicts, as of its last report."""
        return self._write_counts.get("conflicts", 0)

    @property
    def ring_slots(self) -> tuple[int, int]:
        """(slots in use, capacity) of the shared ring: blocks the helper has not
        encoded yet, and how many the ring holds."""
        return self._ring.in_use, self._ring.capacity

    @property
    def arena_unencoded(self) -> int:
        """Blocks of the tier's arena sent to the helper that it has not encoded yet."""
        return self.arena.unencoded if self.arena else 0

    def close(self) -> None:
        """Drain the queue, let the helper drop its holds and lease, and stop it.

        Waits while the helper answers, but at most ``max_wait`` seconds for each next
        answer: on a store that stalls or goes down this raises StoreUnavailableError
        instead of holding the engine's shutdown. The helper then applies what it was sent
        and exits without closing the store; its lease expires and the janitor reclaims
        its holds, as after a crash.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._process.poll() is None:
                # Each wait is max_wait, or short while the helper has not moved since
                # a wait on it ran out; every answer is progress.
                self._enqueue(("close",), timeout=self._stall.close_wait(self.max_wait))
                while self._reply(self._stall.close_wait(self.max_wait))[0] not in (
                        "closed", "error"):
                    pass
                self._process.wait(self.max_wait)
        except (queue.Full, StoreUnavailableError, subprocess.TimeoutExpired):
            raise StoreUnavailableError(
                f"namespace {self.namespace!r}: the writer process did not answer for "
                f"{self.max_wait:g} s while closing (Redis down or stalled?); what it had not "
                "written yet may be lost, and its holds expire with its lease") from None
        finally:
            self._hang_up()
            self._ring.close()
            if self.arena:
                self.arena.close()
            self._reads.close()
            self.reader.close()
        if self._error:
            raise WriterError(self._error)

    def _hang_up(self) -> None:
        """End the connection to the helper: shut down first, so a feeder blocked on a
        stalled helper fails at once and exits, and a helper still writing reads what was
        sent, then finds the end and exits; then close it, the feeder gone."""
        with contextlib.suppress(OSError):
            self._sender.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(queue.Full):
            self._enqueue(("close",), block=False)  # a feeder waiting for work stops as well
        self._feeder.join(_FEEDER_EXIT)
        self._sender.close()
        self._connection.close()

    def _reply(self, timeout: float | None) -> tuple:
        try:
            if not self._connection.poll(timeout):
                raise StoreUnavailableError(
                    f"the writer process for {self.namespace!r} did not answer")
            reply = self._connection.recv()
            self._replies += 1
        except (EOFError, OSError):
            raise self._exited() from None
        if reply[0] == "freed":  # the arena's acknowledgement is in its mapping already
            if reply[1] is not None:
                self._ring.freed(reply[1])
            if reply[2] is not None:
                self._write_counts = reply[2]
        elif reply[0] == "variants":
            self.reader.add_variants(reply[1])
        elif reply[0] == "counts":
            self._write_counts = reply[1]
        elif reply[0] == "taken":
            self._refusal.ended()
        elif reply[0] == "refused":
            self._refusal.began(reply[1])
            log.warning("namespace %r: Redis refused a batch; the writer process writes it "
                        "again until Redis takes it: %s", self.namespace, reply[1])
        elif reply[0] == "error":
            self._failed(reply[1], reply[2])
        return reply

    def _failed(self, kind: str, message: str) -> None:
        """The writer failed for good: every later call raises WriterError."""
        self._error = (f"background writer for namespace {self.namespace!r} failed: "
                       f"{kind}: {message}")

    def _check(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.namespace!r} is closed")
        if self._error:
            raise WriterError(self._error)
        now = time.monotonic()
        # The helper's replies and liveness cost two syscalls: not every put.
        if now >= self._next_check:
            self._next_check = now + _CHECK_EVERY
            while self._connection.poll(0):
                self._reply(timeout=0)
            if self._error:
                raise WriterError(self._error)
            if self._process.poll() is not None:
                raise self._exited()
        self._refusal.check(self.namespace, self.max_wait)

    def _exited(self) -> WriterError:
        """The error for a helper that is gone: its exit status, which follows the end of
        its connection by a moment (a signal, the OOM killer's included, by name)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(0.5)
        code = self._process.returncode
        if code is None:
            how = "closed its connection"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:  # a signal this Python has no name for
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return WriterError(f"the writer process for {self.namespace!r} {how}")

    def __repr__(self) -> str:
        return f"ProcessWriter({self.reader!r})"


def spawn_writer(store: Any, **kwargs: Any) -> ProcessWriter:
    """A ProcessWriter for the namespace of an open RedisBlockStore, which it closes first
    (the helper registers as the same owner when the caller fixed one)."""
    url, options = store.reopen_args
    # Where Redis cannot be told now (a failover under way), the store's entry and holds
    # (none, for a store opened for the engine) go with its lease; the helper then waits
    # for Redis to answer, up to max_wait.
    with contextlib.suppress(StoreUnavailableError):
        store.close()
    # The store ran the janitor as it opened, a moment ago: the helper's open need not.
    return ProcessWriter(url, store.layout, store.namespace, {**options, "janitor": False},
                         **kwargs)

