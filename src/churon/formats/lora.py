"""LoRA adapters: PEFT directories and llama.cpp's GGUF adapters read into one LoraAdapter, and a LoraAdapter
written as a GGUF adapter llama.cpp loads.

A PEFT directory is adapter_config.json (r, lora_alpha, use_rslora, target_modules, rank_pattern,
alpha_pattern) beside adapter_model.safetensors, whose keys are
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` (A [r, in]) and `...lora_B.weight`
(B [out, r]), some savers with the adapter's name in between (`lora_A.default.weight`). Each module's
scaling is PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA, r and alpha per module from rank_pattern /
alpha_pattern (peft.utils.other.get_pattern_key's matching).

A GGUF adapter (llama.cpp's convert_lora_to_gguf.py, read by src/llama-adapter.cpp) has general.type
"adapter", adapter.type "lora", adapter.lora.alpha and a pair NAME.lora_a [r, in] / NAME.lora_b [out, r]
per base tensor NAME (blk.0.attn_q.weight). Its scaling is llama.cpp's: alpha / r, with r lora_b's inner
dimension, and 1 when alpha is 0. For llama, lora_b of attn_q / attn_k holds its rows in llama.cpp's
interleaved order, as the model's weights do; they are put back in Hugging Face's order with the model's
config (read_lora(path, config)).

Both files are read bounded: the safetensors header is validated by the safetensors library before any
tensor is touched (its offsets inside the file, its shapes matching them), a GGUF by formats/gguf.py, and
with a config every shape and rank is checked before a tensor is read. Every problem is a ModelFileError
naming the file and the tensor or field.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from churon.config import ConfigReader, ModelConfig
from churon.errors import ModelFileError
from churon.formats.gguf import GGUFFile, canonical_name, file_name, from_llama_cpp_layout
from churon.formats.gguf_writer import FILE_TYPES, to_llama_cpp_layout
from churon.formats.hf import FLOAT_DTYPES, architecture_of
from churon.formats.model_dir import read_json_object
from churon.formats.quants import dequantize

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"

# target module kind -> its place in a decoder layer (the canonical name after "layers.N."); every family
# churon runs names them alike
TARGET_MODULES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
# the modules whose rows llama.cpp's converter interleaves for its RoPE on a llama (LlamaModel.permute)
_ROPE_ROWS = ("q_proj", "k_proj")
_MODULE = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)")
# an MoE layer's router, routed experts (one per module or stacked) and shared expert, Hugging Face's names and the
# canonical names of GGUF's ffn_*_exps / ffn_gate_inp / *_shexp
_MOE_MODULE = re.compile(r"layers\.\d+\.(mlp|block_sparse_moe)\.(experts|shared_expert|shared_expert_gate|gate)(\..*)?")
_SUPPORTED = ", ".join(TARGET_MODULES)
_MOE_SUPPORTED = "on an MoE model: the attention's q_proj, k_proj, v_proj and o_proj, and the MLP of its dense layers"

# the types a GGUF adapter's tensors are read from (what convert_lora_to_gguf.py writes)
GGUF_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
              GGMLQuantizationType.Q8_0)
GGUF_PARTS = ("lora_a", "lora_b")  # NAME.lora_a, NAME.lora_b
WRITE_TYPES = {"F32": GGMLQuantizationType.F32, "F16": GGMLQuantizationType.F16}

# target_modules' shorthand for every linear layer but the output head (PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND)
_ALL_LINEAR = "all-linear"
# init_lora_weights methods that change the base weights as they initialize A and B (PiSSA, CorDA and OLoRA
# subtract the initial B @ A; LoftQ and LoRA-GA replace the weights): their adapters hold only half the
# fine-tune until PEFT converts them to a plain LoRA
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
# adapter_config.json fields whose set value makes the adapter more than y += s * B @ A x on the target
# modules, and why churon refuses it; unset is null, false, empty or "none" (PEFT's defaults)
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (a learned magnitude per output feature)",
    "lora_bias": "a bias on lora_B",
    "bias": "trained biases of the base model",
    "modules_to_save": "whole modules saved beside the adapter",
    "fan_in_fan_out": "transposed (Conv1D, GPT-2 style) weights",
    "target_parameters": "LoRA on parameters rather than modules",
    "trainable_token_indices": "trained token embeddings",
    "alora_invocation_tokens": "aLoRA (an adapter activated after an invocation sequence)",
    "layer_replication": "replicated layers",
    "use_qalora": "QA-LoRA (pooled inputs)",
    "use_bdlora": "BD-LoRA (block-diagonal factors)",
    "kasa_config": "KaSA (truncated base weights and learned singular values)",
    "monteclora_config": "MonteCLoRA (sampled adapters)",
    "arrow_config": "Arrow routing between adapters",
}
# auto_mapping's parent_library (transformers.models.llama.modeling_llama) names the base model's type
_PARENT_LIBRARY = re.compile(r"transformers\.models\.([a-z0-9_]+)\.modeling_\1")
# a PEFT key: the module, lora_A or lora_B, the adapter's name (some savers), weight or bias
_PEFT_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<name>[^.]+))?\.(?P<leaf>weight|bias)")
_PEFT_PREFIX = "base_model.model."
# a target_modules / rank_pattern / alpha_pattern regular expression from the file: its length, and how many
# repetitions it may hold (PEFT's own wrapping of a pattern key adds one, `(.*\.)?`)
MAX_PATTERN_CHARS = 1000
MAX_PATTERN_REPEATS = 6


@dataclass(frozen=True)
class LoraModule:
    """One target module's low-rank pair: y += scale * B @ (A @ x)."""

    a: torch.Tensor  # float32 [r, in_features]
    b: torch.Tensor  # float32 [out_features, r], Hugging Face's row order (see LoraAdapter.llama_cpp_rows)
    scale: float  # PEFT's scaling (alpha / r or alpha / sqrt(r)); GGUF: adapter.lora.alpha / r (llama.cpp)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraAdapter:
    path: Path
    kind: str  # "peft" or "gguf"
    modules: dict[str, LoraModule]  # canonical module names: "layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"
    alpha: float
    use_rslora: bool
    base_model: str | None  # adapter_config's base_model_name_or_path; GGUF general.base_model.0.name or general.basename
    architecture: str | None  # GGUF general.architecture; PEFT: the model type auto_mapping names, if any
    # module -> the file's names of its A and B, for messages
    tensor_names: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False)
    # a llama GGUF adapter read without a config: lora_b of attn_q / attn_k still in llama.cpp's row order
    llama_cpp_rows: bool = False

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted({_kind(name) for name in self.modules}))

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())

    def names(self, module: str) -> tuple[str, str]:
        """The file's tensor names of a module's A and B."""
        if module in self.tensor_names:
            return self.tensor_names[module]
        if self.kind == "gguf":
            base = _gguf_name(module)
            return f"{base}.lora_a", f"{base}.lora_b"
        return f"{_PEFT_PREFIX}model.{module}.lora_A.weight", f"{_PEFT_PREFIX}model.{module}.lora_B.weight"

    def check(self, config: ModelConfig, max_rank: int | None = None) -> None:
        """Every module fits the model of `config` (its layer, its matrix's shape, the architecture) with a
        rank of at most max_rank: else a ModelFileError naming the tensor and both values."""
        _check_architecture(self.path, self.architecture, config)
        if self.llama_cpp_rows and config.architecture == "llama":
            raise ModelFileError(
                f"{self.path}: read without a model config, its attn_q / attn_k lora_b rows are still in llama.cpp's"
                " order; read it with read_lora(path, config)")
        for module, m in self.modules.items():
            _check_module(self.path, module, tuple(m.a.shape), tuple(m.b.shape), self.names(module), config, max_rank)


