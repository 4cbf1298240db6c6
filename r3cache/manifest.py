"""Manifest: the durable record of one finished request's routes, by reference to its blocks.

A manifest covers positions ``[prompt_start, num_tokens - 1)`` as an ordered list of
segments: a stored block (whole, or a slice of it) referenced by key, or rows held
inline (a partial tail, or a block that never got a hash). Inline rows are encoded
with the block codec, and a checksum over the request id and every field catches any
other change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import xxhash

from r3cache import codec
from r3cache.checks import is_int
from r3cache.errors import ContractError, CorruptBlockError, LayoutMismatchError
from r3cache.layout import RoutingLayout

FORMAT = "1"
_MAX_REQUEST_ID = 1024


def check_request_id(request_id: object) -> str:
    """``request_id`` if it can name a manifest (a non-empty str that UTF-8 can encode)."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= _MAX_REQUEST_ID:
        raise ContractError(f"a request id must be a str of 1-{_MAX_REQUEST_ID} characters, "
                            f"not {request_id!r:.80}")
    try:
        request_id.encode()
    except UnicodeEncodeError:
        raise ContractError(f"request id {request_id!r:.80} cannot be encoded as UTF-8 (a lone "
                            "surrogate?)") from None
    return request_id


def check_request_ids(request_ids: object) -> list[str]:
    """``request_ids`` as a list of ids that can name manifests. One str is refused, not
    taken as its characters: releasing ``"12"`` would release requests ``1`` and ``2``."""
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
        one = "one " if isinstance(request_ids, (str, bytes)) else ""
        raise ContractError(f"a sequence of request ids is wanted, not {one}"
                            f"{type(request_ids).__name__} ({request_ids!r:.80})")
    return [check_request_id(r) for r in request_ids]


class Completion(NamedTuple):
    """A finished request whose routes become a manifest: where they start, how many tokens."""

    prompt_start: int
    num_tokens: int

    @property
    def num_rows(self) -> int:
        return max(self.num_tokens - 1 - self.prompt_start, 0)


def is_completion(value: object) -> bool:
    """Whether ``value`` is two counts: a prompt start and a number of tokens."""
    if value.__class__ is Completion:  # the engine's own: two plain ints, no call each
        start, num_tokens = value
        if start.__class__ is int and num_tokens.__class__ is int:
            return start >= 0 and num_tokens >= 0
    return isinstance(value, tuple) and len(value) == 2 and all(
        is_int(n) and n >= 0 for n in value)


class BlockRef(NamedTuple):
    """Rows ``start:stop`` of the stored block ``key``."""

    key: str
    start: int
    stop: int


Segment = BlockRef | np.ndarray


