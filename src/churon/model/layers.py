"""The weights of one decoder layer, and RoPE's frequencies.

The arithmetic lives in the backend (churon.kernels.backend); this module decides which
weights each layer holds and fuses q/k/v and gate/up into one matrix each, so a layer costs
three matmuls on the way in and two on the way out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from churon.config import ModelConfig
from churon.errors import UnsupportedModelError
from churon.kernels.backend import RawWeight, concat_rows, dense


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


def rope_tables(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] for rotate-half RoPE (the Hugging Face / NeoX layout)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


@dataclass
class LayerWeights:
    input_norm: Any
    qkv: Any  # q, k and v projections stacked by rows
    qkv_bias: Any | None  # Qwen2
    q_norm: Any | None  # Qwen3: RMSNorm over each head of q and k
    k_norm: Any | None
    o: Any
    post_norm: Any
    gate_up: Any  # gate and up projections stacked by rows
    down: Any

    @classmethod
    def build(cls, config: ModelConfig, layer: int, weights: dict[str, RawWeight], backend) -> "LayerWeights":
        p = f"layers.{layer}."
        a, m = p + "self_attn.", p + "mlp."
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([dense(weights[a + f"{x}_proj.bias"]) for x in "qkv"])
            qkv_bias = backend.vector(qkv_bias)
        q_norm = k_norm = None
        if config.qk_norm:
            q_norm, k_norm = backend.vector(weights[a + "q_norm.weight"]), backend.vector(weights[a + "k_norm.weight"])
        return cls(
            input_norm=backend.vector(weights[p + "input_layernorm.weight"]),
            qkv=backend.matrix(concat_rows([weights[a + f"{x}_proj.weight"] for x in "qkv"])),
            qkv_bias=qkv_bias,
            q_norm=q_norm,
            k_norm=k_norm,
            o=backend.matrix(weights[a + "o_proj.weight"]),
            post_norm=backend.vector(weights[p + "post_attention_layernorm.weight"]),
            gate_up=backend.matrix(concat_rows([weights[m + "gate_proj.weight"], weights[m + "up_proj.weight"]])),
            down=backend.matrix(weights[m + "down_proj.weight"]),
        )
