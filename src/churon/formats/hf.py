"""Hugging Face model directories: config.json, one or sharded *.safetensors, tokenizer files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from churon.config import ModelConfig, check_architecture
from churon.errors import ModelFileError, UnsupportedModelError
from churon.formats.tensor_info import TensorInfo

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON: {e}") from e


def _canonical_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


class HFModel:
    """A Hugging Face directory seen as a model (a ModelSource): its ModelConfig, tensor index and weights.
    The tokenizer files beside them are churon.tokenizer's to read."""

    format = "hf"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelFileError(f"{self.path}: not a directory")
        self.metadata = read_json(self.path / "config.json")
        self.config = self._config(self.metadata)
        self._shards = self._shard_files()
        self._index: dict[str, tuple[Path, TensorInfo]] = {}
        for shard in self._shards:
            try:
                with safe_open(shard, framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        shape = tuple(sl.get_shape())
                        dtype = sl.get_dtype()
                        size = math.prod(shape) * _DTYPE_BYTES.get(dtype, 0)
                        self._index[name] = (shard, TensorInfo(name, shape, dtype, size))
            except ModelFileError:
                raise
            except Exception as e:  # safetensors raises SafetensorError for bad headers and truncated data
                raise ModelFileError(f"{shard}: not a readable safetensors file: {e}") from e

    def _config(self, cfg: dict[str, Any]) -> ModelConfig:
        source = str(self.path / "config.json")
        arch = cfg.get("model_type")
        if arch is None:
            raise ModelFileError(f"{source}: field 'model_type' is missing")
        flags = dict(check_architecture(arch, source))
        if "attention_bias" in cfg:
            flags["attention_bias"] = bool(cfg["attention_bias"])
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelFileError(f"{source}: field {key!r} is missing")
            return cfg[key]

        # transformers 5 moved rope_theta and rope_scaling into one "rope_parameters" dict.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            context_length=int(need("max_position_embeddings")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            **flags,
            extra={"torch_dtype": cfg.get("torch_dtype", cfg.get("dtype"))},
        )

    def _shard_files(self) -> list[Path]:
        index = self.path / SAFETENSORS_INDEX
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFileError(f"{index}: field 'weight_map' is missing")
            shards = [self.path / name for name in dict.fromkeys(weight_map.values())]
        else:
            shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise ModelFileError(f"{self.path}: no *.safetensors files")
        for shard in shards:
            if not shard.is_file():
                raise ModelFileError(f"{shard}: no such file (named in {SAFETENSORS_INDEX})")
        return shards

    @property
    def tensors(self) -> list[TensorInfo]:
        return [info for _, info in self._index.values()]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {_canonical_name(name): info.shape for name, (_, info) in self._index.items()}

    def check_types(self) -> None:
        """safetensors float types are all readable; integer tensors are not weights churon knows."""

    def file_name(self, canonical: str) -> str:
        return canonical if canonical in self._index else "model." + canonical

    def load_weights(self) -> dict[str, torch.Tensor]:
        weights = {_canonical_name(name): self._read(name) for name in self._index}
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def load_tensor(self, canonical: str) -> torch.Tensor:
        """One tensor as float32, read on its own (quantization holds one transformer block at a time)."""
        name = self.file_name(canonical)
        if name not in self._index:
            raise ModelFileError(f"{self.path}: no tensor {canonical!r}")
        return self._read(name)

    def _read(self, name: str) -> torch.Tensor:
        shard = self._index[name][0]
        try:
            with safe_open(shard, framework="pt") as f:
                return f.get_tensor(name).float()
        except Exception as e:  # safetensors raises SafetensorError for truncated data
            raise ModelFileError(f"{shard}: cannot read tensor {name!r}: {e}") from e


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
