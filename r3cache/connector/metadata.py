"""The messages between scheduler, model runner and worker connector."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from r3cache.errors import InvalidBatchError
from r3cache.manifest import Completion
from r3cache.store.base import MAX_KEY_LENGTH, is_key

BlockHash = bytes | str | int
# Hashes are keyed as hex: a digest of more bytes than this would make a key no store takes
# (the Redis writer would refuse it after the step, and stop for good).
MAX_HASH_BYTES = MAX_KEY_LENGTH // 2


def _check_hash_size(size: int) -> None:
    if not 0 < size <= MAX_HASH_BYTES:
        raise InvalidBatchError(f"a block hash is 1-{MAX_HASH_BYTES} bytes, not {size}")


def block_key(block_hash: BlockHash) -> str:
    """The store key of a KV block hash: lowercase hex of its digest."""
    if isinstance(block_hash, (bytes, bytearray)):
        _check_hash_size(len(block_hash))
        return block_hash.hex()
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return format(block_hash & ((1 << 128) - 1), "032x")
    if is_key(block_hash):  # a str hash is used as given
        return block_hash
    raise InvalidBatchError(
        f"block hash {block_hash!r} ({type(block_hash).__name__}) is not bytes, an int or "
        "1-256 printable ASCII characters without spaces, braces or '~'"
    )


class PackedHashes(NamedTuple):
    """Block hashes of ``item_size`` bytes each, concatenated (vLLM ships them so): one
    hex conversion for all of a request's new hashes instead of one per hash."""

    data: bytes
    item_size: int


def block_keys(hashes: Sequence[BlockHash] | PackedHashes) -> list[str]:
    """The store keys of one request's block hashes, in order."""
    if hashes.__class__ is not PackedHashes:  # vLLM's packed hashes: no ABC check a step
        if isinstance(hashes, (str, bytes, bytearray)) or not isinstance(hashes, Sequence):
            # A str or bytes would be keyed character by character: blocks under keys
            # that other blocks share. PackedHashes is a tuple: it passes this test.
            raise InvalidBatchError(f"a request's block hashes are a sequence of hashes or "
                                    f"PackedHashes, not {type(hashes).__name__}")
        if not isinstance(hashes, PackedHashes):
            return [block_key(h) for h in hashes]
    data, size = hashes
    if size < 1 or len(data) % size:
        raise InvalidBatchError(f"packed block hashes: {len(data)} bytes are not a whole "
                                f"number of {size}-byte hashes")
    _check_hash_size(size)
    if data.__class__ is not bytes:
        data = bytes(data)
    if len(data) == size:
        return [data.hex()]  # a decode step's usual case: one new block
    # One C call splits them: hex with a separator between hashes.
    return data.hex(" ", size).split(" ") if data else []


def generation_suffix(generation: int) -> str:
    """What the keys of a prefix-cache generation's blocks end with: nothing in generation 0,
    ``.g<n>`` after the engine's n-th prefix-cache reset.

    A reset follows a weight update: the same tokens then hash to the same blocks but
    route to other experts, so each generation's blocks are keys of their own (as vLLM's
    connector scopes its keys by generation). Otherwise the rows stored under a key in an
    earlier generation would be served for the hits of a later one.
    """
    return f".g{generation}" if generation else ""


def keys_by_request(block_hashes: Mapping[str, Sequence[BlockHash] | PackedHashes],
                    generation: int = 0) -> dict[str, list[str]]:
    """Each request's new block keys (block_keys) in ``generation``. Requests that bring
    the same packed hashes in one step (the samples of one prompt, scheduled together)
    share one list, converted once: it is only read."""
    out: dict[str, list[str]] = {}
    seen: dict[PackedHashes, list[str]] = {}
    suffix = generation_suffix(generation)
    for req_id, hashes in block_hashes.items():
        if hashes.__class__ is PackedHashes and hashes.data.__class__ is bytes:
            keys = seen.get(hashes)
            if keys is None:
                keys = block_keys(hashes)
                if suffix:
                    keys = _in_generation(keys, suffix)
                seen[hashes] = keys
        else:
            keys = block_keys(hashes)
            if suffix:
                keys = _in_generation(keys, suffix)
        out[req_id] = keys
    return out


def _in_generation(keys: list[str], suffix: str) -> list[str]:
    if not keys:
        return keys
    keys = [key + suffix for key in keys]
    if max(map(len, keys)) > MAX_KEY_LENGTH:
        raise InvalidBatchError(f"block hash {max(keys, key=len)[: -len(suffix)]!r:.80} is "
                                f"too long to key a block of prefix-cache generation "
                                f"{suffix[2:]}: a key is at most {MAX_KEY_LENGTH} characters")
    return keys


@dataclass(frozen=True)
class StepMetadata:
    """One scheduler step's request registrations, new block hashes and finished requests.

    ``requests`` maps a request that (re)starts on the worker to its emit start:
    the first token position whose routed experts it is still owed.
    ``block_hashes`` holds only hashes not sent before, in block order (a sequence, or
    ``PackedHashes``).
    ``finished_requests`` are torn down (finished, aborted or preempted); those also
    in ``completions`` finished for good, and their routes become a manifest, recorded
    under the request id or its ``record_as`` entry. Those in ``preempted`` will resume:
    the rows they were given stay theirs (their manifest names them, not the rows a
    recomputation yields) until they end, running again or not.
    In a step that starts a new ``generation``, ``finished_requests`` are the generation
    before's (a request may also register again in it, in the new generation).
    """

    generation: int = 0
    requests: Mapping[str, int] = field(default_factory=dict)
    block_hashes: Mapping[str, Sequence[BlockHash] | PackedHashes] = field(default_factory=dict)
    finished_requests: Collection[str] = ()
    completions: Mapping[str, Completion] = field(default_factory=dict)
    # The id a completion's manifest is recorded under where it is not the engine's own
    # (vLLM's engine core knows a request by an internal id, its caller by another).
    record_as: Mapping[str, str] = field(default_factory=dict)
    preempted: Collection[str] = ()

    def is_empty(self) -> bool:
        return not (self.requests or self.block_hashes or self.finished_requests)


@dataclass
class StepBatch:
    """The model runner's view of one executed step, in batch order.

    Request ``i`` ran ``query_start_loc[i + 1] - query_start_loc[i]`` tokens starting
    at position ``num_computed_tokens[i]``; its rows sit at those row offsets of the
    step's routed-experts array. Rows past ``query_start_loc[len(req_ids)]`` are
    padding and are ignored.
    """

    req_ids: Sequence[str]
    num_computed_tokens: np.ndarray
    query_start_loc: np.ndarray


class RequestOutput(NamedTuple):
    """Routed experts a request is owed from one step: rows for positions from token_start."""

    token_start: int
    rows: np.ndarray

    @property
    def token_end(self) -> int:
        return self.token_start + len(self.rows)
