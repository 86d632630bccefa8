"""ModelConfig: the architecture of a decoder-only transformer, whatever file it came from.

Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3 are one transformer with different flags, and so are the
mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), whose MLP is num_experts routed experts;
SUPPORTED_ARCHITECTURES says which flags each sets. Loaders (formats/gguf.py, formats/hf.py) fill in the
rest (sizes, windows, soft-caps).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from churon.errors import ModelFileError, UnsupportedModelError

# What Gemma 2 and 3 change in the Llama layer: embeddings scaled by sqrt(hidden), a norm after attention and after
# the MLP as well as before each, and GeGLU (tanh-approximated GELU) in place of SwiGLU
_GEMMA = {"scale_embeddings": True, "sandwich_norms": True, "hidden_act": "gelu_tanh"}

# architecture name (GGUF general.architecture / HF model_type) -> flags that differ from plain Llama
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},  # Llama with a sliding window on every layer (its config's sliding_window)
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma2": _GEMMA,
    "gemma3": {**_GEMMA, "qk_norm": True},
    # Llama with q/k/v and gate/up stored fused, a window on every layer (its sliding_window) and LongRoPE
    "phi3": {"fused_projections": True},
    # Mixture-of-experts families (named as GGUF's general.architecture; hf.py maps their model_type): a routed
    # MLP whose sizes the files give. Mixtral is Llama with experts (llama.cpp writes it as a "llama" GGUF)
    "mixtral": {"norm_topk_prob": True},
    "qwen2moe": {"attention_bias": True},  # a shared expert beside the routed ones
    "qwen3moe": {"qk_norm": True},
    "olmoe": {"qk_norm": True, "qk_norm_per_head": False},
    # gpt-oss: biases on q/k/v and o, a learned sink logit per head, windows on alternate layers, YaRN, and experts
    # with biases under a router with a bias that ranks the logits before its softmax (over the chosen k only),
    # their SwiGLU clamped
    "gpt-oss": {"attention_bias": True, "attention_out_bias": True, "attention_sinks": True,
                "expert_form": "clamped_swiglu", "router_bias": True, "router_topk_first": True},
}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")


def check_architecture(name: str, source: str) -> dict[str, Any]:
    if not isinstance(name, str):
        raise ModelFileError(f"{source}: the architecture {name!r:.80} is not a string")
    if name not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedModelError(f"{source}: architecture {name!r} is not supported (supported: {supported})")
    return SUPPORTED_ARCHITECTURES[name]


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    # None, or {"rope_type": "linear", "factor": f} or Llama 3's
    # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    # or YaRN's {"rope_type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
    # "truncate" (round the ramp's ends outwards), "attention_factor"} (gpt-oss)
    # or Phi-3's {"rope_type": "longrope", "short_factor", "long_factor" (per rotated pair, frequency divisors),
    # "original_max_position_embeddings", "attention_factor" (what cos and sin are multiplied by)}
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_per_head: bool = True  # False: the norm is over all of q and all of k at once (OLMoE)
    # q/k/v and gate/up come as one matrix each (Phi-3's qkv_proj and gate_up_proj, GGUF's attn_qkv and ffn_up)
    fused_projections: bool = False
    scale_embeddings: bool = False  # the embeddings are multiplied by sqrt(hidden_size) (Gemma)
    # a norm on the attention's and the MLP's outputs before each is added to the residual stream (Gemma 2/3)
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    query_pre_attn_scalar: float | None = None  # attention scores are scaled by its -1/2 power (None: head_dim's)
    # per layer, how many positions back its attention reaches (the query's own included); 0: the whole history.
    # Empty: every layer sees the whole history
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # RoPE base of the windowed layers, without scaling (Gemma 3); None: rope_theta's
    attn_logit_softcap: float = 0.0  # scores become c * tanh(s / c) before the softmax (Gemma 2); 0: none
    final_logit_softcap: float = 0.0  # likewise the logits (Gemma 2); 0: none
    # Mixture of experts: num_experts SwiGLU experts of moe_intermediate_size on each MoE layer; a token runs through
    # the num_experts_per_tok its router ranks highest (softmax over all experts, then the top k), their outputs
    # weighted by those probabilities, renormalized over the k when norm_topk_prob (Mixtral, Qwen3-MoE's releases).
    # 0 experts: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE's shared expert, run on every token and scaled by sigmoid(shared_expert_gate . x); 0: none
    shared_expert_intermediate_size: int = 0
    # layers of an MoE model whose MLP is dense, of intermediate_size (Qwen's mlp_only_layers / decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: o_proj has a bias; each head has a sink logit (self_attn.sinks) in its softmax's denominator
    attention_out_bias: bool = False
    attention_sinks: bool = False
    # the experts' MLP: "swiglu" (silu(gate) * up, no biases) or "clamped_swiglu" (gpt-oss: biases on gate/up and
    # down; gate clamped to at most swiglu_limit, up to [-swiglu_limit, swiglu_limit], then
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate))
    expert_form: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_bias: bool = False  # the router has a bias (gpt-oss)
    # the router's top k taken over its logits, then a softmax over those k (gpt-oss); else softmax, then top k
    router_topk_first: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # informational only (file type, name, ...)

    def moe_layer(self, layer: int) -> bool:
        """Whether layer's MLP is routed experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def window(self, layer: int) -> int:
        """How many positions back layer's attention sees, the query's own included; 0: all."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


@dataclass
class EncoderConfig:
    """The architecture of a BERT-family encoder (bidirectional attention, absolute position and token-type
    embeddings, post-LayerNorm, a GELU MLP, biases on every projection), whatever file it came from."""

    architecture: str  # "bert"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    context_length: int  # max_position_embeddings: rows of the position-embedding table
    type_vocab_size: int  # rows of the token-type table (0 when the file has none)
    layer_norm_eps: float
    hidden_act: str = "gelu"  # "gelu" (erf) or "gelu_tanh" (the tanh approximation)
    extra: dict[str, Any] = field(default_factory=dict)  # informational only (file type, name, ...)


POOLING_MODES = ("mean", "cls", "last")


@dataclass(frozen=True)
class PoolingConfig:
    """How a model's final hidden states become one vector per input (sentence-transformers' Pooling and
    Normalize modules, GGUF's {arch}.pooling_type)."""

    mode: str  # "mean" over the input's tokens, "cls" (its first token) or "last" (its last token)
    normalize: bool  # L2-normalize the pooled vector
    max_length: int | None = None  # sentence_bert_config.json's max_seq_length; None: the model's context

    def __post_init__(self):
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling {self.mode!r} is not supported (supported: {', '.join(POOLING_MODES)})")


