"""Random corruption of stored data and random bad calls: every one detected, typed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3cache import R3Reader, RoutingLayout, StepBatch, WorkerConnector, open_store
from r3cache.errors import R3Error
from r3cache.sim import SimConfig, SimRequest, simulate
from r3cache.store.memory import MemoryBlockStore
from tests.conftest import SESSION, log_reliability

LAYOUT = RoutingLayout(num_layers=4, topk=2, num_experts=16, block_size=4)
DETECTED = [0, 0]  # corruptions detected, corruptions tried


@pytest.fixture(scope="module")
def recorded(redis_url):
    """One recorded request; each example corrupts a copy of one of its values."""
    namespace = f"{SESSION}-corruption"
    report = simulate([SimRequest("r", list(range(22)), list(range(7)))], LAYOUT,
                      SimConfig(keep_manifests=True), store_url=redis_url,
                      namespace=namespace, idle_ttl=600)
    reader = R3Reader(redis_url, namespace=namespace)
    yield reader, report.online["r"]
    reader.close()
    log_reliability(__name__ + "::test_every_corruption_of_a_block_or_manifest_field_is_detected",
                    "bit flips, truncation, foreign bytes in a stored block or any manifest "
                    "field", "property test, random corruptions",
                    "each read raises a typed error; the restored value reads exact",
                    f"{DETECTED[0]}/{DETECTED[1]} corruptions detected, 0 wrong rows returned")


def _mutations():
    flip = st.tuples(st.just("flip"), st.integers(0, 10**6))
    cut = st.tuples(st.just("truncate"), st.integers(0, 10**6))
    foreign = st.tuples(st.just("foreign"), st.binary(max_size=80).map(len))
    return st.one_of(flip, cut, foreign)


def _apply(kind: str, at: int, value: bytes) -> bytes:
    if kind == "flip":
        bit = at % (len(value) * 8)
        data = bytearray(value)
        data[bit // 8] ^= 1 << (bit % 8)
        return bytes(data)
    if kind == "truncate":
        return value[: at % len(value)]
    return bytes(np.random.default_rng(at).integers(0, 256, at + 1, dtype=np.uint8))


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.integers(0, 10**6), mutation=_mutations())
def test_every_corruption_of_a_block_or_manifest_field_is_detected(recorded, target, mutation):
    reader, online = recorded
    store = reader.store
    manifest_key = store.keys.manifest("r")
    fields = store.client_for(manifest_key).hgetall(manifest_key)
    blocks = [store.keys.block(k) for k in store.get_manifests(["r"])[0].block_keys]
    places = [(manifest_key, name) for name in sorted(fields)] + [(b, None) for b in blocks]
    key, field = places[target % len(places)]
    client = store.client_for(key)
    original = client.hget(key, field) if field else client.get(key)
    corrupted = _apply(*mutation, original)
    if corrupted == original:
        return
    if field:
        client.hset(key, field, corrupted)
    else:
        client.set(key, corrupted)
    DETECTED[1] += 1
    try:
        with pytest.raises(R3Error):
            rows = reader.get("r")
            # Returning the exact online rows would mean the change did not matter.
            assert not np.array_equal(rows, online), "corruption went unnoticed"
            raise AssertionError("corrupted data was returned")
        DETECTED[0] += 1
    finally:
        if field:
            client.hset(key, field, original)
        else:
            client.set(key, original)
    np.testing.assert_array_equal(reader.get("r"), online)


BAD_ARRAYS = st.one_of(
    st.just(np.zeros((4, 4, 2), np.int64)),
    st.just(np.zeros((4, 2, 4), np.uint8)),
    st.just(np.zeros((4, 4), np.uint8)),
    st.just(np.zeros((0,), np.float32)),
    st.just([[1, 2]]),
    st.just("rows"),
)


@settings(max_examples=60, deadline=None)
@given(rows=BAD_ARRAYS)
def test_bad_rows_at_every_entry_point_raise_typed_errors(rows):
    store = MemoryBlockStore(LAYOUT)
    with pytest.raises(R3Error):
        store.put({"k": rows})
    worker = WorkerConnector(layout=LAYOUT, store=MemoryBlockStore(LAYOUT))
    from r3cache import StepMetadata

    worker.begin_step(StepMetadata(0, {"r": 0}))
    with pytest.raises(R3Error):
        worker.prepare_output(StepBatch(["r"], np.array([0]), np.array([0, 4])), rows)
    from r3cache import codec

    with pytest.raises(R3Error):
        codec.encode_rows(rows, LAYOUT)
    worker.close()


@settings(max_examples=60, deadline=None)
@given(starts=st.lists(st.integers(-3, 3), min_size=0, max_size=3),
       qsl=st.lists(st.integers(-3, 9), min_size=0, max_size=4),
       counts=st.lists(st.integers(-2, 6), min_size=0, max_size=3))
def test_bad_batches_and_counts_raise_typed_errors_or_are_valid(starts, qsl, counts):
    worker = WorkerConnector(layout=LAYOUT, store=MemoryBlockStore(LAYOUT))
    from r3cache import StepMetadata

    worker.begin_step(StepMetadata(0, {"r": 0}))
    try:
        pending = worker.prepare_output(StepBatch(["r"], np.array(starts), np.array(qsl)),
                                        np.zeros((16, 4, 2), np.uint8))
        pending.enqueue_cpu_copy(counts[:1] or [1], counts[1:2] or [0])
        worker.process_output(pending)
    except R3Error:
        pass  # typed: what the contract demands of bad input
    finally:
        worker.close()


def test_bad_reader_arguments_raise_typed_errors(redis_url):
    from r3cache.errors import ContractError

    with pytest.raises(ContractError):
        R3Reader(redis_url)  # no namespace
    with pytest.raises(R3Error):
        open_store(redis_url, layout=None, namespace="test-does-not-exist")
