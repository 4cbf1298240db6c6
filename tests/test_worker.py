"""Scenario tests for WorkerConnector: every assertion is on exact rows."""

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from r3cache import (
    R3Reader,
    RequestOutput,
    RoutingLayout,
    StepBatch,
    WorkerConnector,
    open_store,
)
from r3cache.connector import PackedHashes
from r3cache.connector.metadata import StepMetadata, block_key, block_keys, keys_by_request
from r3cache.errors import (
    BlockNotFoundError,
    ContractError,
    CursorError,
    GenerationError,
    InvalidBatchError,
    LayoutMismatchError,
    MetadataError,
    StoreClosedError,
    StoreFullError,
)
from r3cache.manifest import Completion
from r3cache.store.memory import MemoryBlockStore
from r3cache.store.writers.background import BackgroundBlockStore
from tests.conftest import Harness

TOKENS = list(range(100, 140))
OTHER = list(range(100, 108)) + list(range(500, 532))  # shares 2 blocks (8 tokens) with TOKENS


def assert_output(out: RequestOutput, h: Harness, req: str, start: int, stop: int) -> None:
    assert out.token_start == start
    np.testing.assert_array_equal(out.rows, h.rows(req, start, stop))


def test_prefill_then_decode_emits_exact_rows_and_publishes_blocks(harness):
    h = harness
    h.add("r", TOKENS)
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 1)})
    out = h.step([("r", 0, 6)], sampled=[1])
    assert_output(out["r"], h, "r", 0, 6)
    for pos in (6, 7):
        assert_output(h.step([("r", pos, 1)], sampled=[1])["r"], h, "r", pos, pos + 1)
    h.begin(block_hashes={"r": h.hashes("r", 1, 2)})
    np.testing.assert_array_equal(h.worker.store.get_concatenated(h.keys("r", 0, 2)),
                                  h.rows("r", 0, 8))
    assert h.refcount(h.keys("r")[0]) == 1


def test_prefix_hit_reads_the_producers_rows_published_earlier_in_the_same_batch(harness):
    h = harness
    h.add("p", TOKENS[:12])
    h.add("c", OTHER[:10])
    shared = h.hashes("p", 0, 2)
    assert shared == h.hashes("c", 0, 2)
    h.begin({"p": 0, "c": 0}, {"p": h.hashes("p"), "c": h.hashes("c")})
    assert h.store.stats().blocks == 0
    out = h.step([("p", 0, 12), ("c", 8, 2)], sampled=[1, 1])
    assert_output(out["p"], h, "p", 0, 12)
    assert_output(out["c"], h, "c", 0, 10)  # rows 0..7 come from the producer's blocks
    assert h.worker.stats.blocks_read == 2
    assert h.refcount(shared[0].hex()) == 2


