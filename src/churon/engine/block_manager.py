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

Windowed layers (model/kv_layout.py). A model whose windowed and global layers keep their K/V apart has KV
groups, each with a window (0: keeps everything), and a sequence has one block table per group, all drawing from
this one pool. In a windowed group, before a step computes tokens from position c on, the blocks wholly behind
c - window + 1 (the earliest key any of its queries sees) are released: their table entries stay in place, unread,
and count as released. Released blocks keep their hash, so the prefix cache still finds them until evicted. The
cache names a block by its chained hash salted by its group (the same tokens in two groups are two blocks), and a
prefix hit of h blocks needs every global group's blocks 0..h-1 but a windowed group's only from the block holding
position h * block_size - window + 1 on.

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

from churon.model.kv_layout import blocks_held
from churon.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: "list[int] | tuple[int, ...]") -> int:
    """Stable 64-bit hash of one full block, chained to the hash of the block before it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" * 8 if parent_hash is None else parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def group_salt(group: int) -> int:
    """XORed into KV group `group`'s block hashes (0 for the first group: a one-group cache keeps the plain chain)."""
    if not group:
        return 0
    return int.from_bytes(hashlib.blake2b(group.to_bytes(4, "little"), digest_size=8, person=b"churon-kvgroup").digest(),
                          "little")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and committed (salted by its group)
    token_ids: tuple[int, ...] = ()  # the block's tokens, kept with the hash to rule out collisions


# a first allocation's share of the prefix cache: h leading blocks, and per group the block ids it takes (a windowed
# group's the last ones of the h only)
PrefixHit = tuple[int, list[list[int]]]


