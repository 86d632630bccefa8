"""What Ollama's /api/tags, /api/show and /api/ps say about a model, read from its files without loading its
weights (loader.open_model: the architecture and the tensor index): its size, digest, details
{format, family, families, parameter_size, quantization_level} and model_info under Ollama's (GGUF's) key
names. Kept per file, by its size and modification time: a listing hashes a file once, not at every call."""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from churon.config import EncoderConfig
from churon.loader import open_model
from churon.tokenizer import load_tokenizer
from churon.tool_calls.formats import detect_format


@dataclass(frozen=True)
class ModelFiles:
    size: int  # bytes on disk
    digest: str  # "sha256:<hex>" of the file, or of a directory's files in name order
    details: dict[str, Any]
    model_info: dict[str, Any]
    chat_template: str | None
    embedding: bool  # an embedding model (an encoder, or files that declare a pooling)


def describe(path: Path) -> ModelFiles:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _describe(path, stamp)


@functools.lru_cache(maxsize=64)
def _describe(path: Path, stamp: tuple) -> ModelFiles:
    digest = hashlib.sha256()
    for name, _, _ in stamp:
        with open(name, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    source = open_model(path, pull=False)
    c = source.config
    arch = c.architecture
    params = sum(_elements(t.shape) for t in source.tensors if not t.name.startswith("rope_freqs"))
    by_type = Counter()
    for t in source.tensors:
        by_type[t.dtype] += t.n_bytes
    details = {
        "parent_model": "",
        "format": source.format if source.format == "gguf" else "safetensors",
        "family": arch,
        "families": [arch],
        "parameter_size": parameter_size(params),
        "quantization_level": by_type.most_common(1)[0][0] if by_type else "",
    }
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": params,
                            f"{arch}.context_length": c.context_length, f"{arch}.embedding_length": c.hidden_size,
                            f"{arch}.block_count": c.num_layers, f"{arch}.feed_forward_length": c.intermediate_size,
                            f"{arch}.attention.head_count": c.num_heads}
    if isinstance(c, EncoderConfig):
        info[f"{arch}.attention.layer_norm_epsilon"] = c.layer_norm_eps
    else:
        info |= {f"{arch}.attention.head_count_kv": c.num_kv_heads, f"{arch}.attention.key_length": c.head_dim,
                 f"{arch}.attention.value_length": c.head_dim, f"{arch}.rope.freq_base": c.rope_theta,
                 f"{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps}
    info["tokenizer.vocab_size"] = c.vocab_size
    template = load_tokenizer(source).chat_template
    embedding = isinstance(c, EncoderConfig) or source.pooling is not None
    return ModelFiles(sum(size for _, size, _ in stamp), f"sha256:{digest.hexdigest()}", details, info, template, embedding)


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def parameter_size(n: int) -> str:
    """As Ollama writes it: "135.27M", "7.6B"."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.2f}K"


def capabilities(files: ModelFiles, template: str | None) -> list[str]:
    """["embedding"], or ["completion"] with "tools" when the chat template renders tools."""
    if files.embedding:
        return ["embedding"]
    return ["completion"] + (["tools"] if detect_format(template) is not None else [])