def test_prefix_hits_on_runs_of_whole_blocks_get_exactly_their_rows(harness):
    """Hits read a producer's blocks of the same batch and, a step later, the store's: a
    hit on the start of a run, on part of one, hits whose blocks leave a run part way (two
    prompts sharing their first blocks, each a run of its own) and go on inside another."""
    h = harness
    bs = h.layout.block_size
    prompt = list(range(1000, 1000 + 10 * bs + 2))
    fork = prompt[: 4 * bs] + list(range(3000, 3000 + 6 * bs))  # shares 4 blocks
    h.add("p", prompt)
    h.add("q", fork)
    hits = {"whole": prompt[: 8 * bs] + [1, 2, 3], "part": prompt[: 3 * bs] + [4],
            "forked": fork[: 9 * bs] + [5]}
    for r, tokens in hits.items():
        h.add(r, tokens)
    assert h.keys("q", 0, 4) == h.keys("p", 0, 4) and h.keys("q", 4, 5) != h.keys("p", 4, 5)
    requests = ["p", "q", *hits]
    h.begin(dict.fromkeys(requests, 0), {r: h.hashes(r) for r in requests})
    out = h.step([("p", 0, len(prompt)), ("q", 0, len(fork)),
                  *((r, len(t) // bs * bs, len(t) % bs) for r, t in hits.items())],
                 sampled=[1] * 5)
    for r in requests:
        assert_output(out[r], h, r, 0, len(h.tokens[r]))
    # The same hits a step later, from the store: its read is one run in first-use order.
    later = {f"{r}-again": t for r, t in hits.items()}
    for r, tokens in later.items():
        h.add(r, tokens)
    h.begin(dict.fromkeys(later, 0), {r: h.hashes(r) for r in later}, finished=list(hits))
    out = h.step([(r, len(t) // bs * bs, len(t) % bs) for r, t in later.items()],
                 sampled=[1] * 3)
    for r, tokens in later.items():
        assert_output(out[r], h, r, 0, len(tokens))
    assert h.worker.stats.blocks_read == 2 * (8 + 3 + 9)


def test_prefix_hit_of_a_fully_cached_prompt_recomputes_only_the_last_token(harness):
    h = harness
    h.add("p", TOKENS[:9])
    h.add("c", TOKENS[:8] + [7])
    h.begin({"p": 0}, {"p": h.hashes("p")})
    h.step([("p", 0, 9)], sampled=[1])
    h.begin({"c": 0}, {"c": h.hashes("c", 0, 2)}, finished=["p"])
    # All 8 prompt tokens hit the cache; the scheduler recomputes position 7.
    out = h.step([("c", 7, 1)], sampled=[1])
    assert_output(out["c"], h, "c", 0, 8)
    # The recomputed block was the producer's: nothing of c's was published over it.
    assert h.store.stats().duplicate_puts == 0
    assert_output(h.step([("c", 8, 1)], sampled=[1])["c"], h, "c", 8, 9)


@pytest.mark.parametrize("hashes_known", [True, False])
def test_chunked_prefill_stopping_mid_block_emits_nothing_until_a_token_is_sampled(
    harness, hashes_known
):
    h = harness
    h.add("r", TOKENS[:11])
    h.begin({"r": 0}, {"r": h.hashes("r")} if hashes_known else None)
    assert h.step([("r", 0, 6)], sampled=[0]) == {}
    out = h.step([("r", 6, 4)], sampled=[0])
    assert out == {}
    out = h.step([("r", 10, 1)], sampled=[1])
    assert_output(out["r"], h, "r", 0, 11)  # from store, unkeyed blocks and the tail
    assert h.worker.stats.blocks_read == (2 if hashes_known else 0)


def test_speculative_rejections_are_discarded(harness):
    h = harness
    h.add("r", TOKENS)
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 2)})
    h.step([("r", 0, 8)], sampled=[1])
    rows = np.concatenate([h.rows("r", 8, 10), np.full((2, 3, 2), 15, np.uint8)])
    out = h.step([("r", 8, 4)], sampled=[2], rejected=[2], rows=rows)
    assert_output(out["r"], h, "r", 8, 10)
    out = h.step([("r", 10, 3)], sampled=[3])
    assert_output(out["r"], h, "r", 10, 13)
    h.begin(block_hashes={"r": h.hashes("r", 2, 3)})
    np.testing.assert_array_equal(h.worker.store.get_concatenated([h.keys("r")[2]]),
                                  h.rows("r", 8, 12))


def test_capture_reattaches_after_an_optimistic_suffix_is_rejected(async_harness):
    h = async_harness
    h.add("r", TOKENS)
    h.begin({"r": 0})
    h.step([("r", 0, 8)], sampled=[1])
    garbage = np.full((2, 3, 2), 15, np.uint8)
    first = h.prepare([("r", 8, 4)], rows=np.concatenate([h.rows("r", 8, 10), garbage]))
    first.enqueue_cpu_copy([2], [2])
    # Scheduled before the rejection was known: starts at 12, really ran from 10.
    second = h.prepare([("r", 12, 4, 10)])
    second.enqueue_cpu_copy([4], [0])
    assert_output(h.worker.process_output(first)["r"], h, "r", 8, 10)
    assert_output(h.worker.process_output(second)["r"], h, "r", 10, 14)


def test_finished_request_teardown_waits_for_in_flight_steps(async_harness):
    h = async_harness
    h.add("r", TOKENS[:12])
    keys = h.keys("r")
    h.begin({"r": 0}, {"r": h.hashes("r")})
    pending = h.prepare([("r", 0, 11)])
    pending.enqueue_cpu_copy([1], [0])
    h.begin(finished=["r"])
    assert h.worker.num_requests == 1 and h.refcount(keys[0]) == 1
    assert_output(h.worker.process_output(pending)["r"], h, "r", 0, 11)
    assert h.worker.num_requests == 0
    assert all(h.refcount(k) == 0 for k in keys)
    np.testing.assert_array_equal(h.store.get_concatenated(keys[:2]), h.rows("r", 0, 8))


def test_keys_a_request_received_are_pinned_before_any_later_put_evicts(layout):
    # The store holds three blocks: the two a consumer will hit, then an idle newer one.
    h = Harness(layout, max_concurrent_batches=2, max_bytes=3 * layout.block_nbytes)
    h.add("q", TOKENS[20:28])
    h.add("c", OTHER[:12])
    hits = h.keys("c", 0, 2)
    h.store.put({k: h.rows("c", 4 * i, 4 * i + 4) for i, k in enumerate(hits)})
    h.store.put({"newer": h.rows("q", 4, 8)})
    h.begin({"q": 0}, {"q": h.hashes("q", 0, 1)})
    first = h.prepare([("q", 0, 4)])  # completes q's first block
    first.enqueue_cpu_copy([1], [0])
    # The next step registers the consumer before the first one is processed: its put
    # must evict the newer idle block, not the oldest ones the consumer now holds.
    h.begin({"c": 0}, {"c": h.hashes("c", 0, 3)})
    h.worker.process_output(first)
    assert [h.refcount(k) for k in hits] == [1, 1]
    assert h.store.stats().evictions == 1
    h.begin(finished=["q"])  # its block goes idle: room for the consumer's own
    assert_output(h.step([("c", 8, 4)], sampled=[1])["c"], h, "c", 0, 12)
    h.worker.close()


def test_a_full_block_waits_for_its_hash_in_a_hash_only_update(harness):
    h = harness
    h.add("r", TOKENS)
    h.begin({"r": 0})
    h.step([("r", 0, 6)], sampled=[1])
    h.step([("r", 6, 3)], sampled=[3])  # positions 6..8: blocks 0 and 1 complete
    assert h.store.stats().blocks == 0
    h.begin(block_hashes={"r": h.hashes("r", 0, 2)})
    h.worker.store.flush()
    np.testing.assert_array_equal(h.store.get_concatenated(h.keys("r", 0, 2)), h.rows("r", 0, 8))
    h.begin(finished=["r"], block_hashes={"r": h.hashes("r", 2, 3)})  # never completed
    assert h.refcount(h.keys("r")[2]) == 0 and h.worker.num_requests == 0


def test_a_block_keyed_by_a_running_step_is_stored_by_its_put_and_read_by_its_hits(harness):
    """Drafts' blocks get their hash a step after they complete; the step that brings it
    stores the block with its own put, and a prefix hit in that step reads its rows."""
    h = harness
    h.add("r", TOKENS)
    h.add("c", TOKENS[:4] + [7, 8])
    h.begin({"r": 0})
    h.step([("r", 0, 6)], sampled=[1])  # block 0 complete, its hash not yet sent
    h.begin({"r": 6, "c": 0}, {"r": h.hashes("r", 0, 1), "c": h.hashes("c", 0, 1)})
    out = h.step([("r", 6, 1), ("c", 4, 2)], sampled=[1, 1])
    assert_output(out["r"], h, "r", 6, 7)
    assert_output(out["c"], h, "c", 0, 6)  # rows 0..3: r's block, keyed this step
    np.testing.assert_array_equal(h.store.get_concatenated(h.keys("r", 0, 1)), h.rows("r", 0, 4))
    assert h.refcount(h.keys("r")[0]) == 2


def test_a_refused_put_keeps_the_blocks_it_was_to_store(layout):
    """A store that refuses a put (full of pinned blocks) gets the same blocks again with
    the next call: a block keyed by a hash-only update is not lost with the error."""
    h = Harness(layout, max_bytes=2 * layout.block_nbytes)
    h.add("r", TOKENS)
    h.store.put({"a": h.rows("r", 20, 24), "b": h.rows("r", 24, 28)}, retain_keys=["a", "b"])
    h.begin({"r": 0})
    h.step([("r", 0, 6)], sampled=[1])
    with pytest.raises(StoreFullError):
        h.begin(block_hashes={"r": h.hashes("r", 0, 1)})
    h.store.put({}, release_keys=["a"])
    h.begin()  # a step that runs nothing stores what is owed at once
    np.testing.assert_array_equal(h.store.get_concatenated(h.keys("r", 0, 1)), h.rows("r", 0, 4))
    assert h.refcount(h.keys("r")[0]) == 1
    assert_output(h.step([("r", 6, 1)], sampled=[1])["r"], h, "r", 6, 7)
    h.worker.close()


def test_a_refused_step_loses_nothing_when_the_engine_goes_on(layout):
    """A step whose put the store refuses (full of another request's pinned blocks) raises
    and changes nothing. The engine goes on: the next call carries the refused blocks with
    a finishing request's releases, which make the room, and the next output holds the
    rows the refused step owed."""
    h = Harness(layout, max_bytes=2 * layout.block_nbytes)
    h.add("a", TOKENS)
    h.add("b", TOKENS[::-1])
    h.begin({"a": 0, "b": 0}, {"a": h.hashes("a", 0, 2)})
    h.step([("a", 0, 9), ("b", 0, 3)], sampled=[1, 1])  # a's two blocks fill the store
    h.begin({}, {"b": h.hashes("b", 0, 1)})
    with pytest.raises(StoreFullError):
        h.step([("b", 3, 3)], sampled=[1])  # completes b's first block
    assert [h.refcount(k) for k in h.keys("a", 0, 2) + h.keys("b", 0, 1)] == [1, 1, 1]
    h.begin(finished=["a"])
    assert_output(h.step([("b", 6, 1)], sampled=[1])["b"], h, "b", 3, 7)
    np.testing.assert_array_equal(h.store.get_concatenated(h.keys("b", 0, 1)),
                                  h.rows("b", 0, 4))
    assert [h.refcount(k) for k in h.keys("a", 0, 2) + h.keys("b", 0, 1)] == [0, 0, 1]
    h.worker.close()


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_completion_naming_rows_the_request_never_had_is_refused_before_any_change(
        layout, in_flight):
    """A completion that is not two counts, or that names rows the worker neither captured
    (nor will, in a step in flight) nor has a block hash for, is a MetadataError before
    anything changes; the engine's corrected finish then records the manifest."""
    h = Harness(layout, max_concurrent_batches=2)
    h.add("r", TOKENS)
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 2)})
    pending = h.prepare([("r", 0, 9)])
    pending.enqueue_cpu_copy([1], [0])
    if not in_flight:
        h.worker.process_output(pending)

    def finish(completion):
        h.worker.begin_step(StepMetadata(0, {}, {}, ("r",), completions={"r": completion}))

    for bad in (Completion(0, 11), Completion(-1, 5), ("x", 5), (0, 5, 1), (True, 5)):
        with pytest.raises(MetadataError, match="completion of request 'r'"):
            finish(bad)
        assert h.worker.num_requests == 1 and not h.worker._table.finishing
    finish((0, 10))  # a plain tuple: rows 0..8, all captured
    if in_flight:
        assert h.worker.num_requests == 1  # torn down once its step is processed
        h.worker.process_output(pending)
    (manifest,) = h.store.get_manifests(["r"])
    assert manifest.completion == Completion(0, 10) and h.worker.num_requests == 0
    assert [h.refcount(k) for k in h.keys("r", 0, 2)] == [1, 1]  # the manifest's holds
    h.worker.close()


