"""RoutingLayout: the shape and dtype of one token's routed experts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from r3cache.checks import is_int
from r3cache.errors import LayoutError, LayoutMismatchError

_FINGERPRINT_VERSION = "r3l1"
# Up to this many ID comparisons (IDs x topk), one topk x topk compare of the columns
# beats topk - 1 calls; a decode step's few rows cost the calls, not the bytes.
_FEW_COMPARES = 1 << 18
_MAX_EXPERTS = 1 << 31  # int32, the widest storage dtype, holds IDs up to 2**31 - 1


def narrowest_dtype(num_experts: int) -> np.dtype:
    """The narrowest storage dtype that holds expert IDs ``0 .. num_experts - 1``."""
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


@dataclass(frozen=True)
class RoutingLayout:
    """Own the per-token row shape ``(num_layers, topk)``, expert range and block size.

    Its derived sizes and fingerprint are computed once (frozen: they cannot change), as
    a step reads them many times.
    """

    num_layers: int
    topk: int
    num_experts: int
    block_size: int = 16
    dtype: np.dtype = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "topk", "num_experts", "block_size"):
            value = getattr(self, name)
            if not is_int(value):
                raise LayoutError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise LayoutError(f"{name} must be positive, got {value}")
            object.__setattr__(self, name, int(value))
        if self.num_experts > _MAX_EXPERTS:
            raise LayoutError(f"num_experts must be at most {_MAX_EXPERTS}, got "
                              f"{self.num_experts}")
        if self.topk > self.num_experts:
            raise LayoutError(
                f"topk ({self.topk}) cannot exceed num_experts ({self.num_experts})"
            )
        object.__setattr__(self, "dtype", narrowest_dtype(self.num_experts))

    @cached_property
    def row_shape(self) -> tuple[int, int]:
        return (self.num_layers, self.topk)

    @cached_property
    def row_nbytes(self) -> int:
        return self.num_layers * self.topk * self.dtype.itemsize

    @cached_property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_layers, self.topk)

    @cached_property
    def block_nbytes(self) -> int:
        return self.block_size * self.row_nbytes

    @cached_property
    def fingerprint(self) -> str:
        """A stable string naming everything a stored block's bytes depend on."""
        return (
            f"{_FINGERPRINT_VERSION}:L{self.num_layers}:K{self.topk}:E{self.num_experts}"
            f":B{self.block_size}:{self.dtype.str}"
        )

    @classmethod
    def from_fingerprint(cls, fingerprint: str) -> RoutingLayout:
        try:
            version, layers, topk, experts, block, _dtype = fingerprint.split(":")
            if version != _FINGERPRINT_VERSION:
                raise ValueError(version)
            layout = cls(int(layers[1:]), int(topk[1:]), int(experts[1:]), int(block[1:]))
        except (ValueError, IndexError, AttributeError) as exc:
            raise LayoutMismatchError(f"not a layout fingerprint: {fingerprint!r:.80}") from exc
        if layout.fingerprint != fingerprint:  # a dtype this layout does not store in
            raise LayoutMismatchError(f"fingerprint {fingerprint!r:.80} is not this version's "
                                      f"for its sizes ({layout.fingerprint})")
        return layout

    def empty_rows(self, num_tokens: int = 0) -> np.ndarray:
        if not is_int(num_tokens) or num_tokens < 0:
            raise LayoutError(f"num_tokens must be an int >= 0, not {num_tokens!r:.40}")
        return np.empty((num_tokens, *self.row_shape), dtype=self.dtype)

    def check_rows(self, rows: np.ndarray, what: str = "rows") -> None:
        """Raise LayoutMismatchError unless ``rows`` is ``(n, num_layers, topk)`` in our dtype."""
        if not isinstance(rows, np.ndarray):
            raise LayoutMismatchError(f"{what} must be a numpy array, got {type(rows).__name__}")
        if rows.ndim != 3 or rows.shape[1:] != self.row_shape:
            raise LayoutMismatchError(
                f"{what} have shape {rows.shape}, expected (n, {self.num_layers}, {self.topk})"
            )
        if rows.dtype != self.dtype:
            raise LayoutMismatchError(f"{what} have dtype {rows.dtype}, expected {self.dtype}")

    def id_problem(self, rows: np.ndarray) -> str | None:
        """Why ``rows`` (in this layout's dtype) are not valid routes, or None.

        An expert ID outside ``0 .. num_experts - 1``, or one (token, layer) naming the
        same expert twice: no router picks either, so the rows would replay wrongly.
        """
        if not len(rows):
            return None
        if rows.shape[-1] * rows.itemsize == 8:
            from r3cache.wordcheck import problems_in_words  # numba, loaded on first use

            outside, repeats = problems_in_words(rows, self.num_experts)  # one pass
        else:
            outside = ids_outside(rows, self.num_experts)
            repeats = not outside and repeats_by_columns(rows)
        if outside:
            return f"expert IDs outside 0..{self.num_experts - 1}"
        if repeats:
            return "a row names the same expert twice"
        return None

    def prepare_checks(self) -> None:
        """Load the compiled kernels of id_problem and repeats_an_expert now rather than
        in an engine's first step (numba's import, and each kernel's compile or cache
        load, once per process)."""
        row = np.arange(self.topk, dtype=self.dtype).reshape(1, 1, self.topk)
        self.id_problem(row)
        repeats_an_expert(row)

    def check_blocks(self, blocks: Mapping[str, np.ndarray]) -> None:
        """check_block for every block of a put, named by its key in an error."""
        shape, dtype = self.block_shape, self.dtype
        for key, rows in blocks.items():
            # The usual case in three compares; anything else gets the full check.
            if rows.__class__ is not np.ndarray or rows.shape != shape or rows.dtype != dtype:
                self.check_block(rows, f"block {key!r}")

    def check_block(self, rows: np.ndarray, what: str = "block") -> None:
        """Raise LayoutMismatchError unless ``rows`` is one whole block of this layout."""
        self.check_rows(rows, what)
        if len(rows) != self.block_size:
            raise LayoutMismatchError(
                f"{what} has {len(rows)} rows, a block has {self.block_size}")


