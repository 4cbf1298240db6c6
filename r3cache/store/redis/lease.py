"""Lease: one owner name held by one live store at a time, kept alive by heartbeats.

Holds are counted per owner name and every write sets the count the owner keeps, so two
live stores under one name would overwrite each other's counts: blocks one of them uses
would lose their holds and could be evicted. A name is therefore taken only from an
incarnation that is gone: a process of this host that no longer runs, or an entry whose
lease ran out without a heartbeat.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import weakref

import redis

from r3cache.errors import ContractError, StoreAccessError, StoreError
from r3cache.store.redis.scripts import JANITOR_FOUND, REGISTER_SCRIPT

log = logging.getLogger("r3cache.store")
_POLL = 0.1  # seconds between looks at a name another incarnation holds
# The leases this process holds: an entry of this process is an earlier incarnation's
# only if none of them wrote it.
_LIVE: weakref.WeakSet[Lease] = weakref.WeakSet()


class Lease:
    """Own this store's entry in the owners registry, refreshed by a daemon thread.

    The entry holds an expiry on the server's clock in a hash without a TTL, so
    neither eviction nor a full Redis can make a live owner look dead. A heartbeat
    that finds its entry gone (reclaimed after a stall, or Redis restarted without
    persistence) registers again, re-creates the namespace metadata if it is gone,
    and applies every hold the owner has again. One that finds the name registered by
    another incarnation (this one stalled past its lease, and a new one took the name)
    stops: the name's holds are the new incarnation's, and ``taken`` is set.
    """

    def __init__(self, store) -> None:
        self._store = store
        self._ttl_ms = int(store.options.lease_ttl * 1000)
        self._key = store.keys.owners
        self._stop = threading.Event()
        self.renewals = 0  # times the entry was found gone, and the holds applied again
        # Set once a heartbeat registered again, until the holds are back: that beat's
        # entry is there for every later one, which would not find it gone again.
        self._holds_lost = False
        self.taken = False  # another incarnation registered this owner name
        self._info = (f"host={socket.gethostname()} pid={os.getpid()} "
                      f"started={int(time.time())}")
        if self._take_name() == 2:
            from r3cache.store.redis.janitor import drop_owner_everywhere

            # The name was registered by an earlier incarnation (a crash, then a restart
            # with the same owner=): what it held is not this one's.
            log.warning("namespace %r: owner %r was registered before; dropping the holds "
                        "of its earlier incarnation", store.namespace, store.owner)
            drop_owner_everywhere(store, store.owner)
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"r3cache-lease-{store.owner}")
        self._thread.start()

    def _take_name(self) -> int:
        """Register the owner name, waiting while an incarnation that may be alive holds
        it; returns 2 where an earlier incarnation's holds must be dropped, else 1.

        A live holder beats within a third of its lease, which changes its entry; a dead
        one's entry runs out (or, being reclaimed, goes once the janitor is done), and the
        name is taken then. A janitor that never finishes is waited for one lease.
        """
        store = self._store
        earlier = ""  # an entry found to be an earlier incarnation's: replaced
        seen = None  # the entry of a holder being watched
        reclaimed_until = None
        while True:
            reply = self._register("open", earlier)
            if not isinstance(reply, list):
                return int(reply)
            entry, left = reply[0].decode(), int(reply[1])
            if (seen is not None and entry != seen and left >= 0) or self._mine(entry):
                raise ContractError(
                    f"owner {store.owner!r} of namespace {store.namespace!r} is in use by a "
                    f"live store ({_info(entry)}): holds are counted per owner, and two "
                    "stores under one name would overwrite each other's; give every "
                    "engine an owner of its own (or leave owner unset)")
            # Not while a janitor reclaims it: its drops could take this one's new holds.
            if left >= 0 and self._gone(entry):
                earlier = entry
                continue
            if seen is None:
                log.warning("namespace %r: owner %r is registered by %s (%s); waiting up to "
                            "its lease for a heartbeat before taking the name",
                            store.namespace, store.owner, _info(entry),
                            "being reclaimed" if left < 0 else f"{left} ms of lease left")
            seen = entry
            if left < 0:  # a janitor is dropping its holds: the entry goes once it is done
                now = time.monotonic()
                reclaimed_until = reclaimed_until or now + self._ttl_ms / 1000
                if now > reclaimed_until:
                    earlier = entry
            time.sleep(_POLL if left < 0 else min(_POLL, left / 1000))

    def _mine(self, entry: str) -> bool:
        """Whether a live store of this process wrote ``entry``."""
        text, owner = _info(entry), self._store.owner
        return any(lease._info == text and lease._store.owner == owner
                   and lease._key == self._key for lease in list(_LIVE))

    def _gone(self, entry: str) -> bool:
        """Whether ``entry`` is an earlier incarnation's that is gone for sure: a process
        of this host that has exited, or this process (a restarted container keeps its
        host name, and may have the same pid) where none of its live stores wrote it."""
        found = re.fullmatch(r"host=(\S+) pid=(\d+) .*", _info(entry))
        if found is None or found[1] != socket.gethostname():
            return False
        pid = int(found[2])
        if pid == os.getpid():
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False  # it runs, as another user
        return False

    def _register(self, mode: str, *extra: str):
        store = self._store
        return store.call(self._key, *REGISTER_SCRIPT.command(
            self._key, store.owner, self._ttl_ms, self._info, mode, int(time.time() * 1000),
            *extra))

    def beat(self) -> None:
        store = self._store
        state = int(self._register("beat"))
        if state == -2:
            self.taken = True
            self._stop.set()
            log.error("namespace %r: owner %r was registered by another store after this "
                      "one's lease ran out (stalled?); this store holds nothing any more and "
                      "refuses writes", store.namespace, store.owner)
            return
        if state == -1:
            self._holds_lost = True
            log.warning("namespace %r: owner %r found its lease gone (reclaimed after a "
                        "stall, or Redis lost its data); registered again and re-applying "
                        "its holds", store.namespace, store.owner)
        if self._holds_lost:  # a re-application that failed is tried again at each beat
            store.restore(holds=True)
            self._holds_lost = False
            self.renewals += 1
        elif not store.call(store.keys.meta, "EXISTS", store.keys.meta):
            store.restore(holds=False)

    def check(self) -> None:
        """Raise StoreAccessError once another incarnation registered this owner name."""
        if self.taken:
            raise StoreAccessError(
                f"namespace {self._store.namespace!r}: owner {self._store.owner!r} was "
                "registered by another store after this one's lease ran out; its holds are "
                "that store's now, and this one writes nothing")

    def _run(self) -> None:
        while not self._stop.wait(self._ttl_ms / 3000):
            try:
                self.beat()
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException,
                    StoreError):
                continue  # retried at the next beat; the lease covers short outages

    def stop(self) -> None:
        """No more heartbeats."""
        self._stop.set()
        self._thread.join()
        _LIVE.discard(self)

    def ours(self) -> bool:
        """Whether the registry's entry for the owner name is this incarnation's (absent
        counts: a lease lost with Redis's data is still this store's); where it is not,
        ``taken`` is set, as a heartbeat would set it."""
        entry = self._store.call(self._key, "HGET", self._key, self._store.owner)
        if entry is not None and _info(entry.decode()) not in (self._info, JANITOR_FOUND):
            self.taken = True
        return not self.taken

    def unregister(self) -> None:
        """Drop the entry if it is still this incarnation's, or the janitor's for the
        holds this store has just dropped."""
        self._register("close")


def _info(entry: str) -> str:
    """An owners-registry entry without its expiry: who registered it."""
    return entry.split(" ", 1)[1] if " " in entry else ""
