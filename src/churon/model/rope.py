"""Rotary position embeddings: the inverse frequencies (with the model's scaling) and the cos/sin tables."""

from __future__ import annotations

import math

import torch

from churon.config import ModelConfig
from churon.errors import UnsupportedModelError


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
    if kind == "longrope":
        # One set of factors, picked once by the context as llama.cpp picks it (the long ones where its n_ctx is past
        # original_max_position_embeddings); churon's context is the model's context_length, what these tables are
        # built for. transformers picks by each forward's sequence length instead, which keys already rotated in a
        # KV cache cannot follow. The two agree while the context is within the original length (short factors)
        # and for sequences longer than it (long).
        long = config.context_length > scaling["original_max_position_embeddings"]
        return inv_freq / torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if kind == "yarn":
        return _yarn_inv_freq(dim, config.rope_theta, scaling)
    raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported (supported: linear, llama3, longrope, yarn)")


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN (gpt-oss): each rotated pair's frequency between its own (extrapolation: the fast-turning pairs, more than
    beta_fast turns over the original context) and its own / factor (interpolation: the slow ones, fewer than
    beta_slow turns), a linear ramp between; as transformers' _compute_yarn_parameters and ggml's rope_yarn (whose
    ramp ends are always rounded outwards: truncate)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:  # the pair index that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(float(scaling["beta_fast"])), correction_dim(float(scaling["beta_slow"]))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_tables(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [context_length, head_dim] for rotate-half RoPE (the Hugging Face / NeoX layout), at the model's
    scaled frequencies, times LongRoPE's or YaRN's attention factor (transformers and llama.cpp scale cos and sin by it,
    whichever factors are in use)."""
    freqs = torch.outer(torch.arange(config.context_length, dtype=torch.float32),
                        rope_inv_freq(config, freq_factors).float())
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = (config.rope_scaling or {}).get("attention_factor", 1.0)
    return (emb.cos() * scale).contiguous(), (emb.sin() * scale).contiguous()
