"""RequestPublisher (what the SGLang plugin runs): whole requests into every store backend,
read back by id and by tokens; bad input refused before anything is written; a stalled
Redis answered within store_wait."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import numpy as np
import pytest

from r3cache import R3Reader, RoutingLayout
from r3cache.connector.publisher import RequestPublisher
from r3cache.errors import (
    ContractError,
    InvalidBatchError,
    R3Error,
    StoreUnavailableError,
)
from r3cache.store import open_store
from r3cache.testing import RedisServer


def _routes(layout: RoutingLayout, n: int, seed: int) -> np.ndarray:
    """``n`` valid rows: distinct experts per (token, layer), as int32 like SGLang's."""
    rng = np.random.default_rng(seed)
    picks = rng.random((n, layout.num_layers, layout.num_experts)).argsort(axis=-1)
    return picks[..., : layout.topk].astype(np.int32)


@pytest.fixture
def publisher(store_url, namespace, layout):
    made = RequestPublisher(layout=layout, store=open_store(store_url, layout=layout,
                                                            namespace=namespace))
    yield made
    made.close()


def _reader(publisher: RequestPublisher, store_url: str) -> R3Reader:
    if store_url == "memory://":
        return R3Reader(publisher.store)
    return R3Reader(store_url, namespace=publisher.store.namespace)