def test_packed_hashes_key_blocks_as_the_hashes_one_by_one(harness):
    """vLLM ships a request's new hashes concatenated: the same keys, the same rows."""
    h = harness
    h.add("r", TOKENS)
    packed = PackedHashes(b"".join(h.hashes("r", 0, 2)), 32)
    with pytest.raises(InvalidBatchError, match="whole number"):
        h.begin({"r": 0}, {"r": PackedHashes(packed.data[:-1], 32)})
    assert h.worker.num_requests == 0  # refused before anything changed
    one = h.hashes("r", 0, 1)[0]
    for data in (one, bytearray(one), memoryview(one)):  # one hash: a decode step's case
        assert block_keys(PackedHashes(data, 32)) == [block_key(one)] == h.keys("r", 0, 1)
    for data in (packed.data, bytearray(packed.data), memoryview(packed.data)):
        assert block_keys(PackedHashes(data, 32)) == [*map(block_key, h.hashes("r", 0, 2))]
    assert block_keys(PackedHashes(b"", 32)) == []  # a step that completed no block
    h.begin({"r": 0}, {"r": packed})
    h.step([("r", 0, 9)], sampled=[1])
    h.worker.store.flush()
    assert h.refcount(h.keys("r")[0]) == h.refcount(h.keys("r")[1]) == 1
    np.testing.assert_array_equal(h.store.get_concatenated(h.keys("r", 0, 2)), h.rows("r", 0, 8))


