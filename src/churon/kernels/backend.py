"""The dispatch table: the handful of operations the transformer is written against, in two backends.

    ReferenceBackend  plain PyTorch in float32 (the exact reference) or bfloat16
    NativeBackend     churon._cpu: quantized matmuls on 8-bit activations, fused row ops,
                      block-table attention; float32 activations

Only the native backend computes each token's row the same way whatever else is in the batch:
its matmuls split work by output rows with a fixed reduction order, and its attention treats
every query token on its own. PyTorch's float32 GEMM changes its reduction order with the
batch size, so the reference backend is exact but not batch-invariant.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from churon import kernels
from churon.formats.gguf import GGUFTensor
from churon.formats.quants import dequantize
from churon.kv_cache import PagedKVCache
from churon.model.batch import ForwardBatch, slots_of

log = logging.getLogger("churon")

# A weight as a loader hands it over: GGUF bytes, or a float tensor (Hugging Face checkpoints).
RawWeight = GGUFTensor | torch.Tensor

KERNEL_CHOICES = ("auto", "native", "reference")


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


class ReferenceBackend:
    name = "reference"

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.kv_dtype = dtype  # the KV cache keeps the exact activations

    def matrix(self, w: RawWeight) -> torch.Tensor:
        return dense(w).to(self.dtype)

    def vector(self, w: RawWeight) -> torch.Tensor:
        return dense(w).to(self.dtype)

    def embedding(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    def linear(self, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, bias)

    def linear_precise(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # normalize in fp32 whatever the activation dtype, as the reference implementation does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place); returns rms_norm(residual)."""
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of x [tokens, heads, head_dim]."""
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * c + rotated.float() * s).to(x.dtype)

    def rope_and_cache(self, qkv: torch.Tensor, shape: tuple[int, int, int], batch: ForwardBatch, cos: torch.Tensor,
                       sin: torch.Tensor, cache: PagedKVCache, layer: int) -> torch.Tensor:
        """RoPE on q and k of qkv [tokens, (heads + 2 kv_heads) * head_dim]; k and v into the cache. Returns q."""
        heads, kv_heads, head_dim = shape
        n = qkv.shape[0]
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = self.rope(q.view(n, heads, head_dim), batch.positions, cos, sin)
        k = self.rope(k.view(n, kv_heads, head_dim), batch.positions, cos, sin)
        cache.write(layer, batch.slot_mapping, k, v.view(n, kv_heads, head_dim))
        return q

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention(self, q: torch.Tensor, cache: PagedKVCache, layer: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over all its keys, read through its slots.

        q: [tokens, heads, head_dim]. Returns [tokens, heads, head_dim].
        """
        out = torch.empty_like(q)
        heads, kv_heads = q.shape[1], cache.k.shape[3]
        for i, ctx in enumerate(batch.context_lens):
            a, b = batch.query_start[i], batch.query_start[i + 1]
            slots = slots_of(batch.block_tables[i], torch.arange(ctx), cache.block_size)
            n = b - a
            k, v = cache.read(layer, slots, q.dtype)
            out[a:b] = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=_causal_mask(n, ctx - n) if n > 1 else None,
                scale=scale,
                enable_gqa=heads != kv_heads,
            ).transpose(0, 1)
        return out


def _causal_mask(n: int, start: int) -> torch.Tensor:
    """Query i (at position start + i) sees keys 0..start + i."""
    return torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]


