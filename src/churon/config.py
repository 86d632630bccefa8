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

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """K and V for one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


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
