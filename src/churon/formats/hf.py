"""Hugging Face model directories: config.json, one or sharded *.safetensors, tokenizer files."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from churon.config import (
    MAX_CONTEXT_LENGTH,
    MAX_LAYERS,
    GEMMA_ARCHITECTURES,
    SWA_PERIODS,
    ConfigReader,
    EncoderConfig,
    ModelConfig,
    check_architecture,
    check_config,
    check_rope_scaling,
    phi3_windows,
    positive_float,
    windows_of_pattern,
)
from churon.errors import ModelFileError, UnsupportedModelError
from churon.formats import bert
from churon.formats.gguf import GGUFTensor
from churon.formats.quants import dequantize
from churon.formats.model_dir import inside, read_json_object
from churon.formats.sentence_transformers import read_pipeline
from churon.formats.tensor_info import TensorInfo

SAFETENSORS_INDEX = "model.safetensors.index.json"
# config.json "architectures" that are BERT whatever model_type says (llama.cpp's converter registers them)
BERT_ARCHITECTURES = ("BertModel", "BertForMaskedLM")


# ModelConfig field -> its config.json key
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "context_length": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "sliding_window": "sliding_window",
    "layer_windows": "layer_types",
    "num_experts": "num_experts",  # Mixtral's num_local_experts
    "num_experts_per_tok": "num_experts_per_tok",
}
# model_type -> the architecture it is (Gemma 3's text-only checkpoints; the MoE families by their GGUF names)
_ARCHITECTURE_OF = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
# An expert's matrix, one tensor per expert as save_pretrained writes them (Mixtral names them w1 / w3 / w2), and its
# canonical name: the experts stacked [experts, rows, cols] as GGUF holds them
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_MATRICES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj", "w1": "gate_proj",
                    "w3": "up_proj", "w2": "down_proj"}
# gpt-oss's experts, each layer's as four fused tensors: gate_up_proj [experts, hidden, 2 x FFN] (gate and up
# interleaved along the last dimension: gate, up, gate, up, ...), its bias [experts, 2 x FFN], down_proj
# [experts, FFN, hidden] (transposed: columns are outputs) and its bias. canonical suffix -> (file suffix, the
# canonical tensor [experts, rows, cols] or [experts, rows] from the file's)
_FUSED_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_FUSED_EXPERT_PARTS = {
    "gate_up_proj": {"gate_proj.weight": lambda t: t[:, :, 0::2].transpose(1, 2),
                     "up_proj.weight": lambda t: t[:, :, 1::2].transpose(1, 2)},
    "gate_up_proj_bias": {"gate_proj.bias": lambda t: t[:, 0::2], "up_proj.bias": lambda t: t[:, 1::2]},
    "down_proj": {"down_proj.weight": lambda t: t.transpose(1, 2)},
    "down_proj_bias": {"down_proj.bias": lambda t: t},
}
# gpt-oss's release: gate_up_proj and down_proj as MXFP4, each a _blocks tensor [experts, rows, cols / 32, 16] (two
# E2M1 codes a byte, the even element's in the low nibble) and a _scales one [experts, rows, cols / 32] (E8M0 bytes),
# rows being outputs (gate_up's 2 x FFN interleaved gate, up, ...; down's hidden)
_MXFP4_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)")
_LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def architecture_of(model_type: str) -> str:
    """The architecture (ModelConfig.architecture, GGUF's general.architecture) of a transformers model_type."""
    return _ARCHITECTURE_OF.get(model_type, model_type)


def _canonical_name(hf_name: str) -> str:
    # Mixtral's router and gpt-oss's
    name = hf_name.removeprefix("model.")
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.").replace(".mlp.router.", ".mlp.gate.")


def is_bert(cfg: dict[str, Any]) -> bool:
    archs = cfg.get("architectures")
    return cfg.get("model_type") == bert.ARCHITECTURE or (
        isinstance(archs, list) and any(a in BERT_ARCHITECTURES for a in archs))


class HFModel:
    """A Hugging Face directory seen as a model (a ModelSource): its ModelConfig (EncoderConfig for BERT),
    tensor index and weights, and the pooling a sentence-transformers directory declares (formats/
    sentence_transformers.py). The tokenizer files beside them are churon.tokenizer's to read."""

    format = "hf"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelFileError(f"{self.path}: not a directory")
        self.metadata = read_json_object(self.path / "config.json")
        self._shards = self._shard_files()
        file_bytes = sum(shard.stat().st_size for shard in self._shards)
        self.config: ModelConfig | EncoderConfig
        if is_bert(self.metadata):
            self.config = bert.encoder_config_from_hf(self.metadata, str(self.path / "config.json"), file_bytes)
        else:
            self.config = self._config(self.metadata, file_bytes)
        self.pooling, notes = read_pipeline(self.path)
        self.config.extra.update(notes)
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
        # canonical name of a stacked expert tensor -> its experts' tensors in the file, by expert index
        self._experts: dict[str, dict[int, str]] = {}
        # canonical name -> (the fused tensor of gpt-oss's experts it is a part of, how to take it out)
        self._fused: dict[str, tuple[str, Any]] = {}
        # canonical name -> (the MXFP4 _blocks tensor of gpt-oss's experts holding its rows, the first of them, the step)
        self._mxfp4: dict[str, tuple[str, int, int]] = {}
        self._file_names = self._canonical_names()

    def _canonical_names(self) -> dict[str, str]:
        """Canonical name -> the file's name, for every tensor the model reads (a BERT's pooler and heads
        are not read); an expert's tensors go to self._experts."""
        encoder = isinstance(self.config, EncoderConfig)
        out: dict[str, str] = {}
        for name in self._index:
            expert = None if encoder else _EXPERT.fullmatch(name)
            fused = None if encoder else _FUSED_EXPERT.fullmatch(name)
            packed = None if encoder else _MXFP4_EXPERT.fullmatch(name)
            if packed is not None:
                if packed[3] == "blocks":
                    rows = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}[packed[2]]
                    for i, part in enumerate(rows):
                        self._mxfp4[f"layers.{packed[1]}.mlp.experts.{part}.weight"] = (name, i, len(rows))
                continue
            if fused is not None:
                for part, take in _FUSED_EXPERT_PARTS[fused[2] + (fused[3] or "")].items():
                    self._fused[f"layers.{fused[1]}.mlp.experts.{part}"] = (name, take)
                continue
            if expert is not None and expert[3] in _EXPERT_MATRICES:
                canonical = f"layers.{expert[1]}.mlp.experts.{_EXPERT_MATRICES[expert[3]]}.weight"
                self._experts.setdefault(canonical, {})[int(expert[2])] = name
                continue
            canonical = bert.canonical_from_hf(name) if encoder else _canonical_name(name)
            if canonical is None:
                continue
            if encoder and canonical in out:
                raise ModelFileError(f"{self.path}: tensors {out[canonical]!r} and {name!r} are the same weight")
            out[canonical] = name
        return out

    def _config(self, cfg: dict[str, Any], file_bytes: int) -> ModelConfig:
        source = str(self.path / "config.json")
        arch = cfg.get("model_type")
        if arch is None:
            raise ModelFileError(f"{source}: field 'model_type' is missing")
        arch = architecture_of(arch) if isinstance(arch, str) else arch
        flags = dict(check_architecture(arch, source))
        r = ConfigReader(cfg, source)
        if "attention_bias" in cfg:
            flags["attention_bias"] = r.boolean("attention_bias", False)
            if arch == "gpt-oss":  # its attention_bias is on o_proj too
                flags["attention_out_bias"] = flags["attention_bias"]
        if r.boolean("mlp_bias", False):
            raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")

        # transformers 5 moved rope_theta and rope_scaling into one "rope_parameters" dict (Gemma 3: one per
        # layer type, the windowed layers' apart).
        rope = cfg.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ModelFileError(f"{source}: rope_parameters = {rope!r:.80} is not an object")
        local_rope = None
        if "full_attention" in rope:
            local_rope, rope = rope.get("sliding_attention"), rope["full_attention"]
            if not isinstance(rope, dict) or not isinstance(local_rope, (dict, type(None))):
                raise ModelFileError(f"{source}: rope_parameters' layer types are not objects")
        if cfg.get("rope_theta") is not None:
            rope_theta = r.number("rope_theta")
        else:
            rope_theta = ConfigReader(rope, source + ": rope_parameters").number("rope_theta", 10000.0)
        scaling_key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        scaling = cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        if arch == "phi3" and isinstance(scaling, dict):
            # transformers' Phi3Config takes the original context from the top level (4096 when it is absent),
            # whatever the scaling says
            original = r.integer("original_max_position_embeddings", 4096, hi=MAX_CONTEXT_LENGTH)
            scaling = {**scaling, "original_max_position_embeddings": original}
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
        if partial is not None and positive_float(partial, "partial_rotary_factor", source) != 1:
            raise UnsupportedModelError(f"{source}: partial_rotary_factor = {partial} is not supported (RoPE over part"
                                        " of each head, as Phi-4-mini has)")
        keys = _CONFIG_KEYS
        heads = r.dimension(keys["num_heads"], file_bytes)
        hidden = r.dimension(keys["hidden_size"], file_bytes)
        head_dim = r.head_dim(keys, hidden, heads, file_bytes)
        context_length = r.integer(keys["context_length"], hi=MAX_CONTEXT_LENGTH)
        num_layers = r.integer(keys["num_layers"], hi=MAX_LAYERS, why=" (llama.cpp's LLAMA_MAX_LAYERS)")
        flags["layer_windows"] = _layer_windows(cfg, r, arch, num_layers, context_length, source)
        if arch in GEMMA_ARCHITECTURES:
            flags |= _gemma_fields(cfg, r, arch, local_rope, source)
        if arch in _MOE_ARCHITECTURES:
            flags |= _moe_fields(cfg, r, arch, num_layers, file_bytes, source)
        config = ModelConfig(
            architecture=arch,
            vocab_size=r.dimension(keys["vocab_size"], file_bytes),
            hidden_size=hidden,
            intermediate_size=r.dimension(keys["intermediate_size"], file_bytes),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=r.dimension(keys["num_kv_heads"], file_bytes, default=heads),
            head_dim=head_dim,
            context_length=context_length,
            rms_norm_eps=r.number(keys["rms_norm_eps"], 1e-6),
            rope_theta=rope_theta,
            rope_scaling=check_rope_scaling(scaling, scaling_key, source, head_dim=head_dim,
                                            context_length=context_length),
            tie_word_embeddings=r.boolean("tie_word_embeddings", False),
            **flags,
            extra={"torch_dtype": cfg.get("torch_dtype", cfg.get("dtype"))},
        )
        check_config(config, keys, source)
        return config

    def _shard_files(self) -> list[Path]:
        index = self.path / SAFETENSORS_INDEX
        if index.exists():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFileError(f"{index}: field 'weight_map' is missing or not an object")
            # each name checked before it is hashed into the de-duplicated list (a list value is not hashable)
            named_in = f"{index}: weight_map"
            shards = list(dict.fromkeys(inside(self.path, name, named_in, "shard") for name in weight_map.values()))
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
        shapes = {canonical: self._index[name][1].shape for canonical, name in self._file_names.items()}
        for canonical, names in self._experts.items():
            missing = next((e for e in range(len(names)) if e not in names), None)
            if missing is not None:  # experts 0..n-1, each once
                raise ModelFileError(f"{self.path}: tensor {self.file_name(canonical, missing)!r} is missing")
            first = self._index[names[0]][1].shape
            for e in range(len(names)):
                if self._index[names[e]][1].shape != first:
                    raise ModelFileError(f"{self.path}: tensor {names[e]!r} has shape {list(self._index[names[e]][1].shape)},"
                                         f" expert 0's has {list(first)}")
            shapes[canonical] = (len(names), *first)
        for canonical, (name, first, step) in self._mxfp4.items():
            shape = self._index[name][1].shape
            scales = self._index.get(name.removesuffix("_blocks") + "_scales")
            if len(shape) != 4 or shape[3] != 16 or shape[1] % step:
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {list(shape)}, not MXFP4 blocks [experts, rows,"
                                     " blocks, 16]" + (" with rows of gate and up" if step == 2 else ""))
            if scales is None or tuple(scales[1].shape) != tuple(shape[:3]):
                raise ModelFileError(f"{self.path}: tensor {name.removesuffix('_blocks') + '_scales'!r} is missing or not"
                                     f" shaped {list(shape[:3])}, as {name!r} needs")
            shapes[canonical] = (shape[0], shape[1] // step, shape[2] * 32)
        for canonical, (name, take) in self._fused.items():
            shape = self._index[name][1].shape
            interleaved = "gate_up_proj" in name  # gate and up alternate along its last dimension: an even one
            if len(shape) != (3 if name.endswith("proj") else 2) or (interleaved and shape[-1] % 2):
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {list(shape)}, not gpt-oss's fused experts'"
                                     " [experts, hidden, 2 x FFN], [experts, FFN, hidden] or [experts, 2 x FFN]")
            shapes[canonical] = tuple(take(torch.empty(shape, device="meta")).shape)
        return shapes

    def check_types(self) -> None:
        """safetensors float types are all readable; an integer weight is a quantization churon does not know."""
        for name, (shard, info) in self._index.items():
            if info.dtype not in FLOAT_DTYPES and name.endswith((".weight", ".bias")):
                raise UnsupportedModelError(
                    f"{shard}: tensor {name!r} has type {info.dtype}, which churon cannot read as a weight"
                    f" (supported: {', '.join(FLOAT_DTYPES)})"
                )

    def file_name(self, canonical: str, expert: int = 0) -> str:
        """The name this directory uses (or would use) for a canonical tensor name (a stacked expert tensor: that of
        its expert `expert`)."""
        if canonical in self._fused:
            return self._fused[canonical][0]
        if canonical in self._mxfp4:
            return self._mxfp4[canonical][0]
        if ".experts." in canonical:
            return self._experts.get(canonical, {}).get(expert) or "model." + canonical.replace(
                ".experts.", f".experts.{expert}.")
        if canonical in self._file_names:
            return self._file_names[canonical]
        return canonical if isinstance(self.config, EncoderConfig) else "model." + canonical

    def load_weights(self) -> dict[str, torch.Tensor]:
        weights = {canonical: self._read(name) for canonical, name in self._file_names.items()}
        weights |= {canonical: self.load_tensor(canonical) for canonical in (*self._experts, *self._fused)}
        weights |= {canonical: self._mxfp4_tensor(canonical) for canonical in self._mxfp4}
        if isinstance(self.config, ModelConfig) and self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def load_tensor(self, canonical: str) -> torch.Tensor:
        """One tensor as float32, read on its own (quantization holds one transformer block at a time)."""
        if canonical in self._experts:
            names = self._experts[canonical]
            return torch.stack([self._read(names[e]) for e in range(len(names))])
        if canonical in self._fused:
            name, take = self._fused[canonical]
            return take(self._read(name)).contiguous()
        if canonical in self._mxfp4:
            w = self._mxfp4_tensor(canonical)
            return dequantize(w.data, w.qtype, w.shape, name=self._mxfp4[canonical][0])
        name = self.file_name(canonical)
        if name not in self._index:
            raise ModelFileError(f"{self.path}: no tensor {canonical!r}")
        return self._read(name)

    def _mxfp4_tensor(self, canonical: str) -> GGUFTensor:
        """A stacked expert matrix from gpt-oss's MXFP4 blocks and scales as ggml's MXFP4 (the same E8M0 byte and E2M1
        codes, ggml's doubled values under its half scale being the same numbers), its rows picked (gate: the even
        rows of gate_up, up: the odd ones), its codes in ggml's order (byte j: elements j and j + 16)."""
        name, first, step = self._mxfp4[canonical]
        blocks, scales = (self._read_raw(name), self._read_raw(name.removesuffix("_blocks") + "_scales"))
        blocks, scales = blocks[:, first::step], scales[:, first::step]
        experts, rows, n = scales.shape
        codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(-1, 32)  # element order
        out = torch.empty(codes.shape[0], 17, dtype=torch.uint8)
        out[:, 0] = scales.reshape(-1)
        out[:, 1:] = codes[:, :16] | (codes[:, 16:] << 4)
        return GGUFTensor(canonical, (experts, rows, n * 32), GGMLQuantizationType.MXFP4, out.numpy().reshape(-1))

    def _read_raw(self, name: str) -> torch.Tensor:
        shard = self._index[name][0]
        try:
            with safe_open(shard, framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise ModelFileError(f"{shard}: cannot read tensor {name!r}: {e}") from e

    def _read(self, name: str) -> torch.Tensor:
        shard = self._index[name][0]
        try:
            with safe_open(shard, framework="pt") as f:
                tensor = f.get_tensor(name).float()
        except Exception as e:  # safetensors raises SafetensorError for truncated data
            raise ModelFileError(f"{shard}: cannot read tensor {name!r}: {e}") from e
        if self.config.architecture in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            # Gemma's RMSNorm multiplies by (1 + weight); llama.cpp's converter stores 1 + weight, and so do we
            tensor += 1.0
        return tensor


def _layer_windows(cfg: dict[str, Any], r: ConfigReader, arch: str, num_layers: int, context_length: int,
                   source: str) -> tuple[int, ...]:
    """Per layer, its attention window (0: the whole history), as transformers reads the config: layer_types when
    given, else the architecture's pattern; Qwen's windows only with use_sliding_window."""
    if cfg.get("sliding_window") is None or cfg.get("use_sliding_window") is False:
        return ()
    window = r.integer("sliding_window", hi=MAX_CONTEXT_LENGTH)
    if arch == "phi3":
        return phi3_windows(num_layers, window, context_length)
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(t in _LAYER_TYPES for t in layer_types):
            raise ModelFileError(f"{source}: layer_types = {layer_types!r:.80} is not a list of"
                                 f" {' / '.join(_LAYER_TYPES)}")
        return tuple(window if _LAYER_TYPES[t] else 0 for t in layer_types)
    if arch in ("qwen2", "qwen3"):  # use_sliding_window: the layers from max_window_layers on
        first = r.integer("max_window_layers", default=num_layers, lo=0)
        return tuple(window if i >= first else 0 for i in range(num_layers))
    if arch not in SWA_PERIODS:  # without layer_types (transformers 4 configs), the architecture's pattern
        return ()
    period = r.integer("sliding_window_pattern", default=SWA_PERIODS[arch], hi=num_layers)
    return windows_of_pattern(num_layers, window, period)


_MOE_ARCHITECTURES = ("mixtral", "qwen2moe", "qwen3moe", "olmoe", "gpt-oss")  # the MoE families a directory may hold


def _moe_fields(cfg: dict[str, Any], r: ConfigReader, arch: str, num_layers: int, file_bytes: int,
                source: str) -> dict[str, Any]:
    """The experts as transformers builds them: their count, top-k, FFN size (Qwen's moe_intermediate_size, else
    intermediate_size), the top-k renormalization (Mixtral always), Qwen2-MoE's shared expert and q/k/v biases,
    Qwen's dense layers (mlp_only_layers, and those decoder_sparse_step skips)."""
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map), as Mixtral has it
    count_key = "num_local_experts" if cfg.get("num_local_experts") is not None else "num_experts"
    count = r.dimension(count_key, file_bytes)
    fields: dict[str, Any] = {
        "num_experts": count,
        "num_experts_per_tok": r.integer("num_experts_per_tok"),
        "moe_intermediate_size": r.dimension("moe_intermediate_size" if arch.startswith("qwen") else "intermediate_size",
                                             file_bytes),
    }
    if arch == "gpt-oss":  # its softmax is over the chosen k already; the clamped SwiGLU's constants
        fields["swiglu_alpha"] = r.number("swiglu_alpha", 1.702)
        fields["swiglu_limit"] = r.number("swiglu_limit", 7.0)
    elif arch != "mixtral":
        fields["norm_topk_prob"] = r.boolean("norm_topk_prob", False)
    if arch == "olmoe" and cfg.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{source}: clip_qkv = {cfg['clip_qkv']!r:.80} is not supported")
    if arch == "qwen2moe":
        fields["attention_bias"] = r.boolean("qkv_bias", True)
        fields["shared_expert_intermediate_size"] = r.integer("shared_expert_intermediate_size", default=0, lo=0,
                                                              hi=file_bytes * 8)
    if arch.startswith("qwen"):
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ModelFileError(f"{source}: mlp_only_layers = {only!r:.80} is not a list of layer numbers")
        step = r.integer("decoder_sparse_step", default=1)
        fields["dense_layers"] = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return fields


