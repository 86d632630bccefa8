"""KV cache memory: the keys and values of every cached token, in fixed-size blocks.

One preallocated tensor per K and V: [layers, num_blocks, block_size, kv_heads, head_dim].
A token's slot is block_id * block_size + offset; a sequence finds its tokens through its
block table (which blocks, in order). The block manager decides which blocks a sequence
owns; this module only holds the memory.
"""

from __future__ import annotations

import torch

from churon.config import ModelConfig

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PagedKVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # empty, not zeros: a slot is always written before it is read, and untouched pages cost no memory
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        # the same memory indexed by slot: [layers, num_blocks * block_size, kv_heads, head_dim]
        self.k_slots = self.k.view(config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.v_slots = self.v.view(config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([tokens, kv_heads, head_dim]) at their slots."""
        self.k_slots[layer].index_copy_(0, slot_mapping, k if k.dtype == self.dtype else k.to(self.dtype))
        self.v_slots[layer].index_copy_(0, slot_mapping, v if v.dtype == self.dtype else v.to(self.dtype))


class SequenceKVCache(PagedKVCache):
    """A cache for one sequence whose block table is simply 0, 1, 2, ... (tests, evaluation, offline use)."""

    def __init__(self, config: ModelConfig, max_tokens: int, block_size: int = 16, dtype: torch.dtype = torch.float32):
        super().__init__(config, -(-max_tokens // block_size), block_size, dtype)
        self.max_tokens = max_tokens
        self.block_table = list(range(self.num_blocks))