def test_keys_of_a_later_generation_carry_its_number_and_must_still_fit_a_key(harness):
    one = bytes(range(32))
    assert keys_by_request({"r": [one]}) == {"r": [one.hex()]}
    assert keys_by_request({"r": PackedHashes(one * 2, 32), "s": [7]}, 3) == {
        "r": [one.hex() + ".g3"] * 2, "s": [format(7, "032x") + ".g3"]}
    h = harness
    h.add("r", TOKENS)
    # A str hash is a key as given: at 256 characters no generation suffix fits.
    with pytest.raises(InvalidBatchError, match="generation 1"):
        h.worker.begin_step(StepMetadata(1, {"r": 0}, {"r": ["x" * 256]}))
    assert h.worker.num_requests == 0  # refused before anything changed
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 1)}, generation=1)
    h.step([("r", 0, 8)], sampled=[1])
    assert h.refcount(h.keys("r")[0] + ".g1") == 1 and h.refcount(h.keys("r")[0]) == 0


def test_samples_of_one_prompt_bringing_the_same_packed_hashes_each_pin_every_block(harness):
    """GRPO's samples of one prompt are scheduled together with equal packed hashes (converted
    once): each pins every block, and a request with another prompt keeps its own keys."""
    h = harness
    for r in ("a", "b", "c"):
        h.add(r, TOKENS)
    h.add("other", TOKENS[::-1])
    data = b"".join(h.hashes("a", 0, 2))
    hashes = {"a": PackedHashes(data, 32), "b": PackedHashes(bytes(bytearray(data)), 32),
              "c": PackedHashes(bytearray(data), 32),
              "other": PackedHashes(b"".join(h.hashes("other", 0, 2)), 32)}
    h.begin(dict.fromkeys(hashes, 0), hashes)
    h.step([(r, 0, 9) for r in hashes], sampled=[1] * 4)
    h.worker.store.flush()
    assert [h.refcount(k) for k in h.keys("a", 0, 2)] == [3, 3]
    assert [h.refcount(k) for k in h.keys("other", 0, 2)] == [1, 1]
    np.testing.assert_array_equal(h.store.get_concatenated(h.keys("other", 0, 2)),
                                  h.rows("other", 0, 8))
    h.begin(finished=["a", "b"])
    assert [h.refcount(k) for k in h.keys("a", 0, 2)] == [1, 1]


