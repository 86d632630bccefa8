"""BERT (architecture "bert"): its tensor names in GGUF and Hugging Face files, the weight shapes an
EncoderConfig implies, and the readers of its architecture from either kind of file.

Canonical names are Hugging Face BertModel's without a leading "bert." (model/encoder.py reads them).
GGUF names are llama.cpp's (gguf-py's MODEL_TENSORS[MODEL_ARCH.BERT], llama-arch.cpp); the GGUF keys are
what convert_hf_to_gguf.py's BertModel writes:

    bert.context_length  bert.embedding_length  bert.feed_forward_length  bert.block_count
    bert.attention.head_count  bert.attention.layer_norm_epsilon  bert.attention.causal (false)
    bert.pooling_type  tokenizer.ggml.token_type_count

The GELU is not in a GGUF file: llama.cpp computes BERT's with the tanh approximation whatever the
checkpoint used; churon reads "gelu" (erf), what BERT and the checkpoints churon converts use.
"""

from __future__ import annotations

from typing import Any, Mapping

from churon.config import MAX_CONTEXT_LENGTH, MAX_LAYERS, ConfigReader, EncoderConfig
from churon.errors import ModelFileError, UnsupportedModelError

ARCHITECTURE = "bert"

# canonical name <-> GGUF name, outside the layers
_GLOBAL_NAMES = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
# module after "encoder.layer.N." <-> after "blk.N." (each has a .weight and a .bias)
_BLOCK_MODULES = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_GGUF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
_GGUF_MODULES = {v: k for k, v in _BLOCK_MODULES.items()}
_SUFFIXES = ("weight", "bias")

# transformers' hidden_act -> EncoderConfig.hidden_act
HIDDEN_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def canonical_from_gguf(gguf_name: str) -> str | None:
    """The canonical name of a BERT GGUF tensor; None for tensors the encoder does not use (cls.*)."""
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_MODULES and parts[3] in _SUFFIXES:
        return f"encoder.layer.{parts[1]}.{_GGUF_MODULES[parts[2]]}.{parts[3]}"
    return None


def gguf_name(canonical: str) -> str:
    """The GGUF name of a canonical BERT tensor name."""
    if canonical in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[canonical]
    _, _, layer, rest = canonical.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK_MODULES[module]}.{suffix}"


def canonical_from_hf(hf_name: str) -> str | None:
    """The canonical name of a Hugging Face BERT tensor (BertModel's, or BertForMaskedLM's under "bert.";
    TensorFlow-era LayerNorm gamma / beta as weight / bias, as llama.cpp's converter reads them); None for
    what the encoder does not use: the pooler, the masked-LM and next-sentence heads, position_ids."""
    name = hf_name.removeprefix("bert.")
    if name.endswith(".gamma"):
        name = name.removesuffix(".gamma") + ".weight"
    elif name.endswith(".beta"):
        name = name.removesuffix(".beta") + ".bias"
    if name in _GLOBAL_NAMES:
        return name
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"] and parts[2].isdigit():
        module, _, suffix = parts[3].rpartition(".")
        if module in _BLOCK_MODULES and suffix in _SUFFIXES:
            return name
    return None


