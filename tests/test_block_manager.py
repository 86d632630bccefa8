"""BlockManager: allocation, growth, prefix sharing, LRU eviction, failure atomicity, invariants."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from churon.engine.block_manager import BlockManager, hash_block
from churon.engine.sequence import Sequence


def check_invariants(bm: BlockManager, seqs) -> None:
    """Everything that must hold between operations; seqs: every sequence that may hold blocks."""
    refs = Counter(b for s in seqs for b in s.block_table)
    free, evictable = set(bm._free), set(bm._evictable)
    assert len(free) == len(bm._free) and not free & evictable
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id], f"block {block.block_id}"
        assert (block.ref_count == 0) == (block.block_id in free | evictable)
        if block.block_id in free:
            assert block.hash is None
        if block.block_id in evictable:
            assert bm.hash_to_block[block.hash] == block.block_id
    for h, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].hash == h  # a reused block's old hash no longer points to it
    owners: dict[int, tuple[Sequence, int]] = {}
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table)
        assert len(s.block_table) >= bm.num_blocks_for(s.num_computed_tokens)
        if not s.block_table:
            assert s.num_computed_tokens == 0
        for i, b in enumerate(s.block_table):
            if b in owners:  # shared: only through a hashed, full, computed block holding the same prefix
                other, j = owners[b]
                assert i == j and bm.blocks[b].hash is not None
                end = (i + 1) * bm.block_size
                assert s.num_computed_tokens >= end and other.num_computed_tokens >= end
                assert s.token_ids[:end] == other.token_ids[:end]
            owners[b] = (s, i)


def test_allocate_and_free():
    bm = BlockManager(10, block_size=4)
    seq = Sequence(range(10))
    assert bm.can_allocate(seq, 10)
    assert bm.allocate(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 7 and bm.num_used_blocks == 3 and bm.usage == pytest.approx(0.3)
    assert [bm.blocks[b].ref_count for b in range(4)] == [1, 1, 1, 0]
    check_invariants(bm, [seq])
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 10 and bm.usage == 0
    check_invariants(bm, [seq])


def test_block_table_grows_with_tokens():
    bm = BlockManager(10, block_size=4)
    seq = Sequence([1, 2, 3, 4])
    assert bm.allocate(seq, 4)
    bm.commit(seq, 4)
    assert len(seq.block_table) == 1
    for n in range(5, 14):  # decode: one token a step
        seq.append_token(n)
        assert bm.allocate(seq, 1)
        assert len(seq.block_table) == bm.num_blocks_for(n)
        bm.commit(seq, 1)
        check_invariants(bm, [seq])
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 6
    # full committed blocks are in the prefix cache, the partial last one is not
    assert all(bm.blocks[b].hash is not None for b in seq.block_table[:3])
    assert bm.blocks[seq.block_table[3]].hash is None


def test_hash_is_chained_and_stable():
    assert hash_block(None, [1, 2, 3]) == hash_block(None, (1, 2, 3))
    assert hash_block(None, [1, 2, 3]) != hash_block(hash_block(None, [0]), [1, 2, 3])
    # blake2b, not Python's hash(): the same value in every process and run
    assert hash_block(None, [1, 2, 3]) == 0xEB57CDA0323EEEE1
    assert hash_block(0xEB57CDA0323EEEE1, [4, 5, 6]) == 0xFD0BDB447906F58B
    assert 0 <= hash_block(None, [2**40, 5]) < 2**64


def test_prefix_sharing():
    bm = BlockManager(10, block_size=4)
    a = Sequence(list(range(10)))
    assert bm.allocate(a, 10)
    bm.commit(a, 10)
    assert (bm.num_hit_blocks, bm.num_miss_blocks) == (0, 2)
    b = Sequence(list(range(8)) + [100, 101, 102])
    assert bm.num_cached_prefix_tokens(b) == 8
    assert bm.can_allocate(b, 3)
    assert bm.allocate(b, 3)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[x].ref_count for x in b.block_table] == [2, 2, 1]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert (bm.num_hit_blocks, bm.num_miss_blocks) == (2, 2)
    assert (bm.num_hit_tokens, bm.num_query_tokens) == (8, 21)
    assert bm.num_used_blocks == 4
    check_invariants(bm, [a, b])
    # a prefix that differs inside the first block shares nothing
    c = Sequence([0, 1, 9, 3, 4, 5, 6, 7, 8])
    assert bm.num_cached_prefix_tokens(c) == 0
    # freeing one owner keeps the shared blocks for the other
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1]
    check_invariants(bm, [a, b])


def test_no_sharing_without_prefix_caching():
    bm = BlockManager(10, block_size=4, enable_prefix_caching=False)
    a, b = Sequence(range(9)), Sequence(range(9))
    assert bm.allocate(a, 9)
    bm.commit(a, 9)
    assert bm.num_cached_prefix_tokens(b) == 0
    assert bm.allocate(b, 9)
    assert not set(a.block_table) & set(b.block_table)
    assert not bm.hash_to_block
    check_invariants(bm, [a, b])


def test_full_hit_leaves_one_token_to_compute():
    bm = BlockManager(10, block_size=4)
    a = Sequence(range(8))  # exactly two full blocks
    assert bm.allocate(a, 8)
    bm.commit(a, 8)
    b = Sequence(range(8))  # all cached: the last block is recomputed into a fresh one
    assert bm.num_cached_prefix_tokens(b) == 4
    assert bm.allocate(b, 4)
    assert b.num_computed_tokens == 4 and b.num_uncomputed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    bm.commit(b, 4)  # b's copy of the second block duplicates a's: a's stays the cached one
    assert bm.hash_to_block[bm.blocks[b.block_table[1]].hash] == a.block_table[1]
    check_invariants(bm, [a, b])
    c = Sequence(range(9))  # one token past the cached blocks: both shared
    assert bm.num_cached_prefix_tokens(c) == 8
    assert bm.allocate(c, 1)
    assert c.block_table[:2] == a.block_table and c.num_uncomputed_tokens == 1
    check_invariants(bm, [a, b, c])
    # the duplicate is dropped from the cache when freed, the original stays
    dup = b.block_table[1]
    bm.free(b)
    assert bm.blocks[dup].hash is None and dup in bm._free
    check_invariants(bm, [a, b, c])
    one = Sequence([0])  # a one-token sequence can never hit
    assert bm.num_cached_prefix_tokens(one) == 0


def _cache_one_block(bm: BlockManager, tokens) -> tuple[Sequence, int]:
    seq = Sequence(tokens)
    assert bm.allocate(seq, len(tokens))
    bm.commit(seq, len(tokens))
    block = seq.block_table[0]
    bm.free(seq)
    return seq, block


def test_lru_eviction_order_and_rehit():
    bm = BlockManager(4, block_size=2)
    _, x = _cache_one_block(bm, [1, 2])
    _, y = _cache_one_block(bm, [3, 4])
    _, z = _cache_one_block(bm, [5, 6])
    assert list(bm._evictable) == [x, y, z] and bm.num_free_blocks == 4
    # re-hit x: it becomes the most recently used
    x2 = Sequence([1, 2, 7])
    assert bm.num_cached_prefix_tokens(x2) == 2
    assert bm.allocate(x2, 1)
    assert x2.block_table[0] == x
    bm.free(x2)
    assert list(bm._evictable) == [y, z, x]
    assert bm.num_cached_prefix_tokens(Sequence([3, 4, 0])) == 2
    # fresh blocks: never-cached ones first, then the least recently used cached block
    w = Sequence([9, 9, 9, 9])
    assert bm.allocate(w, 4)
    assert y in w.block_table and bm.num_evictions == 1
    assert bm.num_cached_prefix_tokens(Sequence([3, 4, 0])) == 0  # evicted: no hit
    assert hash_block(None, [3, 4]) not in bm.hash_to_block
    assert bm.num_cached_prefix_tokens(Sequence([5, 6, 0])) == 2
    assert bm.num_cached_prefix_tokens(Sequence([1, 2, 0])) == 2
    v = Sequence([8, 8])
    assert bm.allocate(v, 2)
    assert v.block_table == [z] and bm.num_evictions == 2
    assert bm.num_cached_prefix_tokens(Sequence([5, 6, 0])) == 0
    assert bm.num_cached_prefix_tokens(Sequence([1, 2, 0])) == 2
    check_invariants(bm, [w, v])


def test_a_sequence_tail_is_evicted_before_its_prefix():
    bm = BlockManager(4, block_size=2)
    seq = Sequence([1, 2, 3, 4, 5, 6, 7])  # three full blocks + one token
    assert bm.allocate(seq, 7)
    bm.commit(seq, 7)
    table = list(seq.block_table)
    bm.free(seq)
    assert list(bm._evictable) == [table[2], table[1], table[0]]
    other = Sequence([0, 0, 0])  # two fresh blocks: the never-cached one, then the tail block
    assert bm.allocate(other, 3)
    assert set(other.block_table) == {table[3], table[2]}
    assert bm.num_cached_prefix_tokens(Sequence([1, 2, 3, 4, 5, 6, 7])) == 4


def test_blocks_in_use_are_never_evicted():
    bm = BlockManager(3, block_size=2)
    a = Sequence([1, 2, 3])
    assert bm.allocate(a, 3)
    bm.commit(a, 3)
    b = Sequence([1, 2, 5, 6])  # shares a's first block
    assert bm.allocate(b, 2)
    assert b.block_table[0] == a.block_table[0]
    bm.free(a)  # block still used by b
    assert bm.num_free_blocks == 1
    c = Sequence([7, 8, 9])
    assert not bm.allocate(c, 3)  # needs 2, one free: the shared block is not evictable
    assert bm.allocate(c, 2)
    assert a.block_table == [] and b.block_table[0] not in c.block_table
    check_invariants(bm, [a, b, c])


def _snapshot(bm: BlockManager, seqs):
    return (
        [(b.ref_count, b.hash, b.token_ids) for b in bm.blocks],
        dict(bm.hash_to_block), list(bm._free), list(bm._evictable),
        (bm.num_hit_tokens, bm.num_query_tokens, bm.num_hit_blocks, bm.num_miss_blocks, bm.num_evictions),
        [(list(s.block_table), s.num_computed_tokens, s.num_cached_tokens) for s in seqs],
    )


def test_allocation_failure_changes_nothing():
    bm = BlockManager(4, block_size=4)
    a = Sequence(range(9))
    assert bm.allocate(a, 9)
    bm.commit(a, 9)
    bm.free(a)  # two cached blocks evictable, two never used
    holder = Sequence([50] * 5)
    assert bm.allocate(holder, 5)  # takes the two never-used blocks
    b = Sequence(list(range(8)) + list(range(100, 112)))  # hits 2 blocks, needs 3 more: only 0 free after hits
    assert bm.num_cached_prefix_tokens(b) == 8
    before = _snapshot(bm, [a, b, holder])
    assert not bm.can_allocate(b, 12)
    assert not bm.allocate(b, 12)
    assert _snapshot(bm, [a, b, holder]) == before
    # a running sequence that cannot grow is left as it was too
    assert not bm.allocate(holder, 20)
    assert _snapshot(bm, [a, b, holder]) == before
    assert not bm.allocate(b, 1)  # even one token past the hits needs a block, and none is left
    assert _snapshot(bm, [a, b, holder]) == before
    bm.free(holder)
    assert not bm.allocate(b, 12)  # 2 shared + 3 fresh: only 2 fresh
    assert bm.allocate(b, 4)
    assert b.num_cached_tokens == 8 and len(b.block_table) == 3
    check_invariants(bm, [a, b, holder])


def test_reset_prefix_cache():
    bm = BlockManager(4, block_size=2)
    a = Sequence([1, 2, 3])
    assert bm.allocate(a, 3)
    bm.commit(a, 3)
    assert not bm.reset_prefix_cache()  # a holds blocks
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert not bm.hash_to_block and bm.num_cached_prefix_tokens(Sequence([1, 2, 3])) == 0
    check_invariants(bm, [a])


def test_freeing_a_block_nobody_holds_is_an_error_that_changes_nothing():
    bm = BlockManager(4, block_size=4)
    a = Sequence(range(6))
    assert bm.allocate(a, 6)
    stray = Sequence(range(8))
    stray.block_tables = [[a.block_table[0], 3]]  # a's block, and one nobody allocated
    before = _snapshot(bm, [a])
    with pytest.raises(RuntimeError, match="block 3 freed more often than allocated"):
        bm.free(stray)
    assert _snapshot(bm, [a]) == before  # the error came before any count went down
    check_invariants(bm, [a])


def test_commit_beyond_the_allocated_tokens_is_an_error():
    bm = BlockManager(4, block_size=4)
    seq = Sequence(range(6))
    assert bm.allocate(seq, 5)  # two blocks for the first five tokens
    with pytest.raises(ValueError, match="cannot commit 7 more tokens"):
        bm.commit(seq, 7)  # more than the sequence has
    with pytest.raises(ValueError, match="cannot commit 0 more tokens"):
        bm.commit(seq, 0)
    bm.commit(seq, 5)
    assert seq.num_computed_tokens == 5
    with pytest.raises(ValueError, match="cannot commit 2 more tokens"):
        bm.commit(seq, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)
    with pytest.raises(ValueError, match="prompt token"):
        Sequence([])
    bm = BlockManager(4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate(Sequence([1]), -1)
    for windows in ((), (0, -8)):  # a window per KV group, each >= 0
        with pytest.raises(ValueError, match="windows must give each KV group a window"):
            BlockManager(4, windows=windows)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_operations_keep_invariants_and_contents(seed, prefix_caching):
    """Random allocate / compute / append / free with shared prefixes, against a fake K/V store.

    The fake store records, per slot, the token prefix whose K/V the runner wrote there; every
    computed token of every live sequence must be found in its own slot, and the runner never
    writes into a block another sequence shares.
    """
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    bm = BlockManager(rng.randint(6, 24), block_size=bs, enable_prefix_caching=prefix_caching)
    kv: dict[int, tuple] = {}  # slot -> token prefix written there
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    live: list[Sequence] = []
    everyone: list[Sequence] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.3 or not live:
            tokens = rng.choice(prefixes)[: rng.randint(1, 12)] + [rng.randrange(5) for _ in range(rng.randint(0, 6))]
            seq = Sequence(tokens or [0])
            cached = bm.num_cached_prefix_tokens(seq)
            n = rng.randint(1, seq.num_tokens - cached)
            expect = bm.can_allocate(seq, n)
            assert bm.allocate(seq, n) == expect
            everyone.append(seq)
            if expect:
                assert seq.num_computed_tokens == seq.num_cached_tokens == cached
                live.append(seq)
            else:
                assert seq.block_table == [] and seq.num_computed_tokens == 0
        elif op < 0.8:  # run a step: the allocated uncomputed tokens get computed
            seq = rng.choice(live)
            covered = min(len(seq.block_table) * bs, seq.num_tokens)
            n = covered - seq.num_computed_tokens
            if n == 0:
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.append_token(rng.randrange(5))
                k = rng.randint(1, seq.num_uncomputed_tokens)
                expect = bm.can_allocate(seq, k)
                assert bm.allocate(seq, k) == expect
                continue
            for t in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = seq.block_table[t // bs]
                assert bm.blocks[block].ref_count == 1, "writing into a shared block"
                assert bm.blocks[block].hash is None, "writing into a cached block"
                kv[block * bs + t % bs] = tuple(seq.token_ids[: t + 1])
            bm.commit(seq, n)
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        check_invariants(bm, everyone)
        for s in live:
            for t in range(s.num_computed_tokens):
                assert kv[s.block_table[t // bs] * bs + t % bs] == tuple(s.token_ids[: t + 1])
    if not prefix_caching:
        assert bm.num_hit_blocks == 0 and not bm.hash_to_block
