"""Tensor-level wrappers around churon._cpu: check dtypes, shapes and contiguity, then pass
pointers. Each costs a few microseconds of Python over the raw call; a hot decode loop can
call churon.kernels.cpu directly with cached pointers instead.

Every function raises RuntimeError (with churon.kernels.reason) when the extension is not built.
"""

from __future__ import annotations

import numpy as np
import torch

from churon import kernels


def _cpu():
    if kernels.cpu is None:
        raise RuntimeError(kernels.reason)
    return kernels.cpu


KV_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _kv_dtype(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"KV caches must both be float32, float16 or bfloat16, got {k_cache.dtype} and {v_cache.dtype}")
    return KV_DTYPES[k_cache.dtype]


def _check(t: torch.Tensor, name: str, dtype: torch.dtype = torch.float32) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _out(out: torch.Tensor | None, shape: tuple[int, ...], name: str = "out") -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    _check(out, name)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    return out


def check_seq_starts(seq_starts: torch.Tensor, tokens: int) -> None:
    """seq_starts of sequences packed back to back: int64 [n_seqs + 1], 0, then never decreasing, ending at
    tokens (an empty sequence owns no rows). Raises ValueError naming what is wrong."""
    if seq_starts.dtype != torch.int64 or seq_starts.dim() != 1 or seq_starts.numel() < 1:
        raise ValueError(f"seq_starts must be a 1-D int64 tensor [n_seqs + 1], got {seq_starts.dtype} "
                         f"{tuple(seq_starts.shape)}")
    if int(seq_starts[0]) != 0 or int(seq_starts[-1]) != tokens:
        raise ValueError(f"seq_starts must run from 0 to the {tokens} tokens, got {int(seq_starts[0])} .. "
                         f"{int(seq_starts[-1])}")
    steps = seq_starts[1:] - seq_starts[:-1]
    if steps.numel() and int(steps.min()) < 0:
        i = int(torch.nonzero(steps < 0)[0])
        raise ValueError(f"seq_starts must not decrease: seq_starts[{i}] = {int(seq_starts[i])} > "
                         f"seq_starts[{i + 1}] = {int(seq_starts[i + 1])}")


class QuantizedMatrix:
    """A GGUF weight [rows, cols] held in the native repacked layout; `self(x)` is x @ W.T."""

    def __init__(self, raw: np.ndarray, qtype: int, rows: int, cols: int):
        self.q = _cpu().QMatrix(np.ascontiguousarray(raw).reshape(-1).view(np.uint8), int(qtype), int(rows), int(cols))
        self.rows, self.cols = int(rows), int(cols)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 precise: bool = False) -> torch.Tensor:
        """x @ W.T (+ bias); precise: activations at ~16 bits (x = hi + lo, each quantized to 8 bits)."""
        _check(x, "x")
        if x.shape[-1] != self.cols:
            raise ValueError(f"x has {x.shape[-1]} features, the matrix has {self.cols} columns")
        m = x.numel() // self.cols
        y = _out(out, tuple(x.shape[:-1]) + (self.rows,))
        if bias is not None:
            _check(bias, "bias")
            if bias.numel() != self.rows:
                raise ValueError(f"bias has {bias.numel()} values, expected {self.rows}")
        self.q.matmul(x.data_ptr(), y.data_ptr(), m, bias.data_ptr() if bias is not None else 0, precise)
        return y

    def dequantize(self) -> torch.Tensor:
        out = torch.empty(self.rows, self.cols, dtype=torch.float32)
        self.q.dequantize(out.data_ptr())
        return out

    def dequantize_bf16(self) -> torch.Tensor:
        out = torch.empty(self.rows, self.cols, dtype=torch.bfloat16)
        self.q.dequantize_bf16(out.data_ptr())
        return out

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup): [*ids.shape, cols]."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(tuple(ids.shape) + (self.cols,), dtype=torch.float32)
        self.q.dequantize_rows(ids.data_ptr(), ids.numel(), out.data_ptr())
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, "x")
    _check(weight, "weight")
    n = x.shape[-1]
    out = _out(out, tuple(x.shape))
    _cpu().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, float(eps))
    return out


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual)."""
    _check(residual, "residual")
    _check(x, "x")
    _check(weight, "weight")
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    n = x.shape[-1]
    out = _out(out, tuple(x.shape))
    _cpu().add_rms_norm(residual.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n,
                        float(eps))
    return out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    return _layer_norm(None, x, weight, bias, eps, out)


def add_layer_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """layer_norm(residual + x); residual and x are not written (unless out is one of them)."""
    _check(residual, "residual")
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    return _layer_norm(residual, x, weight, bias, eps, out)


def _layer_norm(residual: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                out: torch.Tensor | None) -> torch.Tensor:
    _check(x, "x")
    _check(weight, "weight")
    _check(bias, "bias")
    n = x.shape[-1]
    if weight.numel() != n or bias.numel() != n:
        raise ValueError(f"weight ({weight.numel()}) and bias ({bias.numel()}) must have x's {n} features")
    out = _out(out, tuple(x.shape))
    _cpu().layer_norm(x.data_ptr(), residual.data_ptr() if residual is not None else 0, weight.data_ptr(),
                      bias.data_ptr(), out.data_ptr(), x.numel() // n, n, float(eps))
    return out


def gelu(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.gelu: approximate "none" (erf) or "tanh"."""
    _check(x, "x")
    out = _out(out, tuple(x.shape))
    _cpu().gelu(x.data_ptr(), out.data_ptr(), x.numel(), approximate)
    return out


