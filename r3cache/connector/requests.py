"""RequestTable: per-request worker state as columns indexed by slot, so a step is vectorised."""

from __future__ import annotations

import numpy as np

from r3cache.errors import InvalidBatchError, MetadataError
from r3cache.layout import RoutingLayout
from r3cache.manifest import Completion

NO_CURSOR = -1

# Slots made up front: an engine's max_num_seqs (vLLM's default 256, 1024 on some hosts)
# without growth mid-run, and no more, since each slot holds a tail block (6 KiB for
# L=48, K=8, uint8): a max_num_seqs of 10**9, as some set for "no limit", would allocate
# terabytes. Beyond it the table grows as requests arrive.
_PREALLOCATED_SLOTS = 1024


class RequestTable:
    """Own every live request's cursors, keys, tail block and unkeyed full blocks.

    A request occupies one slot from registration to teardown. Columns:

    - ``capture``: next position to capture (NO_CURSOR before the first capture);
    - ``scheduled``: end of the last scheduled range, which may run past
      ``capture`` when a speculative suffix was rejected;
    - ``emit``: first position whose rows the request is still owed;
    - ``emit_from``: its emit start when it registered;
    - ``owned_from``: first position this incarnation captured itself; rows
      before it (a prefix hit) only ever come from the store;
    - ``nkeys``: ``len(keys[slot])``, the full blocks whose hashes arrived.

    ``tail[slot]`` holds the rows of the block containing ``capture``; ``finishing`` the
    slots whose teardown was requested and waits for the in-flight steps that cover
    them (few, so a set: most steps check it is empty and nothing else), ``preempted``
    those among them that will resume (what they were given is kept). ``version``
    changes whenever a name is bound to or taken from a slot, so a batch's slots can be
    reused while it holds.
    """

    def __init__(self, layout: RoutingLayout, capacity: int) -> None:
        self.layout = layout
        self.slot_of: dict[str, int] = {}
        self.req_id: list[str | None] = []
        self.keys: list[list[str]] = []
        # Full blocks whose hash has not arrived: slot -> {block index: rows}.
        self.unkeyed: dict[int, dict[int, np.ndarray]] = {}
        # Finished requests whose teardown writes a manifest: slot -> its extent.
        self.completion: dict[int, Completion] = {}
        self.record_as: dict[int, str | None] = {}  # the id a manifest is recorded under
        self._free: list[int] = []
        self.finishing: set[int] = set()
        self.preempted: set[int] = set()
        self.version = 0
        self._last: list[tuple[list[str], int, np.ndarray]] = [([], -1, np.empty(0, np.int64))] * 2
        self.capture = np.empty(0, np.int64)
        self.scheduled = np.empty(0, np.int64)
        self.emit = np.empty(0, np.int64)
        self.emit_from = np.empty(0, np.int64)
        self.owned_from = np.empty(0, np.int64)
        self.nkeys = np.empty(0, np.int64)
        self.tail = np.empty((0, *layout.block_shape), layout.dtype)
        self._grow(max(1, min(capacity, _PREALLOCATED_SLOTS)))

    def __len__(self) -> int:
        return len(self.req_id) - len(self._free)

    def add(self, req_id: str, emit_start: int) -> int:
        if not self._free:
            self._grow(2 * len(self.req_id))
        slot = self._free.pop()
        self.version += 1
        self.slot_of[req_id] = slot
        self.req_id[slot] = req_id
        self.keys[slot] = []
        self.capture[slot] = NO_CURSOR
        self.scheduled[slot] = 0
        self.emit[slot] = emit_start
        self.emit_from[slot] = emit_start
        self.owned_from[slot] = 0
        self.nkeys[slot] = 0
        return slot

    def lookup(self, req_id: str) -> int:
        try:
            return self.slot_of[req_id]
        except KeyError:
            raise MetadataError(
                f"request {req_id!r} is not registered with the worker connector"
            ) from None

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """The slots of one batch's requests, read-only; a request may appear once."""
        return self._cached(0, req_ids, strict=True)

    def find(self, req_ids: list[str]) -> np.ndarray:
        """The slots of ``req_ids``, read-only, -1 for a request without one."""
        return self._cached(1, req_ids, strict=False)

    def _cached(self, which: int, req_ids: list[str], strict: bool) -> np.ndarray:
        # Consecutive steps name the same requests in the same order: the last answer is
        # reused while the ids and every slot's name are unchanged.
        ids, version, slots = self._last[which]
        if req_ids == ids and self.version == version:
            return slots
        slot_of = self.slot_of
        try:
            slots = np.fromiter((slot_of[r] if strict else slot_of.get(r, -1) for r in req_ids),
                                np.int64, len(req_ids))
        except KeyError as exc:
            raise MetadataError(
                f"request {exc.args[0]!r} is not registered with the worker connector"
            ) from None
        if strict and len(set(req_ids)) != len(req_ids):
            raise InvalidBatchError("a request appears twice in one batch")
        slots.flags.writeable = False  # shared by the steps that reuse it
        self._last[which] = (list(req_ids), self.version, slots)
        return slots

    def detach(self, slot: int) -> None:
        """Unname a slot whose request re-registers while its teardown is deferred."""
        name = self.req_id[slot]
        if name is not None and self.slot_of.get(name) == slot:
            del self.slot_of[name]
            self.version += 1

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            self.detach(slot)
            self.req_id[slot] = None
            self.keys[slot] = []
            self.unkeyed.pop(slot, None)
            self.completion.pop(slot, None)
            self.record_as.pop(slot, None)
            self.finishing.discard(slot)
            self.preempted.discard(slot)
            self._free.append(slot)

    def live_slots(self) -> list[int]:
        return [s for s, name in enumerate(self.req_id) if name is not None]

    def clear(self) -> None:
        self.free(self.live_slots())

    def _grow(self, capacity: int) -> None:
        old = len(self.req_id)
        extra = capacity - old
        self.req_id.extend([None] * extra)
        self.keys.extend([] for _ in range(extra))
        for name in ("capture", "scheduled", "emit", "emit_from", "owned_from", "nkeys"):
            column = getattr(self, name)
            setattr(self, name, np.concatenate((column, np.zeros(extra, column.dtype))))
        new_tails = np.zeros((extra, *self.layout.block_shape), self.layout.dtype)
        self.tail = np.concatenate((self.tail, new_tails))
        # Pop low slots first, so a small batch touches a compact part of the columns.
        self._free.extend(range(capacity - 1, old - 1, -1))
