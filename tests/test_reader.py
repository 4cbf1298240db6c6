"""Offline read-back: manifests written by the worker, read by R3Reader, on every backend."""

from __future__ import annotations

import time

import numpy as np
import pytest

from r3cache import R3Reader, RoutingLayout, open_store
from r3cache.errors import (
    BlockNotFoundError,
    ContractError,
    CorruptBlockError,
    LayoutMismatchError,
    ManifestNotFoundError,
    NamespaceNotFoundError,
)
from r3cache.hashing import block_hashes
from r3cache.sim import SimConfig, SimRequest, oracle_rows, simulate

LAYOUT = RoutingLayout(num_layers=4, topk=2, num_experts=40, block_size=4)
PROMPT = list(range(100, 114))  # 14 tokens: three full blocks and two tokens


def run(url: str, namespace: str, workload, **config) -> None:
    options = {} if url.startswith("memory") else {"idle_ttl": 300}
    report = simulate(workload, LAYOUT, SimConfig(keep_manifests=True, **config),
                      store_url=url, namespace=namespace, **options)
    assert report.failures == [] and report.manifests_verified == len(workload)


@pytest.fixture(params=["redis", "cluster"])
def url(request) -> str:
    return request.getfixturevalue("redis_url" if request.param == "redis" else "cluster_url")


@pytest.fixture
def reader(url, namespace):
    workload = [SimRequest("a", PROMPT, [7, 8, 9, 10, 11]),
                SimRequest("b", PROMPT, [3, 4], prompt_start=6)]
    run(url, namespace, workload, num_spec_tokens=2)
    with R3Reader(url, namespace=namespace) as r:
        yield r


def expected(tokens, start):
    return oracle_rows(tokens, LAYOUT)[start : len(tokens) - 1]


def test_get_returns_exactly_the_request_rows(reader):
    np.testing.assert_array_equal(reader.get("a"), expected(PROMPT + [7, 8, 9, 10, 11], 0))
    b = reader.get("b")
    assert b.shape == (14 + 2 - 1 - 6, 4, 2)
    np.testing.assert_array_equal(b, expected(PROMPT + [3, 4], 6))


def test_prompt_start_asks_for_rows_from_a_position_and_refuses_rows_not_recorded(reader):
    # "b" was recorded from position 6 (vLLM's routed_experts_prompt_start, SGLang's
    # routed_experts_start_len): replay needs rows from 0, which it does not have.
    full = expected(PROMPT + [7, 8, 9, 10, 11], 0)
    np.testing.assert_array_equal(reader.get("a", prompt_start=0), full)
    np.testing.assert_array_equal(reader.get("a", prompt_start=5, dtype=np.int64), full[5:])
    assert reader.get("a", prompt_start=18).shape == (0, 4, 2)  # 19 tokens: 18 rows
    np.testing.assert_array_equal(reader.get("b", prompt_start=6), reader.get("b"))
    np.testing.assert_array_equal(reader.get("b", prompt_start=9), expected(PROMPT + [3, 4], 9))
    with pytest.raises(ContractError, match="'b' was recorded from position 6"):
        reader.get_many(["a", "b"], prompt_start=0)
    with pytest.raises(ContractError, match="'a' has 19 tokens"):
        reader.get("a", prompt_start=19)
    for bad in (-1, 1.0, "0", True):
        with pytest.raises(ContractError, match="prompt_start"):
            reader.get("a", prompt_start=bad)
    torch = pytest.importorskip("torch")
    assert torch.equal(reader.get_torch("a", prompt_start=3),
                       torch.from_numpy(full[3:].astype(np.int64)))


def test_dtype_and_layer_selection(reader):
    rows = reader.get("a", dtype=np.int64, layers=[1, 3])
    assert rows.dtype == np.int64 and rows.shape[1:] == (2, 2)
    np.testing.assert_array_equal(rows, expected(PROMPT + [7, 8, 9, 10, 11], 0)[:, [1, 3]])
    assert reader.get("a", layers=slice(2, None)).shape[1] == 2


def test_get_many_and_torch_tensors(reader):
    torch = pytest.importorskip("torch")
    a, b = reader.get_many(["a", "b"])
    ta, tb = reader.get_many_torch(["a", "b"])
    assert ta.dtype == torch.int64 and torch.equal(ta, torch.from_numpy(a.astype(np.int64)))
    assert reader.get_torch("b", dtype=torch.int32).dtype == torch.int32
    np.testing.assert_array_equal(tb.numpy(), b)


def test_manifests_hold_their_blocks_until_released(reader):
    store = reader.store
    manifest = store.get_manifests(["a"])[0]
    key = manifest.block_keys[0]
    refs = store.keys.refs(key)
    assert store.client_for(refs).hget(refs, "m:a") == b"1"
    assert store.client_for(store.keys.block(key)).pttl(store.keys.block(key)) == -1
    assert reader.release("a") == 1
    assert store.client_for(refs).hget(refs, "m:a") is None
    with pytest.raises(ManifestNotFoundError) as info:
        reader.get("a")
    assert info.value.request_ids == ("a",) and "'a'" in str(info.value)
    assert reader.release("a") == 0