# Limits a model file's architecture fields are held to before anything is sized by them.
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
# The longest context of a released Llama / Qwen model (Gradient's 4M Llama 3); the RoPE tables are this long.
MAX_CONTEXT_LENGTH = 1 << 22
# Every dimension is a dimension of some weight the file holds, and a weight takes at least one bit.
BITS_PER_BYTE = 8

_MISSING = object()


class ConfigReader:
    """Typed reads of a model file's architecture fields (GGUF metadata, config.json): an integer is an
    integer (not a bool, float, string, list or null) within its bounds, a float is finite and positive;
    anything else is a ModelFileError naming the file, the key and the value."""

    def __init__(self, values: Mapping[str, Any], source: str):
        self.values, self.source = values, source

    def _get(self, key: str, default: Any) -> Any:
        value = self.values.get(key)
        if value is None:  # config.json writes null for "not set" (head_dim, num_key_value_heads)
            if default is _MISSING:
                raise ModelFileError(f"{self.source}: field {key!r} is missing")
            return default
        return value

    def integer(self, key: str, default: Any = _MISSING, lo: int = 1, hi: int | None = None, why: str = "") -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ModelFileError(f"{self.source}: {key} = {value!r:.80} is not an integer")
        if value < lo:
            raise ModelFileError(f"{self.source}: {key} = {value} must be at least {lo}")
        if hi is not None and value > hi:
            raise ModelFileError(f"{self.source}: {key} = {value} is more than {hi}{why}")
        return int(value)

    def number(self, key: str, default: Any = _MISSING) -> float:
        return positive_float(self._get(key, default), key, self.source)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ModelFileError(f"{self.source}: {key} = {value!r:.80} is not a boolean")
        return value

    def dimension(self, key: str, file_bytes: int, default: Any = _MISSING) -> int:
        """A size some weight of the file has: no larger than the file's bits."""
        why = f": the weights it sizes cannot fit in the model's {file_bytes} bytes"
        return self.integer(key, default, hi=file_bytes * BITS_PER_BYTE, why=why)

    def head_dim(self, keys: Mapping[str, str], hidden: int, heads: int, file_bytes: int) -> int:
        """The head dimension: its own field, else hidden size / heads (as llama.cpp and transformers take it)."""
        if self.values.get(keys["head_dim"]) is None and heads > hidden:
            raise ModelFileError(
                f"{self.source}: {keys['num_heads']} = {heads} is more than {keys['hidden_size']} = {hidden}"
                f" and {keys['head_dim']} is not given"
            )
        return self.dimension(keys["head_dim"], file_bytes, default=hidden // heads)


def positive_float(value: Any, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ModelFileError(f"{source}: {key} = {value!r:.80} is not a number")
    if not math.isfinite(value) or value <= 0:
        raise ModelFileError(f"{source}: {key} = {value!r} must be a finite number greater than 0")
    return float(value)


def check_rope_scaling(scaling: Any, key: str, source: str, *, head_dim: int,
                       context_length: int) -> dict[str, Any] | None:
    """A RoPE scaling dict (Hugging Face's rope_scaling / rope_parameters) as model/rope.py reads it, every
    factor it uses present and finite; None for no scaling. head_dim and context_length: the model's, which
    LongRoPE's factors and default attention factor depend on."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ModelFileError(f"{source}: {key} = {scaling!r:.80} is not an object")
    kind = scaling.get("rope_type", scaling.get("type"))
    if not isinstance(kind, (str, type(None))):
        raise ModelFileError(f"{source}: {key}: rope_type = {kind!r:.80} is not a string")
    if kind in (None, "default"):
        return None
    r = ConfigReader(scaling, f"{source}: {key}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": r.number("factor")}
    if kind == "llama3":
        out = {
            "rope_type": "llama3",
            "factor": r.number("factor"),
            "low_freq_factor": r.number("low_freq_factor", 1.0),
            "high_freq_factor": r.number("high_freq_factor", 4.0),
            "original_max_position_embeddings": r.integer("original_max_position_embeddings", hi=MAX_CONTEXT_LENGTH),
        }
        if out["high_freq_factor"] <= out["low_freq_factor"]:  # the smoothing divides by their difference
            raise ModelFileError(
                f"{source}: {key}: high_freq_factor = {out['high_freq_factor']} must be greater than"
                f" low_freq_factor = {out['low_freq_factor']}"
            )
        return out
    if kind in ("longrope", "su"):  # "su": Phi-3's first name for it
        original = r.integer("original_max_position_embeddings", lo=2, hi=MAX_CONTEXT_LENGTH)
        # transformers' _compute_longrope_parameters: the attention factor from the context's growth, unless given
        factor = r.number("factor", context_length / original)
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return longrope_scaling(
            [r._get(name, _MISSING) for name in ("short_factor", "long_factor")], ("short_factor", "long_factor"),
            head_dim, original, r.number("attention_factor", attention), r.source)
    if kind == "yarn":
        truncate = scaling.get("truncate", True)  # transformers' default
        if not isinstance(truncate, bool):
            raise ModelFileError(f"{source}: {key}: truncate = {truncate!r:.80} is not a boolean")
        if scaling.get("mscale") or scaling.get("mscale_all_dim"):
            raise UnsupportedModelError(f"{source}: {key}: YaRN's mscale / mscale_all_dim are not supported")
        factor = r.number("factor")
        return yarn_scaling(factor, r.integer("original_max_position_embeddings", lo=2, hi=MAX_CONTEXT_LENGTH),
                            r.number("beta_fast", 32.0), r.number("beta_slow", 1.0), truncate,
                            r.number("attention_factor", yarn_attention_factor(factor)))
    raise UnsupportedModelError(f"{source}: {key}: RoPE scaling type {kind!r:.80} is not supported (supported: linear,"
                                " llama3, longrope, yarn)")


def yarn_attention_factor(factor: float) -> float:
    """YaRN's default factor on cos and sin: 0.1 ln(factor) + 1 (transformers' get_mscale, ggml's rope_yarn)."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_scaling(factor: float, original: int, beta_fast: float, beta_slow: float, truncate: bool,
                 attention_factor: float) -> dict[str, Any]:
    """YaRN's scaling dict (see ModelConfig.rope_scaling), its numbers checked by the caller."""
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": beta_fast, "beta_slow": beta_slow, "truncate": truncate, "attention_factor": attention_factor}


def longrope_scaling(factors: list[Any], names: tuple[str, str], head_dim: int, original: int, attention_factor: float,
                     source: str) -> dict[str, Any]:
    """LongRoPE's scaling dict (see ModelConfig.rope_scaling) from its short and long factors, each a list of one
    positive divisor per rotated pair of dimensions; names: theirs in the file, for its errors."""
    pairs = head_dim // 2
    checked = []
    for values, name in zip(factors, names):
        if not isinstance(values, (list, tuple)):
            raise ModelFileError(f"{source}: {name} = {values!r:.80} is not a list of numbers")
        if len(values) != pairs:
            raise ModelFileError(f"{source}: {name} has {len(values)} factors, the head dimension {head_dim} needs"
                                 f" {pairs} (one per rotated pair)")
        checked.append(tuple(positive_float(v, f"{name}[{i}]", source) for i, v in enumerate(values)))
    return {"rope_type": "longrope", "short_factor": checked[0], "long_factor": checked[1],
            "original_max_position_embeddings": original, "attention_factor": attention_factor}


def check_config(c: ModelConfig, keys: Mapping[str, str], source: str) -> None:
    """The architecture's fields fit one another; keys name each ModelConfig field as the file spells it."""
    if c.num_heads % c.num_kv_heads:
        raise ModelFileError(
            f"{source}: {keys['num_kv_heads']} = {c.num_kv_heads} does not divide {keys['num_heads']} = {c.num_heads}"
            " (each KV head serves a whole group of query heads)"
        )
    if c.head_dim % 2:
        raise ModelFileError(f"{source}: {keys['head_dim']} = {c.head_dim} is odd (RoPE rotates pairs of dimensions)")
    if c.layer_windows and len(c.layer_windows) != c.num_layers:
        raise ModelFileError(
            f"{source}: {keys['layer_windows']} gives {len(c.layer_windows)} layers' attention, the model has"
            f" {keys['num_layers']} = {c.num_layers}"
        )
    if c.num_experts and not 1 <= c.num_experts_per_tok <= c.num_experts:
        raise ModelFileError(
            f"{source}: {keys['num_experts_per_tok']} = {c.num_experts_per_tok} must be between 1 and"
            f" {keys['num_experts']} = {c.num_experts} (the experts each token is routed to)"
        )
    window = max(c.layer_windows, default=0)
    if window > c.context_length:  # a window never reached says the file was written for another model
        raise ModelFileError(
            f"{source}: {keys['sliding_window']} = {window} is larger than the context, {keys['context_length']} ="
            f" {c.context_length}"
        )


# Where a file names no layer pattern: every period-th layer sees the whole history, the others are windowed
# (llama.cpp's swa patterns and transformers 4's sliding_window_pattern defaults; period 1: a window on every layer)
SWA_PERIODS = {"mistral": 1, "mixtral": 1, "gemma2": 2, "gemma3": 6, "gpt-oss": 2}


def windows_of_pattern(num_layers: int, window: int, period: int) -> tuple[int, ...]:
    """Per layer, its window where period - 1 windowed layers alternate with one global layer (llama.cpp's
    swa pattern: Gemma 2 has period 2, Gemma 3 period 6; period 1 is a window on every layer)."""
    if period == 1:
        return (window,) * num_layers
    return tuple(window if i % period < period - 1 else 0 for i in range(num_layers))


def phi3_windows(num_layers: int, window: int, context_length: int) -> tuple[int, ...]:
    """Phi-3's window, on every layer, as transformers applies its sliding_window (llama.cpp has turned Phi's
    window off, ggml-org/llama.cpp#13676). 0, or a window no shorter than the context, is none: Phi-3.5-mini and
    Phi-4-mini ship 262144 over a context of 131072, which masks nothing."""
    return windows_of_pattern(num_layers, window, 1) if 0 < window < context_length else ()


def default_threads() -> int:
    """Number of physical cores (hyper-threads share a core's FPUs and slow matmuls down)."""
    cores = set()
    try:
        with open("/proc/cpuinfo") as f:
            physical = core = None
            for line in f:
                if line.startswith("physical id"):
                    physical = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip() and core is not None:
                    cores.add((physical, core))
                    physical = core = None
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(len(cores) or affinity, affinity))


