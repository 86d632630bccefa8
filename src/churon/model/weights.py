"""Weights as the loaders hand them over, and the weights of one decoder layer.

The arithmetic lives in the backend; this module decides which weights each layer holds and fuses
q/k/v and gate/up into one matrix each, so a layer costs three matmuls on the way in and two on the
way out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from churon.config import ModelConfig
from churon.formats.gguf import GGUFTensor
from churon.formats.quants import dequantize

if TYPE_CHECKING:  # the backends import this module
    from churon.model.backend import Backend

# A weight as a loader hands it over: GGUF bytes, or a float tensor (Hugging Face checkpoints).
RawWeight = GGUFTensor | torch.Tensor


def dense(w: RawWeight) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return w.float()
    return dequantize(w.data, w.qtype, w.shape, name=w.name)


def concat_rows(parts: list[RawWeight]) -> RawWeight:
    """Stack weights by rows (fusing q/k/v or gate/up), keeping GGUF bytes when all share a type."""
    if all(isinstance(p, GGUFTensor) for p in parts) and len({p.qtype for p in parts}) == 1:
        rows = sum(p.shape[0] for p in parts)
        data = np.concatenate([p.data for p in parts])
        return GGUFTensor("+".join(p.name for p in parts), (rows, parts[0].shape[1]), parts[0].qtype, data)
    return torch.cat([dense(p) for p in parts])


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
    def build(cls, config: ModelConfig, layer: int, weights: dict[str, RawWeight], backend: Backend) -> "LayerWeights":
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
