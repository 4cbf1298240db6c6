import json
import sys

import numpy as np
import pytest

from r3cache.errors import ContractError
from r3cache.hashing import UNSET_SEED, block_hashes, none_hash
from tests.conftest import SHARED

VECTORS = SHARED / "testdata" / "vllm_block_hashes.json"


def _vectors():
    """Every vector whose NONE_HASH is deterministic (the file lists only those)."""
    if not VECTORS.exists():
        return []
    return json.loads(VECTORS.read_text())["vectors"]


def _extra(keys):
    """JSON lists back to vLLM's tuples; tags are interned, as vLLM's constants are one
    object (pickle then writes a repeated tag as a back-reference)."""
    if keys is None:
        return None

    def convert(x):
        if isinstance(x, list):
            return tuple(convert(y) for y in x)
        return sys.intern(x) if isinstance(x, str) else x

    return [None if b is None else convert(b) for b in keys]


@pytest.mark.skipif(not VECTORS.exists(), reason="shared/testdata is not beside this checkout")
@pytest.mark.parametrize("vector", _vectors(), ids=lambda v: v["id"])
def test_block_hashes_match_vllm(vector):
    seed = "0" if vector["seed_env"] == "0" else UNSET_SEED
    algo = vector["algo"]
    assert none_hash(seed, algo).hex() == vector["none_hash_hex"]
    hashes = block_hashes(vector["token_ids"], vector["block_size"], algo=algo, seed=seed,
                          extra_keys_per_block=_extra(vector["extra_keys_per_block"]))
    assert [h.hex() for h in hashes] == vector["block_hashes_hex"]


def test_an_unknown_algorithm_is_a_typed_error():
    with pytest.raises(ContractError, match="sha256_cbor"):
        block_hashes([1, 2], 2, algo="md5")


def test_chain_can_be_extended_block_by_block():
    tokens = list(range(50))
    whole = block_hashes(tokens, 16)
    head = block_hashes(tokens[:16], 16)
    assert head + block_hashes(tokens[16:48], 16, parent=head[-1]) == whole
    assert len(whole) == 3  # the partial tail is not hashed


@pytest.mark.parametrize("tokens", [
    [1.0, 2.0], [True, False], [-1, 2], [2**63, 1], [2**70, 1], [[1, 2]], "12", None,
    np.array([2**63], np.uint64),  # int64 would wrap it to another sequence's -2**63
], ids=repr)
def test_token_ids_that_no_engine_hashes_are_refused(tokens):
    with pytest.raises(ContractError, match="token ids"):
        block_hashes(tokens, 2)


def test_a_seed_or_extra_keys_no_engine_hashes_with_are_refused():
    tokens = list(range(4))
    assert block_hashes(np.array(tokens, np.int32), 2) == block_hashes(tokens, 2)
    assert block_hashes(tokens, 2, extra_keys_per_block=[]) == block_hashes(tokens, 2)
    for kwargs in ({"seed": 0}, {"extra_keys_per_block": [None]},
                   {"extra_keys_per_block": ["lora", None]},
                   {"extra_keys_per_block": [(lambda: 0,), None]},
                   {"parent": "00"}, {"block_size": 0}, {"block_size": "2"}):
        with pytest.raises(ContractError):
            block_hashes(tokens, **{"block_size": 2, **kwargs})
    with pytest.raises(ContractError):
        block_hashes(tokens, 2, algo="sha256_cbor", extra_keys_per_block=[(object(),), None])
