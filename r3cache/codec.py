"""Block encoding: a self-describing header followed by an lz4 (or raw) payload.

Wire format, little-endian::

    magic    4 bytes  b"R3BK"
    version  u8       FORMAT_VERSION
    codec    u8       CODEC_RAW | CODEC_LZ4
    fp_len   u8       length of the layout fingerprint
    fp       fp_len   RoutingLayout.fingerprint, ASCII
    raw_len  u32      length of the uncompressed rows
    checksum u64      XXH3-64 of the raw rows, seeded with XXH3-64 of every header byte before it
    payload  ...      lz4 block (no size prefix) or the raw rows

The checksum covers the header as well as the rows, so a flipped bit anywhere is
caught: in the payload by lz4 or the checksum, in the header by the checksum.
XXH3 rather than CRC32: ten times faster on a 6 KiB block, on every read and write.

lz4 runs in its fast mode at acceleration 2 (python-lz4 ignores ``acceleration`` unless
``mode="fast"``): routes of a well-balanced router are near-random bytes, on which lz4's
default effort finds many short matches that shrink a 6 KiB block by ~9 % but compress
in ~16 µs and decode in ~3.5 µs on this project's machine. Acceleration 2 keeps a ~5 %
saving — enough to keep a block with its header inside the 6 KiB allocator size class
instead of the 7 KiB one, the saving that counts in Redis — and compresses in ~10 µs,
decodes in ~2.5 µs. Higher accelerations push some blocks over 6 KiB (1.8 % at 4).
A block lz4 cannot shrink is stored raw.
A namespace may choose ``raw`` for every block: 16 % more memory, faster read-back.
"""

from __future__ import annotations

import functools
import struct

import lz4.block
import numpy as np
import xxhash

from r3cache.errors import CorruptBlockError
from r3cache.layout import RoutingLayout

MAGIC = b"R3BK"
FORMAT_VERSION = 1
CODEC_RAW = 0
CODEC_LZ4 = 1
_CODEC_NAMES = {CODEC_RAW: "raw", CODEC_LZ4: "lz4"}
LZ4_ACCELERATION = 2
_PREFIX = struct.Struct("<4sBBB")
_SIZES = struct.Struct("<IQ")
_RAW_LEN = struct.Struct("<I")
_CHECKSUM = struct.Struct("<Q")
_hash = xxhash.xxh3_64_intdigest
_compress = lz4.block.compress
_decompress = lz4.block.decompress


CODECS = ("lz4", "raw")  # what a namespace may choose for its blocks


@functools.lru_cache(maxsize=64)
def codec_for(layout: RoutingLayout, name: str = "lz4") -> BlockCodec:
    return BlockCodec(layout, compress=name == "lz4")


def encode_rows(rows: np.ndarray, layout: RoutingLayout) -> bytes:
    """Encode ``(n, num_layers, topk)`` rows; lz4 unless it would not shrink them."""
    return codec_for(layout).encode(rows)


