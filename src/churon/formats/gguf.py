"""GGUF files (llama.cpp's format, v2 and v3): metadata, tensor index, memory-mapped data.

Parsing is done by the `gguf` package; this module turns its fields into plain Python
values, checks that every tensor lies inside the file, and reports problems as
ModelFileError naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from churon.config import ModelConfig, check_architecture
from churon.errors import ModelFileError, UnsupportedModelError
from churon.formats.quants import SUPPORTED_TYPES
from churon.formats.tensor_info import TensorInfo

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: rows first (GGUF stores ne reversed)
    qtype: GGMLQuantizationType
    data: np.ndarray  # raw bytes (uint8, flat), a view into the memory map

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        return self.data.nbytes


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFFile":
        path = Path(path)
        if not path.is_file():
            raise ModelFileError(f"{path}: no such file")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        try:
            reader = GGUFReader(path, "r")
        except Exception as e:  # the gguf package raises bare ValueError/IndexError on bad bytes
            raise ModelFileError(f"{path}: malformed or truncated GGUF header: {e}") from e
        metadata = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            metadata[key] = _field_value(field)
        file_size = path.stat().st_size
        tensors = {}
        for t in reader.tensors:
            qtype = GGMLQuantizationType(int(t.tensor_type)) if int(t.tensor_type) in _KNOWN_TYPES else None
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if qtype is None:
                raise ModelFileError(f"{path}: tensor {t.name!r} has unknown GGML type id {int(t.tensor_type)}")
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(shape))
            n_bytes = n_elements // block * type_size
            if t.data_offset + n_bytes > file_size:
                raise ModelFileError(
                    f"{path}: truncated: tensor {t.name!r} needs bytes {t.data_offset}..{t.data_offset + n_bytes}"
                    f" but the file has {file_size}"
                )
            raw = np.asarray(t.data).reshape(-1).view(np.uint8)
            tensors[t.name] = GGUFTensor(t.name, shape, qtype, raw)
        version_field = reader.fields.get("GGUF.version")
        version = int(version_field.contents()) if version_field is not None else 0
        return cls(path, version, metadata, tensors)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(f"{self.path}: metadata field {key!r} is missing")
        return self.metadata[key]


_KNOWN_TYPES = {int(t) for t in GGMLQuantizationType}


def _field_value(field) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


# GGUF tensor name -> canonical name (see model/transformer.py); blk.N. becomes layers.N.
_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_FILE_NAMES = {v: k for k, v in _GLOBAL_NAMES.items()}
_BLOCK_FILE_NAMES = {v: k for k, v in _BLOCK_NAMES.items()}


def canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None


def from_llama_cpp_layout(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which interleaves each head's rows for its GPT-J style RoPE."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFModel:
    """A GGUF file seen as a model (a ModelSource): its ModelConfig, tensor index, metadata and weights."""

    format = "gguf"

    def __init__(self, path: str | os.PathLike):
        self.file = GGUFFile.open(path)
        self.path = self.file.path
        self.metadata = self.file.metadata  # the tokenizer is built from it too (tokenizer.ggml.*)
        self.config = self._config()

    def _config(self) -> ModelConfig:
        f = self.file
        arch = f.require("general.architecture")
        flags = check_architecture(arch, str(self.path))
        p = arch + "."
        heads = int(f.require(p + "attention.head_count"))
        hidden = int(f.require(p + "embedding_length"))
        embed = f.tensors.get("token_embd.weight")
        if embed is None:
            raise ModelFileError(f"{self.path}: tensor 'token_embd.weight' is missing")
        vocab = int(f.get(p + "vocab_size", embed.shape[0]))  # Qwen files leave vocab_size out
        rope_scaling = None
        scaling_type = f.get(p + "rope.scaling.type")
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(f.require(p + "rope.scaling.factor"))}
        elif scaling_type not in (None, "none"):
            raise UnsupportedModelError(f"{self.path}: {p}rope.scaling.type {scaling_type!r} is not supported (supported: linear)")
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(f.require(p + "feed_forward_length")),
            num_layers=int(f.require(p + "block_count")),
            num_heads=heads,
            num_kv_heads=int(f.get(p + "attention.head_count_kv", heads)),
            head_dim=int(f.get(p + "attention.key_length", hidden // heads)),
            context_length=int(f.require(p + "context_length")),
            rms_norm_eps=float(f.require(p + "attention.layer_norm_rms_epsilon")),
            rope_theta=float(f.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in f.tensors,
            **flags,
            extra={"name": f.get("general.name"), "file_type": f.get("general.file_type")},
        )

    @property
    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(t.name, t.shape, t.qtype.name, t.n_bytes) for t in self.file.tensors.values()]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> shape of every tensor the model understands."""
        out = {}
        for t in self.file.tensors.values():
            name = canonical_name(t.name)
            if name is not None:
                out[name] = t.shape
        return out

    def check_types(self) -> None:
        for t in self.file.tensors.values():
            if canonical_name(t.name) is not None and t.qtype not in SUPPORTED_TYPES:
                supported = ", ".join(q.name for q in sorted(SUPPORTED_TYPES))
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name!r} has type {t.qtype.name}, which churon cannot read (supported: {supported})"
                )

    def file_name(self, canonical: str) -> str:
        """The name this file uses (or would use) for a canonical tensor name."""
        if canonical in _FILE_NAMES:
            return _FILE_NAMES[canonical]
        _, layer, rest = canonical.split(".", 2)
        return f"blk.{layer}.{_BLOCK_FILE_NAMES[rest]}"

    def load_weights(self) -> dict[str, GGUFTensor]:
        """Every known tensor as stored (quantized bytes), by canonical name, q/k rows in the Hugging Face layout.

        Un-permuting moves whole rows, so it works on quantized bytes as well as on floats.
        """
        c = self.config
        out = {}
        for t in self.file.tensors.values():
            name = canonical_name(t.name)
            if name is None:
                continue
            heads = None
            if c.architecture == "llama" and name.startswith("layers.") and ".q_proj." in name:
                heads = c.num_heads
            elif c.architecture == "llama" and name.startswith("layers.") and ".k_proj." in name:
                heads = c.num_kv_heads
            if heads is not None:
                order = from_llama_cpp_layout(torch.arange(t.shape[0]), heads).numpy()
                t = GGUFTensor(t.name, t.shape, t.qtype, t.data.reshape(t.shape[0], -1)[order].reshape(-1))
            out[name] = t
        return out