def expected_encoder_weight_shapes(c: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape (rows first) of every weight an encoder of this config reads."""
    h, ff = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (c.vocab_size, h),
        "embeddings.position_embeddings.weight": (c.context_length, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    if c.type_vocab_size > 0:
        shapes["embeddings.token_type_embeddings.weight"] = (c.type_vocab_size, h)
    outputs = {"attention.self.query": h, "attention.self.key": h, "attention.self.value": h,
               "attention.output.dense": h, "intermediate.dense": ff, "output.dense": h}
    inputs = {"intermediate.dense": h, "output.dense": ff}
    for i in range(c.num_layers):
        p = f"encoder.layer.{i}."
        for module, rows in outputs.items():
            shapes[p + module + ".weight"] = (rows, inputs.get(module, h))
            shapes[p + module + ".bias"] = (rows,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[p + norm + ".weight"] = (h,)
            shapes[p + norm + ".bias"] = (h,)
    return shapes


def _heads_divide(hidden: int, heads: int, keys: tuple[str, str], source: str) -> int:
    if hidden % heads:
        raise ModelFileError(f"{source}: {keys[0]} = {heads} does not divide {keys[1]} = {hidden} (the head size)")
    return hidden // heads


def encoder_config_from_gguf(metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str,
                             file_bytes: int) -> EncoderConfig:
    """A BERT GGUF's architecture (metadata keys as convert_hf_to_gguf.py's BertModel writes them; shapes:
    the file's tensors by GGUF name, for the sizes the keys may leave out)."""
    r = ConfigReader(metadata, source)
    k = ARCHITECTURE + "."
    embed = shapes.get("token_embd.weight")
    if embed is None:
        raise ModelFileError(f"{source}: tensor 'token_embd.weight' is missing")
    if r.boolean(k + "attention.causal", False):
        raise ModelFileError(f"{source}: {k}attention.causal = true, but BERT's attention is bidirectional")
    hidden = r.dimension(k + "embedding_length", file_bytes)
    heads = r.dimension(k + "attention.head_count", file_bytes)
    types = shapes.get("token_types.weight")
    return EncoderConfig(
        architecture=ARCHITECTURE,
        vocab_size=r.dimension(k + "vocab_size", file_bytes, default=embed[0]),  # the converter leaves it out
        hidden_size=hidden,
        intermediate_size=r.dimension(k + "feed_forward_length", file_bytes),
        num_layers=r.integer(k + "block_count", hi=MAX_LAYERS, why=" (llama.cpp's LLAMA_MAX_LAYERS)"),
        num_heads=heads,
        head_dim=_heads_divide(hidden, heads, (k + "attention.head_count", k + "embedding_length"), source),
        context_length=r.integer(k + "context_length", hi=MAX_CONTEXT_LENGTH),
        type_vocab_size=r.integer("tokenizer.ggml.token_type_count", default=types[0] if types else 0, lo=0,
                                  hi=file_bytes * 8, why=": the token-type table cannot fit in the file"),
        layer_norm_eps=r.number(k + "attention.layer_norm_epsilon"),
        extra={"name": metadata.get("general.name"), "file_type": metadata.get("general.file_type")},
    )


def encoder_config_from_hf(cfg: Mapping[str, Any], source: str, file_bytes: int) -> EncoderConfig:
    """A Hugging Face BERT config.json's architecture (transformers.BertConfig's fields and defaults)."""
    r = ConfigReader(cfg, source)
    position = cfg.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise UnsupportedModelError(
            f"{source}: position_embedding_type {position!r:.80} is not supported (supported: absolute)")
    for flag in ("is_decoder", "add_cross_attention"):
        if r.boolean(flag, False):
            raise UnsupportedModelError(f"{source}: {flag} = true is not supported (an encoder is bidirectional"
                                        " and attends to nothing but its input)")
    act = cfg.get("hidden_act", "gelu")
    if not isinstance(act, str):
        raise ModelFileError(f"{source}: hidden_act = {act!r:.80} is not a string")
    if act not in HIDDEN_ACTS:
        raise UnsupportedModelError(
            f"{source}: hidden_act {act!r:.80} is not supported (supported: {', '.join(HIDDEN_ACTS)})")
    hidden = r.dimension("hidden_size", file_bytes)
    heads = r.dimension("num_attention_heads", file_bytes)
    return EncoderConfig(
        architecture=ARCHITECTURE,
        vocab_size=r.dimension("vocab_size", file_bytes),
        hidden_size=hidden,
        intermediate_size=r.dimension("intermediate_size", file_bytes),
        num_layers=r.integer("num_hidden_layers", hi=MAX_LAYERS, why=" (llama.cpp's LLAMA_MAX_LAYERS)"),
        num_heads=heads,
        head_dim=_heads_divide(hidden, heads, ("num_attention_heads", "hidden_size"), source),
        context_length=r.integer("max_position_embeddings", hi=MAX_CONTEXT_LENGTH),
        type_vocab_size=r.integer("type_vocab_size", default=2, lo=0, hi=file_bytes * 8,
                                  why=": the token-type table cannot fit in the weights"),
        layer_norm_eps=r.number("layer_norm_eps", 1e-12),
        hidden_act=HIDDEN_ACTS[act],
        extra={"torch_dtype": cfg.get("torch_dtype", cfg.get("dtype"))},
    )