# element types of the KV cache, by torch name (kv_cache.KV_DTYPES maps them to torch dtypes)
KV_DTYPE_CHOICES = ("float32", "bfloat16", "float16", "int8")


MAX_LORAS = 256  # EngineConfig.max_loras at most
MAX_LORA_RANK = 4096  # EngineConfig.max_lora_rank at most
# SpeculativeConfig.num_tokens at most: a verification pass of k + 1 rows costs little more than one row only
# while k is small, and a proposal past a few dozen tokens is almost never accepted whole
MAX_SPECULATIVE_TOKENS = 32
SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decoding request proposes up to num_tokens tokens per step, which the target
    model scores in the step's one batched pass; the longest prefix its own sampling agrees with is kept
    (engine/speculative/). The output is the one without speculation (see engine/speculative/__init__.py).

    method: "ngram" (prompt lookup: the tokens that followed an earlier occurrence of the last n tokens, n from
        ngram_max down to ngram_min, in the prompt and the output so far, the one whose context agrees longest, as
        many as agree, engine/speculative/ngram.py) or "draft" (a smaller model with the same vocabulary, `model`:
        a path or registry name, run greedily on its own KV cache).
    adaptive: each request's proposal length follows its recent acceptance rate, down to none where speculation
        does not pay (False: always num_tokens, for tests).
    """

    method: str = "ngram"
    # the most proposed tokens a step: 8 rather than 4 since attention reads a verification's rows together (SmolLM2,
    # input-grounded prompts: 1.98x over no speculation against 1.79x; chat unchanged, the adaptive length keeps it short)
    num_tokens: int = 8
    ngram_max: int = 4
    ngram_min: int = 2
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"invalid speculative method {self.method!r}: must be one of {', '.join(SPECULATIVE_METHODS)}")
        for name, low, high in (("num_tokens", 1, MAX_SPECULATIVE_TOKENS), ("ngram_max", 1, 64), ("ngram_min", 1, 64)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"invalid speculative setting {name}={value!r}: must be an integer in [{low}, {high}]")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"invalid speculative settings: ngram_min={self.ngram_min} is above ngram_max={self.ngram_max}")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("speculative method 'draft' needs a draft model (model=PATH), and only it takes one")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"invalid speculative setting model={self.model!r}: must be a path or registry name")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"invalid speculative setting adaptive={self.adaptive!r}: must be True or False")

    @classmethod
    def of(cls, value: "SpeculativeConfig | Mapping[str, Any] | None") -> "SpeculativeConfig | None":
        """From LLM(speculative=...)'s value: a config, a dict of its fields, or None (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"invalid speculative setting {value!r}: must be a dict such as {{'method': 'ngram'}}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown speculative setting {unknown[0]!r} (known: {', '.join(cls.__dataclass_fields__)})")
        return cls(**value)