def is_lora_adapter(path: str | os.PathLike) -> bool:
    """A directory with adapter_config.json, or a GGUF file whose general.type is "adapter"."""
    path = Path(path)
    if path.is_dir():
        return (path / ADAPTER_CONFIG).is_file()
    try:
        return GGUFFile.open(path).get("general.type") == gguf.GGUFType.ADAPTER
    except ModelFileError:
        return False


def read_lora(path: str | os.PathLike, config: ModelConfig | None = None, max_rank: int | None = None) -> LoraAdapter:
    """A PEFT directory (adapter_config.json + adapter_model.safetensors) or a GGUF adapter file. With a config
    every tensor is checked against that model before it is read (LoraAdapter.check), and a llama GGUF
    adapter's attn_q / attn_k rows are put in Hugging Face's order."""
    path = Path(path)
    if path.is_dir():
        return _read_peft(path, config, max_rank)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or directory")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a regular file (a LoRA adapter is a directory or a .gguf file)")
    return _read_gguf(path, config, max_rank)


# --- checks shared by both formats


def _kind(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _layer(module: str) -> int:
    return int(module.split(".", 2)[1])


def _gguf_name(module: str) -> str:
    return file_name(f"{module}.weight")


def _matrix_shape(config: ModelConfig, kind: str) -> tuple[tuple[int, str], tuple[int, str]]:
    """(in_features, what it is), (out_features, what it is) of a target module's weight."""
    c = config
    hidden = (c.hidden_size, "hidden_size")
    q = (c.num_heads * c.head_dim, "num_heads * head_dim")
    kv = (c.num_kv_heads * c.head_dim, "num_kv_heads * head_dim")
    ffn = (c.intermediate_size, "intermediate_size")
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden),
    }[kind]


