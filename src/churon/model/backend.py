"""The operations the transformer is written against: the Backend protocol, and the KVCache protocol
through which a backend reads and writes the K/V memory.

    ReferenceBackend  plain PyTorch in float32 (the exact reference path) or bfloat16
    NativeBackend     churon._cpu: quantized matmuls on 8-bit activations, fused row ops,
                      block-table attention; float32 activations

A backend turns a loader's weights into what its kernels read (matrix, vector) and runs the step's
arithmetic on them. It reads and writes the KV cache through the KVCache protocol: the engine owns
that memory (churon.engine.kv_cache) and passes it in with every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from churon.config import ModelConfig
from churon.model.kv_layout import KVLayout
from churon.model.batch import ForwardBatch
from churon.model.weights import RawWeight


class KVCache(Protocol):
    """The KV-cache memory as backends see it: per layer, K and V [num_blocks, block_size, kv_heads, head_dim]
    (int8 caches with float32 scales [num_blocks, block_size, kv_heads]), addressed by slot."""

    k: torch.Tensor  # [layers, num_blocks, block_size, kv_heads, head_dim] (layers: the layout's group size)
    v: torch.Tensor
    k_scale: torch.Tensor | None  # int8 caches only
    v_scale: torch.Tensor | None
    block_size: int
    dtype_name: str  # "float32", "bfloat16", "float16" or "int8"
    layout: KVLayout  # per model layer, its KV group and its index in k and v

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


class SequenceCache(KVCache, Protocol):
    """One sequence's cache, its block table 0, 1, 2, ... (churon.engine.kv_cache.SequenceKVCache)."""

    max_tokens: int
    block_table: list[int]


@dataclass
class RopeTables:
    """The RoPE cos / sin tables [positions, head_dim] of the global layers and of the windowed ones (Gemma 3's
    windowed layers have a base of their own; other models use the same tables for both)."""

    cos: torch.Tensor
    sin: torch.Tensor
    local_cos: torch.Tensor
    local_sin: torch.Tensor


@dataclass
class Experts:
    """An MoE layer's routed experts as a backend holds them (Backend.experts): expert e's gate and up projections
    stacked by rows, gate_up[e] [2 * ffn, hidden], and its down projection, down[e] [hidden, ffn], each made by the
    backend's matrix(); kernel: what the backend's moe_experts runs them with, beside the matrices (the native
    backend's churon._cpu.MoeExperts), or None."""

    gate_up: list[Any]
    down: list[Any]
    kernel: Any = None

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (*self.gate_up, *self.down))


