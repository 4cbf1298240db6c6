import numpy as np
import pytest

from r3cache import RoutingLayout, open_store
from r3cache.errors import BlockNotFoundError, ContractError, LayoutMismatchError, StoreFullError
from r3cache.store.memory import MemoryBlockStore
from r3cache.store.writers.arena import BlockArena

LAYOUT = RoutingLayout(num_layers=2, topk=2, num_experts=8, block_size=4)


def blk(value: int) -> np.ndarray:
    return np.full(LAYOUT.block_shape, value, LAYOUT.dtype)


def store(blocks: int = 4, arena: bool = False) -> MemoryBlockStore:
    return MemoryBlockStore(LAYOUT, "t", max_bytes=blocks * LAYOUT.block_nbytes,
                            arena=BlockArena(LAYOUT, blocks) if arena else None)


def test_open_store_memory_url_with_query_options():
    s = open_store("memory://?max_bytes=4096", layout=LAYOUT, namespace="m@v1")
    assert isinstance(s, MemoryBlockStore) and s.max_bytes == 4096 and s.namespace == "m@v1"
    with pytest.raises(ContractError, match="unsupported store URL scheme"):
        open_store("ftp://x", layout=LAYOUT, namespace="m")
    with pytest.raises(ContractError, match="namespace"):
        open_store("memory://", layout=LAYOUT, namespace="")
    # A Redis option on the embedded store is named, not a TypeError from its constructor.
    for options in ({"idle_ttl": 60}, {"codec": "raw"}):
        with pytest.raises(ContractError, match=f"unknown memory store option.*{[*options][0]}"):
            open_store("memory://", layout=LAYOUT, namespace="m", **options)
    with pytest.raises(ContractError, match="unknown memory store option"):
        open_store("memory://?lease_ttl=3", layout=LAYOUT, namespace="m")
    # An option without a value, or given twice, is refused: not a store of the default
    # size, or of the size written last.
    for query, problem in (("max_bytes=", "has no value"), ("max_bytes", "has no value"),
                           ("max_bytes=4096&max_bytes=8192", "is given twice")):
        with pytest.raises(ContractError, match=f"option 'max_bytes' {problem}"):
            open_store(f"memory://?{query}", layout=LAYOUT, namespace="m")
    assert open_store("memory://?&max_bytes=4096&", layout=LAYOUT,
                      namespace="m").max_bytes == 4096
    with pytest.raises(ContractError, match="names no host or path"):
        open_store("memory://4096", layout=LAYOUT, namespace="m")
    assert open_store("memory:///", layout=LAYOUT, namespace="m").max_bytes == 1 << 30


def test_get_concatenated_returns_rows_in_key_order():
    s = store()
    s.put({"a": blk(1), "b": blk(2)})
    rows = s.get_concatenated(["b", "a", "b"])
    assert rows.shape == (12, 2, 2)
    assert rows[:4].max() == 2 and rows[4:8].max() == 1 and rows[8:].min() == 2
    assert s.get_concatenated([]).shape == (0, 2, 2)


def test_missing_key_raises_block_not_found_naming_it():
    s = store()
    s.put({"a": blk(1)})
    with pytest.raises(BlockNotFoundError) as info:
        s.get_concatenated(["a", "nope"])
    assert info.value.keys == ("nope",) and "nope" in str(info.value)
    assert "namespace 't'" in str(info.value)


def test_first_writer_wins_and_conflicts_are_counted():
    s = store()
    s.put({"a": blk(1)})
    s.put({"a": blk(1)})
    s.put({"a": blk(3)})
    assert s.get_concatenated(["a"]).max() == 1
    stats = s.stats()
    assert (stats.blocks_written, stats.duplicate_puts, stats.conflicts) == (1, 1, 1)


def test_only_unreferenced_blocks_are_evicted_oldest_release_first():
    s = store(blocks=3)
    s.put({"p": blk(1), "x": blk(2), "y": blk(3)}, retain_keys=["p"])
    s.put({"z": blk(4)})  # evicts x: the oldest unpinned block
    assert s.stats().evictions == 1
    with pytest.raises(BlockNotFoundError):
        s.get_concatenated(["x"])
    s.get_concatenated(["p", "y", "z"])


def test_keys_released_together_are_evicted_in_release_order():
    s = store(blocks=3)
    head, mid, tail = "h", "m", "t"
    s.put({head: blk(1), mid: blk(2), tail: blk(3)}, retain_keys=[head, mid, tail])
    s.put({}, release_keys=[tail, mid, head])  # a finished request: tail first
    s.put({"n1": blk(4)})
    assert s.get_concatenated([head, mid]).shape[0] == 8
    with pytest.raises(BlockNotFoundError):
        s.get_concatenated([tail])
    s.put({"n2": blk(5)})
    with pytest.raises(BlockNotFoundError):
        s.get_concatenated([mid])
    s.get_concatenated([head])


