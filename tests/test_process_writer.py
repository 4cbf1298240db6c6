"""The helper-process writer: same results as the thread, bounded waits on a stalled Redis."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from r3cache import RoutingLayout, WorkerConnector, open_store
from r3cache.errors import StoreFullError, StoreUnavailableError, WriterError
from r3cache.manifest import BlockRef, BlockSpan, Completion, Manifest
from r3cache.sim import Engine, SimConfig, SimRequest, oracle_rows
from r3cache.store.memory import MemoryBlockStore
from r3cache.store.tiered import TieredBlockStore
from r3cache.store.writers.background import BackgroundBlockStore
from r3cache.store.writers.process import ProcessWriter
from r3cache.store.writers.ring import BlockRing
from r3cache.testing import RedisServer
from tests.conftest import wait_for

LAYOUT = RoutingLayout(num_layers=48, topk=8, num_experts=128, block_size=16)


@pytest.mark.parametrize("tier_blocks", [None, 3], ids=["1GiB-tier", "3-block-tier"])
def test_the_simulator_verifies_with_a_process_writer(redis_url, namespace, tier_blocks):
    """With the default tier and with one of three blocks, whose slots in the helper's
    arena are taken again while the helper may still be reading them."""
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace, idle_ttl=120)
    sizes = {} if tier_blocks is None else {"local_tier_bytes": tier_blocks
                                            * LAYOUT.block_nbytes}
    worker = WorkerConnector(layout=LAYOUT, store=store, max_concurrent_batches=2,
                             writer="process", **sizes)
    assert isinstance(worker.store, TieredBlockStore)
    assert isinstance(worker.store.remote, ProcessWriter)
    assert worker.store.local.arena is worker.store.remote.arena
    workload = [SimRequest(f"r{i}", list(range(40)), list(range(i, i + 30))) for i in range(6)]
    report = Engine(LAYOUT, worker, SimConfig(num_spec_tokens=2)).run(workload)
    owner = worker.store.remote.owner
    worker.close()
    assert report.failures == [] and report.manifests_verified == 6
    check = open_store(redis_url, layout=LAYOUT, namespace=namespace, lease=False)
    assert not check.client_for(check.keys.owners).hexists(check.keys.owners, owner)
    check.close()


_FILLER = [f"{i:064x}" for i in range(2000)]  # pins of ~140 KB a put: a few fill the socket


def _queue_behind_a_stopped_helper(writer: ProcessWriter) -> int:
    """Stop the helper and pin ``_FILLER`` until a put waits in the feeder's queue (the
    socket full); returns how many puts that took."""
    writer._process.send_signal(signal.SIGSTOP)
    fills = 0
    while writer._queued == 0:
        writer.put({}, _FILLER)
        fills += 1
    return fills


@pytest.mark.parametrize("path", ["straight", "feeder"])
def test_what_put_hands_the_helper_is_its_own_once_put_returns(redis_url, namespace, path):
    """Blocks go by the ring; manifests and pins by a message pickled in put, or, queued
    behind puts the feeder has yet to send (the helper stopped, the socket full), by copies
    the feeder pickles later: editing the caller's arrays and lists afterwards (a reused
    tail, a capture buffer) reaches none of them."""
    writer = ProcessWriter(redis_url, LAYOUT, namespace, {"idle_ttl": 60})
    fills = _queue_behind_a_stopped_helper(writer) if path == "feeder" else 0
    block = oracle_rows(np.arange(16), LAYOUT)
    inline = oracle_rows(np.arange(100, 116), LAYOUT)
    tail = inline[:5]  # a view, as the worker's manifests hold of a request's tail
    segments = [BlockRef("k", 0, 16), tail]
    manifest = Manifest("req", LAYOUT.fingerprint, Completion(0, 22), segments)
    retain = ["k", "k"]
    sent = block.copy()
    queued = writer._queued
    writer.put({"k": sent}, retain, ["k"], manifests=[manifest])
    assert writer._queued == queued + (path == "feeder")
    sent[...] = 0
    inline[...] = 0
    segments[0] = BlockRef("other", 0, 16)
    retain.append("k")
    if path == "feeder":
        writer._process.send_signal(signal.SIGCONT)
    writer.flush()
    (got,) = writer.get_manifests(["req"])
    assert got.segments[0] == BlockRef("k", 0, 16)
    np.testing.assert_array_equal(got.segments[1], oracle_rows(np.arange(100, 105), LAYOUT))
    np.testing.assert_array_equal(writer.get_concatenated(["k"]), block)
    assert writer.reader.refcount("k") == 1  # two pins, one release: the put's own
    writer.release_manifests(["req"])
    writer.put({}, release_keys=["k"] + _FILLER * fills)
    writer.close()


@pytest.mark.parametrize("writer_kind", ["thread", "process"])
def test_blocks_in_any_memory_order_reach_the_store_row_for_row(writer_kind, redis_url,
                                                                 namespace):
    """Both writers copy a put's blocks in one pass over plain buffers; a block that
    exports none (Fortran order, a strided view) is copied all the same, in its place."""
    if writer_kind == "thread":
        writer = BackgroundBlockStore(MemoryBlockStore(LAYOUT, namespace))
    else:
        writer = ProcessWriter(redis_url, LAYOUT, namespace, {"idle_ttl": 60})
    wanted = {f"k{i}": oracle_rows(np.arange(16 * i, 16 * i + 16), LAYOUT) for i in range(4)}
    sent = {"k0": wanted["k0"].copy(), "k1": np.asfortranarray(wanted["k1"]),
            "k2": np.repeat(wanted["k2"], 2, axis=2)[:, :, ::2], "k3": wanted["k3"].copy()}
    assert not sent["k1"].flags.c_contiguous and not sent["k2"].flags.c_contiguous
    writer.put(sent)
    for block in sent.values():
        block[...] = 0  # the caller's again once put returns
    writer.flush()
    np.testing.assert_array_equal(writer.get_concatenated(list(wanted)),
                                  np.concatenate(list(wanted.values())))
    writer.close()


def test_manifests_pickled_for_the_helper_come_back_the_same():
    """A put's manifests cross to the helper pickled, inline rows as bytes: every segment
    comes back in order, a BlockRef as a BlockRef, rows equal (a strided view too) and
    read-only, in a list or in a BlockSpan."""
    rows = oracle_rows(np.arange(100, 116), LAYOUT)
    strided = rows[::2]  # not contiguous
    listed = Manifest("a", LAYOUT.fingerprint, Completion(3, 3 + 16 + 8 + 1),
                      [BlockRef("k", 0, 16), strided], expires_at=12.5)
    spanned = Manifest("b", LAYOUT.fingerprint, Completion(5, 5 + 11 + 32 + 5 + 1),
                       BlockSpan([BlockRef("h", 5, 16)], ["k1", "k2"], [rows[:5]], 16))
    for manifest in (listed, spanned):
        back = pickle.loads(pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL))
        assert type(back.segments) is type(manifest.segments)
        assert (back.request_id, back.fingerprint, back.completion, back.expires_at) == (
            manifest.request_id, manifest.fingerprint, manifest.completion, manifest.expires_at)
        assert back.completion.__class__ is Completion
        assert [type(s) for s in back.segments] == [type(s) for s in manifest.segments]
        for got, sent in zip(back.segments, manifest.segments, strict=True):
            assert np.array_equal(got, sent) if isinstance(sent, np.ndarray) else got == sent
        back.check(LAYOUT)
        inline = [s for s in back.segments if isinstance(s, np.ndarray)]
        assert len(inline) == 1 and not inline[0].flags.writeable


@pytest.mark.parametrize(("url", "policy", "writer"), [
    ("redis", "raise", ProcessWriter),
    ("redis", "incomplete", BackgroundBlockStore),  # the helper knows "raise" only
    ("memory", "raise", MemoryBlockStore),  # written in place: no writer at all
])
def test_the_default_writer_is_the_helper_process_for_redis(request, namespace, url, policy,
                                                           writer):
    url = request.getfixturevalue("redis_url") if url == "redis" else "memory://"
    store = open_store(url, layout=LAYOUT, namespace=namespace)
    worker = WorkerConnector(layout=LAYOUT, store=store, on_unavailable=policy)
    chosen = worker.store.remote if isinstance(worker.store, TieredBlockStore) else worker.store
    worker.close()
    assert isinstance(chosen, writer)


def test_the_helper_waits_for_redis_that_comes_up_within_max_wait(namespace):
    """A helper started while its Redis restarts (a failover) connects once it answers."""
    server = RedisServer().start()
    # Longer than a store's own retries (a few tenths of a second) cover.
    restart = threading.Timer(2.5, server.start)
    try:
        open_store(server.url, layout=LAYOUT, namespace=namespace).close()  # the namespace
        server.kill()
        restart.start()
        began = time.monotonic()
        writer = ProcessWriter(server.url, LAYOUT, namespace, {"idle_ttl": 60}, max_wait=6.0)
        assert 2.4 < time.monotonic() - began < 6.0
        block = oracle_rows(np.arange(16), LAYOUT)
        writer.put({"k": block})
        np.testing.assert_array_equal(writer.get_concatenated(["k"]), block)
        writer.close()
        server.kill()
        with pytest.raises(WriterError, match="could not open"):
            ProcessWriter(server.url, LAYOUT, namespace, {}, max_wait=0.5)  # it never comes
    finally:
        if restart.is_alive():
            restart.join()  # a server it starts late is stopped too
        server.stop()  # and its directory goes


def test_a_paused_redis_makes_put_fail_after_max_wait(namespace):
    with RedisServer() as server:
        writer = ProcessWriter(server.url, LAYOUT, namespace, {"idle_ttl": 60},
                               max_pending=2, max_wait=0.3)
        block = np.zeros(LAYOUT.block_shape, np.uint8)
        writer.put({"warm": block})
        writer.flush()
        pause = threading.Thread(target=server.client().client_pause, args=(3000,))
        pause.start()
        pause.join()
        slowest = 0.0
        with pytest.raises(StoreUnavailableError, match="not written"):
            for i in range(10_000):
                began = time.perf_counter()
                writer.put({f"k{i}": block})
                slowest = max(slowest, time.perf_counter() - began)
        assert slowest < 1.0  # never stalled beyond the bound
        server.client().client_unpause()
        writer.close()


def test_puts_gathered_into_one_round_keep_every_effect(redis_url, namespace):
    """Rapid puts reach Redis as one round; pins crossing zero in order, first writer's
    rows, and a manifest after its block all come out as if applied one by one."""
    from r3cache import Completion, R3Reader
    from r3cache.manifest import BlockRef, Manifest

    rows = [np.broadcast_to(np.arange(8, dtype=np.uint8) + 8 * i, LAYOUT.block_shape).copy()
            for i in range(3)]
    writer = ProcessWriter(redis_url, LAYOUT, namespace, {"idle_ttl": 60})
    manifest = Manifest("req", LAYOUT.fingerprint, Completion(0, 17), [BlockRef("c", 0, 16)])
    # Stopped while the puts are sent, the helper finds them all waiting: one round,
    # whatever the machine's load (else a slow feeder splits them, and the second write
    # of "c" is this writer's own conflict, read back as its variant).
    writer._process.send_signal(signal.SIGSTOP)
    writer.put({"a": rows[0]}, retain_keys=["a"])
    writer.put({}, release_keys=["a"])
    writer.put({}, retain_keys=["a"])
    writer.put({"b": rows[1]}, retain_keys=["b"], release_keys=["b"])
    writer.put({"c": rows[2]}, manifests=[manifest])
    writer.put({"c": rows[0]})  # a second write of "c": the first one's rows stay
    wait_for(lambda: writer.pending == 0, 5, "the feeder to send every put")
    writer._process.send_signal(signal.SIGCONT)
    writer.flush()
    reader = writer.reader
    np.testing.assert_array_equal(reader.get_concatenated(["a", "b", "c"]),
                                  np.concatenate(rows))
    assert reader.refcount("a") == 1 and reader.refcount("b") == 0
    key = reader.keys.block("b")
    assert 0 < reader.client_for(key).pttl(key) <= 61_000  # idle: the TTL (+10 ms a rank)
    key = reader.keys.block("a")
    assert reader.client_for(key).pttl(key) == -1  # held: no TTL
    with R3Reader(redis_url, namespace=namespace) as trainer:
        np.testing.assert_array_equal(trainer.get("req"), rows[2])
        trainer.release("req")
    writer.close()


def test_puts_the_socket_cannot_take_at_once_follow_through_the_feeder_in_order(
        redis_url, namespace):
    """Puts go to the socket straight from the caller while it takes them whole; with the
    helper stopped it fills, one put goes part there and part through the feeder, and the
    rest follow it there: every effect arrives, in order (three holds then two releases
    of each key leave one; a release taken early would leave two)."""
    keys = [f"{i:064x}" for i in range(2000)]  # ~140 KB a put: a few fill the socket
    rows = np.broadcast_to(np.arange(8, dtype=np.uint8), LAYOUT.block_shape).copy()
    writer = ProcessWriter(redis_url, LAYOUT, namespace, {"idle_ttl": 60})
    writer._process.send_signal(signal.SIGSTOP)
    puts = [{"retain_keys": keys}] * 3 + [{"objects": {"blk": rows}}] \
        + [{"release_keys": keys}] * 2
    for put in puts:
        writer.put(put.get("objects", {}), put.get("retain_keys", ()),
                   put.get("release_keys", ()))
    queued = writer._queued
    writer._process.send_signal(signal.SIGCONT)
    writer.flush()
    assert 0 < queued < len(puts)  # some went straight to the socket, some through the feeder
    reader = writer.reader
    assert {reader.refcount(k) for k in keys[::97]} == {1}
    np.testing.assert_array_equal(reader.get_concatenated(["blk"]), rows)
    writer.put({}, release_keys=keys)
    writer.close()


def test_a_queued_put_the_feeder_cannot_pickle_fails_the_writer_at_the_next_call(
        redis_url, namespace):
    """A put queued behind the feeder is pickled there: one that cannot be (a key no
    caller that checks its keys would pass) makes the next call raise WriterError, not
    wait for a feeder that is gone."""
    writer = ProcessWriter(redis_url, LAYOUT, namespace, {"idle_ttl": 60})
    _queue_behind_a_stopped_helper(writer)
    writer.put({}, [lambda: None])
    writer._process.send_signal(signal.SIGCONT)
    wait_for(lambda: writer._error is not None, 10, "the feeder to fail")
    with pytest.raises(WriterError, match="PicklingError|AttributeError"):
        writer.put({}, ["k"])
    writer._process.kill()
    with pytest.raises((WriterError, StoreUnavailableError)):
        writer.close()


def test_a_tier_slot_is_written_again_only_once_the_helper_has_read_it(redis_url, namespace):
    """The tier's blocks go to the helper by their slot in its arena. With the helper
    stopped before it read two of them, a put that would evict them (a tier of two blocks)
    waits for it (a wait the metrics count), then fails after max_wait, changing nothing;
    the helper, going on, still finds the rows it was sent, and the put taken again evicts
    them."""
    writer = ProcessWriter(redis_url, LAYOUT, namespace, {"idle_ttl": 60}, max_wait=0.5,
                           arena_bytes=2 * LAYOUT.block_nbytes)
    local = MemoryBlockStore(LAYOUT, namespace, 2 * LAYOUT.block_nbytes, arena=writer.arena)
    tier = TieredBlockStore(local, writer)
    rng = np.random.default_rng(9)
    blocks = {f"k{i}": rng.integers(0, 128, LAYOUT.block_shape).astype(np.uint8)
              for i in range(4)}
    writer._process.send_signal(signal.SIGSTOP)
    try:
        tier.put({k: blocks[k] for k in ("k0", "k1")})
        began = time.perf_counter()
        with pytest.raises(StoreUnavailableError):
            tier.put({k: blocks[k] for k in ("k2", "k3")})
        assert time.perf_counter() - began >= 0.5
        assert set(local._blocks) == {"k0", "k1"}
        # A put's wait for the writer, on the metrics' histogram.
        assert writer.waits.count == 1 and writer.waits.total >= 0.5
    finally:
        writer._process.send_signal(signal.SIGCONT)
    # The helper (nice 10) may take longer than the put's 0.5 s to run again on a loaded
    # machine: what is tested is that the retried put finds the slots free once it has.
    wait_for(lambda: writer.arena.acked >= writer.arena.latest, 30,
             "the helper to encode the blocks it was sent")
    tier.put({k: blocks[k] for k in ("k2", "k3")})
    assert set(local._blocks) == {"k2", "k3"}
    tier.flush()
    np.testing.assert_array_equal(writer.reader.get_concatenated(list(blocks)),
                                  np.concatenate(list(blocks.values())))
    tier.close()


def test_a_tier_too_small_for_one_block_is_refused_before_a_helper_starts(redis_url,
                                                                          namespace):
    """The tier's arena is the helper's: its size is checked before the helper is spawned,
    or the refused connector would leave a helper process running."""
    def helpers() -> set[str]:
        # This process's writer helpers only: other children (servers the suite's fixtures
        # start and restart) may come and go meanwhile.
        listed = subprocess.run(["pgrep", "-a", "-P", str(os.getpid())],
                                capture_output=True, text=True).stdout.splitlines()
        return {line for line in listed if "r3cache.store.writers.helper" in line}

    before = helpers()
    store = open_store(redis_url, layout=LAYOUT, namespace=namespace)
    with pytest.raises(StoreFullError, match="cannot hold one block"):
        WorkerConnector(layout=LAYOUT, store=store, writer="process",
                        local_tier_bytes=LAYOUT.block_nbytes - 1)
    store.close()
    assert helpers() <= before


def test_the_ring_wraps_and_waits_for_acknowledged_slots():
    ring = BlockRing(LAYOUT, capacity=5)
    assert ring.place(3) == 0
    assert ring.place(3) is None  # 2 slots left at the end, none acknowledged
    ring.freed(3)
    assert ring.place(3) == 5  # wraps: slots 5..7 are 0..2 in memory, 3..4 skipped
    assert ring.view(5, 3).shape == (3, *LAYOUT.block_shape)
    assert ring.place(1) == 8  # memory slot 3: free, though 5..7 are in flight
    ring.freed(8)
    assert ring.place(5) is None  # needs memory 0..4; slot 8 (memory 3) is in flight
    ring.freed(9)
    assert ring.place(5) == 10
    ring.slots[0] = 7
    assert (ring.view(10, 5)[0] == 7).all()
    ring.close()


def test_puts_larger_than_the_ring_and_wrapping_puts_arrive_exact(redis_url, namespace):
    rng = np.random.default_rng(5)
    blocks = {f"k{i}": rng.integers(0, 128, LAYOUT.block_shape).astype(np.uint8)
              for i in range(40)}
    writer = ProcessWriter(redis_url, LAYOUT, namespace, {"idle_ttl": 60},
                           ring_bytes=7 * LAYOUT.block_nbytes)
    keys = list(blocks)
    writer.put({k: blocks[k] for k in keys[:17]}, retain_keys=keys[:17])  # 3 ring loads
    for at in range(17, 40, 3):  # 3 at a time through 7 slots: every put wraps sometime
        writer.put({k: blocks[k] for k in keys[at : at + 3]})
    writer.flush()
    np.testing.assert_array_equal(writer.reader.get_concatenated(keys),
                                  np.concatenate(list(blocks.values())))
    assert [writer.reader.refcount(k) for k in keys[:18]] == [1] * 17 + [0]
    writer.close()


def test_a_full_ring_with_redis_paused_fails_after_max_wait(namespace):
    with RedisServer() as server:
        writer = ProcessWriter(server.url, LAYOUT, namespace, {"idle_ttl": 60},
                               max_pending=10_000, max_wait=0.3,
                               ring_bytes=8 * LAYOUT.block_nbytes)
        block = np.zeros(LAYOUT.block_shape, np.uint8)
        writer.put({"warm": block})
        writer.flush()
        server.client().client_pause(3000)
        began = time.perf_counter()
        with pytest.raises(StoreUnavailableError, match="not written"):
            for i in range(10_000):
                writer.put({f"k{i}": block})
        assert time.perf_counter() - began < 1.5  # the ring filled, then one bounded wait
        server.client().client_unpause()
        writer.close()


@pytest.mark.parametrize("call", ["put", "flush"])
def test_a_helper_killed_while_the_feeder_is_full_is_told_at_once(redis_url, namespace, call,
                                                                   reliability):
    """The helper killed (the OOM killer, say) under a feeder blocked on its full socket:
    the feeder stops, and its queue never drains. A put or flush waiting for room in it
    raised StoreUnavailableError only after the whole max_wait (30 s here), the engine's
    step held that long for a helper that was already gone."""
    writer = ProcessWriter(redis_url, LAYOUT, namespace, {"idle_ttl": 60}, max_pending=2,
                           max_wait=30.0)
    helper = writer._process
    keys = [f"key-{i:06d}-" + "x" * 40 for i in range(20_000)]
    try:
        writer.put({"warm": np.zeros(LAYOUT.block_shape, np.uint8)})
        writer.flush()
        os.kill(helper.pid, signal.SIGSTOP)  # its socket fills, then the feeder's queue
        while True:  # full, and staying so: the feeder is blocked on the socket
            while not writer._outbox.full():
                writer.put({}, retain_keys=keys)
            time.sleep(0.2)
            if writer._outbox.full():
                break
        threading.Timer(0.3, os.kill, (helper.pid, signal.SIGKILL)).start()
        began = time.monotonic()
        with pytest.raises(WriterError, match="was killed by SIGKILL") as info:
            if call == "put":
                writer.put({}, retain_keys=keys)
            else:
                writer.flush()
        reliability(f"the helper-process writer SIGKILLed while its feeder's queue is full "
                    f"(helper stopped, socket full), a {call} waiting for room",
                    "max_pending 2, max_wait 30 s", "WriterError naming the signal, not "
                    "StoreUnavailableError after max_wait",
                    f"raised {time.monotonic() - began - 0.3:.2f} s after the kill: "
                    + str(info.value).replace(namespace, "NS"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper.pid, signal.SIGKILL)
        with contextlib.suppress(WriterError, StoreUnavailableError):
            writer.close()
