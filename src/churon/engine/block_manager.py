"""KV-cache block bookkeeping: which block holds which tokens, who uses it, what can be shared.

The runner owns the K/V tensors, [num_blocks, block_size, kv_heads, head_dim] per layer;
this module only hands out block ids. A sequence's block_table lists its blocks in token
order: token t lives in block block_table[t // block_size] at offset t % block_size
(slot = block_id * block_size + offset).

Prefix caching. Once a block is full and its K/V are written (commit), it is named by a
chained hash: hash(parent block's hash, the block's token ids). The hash therefore names
the whole prefix up to the block's end, and a hash -> block map lets a new sequence with
the same leading tokens share those blocks instead of recomputing them. Blocks are
reference-counted; a block whose count drops to zero keeps its hash and contents and
stays findable until a fresh block is needed and it is evicted, least recently used first.
A sequence under a LoRA adapter starts its chain from its hash_seed instead of None: the same
tokens under another adapter (or scale) have other K/V, and so other hashes.

Hashes are 64-bit blake2b digests over the parent hash and the token ids (little-endian
int64), so they are the same in every process and run. A hit also compares the block's
stored token ids with the sequence's, so only a 64-bit collision between two different
prefixes ending in the same block of tokens could share wrong K/V (odds about 2**-64).

Block life cycle:

    free (no hash) --allocate--> in use (private) --commit, full--> in use (cached, hashed)
    in use, count -> 0: cached -> evictable (LRU queue), private -> free
    evictable --prefix hit--> in use again;  evictable --fresh block needed--> evicted -> in use
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from churon.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: "list[int] | tuple[int, ...]") -> int:
    """Stable 64-bit hash of one full block, chained to the hash of the block before it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" * 8 if parent_hash is None else parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and committed
    token_ids: tuple[int, ...] = ()  # the block's tokens, kept with the hash to rule out collisions