class Backend(Protocol):
    name: str  # "reference" or "native"
    dtype: torch.dtype  # activations
    kv_dtype: torch.dtype  # the KV cache's default element type

    def matrix(self, w: RawWeight) -> Any: ...  # a weight matrix as the kernels read it (has .nbytes)

    def encoder_matrix(self, w: RawWeight) -> Any: ...  # an encoder's (embedding model's) matmul weight: see NativeBackend

    bf16_tiles: bool  # whether encoder_matrix puts float weights on the AMX-BF16 tiles (the native backend, there)

    def vector(self, w: RawWeight) -> torch.Tensor: ...  # a norm weight or bias

    def embedding(self, table: Any, ids: torch.Tensor) -> torch.Tensor: ...

    def linear(self, w: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def linear_precise(self, w: Any, x: torch.Tensor) -> torch.Tensor: ...  # the logits: more precise activations

    def linear_argmax(self, w: Any, x: torch.Tensor) -> torch.Tensor:
        """linear_precise where only each row's first maximum is read (greedy decoding): a backend may give less
        precise values where they are sure to lie below the row's maximum."""
        ...

    def prepare_argmax(self, w: Any) -> None:
        """Make w (the logits' matrix) ready for linear_argmax, before the memory is planned (what it builds counts
        in w.nbytes)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     x_norm: torch.Tensor | None = None) -> torch.Tensor:
        """residual += x (in place; with x_norm, += rms_norm(x, x_norm): Gemma's norms after attention and the MLP);
        returns rms_norm(residual)."""
        ...

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_layer_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> torch.Tensor:
        """layer_norm(residual + x) as a new tensor; residual and x are left as they are (BERT's post-norm)."""
        ...

    def gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """torch.nn.functional.gelu: "none" the exact (erf) GELU, "tanh" its tanh approximation."""
        ...

    def gelu_mlp(self, x: torch.Tensor, up: Any, up_bias: torch.Tensor, down: Any, down_bias: torch.Tensor,
                 approximate: str = "none") -> torch.Tensor:
        """linear(gelu(linear(x, up, up_bias), approximate), down, down_bias): an encoder layer's feed-forward
        block, up and down as encoder_matrix made them."""
        ...

    def attention_packed(self, qkv: torch.Tensor, heads: int, head_dim: int, seq_starts: torch.Tensor,
                         scale: float, bf16_tiles: bool = False) -> torch.Tensor:
        """Bidirectional (encoder) attention over sequences packed back to back without padding.

        qkv [tokens, >= 3H] float32, H = heads * head_dim (its row stride may exceed its width): q, k and v
        are its columns [0, H), [H, 2H), [2H, 3H). seq_starts int64 [n_seqs + 1]: 0, len0, len0 + len1, ...,
        tokens. Every token attends over all the tokens of its own sequence. Returns [tokens, H]. bf16_tiles (where
        the backend's bf16_tiles is true; head_dim 32 or 64): on the AMX-BF16 tiles, in bfloat16.
        """
        ...

    def rope_and_cache(self, qkv: torch.Tensor, shape: tuple[int, int, int], batch: ForwardBatch, cos: torch.Tensor,
                       sin: torch.Tensor, cache: KVCache, layer: int,
                       head_norms: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0) -> torch.Tensor:
        """RoPE on q and k of qkv [tokens, (heads + 2 kv_heads) * head_dim]; k and v into the cache. Returns q.
        head_norms: (q_norm, k_norm) weights [head_dim]: each q and k head is rms_norm'ed first (Qwen3, Gemma 3)."""
        ...

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor: ...  # silu(gate) * up, gate the first half's columns

    def experts(self, gate_up: list[RawWeight], down: list[RawWeight]) -> Experts: ...  # an MoE layer's experts

    def moe_experts(self, experts: Experts, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                    normalize: bool = False) -> torch.Tensor:
        """The routed experts' output for h [tokens, hidden]: out[t] = sum over r of w[t, r] *
        down_e(swiglu(gate_up_e(h[t]))), e = chosen[t, r], the k terms (chosen int64 and weights float32, [tokens, k])
        each rounded to h's dtype, then added in rank order; w = weights, or with normalize weights[t] divided by
        their sum (added in rank order). What experts_one_by_one computes; on the native backend bitwise, a token's
        result independent of the batch and of the thread count."""
        ...

    def routed_experts(self, router: Any, experts: Experts, h: torch.Tensor, k: int,
                       normalize: bool = False) -> torch.Tensor:
        """The routed MLP of the softmax routers (every MoE family but gpt-oss) on h [tokens, hidden]: the router's
        logits (router [experts, hidden], from matrix()), each token's k most probable experts under their float32
        softmax (softmax_top_k), moe_experts over them. On the native backend one call, row by row: a token's experts
        and result do not depend on the batch."""
        ...

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor: ...  # gelu_tanh(gate) * up (Gemma's MLP)

    # gpt-oss's experts: gate clamped to at most limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)
    def swiglu_clamped(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor: ...

    def attention(self, q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, scale: float,
                  window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of each sequence's new tokens q [tokens, heads, head_dim] over its cached keys.

        window > 0: a query at position p sees keys p - window + 1 .. p only. softcap > 0: each score s (scale
        included) becomes softcap * tanh(s / softcap) before the softmax (Gemma 2). sinks [heads] float32: a logit
        per head that joins the softmax's denominator only (gpt-oss)."""
        ...

    def decoder_stack(self, config: ModelConfig, layers: Sequence[Any], embed: Any, norm: torch.Tensor,
                      rope: RopeTables, attention_scale: float) -> Any | None:
        """A decoder's whole layer stack as one call, or None where this backend (or this model) runs it op by op:
        an object whose hidden_states(batch, cache) is bitwise Transformer.hidden_states' per-op result for a batch
        without LoRA slots. layers: the model's LayerWeights; embed: its token embeddings as matrix() made them."""
        ...

    def lora_stack(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> Any:
        """One fused matrix's LoRA adapters by slot: (A [R, in], B [out, R]) float32 with the module scales
        folded into B, or None where that slot has no adapter on this matrix. The result is what add_lora reads."""
        ...

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, stack: Any, slots: torch.Tensor, scales: torch.Tensor) -> None:
        """In place: y[t] += B_s @ (scales[t] * (A_s @ x[t])) for every token t whose slot s = slots[t] >= 0 has a
        pair in stack. x [tokens, in], y [tokens, out] (rows may be strided), slots int32 [tokens] (-1: none),
        scales float32 [tokens] (the request's lora_scale). A token's result depends only on its own row and
        adapter (the native backend: bitwise, whatever else is in the batch)."""
        ...


def experts_one_by_one(b: Backend, experts: Experts, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                       normalize: bool = False, expert: Callable[[int, torch.Tensor], torch.Tensor] | None = None
                       ) -> torch.Tensor:
    """Backend.moe_experts through b's linear and swiglu, one expert at a time over the tokens that chose it (the
    reference backend's moe_experts, and what the native kernel must equal bit for bit). expert(e, rows): another
    expert form's MLP of expert e (gpt-oss's clamped SwiGLU with biases) instead of the plain SwiGLU."""
    if normalize:
        weights = weights / sum_columns(weights)[:, None]
    if expert is None:
        def expert(e: int, x: torch.Tensor) -> torch.Tensor:
            return b.linear(experts.down[e], b.swiglu(b.linear(experts.gate_up[e], x)))
    per_rank = torch.zeros(h.shape[0], chosen.shape[1], h.shape[1], dtype=h.dtype)
    for e in chosen.unique().tolist():
        tokens, ranks = (chosen == e).nonzero(as_tuple=True)
        y = expert(e, h[tokens])
        per_rank[tokens, ranks] = y * weights[tokens, ranks, None].to(y.dtype)
    return sum_columns(per_rank)


def softmax_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, chosen) [tokens, k]: each row's k most probable experts, best first, and their probabilities under
    the float32 softmax of the router's logits."""
    weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    return weights, chosen


def sum_columns(x: torch.Tensor) -> torch.Tensor:
    """x[:, 0] + x[:, 1] + ... in that order: a token's sum of its k terms is the same bits whatever the batch (a
    reduction kernel's order may follow the tensor's shape)."""
    out = x[:, 0].clone()
    for i in range(1, x.shape[1]):
        out += x[:, i]
    return out
