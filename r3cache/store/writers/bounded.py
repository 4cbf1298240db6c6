"""Bounded waits on writers: store calls made on a helper thread (BoundedCalls), so the engine
waits at most a deadline; waits on a draining writer that give up once it stalls; the
memory of a stall (Stall), so one stalled writer costs the engine one wait, not one a call;
and a writer's puts repeated while the store refuses them (put_until_written)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

from r3cache.errors import StoreError, StoreFullError, StoreUnavailableError


class BoundedCalls:
    """Own one helper thread that runs blocking store calls for a caller who may give up.

    A client's own timeouts (socket timeouts, retries across a failover) can add up to far
    more than the engine's ``store_wait``; the caller waits here until its deadline and
    then raises StoreUnavailableError, while the call finishes or fails on its own. The
    call must write only into memory the caller will not read after giving up.
    """

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def run(self, deadline: float, what: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, or StoreUnavailableError once ``time.monotonic()`` passes
        ``deadline`` (a call still queued behind a stuck one never starts)."""
        future = self._pool.submit(call, *args)
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise StoreUnavailableError(f"{what}: no answer in time (Redis down or "
                                        "stalled?)") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def wait_while_progressing(thread: threading.Thread, progress: Callable[[], Any],
                           patience: float, first: float | None = None,
                           poll: float = 0.01) -> bool:
    """Wait for ``thread`` to end; False once ``progress()`` has not changed for
    ``patience`` seconds (``first`` for its first change). A writer draining a long
    backlog into a healthy store is waited for; one stuck on a stalled store is given up
    on after one ``store_wait``."""
    seen, since = progress(), time.monotonic()
    wait = patience if first is None else first
    while thread.is_alive():
        current = progress()
        if current != seen:
            seen, since, wait = current, time.monotonic(), patience
        elif time.monotonic() - since >= wait:
            return False
        thread.join(poll)  # returns as soon as the thread ends
    return True


# Seconds a writer waits before repeating a put the store refused: the first wait,
# doubled after each refusal up to the last.
RETRY_FIRST, RETRY_MAX = 0.05, 1.0
# What a store refuses for a while and then takes again: Redis down, restarting, failing
# over or resharding past the client's retries; Redis full of held blocks until trainers
# release manifests, or idle blocks expire.
REFUSALS = (StoreUnavailableError, StoreFullError)


def put_until_written(store: Any, put: tuple, gone: Callable[[], bool],
                      retrying: Callable[[StoreError], None],
                      refusals: tuple[type[StoreError], ...] = REFUSALS) -> bool:
    """``store.put(*put)``, repeated while the store refuses it (``refusals``) until it
    goes through; the last refusal is raised once ``gone()`` says nobody waits for the
    writes any more. ``retrying`` hears of the first refusal. Returns whether there was
    one.

    Repeating a refused put is exact: blocks are immutable (first writer wins), a Redis
    store sets each hold to the count its owner keeps (it does not add to it) and takes a
    refused put's pins back from that count, and a manifest recorded again replaces
    itself. Meanwhile the writer takes nothing new, so the engine's waits on it run out
    after ``store_wait`` and its refused calls carry their effects to the next ones. (A
    store filled by this engine's own pins stays full: their releases wait behind.)
    """
    delay = RETRY_FIRST
    while True:
        try:
            store.put(*put)
            return delay > RETRY_FIRST
        except refusals as exc:
            if gone():
                raise
            if delay == RETRY_FIRST:
                retrying(exc)
            time.sleep(delay)
            delay = min(2 * delay, RETRY_MAX)


class Refusal:
    """Own what a writer said of the batch it repeats: why the store refuses it, and
    since when (``time.monotonic()``; None while nothing is refused).

    An engine's call is refused once a refusal has lasted ``store_wait``, as when a wait on
    a writer that takes nothing runs out, however much room the writer's queue or ring
    has left: an outage longer than ``store_wait`` reaches the engine at its next call,
    typed, while the writer goes on repeating the batch and the engine's next calls carry
    what was refused. Set by the writer's thread (or from the helper's reports), read by
    the engine's.
    """

    def __init__(self) -> None:
        self.why: str | None = None
        self.since: float | None = None

    def began(self, why: str) -> None:
        self.why, self.since = why, time.monotonic()

    def ended(self) -> None:
        self.since = self.why = None

    def seconds(self) -> float:
        """How long the store has refused the batch (0.0: it refuses none)."""
        since = self.since
        return 0.0 if since is None else time.monotonic() - since

    def check(self, namespace: str, wait: float) -> None:
        """Raise StoreUnavailableError if the store has refused the writer for ``wait``."""
        since = self.since
        if since is not None and time.monotonic() - since >= wait:
            raise self.error(namespace, wait)

    def error(self, namespace: str, wait: float) -> StoreUnavailableError:
        """What an engine's call raises when the writer took nothing for ``wait`` seconds,
        naming the store's refusal if there is one."""
        why = self.why
        return StoreUnavailableError(
            f"namespace {namespace!r}: the writer has not taken a batch for {wait:g} s ("
            + (f"the store refuses: {why}" if why else "store down or stalled?")
            + "); this batch was not written")


class Stall:
    """Own the memory that a writer was given up on, and whether it has moved since.

    Once a wait on the writer ran out (it took nothing for ``store_wait``), later waits
    give it only a grace to move until ``progress()`` changes (as it does within
    milliseconds of Redis answering again): a step under ``on_unavailable="incomplete"``
    then drops its batch at once instead of the engine crawling at one step per
    ``store_wait`` while Redis is down, and a close after a refused put does not wait a
    second ``store_wait``. A put's grace is paid every step of an outage, a close's once.
    """

    PUT_GRACE = 0.01
    CLOSE_GRACE = 0.1

    def __init__(self, progress: Callable[[], Any]) -> None:
        self._progress = progress  # grows with every move: it never returns to a value
        self._since: Any = None  # progress() when the last wait ran out; None: none did

    def stalled(self) -> bool:
        """True while the writer has not moved since a wait on it ran out."""
        return self._since is not None and self._since == self._progress()

    def gave_up(self) -> None:
        """A wait on the writer ran out."""
        self._since = self._progress()

    def put_wait(self, wait: float) -> float:
        """How long a put waits for room: ``wait``, or ``PUT_GRACE`` while stalled."""
        return min(wait, self.PUT_GRACE) if self.stalled() else wait

    def close_wait(self, wait: float) -> float:
        """How long a close waits for the writer's next move: ``wait``, or ``CLOSE_GRACE``
        while stalled."""
        return min(wait, self.CLOSE_GRACE) if self.stalled() else wait
