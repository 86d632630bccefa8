"""The building blocks of a decoder-only transformer: RMSNorm, RoPE, attention, SwiGLU MLP.

Shapes follow one sequence at a time: activations are [tokens, features].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from churon.config import ModelConfig
from churon.errors import UnsupportedModelError
from churon.kv_cache import PagedKVCache
from churon.model.batch import ForwardBatch


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the activation dtype, as the reference does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with the model's frequency scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_factors is not None:
        # GGUF stores Llama 3's scaling as per-dimension divisors (rope_freqs.weight).
        return inv_freq / freq_factors.float()
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = ((original / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= original / low) & (wavelen >= original / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face / NeoX layout) with a precomputed cos/sin table."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; positions: int64 [tokens]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with q/k/v fused into one projection."""

    def __init__(self, config: ModelConfig, layer: int, weights: dict[str, torch.Tensor], rope: RotaryEmbedding):
        super().__init__()
        p = f"layers.{layer}.self_attn."
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        qkv = torch.cat([weights[p + "q_proj.weight"], weights[p + "k_proj.weight"], weights[p + "v_proj.weight"]])
        self.qkv_proj = nn.Parameter(qkv, requires_grad=False)
        self.qkv_bias = None
        if config.attention_bias:
            bias = torch.cat([weights[p + "q_proj.bias"], weights[p + "k_proj.bias"], weights[p + "v_proj.bias"]])
            self.qkv_bias = nn.Parameter(bias, requires_grad=False)
        self.o_proj = nn.Parameter(weights[p + "o_proj.weight"], requires_grad=False)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(weights[p + "q_norm.weight"], config.rms_norm_eps)
            self.k_norm = RMSNorm(weights[p + "k_norm.weight"], config.rms_norm_eps)
        self.rope = rope
        self.scale = 1.0 / math.sqrt(config.head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        n = x.shape[0]
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = self.rope(q, batch.positions)
        k = self.rope(k, batch.positions)
        cache.write(self.layer, batch.slot_mapping, k, v)
        out = paged_attention(q, cache.k_slots[self.layer], cache.v_slots[self.layer], batch, self.scale)
        return F.linear(out.reshape(n, self.q_size).to(x.dtype), self.o_proj)


def paged_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, batch: ForwardBatch, scale: float):
    """Causal attention of each sequence's new tokens over all its keys, read through its slots.

    q: [tokens, heads, head_dim]; k_slots, v_slots: [slots, kv_heads, head_dim]. Returns [tokens, heads, head_dim].
    """
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k_slots.shape[1]
    for i, ctx in enumerate(batch.context_lens):
        a, b = batch.query_start[i], batch.query_start[i + 1]
        slots = batch.context_slots[i]
        keys = k_slots[slots].to(q.dtype).transpose(0, 1)  # [kv_heads, ctx, head_dim]
        values = v_slots[slots].to(q.dtype).transpose(0, 1)
        n = b - a
        out[a:b] = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1),
            keys,
            values,
            attn_mask=_causal_mask(n, ctx - n, q.device) if n > 1 else None,
            scale=scale,
            enable_gqa=heads != kv_heads,
        ).transpose(0, 1)
    return out


def _causal_mask(n: int, start: int, device: torch.device) -> torch.Tensor:
    """Query i (at position start + i) sees keys 0..start + i."""
    keys = torch.arange(start + n, device=device)
    queries = torch.arange(start, start + n, device=device)
    return keys[None, :] <= queries[:, None]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(self, layer: int, weights: dict[str, torch.Tensor]):
        super().__init__()
        p = f"layers.{layer}.mlp."
        gate_up = torch.cat([weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]])
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(weights[p + "down_proj.weight"], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)