class BlockSpan(Sequence):
    """Own a manifest's segments as an engine makes them: partial parts at either end and
    the keys of the whole blocks between.

    A request of 2048 tokens names 128 whole blocks; their BlockRefs are made only when
    the segments are read (by the writer, the encoder, a reader), not on the engine's
    step, and the span pickles as keys, not as 128 tuples.
    """

    __slots__ = ("head", "keys", "tail", "block_size")

    def __init__(self, head: list[Segment], keys: list[str], tail: list[Segment],
                 block_size: int) -> None:
        self.head, self.keys, self.tail, self.block_size = head, keys, tail, block_size

    def __len__(self) -> int:
        return len(self.head) + len(self.keys) + len(self.tail)

    def __iter__(self) -> Iterator[Segment]:
        yield from self.head
        bs = self.block_size
        for key in self.keys:
            yield BlockRef(key, 0, bs)
        yield from self.tail

    def __getitem__(self, index):
        return list(self)[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(
            _same_segment(a, b) for a, b in zip(self, other))

    def __reduce__(self):
        return _span, (_packed(self.head), self.keys, _packed(self.tail), self.block_size)

    @property
    def block_keys(self) -> list[str]:
        return [*_keys_of(self.head), *self.keys, *_keys_of(self.tail)]


def _checked_rows(parts: Sequence[Segment], layout: RoutingLayout,
                  where: Callable[[], str]) -> int:
    """How many rows ``parts`` name, each a slice of one block or rows of this layout
    (``where`` names the manifest in an error)."""
    rows = 0
    for part in parts:
        if isinstance(part, BlockRef):
            key, start, stop = part
            if not isinstance(key, str) or not 0 <= start < stop <= layout.block_size:
                raise ContractError(f"{where()}: {part!r:.120} is not a slice of one block")
            rows += stop - start
            continue
        try:
            layout.check_rows(part, "inline rows")
        except LayoutMismatchError as exc:  # the manifest named only in a refusal
            raise LayoutMismatchError(f"{where()}: {exc}") from None
        rows += len(part)
    return rows


def _keys_of(parts: list[Segment]) -> list[str]:
    return [s.key for s in parts if isinstance(s, BlockRef)]


def _frozen(segment: Segment) -> Segment:
    if isinstance(segment, BlockRef):
        return segment
    rows = np.array(segment)
    rows.flags.writeable = False
    return rows


def _same_segment(a: Segment, b: Segment) -> bool:
    if isinstance(a, BlockRef) or isinstance(b, BlockRef):
        return a == b
    return np.array_equal(a, b)


class _Inline:
    """Marks inline rows in pickled segments (no segment a caller makes holds it)."""


def _packed(segments: Sequence[Segment]) -> list:
    """Segments to pickle, inline rows as a plain (_Inline, bytes, dtype, shape) tuple:
    several times faster to pickle and load than an ndarray (a put that finishes requests
    is pickled on the engine's thread for the writer process)."""
    return [(_Inline, s.tobytes(), s.dtype.str, s.shape) if s.__class__ is np.ndarray else s
            for s in segments]


def _unpacked(segments: list) -> list:
    """Segments as _packed made them, inline rows read-only arrays again: a manifest's
    rows are never written (own_copy freezes them too)."""
    return [np.frombuffer(s[1], s[2]).reshape(s[3])
            if s.__class__ is tuple and s and s[0] is _Inline else s for s in segments]


def _span(head: list, keys: list[str], tail: list, block_size: int) -> BlockSpan:
    """A BlockSpan unpickled."""
    return BlockSpan(_unpacked(head), keys, _unpacked(tail), block_size)


def _manifest(request_id: str, fingerprint: str, completion: tuple[int, int],
              segments: BlockSpan | list, expires_at: float) -> Manifest:
    """A Manifest unpickled."""
    if not isinstance(segments, BlockSpan):
        segments = _unpacked(segments)
    return Manifest(request_id, fingerprint, Completion(*completion), segments, expires_at)


@dataclass
class Manifest:
    """Own one request's route record: its layout, extent and segments in order."""

    request_id: str
    fingerprint: str
    completion: Completion
    segments: Sequence[Segment] = field(default_factory=list)  # a list or a BlockSpan
    expires_at: float = 0.0

    @property
    def block_keys(self) -> list[str]:
        if isinstance(self.segments, BlockSpan):
            return self.segments.block_keys
        return _keys_of(self.segments)

    def check(self, layout: RoutingLayout) -> None:
        """Refuse, before a store changes anything, a manifest no reader could use: a bad
        request id, another layout, a completion that is not two counts, or segments that
        are not block slices and rows of this layout covering exactly the completion's."""
        check_request_id(self.request_id)
        where = self._where  # the messages are built only for a manifest refused
        if self.fingerprint != layout.fingerprint:
            raise LayoutMismatchError(f"{where()} is for layout {self.fingerprint!r:.80}, "
                                      f"the store's is {layout.fingerprint}")
        completion = self.completion
        if not is_completion(completion):
            raise ContractError(f"{where()}: completion {completion!r:.80} is not two counts "
                                "(prompt start, number of tokens)")
        segments = self.segments
        if isinstance(segments, BlockSpan):
            if segments.block_size != layout.block_size:
                raise LayoutMismatchError(f"{where()}: blocks of {segments.block_size} rows, "
                                          f"the layout's have {layout.block_size}")
            try:
                "".join(segments.keys)  # one C pass that takes nothing but str
            except TypeError:
                raise ContractError(f"{where()}: block keys must be str") from None
            rows = (_checked_rows(segments.head, layout, where)
                    + _checked_rows(segments.tail, layout, where)
                    + len(segments.keys) * layout.block_size)
        else:
            rows = _checked_rows(segments, layout, where)
        if completion.__class__ is not Completion:
            completion = Completion(*completion)
        expected = completion.num_rows
        if rows != expected:
            raise ContractError(f"{where()}: segments hold {rows} rows, the request has "
                                f"{expected}")

    def _where(self) -> str:
        return f"manifest of request {self.request_id!r}"

    def __reduce__(self):
        segments = self.segments  # a BlockSpan packs its own
        return _manifest, (self.request_id, self.fingerprint, tuple(self.completion),
                           segments if isinstance(segments, BlockSpan) else _packed(segments),
                           self.expires_at)

    def own_copy(self) -> Manifest:
        """This record with inline rows of its own, read-only: what a store keeps and what
        it hands out (the caller's arrays and the copy share nothing)."""
        segments = self.segments
        if isinstance(segments, BlockSpan):
            segments = BlockSpan([*map(_frozen, segments.head)], list(segments.keys),
                                 [*map(_frozen, segments.tail)], segments.block_size)
        else:
            segments = [*map(_frozen, segments)]
        return Manifest(self.request_id, self.fingerprint, self.completion, segments,
                        self.expires_at)

    def to_fields(self, layout: RoutingLayout) -> dict[str, bytes | str]:
        """The Redis hash fields of this manifest (readable with ``HGETALL``)."""
        fields: dict[str, bytes | str] = {
            "format": FORMAT,
            "layout": self.fingerprint,
            "prompt_start": str(self.completion.prompt_start),
            "num_tokens": str(self.completion.num_tokens),
            "expires_at": f"{self.expires_at:.3f}",
        }
        segments = self.segments
        if isinstance(segments, BlockSpan):
            # The whole blocks named by string concatenation, no BlockRef made for each
            # (a writer records every finished request's hundreds of blocks).
            whole = f":0:{segments.block_size}"
            after = len(segments.head) + len(segments.keys)
            names = [*_segment_names(segments.head, 0, fields, layout),
                     *[key + whole for key in segments.keys],
                     *_segment_names(segments.tail, after, fields, layout)]
        else:
            names = _segment_names(segments, 0, fields, layout)
        fields["segments"] = " ".join(names)
        fields["checksum"] = _checksum(self.request_id, fields)
        return fields

    @classmethod
    def from_fields(cls, request_id: str, fields: dict[bytes, bytes],
                    layout: RoutingLayout) -> Manifest:
        """Parse HGETALL output; a malformed or tampered manifest raises CorruptBlockError."""
        where = f"manifest of request {request_id!r}"
        try:
            text = {k.decode(): v for k, v in fields.items()}
            if text.pop("checksum", b"").decode() != _checksum(request_id, text):
                raise CorruptBlockError(where, "checksum mismatch (a field was changed)")
            if text["format"].decode() != FORMAT:
                raise ValueError(f"format {text['format']!r}")
            fingerprint = text["layout"].decode()
            completion = Completion(int(text["prompt_start"]), int(text["num_tokens"]))
            segments = _parse_segments(text, layout, where)
            expires_at = float(text["expires_at"])
        except CorruptBlockError:
            raise
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise CorruptBlockError(where, f"malformed field ({exc})") from None
        if fingerprint != layout.fingerprint:
            raise LayoutMismatchError(
                f"{where} was written for layout {fingerprint}, not {layout.fingerprint}")
        manifest = cls(request_id, fingerprint, completion, segments, expires_at)
        manifest.check_extent(layout)
        return manifest

    def check_extent(self, layout: RoutingLayout) -> None:
        """Segments must cover exactly the rows the completion names."""
        bs = layout.block_size
        rows = 0
        for segment in self.segments:
            if segment.__class__ is BlockRef:
                start, stop = segment[1], segment[2]
                if not 0 <= start < stop <= bs:
                    raise CorruptBlockError(f"manifest of request {self.request_id!r}",
                                            f"block slice {start}:{stop}")
                rows += stop - start
            else:
                rows += len(segment)
        if rows != self.completion.num_rows:
            raise CorruptBlockError(
                f"manifest of request {self.request_id!r}",
                f"segments hold {rows} rows, the request has {self.completion.num_rows}")


def _segment_names(parts: Sequence[Segment], first: int, fields: dict,
                   layout: RoutingLayout) -> list[str]:
    """The ``segments`` field's names of ``parts``, the first at place ``first``; each
    inline part's encoded rows go into ``fields`` under its place."""
    names = []
    for i, segment in enumerate(parts, first):
        if isinstance(segment, BlockRef):
            names.append(f"{segment.key}:{segment.start}:{segment.stop}")
        else:
            names.append(f"#{i}")
            fields[f"inline:{i}"] = codec.encode_rows(segment, layout)
    return names


def _parse_segments(text: dict, layout: RoutingLayout, where: str) -> list[Segment]:
    """The ``segments`` field's references and inline rows, in order.

    Most names are whole blocks (``key:0:block_size``); those skip the general split,
    which matters at 512 segments a request on every trainer read.
    """
    whole = f":0:{layout.block_size}"
    cut = -len(whole)
    bs = layout.block_size
    segments: list[Segment] = []
    append = segments.append
    for name in text["segments"].decode().split():
        if name.endswith(whole):
            append(BlockRef(name[:cut], 0, bs))
        elif name.startswith("#"):
            key = f"{where}, inline segment {name[1:]}"
            append(codec.decode_rows(text[f"inline:{name[1:]}"], layout, key))
        else:
            key, start, stop = name.rsplit(":", 2)
            append(BlockRef(key, int(start), int(stop)))
    return segments


def _checksum(request_id: str, fields: dict) -> str:
    """XXH3-64 over the request id and every field, in name order."""
    digest = xxhash.xxh3_64(request_id.encode())
    for name in sorted(fields):
        value = fields[name]
        for part in (name.encode(), value if isinstance(value, bytes) else value.encode()):
            digest.update(len(part).to_bytes(4, "little"))
            digest.update(part)
    return digest.hexdigest()
