import lz4.block
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3cache import RoutingLayout
from r3cache.codec import (
    CODEC_LZ4,
    CODEC_RAW,
    LZ4_ACCELERATION,
    codec_for,
    decode_rows,
    encode_rows,
    read_header,
)
from r3cache.errors import CorruptBlockError, LayoutMismatchError
from r3cache.sim import oracle_rows

LAYOUT = RoutingLayout(48, 8, 128, 16)


def block(seed=0):
    return oracle_rows(np.random.default_rng(seed).integers(0, 1000, 16), LAYOUT)


def test_round_trip_is_exact_and_lz4_shrinks_routes():
    rows = np.tile(block(), (1, 1, 1))
    rows[:, :, :] = rows[0]  # repetitive rows compress
    data = encode_rows(rows, LAYOUT)
    header = read_header(data, "k")
    assert header.codec == CODEC_LZ4 and len(data) < rows.nbytes
    assert header.fingerprint == LAYOUT.fingerprint and header.raw_len == rows.nbytes
    np.testing.assert_array_equal(decode_rows(data, LAYOUT, "k"), rows)


def test_incompressible_rows_are_stored_raw():
    rows = np.random.default_rng(1).integers(0, 128, (16, 48, 8)).astype(np.uint8)
    data = encode_rows(rows, LAYOUT)
    assert read_header(data, "k").codec == CODEC_RAW
    np.testing.assert_array_equal(decode_rows(data, LAYOUT, "k"), rows)


def test_near_random_routes_still_fit_the_smaller_allocator_class():
    """Oracle routes (distinct experts per row, no structure) shrink a little under lz4 at
    acceleration 2: header and payload stay within 6 KiB, a raw block would not."""
    sizes = [len(encode_rows(block(seed), LAYOUT)) for seed in range(64)]
    assert all(read_header(encode_rows(block(s), LAYOUT), "k").codec == CODEC_LZ4
               for s in range(4))
    assert LAYOUT.block_nbytes == 6144 and max(sizes) <= 6144 - 16  # room for Redis's SDS


def test_lz4_runs_at_the_acceleration_it_names():
    """python-lz4 applies ``acceleration`` only in its fast mode: the payload must be the
    fast mode's, which on near-random routes is larger than the default effort's."""
    rows = block(5)
    data = encode_rows(rows, LAYOUT)
    payload = data[read_header(data, "k").payload_offset:]
    fast = lz4.block.compress(rows.tobytes(), mode="fast", acceleration=LZ4_ACCELERATION,
                              store_size=False)
    assert LZ4_ACCELERATION > 1 and payload == fast
    assert len(payload) > len(lz4.block.compress(rows.tobytes(), store_size=False))


def test_partial_blocks_and_wide_dtypes_round_trip():
    layout = RoutingLayout(2, 3, 70000, 16)
    rows = np.random.default_rng(2).integers(0, 70000, (5, 2, 3)).astype(np.int32)
    np.testing.assert_array_equal(decode_rows(encode_rows(rows, layout), layout, "k"), rows)


def test_encode_rejects_rows_of_another_layout():
    with pytest.raises(LayoutMismatchError):
        encode_rows(np.zeros((16, 48, 8), np.int64), LAYOUT)


@pytest.mark.parametrize(
    ("rows", "mangle", "reason"),
    [
        (block, lambda d: b"", "truncated"),
        (block, lambda d: d[:10], "truncated"),
        (block, lambda d: d[:-5], "does not decode"),
        (block, lambda d: b"hello world, this is not a block", "foreign value"),
        (block, lambda d: d[:4] + bytes([9]) + d[5:], "unsupported format version"),
        (block, lambda d: d[:5] + bytes([7]) + d[6:], "unknown codec"),
    ],
)
def test_foreign_or_truncated_bytes_raise_corrupt_block_error_naming_the_key(rows, mangle, reason):
    data = encode_rows(rows(), LAYOUT)
    with pytest.raises(CorruptBlockError) as info:
        decode_rows(mangle(data), LAYOUT, "r3:ns:{abc}:blk")
    assert info.value.key == "r3:ns:{abc}:blk"
    assert reason in str(info.value) and "r3:ns:{abc}:blk" in str(info.value)


def test_a_block_of_another_layout_is_rejected():
    other = RoutingLayout(48, 8, 64, 16)
    data = encode_rows(block() % 64, other)
    with pytest.raises(CorruptBlockError, match="does not match"):
        decode_rows(data, LAYOUT, "k")


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 10**6), data=st.data())
def test_every_single_bit_flip_is_detected(seed, data):
    rows = block(seed % 50)
    if seed % 2:
        rows = np.random.default_rng(seed).integers(0, 128, rows.shape).astype(np.uint8)
    encoded = bytearray(encode_rows(rows, LAYOUT))
    bit = data.draw(st.integers(0, len(encoded) * 8 - 1))
    encoded[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptBlockError):
        decode_rows(bytes(encoded), LAYOUT, "k")
    out = memoryview(bytearray(rows.nbytes))
    with pytest.raises(CorruptBlockError):
        codec_for(LAYOUT).decode_into(bytes(encoded), "k", out, 0)


def test_a_huge_length_in_the_header_is_rejected_before_decompressing():
    data = bytearray(encode_rows(block(), LAYOUT))
    at = 7 + len(LAYOUT.fingerprint)  # raw_len follows the fingerprint
    data[at : at + 4] = (0xFFFFFFFF).to_bytes(4, "little")
    with pytest.raises(CorruptBlockError, match="not at most one block"):
        decode_rows(bytes(data), LAYOUT, "k")


@pytest.mark.parametrize("compressible", [True, False])
def test_decode_into_fills_a_block_exactly(compressible):
    rows = block(3) if not compressible else np.repeat(block(3)[:1], 16, axis=0)
    out = np.zeros((2, *rows.shape), rows.dtype)
    codec_for(LAYOUT).decode_into(encode_rows(rows, LAYOUT), "k", memoryview(out).cast("B"),
                                  rows.nbytes)
    np.testing.assert_array_equal(out[1], rows)
    assert not out[0].any()
    with pytest.raises(CorruptBlockError, match="holds 5 rows"):
        codec_for(LAYOUT).decode_into(encode_rows(rows[:5], LAYOUT), "k",
                                      memoryview(out).cast("B"), 0)
