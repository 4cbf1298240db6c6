"""Block encoding: a self-describing header followed by an lz4 (or raw) payload.

Wire format, little-endian::

    magic    4 bytes  b"R3BK"
    version  u8       FORMAT_VERSION
    codec    u8       CODEC_RAW | CODEC_LZ4
    fp_len   u8       length of the layout fingerprint
    fp       fp_len   RoutingLayout.fingerprint, ASCII
    raw_len  u32      length of the uncompressed rows
    crc32    u32      zlib.crc32 over every header byte before it plus the raw rows
    payload  ...      lz4 block (no size prefix) or the raw rows

The checksum covers the header as well as the rows, so a flipped bit anywhere is
caught: in the payload by lz4 or the checksum, in the header by the checksum.
"""

from __future__ import annotations

import struct
import zlib

import lz4.block
import numpy as np

from r3cache.errors import CorruptBlockError
from r3cache.layout import RoutingLayout

MAGIC = b"R3BK"
FORMAT_VERSION = 1
CODEC_RAW = 0
CODEC_LZ4 = 1
_CODEC_NAMES = {CODEC_RAW: "raw", CODEC_LZ4: "lz4"}
_PREFIX = struct.Struct("<4sBBB")
_SIZES = struct.Struct("<II")


def encode_rows(rows: np.ndarray, layout: RoutingLayout) -> bytes:
    """Encode ``(n, num_layers, topk)`` rows; lz4 unless it would not shrink them."""
    layout.check_rows(rows)
    raw = np.ascontiguousarray(rows).tobytes()
    packed = lz4.block.compress(raw, store_size=False)
    codec, payload = (CODEC_LZ4, packed) if len(packed) < len(raw) else (CODEC_RAW, raw)
    fingerprint = layout.fingerprint.encode("ascii")
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, codec, len(fingerprint)) + fingerprint
    crc = zlib.crc32(raw, zlib.crc32(head + struct.pack("<I", len(raw))))
    return b"".join((head, _SIZES.pack(len(raw), crc), payload))


def decode_rows(data: bytes, layout: RoutingLayout, key: str) -> np.ndarray:
    """Decode bytes written by :func:`encode_rows`; raise CorruptBlockError naming ``key``."""
    header = read_header(data, key)
    if header.fingerprint != layout.fingerprint:
        raise CorruptBlockError(
            key, f"layout {header.fingerprint!r} does not match {layout.fingerprint!r}"
        )
    if header.raw_len > layout.block_nbytes or header.raw_len % layout.row_nbytes:
        # Checked before decompressing: a flipped length bit must not allocate gigabytes.
        raise CorruptBlockError(
            key, f"{header.raw_len} bytes is not at most one block of whole rows"
        )
    payload = memoryview(data)[header.payload_offset :]
    if header.codec == CODEC_LZ4:
        try:
            raw = lz4.block.decompress(payload, uncompressed_size=header.raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise CorruptBlockError(key, f"lz4 payload does not decode ({exc})") from None
    else:
        raw = bytes(payload)
    if len(raw) != header.raw_len:
        raise CorruptBlockError(
            key, f"payload holds {len(raw)} bytes, header says {header.raw_len}"
        )
    if zlib.crc32(raw, zlib.crc32(data[: header.payload_offset - 4])) != header.crc32:
        raise CorruptBlockError(key, "checksum mismatch")
    return np.frombuffer(raw, dtype=layout.dtype).reshape(-1, *layout.row_shape)


class BlockHeader:
    """Own the parsed header fields of one encoded block."""

    __slots__ = ("codec", "fingerprint", "raw_len", "crc32", "payload_offset")

    def __init__(self, codec: int, fingerprint: str, raw_len: int, crc32: int, offset: int):
        self.codec = codec
        self.fingerprint = fingerprint
        self.raw_len = raw_len
        self.crc32 = crc32
        self.payload_offset = offset

    @property
    def codec_name(self) -> str:
        return _CODEC_NAMES[self.codec]


def read_header(data: bytes, key: str) -> BlockHeader:
    """Parse and sanity-check an encoded block's header without touching the payload."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptBlockError(key, f"value is {type(data).__name__}, not bytes")
    if len(data) < _PREFIX.size:
        raise CorruptBlockError(key, f"truncated: {len(data)} bytes is shorter than a header")
    magic, version, codec, fp_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlockError(key, f"foreign value (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(key, f"unsupported format version {version}")
    if codec not in _CODEC_NAMES:
        raise CorruptBlockError(key, f"unknown codec id {codec}")
    sizes_at = _PREFIX.size + fp_len
    if len(data) < sizes_at + _SIZES.size:
        raise CorruptBlockError(key, f"truncated: {len(data)} bytes ends inside the header")
    try:
        fingerprint = bytes(data[_PREFIX.size : sizes_at]).decode("ascii")
    except UnicodeDecodeError:
        raise CorruptBlockError(key, "layout fingerprint is not ASCII") from None
    raw_len, crc = _SIZES.unpack_from(data, sizes_at)
    return BlockHeader(codec, fingerprint, raw_len, crc, sizes_at + _SIZES.size)