def rows_digest(rows: np.ndarray) -> str:
    """A short hex digest of rows' bytes: names one writer's version of a block."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(rows).data)


def decode_rows(data: bytes, layout: RoutingLayout, key: str) -> np.ndarray:
    """Decode bytes written by :func:`encode_rows`; raise CorruptBlockError naming ``key``."""
    return codec_for(layout).decode(data, key)


class BlockCodec:
    """Own one layout's precomputed header bytes, so encoding and decoding do little else."""

    def __init__(self, layout: RoutingLayout, *, compress: bool = True) -> None:
        self.layout = layout
        self.compress = compress  # False: every block raw (reads skip decompression)
        fingerprint = layout.fingerprint.encode("ascii")
        self._heads = {
            codec: _PREFIX.pack(MAGIC, FORMAT_VERSION, codec, len(fingerprint)) + fingerprint
            for codec in _CODEC_NAMES
        }
        self._offset = _PREFIX.size + len(fingerprint) + _SIZES.size
        full = _RAW_LEN.pack(layout.block_nbytes)
        # A whole block's header up to its checksum, and the checksum seed it gives.
        self._full = {codec: head + full for codec, head in self._heads.items()}
        self._full_seed = {codec: _hash(head) for codec, head in self._full.items()}
        self._full_lz4, self._full_raw = self._full[CODEC_LZ4], self._full[CODEC_RAW]
        self._block_nbytes = layout.block_nbytes

    def encode(self, rows: np.ndarray) -> bytes:
        self.layout.check_rows(rows)
        raw = np.ascontiguousarray(rows).tobytes()
        codec, payload = CODEC_RAW, raw
        if self.compress:
            packed = _compress(raw, mode="fast", acceleration=LZ4_ACCELERATION, store_size=False)
            if len(packed) < len(raw):
                codec, payload = CODEC_LZ4, packed
        head = self._heads[codec] + _RAW_LEN.pack(len(raw))
        return b"".join((head, _CHECKSUM.pack(_hash(raw, _hash(head))), payload))

    def decode(self, data: bytes, key: str) -> np.ndarray:
        """Rows of any block or partial block; every header field is checked."""
        layout = self.layout
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
        raw = self._payload(data, header.payload_offset, header.codec, header.raw_len, key)
        seed = _hash(data[: header.payload_offset - _CHECKSUM.size])
        if _hash(raw, seed) != header.checksum:
            raise CorruptBlockError(key, "checksum mismatch")
        return np.frombuffer(raw, dtype=layout.dtype).reshape(-1, *layout.row_shape)

    def decode_into(self, data: bytes, key: str, out: memoryview, offset: int) -> None:
        """Decode one whole block into the bytes ``out[offset:offset + block_nbytes]``.

        The common case (a whole, intact block of this layout) is one decompress, one
        checksum and one copy, with no other Python work: it runs once per block read.
        Anything else goes through ``decode``, which names the precise fault.
        """
        size = self._block_nbytes
        payload_at = self._offset
        if data.startswith(self._full_lz4):
            try:
                raw = _decompress(memoryview(data)[payload_at:], uncompressed_size=size)
            except lz4.block.LZ4BlockError:
                raw = b""
            seed = self._full_seed[CODEC_LZ4]
        elif data.startswith(self._full_raw):
            raw = memoryview(data)[payload_at:]
            seed = self._full_seed[CODEC_RAW]
        else:
            raw = b""
            seed = 0
        if len(raw) == size and _hash(raw, seed) == _CHECKSUM.unpack_from(
                data, payload_at - _CHECKSUM.size)[0]:
            out[offset : offset + size] = raw
            return
        # Not an intact whole block: decode names the fault, or it is an intact partial one.
        rows = self.decode(data, key)
        raise CorruptBlockError(key, f"holds {len(rows)} rows, a block has "
                                f"{self.layout.block_size}")

    @staticmethod
    def _payload(data: bytes, offset: int, codec: int, raw_len: int, key: str) -> bytes:
        payload = memoryview(data)[offset:]
        if codec == CODEC_LZ4:
            try:
                raw = lz4.block.decompress(payload, uncompressed_size=raw_len)
            except lz4.block.LZ4BlockError as exc:
                raise CorruptBlockError(key, f"lz4 payload does not decode ({exc})") from None
        else:
            raw = bytes(payload)
        if len(raw) != raw_len:
            raise CorruptBlockError(key, f"payload holds {len(raw)} bytes, header says {raw_len}")
        return raw


class BlockHeader:
    """Own the parsed header fields of one encoded block."""

    __slots__ = ("codec", "fingerprint", "raw_len", "checksum", "payload_offset")

    def __init__(self, codec: int, fingerprint: str, raw_len: int, checksum: int, offset: int):
        self.codec = codec
        self.fingerprint = fingerprint
        self.raw_len = raw_len
        self.checksum = checksum
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
    raw_len, checksum = _SIZES.unpack_from(data, sizes_at)
    return BlockHeader(codec, fingerprint, raw_len, checksum, sizes_at + _SIZES.size)
