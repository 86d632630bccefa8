"""Weights as the loaders hand them over: GGUF bytes or float tensors, and the two things done to them
before a backend takes them (dequantizing, stacking by rows)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from churon.formats.gguf import GGUFTensor
from churon.formats.quants import Q8_0_EXACT, as_q8_0, dequantize, quantize


@dataclass(frozen=True)
class RowStack:
    """GGUF weights stacked by rows whose types share no lossless layout (llama.cpp's Q4_K_M puts a Q6_K v beside
    Q4_K q and k in half the layers): each part as stored, for a backend to run part by part (dense() stacks them
    as float32)."""

    parts: tuple[GGUFTensor, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]


# A weight as a loader hands it over: GGUF bytes, or a float tensor (Hugging Face checkpoints); fused by
# concat_rows, also a RowStack.
RawWeight = GGUFTensor | torch.Tensor | RowStack


FLOAT_QTYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def is_float(w: RawWeight) -> bool:
    """a float tensor, or GGUF float bytes (F32, F16, BF16)"""
    return isinstance(w, torch.Tensor) or (isinstance(w, GGUFTensor) and w.qtype in FLOAT_QTYPES)


def dense(w: RawWeight) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return w.float()
    if isinstance(w, RowStack):
        return torch.cat([dense(p) for p in w.parts])
    return dequantize(w.data, w.qtype, w.shape, name=w.name)


def concat_rows(parts: list[RawWeight]) -> RawWeight:
    """Stack weights by rows (fusing q/k/v or gate/up), keeping GGUF bytes when all share a type, or when all hold
    small integers under a block scale (Q4_0, Q5_0, Q8_0: as Q8_0 blocks of the same values; llama.cpp's Q4_K_M
    mixes Q5_0 and Q8_0 in Gemma 3's q/k/v); GGUF parts of other mixed types as a RowStack; float ones as float32."""
    if all(isinstance(p, GGUFTensor) for p in parts):
        qtypes = {p.qtype for p in parts}
        if len(qtypes) > 1 and qtypes <= Q8_0_EXACT:
            parts = [GGUFTensor(p.name, p.shape, GGMLQuantizationType.Q8_0, as_q8_0(p.data, p.qtype)) for p in parts]
            qtypes = {GGMLQuantizationType.Q8_0}
        if len(qtypes) > 1:
            return RowStack(tuple(parts))
        rows = sum(p.shape[0] for p in parts)
        data = np.concatenate([p.data for p in parts])
        return GGUFTensor("+".join(p.name for p in parts), (rows, parts[0].shape[1]), parts[0].qtype, data)
    return torch.cat([dense(p) for p in parts])


def quantized(w: RawWeight, qtype: GGMLQuantizationType, name: str) -> RawWeight:
    """A float weight as GGUF blocks of qtype, when its rows split into whole blocks; GGUF weights as stored."""
    if isinstance(w, (GGUFTensor, RowStack)) or w.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
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