@dataclass
class EngineConfig:
    """Runtime knobs of the serving engine."""

    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: kv_cache_fraction of available memory
    kv_cache_fraction: float = 0.25
    kv_dtype: str = "auto"  # "auto" (the backend's choice), "float32", "bfloat16", "float16", "int8"
    max_num_seqs: int = 32  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (prompt chunks + decodes)
    # prompt tokens in one step while other requests wait or decode (a prompt alone in the engine takes the whole
    # max_num_batched_tokens): requests get their first tokens in arrival order, a few per step, rather than all
    # at the end of one long step, and the others' decoding stalls for a chunk at most (scheduler.py)
    prefill_chunk_tokens: int = 256
    max_model_len: int | None = None  # cap on a sequence's length (default: the model's context length)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_loras: int = 8  # LoRA adapters loaded at once (each holds a slot the batch's tokens pick); 0: none
    max_lora_rank: int = 64  # the largest rank an adapter may have
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off); a dict is read as its fields

    def __post_init__(self):
        self.speculative = SpeculativeConfig.of(self.speculative)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"invalid engine setting {name}={value!r}: must be an integer >= 1")
        # the bounds: every step's LoRA calls walk each matrix's slot table, and a rank past a few thousand
        # is a model of its own, not an adapter
        for name, low, high in (("max_loras", 0, MAX_LORAS), ("max_lora_rank", 1, MAX_LORA_RANK)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"invalid engine setting {name}={value!r}: must be an integer in [{low}, {high}]")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"invalid engine setting kv_cache_memory={self.kv_cache_memory!r}: must be > 0 bytes")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"invalid engine setting kv_cache_fraction={self.kv_cache_fraction!r}: must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"invalid engine setting max_model_len={self.max_model_len!r}: must be >= 2")
        if self.kv_dtype not in ("auto", *KV_DTYPE_CHOICES):
            raise ValueError(
                f"invalid engine setting kv_dtype={self.kv_dtype!r}: must be one of auto, {', '.join(KV_DTYPE_CHOICES)}"
            )

    def kv_torch_dtype(self, default):
        """The KV cache's torch dtype; "auto" is the backend's default (the activation dtype)."""
        import torch

        return default if self.kv_dtype == "auto" else getattr(torch, self.kv_dtype)