def test_a_huge_max_num_seqs_allocates_as_requests_arrive(layout):
    """max_num_seqs bounds nothing the connector allocates up front: 10**9, as some engines
    are configured for "no limit", would otherwise take terabytes of tail blocks."""
    tracemalloc.start()
    try:
        worker = WorkerConnector(layout=layout, store=MemoryBlockStore(layout, "t", 1 << 20),
                                 max_num_seqs=10**9)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
    h = Harness(layout)
    h.worker.close()
    h.worker = worker
    h.add("r", TOKENS)
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 2)})
    assert_output(h.step([("r", 0, 10)], sampled=[1])["r"], h, "r", 0, 10)
    worker.close()


@pytest.mark.parametrize("record", [True, False])
def test_without_manifests_a_finished_request_holds_nothing(layout, record):
    """An engine's embedded store, which no trainer can read, records no manifests: each
    would hold its blocks until the store is full."""
    h = Harness(layout)
    h.worker = WorkerConnector(layout=layout, store=h.store, max_num_seqs=2,
                               record_manifests=record)
    h.add("r", TOKENS[:11])
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 2)})
    assert_output(h.step([("r", 0, 10)], sampled=[1])["r"], h, "r", 0, 10)
    h.worker.begin_step(StepMetadata(0, {}, {}, ("r",), {"r": Completion(0, 11)}))
    assert [h.refcount(k) for k in h.keys("r", 0, 2)] == ([1, 1] if record else [0, 0])
    assert h.store.stats().manifests == h.worker.stats.manifests == int(record)
    np.testing.assert_array_equal(h.store.get_concatenated(h.keys("r", 0, 2)), h.rows("r", 0, 8))


@pytest.mark.parametrize("deferred", [False, True])
def test_finished_requests_release_keys_tail_first(layout, deferred):
    h = Harness(layout, max_bytes=3 * layout.block_nbytes, max_concurrent_batches=2)
    h.add("r", TOKENS[:13])
    keys = h.keys("r")
    h.begin({"r": 0}, {"r": h.hashes("r")})
    pending = h.prepare([("r", 0, 12)])
    pending.enqueue_cpu_copy([1], [0])
    if deferred:
        h.begin(finished=["r"])
        h.worker.process_output(pending)
    else:
        h.worker.process_output(pending)
        h.begin(finished=["r"])
    h.worker.store.put({"new": np.zeros(layout.block_shape, layout.dtype)})
    with pytest.raises(BlockNotFoundError):
        h.worker.store.get_concatenated([keys[2]])  # the tail block went first
    np.testing.assert_array_equal(h.store.get_concatenated(keys[:2]), h.rows("r", 0, 8))
    h.worker.close()


def test_a_writer_whose_rows_differ_from_the_stored_block_still_gets_its_own_rows(harness):
    h = harness
    h.add("r", TOKENS[:11])
    key = h.keys("r")[1]
    # Another replica stored different rows under the same block hash.
    h.store.put({key: np.zeros(h.layout.block_shape, h.layout.dtype)})
    h.begin({"r": 0}, {"r": h.hashes("r")})
    assert h.step([("r", 0, 2)], sampled=[0]) == {}
    assert_output(h.step([("r", 2, 8)], sampled=[1])["r"], h, "r", 0, 10)
    h.worker.store.flush()
    assert h.store.stats().conflicts == 1


def test_a_generation_change_releases_everything_but_what_running_requests_were_given(
        harness):
    h = harness
    h.add("r", TOKENS)
    h.add("s", [t + 1 for t in TOKENS[:6]])
    h.begin({"r": 0, "s": 0}, {"r": h.hashes("r", 0, 2), "s": h.hashes("s", 0, 1)})
    h.step([("r", 0, 8), ("s", 0, 4)], sampled=[1, 0])  # s is given nothing yet
    h.begin(generation=1)
    assert h.worker.num_requests == 0
    # r resumes in the new generation: the rows it was given (0..8) stay pinned for its
    # manifest. s was given none: its block is released.
    assert [h.refcount(k) for k in h.keys("r", 0, 2)] == [1, 1]
    assert h.refcount(h.keys("s", 0, 1)[0]) == 0
    h.begin({"r": 9}, {"r": h.hashes("r", 0, 2)})  # a new generation starts afresh
    assert_output(h.step([("r", 0, 10)], sampled=[1])["r"], h, "r", 9, 10)
    h.begin(finished=["r"])
    assert all(h.refcount(k) == 0 for k in h.keys("r", 0, 2))


