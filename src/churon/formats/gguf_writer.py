"""Writing GGUF files that churon and llama.cpp both load.

The metadata comes from the source model: a GGUF source's fields are copied with their exact value
types (llama.cpp checks them); a Hugging Face source gets the fields llama.cpp's convert_hf_to_gguf.py
writes (TextModel.set_gguf_parameters and _set_vocab_gpt2; for a BERT, BertModel's and its WordPiece
vocabulary). Tensors are written in llama.cpp's layout (llama attn_q / attn_k rows interleaved for its
RoPE, see `to_llama_cpp_layout`) and streamed one at a time: the writer declares every tensor up
front, then takes their bytes in that order, so a whole model never has to be in memory at once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from churon.config import EncoderConfig, ModelConfig
from churon.errors import ModelFileError, UnsupportedModelError
from churon.formats import bert
from churon.formats.gguf import POOLING_TYPES, GGUFFile, GGUFModel
from churon.formats.hf import HFModel
from churon.formats.model_dir import read_json
from churon.formats.source import ModelSource

# general.file_type llama.cpp writes for a model mostly of one type (the K types as llama-quantize's
# _M mixes, which keep output and some attn_v / ffn_down tensors at Q6_K, as churon's default does)
FILE_TYPES: dict[GGMLQuantizationType, LlamaFileType] = {
    GGMLQuantizationType.F32: LlamaFileType.ALL_F32,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    GGMLQuantizationType.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    GGMLQuantizationType.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    GGMLQuantizationType.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
    GGMLQuantizationType.Q6_K: LlamaFileType.MOSTLY_Q6_K,
}

_GGUF_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
_GGUF_POOLING = {mode: kind for kind, mode in POOLING_TYPES.items()}  # PoolingConfig.mode -> {arch}.pooling_type

# Fields the writer sets itself rather than copying from a GGUF source.
_OWN_FIELDS = ("general.architecture", "general.file_type", "general.quantization_version")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the output file: GGUF name, shape (torch order, rows first) and type."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


def gguf_tensor_name(source: ModelSource, canonical: str) -> str:
    """The GGUF name (blk.0.attn_q.weight) of a canonical churon tensor name (layers.0.self_attn.q_proj.weight)."""
    c = source.config
    if isinstance(c, EncoderConfig):
        return bert.gguf_name(canonical)
    if c.architecture not in _GGUF_ARCHS:
        raise UnsupportedModelError(f"{source.path}: churon cannot write a {c.architecture} directory as GGUF (it writes"
                                    f" {', '.join(_GGUF_ARCHS)} and bert; a {c.architecture} GGUF it can requantize)")
    names = gguf.get_tensor_name_map(_GGUF_ARCHS[c.architecture], c.num_layers)
    hf_name = canonical if canonical == "lm_head.weight" else "model." + canonical
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UnsupportedModelError(f"{source.path}: no GGUF name for tensor {hf_name!r}")
    return name


def permuted_heads(source: ModelSource, gguf_name: str) -> int | None:
    """For llama attn_q / attn_k (weights and biases): the head count their rows are grouped by; else None."""
    c = source.config
    if c.architecture != "llama":
        return None
    kind = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else ""
    return {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}.get(kind)


def to_llama_cpp_layout(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face rows (rotate-half RoPE) -> llama.cpp's interleaved rows (convert_hf_to_gguf's permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama3_rope_freqs(config: ModelConfig) -> torch.Tensor | None:
    """rope_freqs.weight for a Llama 3 rope scaling (None for others): the divisor of each inverse frequency,
    computed as convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors does, in float32."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    dim = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old_context / high, 1.0, torch.where(wavelen > old_context / low, factor, smoothed))


