"""One decoder-only transformer; Llama, Qwen2 and Qwen3 differ only by ModelConfig flags.

Weights come in as a dict with the canonical names listed by `expected_weight_shapes`
(Hugging Face's names without the "model." prefix), as GGUF bytes or float tensors; the
backend (churon.model.backend) turns them into what its kernels read. The forward pass
reads top to bottom in `Transformer.forward_batch` and, for each layer, `DecoderBlock.__call__`.
LoRA adapters (churon.model.lora) add their low-rank deltas after each of a layer's four matmuls, for
the tokens of a batch that carry an adapter slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from churon.config import ModelConfig
from churon.model.backend import Backend, KVCache, SequenceCache
from churon.model.batch import ForwardBatch, SequenceChunk
from churon.model.lora import LoraSlots
from churon.model.reference_backend import ReferenceBackend
from churon.model.rope import rope_inv_freq, rope_tables
from churon.model.weights import RawWeight, concat_rows, dense


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model needs, by canonical name, with its shape (rows first)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, c.hidden_size), "norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        shapes |= {
            f"layers.{i}.input_layernorm.weight": (c.hidden_size,),
            f"layers.{i}.post_attention_layernorm.weight": (c.hidden_size,),
            a + "q_proj.weight": (q, c.hidden_size),
            a + "k_proj.weight": (kv, c.hidden_size),
            a + "v_proj.weight": (kv, c.hidden_size),
            a + "o_proj.weight": (c.hidden_size, q),
            m + "gate_proj.weight": (c.intermediate_size, c.hidden_size),
            m + "up_proj.weight": (c.intermediate_size, c.hidden_size),
            m + "down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
        if c.qk_norm:
            shapes |= {a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)}
    return shapes


@dataclass
class LayerWeights:
    """One decoder layer's weights as its backend holds them. q/k/v and gate/up are fused into one matrix
    each, so a layer costs three matmuls on the way in and two on the way out."""

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


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, RawWeight],
        backend: Backend | None = None,
    ):
        """weights: canonical name -> GGUF tensor or float tensor.

        An optional "rope_freqs.weight" holds per-dimension RoPE frequency divisors (GGUF's Llama 3 scaling).
        """
        self.config = config
        self.backend = backend or ReferenceBackend()
        self.dtype = self.backend.dtype
        self.kv_dtype = self.backend.kv_dtype
        b = self.backend
        freq_factors = weights.get("rope_freqs.weight")
        self.block = DecoderBlock(config, b, dense(freq_factors) if freq_factors is not None else None)
        self.embed_tokens = b.matrix(weights["embed_tokens.weight"])
        self.layers = [LayerWeights.build(config, i, weights, b) for i in range(config.num_layers)]
        self.norm = b.vector(weights["norm.weight"])
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else b.matrix(weights["lm_head.weight"])
        self.lora: LoraSlots | None = None  # enable_lora

    def enable_lora(self, max_loras: int) -> LoraSlots:
        """max_loras adapter slots over this model's weights (they stay as they are: adapters apply unmerged)."""
        if self.lora is not None:
            raise ValueError(f"LoRA is already enabled on this model ({self.lora.max_loras} slots)")
        self.lora = LoraSlots(self.config, self.backend, max_loras)
        return self.lora

    def weight_bytes(self) -> int:
        objects = {id(self.embed_tokens): self.embed_tokens, id(self.lm_head): self.lm_head, id(self.norm): self.norm}
        for layer in self.layers:
            for w in vars(layer).values():
                if w is not None:
                    objects[id(w)] = w
        return sum(w.nbytes for w in objects.values())  # torch tensors and native matrices alike

    def __call__(self, tokens: torch.Tensor, start: int, cache: SequenceCache, all_logits: bool = False,
                 lora_slot: int = -1, lora_scale: float = 1.0) -> torch.Tensor:
        """One sequence: run tokens ([n] ids at positions start..start+n-1) and return float32 logits.

        Only the last position's logits ([1, vocab]) unless all_logits ([n, vocab]); under the adapter in
        lora_slot (of enable_lora's slots) when it is >= 0.
        """
        end = start + tokens.shape[0]
        if end > cache.max_tokens:
            raise ValueError(f"positions up to {end} do not fit a cache of {cache.max_tokens} tokens")
        token_ids = [0] * start + tokens.tolist()  # ids before start are in the cache already
        chunk = SequenceChunk(token_ids, start, cache.block_table, all_logits=all_logits, lora_slot=lora_slot,
                              lora_scale=lora_scale)
        return self.forward_batch(ForwardBatch.build([chunk], cache.block_size), cache)

    @torch.inference_mode()
    def forward_batch(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run a step of many sequences; float32 logits of the rows batch.logits_indices names."""
        return self.backend.linear_precise(self.lm_head, self.hidden_states(batch, cache)).float()

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run a step of many sequences; the final hidden states (after the last norm) of the rows
        batch.logits_indices names: what the logits are computed from, and what a decoder embedder pools."""
        b, eps = self.backend, self.config.rms_norm_eps
        lora = None
        if batch.lora_slots is not None:
            if self.lora is None:
                raise ValueError("the batch runs sequences under LoRA slots, but LoRA is not enabled on this model")
            if int(batch.lora_slots.max()) >= self.lora.max_loras:
                raise ValueError(f"LoRA slot {int(batch.lora_slots.max())} is out of range: this model has slots "
                                 f"0..{self.lora.max_loras - 1}")
            lora = self.lora.layers
        x = b.embedding(self.embed_tokens, batch.input_ids)  # the residual stream, [tokens, hidden]
        h = b.rms_norm(x, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            down = self.block(layer, x, h, batch, cache, i, lora[i] if lora is not None else None)
            if i + 1 < len(self.layers):  # the MLP's residual add fused with the next layer's input norm
                h = b.add_rms_norm(x, down, self.layers[i + 1].input_norm, eps)
        rows = batch.logits_indices
        return b.add_rms_norm(x[rows], down[rows], self.norm, eps)


class DecoderBlock:
    """One decoder layer's arithmetic, with what all layers share (RoPE tables, head geometry); the
    layer's weights come with each call, so a caller holding one layer at a time (quantization's
    calibration) runs the same code as the whole model."""

    def __init__(self, config: ModelConfig, backend: Backend,
                 freq_factors: torch.Tensor | None = None):
        """freq_factors: per-dimension RoPE frequency divisors (GGUF's rope_freqs.weight, Llama 3 scaling)."""
        self.config = config
        self.backend = backend
        self.cos, self.sin = rope_tables(rope_inv_freq(config, freq_factors), config.context_length)
        self.scale = config.head_dim**-0.5
        c = config
        self.split = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        self.heads = (c.num_heads, c.num_kv_heads, c.head_dim)

    def __call__(self, layer: LayerWeights, x: torch.Tensor, h: torch.Tensor, batch: ForwardBatch,
                 cache: KVCache, cache_layer: int, lora: dict[str, Any] | None = None) -> torch.Tensor:
        """x: the residual stream [tokens, hidden]; h: x after the layer's input norm. Adds the attention's
        output to x in place and returns the MLP's output (for the caller to add, fused with the next norm).
        K and V go to the cache's layer cache_layer. lora: the layer's LoRA stacks by fused matrix
        (LoraSlots.layers[i]), given when the batch carries adapter slots."""
        b, c, eps = self.backend, self.config, self.config.rms_norm_eps
        n = batch.num_tokens
        # attention
        qkv = b.linear(layer.qkv, h, layer.qkv_bias)
        if lora:  # the adapters' deltas on the bias-added q/k/v, before q/k norm and RoPE
            self.add_lora(lora, "qkv", qkv, h, batch)
        if layer.q_norm is not None:  # Qwen3: RMSNorm over each head of q and of k, before RoPE
            q_size, kv_size = self.split[0], self.split[1]
            qkv[:, :q_size] = b.rms_norm(qkv[:, :q_size].reshape(-1, c.head_dim), layer.q_norm, eps).view(n, -1)
            k_cols = slice(q_size, q_size + kv_size)
            qkv[:, k_cols] = b.rms_norm(qkv[:, k_cols].reshape(-1, c.head_dim), layer.k_norm, eps).view(n, -1)
        q = b.rope_and_cache(qkv, self.heads, batch, self.cos, self.sin, cache, cache_layer)
        attn = b.attention(q, cache, cache_layer, batch, self.scale).reshape(n, -1)
        o = b.linear(layer.o, attn)
        if lora:
            self.add_lora(lora, "o", o, attn, batch)
        h = b.add_rms_norm(x, o, layer.post_norm, eps)
        # SwiGLU MLP
        gate_up = b.linear(layer.gate_up, h)
        if lora:
            self.add_lora(lora, "gate_up", gate_up, h, batch)
        act = b.swiglu(gate_up)
        down = b.linear(layer.down, act)
        if lora:
            self.add_lora(lora, "down", down, act, batch)
        return down

    def add_lora(self, lora: dict[str, Any], matrix: str, y: torch.Tensor, x: torch.Tensor,
                 batch: ForwardBatch) -> None:
        """y (= matrix's output for x) += its adapters' deltas, each token its own slot's, when some loaded
        adapter touches the matrix."""
        stack = lora.get(matrix)
        if stack is not None:
            self.backend.add_lora(y, x, stack, batch.lora_slots, batch.lora_scales)
