"""ModelSource: what every model file format gives the loader, before and after reading the weights.

A source is opened without reading its weights: the architecture (config), the tensor index and the
file's metadata come first, so that every tensor can be checked before anything large is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping, Protocol

import torch

from churon.config import EncoderConfig, ModelConfig, PoolingConfig
from churon.formats.gguf import GGUFTensor
from churon.formats.tensor_info import TensorInfo


class ModelSource(Protocol):
    format: Literal["gguf", "hf"]
    path: Path  # the .gguf file or the Hugging Face directory
    config: ModelConfig | EncoderConfig  # a decoder's or a BERT-family encoder's architecture
    pooling: PoolingConfig | None  # what the files say turns hidden states into one vector (None: nothing)
    # what the file says besides its tensors: GGUF key/values, or an HF directory's config.json
    metadata: Mapping[str, Any]

    @property
    def tensors(self) -> list[TensorInfo]: ...  # every tensor as stored, in file order

    def weight_shapes(self) -> dict[str, tuple[int, ...]]: ...  # canonical name -> shape

    def check_types(self) -> None: ...  # UnsupportedModelError for a tensor type churon cannot read

    def file_name(self, canonical: str) -> str: ...  # the name this file uses for a canonical tensor name

    def load_weights(self) -> dict[str, GGUFTensor | torch.Tensor]: ...  # canonical name -> weight