class GGUFModelWriter:
    """Declare every tensor, then `write` their raw bytes, in any order (each goes to its place in the
    file); `close` checks all came.

    with GGUFModelWriter(out, source, specs, FILE_TYPES[qtype]) as w:
        for spec in specs:
            w.write(spec.name, raw_bytes)
    """

    def __init__(self, path: str | os.PathLike, source: ModelSource, tensors: list[TensorSpec],
                 file_type: LlamaFileType):
        self.path = Path(path)
        arch = source.config.architecture
        if self.path.is_dir():
            raise ModelFileError(f"{self.path}: is a directory; give the output .gguf file name")
        if not self.path.parent.is_dir():
            raise ModelFileError(f"{self.path.parent}: no such directory for the output file")
        self._writer = gguf.GGUFWriter(self.path, arch)
        w = self._writer
        if isinstance(source, GGUFModel):
            _copy_metadata(w, source.file)
        else:
            _hf_metadata(w, source)
        w.add_file_type(int(file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        (self._file,) = w.fout
        # tensor data starts aligned after the tensor infos; each tensor's size is padded to the
        # alignment (the offsets write_ti_data_to_file recorded)
        align = w.data_alignment
        offset = w.ggml_pad(self._file.tell(), align)
        self._pending: dict[str, tuple[TensorSpec, int]] = {}
        for t in tensors:
            self._pending[t.name] = (t, offset)
            offset += w.ggml_pad(t.n_bytes, align)
        self._end = offset

    def write(self, name: str, raw: np.ndarray) -> None:
        if name not in self._pending:
            raise ValueError(f"{self.path}: tensor {name!r} was not declared, or was written already")
        spec, offset = self._pending[name]
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if raw.nbytes != spec.n_bytes:
            raise ValueError(f"{self.path}: tensor {name!r} ({spec.qtype.name} {list(spec.shape)}) needs"
                             f" {spec.n_bytes} bytes, got {raw.nbytes}")
        self._file.seek(offset)
        raw.tofile(self._file)
        del self._pending[name]

    def close(self) -> None:
        if not self._pending:
            self._file.truncate(self._end)  # the last tensor's padding (zeros)
        self._writer.close()
        if self._pending:
            raise ValueError(f"{self.path}: incomplete file, tensors not written: {list(self._pending)[:5]}")

    def __enter__(self) -> "GGUFModelWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # leave no half-written file that looks like a model
            self._writer.close()
            self.path.unlink(missing_ok=True)


def _copy_metadata(w: gguf.GGUFWriter, source: GGUFFile) -> None:
    """Every metadata field of a GGUF file, with its value type (llama.cpp rejects a u32 stored as i32)."""
    for key, value in source.metadata.items():
        if key in _OWN_FIELDS:
            continue
        vtype, sub_type = source.value_types[key]
        w.add_key_value(key, value, vtype, sub_type)


def _hf_metadata(w: gguf.GGUFWriter, source: HFModel) -> None:
    """The fields convert_hf_to_gguf.py writes for Llama / Qwen2 / Qwen3 with a BPE tokenizer.json."""
    c = source.config
    if isinstance(c, EncoderConfig):
        _hf_encoder_metadata(w, source)
        return
    _text_model_metadata(w, source)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if "head_dim" in read_json(source.path / "config.json") or c.head_dim != c.hidden_size // c.num_heads:
        w.add_key_length(c.head_dim)  # the converter writes it when the config names it
        w.add_value_length(c.head_dim)
    scaling = c.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind not in (None, "default", "llama3"):  # llama3 travels as the rope_freqs tensor
        raise UnsupportedModelError(f"{source.path}: rope scaling {kind!r} cannot be written to GGUF by churon")
    if c.architecture == "llama":
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(c.head_dim)
    _hf_vocab(w, source)


def _text_model_metadata(w: gguf.GGUFWriter, source: HFModel) -> None:
    """What convert_hf_to_gguf.py's TextModel.set_gguf_parameters writes for every architecture, decoder or encoder."""
    c = source.config
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(source.path.name)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)


def _hf_encoder_metadata(w: gguf.GGUFWriter, source: HFModel) -> None:
    """The fields convert_hf_to_gguf.py's BertModel writes: TextModel.set_gguf_parameters' (there is no
    head_count_kv in a BERT config), attention.causal false, the pooling type of a sentence-transformers
    directory (_try_set_pooling_type; a GGUF has no field for Normalize: llama.cpp's server normalizes
    by default, and churon reads every GGUF pooling as normalized), and set_vocab's."""
    c = source.config
    _text_model_metadata(w, source)
    w.add_layer_norm_eps(c.layer_norm_eps)
    w.add_causal_attention(False)
    if source.pooling is not None:
        w.add_pooling_type(gguf.PoolingType(_GGUF_POOLING[source.pooling.mode]))
    _hf_wordpiece_vocab(w, source)


def _hf_vocab(w: gguf.GGUFWriter, source: HFModel) -> None:
    """convert_hf_to_gguf's _set_vocab_gpt2: every id's token and type, merges, special ids, chat template.

    tokenizer.ggml.pre is "gpt-2": llama.cpp picks a model's pre-tokenizer by hashing transformers'
    output on a probe text, which churon (without transformers) cannot reproduce."""
    tokens, types = _vocab(source, "BPE")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(source.path, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _hf_wordpiece_vocab(w: gguf.GGUFWriter, source: HFModel) -> None:
    """BertModel.set_vocab: the token-type count, every id's token in llama.cpp's "phantom space" form (a
    piece that starts a word gets a leading U+2581, a "##" continuation loses its "##", control tokens stay
    as they are), its type, and the special ids and add_bos / add_eos flags gguf.SpecialVocab reads from the
    tokenizer files ([CLS] as bos, [SEP] as eos and separator: what llama.cpp's WordPiece tokenizer puts
    around a text). tokenizer.ggml.pre is "default": llama.cpp's WordPiece has no pre-tokenizer choice."""
    tokens, types = _vocab(source, "WordPiece")

    def phantom(token: str, kind: int) -> str:
        if kind == gguf.TokenType.CONTROL:
            return token
        return token[2:] if token.startswith("##") else "\u2581" + token

    w.add_token_type_count(source.config.type_vocab_size)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list([phantom(t, k) for t, k in zip(tokens, types)])
    w.add_token_types(types)
    # SpecialVocab's default kinds less "cls": GGUF dropped tokenizer.ggml.cls_token_id ([CLS] is the bos
    # id), and gguf-py warns for a kind it has no key for
    kinds = ("bos", "eos", "unk", "sep", "pad", "mask")
    gguf.SpecialVocab(source.path, special_token_types=kinds, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _vocab(source: HFModel, model_type: str) -> tuple[list[str], list[int]]:
    """Every id's token and type as convert_hf_to_gguf's get_vocab_base gives them, from tokenizer.json
    (whose model must be model_type): ids the tokenizer lacks up to the config's vocab_size are [PAD<id>]
    UNUSED, added tokens CONTROL when special (or <|...|>), else USER_DEFINED."""
    from tokenizers import Tokenizer as HFTokenizer

    path = source.path / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{source.path}: no tokenizer.json (churon converts tokenizer.json vocabularies only)")
    tok = HFTokenizer.from_file(str(path))
    found = type(tok.model).__name__
    if found != model_type:
        raise UnsupportedModelError(
            f"{path}: tokenizer model {found} cannot be written to GGUF for {source.config.architecture}"
            f" (only {model_type})")
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(source.config.vocab_size, max(vocab.values()) + 1)
    by_id = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            text = by_id[i]
            special = added[i].special or (text.startswith("<|") and text.endswith("|>"))
            tokens.append(text)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types
