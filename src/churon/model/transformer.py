"""One decoder-only transformer; Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3 differ only by ModelConfig
flags (and the sizes, windows and soft-caps their files give); so do the mixture-of-experts families (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE), whose MLP is routed experts (`DecoderBlock.moe`).

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
from churon.model.backend import Backend, KVCache, RopeTables, SequenceCache, experts_one_by_one, softmax_top_k
from churon.model.batch import ForwardBatch, SequenceChunk
from churon.model.lora import LoraSlots
from churon.model.reference_backend import ReferenceBackend
from churon.model.rope import rope_tables
from churon.model.weights import RawWeight, concat_rows, dense, experts


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
            mlp = {m + "gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size)}
        else:
            qkv = {a + "q_proj.weight": (q, c.hidden_size), a + "k_proj.weight": (kv, c.hidden_size),
                   a + "v_proj.weight": (kv, c.hidden_size)}
            mlp = {m + "gate_proj.weight": (c.intermediate_size, c.hidden_size),
                   m + "up_proj.weight": (c.intermediate_size, c.hidden_size)}
        if c.moe_layer(i):
            mlp = _moe_shapes(c, m)
        else:
            mlp[m + "down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        shapes |= {
            f"layers.{i}.input_layernorm.weight": (c.hidden_size,),
            f"layers.{i}.{_mlp_norm_name(c)}": (c.hidden_size,),
            **qkv,
            a + "o_proj.weight": (c.hidden_size, q),
            **mlp,
        }
        if c.attention_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
        if c.attention_out_bias:
            shapes[a + "o_proj.bias"] = (c.hidden_size,)
        if c.attention_sinks:
            shapes[a + "sinks"] = (c.num_heads,)
        if c.qk_norm:
            q_norm, k_norm = ((c.head_dim,), (c.head_dim,)) if c.qk_norm_per_head else ((q,), (kv,))
            shapes |= {a + "q_norm.weight": q_norm, a + "k_norm.weight": k_norm}
        if c.sandwich_norms:
            shapes |= {f"layers.{i}.{name}": (c.hidden_size,) for name in _OUTPUT_NORM_NAMES}
    return shapes


def _moe_shapes(c: ModelConfig, m: str) -> dict[str, tuple[int, ...]]:
    """An MoE layer's MLP: the router [experts, hidden], the experts' matrices stacked [experts, rows, cols] (as GGUF
    stores them; a Hugging Face directory's per-expert tensors are stacked by formats/hf.py) and the shared expert."""
    e, f, hidden = c.num_experts, c.moe_intermediate_size, c.hidden_size
    shapes = {m + "gate.weight": (e, hidden), m + "experts.gate_proj.weight": (e, f, hidden),
              m + "experts.up_proj.weight": (e, f, hidden), m + "experts.down_proj.weight": (e, hidden, f)}
    if c.router_bias:
        shapes[m + "gate.bias"] = (e,)
    if c.expert_form == "clamped_swiglu":  # gpt-oss: a bias on each expert's gate, up and down
        shapes |= {m + "experts.gate_proj.bias": (e, f), m + "experts.up_proj.bias": (e, f),
                   m + "experts.down_proj.bias": (e, hidden)}
    s = c.shared_expert_intermediate_size
    if s:
        shapes |= {m + "shared_expert.gate_proj.weight": (s, hidden), m + "shared_expert.up_proj.weight": (s, hidden),
                   m + "shared_expert.down_proj.weight": (hidden, s), m + "shared_expert_gate.weight": (1, hidden)}
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
    gate_up: Any | None  # gate and up projections stacked by rows (None on an MoE layer)
    down: Any | None
    window: int = 0  # how many positions back the attention sees, the query's own included (0: all)
    attn_out_norm: Any | None = None  # Gemma: the norms on the attention's and the MLP's outputs
    mlp_out_norm: Any | None = None
    # an MoE layer: the router [experts, hidden] and the experts (backend.Experts: each one's gate/up and down as
    # matrices of their own)
    router: Any | None = None
    experts: Any | None = None
    shared_gate_up: Any | None = None  # Qwen2-MoE's shared expert and its gate [1, hidden]
    shared_down: Any | None = None
    shared_gate: Any | None = None
    o_bias: Any | None = None  # gpt-oss: o_proj's bias and each head's sink logit [heads]
    sinks: Any | None = None
    router_bias: Any | None = None  # gpt-oss: the router's bias [experts], each expert's gate/up and down biases
    experts_gate_up_bias: list[Any] | None = None
    experts_down_bias: list[Any] | None = None

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
        if config.moe_layer(layer):
            mlp = _moe_weights(config, m, weights, backend)
        else:
            mlp = {"gate_up": backend.matrix(_stacked(config, weights, m + "gate_up_proj.weight",
                                                      [m + "gate_proj.weight", m + "up_proj.weight"])),
                   "down": backend.matrix(weights[m + "down_proj.weight"])}
        return cls(
            input_norm=backend.vector(weights[p + "input_layernorm.weight"]),
            qkv=backend.matrix(_stacked(config, weights, a + "qkv_proj.weight", [a + f"{x}_proj.weight" for x in "qkv"])),
            qkv_bias=qkv_bias,
            q_norm=q_norm,
            k_norm=k_norm,
            o=backend.matrix(weights[a + "o_proj.weight"]),
            post_norm=backend.vector(weights[p + _mlp_norm_name(config)]),
            window=config.window(layer),
            attn_out_norm=attn_out_norm,
            mlp_out_norm=mlp_out_norm,
            o_bias=backend.vector(weights[a + "o_proj.bias"]) if config.attention_out_bias else None,
            sinks=backend.vector(weights[a + "sinks"]) if config.attention_sinks else None,
            **{"gate_up": None, "down": None, **mlp},
        )


def _moe_weights(config: ModelConfig, m: str, weights: dict[str, RawWeight], backend: Backend) -> dict[str, Any]:
    """An MoE layer's LayerWeights fields: each expert's slices of the stacked tensors as matrices of their own (its
    gate and up stacked by rows), so a step runs an expert's matmuls over just its tokens, on the bytes as stored."""
    gates, ups, downs = (experts(weights[m + f"experts.{x}_proj.weight"]) for x in ("gate", "up", "down"))
    out = {"router": backend.matrix(weights[m + "gate.weight"]),
           "experts": backend.experts([concat_rows([g, u]) for g, u in zip(gates, ups)], downs)}
    if config.router_bias:
        out["router_bias"] = backend.vector(weights[m + "gate.bias"])
    if config.expert_form == "clamped_swiglu":
        gate_bias, up_bias, down_bias = (dense(weights[m + f"experts.{x}_proj.bias"]) for x in ("gate", "up", "down"))
        out["experts_gate_up_bias"] = [backend.vector(torch.cat([g, u])) for g, u in zip(gate_bias, up_bias)]
        out["experts_down_bias"] = [backend.vector(d.clone()) for d in down_bias]
    if config.shared_expert_intermediate_size:
        s = m + "shared_expert."
        out |= {"shared_gate_up": backend.matrix(concat_rows([weights[s + "gate_proj.weight"], weights[s + "up_proj.weight"]])),
                "shared_down": backend.matrix(weights[s + "down_proj.weight"]),
                "shared_gate": backend.matrix(weights[m + "shared_expert_gate.weight"])}
    return out


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
        # the layer stack as one native call where the backend has one for this model (None: op by op, as
        # DecoderBlock reads; the two are bitwise the same, and a batch with LoRA slots always goes op by op)
        self.fused_stack = b.decoder_stack(config, self.layers, self.embed_tokens, self.norm, self.block.rope,
                                           self.block.scale)

    def enable_lora(self, max_loras: int) -> LoraSlots:
        """max_loras adapter slots over this model's weights (they stay as they are: adapters apply unmerged)."""
        if self.lora is not None:
            raise ValueError(f"LoRA is already enabled on this model ({self.lora.max_loras} slots)")
        self.lora = LoraSlots(self.config, self.backend, max_loras)
        return self.lora

    def prepare_argmax(self) -> None:
        """Ready forward_batch's argmax logits (Backend.prepare_argmax; soft-capping never takes them): what a
        generation engine asks before planning memory, since what it builds counts in weight_bytes."""
        if not self.config.final_logit_softcap:
            self.backend.prepare_argmax(self.lm_head)

    def weight_bytes(self) -> int:
        objects = {id(self.embed_tokens): self.embed_tokens, id(self.lm_head): self.lm_head, id(self.norm): self.norm}
        for layer in self.layers:
            for w in vars(layer).values():
                if hasattr(w, "nbytes"):  # weights (an MoE layer's Experts: all of theirs), not the layer's window
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
    def forward_batch(self, batch: ForwardBatch, cache: KVCache, argmax_only: bool = False) -> torch.Tensor:
        """Run a step of many sequences; float32 logits of the rows batch.logits_indices names. argmax_only: each
        row's first maximum is all that is read of it (greedy decoding), so values sure to lie below it may be less
        precise (Backend.linear_argmax)."""
        hidden = self.hidden_states(batch, cache)
        cap = self.config.final_logit_softcap
        # soft-capping flattens the top: a value below the maximum may reach it once capped
        linear = self.backend.linear_argmax if argmax_only and not cap else self.backend.linear_precise
        logits = linear(self.lm_head, hidden).float()
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
        elif self.fused_stack is not None:
            return self.fused_stack.hidden_states(batch, cache)
        x = b.embedding(self.embed_tokens, batch.input_ids)  # the residual stream, [tokens, hidden]
        if self.config.scale_embeddings:
            x *= self.config.hidden_size**0.5
        h = b.rms_norm(x, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            down = self.block(layer, x, h, batch, cache, i, lora[i] if lora is not None else None)
            if i + 1 < len(self.layers):  # the MLP's residual add (Gemma: its norm first) fused with the next input norm
                h = b.add_rms_norm(x, down, self.layers[i + 1].input_norm, eps, layer.mlp_out_norm)
        rows = batch.logits_indices
        return b.add_rms_norm(x[rows], down[rows], self.norm, eps, layer.mlp_out_norm)


class DecoderBlock:
    """One decoder layer's arithmetic, with what all layers share (RoPE tables, head geometry); the
    layer's weights come with each call, so a caller holding one layer at a time (quantization's
    calibration) runs the same code as the whole model."""

    def __init__(self, config: ModelConfig, backend: Backend,
                 freq_factors: torch.Tensor | None = None):
        """freq_factors: per-dimension RoPE frequency divisors (GGUF's rope_freqs.weight, Llama 3 scaling)."""
        self.config = config
        self.backend = backend
        cos, sin = rope_tables(config, freq_factors)
        local_cos, local_sin = cos, sin  # the windowed layers' (Gemma 3: another base)
        if config.rope_local_theta is not None:
            local = replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
            local_cos, local_sin = rope_tables(local)
        self.rope = RopeTables(cos, sin, local_cos, local_sin)
        self.scale = config.attention_scale
        c = config
        self.split = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        self.heads = (c.num_heads, c.num_kv_heads, c.head_dim)

    def __call__(self, layer: LayerWeights, x: torch.Tensor, h: torch.Tensor, batch: ForwardBatch,
                 cache: KVCache, cache_layer: int, lora: dict[str, Any] | None = None) -> torch.Tensor:
        """x: the residual stream [tokens, hidden]; h: x after the layer's input norm. Adds the attention's
        output to x in place (Gemma: normed first) and returns the MLP's output, for the caller to add fused with the
        next norm (Gemma: after its own norm, layer.mlp_out_norm, in the same call: add_rms_norm's x_norm).
        K and V go to model layer cache_layer's place in the cache (its layout's KV group and index). lora: the
        layer's LoRA stacks by fused matrix (LoraSlots.layers[i]), given when the batch carries adapter slots."""
        b, c, eps = self.backend, self.config, self.config.rms_norm_eps
        n = batch.num_tokens
        # attention
        qkv = b.linear(layer.qkv, h, layer.qkv_bias)
        if lora:  # the adapters' deltas on the bias-added q/k/v, before q/k norm and RoPE
            self.add_lora(lora, "qkv", qkv, h, batch)
        # q/k norms before RoPE: Qwen3 and Gemma 3 over each head (in rope_and_cache), OLMoE over all of q and of k
        head_norms = None
        if layer.q_norm is not None and c.qk_norm_per_head:
            head_norms = (layer.q_norm, layer.k_norm)
        elif layer.q_norm is not None:
            q_size, kv_size = self.split[0], self.split[1]
            qkv[:, :q_size] = b.rms_norm(qkv[:, :q_size], layer.q_norm, eps)
            qkv[:, q_size:q_size + kv_size] = b.rms_norm(qkv[:, q_size:q_size + kv_size], layer.k_norm, eps)
        r = self.rope
        cos, sin = (r.local_cos, r.local_sin) if layer.window else (r.cos, r.sin)
        group, slot = cache.layout.layer_slots[cache_layer]  # where the layer's K/V live, through which tables
        kv = batch.kv_group(group)
        q = b.rope_and_cache(qkv, self.heads, kv, cos, sin, cache, slot, head_norms, eps)
        attn = b.attention(q, cache, slot, kv, self.scale, window=layer.window,
                           softcap=c.attn_logit_softcap, sinks=layer.sinks).reshape(n, -1)
        o = b.linear(layer.o, attn, layer.o_bias)
        if lora:
            self.add_lora(lora, "o", o, attn, batch)
        h = b.add_rms_norm(x, o, layer.post_norm, eps, layer.attn_out_norm)
        if layer.router is not None:
            return self.moe(layer, h)
        # gated MLP: SwiGLU, or GeGLU (Gemma)
        gate_up = b.linear(layer.gate_up, h)
        if lora:
            self.add_lora(lora, "gate_up", gate_up, h, batch)
        act = b.geglu(gate_up) if c.hidden_act == "gelu_tanh" else b.swiglu(gate_up)
        down = b.linear(layer.down, act)
        if lora:
            self.add_lora(lora, "down", down, act, batch)
        return down

    def moe(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """The routed MLP of h [tokens, hidden]: each token's top-k experts' SwiGLU outputs, weighted by the router's
        probabilities, summed in the order of the token's own ranking (plus the shared expert's, gated).

        The experts run in backend.routed_experts, or after gpt-oss's routing here in backend.moe_experts (each one's
        matmuls once over its tokens; on the native kernels one call per layer, the softmax routers' routing in it); on
        the native kernels a row's result does not depend on the other rows, and the routing is row by row (softmax and
        top-k along each row, then elementwise products and sums), so a token's bits do not depend on its batch."""
        b, c = self.backend, self.config
        k = c.num_experts_per_tok
        if c.expert_form == "swiglu" and layer.router_bias is None and not c.router_topk_first:
            # the softmax routers (every family but gpt-oss): routing and experts in one backend call; norm_topk_prob:
            # the k weights renormalized to sum to 1 inside it
            out = b.routed_experts(layer.router, layer.experts, h, k, normalize=c.norm_topk_prob)
        else:
            logits = b.linear(layer.router, h, layer.router_bias).float()
            if c.router_topk_first:  # gpt-oss: the k largest logits, then a softmax over just those
                weights, chosen = torch.topk(logits, k, dim=-1)
                weights = torch.softmax(weights, dim=-1)
            else:
                weights, chosen = softmax_top_k(logits, k)
            if c.expert_form == "clamped_swiglu":  # gpt-oss's experts, with biases: one expert at a time
                out = experts_one_by_one(b, layer.experts, h, chosen, weights, c.norm_topk_prob,
                                         lambda e, x: self.clamped_expert(layer, e, x))
            else:
                out = b.moe_experts(layer.experts, h, chosen, weights, normalize=c.norm_topk_prob)
        if layer.shared_gate_up is not None:
            shared = b.linear(layer.shared_down, b.swiglu(b.linear(layer.shared_gate_up, h)))
            logit = b.linear(layer.shared_gate, h).float()
            # sigmoid as a two-way softmax, row by row: CPU elementwise kernels take a scalar path for a tensor's
            # last few elements, so torch.sigmoid's bits for a token would depend on how many tokens the step has
            gate = torch.softmax(torch.cat([logit, torch.zeros_like(logit)], dim=-1), dim=-1)[:, :1]
            out += gate.to(shared.dtype) * shared
        return out

    def clamped_expert(self, layer: LayerWeights, e: int, x: torch.Tensor) -> torch.Tensor:
        """gpt-oss's expert e on its tokens' rows x: the clamped SwiGLU, with its biases."""
        b, c = self.backend, self.config
        gate_up = b.linear(layer.experts.gate_up[e], x, layer.experts_gate_up_bias[e])
        return b.linear(layer.experts.down[e], b.swiglu_clamped(gate_up, c.swiglu_alpha, c.swiglu_limit),
                        layer.experts_down_bias[e])

    def add_lora(self, lora: dict[str, Any], matrix: str, y: torch.Tensor, x: torch.Tensor,
                 batch: ForwardBatch) -> None:
        """y (= matrix's output for x) += its adapters' deltas, each token its own slot's, when some loaded
        adapter touches the matrix."""
        stack = lora.get(matrix)
        if stack is not None:
            self.backend.add_lora(y, x, stack, batch.lora_slots, batch.lora_scales)
