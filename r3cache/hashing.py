"""KV-compatible block hashes computed from token IDs, as vLLM's prefix cache does.

Block ``i`` of a token sequence is hashed from the tuple
``(parent_hash, tuple(block_token_ids), extra_keys)`` where ``parent_hash`` is the
raw digest of block ``i - 1`` (``NONE_HASH`` for block 0) and ``extra_keys`` is
``None`` or a tuple.  The tuple is serialised with pickle protocol 5 and hashed
with SHA-256 (vLLM's ``sha256`` algorithm).  ``NONE_HASH`` is the hash of the
seed string (``PYTHONHASHSEED``; vLLM uses ``"vllm-none-hash"`` when unset).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

DEFAULT_SEED = "0"
UNSET_SEED = "vllm-none-hash"


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 over ``pickle.dumps(obj, protocol=5)``."""
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    """The parent hash of a sequence's first block."""
    return sha256_pickle(seed)


def hash_block_tokens(
    parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    return sha256_pickle((parent_hash, tuple(int(t) for t in token_ids), extra_keys))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: str = DEFAULT_SEED,
    extra_keys_per_block: Sequence[tuple | None] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Hash chain over the full blocks of ``token_ids`` (a partial tail is not hashed).

    ``parent`` continues an existing chain (the last hash of the blocks before
    ``token_ids``), so a caller can extend a request's hashes as tokens arrive.
    """
    current = none_hash(seed) if parent is None else parent
    hashes: list[bytes] = []
    for index in range(len(token_ids) // block_size):
        extra = extra_keys_per_block[index] if extra_keys_per_block else None
        current = hash_block_tokens(
            current, token_ids[index * block_size : (index + 1) * block_size], extra
        )
        hashes.append(current)
    return hashes