class BlockManager:
    """Reference-counted KV blocks with prefix caching and LRU eviction.

    Sequences in the WAITING state hold no blocks; a sequence's first allocation (no block tables) first takes the
    longest chain of cached full blocks matching its tokens. After each step the scheduler commits the tokens each
    sequence computed; free(seq) when a sequence finishes, is aborted or preempted.

    windows: one per KV group (model/kv_layout.py), the positions its layers see (0: all); the default is one
    group that keeps everything.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 windows: tuple[int, ...] = (0,)):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or any(w < 0 for w in windows):
            raise ValueError(f"windows must give each KV group a window >= 0 (0: none), got {windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self._salts = [group_salt(g) for g in range(len(self.windows))]
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}  # full-block hash (salted by group) -> the block holding it
        # free blocks without a hash; popped from the end, so block 0 goes first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # free blocks that keep a hash, least recently used first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._num_committed: dict[int, int] = {}  # seq_id -> leading blocks registered by commit
        self._num_released: dict[int, list[int]] = {}  # seq_id -> per group, leading blocks given back (windows)
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
        """Blocks one table needs to cover num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_held(self, num_tokens: int, chunk: int = 1) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once in all groups, computing up to `chunk`
        tokens a step (with windows, fewer than a table of num_tokens per group)."""
        return blocks_held(self.windows, num_tokens, self.block_size, chunk)

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks seq holds now, in all its tables (released ones not counted)."""
        released = self._num_released.get(seq.seq_id, [0] * len(seq.block_tables))
        return sum(len(t) - r for t, r in zip(seq.block_tables, released))

    # -- allocation --------------------------------------------------------------------

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many leading tokens seq's next allocate() would take from the prefix cache.

        Nonzero only for a sequence without blocks. Always leaves at least one token to
        compute (the model must produce logits), so a cached last block is not used when
        the whole sequence is cached: only full blocks inside the first num_tokens - 1
        tokens count.
        """
        return self._prefix_hits(seq)[0] * self.block_size

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
        hit = self._prefix_hits(seq)
        return self._num_fresh_needed(seq, hit, num_new_tokens) <= self._num_free_after(seq, hit)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block tables to cover its computed tokens plus num_new_tokens more.

        On a first allocation (no block tables) the cached prefix is taken first: those
        blocks are shared (ref count + 1) and seq.num_computed_tokens / num_cached_tokens
        are set to the cached length; num_new_tokens counts tokens beyond it (use
        num_cached_prefix_tokens to size it). Later allocations first release the blocks behind the windows
        of seq's windowed groups. Returns False and changes nothing when there are not enough free blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hit = self._prefix_hits(seq)
        if self._num_fresh_needed(seq, hit, num_new_tokens) > self._num_free_after(seq, hit):
            return False
        if not seq.block_tables:
            if seq.num_computed_tokens:
                raise ValueError(f"{seq!r} has computed tokens but no blocks")
            self._take_prefix(seq, hit)
        else:
            for g, i in self._behind_windows(seq):
                self._release(seq.block_tables[g][i], seq)
                self._released(seq)[g] = i + 1
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        for table in seq.block_tables:
            while len(table) < needed:
                table.append(self._take_fresh_block())
        return True

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """The runner wrote the K/V of seq's next num_new_tokens tokens: count them computed, and
        register seq's newly full blocks in the prefix cache.

        A block whose prefix another block already holds stays private (it is dropped from the
        cache when freed).
        """
        end = seq.num_computed_tokens + num_new_tokens
        num_blocks = len(seq.block_tables[0]) if seq.block_tables else 0
        if num_new_tokens < 1 or end > min(seq.num_tokens, num_blocks * self.block_size):
            raise ValueError(f"{seq!r}: cannot commit {num_new_tokens} more tokens (beyond its tokens or its blocks)")
        seq.num_computed_tokens += num_new_tokens
        if not self.enable_prefix_caching:
            return
        start = self._num_committed.get(seq.seq_id, 0)
        num_full = min(seq.num_computed_tokens // self.block_size, num_blocks)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        released = self._released(seq)
        for g, table in enumerate(seq.block_tables):
            salt = self._salts[g]
            for i in range(max(start, released[g]), num_full):
                block = self.blocks[table[i]]
                if block.hash is None:
                    block.hash = hashes[i] ^ salt
                    block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                    self.hash_to_block.setdefault(block.hash, block.block_id)
        self._num_committed[seq.seq_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Drop seq's references to its blocks; its block tables empty and nothing counts as computed.

        Blocks are released last block first (each position in every group before the position before it), so a
        sequence's tail is evicted before its prefix (a tail is useless without the blocks before it).
        """
        released = self._released(seq)
        for i in reversed(range(len(seq.block_tables[0]) if seq.block_tables else 0)):
            for table, first in zip(seq.block_tables, released):
                if i >= first:
                    self._release(table[i], seq)
        seq.block_tables = []
        seq.num_computed_tokens = 0
        self._num_committed.pop(seq.seq_id, None)
        self._num_released.pop(seq.seq_id, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget seq's K/V from token num_tokens on (speculative decoding's rejected proposals): at most
        num_tokens count as computed, and the blocks past the ones num_tokens tokens fill go back. Only
        uncommitted tokens can be forgotten, so no prefix-cache block ever loses what its hash names; the caller
        cuts seq.token_ids itself where the forgotten tokens were in it (a draft model's own sequence)."""
        if num_tokens < self._num_committed.get(seq.seq_id, 0) * self.block_size:
            raise ValueError(f"{seq!r}: cannot truncate to {num_tokens} tokens, below its blocks in the prefix cache")
        keep = self.num_blocks_for(num_tokens)
        if keep < max(self._released(seq), default=0):
            raise ValueError(f"{seq!r}: cannot truncate to {num_tokens} tokens, below blocks its windows gave back")
        for table in seq.block_tables:
            while len(table) > keep:
                self._release(table.pop(), seq)
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

    def _released(self, seq: Sequence) -> list[int]:
        """Per group, how many of seq's leading blocks its window gave back (kept by seq_id, made on first use)."""
        return self._num_released.setdefault(seq.seq_id, [0] * len(seq.block_tables))

    def _first_seen(self, group: int, position: int) -> int:
        """The block holding the earliest key a query at `position` sees in `group` (0 without a window)."""
        window = self.windows[group]
        return max(0, position - window + 1) // self.block_size if window else 0

    def _behind_windows(self, seq: Sequence) -> list[tuple[int, int]]:
        """(group, index) of the blocks seq's next step no longer sees and still holds, in table order."""
        released = self._released(seq)
        behind = [(g, min(self._first_seen(g, seq.num_computed_tokens), len(seq.block_tables[g])))
                  for g, w in enumerate(self.windows) if w]
        return [(g, i) for g, end in behind for i in range(released[g], end)]

    def _prefix_hits(self, seq: Sequence) -> PrefixHit:
        """The cached prefix a first allocation of seq would take ((0, []) if it has blocks): the most leading full
        blocks h every global group has cached from block 0 and every windowed group from the first its window
        sees at position h * block_size."""
        if seq.block_tables or not self.enable_prefix_caching:
            return 0, []
        if seq.params.prompt_logprobs is not None:  # every prompt position must run to get its logits
            return 0, []
        num_full = (seq.num_tokens - 1) // self.block_size  # leave >= 1 token to compute
        bs, found = self.block_size, {}

        def cached(g: int, i: int) -> int | None:  # the block holding seq's block i in group g's cache
            if (g, i) not in found:
                block_id = self.hash_to_block.get(self._block_hashes(seq, i + 1)[i] ^ self._salts[g])
                if block_id is not None and self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                    block_id = None
                found[g, i] = block_id
            return found[g, i]

        def last_missing(g: int) -> int:  # the last block windowed group g's window needs at h and lacks, or -1
            needed = range(h - 1, self._first_seen(g, h * bs) - 1, -1)
            return next((i for i in needed if cached(g, i) is None), -1)

        groups = range(len(self.windows))
        whole = [g for g in groups if not self.windows[g]]
        windowed = [g for g in groups if self.windows[g]]
        h = 0 if whole else num_full
        while whole and h < num_full and all(cached(g, h) is not None for g in whole):
            h += 1
        while h > 0 and windowed:  # a hit longer than a missing block i would need it: at most i blocks
            missing = max(last_missing(g) for g in windowed)
            if missing < 0:
                break
            h = missing
        return h, [[cached(g, i) for i in range(self._first_seen(g, h * bs), h)] for g in groups]

    def _take_prefix(self, seq: Sequence, hit: PrefixHit) -> None:
        """seq's first block tables: the hit's blocks shared (ref count + 1), a windowed table's entries before its
        hit blocks released already."""
        h, taken = hit
        taken = taken or [[] for _ in self.windows]
        seq.block_tables = []
        released = []
        for ids in taken:
            for block_id in ids:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._evictable[block_id]
                block.ref_count += 1
            released.append(h - len(ids))
            seq.block_tables.append([0] * (h - len(ids)) + ids)  # released entries: never read
        self._num_released[seq.seq_id] = released
        seq.num_computed_tokens = seq.num_cached_tokens = h * self.block_size
        self._num_committed[seq.seq_id] = h
        if self.enable_prefix_caching:
            num_full = (seq.num_tokens - 1) // self.block_size
            self.num_query_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_cached_tokens
            self.num_hit_blocks += h
            self.num_miss_blocks += num_full - h

    def _num_fresh_needed(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> int:
        """Fresh blocks allocate(seq, num_new_tokens) takes, in all groups."""
        if seq.block_tables:
            end = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
            return sum(max(0, end - len(t)) for t in seq.block_tables)
        h = hit[0]
        return len(self.windows) * max(0, self.num_blocks_for(h * self.block_size + num_new_tokens) - h)

    def _num_free_after(self, seq: Sequence, hit: PrefixHit) -> int:
        """Free blocks left for fresh allocation once the hit blocks are taken and the blocks behind seq's windows
        given back."""
        free = self.num_free_blocks - sum(1 for ids in hit[1] for b in ids if self.blocks[b].ref_count == 0)
        if seq.block_tables:
            free += sum(1 for g, i in self._behind_windows(seq) if self.blocks[seq.block_tables[g][i]].ref_count == 1)
        return free

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