def _gemma_fields(cfg: dict[str, Any], r: ConfigReader, arch: str, local_rope: dict[str, Any] | None,
                  source: str) -> dict[str, Any]:
    """Gemma 2/3's query scale, soft-caps and local RoPE base; its activation checked."""
    act = cfg.get("hidden_activation", cfg.get("hidden_act"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{source}: hidden_activation {act!r:.80} is not supported (supported:"
                                    " gelu_pytorch_tanh)")
    fields: dict[str, Any] = {}
    if cfg.get("query_pre_attn_scalar") is not None:
        fields["query_pre_attn_scalar"] = r.number("query_pre_attn_scalar")
    for field, key in (("attn_logit_softcap", "attn_logit_softcapping"), ("final_logit_softcap", "final_logit_softcapping")):
        if cfg.get(key) is not None:
            fields[field] = r.number(key)
    if arch == "gemma3":
        if local_rope is not None:
            if local_rope.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"{source}: rope_parameters.sliding_attention: RoPE scaling"
                                            f" {local_rope.get('rope_type')!r:.80} is not supported on windowed layers")
            fields["rope_local_theta"] = positive_float(local_rope.get("rope_theta", 10000.0),
                                                        "rope_parameters.sliding_attention.rope_theta", source)
        else:
            fields["rope_local_theta"] = r.number("rope_local_base_freq", 10000.0)
    return fields


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # the safetensors dtypes weights are read from (and adapters)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