def test_a_reader_refuses_the_options_of_a_writer_by_name(url, namespace):
    """A reader holds nothing and collects nothing: lease= or janitor= was a TypeError
    (its own keyword given twice)."""
    for option in ({"lease": True}, {"janitor": True}, {"lease": False, "janitor": False}):
        with pytest.raises(ContractError, match="R3Reader opens read-only: it takes no "):
            R3Reader(url, namespace=namespace, **option)


def test_a_reader_checks_the_layout_it_is_given_and_writes_no_namespace(reader, url):
    """``layout=`` was a TypeError (the keyword given twice). The trainer's layout is now
    compared with the stored one; a namespace that is not there stays so."""
    with R3Reader(url, namespace=reader.namespace, layout=LAYOUT) as same:
        np.testing.assert_array_equal(same.get("a"), reader.get("a"))
    other = RoutingLayout(num_layers=5, topk=2, num_experts=40, block_size=4)
    with pytest.raises(LayoutMismatchError, match=other.fingerprint):
        R3Reader(url, namespace=reader.namespace, layout=other)
    with pytest.raises(ContractError, match="RoutingLayout"):
        R3Reader(url, namespace=reader.namespace, layout="r3l1:L4:K2:E40:B4:|u1")
    missing = reader.namespace + "-none"
    with pytest.raises(NamespaceNotFoundError):
        R3Reader(url, namespace=missing, layout=LAYOUT)
    with pytest.raises(NamespaceNotFoundError):  # the failed open wrote nothing
        R3Reader(url, namespace=missing)


def test_a_reader_of_a_store_object_refuses_a_namespace_or_options_it_would_not_use(
        reader):
    """Both were ignored: a reader given another namespace read the store's."""
    store = reader.store
    with pytest.raises(ContractError, match="namespace and options go with a URL"):
        R3Reader(store, namespace=store.namespace + "-other")
    with pytest.raises(ContractError, match="namespace and options go with a URL"):
        R3Reader(store, socket_timeout=1)
    with R3Reader(store, namespace=store.namespace, layout=LAYOUT) as same:
        np.testing.assert_array_equal(same.get("a"), reader.get("a"))
    assert reader.get("a").shape[0] > 0  # the reader's store is still open


def test_a_missing_block_names_the_request(reader):
    store = reader.store
    key = store.get_manifests(["b"])[0].block_keys[-1]
    store.client_for(store.keys.block(key)).delete(store.keys.block(key))
    with pytest.raises(BlockNotFoundError) as info:
        reader.get_many(["b"])
    assert info.value.request_ids == ("b",) and key in info.value.keys


def test_a_corrupted_block_names_the_request(reader):
    store = reader.store
    key = store.get_manifests(["a"])[0].block_keys[0]
    block = store.keys.block(key)
    data = bytearray(store.client_for(block).get(block))
    data[-1] ^= 0x10
    store.client_for(block).set(block, bytes(data))
    with pytest.raises(CorruptBlockError, match="request\\(s\\) 'a'"):
        reader.get("a")


@pytest.mark.parametrize(
    ("field", "mangle", "reason"),
    [
        (b"segments", lambda v: v.rsplit(b" ", 1)[0], "checksum mismatch"),
        (b"num_tokens", lambda v: b"9999", "checksum mismatch"),
        (b"format", lambda v: b"7", "checksum mismatch"),
        (b"inline:", lambda v: v[:-3], "checksum mismatch"),
        (b"expires_at", lambda v: b"1", "checksum mismatch"),
        (b"checksum", lambda v: v[::-1], "checksum mismatch"),
    ],
)
def test_a_tampered_manifest_is_detected(reader, field, mangle, reason):
    store = reader.store
    key = store.keys.manifest("a")
    client = store.client_for(key)
    fields = client.hgetall(key)
    field = next(f for f in fields if f.startswith(field))  # inline:N is the tail segment
    client.hset(key, field, mangle(fields[field]))
    with pytest.raises(CorruptBlockError, match=reason):
        reader.get("a")


def test_invalid_expert_ids_are_refused(url, namespace):
    store = open_store(url, layout=LAYOUT, namespace=namespace)
    rows = np.zeros(LAYOUT.block_shape, np.uint8)
    rows[:, :, 1] = 1
    bad_range, duplicate = rows.copy(), rows.copy()
    bad_range[2, 1, 0] = 40
    duplicate[1, 3, 1] = 0
    range_key = block_hashes(list(range(4)), 4)[0].hex()
    duplicate_key = block_hashes([9, 9, 9, 9], 4)[0].hex()
    store.put({range_key: bad_range, duplicate_key: duplicate})
    reader = R3Reader(store)
    with pytest.raises(CorruptBlockError, match="outside 0..39"):
        reader.get_by_tokens(list(range(4)))
    with pytest.raises(CorruptBlockError, match="same expert twice"):
        reader.get_by_tokens([9, 9, 9, 9])
    store.close()


