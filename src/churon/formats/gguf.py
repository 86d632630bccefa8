"""GGUF files (llama.cpp's format, v2 and v3): metadata, tensor index, memory-mapped data.

churon reads the header itself, over a memory map, the way llama.cpp's gguf.cpp does: every
length and count is checked against the bytes that remain before anything is read or sized by
it (a short read is an error, never a loop), keys and tensor names are unique, nested arrays are
refused, and each tensor's bytes lie inside the data section, aligned, and overlap no other
tensor's. Every problem is a ModelFileError naming the file and the key or tensor.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from churon.config import (
    MAX_CONTEXT_LENGTH,
    MAX_LAYERS,
    GEMMA_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    SWA_PERIODS,
    ConfigReader,
    EncoderConfig,
    ModelConfig,
    PoolingConfig,
    check_architecture,
    check_config,
    longrope_scaling,
    phi3_windows,
    windows_of_pattern,
    yarn_attention_factor,
    yarn_scaling,
)
from churon.errors import ModelFileError, UnsupportedModelError
from churon.formats import bert
from churon.formats.quants import SUPPORTED_TYPES, dequantize
from churon.formats.tensor_info import TensorInfo

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # v1 had 32-bit counts and lengths; llama.cpp no longer reads it either
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# scalar value types: struct format and size
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: rows first (GGUF stores ne reversed)
    qtype: GGMLQuantizationType
    data: np.ndarray  # raw bytes (uint8, flat), a view into the memory map

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        return self.data.nbytes


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    # key -> (value type, element type of an array or None): what a copy must write back (quantize)
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFFile":
        path = Path(path)
        if not path.is_file():
            raise ModelFileError(f"{path}: no such file")
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise ModelFileError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return _HeaderReader(path, buf).read()

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(f"{self.path}: metadata field {key!r} is missing")
        return self.metadata[key]


class _HeaderReader:
    """One pass over the header; `pos` only moves forward, and only after `_need` said the bytes are there."""

    def __init__(self, path: Path, buf: mmap.mmap):
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 4

    def _fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: malformed GGUF header: {what}")

    def _need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise ModelFileError(
                f"{self.path}: truncated GGUF header: {what} at byte {self.pos} needs {n} bytes, {self.size - self.pos} remain"
            )

    def _u32(self, what: str) -> int:
        self._need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def _u64(self, what: str) -> int:
        self._need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def _string(self, what: str) -> str:
        n = self._u64(f"the length of {what}")
        self._need(n, f"{what} ({n} bytes)")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._fail(f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None

    def _value_type(self, what: str) -> GGUFValueType:
        raw = self._u32(f"the type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self._fail(f"{what} has unknown value type {raw}") from None

    def _value(self, vtype: GGUFValueType, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string(f"the value of {key!r}")
        fmt = _SCALARS[vtype]
        size = struct.calcsize(fmt)
        self._need(size, f"the value of {key!r}")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def _array(self, key: str) -> tuple[list, GGUFValueType]:
        sub = self._value_type(f"the elements of {key!r}")
        count = self._u64(f"the element count of {key!r}")
        if sub == GGUFValueType.ARRAY:
            raise self._fail(f"{key!r} is an array of arrays, which GGUF readers do not support")
        # the count is checked against what remains before a single element is read: a string
        # takes at least its 8-byte length
        least = 8 if sub == GGUFValueType.STRING else struct.calcsize(_SCALARS[sub])
        if count > (self.size - self.pos) // least:
            raise self._fail(
                f"array {key!r} declares {count} elements of {sub.name}, more than the {self.size - self.pos}"
                f" bytes that remain can hold"
            )
        if sub != GGUFValueType.STRING:
            values = np.frombuffer(self.buf, dtype=_NUMPY[sub], count=count, offset=self.pos).tolist()
            self.pos += count * least
            return values, sub
        return self._strings(count, key), sub

    def _strings(self, count: int, key: str) -> list[str]:
        # the hot loop of a real file (a vocabulary and its merges: ~10^5 strings), kept tight
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        append = out.append
        try:
            for i in range(count):
                if pos + 8 > size:
                    self.pos = pos
                    self._need(8, f"the length of {key}[{i}]")
                (n,) = unpack(buf, pos)
                pos += 8
                if n > size - pos:
                    self.pos = pos
                    self._need(n, f"{key}[{i}] ({n} bytes)")
                append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise self._fail(f"{key}[{len(out)}] is not UTF-8 ({e.reason} at byte {e.start})") from None
        self.pos = pos
        return out

    def read(self) -> GGUFFile:
        version = self._u32("the version")
        if version not in GGUF_VERSIONS:
            raise ModelFileError(
                f"{self.path}: GGUF version {version} is not supported (supported: {', '.join(map(str, GGUF_VERSIONS))})"
            )
        n_tensors = self._u64("the tensor count")
        n_kv = self._u64("the metadata count")
        metadata: dict[str, Any] = {}
        value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for k in range(n_kv):  # every field reads at least 12 bytes: a lying count ends at a short read
            key = self._string(f"metadata key {k}")
            if key in metadata:
                raise self._fail(f"duplicate metadata key {key!r}")
            vtype = self._value_type(f"metadata field {key!r}")
            if vtype == GGUFValueType.ARRAY:
                metadata[key], sub = self._array(key)
            else:
                metadata[key], sub = self._value(vtype, key), None
            value_types[key] = (vtype, sub)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise self._fail(f"general.alignment = {alignment!r} is not a power of two")

        infos = []
        for k in range(n_tensors):
            name = self._string(f"the name of tensor {k}")
            n_dims = self._u32(f"the dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are possible)")
            ne = [self._u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
            raw_type = self._u32(f"the type of tensor {name!r}")
            offset = self._u64(f"the offset of tensor {name!r}")
            infos.append((name, ne, raw_type, offset))
        data_start = -(-self.pos // alignment) * alignment
        tensors = self._tensors(infos, data_start, alignment)
        return GGUFFile(self.path, version, metadata, tensors, value_types)

    def _tensors(self, infos: list, data_start: int, alignment: int) -> dict[str, GGUFTensor]:
        tensors: dict[str, GGUFTensor] = {}
        extents = []
        data_bytes = self.size - data_start
        for name, ne, raw_type, offset in infos:
            if name in tensors:
                raise self._fail(f"duplicate tensor name {name!r}")
            if raw_type not in _KNOWN_TYPES:
                raise ModelFileError(f"{self.path}: tensor {name!r} has unknown GGML type id {raw_type}")
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            if any(d < 1 for d in ne) or ne[0] % block:
                raise self._fail(
                    f"tensor {name!r} has dimensions {ne}: each must be at least 1 and the first a multiple of"
                    f" {qtype.name}'s block of {block}"
                )
            n_bytes = int(np.prod(ne, dtype=object)) // block * type_size  # Python integers: no overflow
            if offset % alignment:
                raise self._fail(f"tensor {name!r} has offset {offset}, not a multiple of the alignment {alignment}")
            if offset > data_bytes or n_bytes > data_bytes - offset:
                raise ModelFileError(
                    f"{self.path}: truncated: tensor {name!r} needs bytes {data_start + offset}..{data_start + offset + n_bytes}"
                    f" but the file has {self.size}"
                )
            extents.append((offset, n_bytes, name))
            data = np.frombuffer(self.buf, dtype=np.uint8, count=n_bytes, offset=data_start + offset)
            tensors[name] = GGUFTensor(name, tuple(reversed(ne)), qtype, data)
        extents.sort()
        for (start, n, name), (next_start, _, next_name) in zip(extents, extents[1:]):
            if start + n > next_start:
                raise self._fail(f"tensors {name!r} and {next_name!r} overlap (bytes {next_start}..{start + n})")
        return tensors


_KNOWN_TYPES = {int(t) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


# ModelConfig field -> its GGUF key after "{architecture}."
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_layers": "block_count",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "context_length": "context_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "rope_scaling": "rope.scaling.type",
    "sliding_window": "attention.sliding_window",
    "layer_windows": "attention.sliding_window_pattern",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
}
# llama.cpp renormalizes the top-k router weights per architecture (build_moe_ffn's norm_w), unless the file says
# {arch}.expert_weights_norm
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False, "gpt-oss": False}
# the stacked expert tensors a layer's expert_count must match (first dimension: the experts; gpt-oss's biases too)
_EXPERT_TENSORS = tuple(f"{kind}.{part}" for kind in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
                        for part in ("weight", "bias"))

# Gemma 3's windowed layers turn at base 10000 without scaling, a constant in llama.cpp (rope_freq_base_train_swa)
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# The 27B Gemmas scale queries by (hidden / heads) ** -0.5 rather than head_dim ** -0.5 (query_pre_attn_scalar
# 144); a GGUF does not say so, llama.cpp tells them by their layer count
_QUERY_SCALAR_BY_HIDDEN = {"gemma2": 46, "gemma3": 62}

# GGUF tensor name -> canonical name (see model/transformer.py); blk.N. becomes layers.N.
_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts: the router, the experts stacked [experts, rows, cols], Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}

# Gemma's four norms a layer: its ffn_norm is the norm before the MLP, as in Llama, but Hugging Face names that
# pre_feedforward_layernorm and gives post_attention_layernorm to the norm on the attention's output
_SANDWICH_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

# Phi-3's q/k/v in one attn_qkv, and its gate and up stacked in ffn_up (gate first: llama.cpp's fused SwiGLU
# activates the first half), passed on as they are
_FUSED_BLOCK_NAMES = {
    **{k: v for k, v in _BLOCK_NAMES.items() if k.split(".")[0] not in ("attn_q", "attn_k", "attn_v", "ffn_gate")},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}

# gpt-oss: Llama's names with the norm before the MLP as post_attention_norm, o's bias, the sinks, and biases on the
# router and the experts (gate and up stored apart, de-interleaved by the converter)
_GPT_OSS_BLOCK_NAMES = {
    **{k: v for k, v in _BLOCK_NAMES.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj.bias",
    "ffn_up_exps.bias": "mlp.experts.up_proj.bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj.bias",
}

_FILE_NAMES = {v: k for k, v in _GLOBAL_NAMES.items()}
# LongRoPE's frequency divisors (Phi-3), read into the config: the short factors and the long
LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def _block_names(arch: str) -> dict[str, str]:
    if arch == "gpt-oss":
        return _GPT_OSS_BLOCK_NAMES
    if arch in GEMMA_ARCHITECTURES:
        return _SANDWICH_BLOCK_NAMES
    return _FUSED_BLOCK_NAMES if SUPPORTED_ARCHITECTURES.get(arch, {}).get("fused_projections") else _BLOCK_NAMES

# llama.cpp's enum llama_pooling_type, as {arch}.pooling_type stores it: 0 none, 1 mean, 2 cls, 3 last, 4 rank
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
POOLING_RANK = 4


def canonical_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The canonical name (model/transformer.py's) of a decoder's GGUF tensor; None for one the model does not read."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    names = _block_names(arch)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"layers.{parts[1]}.{names[parts[2]]}"
    return None


def file_name(canonical: str, arch: str = "llama") -> str:
    """A decoder's GGUF tensor name for a canonical one (layers.0.self_attn.q_proj.weight -> blk.0.attn_q.weight):
    canonical_name's inverse."""
    if canonical in _FILE_NAMES:
        return _FILE_NAMES[canonical]
    _, layer, rest = canonical.split(".", 2)
    return f"blk.{layer}.{next(k for k, v in _block_names(arch).items() if v == rest)}"


