import json

import pytest

from r3cache.hashing import UNSET_SEED, block_hashes, none_hash
from tests.conftest import SHARED

VECTORS = SHARED / "testdata" / "vllm_block_hashes.json"


def _sha256_vectors():
    if not VECTORS.exists():
        return []
    vectors = json.loads(VECTORS.read_text())["vectors"]
    # Plain pickle + SHA-256 vectors whose extra keys are plain tuples; the
    # multimodal extra keys are covered with the read-back work.
    return [
        v for v in vectors
        if v["algo"] == "sha256" and v["case"] != "multimodal_two_images"
        and (v["seed_env"] == "0" or "v0.33.0" in v["vllm_code"])
    ]


def _extra(keys):
    if keys is None:
        return None
    return [None if b is None else tuple(tuple(x) if isinstance(x, list) else x for x in b)
            for b in keys]


@pytest.mark.skipif(not VECTORS.exists(), reason="shared/testdata is not beside this checkout")
@pytest.mark.parametrize("vector", _sha256_vectors(), ids=lambda v: v["id"])
def test_block_hashes_match_vllm(vector):
    seed = "0" if vector["seed_env"] == "0" else UNSET_SEED
    assert none_hash(seed).hex() == vector["none_hash_hex"]
    hashes = block_hashes(vector["token_ids"], vector["block_size"], seed=seed,
                          extra_keys_per_block=_extra(vector["extra_keys_per_block"]))
    assert [h.hex() for h in hashes] == vector["block_hashes_hex"]


def test_chain_can_be_extended_block_by_block():
    tokens = list(range(50))
    whole = block_hashes(tokens, 16)
    head = block_hashes(tokens[:16], 16)
    assert head + block_hashes(tokens[16:48], 16, parent=head[-1]) == whole
    assert len(whole) == 3  # the partial tail is not hashed