class NativeBackend:
    """churon._cpu kernels; every tensor float32 and contiguous."""

    name = "native"
    dtype = torch.float32
    # float32: float16 or bfloat16 caches halve attention's memory traffic and score the same on
    # plain text (GPL-3 mean KL from the fp32 path 0.002247 / 0.002300 vs 0.002255), but after a
    # chat template they move SmolLM2's first-token logit gaps by 0.2-0.35, enough to change
    # the answer to "What is the capital of France?"; kv_dtype="float16" is there to choose
    kv_dtype = torch.float32
    # types the native matmul reads directly; others are dequantized to F32 first
    NATIVE_TYPES = {
        GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }

    def __init__(self):
        if kernels.cpu is None:
            raise RuntimeError(kernels.reason)
        self.cpu = kernels.cpu

    def matrix(self, w: RawWeight):
        if isinstance(w, GGUFTensor) and w.qtype in self.NATIVE_TYPES:
            raw, qtype, (rows, cols) = w.data, w.qtype, w.shape
        else:
            t = dense(w).contiguous()
            raw, qtype, (rows, cols) = t.view(torch.uint8).numpy().reshape(-1), GGMLQuantizationType.F32, t.shape
        return self.cpu.QMatrix(np.ascontiguousarray(raw), int(qtype), int(rows), int(cols))

    def vector(self, w: RawWeight) -> torch.Tensor:
        return dense(w).contiguous()

    def embedding(self, table, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.shape[0], table.cols)
        table.dequantize_rows(ids.data_ptr(), ids.shape[0], out.data_ptr())
        return out

    def linear(self, w, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.rows)
        w.matmul(x.data_ptr(), y.data_ptr(), x.shape[0], bias.data_ptr() if bias is not None else 0)
        return y

    def linear_precise(self, w, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with activations at about 16 bits instead of 8, for the same weight traffic.

        The kernel splits x = hi + lo, hi its 8-bit block quantization and lo the rounding error
        quantized in turn at a 127x finer scale, and runs both against each weight block. Used
        for the logits, where 8-bit activations cost the most accuracy (KL from the fp32 path on
        GPL-3: 0.0029 -> 0.0023, below llama.cpp's 0.0030).
        """
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.rows)
        w.matmul(x.data_ptr(), y.data_ptr(), x.shape[0], 0, True)
        return y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        n = x.shape[-1]
        out = torch.empty_like(x)
        self.cpu.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps)
        return out

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        n = x.shape[-1]
        out = torch.empty_like(x)
        self.cpu.add_rms_norm(residual.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps)
        return out

    def rope_and_cache(self, qkv: torch.Tensor, shape: tuple[int, int, int], batch: ForwardBatch, cos: torch.Tensor,
                       sin: torch.Tensor, cache: PagedKVCache, layer: int) -> torch.Tensor:
        """One kernel: RoPE on q and k in place in qkv, k and v stored at their slots. Returns q (a view of qkv)."""
        heads, kv_heads, head_dim = shape
        n = qkv.shape[0]
        self.cpu.rope_and_cache(
            qkv.data_ptr(), n, heads, kv_heads, head_dim, batch.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            cache.k[layer].data_ptr(), cache.v[layer].data_ptr(), batch.slot_mapping.data_ptr(), qkv.stride(0),
            cache.dtype_name, *_scale_ptrs(cache, layer),
        )
        return qkv[:, : heads * head_dim].view(n, heads, head_dim)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        n = gate_up.shape[-1] // 2
        out = torch.empty(gate_up.shape[0], n)
        self.cpu.swiglu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], n)
        return out

    def attention(self, q: torch.Tensor, cache: PagedKVCache, layer: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Every query token attends on its own (its keys up to its position, through its sequence's block table)."""
        m, heads, head_dim = q.shape
        out = torch.empty(m, heads, head_dim)
        tables = batch.token_block_tables
        self.cpu.attention_decode(
            q.data_ptr(), cache.k[layer].data_ptr(), cache.v[layer].data_ptr(), tables.data_ptr(),
            batch.token_context_lens.data_ptr(), out.data_ptr(), m, heads, cache.k.shape[3], head_dim,
            cache.block_size, scale, tables.shape[1], q.stride(0), cache.dtype_name, *_scale_ptrs(cache, layer),
        )
        return out


def _scale_ptrs(cache: PagedKVCache, layer: int) -> tuple[int, int]:
    """Addresses of an int8 cache's K and V scales of one layer (0 for float caches)."""
    if cache.k_scale is None:
        return 0, 0
    return cache.k_scale[layer].data_ptr(), cache.v_scale[layer].data_ptr()


def make_backend(kernels_choice: str, dtype: torch.dtype):
    """'auto': native when built and the dtype is float32; otherwise the reference path, said once."""
    if kernels_choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels_choice!r}: must be one of {', '.join(KERNEL_CHOICES)}")
    if kernels_choice == "reference":
        return ReferenceBackend(dtype)
    if dtype != torch.float32:
        if kernels_choice == "native":
            raise ValueError(f"the native kernels compute in float32; dtype={dtype} needs kernels='reference'")
        return ReferenceBackend(dtype)
    if kernels.cpu is None:
        if kernels_choice == "native":
            raise RuntimeError(kernels.reason)
        log.warning("churon: native CPU kernels unavailable (%s); running the PyTorch reference path", kernels.reason)
        return ReferenceBackend(dtype)
    return NativeBackend()