def attention_packed(qkv: torch.Tensor, heads: int, head_dim: int, seq_starts: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, bf16_tiles: bool = False) -> torch.Tensor:
    """Bidirectional attention of every row over its own sequence's rows, sequences packed back to back.

    qkv float32 [tokens, >= 3H] (rows may be strided, columns not), H = heads * head_dim: q, k, v in its
    columns [0, H), [H, 2H), [2H, 3H); seq_starts int64 [n_seqs + 1] (check_seq_starts). Returns [tokens, H].
    bf16_tiles: on the AMX-BF16 tiles (cpu.bf16_tiles_available(); head_dim 32 or 64), q, k, v and the softmax
    weights rounded to bfloat16, the products summed in float32.
    """
    if qkv.dtype != torch.float32 or qkv.device.type != "cpu" or qkv.dim() != 2 or qkv.stride(1) != 1:
        raise ValueError("qkv must be a float32 CPU tensor [tokens, >= 3 * heads * head_dim] with unit column stride")
    if heads < 1 or head_dim < 1 or qkv.shape[1] < 3 * heads * head_dim:
        raise ValueError(f"qkv has {qkv.shape[1]} columns; {heads} heads of {head_dim} need 3 * {heads * head_dim}")
    tokens = qkv.shape[0]
    check_seq_starts(seq_starts, tokens)
    seq_starts = seq_starts.contiguous()
    out = _out(out, (tokens, heads * head_dim))
    if tokens:
        _cpu().attention_packed(qkv.data_ptr(), seq_starts.data_ptr(), out.data_ptr(), tokens, seq_starts.numel() - 1,
                                heads, head_dim, float(scale), qkv.stride(0) if tokens > 1 else qkv.shape[1], bf16_tiles)
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In-place RoPE of x [m, heads, head_dim] (rows may be strided, heads packed)."""
    if x.dtype != torch.float32 or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError("x must be float32 [m, heads, head_dim] with packed heads")
    _check(cos, "cos")
    _check(sin, "sin")
    positions = positions.to(torch.int64).contiguous()
    if positions.numel() and int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"position {int(positions.max())} is beyond the RoPE table ({cos.shape[0]} positions)")
    m, heads, head_dim = x.shape
    _cpu().rope(x.data_ptr(), m, heads, head_dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.stride(0))
    return x


def rope_and_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place on qkv [m, (num_heads + 2 num_kv_heads) * head_dim] (rows may be strided): RoPE on q and k,
    then k and v written into the caches [num_blocks, block_size, num_kv_heads, head_dim] at the flat
    slots slot_mapping [m] (negative: skipped)."""
    if qkv.dtype != torch.float32 or qkv.dim() != 2 or qkv.stride(1) != 1:
        raise ValueError("qkv must be float32 [m, (num_heads + 2 num_kv_heads) * head_dim] with unit column stride")
    _check(cos, "cos")
    _check(sin, "sin")
    kv_dtype = _kv_dtype(k_cache, v_cache)
    _check(k_cache, "k_cache", k_cache.dtype)
    _check(v_cache, "v_cache", v_cache.dtype)
    head_dim = k_cache.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or k_cache.shape[-2] != num_kv_heads:
        raise ValueError("qkv, num_heads, num_kv_heads and the cache shape disagree")
    if v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache differ in shape")
    positions = positions.to(torch.int64).contiguous()
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    m = qkv.shape[0]
    if positions.numel() != m or slot_mapping.numel() != m:
        raise ValueError("positions and slot_mapping need one entry per token")
    if m and int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"position {int(positions.max())} is beyond the RoPE table ({cos.shape[0]} positions)")
    if m and int(slot_mapping.max()) >= k_cache.numel() // (num_kv_heads * head_dim):
        raise ValueError("slot_mapping holds a slot outside the cache")
    _cpu().rope_and_cache(qkv.data_ptr(), m, num_heads, num_kv_heads, head_dim, positions.data_ptr(), cos.data_ptr(),
                          sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), qkv.stride(0),
                          kv_dtype)


def swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2n] = [gate | up]."""
    return _gated(_cpu().swiglu, gate_up, out)


def geglu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for gate_up [..., 2n] = [gate | up]."""
    return _gated(_cpu().geglu, gate_up, out)


def _gated(kernel, gate_up: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    _check(gate_up, "gate_up")
    n = gate_up.shape[-1] // 2
    out = _out(out, tuple(gate_up.shape[:-1]) + (n,))
    kernel(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * n), n)
    return out


def moe_experts(experts, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, normalize: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """An MoE layer's routed experts (experts: a churon._cpu.MoeExperts) on h [tokens, hidden] float32: out[t] = the
    sum over r, in rank order, of w[t, r] * down_e(swiglu(gate_up_e(h[t]))), e = ids[t, r]; ids int64 and weights
    float32 [tokens, k], all contiguous; w = weights, or with normalize weights[t] / their rank-ordered sum. An
    expert id outside [0, experts.num_experts) raises IndexError. The checks are one expression (this runs once a
    layer and step); only a failing call works out which argument is wrong."""
    tokens, k = ids.shape[0], ids.shape[-1]
    f32 = torch.float32
    if not (h.dtype is f32 and weights.dtype is f32 and ids.dtype is torch.int64 and h.is_cpu and ids.is_cpu
            and weights.is_cpu and h.shape == (tokens, experts.hidden) and ids.shape == (tokens, k) and k >= 1
            and weights.shape == ids.shape and h.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()):
        _moe_argument_error(experts, h, ids, weights)
    out = torch.empty(tokens, experts.hidden) if out is None else _out(out, (tokens, experts.hidden))
    experts.forward(h.data_ptr(), tokens, ids.data_ptr(), weights.data_ptr(), k, out.data_ptr(), normalize)
    return out


def routed_experts(experts, router, h: torch.Tensor, k: int, normalize: bool = False) -> torch.Tensor:
    """moe_experts with the softmax router's routing in the same call (churon._cpu.MoeExperts.forward_routed):
    router a QMatrix [experts, hidden]; each token's k most probable experts under the float32 softmax of its
    logits, best first, their probabilities the weights (renormalized with normalize)."""
    if not (h.dtype is torch.float32 and h.is_cpu and h.dim() == 2 and h.shape[1] == experts.hidden
            and h.is_contiguous()):
        _check(h, "h")
        raise ValueError(f"h must be [tokens, {experts.hidden}] (the experts' hidden size), got {tuple(h.shape)}")
    out = torch.empty(h.shape[0], experts.hidden)
    experts.forward_routed(router, h.data_ptr(), h.shape[0], k, out.data_ptr(), normalize)
    return out


def _moe_argument_error(experts, h, ids, weights):
    for t, name, dtype in ((h, "h", torch.float32), (ids, "ids", torch.int64), (weights, "weights", torch.float32)):
        _check(t, name, dtype)
    if h.dim() != 2 or h.shape[1] != experts.hidden:
        raise ValueError(f"h must be [tokens, {experts.hidden}] (the experts' hidden size), got {tuple(h.shape)}")
    if ids.dim() != 2 or ids.shape[0] != h.shape[0] or ids.shape[1] < 1:
        raise ValueError(f"ids must be [{h.shape[0]}, k] (a row of k >= 1 expert ids per token of h), got "
                         f"{tuple(ids.shape)}")
    raise ValueError(f"weights must have the shape of ids {tuple(ids.shape)}, got {tuple(weights.shape)}")


def softmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, "x")
    n = x.shape[-1]
    out = _out(out, tuple(x.shape))
    _cpu().softmax(x.data_ptr(), out.data_ptr(), x.numel() // n, n)
    return out


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim]
    (float32, float16 or bfloat16); block_table int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs].
    window > 0: a sequence of n tokens reads its last min(n, window) positions only (the table's entries
    for the blocks before them are not read, nor checked); softcap > 0: scores s -> softcap * tanh(s /
    softcap); sinks float32 [num_heads]: logits in each head's softmax denominator only
    (ground_truth.attention_decode)."""
    _check(q, "q")
    kv_dtype = _kv_dtype(k_cache, v_cache)
    _check(k_cache, "k_cache", k_cache.dtype)
    _check(v_cache, "v_cache", v_cache.dtype)
    _check(block_table, "block_table", torch.int32)
    _check(seq_lens, "seq_lens", torch.int32)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kd = k_cache.shape
    if kd != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim]")
    if block_table.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError("block_table and seq_lens need one row per sequence")
    if num_seqs and int(seq_lens.min()) < 0:
        raise ValueError("seq_lens must not be negative")
    if window < 0 or not 0.0 <= softcap < float("inf"):
        raise ValueError(f"window must be >= 0 and softcap finite and >= 0, got {window} and {softcap}")
    if sinks is not None:
        _check(sinks, "sinks")
        if tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have one logit per query head ({num_heads}), got shape {tuple(sinks.shape)}")
    # only the blocks a sequence reads must be valid; the rest of its row is padding, or blocks before its window
    lens = seq_lens.long().unsqueeze(1)
    first = (lens - window).clamp(min=0) // block_size if window > 0 else torch.zeros_like(lens)
    blocks = torch.arange(block_table.shape[1])
    ids = block_table[(blocks >= first) & (blocks < (lens + block_size - 1) // block_size)]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k_cache.shape[0]):
        raise ValueError("block_table holds a block id outside the cache")
    out = _out(out, (num_seqs, num_heads, head_dim))
    _cpu().attention_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                            seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
                            block_size, float(scale), block_table.shape[1], 0, kv_dtype, 0, 0, int(window),
                            float(softcap), sinks.data_ptr() if sinks is not None else 0)
    return out


LORA_BAND_ROWS = 16  # B's outputs are sorted into bands by their nonzero ranks this many rows at a time


class LoraStack:
    """One matrix's LoRA adapters by slot, as the lora_add kernel reads them: per slot with a pair, A [R, in]
    and B's transpose [R, out] (the expand pass reads a row of `out` values per rank), float32, and B's
    bands: runs of outputs whose nonzero entries lie in one range of ranks, so that the kernel skips the zero
    blocks of a fused matrix's block-diagonal B (the q, k and v outputs each read their own ranks only).
    `table` int64 [slots, 5] is the kernel's slot table (A's and Bt's addresses, the rank, the bands'
    address and count; zeros where a slot has no pair)."""

    def __init__(self, pairs):
        self.slots = len(pairs)
        self.in_features = self.out_features = None
        self.a: list[torch.Tensor | None] = []
        self.bt: list[torch.Tensor | None] = []
        self.bands: list[torch.Tensor | None] = []
        self.table = torch.zeros(max(self.slots, 1), 5, dtype=torch.int64)
        for s, pair in enumerate(pairs):
            if pair is None:
                self.a.append(None)
                self.bt.append(None)
                self.bands.append(None)
                continue
            a, b = pair
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
                raise ValueError(f"LoRA slot {s}: A {tuple(a.shape)} and B {tuple(b.shape)} must be [R, in] and "
                                 f"[out, R] with the same rank R >= 1")
            if self.in_features is None:
                self.in_features, self.out_features = a.shape[1], b.shape[0]
            elif (a.shape[1], b.shape[0]) != (self.in_features, self.out_features):
                raise ValueError(f"LoRA slot {s}: A {tuple(a.shape)} and B {tuple(b.shape)} do not map "
                                 f"{self.in_features} features to {self.out_features} like the other slots")
            a = a.detach().to(torch.float32).contiguous()
            b = b.detach().to(torch.float32)
            bt = b.T.contiguous()
            bands = _lora_bands(b)
            self.a.append(a)
            self.bt.append(bt)
            self.bands.append(bands)
            self.table[s] = torch.tensor([a.data_ptr(), bt.data_ptr(), a.shape[0], bands.data_ptr(), bands.shape[0]])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.a + self.bt + self.bands if t is not None)


def _lora_bands(b: torch.Tensor) -> torch.Tensor:
    """int64 [n, 4] (o0, o1, r0, r1), ascending and disjoint: B's nonzero entries of rows [o0, o1) lie in columns
    [r0, r1); rows in no band are zero. Decided LORA_BAND_ROWS rows at a time (the union of their columns), so
    that a stray zero weight never splits a band; a fused B's parts begin at multiples of 16 rows."""
    out, rank = b.shape
    groups = -(-out // LORA_BAND_ROWS)
    nonzero = torch.zeros(groups * LORA_BAND_ROWS, rank, dtype=torch.bool)
    nonzero[:out] = b != 0
    cols = nonzero.view(groups, LORA_BAND_ROWS, rank).any(1).to(torch.int8)  # [groups, rank]
    used = cols.any(1)
    first = torch.where(used, cols.argmax(1), -1)
    end = torch.where(used, rank - cols.flip(1).argmax(1), -1)
    keys = torch.stack([first, end], 1)
    starts = torch.ones(groups, dtype=torch.bool)
    starts[1:] = (keys[1:] != keys[:-1]).any(1)
    g0 = starts.nonzero().squeeze(1)
    g1 = torch.cat([g0[1:], torch.tensor([groups])])
    bands = torch.stack([g0 * LORA_BAND_ROWS, (g1 * LORA_BAND_ROWS).clamp(max=out), keys[g0, 0], keys[g0, 1]], 1)
    return bands[bands[:, 2] >= 0].contiguous()


def lora_add(y: torch.Tensor, x: torch.Tensor, stack: LoraStack, slots: torch.Tensor,
             scales: torch.Tensor) -> torch.Tensor:
    """In place: y[t] += B_s @ (scales[t] * (A_s @ x[t])) for every token t whose slot s = slots[t] >= 0 has a
    pair in stack; returns y. x float32 [tokens, in], y float32 [tokens, out] (rows of either may be strided,
    columns not), slots int32 [tokens] (-1: none), scales float32 [tokens]. The checks are one expression (this
    runs four times a layer); only a failing call works out which argument is wrong."""
    fin, fout = stack.in_features, stack.out_features
    if fin is None:  # no slot has a pair
        return y
    tokens = x.shape[0]
    f32 = torch.float32
    if not (x.dtype is f32 and y.dtype is f32 and scales.dtype is f32 and slots.dtype is torch.int32
            and x.is_cpu and y.is_cpu and slots.is_cpu and scales.is_cpu
            and x.shape == (tokens, fin) and y.shape == (tokens, fout) and slots.shape == (tokens,)
            and scales.shape == (tokens,) and x.stride(1) == 1 and y.stride(1) == 1
            and slots.is_contiguous() and scales.is_contiguous()):
        _lora_argument_error(y, x, stack, slots, scales)
    _cpu().lora_add(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), tokens, fin, fout, slots.data_ptr(),
                    scales.data_ptr(), stack.table.data_ptr(), stack.slots)
    return y


def _lora_argument_error(y, x, stack: LoraStack, slots, scales):
    for t, name in ((x, "x"), (y, "y")):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"lora_add: {name} must be a float32 CPU tensor [tokens, features] with unit column "
                             f"stride, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    _check(slots, "lora_add: slots", torch.int32)
    _check(scales, "lora_add: scales")
    if y.shape[0] != x.shape[0] or slots.shape != x.shape[:1] or scales.shape != x.shape[:1]:
        raise ValueError(f"lora_add: x {tuple(x.shape)}, y {tuple(y.shape)}, slots {tuple(slots.shape)} and scales "
                         f"{tuple(scales.shape)} must have one row per token")
    raise ValueError(f"lora_add: x {tuple(x.shape)} and y {tuple(y.shape)} do not match the adapters' "
                     f"{stack.in_features} -> {stack.out_features} features")
