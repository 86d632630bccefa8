"""The loader: from a model name or path to a ready model (a decoder Transformer or an Encoder) and Tokenizer.

model file -> ModelSource (GGUF file or HF directory) -> checked weights -> Transformer | Encoder, Tokenizer
"""

from __future__ import annotations

import logging
import os

import torch

from churon import kernels
from churon.config import EncoderConfig
from churon.errors import ModelFileError
from churon.formats.bert import expected_encoder_weight_shapes
from churon.formats.gguf import GGUFModel
from churon.formats.hf import HFModel
from churon.formats.source import ModelSource
from churon.model.backend import Backend
from churon.model.encoder import Encoder
from churon.model.native_backend import NativeBackend
from churon.model.reference_backend import ReferenceBackend
from churon.model.transformer import Transformer, expected_weight_shapes
from churon.registry import resolve_model
from churon.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("churon")

KERNEL_CHOICES = ("auto", "native", "reference")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def open_model(model: str | os.PathLike, pull: bool = True) -> ModelSource:
    """Open a model file without reading its weights: a registry name, a .gguf file or an HF directory.
    Its architecture and tensor index are checked (check_weights) before anything is sized by them."""
    path = resolve_model(model, pull=pull)
    source = HFModel(path) if path.is_dir() else GGUFModel(path)
    check_weights(source)
    return source


def check_weights(source: ModelSource) -> None:
    """Every tensor the architecture needs is present with the right shape, before any data is read."""
    found = source.weight_shapes()
    c = source.config
    expected = expected_encoder_weight_shapes(c) if isinstance(c, EncoderConfig) else expected_weight_shapes(c)
    for name, shape in expected.items():
        if name not in found:
            raise ModelFileError(f"{source.path}: tensor {source.file_name(name)!r} is missing")
        if tuple(found[name]) != shape:
            raise ModelFileError(
                f"{source.path}: tensor {source.file_name(name)!r} has shape {list(found[name])}, expected {list(shape)}"
            )


def make_backend(kernels_choice: str, dtype: torch.dtype) -> Backend:
    """'auto': native when built and the dtype is float32; otherwise the reference path, said once."""
    if kernels_choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels_choice!r}: must be one of {', '.join(KERNEL_CHOICES)}")
    if kernels_choice == "reference":
        return ReferenceBackend(dtype)
    if dtype != torch.float32:
        if kernels_choice == "native":
            raise ValueError(f"the native kernels compute in float32; dtype={dtype} needs kernels='reference'")
        return ReferenceBackend(dtype)
    if kernels.cpu is None:
        if kernels_choice == "native":
            raise RuntimeError(kernels.reason)
        log.warning("churon: native CPU kernels unavailable (%s); running the PyTorch reference path", kernels.reason)
        return ReferenceBackend(dtype)
    return NativeBackend()


def load_model(
    model: str | os.PathLike, dtype: str | torch.dtype = "float32", pull: bool = True, kernels: str = "auto"
) -> tuple[Transformer | Encoder, Tokenizer, ModelSource]:
    """kernels: "native" (churon's CPU kernels), "reference" (plain PyTorch), "auto" (native when built, float32).
    A decoder becomes a Transformer, a BERT-family encoder an Encoder."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
        dtype = DTYPES[dtype]
    backend = make_backend(kernels, dtype)
    source = open_model(model, pull=pull)
    source.check_types()
    tokenizer = load_tokenizer(source)
    model_class = Encoder if isinstance(source.config, EncoderConfig) else Transformer
    return model_class(source.config, source.load_weights(), backend), tokenizer, source