def test_reference_counts_are_per_hold_and_never_negative():
    s = store()
    s.put({"a": blk(1)}, retain_keys=["a", "a"])
    s.put({}, release_keys=["a"])
    assert s.refcount("a") == 1 and s.stats().pinned_blocks == 1
    s.put({}, release_keys=["a", "a", "a"])
    assert s.refcount("a") == 0 and s.stats().pinned_blocks == 0
    s.put({}, retain_keys=["a"])
    assert s.refcount("a") == 1


def test_a_key_can_be_pinned_before_it_is_written():
    s = store(blocks=1)
    s.put({}, retain_keys=["later"])
    s.put({"later": blk(1)})
    with pytest.raises(StoreFullError):
        s.put({"other": blk(2)})  # the only slot is pinned
    s.put({}, release_keys=["later"])
    assert s.stats().referenced_keys == 0


def test_a_batch_that_cannot_fit_raises_without_a_partial_write():
    s = store(blocks=2)
    s.put({"a": blk(1)}, retain_keys=["a"])
    s.put({"b": blk(2)})
    before = s.stats()
    with pytest.raises(StoreFullError, match="nothing was written"):
        s.put({"c": blk(3), "d": blk(4)}, retain_keys=["b", "c"], release_keys=["a"])
    assert s.stats() == before
    assert s.refcount("a") == 1 and s.refcount("b") == 0 and s.refcount("c") == 0
    s.get_concatenated(["a", "b"])


def test_rows_read_or_put_are_never_the_memory_a_later_eviction_reuses():
    s = store(blocks=2)
    mine = blk(1)
    s.put({"a": mine, "b": blk(2)})
    mine[...] = 7  # the caller's array is its own again once put returns
    rows = s.get_concatenated(["a"])
    targets = [np.zeros(LAYOUT.block_shape, LAYOUT.dtype)]
    s.read_into(["b"], targets)
    # A full store copies new blocks into the arrays of the blocks it evicts.
    s.put({"c": blk(3), "d": blk(4)})
    assert s.stats().evictions == 2
    assert rows.max() == rows.min() == 1 and targets[0].max() == targets[0].min() == 2
    assert s.get_concatenated(["c", "d"]).tolist() == np.stack([blk(3), blk(4)]).reshape(
        -1, *LAYOUT.row_shape).tolist()
    assert mine.min() == 7


def test_a_put_that_evicts_keeps_the_stored_blocks_it_names_again():
    s = store(blocks=2)
    s.put({"a": blk(1)})
    s.put({"b": blk(2)})
    # "a" is the oldest idle block, and this put needs room: "b" goes instead.
    s.put({"a": blk(1), "c": blk(3)})
    assert sorted(s._blocks) == ["a", "c"]
    stats = s.stats()
    assert (stats.duplicate_puts, stats.evictions, stats.blocks_written) == (1, 1, 3)


def test_blocks_of_the_wrong_shape_or_dtype_are_rejected():
    s = store()
    with pytest.raises(LayoutMismatchError):
        s.put({"a": np.zeros((3, 2, 2), LAYOUT.dtype)})
    with pytest.raises(LayoutMismatchError):
        s.put({"a": np.zeros(LAYOUT.block_shape, np.int32)})
    assert s.stats().blocks == 0


def test_stored_blocks_do_not_alias_the_callers_array():
    s = store()
    batch = np.stack([blk(1), blk(2)])
    s.put({"a": batch[0], "b": batch[1]})
    batch[:] = 7
    assert s.get_concatenated(["a", "b"]).max() == 2


def test_a_finishing_request_hands_its_pins_to_its_manifest():
    from r3cache.manifest import BlockRef, Completion, Manifest

    s = store(blocks=8)
    keys = ["a", "b", "c"]
    s.put({k: blk(i) for i, k in enumerate(keys)}, retain_keys=keys)

    def manifest(request_id: str, held: list[str]) -> Manifest:
        return Manifest(request_id, LAYOUT.fingerprint, Completion(0, 4 * len(held) + 1),
                        [BlockRef(k, 0, 4) for k in held])

    # Exactly the keys it releases: the pins pass over, no key is ever unpinned.
    first, last, *_ = s.put({}, (), keys[::-1], [manifest("r1", keys)])
    assert (first, last) == ([], []) and [s._refs[k] for k in keys] == [1, 1, 1]
    assert s.stats().pinned_blocks == 3 and not s._idle
    # A request that releases more than its manifest holds: applied key by key.
    s.put({"d": blk(5)}, retain_keys=["a", "d"])
    first, last, *_ = s.put({}, (), ["d", "a"], [manifest("r2", ["a"])])
    assert last == ["d"] and s._refs["a"] == 2 and list(s._idle) == ["d"]
    # A manifest replacing one under the same id: applied key by key too.
    s.put({}, ["b"])
    first, last, *_ = s.put({}, (), ["b"], [manifest("r1", ["b"])])
    assert s._refs == {"a": 1, "b": 1}
    assert s.release_manifests(["r1", "r2"]) == 2
    assert s.stats().pinned_blocks == 0 and list(s._idle) == ["d", "c", "b", "a"]


