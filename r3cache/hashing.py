"""KV-compatible block hashes computed from token IDs, as vLLM's prefix cache does.

Block ``i`` of a token sequence is hashed from the tuple
``(parent_hash, tuple(block_token_ids), extra_keys)`` where ``parent_hash`` is the
raw digest of block ``i - 1`` (``NONE_HASH`` for block 0) and ``extra_keys`` is
``None`` or a tuple (LoRA name, cache salt, multimodal feature identifiers). The tuple
is serialised and hashed by one of vLLM's algorithms:

``sha256``        pickle protocol 5, SHA-256 (32-byte digest)
``sha256_cbor``   canonical CBOR, SHA-256
``xxhash``        pickle protocol 5, XXH3-128 (16-byte big-endian digest)
``xxhash_cbor``   canonical CBOR, XXH3-128

``NONE_HASH`` is the algorithm's hash of the seed string (vLLM takes PYTHONHASHSEED,
or ``"vllm-none-hash"`` for the SHA-256 algorithms when it is unset). Tags repeated in
extra keys must be the same string object, as vLLM's constants are: pickle writes the
second occurrence as a back-reference.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash

from r3cache.errors import ContractError

DEFAULT_SEED = "0"
UNSET_SEED = "vllm-none-hash"


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


ALGORITHMS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda obj: _sha256(_pickle(obj)),
    "sha256_cbor": lambda obj: _sha256(_cbor(obj)),
    "xxhash": lambda obj: _xxh3_128(_pickle(obj)),
    "xxhash_cbor": lambda obj: _xxh3_128(_cbor(obj)),
}


def hasher(algo: str) -> Callable[[Any], bytes]:
    try:
        return ALGORITHMS[algo]
    except KeyError:
        raise ContractError(f"unknown block hash algorithm {algo!r}; one of "
                            f"{', '.join(ALGORITHMS)}") from None


def hasher_name(algo: str) -> str:
    """``algo`` if it names a known algorithm, else a typed error."""
    hasher(algo)
    return algo


def none_hash(seed: str = DEFAULT_SEED, algo: str = "sha256") -> bytes:
    """The parent hash of a sequence's first block."""
    return hasher(algo)(seed)


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int],
                      extra_keys: tuple | None = None, algo: str = "sha256") -> bytes:
    return hasher(algo)((parent_hash, tuple(int(t) for t in token_ids), extra_keys))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256",
    seed: str = DEFAULT_SEED,
    extra_keys_per_block: Sequence[tuple | None] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Hash chain over the full blocks of ``token_ids`` (a partial tail is not hashed).

    ``parent`` continues an existing chain (the last hash of the blocks before
    ``token_ids``), so a caller can extend a request's hashes as tokens arrive.
    """
    digest = hasher(algo)
    current = digest(seed) if parent is None else parent
    # Python ints, as the engine hashes them: one conversion for the sequence (an
    # array's tolist) rather than one int() per token.
    ids = token_ids.tolist() if hasattr(token_ids, "tolist") else [int(t) for t in token_ids]
    hashes: list[bytes] = []
    for index in range(len(ids) // block_size):
        extra = extra_keys_per_block[index] if extra_keys_per_block else None
        current = digest((current, tuple(ids[index * block_size : (index + 1) * block_size]),
                          extra))
        hashes.append(current)
    return hashes