def ids_outside(rows: np.ndarray, num_experts: int) -> bool:
    """Whether any ID of ``rows`` is outside ``0 .. num_experts - 1``, in numpy."""
    # Storage dtypes other than int32 are unsigned: no ID can be negative. ufunc
    # reductions directly: a decode step checks a few rows, where each call's own
    # overhead is the cost.
    return (int(np.maximum.reduce(rows, axis=None)) >= num_experts
            or (rows.dtype.kind == "i" and int(np.minimum.reduce(rows, axis=None)) < 0))


def repeats_an_expert(rows: np.ndarray) -> bool:
    """Whether any (token, layer) of ``(n, layers, topk)`` rows lists an expert twice.

    Rows of eight bytes go to the compiled kernel of ``r3cache.wordcheck`` (which holds
    no GIL), the others to numpy's column compares.
    """
    if rows.shape[-1] * rows.itemsize == 8:
        from r3cache.wordcheck import repeats_in_words  # numba, loaded on first use

        return repeats_in_words(rows)
    return repeats_by_columns(rows)


def repeats_by_columns(rows: np.ndarray) -> bool:
    """repeats_an_expert on the topk columns (about 15 times faster than sorting each
    row): for a few rows (a decode step) one topk x topk compare of all columns, else
    column ``i`` against every later column, topk - 1 calls. Few calls matter as much as
    few bytes: the reader runs this on a helper thread, and each call takes the GIL back
    from the thread that is reading the next blocks.
    """
    topk = rows.shape[-1]
    columns = np.ascontiguousarray(rows.reshape(-1, topk).T)
    if rows.size * topk <= _FEW_COMPARES:
        # Every column against every column: equal on the diagonal only, unless an
        # expert repeats (each repeat adds two more).
        return int(np.count_nonzero(columns[:, None] == columns[None, :])) != columns.size
    return any(bool((columns[i + 1 :] == columns[i]).any()) for i in range(topk - 1))
