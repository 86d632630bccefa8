"""One decoder-only transformer; Llama, Qwen2 and Qwen3 differ only by ModelConfig flags.

Weights come in as a dict with the canonical names listed by `expected_weight_shapes`
(Hugging Face's names without the "model." prefix), whatever file format they were read from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from churon.config import ModelConfig
from churon.kv_cache import PagedKVCache, SequenceKVCache
from churon.model.batch import ForwardBatch, SequenceChunk
from churon.model.layers import MLP, Attention, RMSNorm, RotaryEmbedding, rope_inv_freq


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


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, weights: dict[str, torch.Tensor], rope: RotaryEmbedding):
        super().__init__()
        p = f"layers.{layer}."
        self.input_layernorm = RMSNorm(weights[p + "input_layernorm.weight"], config.rms_norm_eps)
        self.self_attn = Attention(config, layer, weights, rope)
        self.post_attention_layernorm = RMSNorm(weights[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        self.mlp = MLP(layer, weights)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        """weights: canonical name -> tensor (any float dtype; converted to `dtype`).

        An optional "rope_freqs.weight" holds per-dimension RoPE frequency divisors (GGUF's Llama 3 scaling).
        """
        super().__init__()
        self.config = config
        self.dtype = dtype
        freq_factors = weights.get("rope_freqs.weight")
        w = {name: t.to(dtype) for name, t in weights.items() if name != "rope_freqs.weight"}
        rope = RotaryEmbedding(rope_inv_freq(config, freq_factors), config.context_length)
        self.embed_tokens = nn.Parameter(w["embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, w, rope) for i in range(config.num_layers))
        self.norm = RMSNorm(w["norm.weight"], config.rms_norm_eps)
        lm_head = w["embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = nn.Parameter(lm_head, requires_grad=False)

    def weight_bytes(self) -> int:
        seen = {}
        for p in self.parameters():
            seen[p.data_ptr()] = p.nbytes  # the tied lm_head shares the embedding's memory
        return sum(seen.values())

    def new_cache(self, max_tokens: int | None = None) -> SequenceKVCache:
        """A KV cache for one sequence of up to max_tokens (default: the context length)."""
        return SequenceKVCache(self.config, max_tokens or self.config.context_length, dtype=self.dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: SequenceKVCache, all_logits: bool = False) -> torch.Tensor:
        """One sequence: run tokens ([n] ids at positions start..start+n-1) and return float32 logits.

        Only the last position's logits ([1, vocab]) unless all_logits ([n, vocab]).
        """
        end = start + tokens.shape[0]
        if end > cache.max_tokens:
            raise ValueError(f"positions up to {end} do not fit a cache of {cache.max_tokens} tokens")
        token_ids = [0] * start + tokens.tolist()  # ids before start are in the cache already
        chunk = SequenceChunk(token_ids, start, cache.block_table, all_logits=all_logits)
        return self.forward_batch(ForwardBatch.build([chunk], cache.block_size), cache)

    @torch.inference_mode()
    def forward_batch(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Run a step of many sequences; float32 logits of the rows batch.logits_indices names."""
        x = F.embedding(batch.input_ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x, batch, cache)
        x = x[batch.logits_indices]
        return F.linear(self.norm(x), self.lm_head).float()
