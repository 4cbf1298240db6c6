import threading
import time

import numpy as np
import pytest

from r3cache import RoutingLayout
from r3cache.errors import StoreClosedError, StoreFullError, StoreUnavailableError, WriterError
from r3cache.store.memory import MemoryBlockStore
from r3cache.store.writers.background import BackgroundBlockStore

LAYOUT = RoutingLayout(num_layers=2, topk=2, num_experts=8, block_size=4)


def blk(value):
    return np.full(LAYOUT.block_shape, value, LAYOUT.dtype)


class GatedStore(MemoryBlockStore):
    """A real memory store whose writes wait until the test opens the gate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def put(self, *args, **kwargs):
        self.gate.wait(10)
        super().put(*args, **kwargs)


def test_put_returns_before_the_write_and_reads_see_earlier_writes():
    inner = GatedStore(LAYOUT, "t")
    store = BackgroundBlockStore(inner, max_pending=8)
    began = time.perf_counter()
    store.put({"a": blk(1)}, retain_keys=["a"])
    assert time.perf_counter() - began < 1.0
    assert inner.stats().blocks == 0 and store.pending == 1
    threading.Timer(0.05, inner.gate.set).start()
    assert store.get_concatenated(["a"]).max() == 1  # waits for the write
    assert inner.refcount("a") == 1 and store.pending == 0
    store.close()


def test_a_full_queue_makes_put_wait_and_stays_bounded():
    inner = GatedStore(LAYOUT, "t")
    store = BackgroundBlockStore(inner, max_pending=2)
    for i in range(3):  # one taken by the writer, two queued
        store.put({f"k{i}": blk(i)})
    blocked = threading.Thread(target=store.put, args=({"k3": blk(3)},))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive() and store.pending <= 3 + 1
    inner.gate.set()
    blocked.join(5)
    assert not blocked.is_alive()
    store.flush()
    assert inner.stats().blocks == 4
    store.close()


def test_a_writer_failure_is_sticky_and_typed():
    inner = MemoryBlockStore(LAYOUT, "t", max_bytes=LAYOUT.block_nbytes)
    store = BackgroundBlockStore(inner)
    store.put({"a": blk(1)}, retain_keys=["a"])
    store.put({"b": blk(2)})  # cannot fit: the writer fails
    with pytest.raises(WriterError) as info:
        store.flush()
    assert isinstance(info.value.__cause__, StoreFullError)
    for call in (lambda: store.put({"c": blk(3)}), lambda: store.get_concatenated(["a"]),
                 store.flush):
        with pytest.raises(WriterError):
            call()
    with pytest.raises(WriterError):
        store.close()


def test_close_drains_pending_writes_then_refuses_calls():
    inner = GatedStore(LAYOUT, "t")
    seen = []
    original_close = inner.close
    inner.close = lambda: (seen.append(inner.stats().blocks), original_close())
    store = BackgroundBlockStore(inner)
    for i in range(5):
        store.put({f"k{i}": blk(i)})
    inner.gate.set()
    store.close()
    assert seen == [5]
    with pytest.raises(StoreClosedError):
        store.put({"x": blk(1)})


def test_close_on_a_stalled_store_fails_after_max_wait_and_the_writer_finishes_alone():
    inner = GatedStore(LAYOUT, "t")
    store = BackgroundBlockStore(inner, max_pending=4, max_wait=0.3)
    for i in range(3):  # one taken by the writer, which stalls; two queued
        store.put({f"k{i}": blk(i)})
    began = time.perf_counter()
    with pytest.raises(StoreUnavailableError, match="3 batch"):
        store.close()
    assert 0.25 < time.perf_counter() - began < 2.0
    with pytest.raises(StoreClosedError):
        store.put({"x": blk(1)})
    inner.gate.set()  # the store answers again: the writer drains, then closes it
    store._thread.join(5)
    assert not store._thread.is_alive() and inner.stats().blocks_written == 3
    with pytest.raises(StoreClosedError):
        inner.put({"y": blk(1)})


def test_close_waits_for_a_writer_that_keeps_making_progress():
    class SlowStore(MemoryBlockStore):
        def put(self, *args, **kwargs):
            time.sleep(0.1)  # each batch well inside max_wait, all of them beyond it
            super().put(*args, **kwargs)

    inner = SlowStore(LAYOUT, "t")
    store = BackgroundBlockStore(inner, max_pending=16, max_wait=0.3)
    for i in range(8):
        store.put({f"k{i}": blk(i)})
    store.close()
    assert inner.stats().blocks_written == 8


def test_a_stalled_writer_makes_put_fail_after_max_wait_not_hang():
    inner = GatedStore(LAYOUT, "t")
    store = BackgroundBlockStore(inner, max_pending=1, max_wait=0.2)
    store.put({"a": blk(1)})  # taken by the writer, which stalls
    store.put({"b": blk(2)})  # queued
    began = time.perf_counter()
    with pytest.raises(StoreUnavailableError, match="not written"):
        store.put({"c": blk(3)})
    assert 0.15 < time.perf_counter() - began < 2.0
    inner.gate.set()
    store.close()
    assert inner.stats().blocks_written == 2


def test_after_a_put_gave_up_later_puts_fail_at_once_until_the_writer_moves():
    """One stall costs one max_wait: under "incomplete" the engine's next steps drop their
    batches at once instead of each waiting; a writer that moves again (its store answers)
    takes the next put within its grace, and puts wait as before."""
    inner = GatedStore(LAYOUT, "t")
    store = BackgroundBlockStore(inner, max_pending=1, max_wait=0.5,
                                 on_unavailable="incomplete")
    store.put({"a": blk(1)})  # taken by the writer, which stalls
    store.put({"b": blk(2)})  # queued
    began = time.perf_counter()
    store.put({"c": blk(3)})  # waits max_wait, then dropped
    assert time.perf_counter() - began >= 0.45 and store.dropped_batches == 1
    began = time.perf_counter()
    for value in range(4, 9):
        store.put({f"k{value}": blk(value)})
    assert time.perf_counter() - began < 0.2 and store.dropped_batches == 6
    inner.gate.set()
    store.put({"d": blk(4)})  # the writer moves again at once: room within the grace
    store.flush()
    assert inner.stats().blocks_written == 3 and store.dropped_batches == 6
    store.close()