def test_a_preempted_request_recomputed_with_other_rows_records_the_rows_it_was_given(
        harness):
    h = harness
    h.add("r", TOKENS[:20])
    given = []
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 2)})
    given.append(h.step([("r", 0, 10)], sampled=[1])["r"].rows.copy())  # rows 0..9
    h.begin(finished=["r"], preempted=["r"])
    keys = h.keys("r", 0, 2)
    assert [h.refcount(k) for k in keys] == [1, 1]  # held for what r was given
    # Resumed: its recomputation (a non-batch-invariant kernel, say) yields other rows.
    other = ((h.rows("r", 0, 20) + 1) % h.layout.num_experts).astype(h.layout.dtype)
    h.begin({"r": 10}, {"r": h.hashes("r", 2, 4)})
    given.append(h.step([("r", 0, 16)], sampled=[1], rows=other[:16])["r"].rows.copy())
    h.begin(finished=["r"], completions={"r": Completion(0, 17)})
    with R3Reader(h.worker.store) as reader:
        np.testing.assert_array_equal(reader.get("r"), np.concatenate(given))
        np.testing.assert_array_equal(reader.get("r")[:10], h.rows("r", 0, 10))
        reader.release("r")
    assert all(h.refcount(k) == 0 for k in h.keys("r"))


def test_a_request_that_ends_while_preempted_is_recorded_from_what_it_was_given(harness):
    h = harness
    h.add("r", TOKENS[:20])
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 1)})
    h.step([("r", 0, 6)], sampled=[1])
    h.begin(finished=["r"], preempted=["r"])
    # It never runs again (aborted while it waited): the scheduler tells of its end.
    h.begin(finished=["r"], completions={"r": Completion(0, 7)})
    with R3Reader(h.worker.store) as reader:
        np.testing.assert_array_equal(reader.get("r"), h.rows("r", 0, 6))
        reader.release("r")
    assert h.refcount(h.keys("r", 0, 1)[0]) == 0
    with pytest.raises(MetadataError, match="not registered"):  # once only
        h.begin(finished=["r"])


@pytest.mark.parametrize("preempted,completions,match", [
    ("r", {}, "not a str"),
    (["s"], {}, "must be finished"),
    (["r"], {"r": Completion(0, 3)}, "cannot finish for good"),
])
def test_preempted_requests_are_finished_ones_that_did_not_end(harness, preempted,
                                                                completions, match):
    h = harness
    h.add("r", TOKENS)
    h.begin({"r": 0, "s": 0})
    h.step([("r", 0, 4)], sampled=[1])
    with pytest.raises(MetadataError, match=match):
        h.begin(finished=["r"], completions=completions, preempted=preempted)
    assert h.worker.num_requests == 2  # refused before anything changed


def test_generation_cannot_change_with_output_in_flight_or_move_back(async_harness):
    h = async_harness
    h.add("r", TOKENS)
    h.begin({"r": 0}, generation=2)
    pending = h.prepare([("r", 0, 4)])
    with pytest.raises(GenerationError, match="in flight"):
        h.begin(generation=3)
    pending.enqueue_cpu_copy([1], [0])
    h.worker.process_output(pending)
    with pytest.raises(GenerationError, match="backwards"):
        h.begin(generation=1)


def test_preemption_and_resume_continue_from_the_emit_start(harness):
    h = harness
    h.add("r", TOKENS)
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 2)})
    h.step([("r", 0, 8)], sampled=[1])
    h.step([("r", 8, 2)], sampled=[2])
    h.begin(finished=["r"])  # preempted: rows 0..9 were delivered
    # Resumed: blocks 0-1 still cached, positions 8..10 recomputed, rows owed from 10.
    h.begin({"r": 10}, {"r": h.hashes("r", 0, 2)})
    assert_output(h.step([("r", 8, 3)], sampled=[1])["r"], h, "r", 10, 11)
    h.begin(finished=["r"])
    h.begin({"r": 11}, {"r": h.hashes("r", 0, 2)})  # nothing cached this time
    assert_output(h.step([("r", 0, 12)], sampled=[1])["r"], h, "r", 11, 12)


def test_prompt_start_at_the_prompt_length_gives_an_empty_prompt_slice(harness):
    h = harness
    h.add("r", TOKENS)
    h.begin({"r": 6})
    out = h.step([("r", 0, 6)], sampled=[1])
    assert out["r"].token_start == 6 and out["r"].rows.shape == (0, 3, 2)
    assert_output(h.step([("r", 6, 1)], sampled=[1])["r"], h, "r", 6, 7)


