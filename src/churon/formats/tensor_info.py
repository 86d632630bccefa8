"""What a model file says about one tensor, before any data is read."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorInfo:
    name: str  # as stored in the file
    shape: tuple[int, ...]  # rows first
    dtype: str  # GGML type name (Q4_1, F32, ...) or safetensors dtype (BF16, F32, ...)
    n_bytes: int
