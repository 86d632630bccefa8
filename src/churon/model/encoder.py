"""Encoder: a BERT-family encoder over a packed batch of whole inputs -> their final hidden states.

    x = LayerNorm(word[id] + position[pos] + token_type[0])
    every layer, norm after each residual add (post-norm):
        x = LayerNorm(x + O(attention(QKV x)))
        x = LayerNorm(x + Down(gelu(Up x)))

Attention is bidirectional within each input: inputs are packed back to back without padding, each token
attends to every token of its own input and nothing else, and no KV cache is kept. Every input is one
sentence, so its token types are all 0 (what sentence-transformers passes).

On the native kernels the four matmuls of a layer run as Backend.encoder_matrix makes them: float weights (a
Hugging Face directory, an F32/F16/BF16 GGUF) on the AMX-BF16 tiles where the CPU has them, else as Q8_0 blocks
quantized at load; quantized GGUF weights as stored. On the tiles the feed-forward block is one kernel
(Backend.gelu_mlp). all-MiniLM-L6-v2's vectors keep a cosine >= 0.9995 with sentence-transformers' either way
(tests/test_embeddings_real.py); the reference backend keeps every weight exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from churon.config import EncoderConfig
from churon.model.backend import Backend
from churon.model.batch import PackedBatch
from churon.model.reference_backend import ReferenceBackend
from churon.model.weights import RawWeight, concat_rows, dense, is_float

GELU_APPROXIMATION = {"gelu": "none", "gelu_tanh": "tanh"}  # EncoderConfig.hidden_act -> gelu's approximate


@dataclass
class Norm:
    weight: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def build(cls, weights: dict[str, RawWeight], prefix: str, backend: Backend) -> "Norm":
        return cls(backend.vector(weights[prefix + "weight"]), backend.vector(weights[prefix + "bias"]))


@dataclass
class EncoderLayerWeights:
    """One encoder layer's weights as its backend holds them; q/k/v fused into one matrix (one matmul)."""

    qkv: Any
    qkv_bias: torch.Tensor
    o: Any
    o_bias: torch.Tensor
    attn_norm: Norm
    up: Any
    up_bias: torch.Tensor
    down: Any
    down_bias: torch.Tensor
    out_norm: Norm

    @classmethod
    def build(cls, layer: int, weights: dict[str, RawWeight], backend: Backend) -> "EncoderLayerWeights":
        p = f"encoder.layer.{layer}."
        a = p + "attention.self."
        b = backend

        def matrix(*names: str) -> Any:  # a matmul's weight (rows stacked) as the backend runs it
            return b.encoder_matrix(concat_rows([weights[n] for n in names]))

        return cls(
            qkv=matrix(*(a + f"{x}.weight" for x in ("query", "key", "value"))),
            qkv_bias=b.vector(torch.cat([dense(weights[a + f"{x}.bias"]) for x in ("query", "key", "value")])),
            o=matrix(p + "attention.output.dense.weight"),
            o_bias=b.vector(weights[p + "attention.output.dense.bias"]),
            attn_norm=Norm.build(weights, p + "attention.output.LayerNorm.", b),
            up=matrix(p + "intermediate.dense.weight"),
            up_bias=b.vector(weights[p + "intermediate.dense.bias"]),
            down=matrix(p + "output.dense.weight"),
            down_bias=b.vector(weights[p + "output.dense.bias"]),
            out_norm=Norm.build(weights, p + "output.LayerNorm.", b),
        )


class Encoder:
    def __init__(self, config: EncoderConfig, weights: dict[str, RawWeight], backend: Backend | None = None):
        """weights: canonical name (formats/bert.py) -> GGUF tensor or float tensor."""
        self.config = config
        self.backend = b = backend or ReferenceBackend()
        self.dtype = b.dtype
        self.word = b.matrix(weights["embeddings.word_embeddings.weight"])
        self.position = b.matrix(weights["embeddings.position_embeddings.weight"])
        types = weights.get("embeddings.token_type_embeddings.weight")
        # every input is token type 0: its row is added to every token
        self.type0 = None if types is None else b.vector(dense(types)[0])
        self.embed_norm = Norm.build(weights, "embeddings.LayerNorm.", b)
        self.layers = [EncoderLayerWeights.build(i, weights, b) for i in range(config.num_layers)]
        self.scale = config.head_dim**-0.5
        # with its matmuls on the AMX-BF16 tiles, attention runs there too: in float32, its 8 FMAs a score and row
        # were 20% of an all-MiniLM-L6-v2 forward once the matmuls ran on the tiles
        query = weights["encoder.layer.0.attention.self.query.weight"]
        self.bf16_tiles = b.bf16_tiles and is_float(query) and config.head_dim in (32, 64)
        self.gelu_approximate = GELU_APPROXIMATION[config.hidden_act]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def weight_bytes(self) -> int:
        objects = [self.word, self.position, *vars(self.embed_norm).values()]
        for layer in self.layers:
            for w in vars(layer).values():
                objects.extend(vars(w).values() if isinstance(w, Norm) else [w])
        return sum(w.nbytes for w in objects)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of every token of the batch's inputs."""
        b, c, eps = self.backend, self.config, self.config.layer_norm_eps
        x = b.embedding(self.word, batch.input_ids) + b.embedding(self.position, batch.positions)
        if self.type0 is not None:
            x += self.type0
        x = b.layer_norm(x, self.embed_norm.weight, self.embed_norm.bias, eps)
        for layer in self.layers:
            qkv = b.linear(layer.qkv, x, layer.qkv_bias)
            attn = b.attention_packed(qkv, c.num_heads, c.head_dim, batch.seq_starts, self.scale, self.bf16_tiles)
            x = b.add_layer_norm(x, b.linear(layer.o, attn, layer.o_bias), layer.attn_norm.weight, layer.attn_norm.bias, eps)
            mlp = b.gelu_mlp(x, layer.up, layer.up_bias, layer.down, layer.down_bias, self.gelu_approximate)
            x = b.add_layer_norm(x, mlp, layer.out_norm.weight, layer.out_norm.bias, eps)
        return x.float()
