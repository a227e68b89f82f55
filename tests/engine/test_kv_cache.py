"""Block accounting of the KV cache manager."""

from fulcrum.engine.kv_cache import KVCacheManager
from fulcrum.engine.request import Request
from fulcrum.sampling_params import SamplingParams
from fulcrum.utils.hashing import hash_block_tokens, hash_prefix_blocks


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def test_prefix_hit_shares_blocks_and_refcounts():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", range(10))
    assert kv.allocate_slots(a, 10)
    assert kv.num_free_blocks() == 7
    b = req("b", list(range(8)) + [99, 98, 97])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in blocks] == kv.block_table("a")[:2]
    assert kv.allocate_slots(b, 3, blocks)
    assert [x.ref_cnt for x in blocks] == [2, 2]
    kv.free(a)
    assert [x.ref_cnt for x in blocks] == [1, 1]
    kv.free(b)
    assert kv.num_free_blocks() == 10


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", range(8))
    kv.allocate_slots(a, 8)
    kv.free(a)
    again = req("a2", range(9))
    blocks, n = kv.get_computed_blocks(again)
    assert n == 8
    # filling the whole cache with other tokens evicts them
    other = req("o", range(100, 116))
    assert kv.allocate_slots(other, 16)
    kv.free(other)
    assert kv.get_computed_blocks(req("a3", range(9)))[1] == 0


def test_allocation_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", range(12))
    assert not kv.allocate_slots(a, 12)
    assert kv.num_free_blocks() == 2 and kv.block_table("a") == []


def test_block_hash_chains_the_prefix():
    h1 = hash_block_tokens(0, [1, 2, 3, 4])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(0, [5, 6, 7, 8])
    assert hash_prefix_blocks(list(range(1, 10)), 4) == [h1, hash_block_tokens(h1, [5, 6, 7, 8])]
