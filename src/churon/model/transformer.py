"""One decoder-only transformer; Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3 differ only by ModelConfig
flags (and the sizes, windows and soft-caps their files give).

Weights come in as a dict with the canonical names listed by `expected_weight_shapes`
(Hugging Face's names without the "model." prefix), as GGUF bytes or float tensors; the
backend (churon.model.backend) turns them into what its kernels read. The forward pass
reads top to bottom in `Transformer.forward_batch` and, for each layer, `DecoderBlock.__call__`.
LoRA adapters (churon.model.lora) add their low-rank deltas after each of a layer's four matmuls, for
the tokens of a batch that carry an adapter slot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from churon.config import ModelConfig
from churon.model.backend import Backend, KVCache, SequenceCache
from churon.model.batch import ForwardBatch, SequenceChunk
from churon.model.lora import LoraSlots
from churon.model.reference_backend import ReferenceBackend
from churon.model.rope import rope_tables
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
        if c.fused_projections:
            qkv = {a + "qkv_proj.weight": (q + 2 * kv, c.hidden_size)}
            gate_up = {m + "gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size)}
        else:
            qkv = {a + "q_proj.weight": (q, c.hidden_size), a + "k_proj.weight": (kv, c.hidden_size),
                   a + "v_proj.weight": (kv, c.hidden_size)}
            gate_up = {m + "gate_proj.weight": (c.intermediate_size, c.hidden_size),
                       m + "up_proj.weight": (c.intermediate_size, c.hidden_size)}
        shapes |= {
            f"layers.{i}.input_layernorm.weight": (c.hidden_size,),
            f"layers.{i}.{_mlp_norm_name(c)}": (c.hidden_size,),
            **qkv,
            a + "o_proj.weight": (c.hidden_size, q),
            **gate_up,
            m + "down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
        if c.qk_norm:
            shapes |= {a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)}
        if c.sandwich_norms:
            shapes |= {f"layers.{i}.{name}": (c.hidden_size,) for name in _OUTPUT_NORM_NAMES}
    return shapes


# Gemma's norms on the attention's and the MLP's outputs (Hugging Face's names)
_OUTPUT_NORM_NAMES = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")


def _mlp_norm_name(config: ModelConfig) -> str:
    """The norm before the MLP: Llama's post_attention_layernorm, which Gemma calls pre_feedforward_layernorm (its
    post_attention_layernorm is the norm on the attention's output)."""
    return "pre_feedforward_layernorm.weight" if config.sandwich_norms else "post_attention_layernorm.weight"


def _stacked(config: ModelConfig, weights: dict[str, RawWeight], fused: str, parts: list[str]) -> RawWeight:
    """A fused matrix as the file has it (Phi-3 stores it whole: passed on, not copied), else its parts stacked."""
    return weights[fused] if config.fused_projections else concat_rows([weights[p] for p in parts])


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
    post_norm: Any  # the norm before the MLP
    gate_up: Any  # gate and up projections stacked by rows
    down: Any
    window: int = 0  # how many positions back the attention sees, the query's own included (0: all)
    attn_out_norm: Any | None = None  # Gemma: the norms on the attention's and the MLP's outputs
    mlp_out_norm: Any | None = None

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
        attn_out_norm = mlp_out_norm = None
        if config.sandwich_norms:
            attn_out_norm, mlp_out_norm = (backend.vector(weights[p + name]) for name in _OUTPUT_NORM_NAMES)
        return cls(
            input_norm=backend.vector(weights[p + "input_layernorm.weight"]),
            qkv=backend.matrix(_stacked(config, weights, a + "qkv_proj.weight", [a + f"{x}_proj.weight" for x in "qkv"])),
            qkv_bias=qkv_bias,
            q_norm=q_norm,
            k_norm=k_norm,
            o=backend.matrix(weights[a + "o_proj.weight"]),
            post_norm=backend.vector(weights[p + _mlp_norm_name(config)]),
            gate_up=backend.matrix(_stacked(config, weights, m + "gate_up_proj.weight",
                                            [m + "gate_proj.weight", m + "up_proj.weight"])),
            down=backend.matrix(weights[m + "down_proj.weight"]),
            window=config.window(layer),
            attn_out_norm=attn_out_norm,
            mlp_out_norm=mlp_out_norm,
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
                if hasattr(w, "nbytes"):  # weights, not the layer's window
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
        logits = self.backend.linear_precise(self.lm_head, self.hidden_states(batch, cache)).float()
        cap = self.config.final_logit_softcap
        if cap:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits

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
        if self.config.scale_embeddings:
            x *= self.config.hidden_size**0.5
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
        self.cos, self.sin = rope_tables(config, freq_factors)
        self.local_cos, self.local_sin = self.cos, self.sin  # the windowed layers' (Gemma 3: another base)
        if config.rope_local_theta is not None:
            local = replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
            self.local_cos, self.local_sin = rope_tables(local)
        self.scale = config.attention_scale
        c = config
        self.split = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        self.heads = (c.num_heads, c.num_kv_heads, c.head_dim)

    def __call__(self, layer: LayerWeights, x: torch.Tensor, h: torch.Tensor, batch: ForwardBatch,
                 cache: KVCache, cache_layer: int, lora: dict[str, Any] | None = None) -> torch.Tensor:
        """x: the residual stream [tokens, hidden]; h: x after the layer's input norm. Adds the attention's
        output to x in place (Gemma: normed first) and returns the MLP's output (Gemma: normed too), for the caller to
        add, fused with the next norm.
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
        cos, sin = (self.local_cos, self.local_sin) if layer.window else (self.cos, self.sin)
        q = b.rope_and_cache(qkv, self.heads, batch, cos, sin, cache, cache_layer)
        attn = b.attention(q, cache, cache_layer, batch, self.scale, window=layer.window,
                           softcap=c.attn_logit_softcap).reshape(n, -1)
        o = b.linear(layer.o, attn)
        if lora:
            self.add_lora(lora, "o", o, attn, batch)
        if layer.attn_out_norm is not None:
            o = b.rms_norm(o, layer.attn_out_norm, eps)
        h = b.add_rms_norm(x, o, layer.post_norm, eps)
        # gated MLP: SwiGLU, or GeGLU (Gemma)
        gate_up = b.linear(layer.gate_up, h)
        if lora:
            self.add_lora(lora, "gate_up", gate_up, h, batch)
        act = b.geglu(gate_up) if c.hidden_act == "gelu_tanh" else b.swiglu(gate_up)
        down = b.linear(layer.down, act)
        if lora:
            self.add_lora(lora, "down", down, act, batch)
        if layer.mlp_out_norm is not None:
            down = b.rms_norm(down, layer.mlp_out_norm, eps)
        return down

    def add_lora(self, lora: dict[str, Any], matrix: str, y: torch.Tensor, x: torch.Tensor,
                 batch: ForwardBatch) -> None:
        """y (= matrix's output for x) += its adapters' deltas, each token its own slot's, when some loaded
        adapter touches the matrix."""
        stack = lora.get(matrix)
        if stack is not None:
            self.backend.add_lora(y, x, stack, batch.lora_slots, batch.lora_scales)
