"""Delivered: the rows a preempted request was given, kept for its manifest."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from r3cache.manifest import BlockRef, Segment


class Delivered:
    """Own the rows ``[start, end)`` a preempted request was given, as manifest segments,
    and the keys the worker keeps pinned for them until the request ends.

    A request recomputed after a preemption gets rows it was given before only from
    here: after a weight update and a prefix-cache reset (vLLM's ``pause_generation(mode=
    "keep")``), or on a device whose kernels are not batch-invariant, its recomputed rows
    differ from the ones it was given, and its manifest must name the ones it was given.
    Segments are block slices by key, or rows of their own (a tail buffer is reused).
    """

    __slots__ = ("start", "end", "segments", "held")

    def __init__(self, start: int, segments: list[Segment], held: list[str]) -> None:
        self.start = start
        self.segments = segments
        self.end = start + sum(map(_length, segments))
        self.held = held  # pinned for this record, released when the request ends

    def between(self, lo: int, hi: int) -> list[Segment]:
        """The segments of rows ``[lo, hi)``, cut to it."""
        out: list[Segment] = []
        at = self.start
        for segment in self.segments:
            n = _length(segment)
            a, b = max(lo, at) - at, min(hi, at + n) - at
            if a < b:
                if isinstance(segment, BlockRef):
                    out.append(BlockRef(segment.key, segment.start + a, segment.start + b))
                else:
                    out.append(segment[a:b])
            at += n
        return out

    def up_to(self, end: int) -> Delivered:
        """This record cut to end at ``end`` (where the request resumes), holding the same
        keys: a scheduler that dropped a step's output resumes the request before it."""
        if end >= self.end:
            return self
        return Delivered(self.start, self.between(self.start, end), self.held)


def without(keys: Iterable[str], kept: Iterable[str]) -> list[str]:
    """``keys`` less one occurrence of each of ``kept`` (pins are counted, not sets)."""
    left = Counter(kept)
    out = []
    for key in keys:
        if left[key]:
            left[key] -= 1
        else:
            out.append(key)
    return out


def _length(segment: Segment) -> int:
    return segment.stop - segment.start if isinstance(segment, BlockRef) else len(segment)