@pytest.mark.parametrize("arena", [False, True], ids=["heap", "arena"])
@pytest.mark.parametrize("seed", range(40))
def test_random_puts_under_memory_pressure_keep_every_invariant(seed, arena):
    """Random puts, manifest releases and reads on a store of one to five blocks: no put
    leaves part of itself behind, bytes and the idle list match the blocks held, what a
    manifest names stays pinned, reads return the rows first stored under each key, and
    no two blocks share a slot (on the heap as in a writer's arena)."""
    from collections import Counter

    from r3cache.errors import R3Error
    from r3cache.manifest import BlockRef, Completion, Manifest

    rng = np.random.default_rng(seed)
    s = store(blocks=int(rng.integers(1, 6)), arena=arena)
    keys = [f"k{i}" for i in range(8)]
    stored: dict[str, np.ndarray] = {}  # the rows the store took for each key
    held: Counter[str] = Counter()  # the worker's own pins: it releases only those

    def pick(n):
        return [keys[i] for i in rng.integers(0, len(keys), n)]

    for _ in range(40):
        op = rng.random()
        if op < 0.7:
            # One block in ten is a conflicting rewrite: other rows under a stored key.
            objects = {k: blk(int(k[1:]) + (rng.random() < 0.1))
                       for k in pick(int(rng.integers(0, 4)))}
            manifests = [Manifest(f"r{int(rng.integers(0, 5))}", LAYOUT.fingerprint,
                                  Completion(0, 9), [BlockRef(k, 0, 4) for k in pick(2)])
                         for _ in range(int(rng.integers(0, 2)))]
            retain = pick(int(rng.integers(0, 4)))
            pool = list(held.elements())
            release = [pool[i] for i in rng.permutation(len(pool))[: int(rng.integers(0, 4))]]
            before = (dict(s._refs), list(s._idle), set(s._blocks), set(s._manifests), s._used)
            try:
                s.put(objects, retain, release, manifests)
            except R3Error:
                assert (dict(s._refs), list(s._idle), set(s._blocks), set(s._manifests),
                        s._used) == before
            else:
                held.update(retain)
                held.subtract(release)
                stored.update((k, v) for k, v in objects.items() if k not in before[2])
        elif op < 0.85:
            s.release_manifests([f"r{i}" for i in rng.integers(0, 5, 2)])
        else:
            wanted = [k for k in pick(3) if k in s._blocks]
            rows = s.get_concatenated(wanted)
            for n, k in enumerate(wanted):
                np.testing.assert_array_equal(rows[4 * n : 4 * n + 4], stored[k])
        assert s._used == len(s._blocks) * LAYOUT.block_nbytes <= s.max_bytes
        assert len(set(s._blocks.values())) == len(s._blocks)
        assert set(s._idle) == {k for k in s._blocks if k not in s._refs}
        assert s._idle_bytes == len(s._idle) * LAYOUT.block_nbytes
        assert min(s._refs.values(), default=1) > 0
        assert all(k in s._refs for m in s._manifests.values() for k in m.block_keys)


def test_a_put_that_fits_once_its_own_releases_apply_is_stored():
    """A full store of pinned blocks takes a new block in the put that releases one of
    them for good; one it still pins, or whose release another pin outlives, stays."""
    s = store(blocks=2)
    s.put({"a": blk(1), "b": blk(2)}, retain_keys=["a", "b", "b"])
    with pytest.raises(StoreFullError):
        s.put({"c": blk(3)}, release_keys=["b"])  # b keeps a pin: nothing fits
    with pytest.raises(StoreFullError):
        s.put({"c": blk(3)}, retain_keys=["a"], release_keys=["a"])
    assert s._refs == {"a": 1, "b": 2}
    s.put({"c": blk(3)}, release_keys=["b", "a", "b"])
    assert set(s._blocks) == {"b", "c"} and list(s._idle) == ["c", "b"]  # a went first
    assert s._used == 2 * LAYOUT.block_nbytes and s._idle_bytes == s._used
    np.testing.assert_array_equal(s.get_concatenated(["c"]), blk(3))


@pytest.mark.parametrize("seed", range(20))
def test_undoing_a_puts_pins_restores_every_count(seed):
    """What a tier does when its durable store refuses a put: the pins and releases it
    applied, duplicates and releases of unheld keys included, are taken back exactly."""
    rng = np.random.default_rng(seed)
    s = store(blocks=8)
    keys = [f"k{i}" for i in range(6)]
    s.put({k: blk(i) for i, k in enumerate(keys[:4])},
          retain_keys=[keys[i] for i in rng.integers(0, 6, 6)])
    for _ in range(10):
        retain = [keys[i] for i in rng.integers(0, 6, int(rng.integers(0, 5)))]
        release = [keys[i] for i in rng.integers(0, 6, int(rng.integers(0, 5)))]
        before = dict(s._refs)
        changes = s.put({}, retain, release)
        s.undo_pins(retain, release, changes)
        assert s._refs == before
        assert set(s._idle) == {k for k in s._blocks if k not in s._refs}
        assert s._idle_bytes == len(s._idle) * LAYOUT.block_nbytes
        s.put({}, retain, release)  # applied for good, the next round starts from there
