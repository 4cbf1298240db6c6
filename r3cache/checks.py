"""Checks of the plain arguments of public entry points: counts, indices, expert IDs,
bounded waits and store URL options."""

from __future__ import annotations

import math
import operator
import os
from urllib.parse import parse_qsl

import numpy as np

from r3cache.errors import ContractError, R3Error


def is_int(value: object) -> bool:
    """Whether ``value`` is an int (a numpy integer too), and not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def count(value: object, name: str, minimum: int = 0,
          error: type[R3Error] = ContractError) -> int:
    """``value`` as an int of at least ``minimum``, or ``error``: a float would be
    truncated, a bool taken for 0 or 1."""
    if not is_int(value):
        raise error(f"{name} must be an int, not {value!r:.40}")
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, not {value}")
    return int(value)


def id_range_problem(rows: np.ndarray, max_id: int) -> str | None:
    """Why ``rows`` cannot be read as expert IDs in ``0 .. max_id``, or None: a float would
    be truncated, and a wider int wrapped, into another expert."""
    if not rows.size:
        return None
    if rows.dtype.kind not in "iu":
        return f"hold {rows.dtype}, not integer expert IDs"
    low, high = int(rows.min()), int(rows.max())
    if low < 0 or high > max_id:
        return f"hold expert IDs {low}..{high}, outside 0..{max_id}"
    return None


def layer_indices(layers: object, num_layers: int, of: str) -> list[int]:
    """``layers`` as ints that index ``num_layers`` layers (negative from the end), or a
    ContractError naming those out of range (``of``: whose layers they are)."""
    try:
        given = list(layers)
        picked = [operator.index(x) for x in given]
    except TypeError:
        raise ContractError(f"layers must be a sequence of ints, not {layers!r:.80}") from None
    if any(isinstance(x, bool) for x in given):
        # numpy reads a list of bools as a mask, operator.index as the layers 1 and 0.
        raise ContractError("layers are indices, not a mask of bools: "
                            "np.flatnonzero(mask) gives a mask's indices")
    bad = [x for x in picked if not -num_layers <= x < num_layers]
    if bad:
        raise ContractError(f"layers {bad} outside {of} {num_layers} layers")
    return picked


def byte_size(value: object) -> int:
    """A number of bytes as a URL's query gives it: ``1073741824`` or ``1e9`` (truncated);
    ValueError for anything else, infinity and NaN too, so the caller names the option."""
    if isinstance(value, bool):  # True would be one byte
        raise ValueError("a bool is no size")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("a size is finite")
    return int(number)


def physical_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def fits_memory(nbytes: int, name: str) -> None:
    """A ContractError where ``nbytes`` exceeds this machine's physical memory: an
    in-process bound that large is never reached (the process runs out of memory first),
    and what is mapped and counted for it up front fails at once."""
    total = physical_memory()
    if total is not None and nbytes > total:
        raise ContractError(f"{name}={nbytes} exceeds this machine's memory ({total} bytes)")


_FLAGS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def flag(value: object, name: str) -> bool:
    """``value`` as a bool: a bool, or 1/0, true/false, yes/no, on/off in any case, as an
    environment variable or a URL query spells it; a ContractError for anything else, so
    a typo (``flase``) is not taken for true."""
    if isinstance(value, bool):
        return value
    try:
        return _FLAGS[str(value).strip().lower()]
    except KeyError:
        raise ContractError(f"{name} is a flag (1/0, true/false, yes/no, on/off), not "
                            f"{value!r:.40}") from None


# The longest wait or TTL an option may ask for (31 years): Python's waits overflow past
# threading.TIMEOUT_MAX (292 years), Redis's TTLs in milliseconds soon after.
MAX_SECONDS = 1e9


def seconds(value: object, name: str) -> float:
    """``value`` as a finite number of seconds >= 0, or a ContractError: every wait is
    bounded, and infinity or NaN would make one unbounded."""
    if not (is_int(value) or isinstance(value, (float, np.floating))) or not (
            0 <= value <= MAX_SECONDS):
        raise ContractError(f"{name} must be a finite number of seconds >= 0, at most "
                            f"{MAX_SECONDS:g}, not {value!r:.40}")
    return float(value)


def url_options(query: str) -> dict[str, str]:
    """A store URL's query as options, each given once and with a value, or a
    ContractError: parse_qsl alone drops ``owner=`` and a bare ``owner`` and keeps the last
    of two, so a mistyped URL would open a store other than the one its user meant. No
    value is echoed: the query may hold a password."""
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in options:
            raise ContractError(f"store URL option {name!r} is given twice")
        if not value:
            raise ContractError(f"store URL option {name!r} has no value")
        options[name] = value
    return options
