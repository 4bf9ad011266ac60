import pytest

from hybridpd.engine.kv_cache.hashing import RequestBlockHashes, hash_block


@pytest.mark.parametrize("a, b, equal", [
    ((None, (1, 2, 3), None), (None, (1, 2, 3), None), True),
    ((None, (1, 2, 3), None), (None, (1, 2, 4), None), False),
    ((None, (1, 2, 3), None), (None, (1, 2, 3), b"s"), False),
    ((None, (1, 2, 3), b"s"), (None, (1, 2, 3), b"t"), False),
    ((None, (1, 2, 3), b""), (None, (1, 2, 3), None), False),
    ((None, (1, 2), None), (None, (1, 2, 0), None), False),
    ((None, (256,), None), (None, (1, 0), None), False),
])
def test_hash_block_distinguishes_inputs(a, b, equal):
    assert (hash_block(*a) == hash_block(*b)) is equal


def test_parent_enters_the_hash():
    root = hash_block(None, (1, 2))
    other = hash_block(None, (9, 9))
    assert hash_block(root, (3, 4)) != hash_block(other, (3, 4))
    assert hash_block(root, (3, 4)) != hash_block(None, (3, 4))


@pytest.mark.parametrize("block_size, tokens, expected_len", [
    (4, list(range(10)), 2),
    (1, list(range(3)), 3),
    (16, list(range(15)), 0),
    (5, list(range(20)), 4),
])
def test_chain_covers_full_blocks_only(block_size, tokens, expected_len):
    chain = RequestBlockHashes(None).chain(block_size, tokens)
    assert len(chain) == expected_len
    parent = None
    for k, h in enumerate(chain):
        parent = hash_block(parent, tokens[k * block_size:(k + 1) * block_size])
        assert h == parent


def test_chain_extends_without_rehashing_and_salt_only_in_first_block():
    store = RequestBlockHashes(b"salt")
    first = store.chain(2, [1, 2, 3, 4])
    kept = list(first)
    longer = store.chain(2, [1, 2, 3, 4, 5, 6, 7])
    assert longer[:2] == kept and len(longer) == 3
    assert longer[0] == hash_block(None, [1, 2], b"salt")
    assert longer[1] == hash_block(longer[0], [3, 4])
    assert RequestBlockHashes(None).chain(2, [1, 2])[0] != longer[0]
