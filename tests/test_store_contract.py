"""One contract every BlockStore backend meets, checked against raw access to its data."""

from __future__ import annotations

import numpy as np
import pytest

from r3cache import RoutingLayout, codec, open_store
from r3cache.errors import (
    BlockNotFoundError,
    ContractError,
    LayoutMismatchError,
    StoreClosedError,
)
from r3cache.manifest import BlockRef, Completion, Manifest
from r3cache.store.memory import MemoryBlockStore

LAYOUT = RoutingLayout(num_layers=3, topk=2, num_experts=16, block_size=4)
IDLE_TTL = 300.0


def blk(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16, LAYOUT.block_shape).astype(np.uint8)


class Raw:
    """Read a store's data without going through its API."""

    def __init__(self, store) -> None:
        self.store = store

    def rows(self, key: str) -> np.ndarray | None:
        if isinstance(self.store, MemoryBlockStore):
            slot = self.store._blocks.get(key)
            return None if slot is None else self.store._pool.arrays[slot]
        value = self._client(self.store.keys.block(key)).get(self.store.keys.block(key))
        return None if value is None else codec.decode_rows(value, LAYOUT, key)

    def holds(self, key: str) -> int:
        if isinstance(self.store, MemoryBlockStore):
            return self.store._refs.get(key, 0)
        refs = self.store.keys.refs(key)
        return int(self._client(refs).hget(refs, self.store.owner) or 0)

    def evictable(self, key: str) -> bool:
        """Unpinned: LRU-evictable in memory, carries the idle TTL in Redis."""
        if isinstance(self.store, MemoryBlockStore):
            return key in self.store._idle
        ttl = self._client(self.store.keys.block(key)).pttl(self.store.keys.block(key))
        return 0 < ttl <= IDLE_TTL * 1000 + 1000

    def ttl_ms(self, key: str) -> int:
        return self._client(self.store.keys.block(key)).pttl(self.store.keys.block(key))

    def _client(self, key: bytes):
        return self.store.client_for(key)


@pytest.fixture
def store(store_url, namespace):
    s = open_store(store_url, layout=LAYOUT, namespace=namespace, idle_ttl=IDLE_TTL) \
        if not store_url.startswith("memory") else open_store(store_url, layout=LAYOUT,
                                                              namespace=namespace)
    yield s
    s.close()