def from_llama_cpp_layout(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which interleaves each head's rows for its GPT-J style RoPE."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFModel:
    """A GGUF file seen as a model (a ModelSource): its ModelConfig (EncoderConfig for BERT), tensor index,
    metadata, weights and the pooling it declares."""

    format = "gguf"

    def __init__(self, path: str | os.PathLike):
        self.file = GGUFFile.open(path)
        self.path = self.file.path
        self.metadata = self.file.metadata  # the tokenizer is built from it too (tokenizer.ggml.*)
        arch = self.file.require("general.architecture")
        self.config: ModelConfig | EncoderConfig
        if arch == bert.ARCHITECTURE:
            shapes = {t.name: t.shape for t in self.file.tensors.values()}
            self.config = bert.encoder_config_from_gguf(self.metadata, shapes, str(self.path), self.path.stat().st_size)
            self._canonical_name = bert.canonical_from_gguf
        else:
            self.config = self._config(arch)
            self._canonical_name = lambda name: canonical_name(name, arch)
        self.pooling = self._pooling(arch)

    def _pooling(self, arch: str) -> PoolingConfig | None:
        """{arch}.pooling_type, unit length: llama.cpp's server normalizes embeddings unless told not to."""
        key = f"{arch}.pooling_type"
        kind = ConfigReader(self.metadata, str(self.path)).integer(key, default=0, lo=0)
        if kind == 0:
            return None
        if kind == POOLING_RANK:
            raise UnsupportedModelError(
                f"{self.path}: {key} = {kind} (rank: a reranker's relevance score) is not supported (supported:"
                " 0 none, 1 mean, 2 cls, 3 last)")
        if kind not in POOLING_TYPES:
            raise ModelFileError(f"{self.path}: {key} = {kind} is not one of llama.cpp's pooling types (0 to 4)")
        return PoolingConfig(POOLING_TYPES[kind], normalize=True)

    def _config(self, arch: str) -> ModelConfig:
        f = self.file
        source = str(self.path)
        flags = check_architecture(arch, source)
        keys = {name: f"{arch}.{key}" for name, key in _CONFIG_KEYS.items()}
        r = ConfigReader(f.metadata, source)
        embed = f.tensors.get("token_embd.weight")
        if embed is None:
            raise ModelFileError(f"{self.path}: tensor 'token_embd.weight' is missing")
        size = self.path.stat().st_size
        heads = r.dimension(keys["num_heads"], size)
        hidden = r.dimension(keys["hidden_size"], size)
        head_dim = r.head_dim(keys, hidden, heads, size)
        context_length = r.integer(keys["context_length"], hi=MAX_CONTEXT_LENGTH)
        rope_scaling = self._longrope(arch, r, head_dim)
        scaling_type = f.get(keys["rope_scaling"])
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": r.number(arch + ".rope.scaling.factor")}
        elif scaling_type == "yarn":
            rope_scaling = self._yarn(arch, r)
        elif not isinstance(scaling_type, (str, type(None))):
            raise ModelFileError(f"{self.path}: {keys['rope_scaling']} = {scaling_type!r:.80} is not a string")
        elif scaling_type == "longrope" and rope_scaling is None:
            raise ModelFileError(f"{self.path}: {keys['rope_scaling']} is 'longrope' but tensor"
                                 f" {LONGROPE_TENSORS[1]!r} is missing")
        elif scaling_type not in (None, "none", "longrope"):
            raise UnsupportedModelError(
                f"{self.path}: {keys['rope_scaling']} {scaling_type!r} is not supported (supported: linear, longrope, yarn)"
            )
        num_layers = r.integer(keys["num_layers"], hi=MAX_LAYERS, why=" (llama.cpp's LLAMA_MAX_LAYERS)")
        if arch in GEMMA_ARCHITECTURES:
            flags = {**flags, **self._gemma_fields(arch, r, keys, num_layers, hidden, heads)}
        if arch == "gpt-oss":  # llama.cpp: windows on alternate layers (swa pattern 2), the clamped SwiGLU's constants
            window = r.integer(keys["sliding_window"], hi=MAX_CONTEXT_LENGTH)
            flags = {**flags, "layer_windows": windows_of_pattern(num_layers, window, SWA_PERIODS[arch])}
        if arch == "phi3":  # its converter writes 0 for no window
            window = r.integer(keys["sliding_window"], default=0, lo=0, hi=MAX_CONTEXT_LENGTH)
            flags = {**flags, "layer_windows": phi3_windows(num_layers, window, context_length)}
        intermediate = r.dimension(keys["intermediate_size"], size)
        flags = {**flags, **self._moe_fields(arch, r, keys, size, intermediate)}
        config = ModelConfig(
            architecture=arch,
            vocab_size=r.dimension(keys["vocab_size"], size, default=embed.shape[0]),  # Qwen files leave it out
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=r.dimension(keys["num_kv_heads"], size, default=heads),
            head_dim=head_dim,
            context_length=context_length,
            rms_norm_eps=r.number(keys["rms_norm_eps"]),
            rope_theta=r.number(keys["rope_theta"], 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in f.tensors,
            **flags,
            extra={"name": f.get("general.name"), "file_type": f.get("general.file_type")},
        )
        check_config(config, keys, source)
        self._check_expert_tensors(config, keys)
        rope_dim = r.integer(arch + ".rope.dimension_count", default=config.head_dim)
        if rope_dim != config.head_dim:  # llama.cpp's n_rot: RoPE over part of each head
            raise UnsupportedModelError(
                f"{self.path}: {arch}.rope.dimension_count = {rope_dim} differs from the head dimension {config.head_dim}"
                " (RoPE over part of a head is not supported)"
            )
        return config

    def _moe_fields(self, arch: str, r: ConfigReader, keys: dict[str, str], size: int,
                    intermediate: int) -> dict[str, Any]:
        """The experts as llama.cpp reads them: a model is MoE when the file gives {arch}.expert_count (its layer 0
        having ffn_gate_inp otherwise: the key is missing); the experts' FFN size is expert_feed_forward_length,
        else feed_forward_length (Mixtral, OLMoE) or, for Qwen's, feed_forward_length / expert_used_count."""
        if self.file.get(keys["num_experts"]) is None:
            if "blk.0.ffn_gate_inp.weight" in self.file.tensors:
                raise ModelFileError(f"{self.path}: metadata field {keys['num_experts']!r} is missing (the file has"
                                     " expert tensors)")
            return {}
        if arch not in _NORM_TOPK:
            raise UnsupportedModelError(f"{self.path}: {keys['num_experts']} is given, but mixture-of-experts"
                                        f" {arch} models are not supported (supported: {', '.join(_NORM_TOPK)})")
        count = r.dimension(keys["num_experts"], size)
        used = r.integer(keys["num_experts_per_tok"], hi=count, why=f" ({keys['num_experts']} = {count})")
        default = intermediate // used if arch in ("qwen2moe", "qwen3moe") else intermediate
        return {
            "num_experts": count,
            "num_experts_per_tok": used,
            "moe_intermediate_size": r.dimension(keys["moe_intermediate_size"], size, default=default),
            "norm_topk_prob": r.boolean(f"{arch}.expert_weights_norm", _NORM_TOPK[arch]),
            "shared_expert_intermediate_size": r.integer(keys["shared_expert_intermediate_size"], default=0, lo=0,
                                                         hi=size * 8) if arch == "qwen2moe" else 0,
        }

    def _check_expert_tensors(self, c: ModelConfig, keys: dict[str, str]) -> None:
        """Every stacked expert tensor holds expert_count experts (its first dimension), named with the key."""
        for i in range(c.num_layers if c.num_experts else 0):
            for kind in _EXPERT_TENSORS:
                t = self.file.tensors.get(f"blk.{i}.{kind}")
                if t is not None and t.shape[0] != c.num_experts:
                    raise ModelFileError(
                        f"{self.path}: tensor {t.name!r} holds {t.shape[0]} experts (shape {list(t.shape)}), but"
                        f" {keys['num_experts']} = {c.num_experts}"
                    )

    def _yarn(self, arch: str, r: ConfigReader) -> dict[str, Any]:
        """YaRN as llama.cpp reads it: the factor and original context, beta_fast / beta_slow (32 and 1 unless given),
        the ramp's ends rounded outwards (ggml_rope_yarn_corr_dims), cos and sin times 0.1 ln(factor) + 1 (ggml's
        rope_yarn) and times rope.scaling.attn_factor when the file has one."""
        factor = r.number(f"{arch}.rope.scaling.factor")
        return yarn_scaling(
            factor, r.integer(f"{arch}.rope.scaling.original_context_length", lo=2, hi=MAX_CONTEXT_LENGTH),
            r.number(f"{arch}.rope.scaling.yarn_beta_fast", 32.0), r.number(f"{arch}.rope.scaling.yarn_beta_slow", 1.0),
            True, yarn_attention_factor(factor) * r.number(f"{arch}.rope.scaling.attn_factor", 1.0))

    def _longrope(self, arch: str, r: ConfigReader, head_dim: int) -> dict[str, Any] | None:
        """LongRoPE (Phi-3) as llama.cpp reads it: both factor tensors, the original context and the attention
        factor (1 when the file has none); None for a file without the tensors."""
        present = [name for name in LONGROPE_TENSORS if name in self.file.tensors]
        if not present:
            return None
        if len(present) == 1:
            missing = next(name for name in LONGROPE_TENSORS if name not in present)
            raise ModelFileError(f"{self.path}: tensor {missing!r} is missing: LongRoPE needs it beside {present[0]!r}")
        factors = []
        for name in LONGROPE_TENSORS:
            t = self.file.tensors[name]
            if len(t.shape) != 1:
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {list(t.shape)}, expected one dimension")
            factors.append(dequantize(t.data, t.qtype, t.shape, name=name).tolist())
        original = r.integer(f"{arch}.rope.scaling.original_context_length", lo=2, hi=MAX_CONTEXT_LENGTH)
        return longrope_scaling(factors, LONGROPE_TENSORS, head_dim, original,
                                r.number(f"{arch}.rope.scaling.attn_factor", 1.0), str(self.path))

    def _gemma_fields(self, arch: str, r: ConfigReader, keys: dict[str, str], num_layers: int, hidden: int,
                      heads: int) -> dict[str, Any]:
        """Gemma's windows, soft-caps, query scale and local RoPE base, as llama.cpp reads them."""
        window = r.integer(keys["sliding_window"], hi=MAX_CONTEXT_LENGTH)
        pattern = self.file.get(keys["layer_windows"])
        if pattern is None:
            windows = windows_of_pattern(num_layers, window, SWA_PERIODS[arch])
        elif isinstance(pattern, list):  # newer converters: one bool per layer, true where it is windowed
            if not all(isinstance(p, bool) for p in pattern):
                raise ModelFileError(f"{self.path}: {keys['layer_windows']} is neither an integer nor booleans")
            windows = tuple(window if p else 0 for p in pattern)
        else:
            windows = windows_of_pattern(num_layers, window, r.integer(keys["layer_windows"], hi=num_layers))
        fields: dict[str, Any] = {"layer_windows": windows}
        if num_layers == _QUERY_SCALAR_BY_HIDDEN[arch]:
            fields["query_pre_attn_scalar"] = float(hidden // heads)
        if arch == "gemma2":
            fields["attn_logit_softcap"] = r.number(f"{arch}.attn_logit_softcapping", 50.0)
            fields["final_logit_softcap"] = r.number(f"{arch}.final_logit_softcapping", 30.0)
        else:
            fields["rope_local_theta"] = r.number(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)
            if self.file.get(f"{arch}.final_logit_softcapping") is not None:  # Gemma3Model writes one a config has
                fields["final_logit_softcap"] = r.number(f"{arch}.final_logit_softcapping")
        return fields

    @property
    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(t.name, t.shape, t.qtype.name, t.n_bytes) for t in self.file.tensors.values()]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> shape of every tensor the model understands."""
        out = {}
        for t in self.file.tensors.values():
            name = self._canonical_name(t.name)
            if name is not None:
                out[name] = t.shape
        return out

    def check_types(self) -> None:
        for t in self.file.tensors.values():
            if self._canonical_name(t.name) is not None and t.qtype not in SUPPORTED_TYPES:
                supported = ", ".join(q.name for q in sorted(SUPPORTED_TYPES))
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name!r} has type {t.qtype.name}, which churon cannot read (supported: {supported})"
                )

    def file_name(self, canonical: str) -> str:
        """The name this file uses (or would use) for a canonical tensor name."""
        if isinstance(self.config, EncoderConfig):
            return bert.gguf_name(canonical)
        return file_name(canonical, self.config.architecture)

    def load_weights(self) -> dict[str, GGUFTensor]:
        """Every known tensor as stored (quantized bytes), by canonical name, q/k rows in the Hugging Face layout.

        Un-permuting moves whole rows, so it works on quantized bytes as well as on floats.
        """
        c = self.config
        out = {}
        for t in self.file.tensors.values():
            name = self._canonical_name(t.name)
            if name is None:
                continue
            heads = None
            if c.architecture == "llama" and name.startswith("layers.") and ".q_proj." in name:
                heads = c.num_heads
            elif c.architecture == "llama" and name.startswith("layers.") and ".k_proj." in name:
                heads = c.num_kv_heads
            if heads is not None:
                order = from_llama_cpp_layout(torch.arange(t.shape[0]), heads).numpy()
                t = GGUFTensor(t.name, t.shape, t.qtype, t.data.reshape(t.shape[0], -1)[order].reshape(-1))
            out[name] = t
        return out