def test_padding_rows_past_the_batch_are_ignored(harness):
    h = harness
    h.add("a", TOKENS)
    h.add("b", OTHER)
    h.begin({"a": 0, "b": 0}, {"a": h.hashes("a", 0, 1), "b": h.hashes("b", 0, 1)})
    out = h.step([("a", 0, 5), ("b", 0, 3)], sampled=[1, 0], padding=7)
    assert list(out) == ["a"]
    assert_output(out["a"], h, "a", 0, 5)


# -- contract violations raise typed errors ------------------------------------------


def test_run_and_finish_in_one_step_is_rejected(harness):
    with pytest.raises(MetadataError, match="run and finish"):
        harness.begin({"r": 0}, finished=["r"])


def test_capture_moving_backwards_or_leaving_an_unbacked_gap_is_rejected(harness):
    h = harness
    h.add("r", TOKENS)
    h.begin({"r": 0})
    h.step([("r", 0, 8)], sampled=[1])
    pending = h.prepare([("r", 4, 1)])
    pending.enqueue_cpu_copy([1], [0])
    with pytest.raises(CursorError, match="capture moved backwards"):
        h.worker.process_output(pending)
    pending = h.prepare([("r", 10, 1)])
    pending.enqueue_cpu_copy([1], [0])
    with pytest.raises(CursorError, match="unbacked gap"):
        h.worker.process_output(pending)


@pytest.mark.parametrize(
    ("req_ids", "starts", "qsl", "message"),
    [
        (["a", "b"], [0, 0], [0, 4, 4], "query_start_loc must increase"),
        (["a", "b"], [0, 0], [0, 4, 2], "rows must not overlap"),
        (["a", "a"], [0, 0], [0, 2, 4], "appears twice"),
        (["a"], [0], [0], "need 2 query_start_loc"),
        (["a"], [0], [0, 50], "routed_experts has 10 rows"),
    ],
)
def test_malformed_batches_are_rejected(harness, req_ids, starts, qsl, message):
    h = harness
    h.begin({"a": 0, "b": 0})
    with pytest.raises(InvalidBatchError, match=message):
        h.worker.prepare_output(StepBatch(req_ids, np.array(starts), np.array(qsl)),
                                routed_experts=np.zeros((10, 3, 2), np.uint8))
    assert h.worker.num_requests == 2


@pytest.mark.parametrize("rejected", [-1, 5])
def test_invalid_rejected_counts_are_rejected(harness, rejected):
    h = harness
    h.add("r", TOKENS)
    h.begin({"r": 0})
    pending = h.prepare([("r", 0, 4)])
    pending.enqueue_cpu_copy([1], [rejected])
    with pytest.raises(InvalidBatchError, match="rejected of 4"):
        h.worker.process_output(pending)


def test_layout_mismatches_are_rejected(layout):
    with pytest.raises(LayoutMismatchError):
        WorkerConnector(layout=layout, store=MemoryBlockStore(RoutingLayout(3, 2, 17, 4)))
    h = Harness(layout)
    h.begin({"r": 0})
    for rows in (np.zeros((4, 3, 2), np.int64), np.zeros((4, 2, 3), np.uint8)):
        with pytest.raises(LayoutMismatchError):
            h.worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 4])), rows)
    h.worker.close()


def test_the_embedded_store_is_written_in_place_unless_a_writer_thread_is_asked_for(layout):
    inplace = WorkerConnector(layout=layout, store=MemoryBlockStore(layout))
    assert type(inplace.store) is MemoryBlockStore
    threaded = WorkerConnector(layout=layout, store=MemoryBlockStore(layout), writer="thread")
    assert isinstance(threaded.store, BackgroundBlockStore)
    assert type(threaded.store.inner) is MemoryBlockStore
    with pytest.raises(ContractError, match="embedded store"):
        WorkerConnector(layout=layout, store=MemoryBlockStore(layout), writer="process")
    inplace.close()
    threaded.close()


def test_a_prefix_hit_on_a_missing_block_fails_closed_naming_request_and_key(harness):
    h = harness
    h.add("c", TOKENS)
    h.begin({"c": 0}, {"c": h.hashes("c", 0, 2)})
    pending = h.prepare([("c", 8, 2)])
    pending.enqueue_cpu_copy([1], [0])
    with pytest.raises(BlockNotFoundError) as info:
        h.worker.process_output(pending)
    assert info.value.request_ids == ("c",)
    assert set(info.value.keys) == set(h.keys("c", 0, 2))
    assert "'c'" in str(info.value) and "prefix-cache hit" in str(info.value)