class TestStoreContract:
    def test_put_then_get_round_trips_and_matches_raw_data(self, store):
        store.put({"k1": blk(1), "k2": blk(2)})
        rows = store.get_concatenated(["k2", "k1", "k2"])
        np.testing.assert_array_equal(rows, np.concatenate([blk(2), blk(1), blk(2)]))
        np.testing.assert_array_equal(Raw(store).rows("k1"), blk(1))
        assert store.get_concatenated([]).shape == (0, 3, 2)

    def test_reads_refuse_targets_they_cannot_fill_exactly(self, store):
        """A store decodes a block's bytes into its target as they are: another dtype
        would hold other numbers, so every backend refuses what it cannot fill exactly."""
        store.put({"k1": blk(1)})
        block = np.zeros(LAYOUT.block_shape, LAYOUT.dtype)
        for keys, targets in ((["k1"], [block.astype(np.int64)]),
                              (["k1"], [np.zeros((8, 3, 2), np.uint8)[::2]]),
                              (["k1"], [block[:2]]), (["k1"], [block.tolist()]),
                              (["k1", "k1"], [block]), ("k1", [block])):
            with pytest.raises(ContractError):
                store.read_into(keys, targets)
        with pytest.raises(ContractError):
            store.get_concatenated("k1")  # one key, not a sequence of its characters
        assert not block.any()
        store.read_into(["k1"], [block])
        np.testing.assert_array_equal(block, blk(1))

    def test_a_missing_block_is_a_typed_error_naming_namespace_and_keys(self, store):
        store.put({"present": blk(1)})
        with pytest.raises(BlockNotFoundError) as info:
            store.get_concatenated(["present", "absent-1", "absent-2"])
        assert info.value.keys == ("absent-1", "absent-2")
        assert store.namespace in str(info.value) and "absent-1" in str(info.value)
        assert "likely cause" in str(info.value)

    def test_a_store_keeps_its_own_copy_and_hands_out_copies(self, store):
        block, inline = blk(1), blk(2)[:3]
        manifest = Manifest("req", LAYOUT.fingerprint, Completion(0, 8),
                            [BlockRef("k", 0, 4), inline])
        store.put({"k": block}, ["k"], manifests=[manifest])
        block[...] = 0  # the caller's arrays are its own again once put returns
        inline[...] = 0
        (got,) = store.get_manifests(["req"])
        np.testing.assert_array_equal(store.get_concatenated(["k"]), blk(1))
        np.testing.assert_array_equal(got.segments[1], blk(2)[:3])
        got.segments[1] = np.zeros_like(inline)  # the reader's record is its own
        store.get_concatenated(["k"])[...] = 0
        np.testing.assert_array_equal(store.get_manifests(["req"])[0].segments[1], blk(2)[:3])
        np.testing.assert_array_equal(store.get_concatenated(["k"]), blk(1))
        store.release_manifests(["req"])
        store.put({}, release_keys=["k"])

    def test_one_str_of_request_ids_is_refused_not_read_per_character(self, store):
        """release_manifests("12") would release requests 1 and 2 (vLLM's offline ids)."""
        manifests = [Manifest(r, LAYOUT.fingerprint, Completion(0, 5), [BlockRef("k", 0, 4)])
                     for r in ("1", "2")]
        store.put({"k": blk(1)}, manifests=manifests)
        for call in (store.release_manifests, store.get_manifests):
            with pytest.raises(ContractError):
                call("12")
        assert [m.request_id for m in store.get_manifests(["1", "2"])] == ["1", "2"]
        assert store.release_manifests(["1", "2"]) == 2

    def test_first_writer_wins_and_conflicts_are_counted(self, store):
        store.put({"k": blk(1)})
        store.put({"k": blk(1)})
        store.put({"k": blk(2)})
        np.testing.assert_array_equal(Raw(store).rows("k"), blk(1))
        stats = store.stats()
        assert (stats.blocks_written, stats.duplicate_puts, stats.conflicts) == (1, 1, 1)

    def test_retained_blocks_are_pinned_until_the_last_release(self, store):
        raw = Raw(store)
        store.put({}, retain_keys=["k", "k"])  # pinned before it is written
        store.put({"k": blk(3)})
        assert raw.holds("k") == 2 and not raw.evictable("k")
        store.put({}, release_keys=["k"])
        assert raw.holds("k") == 1 and not raw.evictable("k")
        store.put({}, release_keys=["k", "k"])  # one release too many: clamped at zero
        assert raw.holds("k") == 0 and raw.evictable("k")
        store.put({}, retain_keys=["k"])
        assert raw.holds("k") == 1 and not raw.evictable("k")
        assert store.stats().referenced_keys == 1

    def test_unheld_blocks_are_evictable_as_soon_as_they_are_written(self, store):
        store.put({"k": blk(4)})
        assert Raw(store).evictable("k") and Raw(store).holds("k") == 0

    def test_blocks_of_another_layout_are_rejected_and_nothing_is_written(self, store):
        with pytest.raises(LayoutMismatchError):
            store.put({"ok": blk(1), "bad": np.zeros((4, 3, 2), np.int32)})
        assert Raw(store).rows("ok") is None

    @pytest.mark.parametrize("bad", [
        Manifest("req", RoutingLayout(3, 2, 16, 8).fingerprint, Completion(0, 5),
                 [BlockRef("k", 0, 4)]),  # another layout
        Manifest("req", LAYOUT.fingerprint, Completion(0, 9), [BlockRef("k", 0, 4)]),
        Manifest("req", LAYOUT.fingerprint, Completion(0, 6), [BlockRef("k", 2, 6)]),
        Manifest("req", LAYOUT.fingerprint, Completion(0, 5), [BlockRef(7, 0, 4)]),
        Manifest("req", LAYOUT.fingerprint, Completion(0, 3), [np.zeros((2, 3, 2), np.int32)]),
        Manifest("req", LAYOUT.fingerprint, (0, "5"), [BlockRef("k", 0, 4)]),
        Manifest("", LAYOUT.fingerprint, Completion(0, 5), [BlockRef("k", 0, 4)]),
    ], ids=["layout", "extent", "slice", "key", "dtype", "completion", "id"])
    def test_a_manifest_no_reader_could_use_is_refused_and_nothing_changes(self, store, bad):

        raw = Raw(store)
        store.put({"held": blk(2)}, retain_keys=["held"])
        with pytest.raises(ContractError):
            store.put({"k": blk(1)}, ["k"], ["held"], [bad])
        assert raw.rows("k") is None and raw.holds("k") == 0 and raw.holds("held") == 1
        assert store.get_manifests(["req"]) == [None] and store.stats().manifests == 0

    def test_stats_count_blocks_pins_and_bytes(self, store):
        store.put({"a": blk(1), "b": blk(2)}, retain_keys=["a"])
        stats = store.stats()
        assert stats.blocks == 2 and stats.pinned_blocks == 1 and stats.referenced_keys == 1
        assert stats.raw_bytes_used == 2 * LAYOUT.block_nbytes and stats.bytes_used > 0

    def test_a_closed_store_refuses_calls(self, store):
        store.close()
        with pytest.raises(StoreClosedError):
            store.put({"k": blk(1)})
        with pytest.raises(StoreClosedError):
            store.get_concatenated(["k"])
