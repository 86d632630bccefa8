"""ModelConfig: the architecture of a decoder-only transformer, whatever file it came from.

Llama, Qwen2 and Qwen3 are one transformer with different flags; SUPPORTED_ARCHITECTURES
says which flags each sets. Loaders (formats/gguf.py, formats/hf.py) fill this in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from churon.errors import UnsupportedModelError

# architecture name (GGUF general.architecture / HF model_type) -> flags that differ from plain Llama
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "llama": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
}


def check_architecture(name: str, source: str) -> dict[str, bool]:
    if name not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedModelError(f"{source}: architecture {name!r} is not supported (supported: {supported})")
    return SUPPORTED_ARCHITECTURES[name]


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    # None, or {"rope_type": "linear", "factor": f} or Llama 3's
    # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    extra: dict[str, Any] = field(default_factory=dict)  # informational only (file type, name, ...)


def default_threads() -> int:
    """Number of physical cores (hyper-threads share a core's FPUs and slow matmuls down)."""
    cores = set()
    try:
        with open("/proc/cpuinfo") as f:
            physical = core = None
            for line in f:
                if line.startswith("physical id"):
                    physical = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip() and core is not None:
                    cores.add((physical, core))
                    physical = core = None
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(len(cores) or affinity, affinity))


# element types of the KV cache, by torch name (kv_cache.KV_DTYPES maps them to torch dtypes)
KV_DTYPE_CHOICES = ("float32", "bfloat16", "float16", "int8")


@dataclass
class EngineConfig:
    """Runtime knobs of the serving engine."""

    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: kv_cache_fraction of available memory
    kv_cache_fraction: float = 0.25
    kv_dtype: str = "auto"  # "auto" (the backend's choice), "float32", "bfloat16", "float16", "int8"
    max_num_seqs: int = 32  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (prompt chunks + decodes)
    max_model_len: int | None = None  # cap on a sequence's length (default: the model's context length)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"invalid engine setting {name}={value!r}: must be an integer >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"invalid engine setting kv_cache_memory={self.kv_cache_memory!r}: must be > 0 bytes")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"invalid engine setting kv_cache_fraction={self.kv_cache_fraction!r}: must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"invalid engine setting max_model_len={self.max_model_len!r}: must be >= 2")
        if self.kv_dtype not in ("auto", *KV_DTYPE_CHOICES):
            raise ValueError(
                f"invalid engine setting kv_dtype={self.kv_dtype!r}: must be one of auto, {', '.join(KV_DTYPE_CHOICES)}"
            )

    def kv_torch_dtype(self, default):
        """The KV cache's torch dtype; "auto" is the backend's default (the activation dtype)."""
        import torch

        return default if self.kv_dtype == "auto" else getattr(torch, self.kv_dtype)
