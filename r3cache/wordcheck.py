"""The expert-ID checks for rows of exactly eight bytes, compiled with numba.

topk 8 in uint8, 4 in uint16 or 2 in int32 (Qwen3-MoE, DeepSeek-V3, GLM-4.5: topk 8 of at
most 256 experts) make one (token, layer) row one 64-bit word, and one pass over the
words checks both what no router picks: an ID outside the expert range (a subtraction
per lane that borrows from no other lane), and an expert named twice (rotating the word
by d lanes and XOR-ing it with itself zeroes a lane exactly where two experts d lanes
apart are the same; rotations by 1 .. topk/2 lanes meet every pair). In compiled code
that is a few vector instructions a row with no branch: 0.17 ms for 8192 tokens x 48
layers of topk 8, where numpy takes 2.6 ms (``scripts/bench_idcheck.py``).

numba is imported with this module, which ``r3cache.layout`` loads on the first check of
such rows: about 0.2 s, and about 0.15 s to compile a kernel (one per lane width and
expert count), once per process; about 0.05 s to load it from numba's cache on disk,
where a later process finds it.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

# The kernel takes four shifts: topk / 2 for topk 8; narrower words repeat one, which
# changes nothing.
_ROTATIONS = 4


def _jit(function):
    try:
        return numba.njit(nogil=True, cache=True)(function)
    except RuntimeError:  # no writable cache directory (a read-only install): per process
        return numba.njit(nogil=True)(function)


def _constants(size: int, num_experts: int) -> tuple[np.uint64, ...]:
    lane_bits = 8 * size
    lanes = 64 // lane_bits
    ones = sum(1 << (i * lane_bits) for i in range(lanes))
    high = ones << (lane_bits - 1)
    shifts = [d * lane_bits for d in range(1, lanes // 2 + 1)]
    shifts = (shifts * _ROTATIONS)[:_ROTATIONS]
    half = 1 << (lane_bits - 1)
    if num_experts <= half:
        floor, above = num_experts * ones, (1 << 64) - 1
    else:  # IDs with the high bit set can be valid: compare the low bits against the rest
        floor, above = (num_experts - half) * ones, 0
    return tuple(np.uint64(v) for v in (ones, high, *shifts, floor, above))


@functools.lru_cache(maxsize=16)
def _kernel(size: int, num_experts: int):
    """The check compiled for one lane width and expert count, every constant folded in:
    with its shift counts known, each rotation of the vectorised loop is one instruction
    (0.43-0.73x the time of one kernel taking the constants as arguments, by lane width).
    numba's disk cache keys each by its constants."""
    ones, high, s1, s2, s3, s4, floor, above = _constants(size, num_experts)
    r1, r2, r3, r4 = (np.uint64(64 - int(s)) for s in (s1, s2, s3, s4))
    zero = np.uint64(0)

    @_jit
    def lane_problems(words):  # pragma: no cover
        # Range: (x | high) - floor borrows from no lane (floor's lanes are at most
        # high), and sets a lane's high bit iff its low bits reach floor's. With floor =
        # num_experts (above all ones) a lane is out of range when that bit or its own
        # high bit is set; with floor = num_experts - high (above zero), when both are.
        outside = zero
        # Repeats: a lane of y is zero iff (y - ones) & ~y has its high bit: exact for
        # "any zero lane".
        found = zero
        for i in range(words.shape[0]):
            x = words[i]
            t = (x | high) - floor
            outside |= (t & (x | above)) | (x & above)
            y = x ^ ((x >> s1) | (x << r1))
            found |= (y - ones) & ~y
            y = x ^ ((x >> s2) | (x << r2))
            found |= (y - ones) & ~y
            y = x ^ ((x >> s3) | (x << r3))
            found |= (y - ones) & ~y
            y = x ^ ((x >> s4) | (x << r4))
            found |= (y - ones) & ~y
        return (outside & high) != zero, (found & high) != zero

    return lane_problems


def problems_in_words(rows: np.ndarray, num_experts: int) -> tuple[bool, bool]:
    """Whether rows of ``(..., topk)``, ``topk * itemsize == 8``, hold an ID outside
    ``0 .. num_experts - 1`` (a negative int32 is one), and whether one lists an expert
    twice; one pass over the rows for both. IDs compare as bit patterns."""
    words = np.ascontiguousarray(rows).reshape(-1).view(np.uint64)
    outside, repeats = _kernel(rows.itemsize, num_experts)(words)
    return bool(outside), bool(repeats)


def repeats_in_words(rows: np.ndarray) -> bool:
    """Whether any row of ``(..., topk)`` rows, ``topk * itemsize == 8``, lists an expert
    twice, whatever the IDs."""
    return problems_in_words(rows, 1 << (8 * rows.itemsize))[1]
