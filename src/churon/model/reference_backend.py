"""ReferenceBackend: the backend's operations in plain PyTorch, float32 (the exact reference path) or bfloat16.

PyTorch's float32 GEMM changes its reduction order with the batch size, so this path is exact but
not batch-invariant (the native backend is both fast and batch-invariant).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from churon.kernels.ops import check_seq_starts
from churon.model.backend import Experts, KVCache, experts_one_by_one, softmax_top_k
from churon.model.batch import ForwardBatch, slots_of
from churon.model.weights import RawWeight, dense


class ReferenceBackend:
    name = "reference"

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.kv_dtype = dtype  # the KV cache keeps the exact activations

    def matrix(self, w: RawWeight) -> torch.Tensor:
        return dense(w).to(self.dtype)

    encoder_matrix = matrix  # every weight exact
    bf16_tiles = False

    def vector(self, w: RawWeight) -> torch.Tensor:
        return dense(w).to(self.dtype)

    def embedding(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    def linear(self, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, bias)

    def linear_precise(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def linear_argmax(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def prepare_argmax(self, w: torch.Tensor) -> None:
        pass

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # normalize in fp32 whatever the activation dtype, as the reference implementation does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     x_norm: torch.Tensor | None = None) -> torch.Tensor:
        """residual += x, or rms_norm(x, x_norm) (in place); returns rms_norm(residual)."""
        residual.add_(x if x_norm is None else self.rms_norm(x, x_norm, eps))
        return self.rms_norm(residual, weight, eps)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def add_layer_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> torch.Tensor:
        """layer_norm(residual + x) as a new tensor; residual and x are left as they are."""
        return self.layer_norm(residual + x, weight, bias, eps)

    def gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return F.gelu(x, approximate=approximate)

    def gelu_mlp(self, x: torch.Tensor, up: torch.Tensor, up_bias: torch.Tensor, down: torch.Tensor,
                 down_bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, up, up_bias), approximate=approximate), down, down_bias)

    def attention_packed(self, qkv: torch.Tensor, heads: int, head_dim: int, seq_starts: torch.Tensor,
                         scale: float, bf16_tiles: bool = False) -> torch.Tensor:
        """Bidirectional attention of every token over its own sequence's tokens; q, k, v are the column
        ranges [0, H), [H, 2H), [2H, 3H) of qkv [tokens, >= 3H], H = heads * head_dim. Returns [tokens, H]."""
        width = heads * head_dim
        check_seq_starts(seq_starts, qkv.shape[0])
        out = torch.empty(qkv.shape[0], width, dtype=qkv.dtype)
        starts = seq_starts.tolist()
        for a, b in zip(starts, starts[1:]):
            q, k, v = (qkv[a:b, i * width : (i + 1) * width].reshape(b - a, heads, head_dim).transpose(0, 1)
                       for i in range(3))
            out[a:b] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1).reshape(b - a, width)
        return out

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of x [tokens, heads, head_dim]."""
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * c + rotated.float() * s).to(x.dtype)

    def rope_and_cache(self, qkv: torch.Tensor, shape: tuple[int, int, int], batch: ForwardBatch, cos: torch.Tensor,
                       sin: torch.Tensor, cache: KVCache, layer: int,
                       head_norms: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0) -> torch.Tensor:
        """RoPE on q and k of qkv [tokens, (heads + 2 kv_heads) * head_dim] (each head rms_norm'ed first with
        head_norms' q and k weights); k and v into the cache. Returns q."""
        heads, kv_heads, head_dim = shape
        n = qkv.shape[0]
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim)
        if head_norms is not None:
            q, k = self.rms_norm(q, head_norms[0], eps), self.rms_norm(k, head_norms[1], eps)
        q = self.rope(q, batch.positions, cos, sin)
        k = self.rope(k, batch.positions, cos, sin)
        cache.write(layer, batch.slot_mapping, k, v.view(n, kv_heads, head_dim))
        return q

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def experts(self, gate_up: list[RawWeight], down: list[RawWeight]) -> Experts:
        return Experts([self.matrix(w) for w in gate_up], [self.matrix(w) for w in down])

    def moe_experts(self, experts: Experts, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                    normalize: bool = False) -> torch.Tensor:
        return experts_one_by_one(self, experts, h, chosen, weights, normalize)

    def routed_experts(self, router: torch.Tensor, experts: Experts, h: torch.Tensor, k: int,
                       normalize: bool = False) -> torch.Tensor:
        weights, chosen = softmax_top_k(self.linear(router, h), k)
        return self.moe_experts(experts, h, chosen, weights, normalize)

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def swiglu_clamped(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's SwiGLU, in transformers' GptOssExperts order of operations."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def attention(self, q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, scale: float,
                  window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its keys, read through its slots: all of them, or the
        last `window` positions of each query's; soft-capped scores (softcap > 0) and per-head sink logits that
        join the softmax's denominator (sinks [heads]) when given.

        q: [tokens, heads, head_dim]. Returns [tokens, heads, head_dim].
        """
        out = torch.empty_like(q)
        heads, kv_heads = q.shape[1], cache.k.shape[3]
        for i, ctx in enumerate(batch.context_lens):
            a, b = batch.query_start[i], batch.query_start[i + 1]
            n = b - a
            first = max(0, ctx - n - window + 1) if window else 0  # the earliest key any of the n queries sees
            slots = slots_of(batch.block_tables[i], torch.arange(first, ctx), cache.block_size)
            k, v = cache.read(layer, slots, q.dtype)
            mask = _attention_mask(n, ctx - n, first, window)
            qh, kh, vh = q[a:b].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            if not softcap and sinks is None:
                out[a:b] = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                                          enable_gqa=heads != kv_heads).transpose(0, 1)
                continue
            kh, vh = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (kh, vh))
            scores = (qh @ kh.transpose(1, 2)) * scale  # [heads, n, keys]
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is not None:  # one more logit per head, no value behind it
                scores = torch.cat([scores, sinks.to(scores.dtype).view(heads, 1, 1).expand(heads, n, 1)], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., : kh.shape[1]]
            out[a:b] = (probs @ vh).transpose(0, 1)
        return out

    def decoder_stack(self, *args) -> None:
        return None  # the reference path stays op by op: it is the ground truth

    def lora_stack(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> list:
        """The pairs by slot, float32 whatever the activations (the adapters' own precision)."""
        return [None if p is None else (p[0].float().contiguous(), p[1].float().contiguous()) for p in pairs]

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, stack: list, slots: torch.Tensor,
                 scales: torch.Tensor) -> None:
        """y[t] += B_s @ (scales[t] * (A_s @ x[t])): each slot's tokens as one pair of matmuls, in float32."""
        for s in slots.unique().tolist():
            if not 0 <= s < len(stack) or stack[s] is None:
                continue
            a, b = stack[s]
            rows = (slots == s).nonzero().squeeze(1)
            low = F.linear(x[rows].float(), a) * scales[rows, None]
            y.index_add_(0, rows, F.linear(low, b).to(y.dtype))


def _attention_mask(n: int, start: int, first: int, window: int) -> torch.Tensor:
    """[n, start + n - first]: query i (at position start + i) sees the key at position first + j when that is at
    most start + i and, with a window, less than window positions back."""
    keys = torch.arange(first, start + n)[None, :]
    queries = torch.arange(start, start + n)[:, None]
    mask = keys <= queries
    if window:
        mask &= queries - keys < window
    return mask