def test_step_outputs_must_be_consumed_in_order_and_within_the_flight_limit(async_harness):
    h = async_harness
    h.add("a", TOKENS)
    h.add("b", OTHER)
    h.begin({"a": 0, "b": 0})
    first = h.prepare([("a", 0, 4)])
    second = h.prepare([("b", 0, 4)])
    with pytest.raises(InvalidBatchError, match="already in flight"):
        h.prepare([("a", 4, 1)])
    with pytest.raises(InvalidBatchError, match="enqueue_cpu_copy"):
        h.worker.process_output(first)
    second.enqueue_cpu_copy([1], [0])
    with pytest.raises(InvalidBatchError, match="in the order prepared"):
        h.worker.process_output(second)
    with pytest.raises(InvalidBatchError, match="2 entries for 1 requests"):
        first.enqueue_cpu_copy([1, 1], [0])


def test_unknown_requests_and_an_emit_start_ahead_of_the_worker_are_rejected(harness):
    h = harness
    h.add("r", TOKENS)
    with pytest.raises(MetadataError, match="'ghost' is not registered"):
        h.prepare([("ghost", 0, 1)], rows=np.zeros((1, 3, 2), np.uint8))
    with pytest.raises(MetadataError, match="'ghost' is not registered"):
        h.begin(block_hashes={"ghost": [b"x"]})
    h.begin({"r": 0})
    h.step([("r", 0, 6)], sampled=[1])
    with pytest.raises(CursorError, match="ahead"):
        h.begin({"r": 9})


def test_contract_checks_survive_python_dash_o(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(
        "from r3cache import RoutingLayout, StepMetadata, WorkerConnector\n"
        "from r3cache.store.memory import MemoryBlockStore\n"
        "from r3cache.errors import MetadataError\n"
        "layout = RoutingLayout(2, 1, 4, 4)\n"
        "w = WorkerConnector(layout=layout, store=MemoryBlockStore(layout))\n"
        "try:\n"
        "    w.begin_step(StepMetadata(0, {'r': 0}, {}, ('r',)))\n"
        "except MetadataError:\n"
        "    print('raised')\n"
    )
    result = subprocess.run([sys.executable, "-O", str(script)], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "raised"


def test_counts_are_read_when_the_step_is_processed_not_when_handed_over(harness):
    # vLLM hands enqueue_cpu_copy host arrays that its copy stream is still filling;
    # they hold the step's counts only once the copy event fired, before process_output.
    h = harness
    h.add("a", TOKENS)
    h.add("b", OTHER)
    h.begin({"a": 0, "b": 0})
    pending = h.prepare([("a", 0, 5), ("b", 0, 5)])
    sampled, rejected = np.zeros(2, np.int32), np.full(2, 5, np.int32)  # not yet copied
    pending.enqueue_cpu_copy(sampled, rejected)
    sampled[:] = [1, 1]
    rejected[:] = [0, 2]  # the copy landed: b's last two draft tokens were rejected
    out = h.worker.process_output(pending)
    assert_output(out["a"], h, "a", 0, 5)
    assert_output(out["b"], h, "b", 0, 3)


@pytest.mark.parametrize("backend", ["memory", "redis", "cluster"])
def test_a_closed_connector_refuses_every_step_call_and_takes_no_pin(backend, request,
                                                                      namespace):
    """close() released every pin and dropped the steps in flight: a step after it, or one
    prepared before it, is refused as closed (not registered into a cleared table, not
    reported as out of order), and close() again is a no-op."""
    layout = RoutingLayout(num_layers=3, topk=2, num_experts=16, block_size=4)
    url = {"memory": "memory://", "redis": None, "cluster": None}[backend] or \
        request.getfixturevalue(f"{backend}_url")
    h = Harness(layout)
    h.worker.close()
    h.worker = WorkerConnector(layout=layout, store=open_store(url, layout=layout,
                                                               namespace=namespace),
                               max_num_seqs=2)
    h.add("r", TOKENS)
    h.begin({"r": 0}, {"r": h.hashes("r", 0, 2)})
    pending = h.prepare([("r", 0, 8)])
    pending.enqueue_cpu_copy([1], [0])
    h.worker.close()
    with pytest.raises(StoreClosedError, match="closed"):
        h.worker.process_output(pending)
    with pytest.raises(StoreClosedError, match="closed"):
        h.begin({"q": 0}, {"q": h.hashes("r", 0, 2)})
    with pytest.raises(StoreClosedError, match="closed"):
        h.prepare([("r", 8, 1)])
    h.worker.close()
    if backend != "memory":  # no holder of any kind on the keys the refused calls named
        probe = open_store(url, layout=layout, namespace=namespace, lease=False,
                           janitor=False)
        try:
            for key in h.keys("r", 0, 2):
                refs = probe.keys.refs(key)
                assert probe.client_for(refs).hkeys(refs) == []
        finally:
            probe.close()
