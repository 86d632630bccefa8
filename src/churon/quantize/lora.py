"""A LoRA adapter in the export pipeline: merged into the weights quantize_model reads, or written alone.

Merging: W' = W + S * s * B @ A for every target module, in float32, where s is the module's own scaling
(alpha / r, or alpha / sqrt(r) with rsLoRA) and S the --scale of the export. SourceTensors adds it as each
tensor is read (lora_delta), so every quantization method and the calibration see the merged weights, one
block at a time like the base weights.

Alone: `export_adapter` writes a llama.cpp GGUF adapter (formats.lora.write_lora_gguf) of the model it is for.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from churon.config import ModelConfig
from churon.errors import UnsupportedModelError
from churon.formats.lora import LoraAdapter, LoraModule, read_lora, write_lora_gguf
from churon.formats.source import ModelSource
from churon.loader import open_model


def lora_for(source: ModelSource, lora: LoraAdapter | str | os.PathLike) -> LoraAdapter:
    """The adapter, read for (and checked against) the model of `source`: ModelFileError naming the tensor
    that does not fit, before anything is written. An adapter already read is checked again: it may have
    been read for another model (a GGUF adapter must be read with the config its q/k rows are un-permuted by)."""
    config = source.config
    if not isinstance(config, ModelConfig):
        raise UnsupportedModelError(
            f"{source.path}: a LoRA adapter applies to a decoder's linear layers; {config.architecture} is an encoder")
    if isinstance(lora, LoraAdapter):
        lora.check(config)
        return lora
    return read_lora(lora, config)


def check_lora_scale(scale: float) -> float:
    if not math.isfinite(scale):
        raise ValueError(f"--scale must be a finite number, got {scale}")
    return float(scale)


def lora_delta(module: LoraModule, scale: float) -> torch.Tensor:
    """S * s * B @ A, float32 [out, in] in Hugging Face's row order; the product first, then the scaling,
    as PEFT's merge_and_unload computes it (so the merged weights equal PEFT's bit for bit at scale 1)."""
    return (module.b.float() @ module.a.float()) * (scale * module.scale)


def export_adapter(model: str | os.PathLike, lora: str | os.PathLike, out: str | os.PathLike,
                   qtype: str = "F32") -> Path:
    """Write adapter `lora` (PEFT directory or GGUF adapter) for `model` as a llama.cpp GGUF adapter at `out`,
    A and B as qtype (F32 or F16), llama attn_q / attn_k lora_b rows permuted as that model's weights are."""
    out = Path(out)
    source = open_model(model)
    # the writer truncates out before it writes: the model's own GGUF file would be lost, not just replaced
    for what, given in (("adapter", Path(lora)), ("model", Path(source.path))):
        if out.exists() and out.resolve() == given.resolve():
            raise ValueError(f"{out}: the output would overwrite the {what}")
    adapter = lora_for(source, lora)
    return write_lora_gguf(adapter, source.config, out, qtype)
