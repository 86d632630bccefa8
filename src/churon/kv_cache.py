"""KV cache: the keys and values of every past token, per layer.

This is the contiguous per-sequence cache: one preallocated [max_tokens, kv_heads, head_dim]
buffer per layer for K and for V, written in place as tokens arrive. Token-major, so the whole
buffer is one block of a paged cache ([blocks, block_size, kv_heads, head_dim]) and the
block-table attention kernels read it unchanged.
"""

from __future__ import annotations

import torch

from churon.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, max_tokens: int, dtype: torch.dtype):
        shape = (config.num_layers, max_tokens, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.max_tokens = max_tokens

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([tokens, kv_heads, head_dim]) at positions start.. and return all keys and values so far."""
        end = start + k.shape[0]
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end]