def _check_architecture(path: Path, architecture: str | None, config: ModelConfig) -> None:
    if architecture is not None and architecture != config.architecture:
        raise ModelFileError(
            f"{path}: the adapter is for architecture {architecture!r}, the model is {config.architecture!r}")


def _check_module(path: Path, module: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
                  names: tuple[str, str], config: ModelConfig | None, max_rank: int | None) -> None:
    """One module's A [r, in] and B [out, r] shapes, against each other, max_rank and the model's matrix."""
    a_name, b_name = names
    for name, shape in ((a_name, a_shape), (b_name, b_shape)):
        if len(shape) != 2 or min(shape) < 1:
            raise ModelFileError(f"{path}: tensor {name!r} has shape {list(shape)}, not a matrix")
    rank = a_shape[0]
    if b_shape[1] != rank:
        raise ModelFileError(
            f"{path}: tensor {b_name!r} has shape {list(b_shape)} ({b_shape[1]} columns), but {a_name!r} has"
            f" {list(a_shape)} (rank {rank}): B's columns must equal A's rows")
    if max_rank is not None and rank > max_rank:
        raise ModelFileError(f"{path}: tensor {a_name!r} has rank {rank}, more than the maximum rank {max_rank}")
    if config is None:
        return
    layer = _layer(module)
    if layer >= config.num_layers:
        raise ModelFileError(
            f"{path}: tensor {a_name!r} is for layer {layer}, but the model has {config.num_layers} layers")
    if module.startswith(f"layers.{layer}.mlp.") and config.moe_layer(layer):  # its MLP matrices are the experts'
        raise ModelFileError(
            f"{path}: tensor {a_name!r} adapts {module}, but layer {layer}'s MLP is {config.num_experts} routed"
            f" experts, which churon does not apply LoRA to ({_MOE_SUPPORTED})")
    (n_in, what_in), (n_out, what_out) = _matrix_shape(config, _kind(module))
    if a_shape[1] != n_in:
        raise ModelFileError(
            f"{path}: tensor {a_name!r} has shape {list(a_shape)} ({a_shape[1]} input features), but the model's"
            f" {module} takes {n_in} ({what_in})")
    if b_shape[0] != n_out:
        raise ModelFileError(
            f"{path}: tensor {b_name!r} has shape {list(b_shape)} ({b_shape[0]} output features), but the model's"
            f" {module} gives {n_out} ({what_out})")


def _target(path: Path, module: str, tensor: str, adapted: str) -> str:
    """The canonical module name (layers.N.self_attn.q_proj) of a module path without its model prefix;
    adapted: what the file names it (for the message)."""
    if _MOE_MODULE.fullmatch(module):
        raise ModelFileError(
            f"{path}: tensor {tensor!r} adapts {adapted!r}, a mixture-of-experts layer's router or experts, which churon"
            f" does not apply LoRA to ({_MOE_SUPPORTED})")
    m = _MODULE.fullmatch(module)
    if m is None or m.group(3) not in TARGET_MODULES or TARGET_MODULES[m.group(3)] != f"{m.group(2)}.{m.group(3)}":
        raise ModelFileError(
            f"{path}: tensor {tensor!r} adapts {adapted!r}, which churon does not apply LoRA to"
            f" (supported: the {_SUPPORTED} of each decoder layer)")
    return f"layers.{int(m.group(1))}.{m.group(2)}.{m.group(3)}"


