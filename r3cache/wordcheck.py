"""The repeated-expert check for rows of exactly eight bytes, compiled with numba.

topk 8 in uint8, 4 in uint16 or 2 in int32 (Qwen3-MoE, DeepSeek-V3, GLM-4.5: topk 8 of at
most 256 experts) make one (token, layer) row one 64-bit word. Rotating the word by d lanes
and XOR-ing it with itself zeroes a lane exactly where two experts d lanes apart are the
same; rotations by 1 .. topk/2 lanes meet every pair. In compiled code that is a few
instructions a row with no branch: 0.33 ms for 8192 tokens x 48 layers of topk 8, where
numpy's column compares take 2-4 ms (``scripts/bench_idcheck.py``).

numba is imported with this module, which ``r3cache.layout`` loads on the first check of
such rows: about 0.4 s, and 0.45 s to compile the kernel, once per process (0.25 s to
load it from numba's cache on disk, where a later process finds it).
"""

from __future__ import annotations

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


@_jit
def _zero_lane(words, ones, high, s1, s2, s3, s4):  # pragma: no cover - compiled
    # A lane of y is zero iff (y - ones) & ~y has its high bit: exact for "any zero lane".
    found = np.uint64(0)
    w = np.uint64(64)
    for i in range(words.shape[0]):
        x = words[i]
        y = x ^ ((x >> s1) | (x << (w - s1)))
        found |= (y - ones) & ~y & high
        y = x ^ ((x >> s2) | (x << (w - s2)))
        found |= (y - ones) & ~y & high
        y = x ^ ((x >> s3) | (x << (w - s3)))
        found |= (y - ones) & ~y & high
        y = x ^ ((x >> s4) | (x << (w - s4)))
        found |= (y - ones) & ~y & high
    return found != np.uint64(0)


def _constants(lane_bits: int) -> tuple[np.uint64, ...]:
    lanes = 64 // lane_bits
    ones = sum(1 << (i * lane_bits) for i in range(lanes))
    shifts = [d * lane_bits for d in range(1, lanes // 2 + 1)]
    shifts = (shifts * _ROTATIONS)[:_ROTATIONS]
    return tuple(np.uint64(v) for v in (ones, ones << (lane_bits - 1), *shifts))


_CONSTANTS = {size: _constants(8 * size) for size in (1, 2, 4)}


def repeats_in_words(rows: np.ndarray) -> bool:
    """Whether any row of ``(..., topk)`` rows, ``topk * itemsize == 8``, lists an expert
    twice. IDs are compared as bit patterns, so the dtype's sign does not matter."""
    words = np.ascontiguousarray(rows).reshape(-1).view(np.uint64)
    return bool(_zero_lane(words, *_CONSTANTS[rows.itemsize]))
