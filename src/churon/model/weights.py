"""Weights as the loaders hand them over: GGUF bytes or float tensors, and the two things done to them
before a backend takes them (dequantizing, stacking by rows)."""

from __future__ import annotations

import numpy as np
import torch

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from churon.formats.gguf import GGUFTensor
from churon.formats.quants import dequantize, quantize

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


def quantized(w: RawWeight, qtype: GGMLQuantizationType, name: str) -> RawWeight:
    """A float weight as GGUF blocks of qtype, when its rows split into whole blocks; GGUF weights as stored."""
    if isinstance(w, GGUFTensor) or w.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return w
    t = dense(w)
    return GGUFTensor(name, tuple(t.shape), qtype, quantize(t, qtype).reshape(-1))


def experts(w: RawWeight) -> list[RawWeight]:
    """A stacked expert tensor [experts, rows, cols] as one matrix per expert, GGUF bytes kept (each expert's
    blocks are a contiguous slice: views, not copies)."""
    if isinstance(w, torch.Tensor):
        return list(w.unbind(0))
    per_expert = w.data.reshape(w.shape[0], -1)
    return [GGUFTensor(f"{w.name}[{e}]", tuple(w.shape[1:]), w.qtype, per_expert[e]) for e in range(w.shape[0])]
