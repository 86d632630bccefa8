"""SourceTensors: a model's tensors by GGUF name, read one at a time as float32.

Quantization never holds the model: it reads a transformer block, quantizes and writes it, and
lets it go. A GGUF source is dequantized tensor by tensor from its memory map; a Hugging Face
source's safetensors are read tensor by tensor.

Two layouts: `read` gives llama.cpp's (what a GGUF file stores: llama attn_q / attn_k rows
interleaved per head), `read_canonical` gives Hugging Face's (what churon's Transformer runs).

With a LoRA adapter both give the merged weights W + S * s * B @ A (quantize.lora): the product is made
in Hugging Face's row order and permuted with the weight where llama.cpp's layout interleaves it.
"""

from __future__ import annotations

import torch

from churon.config import ModelConfig
from churon.errors import ModelFileError
from churon.formats.gguf import GGUFModel, canonical_name, from_llama_cpp_layout
from churon.formats.gguf_writer import gguf_tensor_name, llama3_rope_freqs, permuted_heads, to_llama_cpp_layout
from churon.formats.hf import HFModel
from churon.formats.lora import LoraAdapter, LoraModule
from churon.formats.quants import dequantize
from churon.formats.source import ModelSource
from churon.quantize.lora import lora_delta


class SourceTensors:
    def __init__(self, source: ModelSource, lora: LoraAdapter | None = None, lora_scale: float = 1.0):
        """lora: an adapter already checked against source's config (quantize.lora.lora_for), merged into
        every tensor it targets, its products scaled by lora_scale."""
        self.source = source
        self.config = source.config
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._canonical: dict[str, str] = {}  # HF source: GGUF name -> canonical name
        self._lora_scale = lora_scale
        self._rope_freqs: torch.Tensor | None = None
        if isinstance(source, GGUFModel):
            self.shapes = {t.name: tuple(t.shape) for t in source.file.tensors.values()}
        else:
            decoder = isinstance(source.config, ModelConfig)  # an encoder has no RoPE and no output matrix
            self._rope_freqs = llama3_rope_freqs(source.config) if decoder else None
            if self._rope_freqs is not None:
                self.shapes["rope_freqs.weight"] = tuple(self._rope_freqs.shape)
            tied = decoder and source.config.tie_word_embeddings
            for canonical, shape in source.weight_shapes().items():
                if tied and canonical == "lm_head.weight":
                    continue  # llama.cpp writes no output matrix for tied embeddings
                name = gguf_tensor_name(source, canonical)
                self._canonical[name] = canonical
                self.shapes[name] = tuple(shape)
        self.order = [n for group in self.groups() for n in group]
        self._lora: dict[str, LoraModule] = {}  # GGUF name -> the adapter module merged into it
        if lora is not None:
            by_canonical = {self._canonical_name(n): n for n in self.shapes}
            for module, m in lora.modules.items():
                name = by_canonical.get(f"{module}.weight")
                if name is None:  # adapter.check rules this out; a merge that skipped a module would be wrong
                    raise ModelFileError(f"{lora.path}: LoRA module {module!r} has no weight in {source.path}")
                self._lora[name] = m

    def groups(self) -> list[list[str]]:
        """Tensor names, each transformer block's together ('blk.N.*'), in the order blocks first appear;
        the tensors outside the blocks (embeddings, output norm and matrix) form one group of their own."""
        by_key: dict[str, list[str]] = {}
        for name in self.shapes:
            parts = name.split(".")
            key = ".".join(parts[:2]) if parts[0] == "blk" else ""
            by_key.setdefault(key, []).append(name)
        return list(by_key.values())

    def block(self, layer: int) -> list[str]:
        return [n for n in self.shapes if n.startswith(f"blk.{layer}.")]

    def read(self, name: str) -> torch.Tensor:
        """A fresh float32 copy in llama.cpp's layout: methods may rewrite what they are given."""
        w, heads = self._read_stored(name), permuted_heads(self.source, name)
        if isinstance(self.source, HFModel):
            w = self._merged(name, w)
            return w if heads is None else to_llama_cpp_layout(w, heads)
        if name in self._lora:
            delta = lora_delta(self._lora[name], self._lora_scale)
            w = w + (delta if heads is None else to_llama_cpp_layout(delta, heads))
        return w

    def read_canonical(self, name: str) -> tuple[str, torch.Tensor]:
        """(canonical name, float32 tensor in the Hugging Face layout) of GGUF tensor `name`."""
        w = self._read_stored(name)
        if not isinstance(self.source, HFModel):
            heads = permuted_heads(self.source, name)
            w = w if heads is None else from_llama_cpp_layout(w, heads)
        return self._canonical_name(name), self._merged(name, w)

    def _canonical_name(self, name: str) -> str:
        if isinstance(self.source, HFModel):
            return self._canonical.get(name, name)
        return canonical_name(name, self.source.config.architecture) or name

    def _merged(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """w (Hugging Face's row order) with the adapter's product added, if it targets tensor `name`."""
        if name not in self._lora:
            return w
        return w + lora_delta(self._lora[name], self._lora_scale)

    def _read_stored(self, name: str) -> torch.Tensor:
        if isinstance(self.source, GGUFModel):
            t = self.source.file.tensors[name]
            return dequantize(t.data, t.qtype, t.shape, name=name)
        if name == "rope_freqs.weight":
            return self._rope_freqs.clone()
        return self.source.load_tensor(self._canonical[name])
