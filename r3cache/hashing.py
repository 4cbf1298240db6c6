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
import numpy as np
import xxhash

from r3cache.checks import count
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
    """The hash of one block of ``token_ids`` after ``parent_hash``."""
    return hasher(algo)((parent_hash, tuple(token_id_array(token_ids).tolist()), extra_keys))


def token_id_array(token_ids: Any) -> np.ndarray:
    """``token_ids`` as a flat int64 array, or a ContractError: token ids are ints in
    ``0 .. 2**63 - 1``. Anything else would hash to a chain no engine wrote (a float, a
    bool) or, wrapped into int64, to another sequence's (an id past 2**63)."""
    try:
        array = np.asarray(token_ids)
    except (TypeError, ValueError, RuntimeError) as exc:  # a ragged list, a device tensor
        raise ContractError(f"token ids must be a flat sequence of ints on the host: {exc}"
                            ) from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ContractError(f"token ids must be a flat sequence of ints, not an array of "
                            f"{array.dtype} with shape {array.shape}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > np.iinfo(np.int64).max):
        raise ContractError(f"token ids must be in 0..{np.iinfo(np.int64).max}, got "
                            f"{int(array.min())}..{int(array.max())}")
    return array.astype(np.int64, copy=False)


def _check_chain(seed: str, extra_keys_per_block: Any, blocks: int) -> None:
    """Refuse a seed or extra keys that no engine hashes with: each would silently give a
    chain of keys that are stored nowhere. An empty sequence of extra keys is none."""
    if not isinstance(seed, str):
        raise ContractError(f"the hash seed must be a str (the engine's PYTHONHASHSEED), "
                            f"not {seed!r:.40}")
    if extra_keys_per_block is None:
        return
    if isinstance(extra_keys_per_block, (str, bytes)) or not isinstance(
            extra_keys_per_block, Sequence) or 0 < len(extra_keys_per_block) < blocks:
        raise ContractError(f"extra_keys_per_block must be a sequence of one tuple or None "
                            f"per full block ({blocks}), not {extra_keys_per_block!r:.80}")
    bad = next((e for e in extra_keys_per_block[:blocks]
                if e is not None and not isinstance(e, tuple)), None)
    if bad is not None:
        raise ContractError(f"a block's extra keys are a tuple or None, not {bad!r:.80}")


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
    ``token_ids``), so a caller can extend a request's hashes as tokens arrive. Every
    argument is checked first (ContractError).
    """
    digest = hasher(algo)
    # Python ints, as the engine hashes them: one conversion for the sequence.
    ids = token_id_array(token_ids).tolist()
    blocks = len(ids) // count(block_size, "block_size", 1)
    _check_chain(seed, extra_keys_per_block, blocks)
    if parent is not None and not isinstance(parent, bytes):
        raise ContractError(f"parent must be a block hash (bytes), not {parent!r:.40}")
    current = digest(seed) if parent is None else parent
    hashes: list[bytes] = []
    try:
        for index in range(blocks):
            extra = extra_keys_per_block[index] if extra_keys_per_block else None
            current = digest((current, tuple(ids[index * block_size : (index + 1) * block_size]),
                              extra))
            hashes.append(current)
    except (pickle.PicklingError, cbor2.CBOREncodeError, TypeError, AttributeError) as exc:
        raise ContractError(f"extra keys the {algo} hash cannot serialise: {exc}") from None
    return hashes
