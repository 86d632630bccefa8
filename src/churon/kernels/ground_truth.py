"""The ground truth of each native CPU kernel: its math in the most direct PyTorch code, what the kernel
is tested against, with the same argument conventions as the tensor-level wrappers in
churon.kernels.ops (tensors, not pointers).

GGUF weights are dequantized here by the gguf package's own numpy code, not by churon's loader: the
kernels are held against an implementation that shares nothing with them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
import gguf.quants
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q8_BLOCK = 32  # activations are quantized per 32 values

_T = GGMLQuantizationType
# byte offsets of the fp16 scale fields in each block (d, and dmin or m where the type has one)
FP16_FIELDS = {_T.Q8_0: [0], _T.Q4_0: [0], _T.Q5_0: [0], _T.Q4_1: [0, 2], _T.Q4_K: [0, 2], _T.Q5_K: [0, 2], _T.Q6_K: [208]}
_FLOAT_DTYPES = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}


def random_weight_bytes(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator,
                        scale: float = 0.1) -> np.ndarray:
    """Raw GGUF bytes of a rows x cols weight, for kernel tests and benchmarks: random codes with finite
    fp16 scales of either sign in [-scale, scale] (quantized types), or standard normal values (float types)."""
    if qtype in _FLOAT_DTYPES:
        w = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32)).to(_FLOAT_DTYPES[qtype])
        return w.view(torch.uint8).numpy().reshape(-1).copy()
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        blocks[:, off : off + 2] = rng.uniform(-scale, scale, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(-1)


# ---------------------------------------------------------------------------
# quantized matmul


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType | int, rows: int, cols: int) -> torch.Tensor:
    """A GGUF weight's bytes as float32 [rows, cols]."""
    qtype = GGMLQuantizationType(int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    data = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // block * size)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))


def qmatmul(raw: np.ndarray, qtype: GGMLQuantizationType | int, rows: int, cols: int, x: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[m, rows] = x[m, cols] @ W.T (+ bias), W the dequantized GGUF weight, float32."""
    w = dequantize(raw, qtype, rows, cols)
    y = x.float() @ w.T
    return y + bias if bias is not None else y


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' on-the-fly 8-bit quantization of activations, per 32 values.

    d = max|x| / 127 and q = round_half_even(x * (1 / d)) (q = 0 where d = 0), all in float32,
    the same operations as every ISA's kernel, so q and d here are bitwise what the kernels use.
    Returns q (int8, [m, cols]) and d (float32, [m, cols // 32]).
    """
    m, cols = x.shape
    xb = x.float().reshape(m, cols // Q8_BLOCK, Q8_BLOCK)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = (xb * inv.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8)
    return q.reshape(m, cols), d


def dequantize_activations(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q * d per 32-value block, in float64 (exact)."""
    m, cols = q.shape
    return (q.double().reshape(m, -1, Q8_BLOCK) * d.double().unsqueeze(-1)).reshape(m, cols)


def split_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = hi + lo as the `precise` matmul splits it: hi = q * d (float32) from
    quantize_activations, lo = x - hi (float32); the kernel then quantizes lo in turn."""
    m, cols = x.shape
    q, d = quantize_activations(x)
    hi = (q.float().reshape(m, -1, Q8_BLOCK) * d.unsqueeze(-1)).reshape(m, cols)
    return hi, x.float() - hi


def qmatmul_q8(raw: np.ndarray, qtype: GGMLQuantizationType | int, rows: int, cols: int,
               x: torch.Tensor) -> torch.Tensor:
    """What the integer kernels compute, in float64: the 8-bit activations of
    `quantize_activations` against the dequantized weight. The kernels differ from this only by
    float32 rounding of per-block scale products and of the accumulation."""
    w = dequantize(raw, qtype, rows, cols).double()
    return dequantize_activations(*quantize_activations(x)) @ w.T


# ---------------------------------------------------------------------------
# row ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)), in float32."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rms_norm(residual + x)); the kernel updates residual in place."""
    r = residual + x
    return r, rms_norm(r, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension (biased variance), in x's dtype."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight.to(x.dtype) + bias.to(x.dtype)


def add_layer_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """layer_norm(residual + x); the kernel leaves both inputs as they are."""
    return layer_norm(residual + x, weight, bias, eps)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x * Phi(x) = x / 2 * (1 + erf(x / sqrt 2)), or with approximate="tanh"
    x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))), in x's dtype (float64 for an exact reference)."""
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def attention_packed(qkv: torch.Tensor, heads: int, head_dim: int, seq_starts: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence and head, every row over all the rows of its own sequence.

    qkv [tokens, >= 3H], H = heads * head_dim, holds q, k, v in columns [0, H), [H, 2H), [2H, 3H); seq_starts
    [n_seqs + 1] = 0, len0, len0 + len1, ..., tokens. Returns [tokens, H] in qkv's dtype.
    """
    width = heads * head_dim
    out = torch.zeros(qkv.shape[0], width, dtype=qkv.dtype)
    starts = seq_starts.tolist()
    for a, b in zip(starts, starts[1:]):
        q, k, v = (qkv[a:b, i * width : (i + 1) * width].reshape(b - a, heads, head_dim).transpose(0, 1)
                   for i in range(3))
        p = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1)  # [heads, len, len]
        out[a:b] = (p @ v).transpose(0, 1).reshape(b - a, width)
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face / NeoX layout) of x [m, heads, head_dim] at
    positions [m], with tables cos/sin [max_pos, head_dim]."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rotated * s


def rope_and_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [m, (num_heads + 2 num_kv_heads) * head_dim] -> (q with RoPE [m, heads, head_dim], and copies
    of k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] with token i's RoPE'd k and its v
    written at flat slot slot_mapping[i], converted to the cache dtype; negative slots are not written)."""
    m = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rope(q.reshape(m, num_heads, head_dim), positions, cos, sin)
    k = rope(k.reshape(m, num_kv_heads, head_dim), positions, cos, sin)
    kc, vc = k_cache.clone(), v_cache.clone()
    keep = slot_mapping >= 0
    kc.view(-1, num_kv_heads, head_dim)[slot_mapping[keep]] = k[keep].to(kc.dtype)
    vc.view(-1, num_kv_heads, head_dim)[slot_mapping[keep]] = v.reshape(m, num_kv_heads, head_dim)[keep].to(vc.dtype)
    return q, kc, vc


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [m, 2n] = [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for gate_up [m, 2n] = [gate | up] (Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against a paged KV cache.

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads,
    head_dim]; block_table int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs]. Token t of
    sequence s is in block block_table[s, t // block_size] at offset t % block_size. Query head h
    uses KV head h // (num_heads // num_kv_heads). Returns [num_seqs, num_heads, head_dim]
    (zeros for an empty sequence), in q's dtype (pass float64 for an exact reference).

    window > 0: the query of a sequence of n tokens (at position n - 1) sees the keys at positions
    max(0, n - window) .. n - 1 only, as Hugging Face's sliding-window mask (a key at distance >= window
    is masked); the table's entries for blocks wholly before them are not looked at. softcap > 0: a
    score s becomes softcap * tanh(s / softcap) (Gemma 2). sinks [num_heads]: per head a logit that
    joins the softmax's denominator only, softmax([scores, sink])[:-1] @ values (gpt-oss).
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=q.dtype)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        if n == 0:
            continue
        t = torch.arange(max(0, n - window) if window > 0 else 0, n)
        blocks = block_table[s, t // block_size].long()
        keys = k_cache[blocks, t % block_size].to(q.dtype)  # [n, kv_heads, head_dim]
        values = v_cache[blocks, t % block_size].to(q.dtype)
        for h in range(num_heads):
            kv = h // group
            scores = (keys[:, kv] @ q[s, h]) * scale  # [n]
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is None:
                p = torch.softmax(scores, dim=0)
            else:
                p = torch.softmax(torch.cat([scores, sinks[h : h + 1].to(q.dtype)]), dim=0)[:-1]
            out[s, h] = p @ values[:, kv]
    return out


def lora_add(y: torch.Tensor, x: torch.Tensor, pairs, slots: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y + B_s @ (scales[t] * (A_s @ x[t])) for every token t whose slot s = slots[t] >= 0 has a pair (A [R, in],
    B [out, R]) in pairs (None: no adapter), in x's dtype (float64 for an exact reference); y is not written."""
    out = y.clone()
    for s, pair in enumerate(pairs):
        rows = slots.long() == s
        if pair is None or not bool(rows.any()):
            continue
        a, b = (w.to(x.dtype) for w in pair)
        out[rows] += ((x[rows] @ a.T) * scales[rows].to(x.dtype).unsqueeze(1)) @ b.T
    return out
