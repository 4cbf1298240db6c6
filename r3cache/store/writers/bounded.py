"""Bounded waits on writers: store calls made on a helper thread (BoundedCalls), so the engine
waits at most a deadline, and waits on a draining writer that give up once it stalls."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

from r3cache.errors import StoreUnavailableError


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
                           patience: float, poll: float = 0.01) -> bool:
    """Wait for ``thread`` to end; False once ``progress()`` has not changed for
    ``patience`` seconds. A writer draining a long backlog into a healthy store is waited
    for; one stuck on a stalled store is given up on after one ``store_wait``."""
    seen, since = progress(), time.monotonic()
    while thread.is_alive():
        current = progress()
        if current != seen:
            seen, since = current, time.monotonic()
        elif time.monotonic() - since >= patience:
            return False
        thread.join(poll)  # returns as soon as the thread ends
    return True