def test_get_by_tokens_finds_the_longest_stored_prefix(reader):
    tokens = PROMPT + [7, 8, 9, 10, 11]
    lookup = reader.get_by_tokens(tokens + [1, 2, 3, 4, 5, 6])
    assert lookup.num_blocks == 4 and lookup.num_rows == 16  # 19 tokens: 4 blocks stored
    np.testing.assert_array_equal(lookup.rows, oracle_rows(tokens, LAYOUT)[:16])
    assert reader.get_by_tokens([1, 2, 3, 4, 5]).num_rows == 0


def test_a_continued_conversation_reuses_the_earlier_turns_blocks(url, namespace):
    turn1 = SimRequest("turn1", PROMPT, [7, 8, 9, 10, 11, 12])
    history = turn1.tokens + [50, 51, 52]  # the user's next message
    turn2 = SimRequest("turn2", history, [60, 61, 62], prompt_start=len(turn1.tokens),
                       arrival_step=40)
    run(url, namespace, [turn1], num_spec_tokens=0)
    blocks_after_turn1 = open_store(url, layout=LAYOUT, namespace=namespace,
                                    lease=False).stats().blocks
    run(url, namespace, [turn2], num_spec_tokens=0)
    with R3Reader(url, namespace=namespace) as reader:
        store = reader.store
        first, _ = store.get_manifests(["turn1", "turn2"])
        turn2_keys = [h.hex() for h in block_hashes(turn2.tokens, 4)]
        assert turn2_keys[: len(first.block_keys)] == first.block_keys  # the same blocks
        # Turn 2 ran turn 1's prefix again; its blocks were not stored a second time.
        assert store.stats().blocks == blocks_after_turn1 + 2
        new_rows = reader.get("turn2")
        assert len(new_rows) == len(turn2.tokens) - 1 - len(turn1.tokens)
        np.testing.assert_array_equal(new_rows, expected(turn2.tokens, len(turn1.tokens)))


def test_expired_manifests_are_released_by_the_janitor(url, namespace):
    store = open_store(url, layout=LAYOUT, namespace=namespace, manifest_ttl=0.2)
    from r3cache import Completion
    from r3cache.manifest import BlockRef, Manifest

    store.put({"k": np.zeros(LAYOUT.block_shape, np.uint8)})
    manifest = Manifest("r", LAYOUT.fingerprint, Completion(0, 4), [BlockRef("k", 0, 3)])
    store.put({}, manifests=[manifest])
    assert store.get_manifests(["r"])[0] is not None
    time.sleep(0.3)
    from r3cache.store.redis.janitor import reclaim_dead_owners

    assert reclaim_dead_owners(store).manifests_expired == 1
    assert store.get_manifests(["r"]) == [None]
    refs = store.keys.refs("k")
    assert store.client_for(refs).hget(refs, "m:r") is None
    store.close()


def test_the_embedded_store_records_manifests_too():
    store = open_store("memory://", layout=LAYOUT, namespace="mem")
    from r3cache import WorkerConnector
    from r3cache.sim import Engine

    worker = WorkerConnector(layout=LAYOUT, store=store, max_concurrent_batches=2)
    report = Engine(LAYOUT, worker, SimConfig(keep_manifests=True)).run(
        [SimRequest("a", PROMPT, [1, 2, 3])])
    assert report.manifests_verified == 1
    reader = R3Reader(worker.store)
    np.testing.assert_array_equal(reader.get("a"), expected(PROMPT + [1, 2, 3], 0))
    assert reader.release("a") == 1
    assert worker.store.stats().referenced_keys == 0
    worker.close()


def test_a_trainer_in_a_fresh_process_reads_every_rollout_byte_for_byte(url, namespace):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "trainer_readback.py"
    result = subprocess.run(
        [sys.executable, str(script), url, "--namespace", namespace, "--prompts", "3",
         "--samples", "4", "--layers", "6"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "12 manifests written" in result.stdout
    assert "12 byte-identical, 0 different" in result.stdout


def _with(url: str, query: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{query}"


def test_the_engines_url_reads_as_the_store_url_and_a_mistyped_option_is_refused(reader,
                                                                                 url):
    """The README hands a trainer the engine's R3CACHE_URL: its plugin's options there
    (vLLM's connector options, SGLang's block size) are the engine's, not the store's."""
    engine_url = _with(url, "store_wait=5&on_unavailable=incomplete&writer=process&"
                            "local_tier_bytes=1000000&block_size=4&owner=vllm-0")
    with R3Reader(engine_url, namespace=reader.namespace) as from_engine:
        np.testing.assert_array_equal(from_engine.get("a"), reader.get("a"))
    with pytest.raises(ContractError, match="store_wiat"):
        R3Reader(_with(url, "store_wiat=5"), namespace=reader.namespace)


def test_the_options_a_reader_drops_are_the_engine_plugins_own():
    from r3cache.integrations import sglang, vllm
    from r3cache.store.redis.connect import _STORE_OPTIONS
    from r3cache.store.urls import ENGINE_OPTIONS

    plugins = vllm._CONNECTOR_OPTIONS.keys() | sglang._OPTIONS.keys()
    assert plugins - _STORE_OPTIONS.keys() == ENGINE_OPTIONS
