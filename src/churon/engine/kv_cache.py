"""KV cache memory: the keys and values of every cached token, in fixed-size blocks.

One preallocated tensor per K and V: [layers, num_blocks, block_size, kv_heads, head_dim].
A token's slot is block_id * block_size + offset; a sequence finds its tokens through its
block table (which blocks, in order). The block manager decides which blocks a sequence
owns; this module only holds the memory. With KV groups (model/kv_layout.py: windowed and global
layers apart) the first dimension is the group size, not the layers: layer i's K/V sit at index
layout.layer_slots[i][1], through its group's block tables.

An int8 cache also holds one float32 scale per (slot, kv head), k_scale and v_scale
[layers, num_blocks, block_size, kv_heads]: a head's values are quantized when written,
symmetric around zero with scale amax / 127 (Q8_0's rule over a head vector), so a written
token never changes again and its values do not depend on what else is in the cache.
"""

from __future__ import annotations

import torch

from churon.config import KV_DTYPE_CHOICES, ModelConfig
from churon.model.kv_layout import KVLayout
from churon.model.transformer import Transformer

KV_DTYPES = {name: getattr(torch, name) for name in KV_DTYPE_CHOICES}
KV_DTYPE_NAMES = {dtype: name for name, dtype in KV_DTYPES.items()}
SCALE_BYTES = 4  # one float32 scale per (token, kv head) in an int8 cache


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, layers: int | None = None) -> int:
    """K and V of one token in every layer, or in `layers` of them (int8: with their scales)."""
    per_head = config.head_dim * dtype.itemsize + (SCALE_BYTES if dtype == torch.int8 else 0)
    return 2 * (config.num_layers if layers is None else layers) * config.num_kv_heads * per_head


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] float32 -> (int8 values, float32 scales [...]); the native kernel's arithmetic exactly."""
    amax = x.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (x * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8), amax / 127.0


class PagedKVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 layout: KVLayout | None = None):
        """layout: how layers share block tables (default: all in one group, nothing freed)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs at least one block of at least one token, got {num_blocks} x {block_size}")
        if dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"KV cache dtype {dtype} is not one of {', '.join(KV_DTYPES)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.dtype_name = KV_DTYPE_NAMES[dtype]
        self.layout = layout or KVLayout.whole(config.num_layers)
        layers, slots = self.layout.group_size, num_blocks * block_size
        shape = (layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # empty, not zeros: a slot is always written before it is read (tests/test_reproducibility.py fills
        # this memory with NaN and gets the same bits), and untouched pages cost no memory
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        # the same memory indexed by slot: [layers (group size), num_blocks * block_size, kv_heads, head_dim]
        self.k_slots = self.k.view(layers, slots, config.num_kv_heads, config.head_dim)
        self.v_slots = self.v.view(layers, slots, config.num_kv_heads, config.head_dim)
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            self.k_scale = torch.empty(shape[:-1], dtype=torch.float32)
            self.v_scale = torch.empty(shape[:-1], dtype=torch.float32)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([tokens, kv_heads, head_dim]) at their slots."""
        for x, slots, scales in ((k, self.k_slots, self.k_scale), (v, self.v_slots, self.v_scale)):
            if scales is None:
                slots[layer].index_copy_(0, slot_mapping, x if x.dtype == self.dtype else x.to(self.dtype))
                continue
            values, scale = quantize_int8(x.float())
            slots[layer].index_copy_(0, slot_mapping, values)
            scales[layer].view(-1, scales.shape[-1]).index_copy_(0, slot_mapping, scale)

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the given slots as dtype, [len(slots), kv_heads, head_dim]."""
        k, v = self.k_slots[layer][slots].to(dtype), self.v_slots[layer][slots].to(dtype)
        if self.k_scale is not None:
            kv_heads = self.k_scale.shape[-1]
            k = k * self.k_scale[layer].view(-1, kv_heads)[slots].unsqueeze(-1).to(dtype)
            v = v * self.v_scale[layer].view(-1, kv_heads)[slots].unsqueeze(-1).to(dtype)
        return k, v


class SequenceKVCache(PagedKVCache):
    """A cache for one sequence whose block table is simply 0, 1, 2, ... (tests, evaluation, offline use)."""

    def __init__(self, config: ModelConfig, max_tokens: int, block_size: int = 16, dtype: torch.dtype = torch.float32):
        super().__init__(config, -(-max_tokens // block_size), block_size, dtype)
        self.max_tokens = max_tokens
        self.block_table = list(range(self.num_blocks))

    @classmethod
    def for_model(cls, model: Transformer, max_tokens: int | None = None) -> "SequenceKVCache":
        """A cache for one sequence of up to max_tokens (default: the context length) in the model's KV dtype."""
        return cls(model.config, max_tokens or model.config.context_length, dtype=model.kv_dtype)