def _number(value: Any, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ModelFileError(f"{source}: {key} = {value!r:.80} is not a finite number")
    return float(value)


def _peft_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """LoraLayer.update_layer's scaling."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _gguf_scale(alpha: float, rank: int) -> float:
    """llama_adapter_lora_weight::get_scale: alpha 0 means no scaling."""
    return alpha / rank if alpha else 1.0


@dataclass
class _Pair:
    """One module's A and B as a file indexes them, before their data is read."""

    names: list[str | None]  # [A, B]
    shapes: list[tuple[int, ...]]
    read: list[Callable[[], torch.Tensor] | None]


def _pairs_complete(path: Path, pairs: dict[str, _Pair], parts: tuple[str, str]) -> None:
    """Every module has both its A and its B; parts: what the file calls them."""
    if not pairs:
        raise ModelFileError(f"{path}: no LoRA tensors")
    for module, p in pairs.items():
        for i, part in enumerate(parts):
            if p.names[i] is None:
                raise ModelFileError(f"{path}: tensor {p.names[1 - i]!r} has no {part} beside it (module {module})")


# --- PEFT


@dataclass
class _PeftSettings:
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: list[tuple[re.Pattern, int]]
    alpha_pattern: list[tuple[re.Pattern, float]]
    target_modules: list[str] | re.Pattern | None
    base_model: str | None
    architecture: str | None


def _peft_settings(cfg: dict[str, Any], source: str) -> _PeftSettings:
    """adapter_config.json's fields, checked: a plain LoRA of the target modules churon has."""
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise ModelFileError(f"{source}: peft_type = {peft_type!r:.80}: churon loads LoRA adapters (peft_type LORA)")
    for key, what in _UNSUPPORTED_FIELDS.items():
        value = cfg.get(key)
        if value not in (None, False, "none", [], {}):
            raise ModelFileError(f"{source}: {key} = {value!r:.80}: {what} is not supported (plain LoRA only)")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ModelFileError(
            f"{source}: init_lora_weights = {init!r:.80} changed the base model's weights as it initialized the"
            " adapter; convert it to a plain LoRA first (PEFT's save_pretrained with"
            " path_initial_model_for_weight_conversion)")
    r = ConfigReader(cfg, source)
    settings = _PeftSettings(
        r=r.integer("r"),
        alpha=_number(cfg.get("lora_alpha"), "lora_alpha", source),
        use_rslora=r.boolean("use_rslora", False),
        rank_pattern=_pattern(cfg, "rank_pattern", source, lambda v, k: ConfigReader({k: v}, source).integer(k)),
        alpha_pattern=_pattern(cfg, "alpha_pattern", source, lambda v, k: _number(v, k, source)),
        target_modules=_target_modules(cfg.get("target_modules"), source),
        base_model=cfg.get("base_model_name_or_path"),
        architecture=None,
    )
    if not isinstance(settings.base_model, (str, type(None))):
        raise ModelFileError(f"{source}: base_model_name_or_path = {settings.base_model!r:.80} is not a string")
    mapping = cfg.get("auto_mapping")
    if isinstance(mapping, dict) and isinstance(mapping.get("parent_library"), str):
        m = _PARENT_LIBRARY.fullmatch(mapping["parent_library"])
        # the model's architecture as churon names it (qwen3_moe is qwen3moe), to compare with the model's
        settings.architecture = architecture_of(m.group(1)) if m else None
    return settings


def _regex(pattern: str, key: str, source: str) -> re.Pattern:
    """A pattern from the file, compiled; refused when it could backtrack for ever: Python's re has no time
    limit, and a repetition of a repetition or of alternatives ((a+)+, (a|aa)*) takes time exponential in the
    module name's length. PEFT's patterns are names and simple wildcards (.*\\.q_proj), which pass."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ModelFileError(f"{source}: {key}: a pattern of {len(pattern)} characters (at most {MAX_PATTERN_CHARS})")
    try:
        parsed = re._parser.parse(pattern)
        compiled = re.compile(pattern)
    except re.error as e:
        raise ModelFileError(f"{source}: {key}: {pattern!r:.80} is not a regular expression ({e})") from None
    if _nested_repeat(parsed, inside_repeat=False):
        raise ModelFileError(
            f"{source}: {key}: {pattern!r:.80} repeats a repetition or alternatives, which can take exponential"
            " time to match; write it without the nesting")
    if _repeats(parsed) > MAX_PATTERN_REPEATS:  # k of them in a row backtrack as name length ** k
        raise ModelFileError(
            f"{source}: {key}: {pattern!r:.80} has more than {MAX_PATTERN_REPEATS} repetitions (*, +, {{m,n}})")
    return compiled


def _repeats(items) -> int:
    """The repetitions (of more than one) in a parsed pattern, nested ones included."""
    n = 0
    for op, arg in items:
        if op in (re._constants.MAX_REPEAT, re._constants.MIN_REPEAT, re._constants.POSSESSIVE_REPEAT):
            n += (arg[1] > 1) + _repeats(arg[2])
        elif op is re._constants.BRANCH:
            n += sum(_repeats(b) for b in arg[1])
        elif op in (re._constants.SUBPATTERN, re._constants.ATOMIC_GROUP, re._constants.ASSERT,
                    re._constants.ASSERT_NOT):
            n += _repeats(arg[-1])
    return n


def _nested_repeat(items, inside_repeat: bool) -> bool:
    """Whether a parsed pattern (re._parser's tree) has a repetition or alternatives inside a repetition."""
    for op, arg in items:
        if op in (re._constants.MAX_REPEAT, re._constants.MIN_REPEAT, re._constants.POSSESSIVE_REPEAT):
            if inside_repeat or _nested_repeat(arg[2], inside_repeat=arg[1] > 1):
                return True
        elif op is re._constants.BRANCH:
            if inside_repeat or any(_nested_repeat(b, inside_repeat) for b in arg[1]):
                return True
        elif op in (re._constants.SUBPATTERN, re._constants.ATOMIC_GROUP, re._constants.ASSERT,
                    re._constants.ASSERT_NOT):
            if _nested_repeat(arg[-1], inside_repeat):
                return True
    return False


def _pattern(cfg: dict[str, Any], key: str, source: str, value: Callable[[Any, str], Any]) -> list[tuple[re.Pattern, Any]]:
    """rank_pattern / alpha_pattern in their order, each pattern as peft.utils.other.get_pattern_key matches it:
    the end of a module's path, over whole dot-separated parts."""
    patterns = cfg.get(key) or {}
    if not isinstance(patterns, dict):
        raise ModelFileError(f"{source}: {key} = {patterns!r:.80} is not an object")
    return [(_regex(rf"(.*\.)?({k})$", key, source), value(v, f"{key}[{k!r}]")) for k, v in patterns.items()]


def _target_modules(targets: Any, source: str) -> list[str] | re.Pattern | None:
    """A list of module names (each matched as the end of a module's path) or one regular expression over the
    whole path ("all-linear": every target churon has)."""
    if targets is None or targets == _ALL_LINEAR:
        return None
    if isinstance(targets, str):
        return _regex(targets, "target_modules", source)
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ModelFileError(f"{source}: target_modules = {targets!r:.80} is neither a list of names nor a string")
    for t in targets:
        if t.rsplit(".", 1)[-1] not in TARGET_MODULES:
            raise ModelFileError(
                f"{source}: target_modules names {t!r}, which churon does not apply LoRA to (supported: {_SUPPORTED})")
    return targets


def _is_target(targets: list[str] | re.Pattern | None, key: str) -> bool:
    """peft's check_target_module_exists: a regular expression matches the whole module path, a name its end."""
    if targets is None:
        return True
    if isinstance(targets, re.Pattern):
        return targets.fullmatch(key) is not None
    return key in targets or any(key.endswith("." + t) for t in targets)


def _pattern_value(patterns: list[tuple[re.Pattern, Any]], key: str, default: Any) -> Any:
    """peft.utils.other.get_pattern_key: the value of the first pattern that matches."""
    for pattern, value in patterns:
        if pattern.match(key):
            return value
    return default


def _open_safetensors(path: Path):
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises SafetensorError for bad headers and offsets beyond the file
        raise ModelFileError(f"{path}: not a readable safetensors file: {e}") from e


def _read_peft(path: Path, config: ModelConfig | None, max_rank: int | None) -> LoraAdapter:
    config_path = path / ADAPTER_CONFIG
    if not config_path.is_file():
        raise ModelFileError(f"{path}: not a LoRA adapter: no {ADAPTER_CONFIG}")
    settings = _peft_settings(read_json_object(config_path), str(config_path))
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (path / ADAPTER_PICKLE).exists():
            raise ModelFileError(
                f"{path / ADAPTER_PICKLE}: a pickle, which churon does not load (unpickling can run code); re-save"
                " the adapter as safetensors (PEFT's save_pretrained writes adapter_model.safetensors)")
        raise ModelFileError(f"{weights}: no such file")
    if config is not None:
        _check_architecture(config_path, settings.architecture, config)
    with _open_safetensors(weights) as f:
        pairs = _peft_pairs(weights, f, settings)
        _pairs_complete(weights, pairs, ("lora_A", "lora_B"))
        modules: dict[str, LoraModule] = {}
        for module, p in pairs.items():
            key = "model." + module  # the module's path in the transformers model, as PEFT matches it
            rank = _pattern_value(settings.rank_pattern, key, settings.r)
            if p.shapes[0][:1] != (rank,):
                raise ModelFileError(
                    f"{weights}: tensor {p.names[0]!r} has shape {list(p.shapes[0])}, but {ADAPTER_CONFIG} gives"
                    f" {module} rank {rank} (r or rank_pattern)")
            _check_module(weights, module, p.shapes[0], p.shapes[1], tuple(p.names), config, max_rank)
        for module, p in pairs.items():
            a, b = (read() for read in p.read)
            alpha = _pattern_value(settings.alpha_pattern, "model." + module, settings.alpha)
            modules[module] = LoraModule(a, b, _peft_scale(alpha, a.shape[0], settings.use_rslora))
    return LoraAdapter(path, "peft", modules, settings.alpha, settings.use_rslora, settings.base_model,
                       settings.architecture, {m: tuple(p.names) for m, p in pairs.items()})


def _peft_pairs(weights: Path, f, settings: _PeftSettings) -> dict[str, _Pair]:
    pairs: dict[str, _Pair] = {}
    adapter_names = set()
    for name in f.keys():
        if "lora_magnitude_vector" in name:
            raise ModelFileError(f"{weights}: tensor {name!r} is DoRA's magnitude, which is not supported")
        if "lora_embedding_" in name:
            raise ModelFileError(
                f"{weights}: tensor {name!r} adapts an embedding, which churon does not apply LoRA to"
                f" (supported: {_SUPPORTED})")
        m = _PEFT_KEY.fullmatch(name)
        if m is None:
            raise ModelFileError(f"{weights}: tensor {name!r} is not a LoRA tensor (lora_A or lora_B of a module)")
        if m["leaf"] == "bias":
            raise ModelFileError(f"{weights}: tensor {name!r} is a bias on lora_B, which is not supported")
        adapter_names.add(m["name"])
        if len(adapter_names) > 1:
            raise ModelFileError(
                f"{weights}: tensors of more than one adapter ({', '.join(sorted(map(str, adapter_names)))});"
                " save each adapter on its own")
        key = m["module"].removeprefix(_PEFT_PREFIX)
        module = _target(weights, key.removeprefix("model."), name, key)
        if not _is_target(settings.target_modules, key):
            raise ModelFileError(
                f"{weights}: tensor {name!r} adapts {key!r}, which target_modules in {ADAPTER_CONFIG} does not name")
        sl = f.get_slice(name)
        if sl.get_dtype() not in FLOAT_DTYPES:
            raise ModelFileError(
                f"{weights}: tensor {name!r} has type {sl.get_dtype()}, not a float type"
                f" ({', '.join(FLOAT_DTYPES)})")
        p = pairs.setdefault(module, _Pair([None, None], [(), ()], [None, None]))
        i = "AB".index(m["ab"])
        if p.names[i] is not None:
            raise ModelFileError(f"{weights}: tensors {p.names[i]!r} and {name!r} are the same lora_{m['ab']}")
        p.names[i], p.shapes[i] = name, tuple(sl.get_shape())
        p.read[i] = lambda name=name: _safetensors_tensor(weights, f, name)
    return pairs


def _safetensors_tensor(weights: Path, f, name: str) -> torch.Tensor:
    try:
        t = f.get_tensor(name).float()
    except Exception as e:  # safetensors raises SafetensorError for data it cannot read
        raise ModelFileError(f"{weights}: cannot read tensor {name!r}: {e}") from e
    return _finite(t, weights, name)


def _finite(t: torch.Tensor, path: Path, name: str) -> torch.Tensor:
    """t, refused when it holds a NaN or an infinity (a fine-tune that diverged, or F64 beyond float32): served,
    it would make every request naming the adapter fail on NaN logits, far from the file at fault."""
    if not bool(torch.isfinite(t).all()):
        raise ModelFileError(f"{path}: tensor {name!r} holds NaN or infinite values (in float32)")
    return t


# --- GGUF


def _read_gguf(path: Path, config: ModelConfig | None, max_rank: int | None) -> LoraAdapter:
    f = GGUFFile.open(path)
    general_type = f.get("general.type")
    if general_type != gguf.GGUFType.ADAPTER:
        raise ModelFileError(
            f"{path}: general.type = {general_type!r:.80}: not a LoRA adapter (a GGUF adapter's general.type is"
            " 'adapter')")
    adapter_type = f.get(gguf.Keys.Adapter.TYPE)
    if adapter_type != "lora":
        raise ModelFileError(f"{path}: {gguf.Keys.Adapter.TYPE} = {adapter_type!r:.80}: not a LoRA adapter ('lora')")
    if gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS in f.metadata:
        raise ModelFileError(
            f"{path}: {gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS} is set: aLoRA (an adapter activated after an"
            " invocation sequence) is not supported")
    # llama.cpp reads a missing alpha as 0: no scaling
    alpha = _number(f.get(gguf.Keys.Adapter.LORA_ALPHA, 0.0), gguf.Keys.Adapter.LORA_ALPHA, str(path))
    architecture = f.require("general.architecture")
    if not isinstance(architecture, str):
        raise ModelFileError(f"{path}: general.architecture = {architecture!r:.80} is not a string")
    # convert_lora_to_gguf.py names the base model in general.base_model.0.name; general.basename is the
    # adapter's own family name when a writer sets it
    base_model = f.get("general.base_model.0.name", f.get("general.basename"))
    pairs = _gguf_pairs(f)
    _pairs_complete(path, pairs, GGUF_PARTS)
    if config is not None:
        _check_architecture(path, architecture, config)
    for module, p in pairs.items():
        _check_module(path, module, p.shapes[0], p.shapes[1], tuple(p.names), config, max_rank)
    permuted = architecture == "llama"
    modules = {}
    for module, p in pairs.items():
        a, b = (read() for read in p.read)
        heads = _permuted_heads(config, module) if permuted and config is not None else None
        if heads is not None:
            b = from_llama_cpp_layout(b, heads).contiguous()
        modules[module] = LoraModule(a, b, _gguf_scale(alpha, a.shape[0]))
    return LoraAdapter(path, "gguf", modules, alpha, False, base_model if isinstance(base_model, str) else None,
                       architecture, {m: tuple(p.names) for m, p in pairs.items()},
                       llama_cpp_rows=permuted and config is None and any(_kind(m) in _ROPE_ROWS for m in modules))


def _gguf_pairs(f: GGUFFile) -> dict[str, _Pair]:
    pairs: dict[str, _Pair] = {}
    for t in f.tensors.values():
        base, dot, suffix = t.name.rpartition(".")
        if t.name.endswith("_norm.weight"):
            continue  # mergekit-extract-lora's norms: llama.cpp skips them too
        if not dot or suffix not in GGUF_PARTS:
            raise ModelFileError(f"{f.path}: tensor {t.name!r} is not a LoRA tensor (NAME.lora_a or NAME.lora_b)")
        canonical = canonical_name(base) or base  # a name no model has is no target either
        module = _target(f.path, canonical.removesuffix(".weight") if canonical.endswith(".weight") else base,
                         t.name, base)
        if t.qtype not in GGUF_TYPES:
            raise ModelFileError(
                f"{f.path}: tensor {t.name!r} has type {t.qtype.name} (supported: {', '.join(q.name for q in GGUF_TYPES)})")
        p = pairs.setdefault(module, _Pair([None, None], [(), ()], [None, None]))
        i = GGUF_PARTS.index(suffix)
        p.names[i], p.shapes[i] = t.name, t.shape
        p.read[i] = lambda t=t: _finite(dequantize(t.data, t.qtype, t.shape, name=t.name), f.path, t.name)
    return pairs


def _permuted_heads(config: ModelConfig, module: str) -> int | None:
    """The head count llama.cpp's converter groups a llama module's rows by (its attn_q / attn_k), else None."""
    kind = _kind(module)
    return None if kind not in _ROPE_ROWS else config.num_heads if kind == "q_proj" else config.num_kv_heads


# --- writing


def write_lora_gguf(adapter: LoraAdapter, config: ModelConfig, out: str | os.PathLike, qtype: str = "F32") -> Path:
    """The adapter as a llama.cpp GGUF adapter (convert_lora_to_gguf.py's layout) for the model of `config`:
    A and B as F32 or F16, llama attn_q / attn_k lora_b rows permuted as the model's weights are.

    llama.cpp scales each pair by adapter.lora.alpha / r and has no rsLoRA or per-module alpha: when one alpha
    gives every module its scale it is written; otherwise each module's scale is folded into its B and
    alpha is 0 (llama.cpp: scale 1)."""
    out = Path(out)
    qtype_name = str(qtype).upper()
    if qtype_name not in WRITE_TYPES:
        raise ValueError(f"{out}: an adapter is written as {' or '.join(WRITE_TYPES)}, not {qtype!r}")
    if out.is_dir():
        raise ModelFileError(f"{out}: is a directory; give the output .gguf file name")
    if not out.parent.is_dir():
        raise ModelFileError(f"{out.parent}: no such directory for the output file")
    adapter.check(config)
    alpha = _common_alpha(adapter)
    tensors = {}  # every array made (and float16's range checked) before the file is opened
    for module in sorted(adapter.modules, key=lambda m: (_layer(m), list(TARGET_MODULES).index(_kind(m)))):
        m = adapter.modules[module]
        b = m.b.float() if alpha else m.b.float() * m.scale
        heads = _permuted_heads(config, module) if config.architecture == "llama" else None
        if heads is not None:
            b = to_llama_cpp_layout(b, heads)
        for suffix, t in zip(GGUF_PARTS, (m.a.float(), b)):
            name = f"{_gguf_name(module)}.{suffix}"
            tensors[name] = _encode(t, qtype_name, name, out)
    # written beside `out` and renamed over it at the end: a failed write leaves what was there before
    partial = out.with_name(f".{out.name}.partial")
    writer = gguf.GGUFWriter(partial, config.architecture)
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        writer.add_file_type(int(FILE_TYPES[WRITE_TYPES[qtype_name]]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, data in tensors.items():
            writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    writer.close()
    os.replace(partial, out)
    return out


def _common_alpha(adapter: LoraAdapter) -> float:
    """The alpha with alpha / r == scale for every module, or 0 when there is none (scales folded into B).

    0 itself cannot carry a scale (llama.cpp reads it as "no scaling"), nor can a value float32 cannot hold."""
    values = [m.scale * m.rank for m in adapter.modules.values()]
    alpha = values[0]
    fits = alpha != 0 and abs(alpha) < np.finfo(np.float32).max
    if fits and all(math.isclose(v, alpha, rel_tol=1e-9) for v in values):
        return alpha
    return 0.0


def _encode(t: torch.Tensor, qtype: str, name: str, out: Path) -> np.ndarray:
    """A tensor as the numpy array GGUFWriter stores as F32 or F16 (its type follows the array's dtype)."""
    if qtype == "F32":
        return t.contiguous().numpy()
    half = t.to(torch.float16)
    if not bool(torch.isfinite(half).all()):
        raise ValueError(f"{out}: tensor {name!r} holds values float16 cannot (beyond +-65504): write it as F32")
    return half.contiguous().numpy()