class BlockManager:
    """Reference-counted KV blocks with prefix caching and LRU eviction.

    Sequences in the WAITING state hold no blocks; a sequence's first allocation (empty
    block table) first takes the longest chain of cached full blocks matching its tokens.
    After each step the scheduler commits the tokens each sequence computed; free(seq) when
    a sequence finishes, is aborted or preempted.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}  # full-block hash -> the block holding it
        # free blocks without a hash; popped from the end, so block 0 goes first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # free blocks that keep a hash, least recently used first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._num_committed: dict[int, int] = {}  # seq_id -> leading blocks registered by commit
        # prefix-cache counters, counted once per first allocation
        self.num_query_tokens = 0  # tokens of the sequences looked up
        self.num_hit_tokens = 0  # of those, taken from the cache
        self.num_hit_blocks = 0
        self.num_miss_blocks = 0  # full blocks looked up and not found
        self.num_evictions = 0

    # -- state -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used, or cached but used by no sequence."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (0..1)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits over looked-up tokens since start (0 when nothing was looked up)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation --------------------------------------------------------------------

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many leading tokens seq's next allocate() would take from the prefix cache.

        Nonzero only for a sequence without blocks. Always leaves at least one token to
        compute (the model must produce logits), so a cached last block is not used when
        the whole sequence is cached: only full blocks inside the first num_tokens - 1
        tokens count.
        """
        return len(self._prefix_hits(seq)) * self.block_size

    def num_shared_prefix_tokens(self, seq: Sequence, other: Sequence) -> int:
        """Leading tokens of seq, in full blocks it could take from the cache (the same rule as
        num_cached_prefix_tokens), that are other's tokens too: what seq would find cached once other
        has computed them. 0 without prefix caching or when seq asks for prompt logprobs."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0
        n = min((seq.num_tokens - 1) // self.block_size, other.num_tokens // self.block_size)
        mine, theirs = self._block_hashes(seq, n), self._block_hashes(other, n)
        shared = 0
        while shared < n and mine[shared] == theirs[shared]:  # chained: equal hashes, equal prefixes
            shared += 1
        return shared * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether allocate(seq, num_new_tokens) would succeed; changes nothing."""
        hits = self._prefix_hits(seq)
        return self._num_fresh_needed(seq, hits, num_new_tokens) <= self._num_free_after(hits)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq.block_table to cover its computed tokens plus num_new_tokens more.

        On a first allocation (empty block table) the cached prefix is taken first: those
        blocks are shared (ref count + 1) and seq.num_computed_tokens / num_cached_tokens
        are set to the cached length; num_new_tokens counts tokens beyond it (use
        num_cached_prefix_tokens to size it). Returns False and changes nothing when there
        are not enough free blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hits = self._prefix_hits(seq)
        if self._num_fresh_needed(seq, hits, num_new_tokens) > self._num_free_after(hits):
            return False
        if not seq.block_table:
            if seq.num_computed_tokens:
                raise ValueError(f"{seq!r} has computed tokens but no blocks")
            for block_id in hits:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._evictable[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
            seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
            self._num_committed[seq.seq_id] = len(hits)
            if self.enable_prefix_caching:
                num_full = (seq.num_tokens - 1) // self.block_size
                self.num_query_tokens += seq.num_tokens
                self.num_hit_tokens += seq.num_cached_tokens
                self.num_hit_blocks += len(hits)
                self.num_miss_blocks += num_full - len(hits)
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_fresh_block())
        return True

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """The runner wrote the K/V of seq's next num_new_tokens tokens: count them computed, and
        register seq's newly full blocks in the prefix cache.

        A block whose prefix another block already holds stays private (it is dropped from the
        cache when freed).
        """
        end = seq.num_computed_tokens + num_new_tokens
        if num_new_tokens < 1 or end > min(seq.num_tokens, len(seq.block_table) * self.block_size):
            raise ValueError(f"{seq!r}: cannot commit {num_new_tokens} more tokens (beyond its tokens or its blocks)")
        seq.num_computed_tokens += num_new_tokens
        if not self.enable_prefix_caching:
            return
        start = self._num_committed.get(seq.seq_id, 0)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.hash_to_block.setdefault(block.hash, block.block_id)
        self._num_committed[seq.seq_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Drop seq's references to its blocks; its block table empties and nothing counts as computed.

        Blocks are released last block first, so a sequence's tail is evicted before its
        prefix (a tail is useless without the blocks before it).
        """
        for block_id in reversed(seq.block_table):
            self._release(block_id, seq)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_committed.pop(seq.seq_id, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget seq's K/V from token num_tokens on (speculative decoding's rejected proposals): at most
        num_tokens count as computed, and the blocks past the ones num_tokens tokens fill go back. Only
        uncommitted tokens can be forgotten, so no prefix-cache block ever loses what its hash names; the caller
        cuts seq.token_ids itself where the forgotten tokens were in it (a draft model's own sequence)."""
        if num_tokens < self._num_committed.get(seq.seq_id, 0) * self.block_size:
            raise ValueError(f"{seq!r}: cannot truncate to {num_tokens} tokens, below its blocks in the prefix cache")
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop(), seq)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def _release(self, block_id: int, seq: Sequence) -> None:
        """Drop one of seq's references to block_id: at zero a cached block becomes evictable, any other free."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated ({seq!r})")
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.hash is not None and self.hash_to_block.setdefault(block.hash, block_id) == block_id:
            self._evictable[block_id] = None  # most recently used end
        else:  # never committed, or a duplicate of a prefix another block holds
            block.hash, block.token_ids = None, ()
            self._free.append(block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Only possible while no sequence holds blocks: returns False otherwise."""
        if self.num_used_blocks:
            return False
        for block_id in self._evictable:
            self.blocks[block_id].hash, self.blocks[block_id].token_ids = None, ()
            self._free.append(block_id)
        self._evictable.clear()
        self.hash_to_block.clear()
        return True

    # -- internals ---------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, n: int) -> list[int]:
        """seq.block_hashes extended to (at least) its first n full blocks."""
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), n):
            hashes.append(hash_block(hashes[i - 1] if i else seq.hash_seed, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Block ids of seq's cached prefix a first allocation would share ([] if it has blocks)."""
        if seq.block_table or not self.enable_prefix_caching:
            return []
        if seq.params.prompt_logprobs is not None:  # every prompt position must run to get its logits
            return []
        num_full = (seq.num_tokens - 1) // self.block_size  # leave >= 1 token to compute
        hits: list[int] = []
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(num_full):
            if i == len(hashes):
                self._block_hashes(seq, i + 1)
            block_id = self.hash_to_block.get(hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def _num_fresh_needed(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> int:
        computed = len(hits) * self.block_size if hits else seq.num_computed_tokens
        have = len(hits) if hits else len(seq.block_table)
        return max(0, self.num_blocks_for(computed + num_new_tokens) - have)

    def _num_free_after(self, hits: list[int]) -> int:
        """Free blocks left for fresh allocation once the hit blocks are taken."""
        return self.num_free_blocks - sum(1 for b in hits if self.blocks[b].ref_count == 0)

    def _take_fresh_block(self) -> int:
        if self._free:
            block_id = self._free.pop()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently used
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
            self.num_evictions += 1
        self.blocks[block_id].ref_count = 1
        return block_id