@pytest.mark.parametrize("prompt_start", [0, 3, 4, 9, 22])
def test_a_published_request_reads_back_as_given(publisher, store_url, layout, prompt_start):
    tokens = list(range(100, 123))  # 23 tokens: 22 rows, 5 whole blocks of 4 and 2 more
    rows = _routes(layout, len(tokens) - 1 - prompt_start, seed=prompt_start)
    manifest = publisher.publish("req-a", tokens, rows, prompt_start)
    for part in (*manifest.segments.head, *manifest.segments.tail):
        part[...] = part[::-1].copy()  # the caller's record is its own: the store's is not
    publisher.flush()
    with _reader(publisher, store_url) as reader:
        got = reader.get("req-a", wait=5)
    assert got.dtype == layout.dtype and np.array_equal(got, rows)
    assert len(manifest.block_keys) == max(5 - -(-prompt_start // 4), 0)  # whole, after start
    assert publisher.stats.manifests == 1


def test_a_shared_prefix_is_stored_once_and_found_by_tokens(publisher, store_url, layout):
    prefix = list(range(200, 213))  # 13 tokens: 3 whole blocks of 4 shared
    prefix_rows = _routes(layout, len(prefix), seed=1)
    ids = []
    for i in range(3):
        tokens = prefix + [300 + i] * 6
        rows = np.concatenate([prefix_rows, _routes(layout, 5, seed=10 + i)])
        publisher.publish(f"grpo-{i}", tokens, rows)
        ids.append(tokens)
    publisher.flush()
    with _reader(publisher, store_url) as reader:
        keys = [m.block_keys for m in reader.store.get_manifests(["grpo-0", "grpo-1",
                                                                   "grpo-2"])]
        assert keys[0][:3] == keys[1][:3] == keys[2][:3]
        assert reader.store.stats().blocks == 3 + 3 * 1  # the prefix once, a block each
        found = reader.get_by_tokens(prefix)
        assert found.num_blocks == 3 and np.array_equal(found.rows, prefix_rows[:12])


def test_extra_keys_make_other_blocks(publisher, store_url, layout):
    tokens = list(range(50, 59))
    a = publisher.publish("base", tokens, _routes(layout, 8, seed=2))
    b = publisher.publish("lora", tokens, _routes(layout, 8, seed=3), extra_keys=("lora-a",))
    publisher.flush()
    assert a.block_keys and not set(a.block_keys) & set(b.block_keys)
    with _reader(publisher, store_url) as reader:
        assert reader.store.stats().conflicts == 0


BAD = {
    "a row too many": lambda rows: (np.concatenate([rows, rows[:1]]), 0, InvalidBatchError),
    "topk columns": lambda rows: (rows[..., :1], 0, InvalidBatchError),
    "an expert out of range": lambda rows: (np.where(rows == rows.max(), 16, rows), 0,
                                            InvalidBatchError),
    "a negative expert": lambda rows: (rows - 1, 0, InvalidBatchError),
    "an expert twice in a row": lambda rows: (np.repeat(rows[..., :1], 2, axis=-1), 0,
                                              InvalidBatchError),
    "floats": lambda rows: (rows.astype(np.float32), 0, InvalidBatchError),
    "prompt_start past the rows": lambda rows: (rows, 12, InvalidBatchError),
    "prompt_start negative": lambda rows: (rows, -1, InvalidBatchError),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_and_writes_nothing(case, publisher, store_url, layout):
    rows, start, error = BAD[case](_routes(layout, 10, seed=4))
    with pytest.raises(error):
        publisher.publish("bad", list(range(11)), rows, start)
    with pytest.raises(ContractError):
        publisher.publish("", list(range(11)), _routes(layout, 10, seed=4))
    with pytest.raises(InvalidBatchError):
        publisher.publish("bad", [[1, 2]], _routes(layout, 1, seed=4))
    publisher.flush()
    with _reader(publisher, store_url) as reader:
        assert reader.store.stats().blocks == 0
        assert reader.store.get_manifests(["bad"]) == [None]


def test_token_ids_and_extra_keys_no_engine_hashes_are_refused(publisher, store_url, layout):
    rows = _routes(layout, 10, seed=4)
    # Past int64 a token id would wrap into another sequence's; a float or a negative id
    # hashes to a chain no engine writes.
    for tokens in (np.full(11, 2**63, np.uint64), [-1, *range(10)], [t + 0.5 for t in range(11)]):
        with pytest.raises(InvalidBatchError, match="token ids"):
            publisher.publish("bad", tokens, rows)
    with pytest.raises(InvalidBatchError, match="extra_keys"):
        publisher.publish("bad", list(range(11)), rows, extra_keys="lora-a")
    publisher.flush()
    with _reader(publisher, store_url) as reader:
        assert reader.store.stats().blocks == 0
        assert reader.store.get_manifests(["bad"]) == [None]


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_record_edited_before_the_writer_stored_it_is_stored_as_published(
        tmp_path, namespace, layout, writer):
    tokens, rows = list(range(300, 323)), _routes(layout, 19, seed=1)  # rows from token 3
    with RedisServer("--enable-debug-command", "yes", directory=tmp_path) as server:
        publisher = RequestPublisher(
            layout=layout, store=open_store(server.url, layout=layout, namespace=namespace),
            writer=writer)
        # Redis sleeps: the writer holds the record until it answers.
        stall = threading.Thread(target=lambda: server.client().execute_command(
            "DEBUG", "SLEEP", "0.5"))
        stall.start()
        time.sleep(0.1)
        manifest = publisher.publish("req", tokens, rows, prompt_start=3)
        for part in (*manifest.segments.head, *manifest.segments.tail):
            part[...] = part[::-1].copy()
        stall.join()
        publisher.flush()
        with R3Reader(server.url, namespace=namespace) as reader:
            np.testing.assert_array_equal(reader.get("req", wait=5), rows)
        publisher.close()


def test_a_stalled_redis_is_answered_within_store_wait(tmp_path, namespace, layout):
    with RedisServer(directory=tmp_path) as server:
        publisher = RequestPublisher(
            layout=layout, store=open_store(server.url, layout=layout, namespace=namespace),
            store_wait=0.5, max_pending=4)
        # 250 blocks a request: the helper's socket and queue fill after a few dozen.
        tokens, rows = list(range(1000, 2001)), _routes(layout, 1000, seed=0)
        server.process.send_signal(signal.SIGSTOP)  # stalled, not gone
        try:
            began = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                for i in range(10_000):  # until the ring or the queue stays full
                    publisher.publish(f"r{i}", tokens, rows)
            assert time.monotonic() - began < 5.0
        finally:
            server.process.send_signal(signal.SIGCONT)
        with contextlib.suppress(R3Error):  # what the store refused may be said again
            publisher.close()


def test_published_requests_show_in_the_metrics(publisher, layout):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from r3cache import metrics

    registry = CollectorRegistry()
    metrics.register(registry)
    for i in range(3):
        publisher.publish(f"m{i}", list(range(40, 58)), _routes(layout, 17, seed=i))
    publisher.flush()
    scraped = {s.name: s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples if s.labels.get("namespace") == publisher.store.namespace}
    assert scraped["r3cache_manifests_written_total"] == 3
    assert scraped["r3cache_rows_captured_total"] == 3 * 17
    assert scraped["r3cache_blocks_published_total"] == 3 * 4  # 17 rows: 4 whole blocks
