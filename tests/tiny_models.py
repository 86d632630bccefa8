"""Tiny random models for tests: Hugging Face directories and GGUF files made from them.

Test-support code, imported by tests (not collected itself). Transformers is the reference here and
only here; churon never imports it.

    make_tokenizer_files(dir)            byte-level BPE tokenizer (ChatML specials) trained on fixed text
    make_hf_model(arch, dir)             tiny random model of each decoder family, saved with save_pretrained
    write_gguf(hf_dir, path, qtype)      converts that directory the way llama.cpp's convert_hf_to_gguf.py does
    reference_model(hf_dir, gguf_path)   the transformers model, optionally with the weights stored in the GGUF
    make_peft_adapter(hf_dir, dir)       a random LoRA adapter for that model, saved by PEFT (peft_model: attached)
    make_bert_model(dir)                 tiny random BERT as a sentence-transformers directory (WordPiece tokenizer)
    write_bert_gguf(hf_dir, path, qtype) converts it the way convert_hf_to_gguf.py's BertModel does

The conversion follows convert_hf_to_gguf.py (TextModel.set_gguf_parameters, LlamaModel, Qwen2Model,
Qwen3Model, Phi3MiniModel, TextModel.prepare_tensors, _set_vocab_gpt2): the same metadata keys, tensor names
(through gguf.get_tensor_name_map), the llama q/k row permutation, F32 for 1-D tensors and norms, rope_freqs for
llama3 rope scaling, rope_factors_long / _short for Phi-3's longrope, and the vocabulary written through
gguf.SpecialVocab (Phi-3's too, as the converter writes Phi-4's GPT-2 vocabulary). Where llama.cpp's converter
and transformers would disagree about the model (see _llama3_rope_factors) write_gguf raises instead of
writing a file whose reference would be wrong.

Everything is seeded and offline: no hub access, same bytes on every run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")  # the Llama-layout families (LoRA's tests run on these)
# every decoder family; Gemma's layers add norms and windows, Mistral a window on every layer, Phi-3 fused
# matrices and a window on every layer
# mixture-of-experts families, by Hugging Face model_type: routed experts in place of the MLP (Qwen2-MoE: a shared
# expert beside them; OLMoE: q/k norms over whole projections)
# gpt-oss: attention sinks and biases, windows on alternate layers, YaRN, experts with biases under a biased router,
# their SwiGLU clamped
MOE_ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")
DECODER_ARCHS = ARCHS + ("mistral", "gemma2", "gemma3", "phi3") + MOE_ARCHS

# Sizes shared by every tiny model (the brief's numbers; head_dim = hidden / heads).
HIDDEN = 64
N_LAYERS = 2
N_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
MAX_POSITIONS = 256
ROPE_THETA = 10000.0
RMS_EPS = 1e-6
# The MoE models' experts: 8 of FFN 32, each token through 2; Qwen2-MoE's shared expert of 48
N_EXPERTS = 8
N_EXPERTS_USED = 2
EXPERT_INTERMEDIATE = 32
SHARED_EXPERT_INTERMEDIATE = 48
# Routers more decisive than the other matrices' 0.15 would make them (whose k-th and (k+1)-th experts are often within
# a few percent, where 8-bit activations swap them), yet not so decisive that the top expert takes all the weight
ROUTER_STD = 1.0
OLMOE_RMS_EPS = 1e-5  # llama.cpp's converter writes 1e-5 for every OLMoE, whatever its config says
# gpt-oss's YaRN, as its release has it but over an original context of 64 (every test's sequence within the model's
# context of 256; head_dim 16: pairs 0-2 ramp between their own frequency and a quarter of it, the rest interpolated),
# with the ramp's ends rounded outwards (truncate: what llama.cpp does, whatever the config says)
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                "original_max_position_embeddings": 64}
# the experts' gate/up weights large enough that the clamped SwiGLU's limit of 7 clamps a tenth of gate and up
GPT_OSS_GATE_UP_STD = 0.6
# Windows short enough that every test's prompt runs past them; Gemma 3 needs six layers for one global one
SLIDING_WINDOW = 8
GEMMA3_LAYERS = 6
GEMMA3_GLOBAL_THETA = 1_000_000.0  # its windowed layers turn at 10000 (llama.cpp's constant)
# Soft-caps small enough that tanh bends the tiny models' scores and logits
GEMMA2_ATTN_SOFTCAP = 5.0
GEMMA2_FINAL_SOFTCAP = 8.0

# Tokenizer.
VOCAB_SIZE = 400  # target size given to the BPE trainer (256 bytes + 3 specials + merges)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2.5-Instruct's template (shortened default system prompt): `tools` in the system turn, assistant
# tool_calls as <tool_call> JSON, tool results as <tool_response> blocks in one user turn. The native
# tool-calling template of tests that need one (make_hf_model(..., chat_template=QWEN_TOOLS_TEMPLATE)).
QWEN_TOOLS_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# A llama3 rope scaling that llama.cpp's converter and transformers agree on (all three regimes occur
# for head_dim 16, theta 1e4: factor 1 for the high frequencies, a smoothed factor, and 8 for the lowest).
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Llama 3.2's (1B, 3B): factor 32 over an original 8192 positions, base 500000; with head_dim 64 (make_hf_model's
# head_dim) every regime occurs too
LLAMA32_ROPE_SCALING = {**LLAMA3_ROPE_SCALING, "factor": 32.0, "rope_theta": 500000.0}

# Phi-3's longrope (make_hf_model("phi3", rope_scaling=...) with an original_max_position_embeddings): one frequency
# divisor per rotated pair (head_dim 16: 8), short and long apart and neither all 1, as Phi-3.5-mini's
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.6, 2.0],
    "long_factor": [1.0, 1.2, 1.6, 2.4, 4.0, 7.0, 12.0, 20.0],
}

QTYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "Q5_0": (gguf.GGMLQuantizationType.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0),
    "Q5_1": (gguf.GGMLQuantizationType.Q5_1, gguf.LlamaFileType.MOSTLY_Q5_1),
    # gpt-oss's release: its experts MXFP4 (the other matrices F32 here)
    "MXFP4": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
}

# convert_hf_to_gguf.py writes Mistral as llama (its LlamaModel), without the sliding window
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
             "mistral": gguf.MODEL_ARCH.LLAMA, "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
             "phi3": gguf.MODEL_ARCH.PHI3, "mixtral": gguf.MODEL_ARCH.LLAMA, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
             "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "olmoe": gguf.MODEL_ARCH.OLMOE, "gpt_oss": gguf.MODEL_ARCH.GPT_OSS}
LLAMA_LAYOUT = ("llama", "mistral", "mixtral")  # LlamaModel's conversions: q/k rows permuted, vocab_size written
# build_moe_ffn's norm_w in llama.cpp: whether it renormalizes the top-k weights (Mixtral, written as llama: always)
LLAMA_CPP_NORM_TOPK = {"mixtral": True, "qwen3_moe": True, "qwen2_moe": False, "olmoe": False, "gpt_oss": False}
GEMMA = ("gemma2", "gemma3")

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog did not mind; it was a warm afternoon.
Once upon a time there was a small town by the sea, where the people went out fishing every morning.
In the evening they would come back, sit by the fire and tell stories about the things they had seen.
"What did you see today?" asked the child. "A whale," said her father, "and a ship with red sails."
She laughed, because she didn't believe him, but she'd remember the red sails for a long time.
Numbers matter too: 1, 2, 3, 10, 42, 100, 2024, 3.14 and 1,000,000 are all written with digits.
I've been told that it's best to keep things simple. We're going to try, and they'll see the result.
The weather was cold in the north and hot in the south; the wind came from the west in the winter.
Machine learning models read text as tokens. A tokenizer splits the text into pieces and maps each
piece to a number. The model then predicts the next token, one at a time, until it reaches the end.
Hello, world! How are you? I am fine, thank you. Where is the library? It is on the other street.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
To be, or not to be, that is the question: whether it is nobler in the mind to suffer the slings
and arrows of outrageous fortune, or to take arms against a sea of troubles and by opposing end them.
The garden had roses, tulips and a tall old tree; in spring the birds built their nests in its branches.
    Indented lines, tabs\tand double  spaces also appear in real text, as do (brackets) and [lists].
Water boils at 100 degrees and freezes at 0 degrees. The train leaves at 7:45 and arrives at 9:30.
Good morning! Could you please pass the salt? Thanks a lot. You're welcome, it was nothing at all.
"""


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

def make_tokenizer_files(out_dir: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    """Train a small byte-level BPE tokenizer and save tokenizer.json, tokenizer_config.json and
    generation_config.json into out_dir (deterministic: the same files on every call).
    chat_template: tokenizer_config.json's (QWEN_TOOLS_TEMPLATE for a model with native tool calling)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    # GPT-2 style: the GPT-2 split regex plus the byte-to-unicode mapping, i.e. llama.cpp's "gpt-2" pre.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added_tokens_decoder = {
        str(ids[t]): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": BOS_TOKEN,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": MAX_POSITIONS,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", _generation_config(ids))


def _generation_config(ids: dict[str, int]) -> dict:
    # Like Qwen2.5-Instruct: eos is a list (end of turn first), no sampling defaults.
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids["<|endoftext|>"]],
        "pad_token_id": ids[PAD_TOKEN],
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Hugging Face model
# --------------------------------------------------------------------------------------------------

def make_hf_model(
    arch: str,
    out_dir: Path,
    *,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    rope_scaling: dict | None = None,
    shard: bool = False,
    max_shard_size: str | int = "100KB",
    extra_vocab: int = 0,
    legacy_config: bool = False,
    chat_template: str = CHAT_TEMPLATE,
    max_positions: int = MAX_POSITIONS,
    query_pre_attn_scalar: int | None = None,
    final_logit_softcapping: float | None = None,
    head_dim: int | None = None,
) -> Path:
    """Build a tiny random fp32 model of `arch` and save it (safetensors + config + tokenizer files).

    shard=True saves several model-0000N-of-0000M.safetensors files plus model.safetensors.index.json
    (max_shard_size sets the shard size). extra_vocab > 0 pads the embedding beyond the tokenizer's
    vocabulary, as Qwen2.5 does (those ids become [PAD<i>] UNUSED tokens in the GGUF).
    legacy_config=True rewrites config.json the way transformers 4.x wrote it and real checkpoints
    (SmolLM2, Qwen2.5, Llama 3.x) still ship it: top-level rope_theta and rope_scaling (null unless
    scaled), torch_dtype instead of dtype, no layer_types, and for qwen a sliding_window number with
    use_sliding_window false, as Qwen2.5 has. Transformers 5 loads both to the same model.
    chat_template: the tokenizer's (see make_tokenizer_files); max_positions: the context (tool-calling
    prompts, with their tools' schemas, need more than the default); final_logit_softcapping: a Gemma 3's;
    query_pre_attn_scalar: Gemma's, when it is
    not head_dim; head_dim: a llama's (Llama 3.2 has 64), apart from hidden / heads. rope_scaling: a llama's
    (LLAMA3_ROPE_SCALING) or a phi3's (PHI3_LONGROPE and an original_max_position_embeddings). Returns out_dir."""
    if arch not in DECODER_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {DECODER_ARCHS}")
    if rope_scaling is not None and arch not in ("llama", "phi3", "gpt_oss"):
        raise ValueError(f"rope_scaling is only supported for llama, phi3 and gpt_oss here, not {arch!r}")
    head_dim = HEAD_DIM if head_dim is None else head_dim  # read now: tests widen the tiny models by patching HEAD_DIM
    if head_dim != HEAD_DIM and arch != "llama":
        raise ValueError(f"head_dim is only supported for llama here, not {arch!r}")
    out_dir = Path(out_dir)
    make_tokenizer_files(out_dir, chat_template)
    model = _build_model(arch, out_dir, tie_word_embeddings, seed, rope_scaling, extra_vocab, max_positions, head_dim)
    if query_pre_attn_scalar is not None:
        model.config.query_pre_attn_scalar = query_pre_attn_scalar
    if final_logit_softcapping is not None:  # Gemma 3 has a field for it, null in every released model
        model.config.final_logit_softcapping = final_logit_softcapping
    kwargs = {"max_shard_size": max_shard_size} if shard else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    # save_pretrained may write its own generation_config.json; keep ours.
    ids = _special_ids(out_dir)
    _write_json(out_dir / "generation_config.json", _generation_config(ids))
    if legacy_config:
        _write_json(out_dir / "config.json", _legacy_config(json.loads((out_dir / "config.json").read_text())))
    return out_dir


def _legacy_config(cfg: dict) -> dict:
    """A transformers 5 config.json in the transformers 4.x layout."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", ROPE_THETA)
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if "full_attention" in rope:  # Gemma 3: the global layers' base on top, the windowed layers' apart
        cfg["rope_theta"] = rope["full_attention"]["rope_theta"]
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        cfg["rope_scaling"] = None
        cfg["sliding_window_pattern"] = GEMMA3_LAYERS
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)
    if cfg.get("use_sliding_window") is False and cfg.get("sliding_window") is None:
        cfg["sliding_window"] = cfg["max_position_embeddings"]  # Qwen2.5 ships a number it does not use
    return cfg


def _special_ids(hf_dir: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(hf_dir) / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _build_model(arch: str, tok_dir: Path, tie: bool, seed: int, rope_scaling: dict | None,
                 extra_vocab: int, max_positions: int = MAX_POSITIONS, head_dim: int = HEAD_DIM) -> torch.nn.Module:
    import transformers
    from tokenizers import Tokenizer

    transformers.utils.logging.disable_progress_bar()
    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    common = dict(
        vocab_size=tok.get_vocab_size(with_added_tokens=True) + extra_vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        max_position_embeddings=max_positions,
        rms_norm_eps=RMS_EPS,
        tie_word_embeddings=tie,
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        hidden_act="silu",
    )
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    if rope_scaling is not None:
        rope = {"rope_theta": ROPE_THETA, **rope_scaling}
        rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type")
    if arch == "llama":
        config = transformers.LlamaConfig(**common, head_dim=head_dim, attention_bias=False, mlp_bias=False,
                                          rope_parameters=rope)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        # Qwen2's q/k/v biases are built in (no attention_bias field); no head_dim field, like the real config.
        config = transformers.Qwen2Config(**common, rope_parameters=rope)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=HEAD_DIM, attention_bias=False, rope_parameters=rope)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, head_dim=HEAD_DIM, sliding_window=SLIDING_WINDOW,
                                            rope_parameters=rope)
        cls = transformers.MistralForCausalLM
    elif arch == "gemma2":
        # the query scale equal to head_dim's: a GGUF cannot say otherwise (but 27B's layer count)
        config = transformers.Gemma2Config(**_gemma_common(common), head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                           sliding_window=SLIDING_WINDOW, attn_logit_softcapping=GEMMA2_ATTN_SOFTCAP,
                                           final_logit_softcapping=GEMMA2_FINAL_SOFTCAP, rope_parameters=rope)
        cls = transformers.Gemma2ForCausalLM
    elif arch == "phi3":
        # Phi3Config reads the original context from its own field whatever the scaling says (Phi-3-mini-4k: equal
        # to the context); its head_dim is hidden / heads
        original = rope.get("original_max_position_embeddings", max_positions)
        config = transformers.Phi3Config(**common, sliding_window=SLIDING_WINDOW, original_max_position_embeddings=original,
                                         rope_parameters=rope)
        cls = transformers.Phi3ForCausalLM
    elif arch in MOE_ARCHS:
        config, cls = _moe_config(transformers, arch, common, rope)
    else:
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": ROPE_THETA},
                "full_attention": {"rope_type": "default", "rope_theta": GEMMA3_GLOBAL_THETA}}
        config = transformers.Gemma3TextConfig(**{**_gemma_common(common), "num_hidden_layers": GEMMA3_LAYERS},
                                               head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                               sliding_window=SLIDING_WINDOW, rope_parameters=rope)
        cls = transformers.Gemma3ForCausalLM
    config.architectures = [cls.__name__]
    config.dtype = "float32"

    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    _randomize(model, seed)
    return model.eval()


def _moe_config(transformers, arch: str, common: dict, rope: dict):
    """A tiny MoE config and its model class: N_EXPERTS experts of EXPERT_INTERMEDIATE, N_EXPERTS_USED a token, the
    top-k renormalized where llama.cpp does (Qwen3-MoE's releases set norm_topk_prob; Qwen2-MoE's and OLMoE's not)."""
    experts = dict(num_experts_per_tok=N_EXPERTS_USED, rope_parameters=rope)
    if arch == "gpt_oss":  # layer_types: GptOssConfig's own, windowed on even layers
        if rope.get("rope_type") == "default":
            rope = {"rope_theta": ROPE_THETA, **GPT_OSS_YARN}
        common = {k: v for k, v in common.items() if k != "hidden_act"} | {"intermediate_size": EXPERT_INTERMEDIATE}
        return (transformers.GptOssConfig(**common, head_dim=HEAD_DIM, num_local_experts=N_EXPERTS,
                                          num_experts_per_tok=N_EXPERTS_USED, sliding_window=SLIDING_WINDOW,
                                          attention_bias=True, rope_parameters=rope), transformers.GptOssForCausalLM)
    if arch == "mixtral":
        return (transformers.MixtralConfig(**{**common, "intermediate_size": EXPERT_INTERMEDIATE}, head_dim=HEAD_DIM,
                                           num_local_experts=N_EXPERTS, **experts), transformers.MixtralForCausalLM)
    if arch == "olmoe":
        common = {**common, "intermediate_size": EXPERT_INTERMEDIATE, "rms_norm_eps": OLMOE_RMS_EPS}
        return (transformers.OlmoeConfig(**common, num_experts=N_EXPERTS, norm_topk_prob=False, **experts),
                transformers.OlmoeForCausalLM)
    qwen = dict(num_experts=N_EXPERTS, moe_intermediate_size=EXPERT_INTERMEDIATE, decoder_sparse_step=1,
                mlp_only_layers=[], **experts)
    if arch == "qwen3_moe":
        return (transformers.Qwen3MoeConfig(**common, head_dim=HEAD_DIM, norm_topk_prob=True, **qwen),
                transformers.Qwen3MoeForCausalLM)
    return (transformers.Qwen2MoeConfig(**common, norm_topk_prob=False,
                                        shared_expert_intermediate_size=SHARED_EXPERT_INTERMEDIATE, **qwen),
            transformers.Qwen2MoeForCausalLM)


def _gemma_common(common: dict) -> dict:
    """Gemma's configs name the activation hidden_activation: the tanh-approximated GELU."""
    out = {k: v for k, v in common.items() if k != "hidden_act"}
    return out | {"hidden_activation": "gelu_pytorch_tanh"}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a seeded value large enough that mistakes show in the logits:
    matrices ~ N(0, 0.15) (routers ~ N(0, ROUTER_STD), gpt-oss's experts' gate/up ~ N(0, GPT_OSS_GATE_UP_STD), its
    sinks ~ N(0, 1)), norm weights ~ U(0.7, 1.3), biases ~ N(0, 0.1). Gemma's norms multiply by 1 + weight: theirs ~ U(-0.3, 0.3), the same scales (at 1.7-2.3 its four norms a layer make the model
    chaotic: 8-bit or bf16 activations then move its logits by 10%)."""
    g = torch.Generator().manual_seed(seed)
    norm_offset = -1.0 if model.config.model_type.startswith("gemma") else 0.0
    gpt_oss = model.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head shares embed_tokens, visited once
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # a router
                p.copy_(torch.randn(p.shape, generator=g) * ROUTER_STD)
            elif gpt_oss and name.endswith("experts.gate_up_proj"):  # into its SwiGLU's clamps
                p.copy_(torch.randn(p.shape, generator=g) * GPT_OSS_GATE_UP_STD)
            elif name.endswith("self_attn.sinks"):  # gpt-oss's sink logits, of the scores' own size
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:  # matrices, and the experts' stacked [experts, rows, cols]
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:  # RMSNorm weights (input/post-attention/final, q_norm/k_norm)
                p.copy_(0.7 + norm_offset + 0.6 * torch.rand(p.shape, generator=g))


# --------------------------------------------------------------------------------------------------
# GGUF conversion
# --------------------------------------------------------------------------------------------------

def _arch(model_type: str) -> str:
    """This module's name for a transformers model_type (Gemma 3's text-only checkpoints are gemma3_text)."""
    return {"gemma3_text": "gemma3"}.get(model_type, model_type)


def _load_hparams(hf_dir: Path) -> dict:
    """Config as llama.cpp's converter sees it: AutoConfig(...).to_dict(), rope params mirrored."""
    import transformers

    hparams = transformers.AutoConfig.from_pretrained(hf_dir).to_dict()
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    if "rope_theta" not in rope and hparams.get("rope_theta") is not None:
        rope["rope_theta"] = hparams["rope_theta"]
    if "rope_type" not in rope and rope.get("type") is not None:
        rope["rope_type"] = rope["type"]
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):  # TextModel.__init__ mirrors these too
        if key not in rope and hparams.get(key) is not None:
            rope[key] = hparams[key]
    hparams["_rope"] = rope
    return hparams


def _read_safetensors(hf_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """Tensors in the order llama.cpp indexes them: part files sorted by name, keys in file order."""
    from safetensors import safe_open

    parts = sorted(p.name for p in Path(hf_dir).iterdir() if p.name.startswith("model") and p.suffix == ".safetensors")
    if not parts:
        raise FileNotFoundError(f"no model*.safetensors in {hf_dir}")
    out = []
    for part in parts:
        with safe_open(str(Path(hf_dir) / part), framework="pt") as f:
            for name in f.keys():
                out.append((name, f.get_tensor(name)))
    return out


def permute_qk(w: torch.Tensor | np.ndarray, n_head: int):
    """llama.cpp's LlamaModel.permute (HF rotate-half rows -> GGML interleaved rope rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor | np.ndarray, n_head: int):
    """Inverse of permute_qk (GGUF rows -> HF rows)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(hparams: dict) -> torch.Tensor | None:
    """rope_freqs.weight exactly as LlamaModel.generate_extra_tensors computes it, or None.

    Two quirks of llama.cpp's converter are kept: it reads original_max_position_embeddings from the
    config's top level (default 8192), not from rope_scaling, and it uses 8192 when the key is absent
    where transformers falls back to max_position_embeddings. When that makes the factors disagree with
    the inverse frequencies transformers computes, raise: the GGUF would not match its reference."""
    rope = hparams["_rope"]
    if rope.get("rope_type", "").lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = hparams.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    factors = torch.tensor(rope_factors, dtype=torch.float32)

    hf_old = rope.get("original_max_position_embeddings", hparams.get("max_position_embeddings"))
    if hf_old != old_context_len:
        raise ValueError(
            f"llama3 rope_scaling: transformers uses original_max_position_embeddings={hf_old} but llama.cpp's "
            f"converter uses {old_context_len} (it reads the config's top level, default 8192), so rope_freqs.weight "
            f"would not match the reference model; use original_max_position_embeddings={old_context_len} "
            f"(e.g. tiny_models.LLAMA3_ROPE_SCALING)")
    return factors


def write_gguf(hf_dir: Path, out_path: Path, qtype: str = "F32") -> Path:
    """Convert the HF directory to a GGUF file like convert_hf_to_gguf.py (qtype for 2-D weights;
    1-D tensors, norms and rope_freqs stay F32). Returns out_path."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; expected one of {tuple(QTYPES)}")
    data_qtype, ftype = QTYPES[qtype]
    hparams = _load_hparams(hf_dir)
    arch = _arch(hparams["model_type"])
    if arch not in DECODER_ARCHS:
        raise ValueError(f"{hf_dir}/config.json: model_type {arch!r} is not one of {DECODER_ARCHS}")
    model_arch = GGUF_ARCH[arch]
    n_blocks = hparams["num_hidden_layers"]
    n_head = hparams["num_attention_heads"]
    n_kv_head = hparams.get("num_key_value_heads") or n_head
    tensor_map = gguf.get_tensor_name_map(model_arch, n_blocks)

    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[model_arch])

    # --- tensors (TextModel.prepare_tensors: generate_extra_tensors first, then the checkpoint) ---
    # (gpt-oss's softmax is over the chosen k: no renormalization to agree on)
    if arch in MOE_ARCHS and arch != "gpt_oss" and bool(hparams.get("norm_topk_prob", True)) != LLAMA_CPP_NORM_TOPK[arch]:
        raise ValueError(f"{arch}: llama.cpp {'always' if LLAMA_CPP_NORM_TOPK[arch] else 'never'} renormalizes the top-k"
                         f" router weights, the config says norm_topk_prob={hparams.get('norm_topk_prob')}")
    if arch == "gpt_oss":
        _check_gpt_oss_convertible(hparams)
    if arch == "olmoe" and hparams["rms_norm_eps"] != OLMOE_RMS_EPS:
        raise ValueError(f"olmoe: llama.cpp's converter writes rms_norm_eps {OLMOE_RMS_EPS}, the config has"
                         f" {hparams['rms_norm_eps']}")
    tensors: list[tuple[str, torch.Tensor]] = []
    experts: dict[str, torch.Tensor] = {}  # one layer's per-expert tensors until all have come (modify_tensors)
    if arch == "llama" and (factors := _llama3_rope_factors(hparams)) is not None:
        tensors.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors))
    longrope = _phi3_longrope(hparams) if arch == "phi3" else None
    if longrope is not None:
        tensors += longrope[1]
    for name, t in _read_safetensors(hf_dir):
        if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
            continue
        if arch in LLAMA_LAYOUT:  # LlamaModel.modify_tensors: undo_permute
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = permute_qk(t, n_head)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                t = permute_qk(t, n_kv_head)
        if arch in GEMMA and name.endswith("norm.weight"):  # Gemma2Model / Gemma3Model: (1 + weight) stored
            t = t + 1
        if arch == "gemma2" and name == "lm_head.weight":
            continue
        if arch == "gpt_oss":
            tensors += _gpt_oss_tensors(name, t, tensor_map)
            continue
        if ".experts." in name:
            experts[name] = t
            tensors += _stacked_experts(experts, name, hparams, tensor_map)
            continue
        new_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"{hf_dir}: cannot map tensor {name!r} to a GGUF name")
        tensors.append((new_name, t))

    for new_name, t in tensors:
        data = t.to(torch.float32).numpy() if t.dtype not in (torch.float16, torch.float32) else t.numpy()
        n_dims = data.ndim
        q = data_qtype
        # the routers stay F32 (prepare_tensors: FFN_GATE_INP, FFN_GATE_INP_SHEXP), and gpt-oss's experts' biases
        # [experts, rows] (ggml adds them by expert id, from F32)
        if n_dims <= 1 or new_name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", ".bias")):
            q = gguf.GGMLQuantizationType.F32
        elif qtype == "MXFP4" and new_name.endswith("_exps.weight"):
            q = gguf.GGMLQuantizationType.MXFP4
        try:
            qdata = gguf.quants.quantize(data, q)
        except gguf.QuantError:  # llama.cpp: "falling back to F16" (e.g. rows not a multiple of the block)
            q = gguf.GGMLQuantizationType.F16
            qdata = gguf.quants.quantize(data, q)
        writer.add_tensor(new_name, qdata, raw_dtype=q)

    # --- metadata (ModelBase.prepare_metadata -> set_type, general.*, set_gguf_parameters) ---
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"tiny-{arch}")
    if arch == "phi3":
        _set_phi3_parameters(writer, hparams, n_blocks, ftype, longrope[0] if longrope is not None else None)
    else:
        _set_gguf_parameters(writer, hparams, arch, n_blocks, ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _set_vocab_gpt2(writer, hf_dir, hparams)

    return _write_file(writer, out_path)


def _stacked_experts(experts: dict[str, torch.Tensor], name: str, hparams: dict,
                     tensor_map: gguf.TensorNameMap) -> list[tuple[str, torch.Tensor]]:
    """Qwen2MoeModel / OlmoeModel / LlamaModel.modify_tensors: once a layer's 3 x experts tensors have come, each
    matrix's experts stacked [experts, rows, cols] (down, gate, up; Mixtral's w1, w2, w3); before that, nothing."""
    n_experts = hparams.get("num_local_experts") or hparams["num_experts"]
    bid = int(name.split(".")[2])
    prefix = f"model.layers.{bid}."
    if sum(n.startswith(prefix) for n in experts) < n_experts * 3:
        return []
    mixtral = ".block_sparse_moe." in name
    out = []
    for w in ("w1", "w2", "w3") if mixtral else ("down_proj", "gate_proj", "up_proj"):
        module = "block_sparse_moe" if mixtral else "mlp"
        data = torch.stack([experts.pop(f"{prefix}{module}.experts.{x}.{w}.weight") for x in range(n_experts)])
        merged = f"layers.{bid}.feed_forward.experts.{w}.weight" if mixtral else f"{prefix}mlp.experts.{w}.weight"
        out.append((tensor_map.get_name(merged, try_suffixes=(".weight",)), data))
    return out


def _gpt_oss_tensors(name: str, t: torch.Tensor, tensor_map: gguf.TensorNameMap) -> list[tuple[str, torch.Tensor]]:
    """GptOssModel.modify_tensors on an unquantized checkpoint: sinks get a .weight; down_proj [experts, FFN, hidden]
    transposed to [experts, hidden, FFN]; gate_up_proj [experts, hidden, 2 x FFN] transposed and de-interleaved into
    gate (even rows) and up (odd rows), its bias likewise."""
    def mapped(n: str) -> str:
        return tensor_map.get_name(n, try_suffixes=(".weight", ".bias"))

    if name.endswith("self_attn.sinks"):
        name += ".weight"
    if name.endswith("experts.down_proj_bias"):
        name = name.replace("down_proj_bias", "down_proj.bias")
    elif name.endswith("experts.down_proj"):
        name, t = name.replace("down_proj", "down_proj.weight"), t.transpose(-1, -2)
    elif name.endswith("experts.gate_up_proj_bias"):
        return [(mapped(name.replace("gate_up_proj_bias", "gate_proj.bias")), t[..., 0::2].contiguous()),
                (mapped(name.replace("gate_up_proj_bias", "up_proj.bias")), t[..., 1::2].contiguous())]
    elif name.endswith("experts.gate_up_proj"):
        t = t.transpose(-1, -2)
        return [(mapped(name.replace("gate_up_proj", "gate_proj.weight")), t[:, 0::2, :].contiguous()),
                (mapped(name.replace("gate_up_proj", "up_proj.weight")), t[:, 1::2, :].contiguous())]
    return [(mapped(name), t.contiguous())]


def _check_gpt_oss_convertible(hparams: dict) -> None:
    """What GptOssModel does not write, llama.cpp takes as gpt-oss's release has it: the clamped SwiGLU's alpha 1.702
    and limit 7, YaRN's beta_fast 32 and beta_slow 1 and its ramp's ends rounded (truncate); a config that says
    otherwise would make a GGUF whose reference is another model."""
    rope = hparams["_rope"]
    if rope.get("rope_type") != "yarn":
        raise ValueError(f"gpt_oss: GptOssModel only converts yarn rope scaling, not {rope.get('rope_type')!r}")
    for key, want, got in (("swiglu_alpha", 1.702, hparams.get("swiglu_alpha", 1.702)),
                           ("swiglu_limit", 7.0, hparams.get("swiglu_limit", 7.0)),
                           ("beta_fast", 32.0, rope.get("beta_fast") or 32.0), ("beta_slow", 1.0, rope.get("beta_slow") or 1.0),
                           ("truncate", True, rope.get("truncate", True))):
        if got != want:
            raise ValueError(f"gpt_oss: llama.cpp takes {key} = {want}, the config has {got}")


def _set_gguf_parameters(writer: gguf.GGUFWriter, hparams: dict, arch: str, n_blocks: int,
                         ftype: gguf.LlamaFileType) -> None:
    """TextModel.set_gguf_parameters (+ LlamaModel's vocab_size and rope.dimension_count for llama)."""
    writer.add_block_count(n_blocks)
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    if hparams.get("num_key_value_heads") is not None:
        writer.add_head_count_kv(hparams["num_key_value_heads"])
    rope = hparams["_rope"]
    rope_type = rope.get("rope_type")
    if rope_type == "linear" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    # "default": nothing; "llama3": handled by the rope_freqs tensor, no rope.scaling.* keys.
    if rope.get("rope_theta") is not None and arch != "gemma2":  # Gemma2Model writes none: llama.cpp's 10000
        writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    if hparams.get("head_dim") is not None:  # qwen2's config has no head_dim, so no key/value_length
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
    writer.add_file_type(ftype)
    if arch in MOE_ARCHS:  # TextModel: expert_count, expert_used_count; Qwen2MoeModel: the experts' FFN sizes
        writer.add_expert_count(hparams.get("num_local_experts") or hparams["num_experts"])
        writer.add_expert_used_count(hparams["num_experts_per_tok"])
        if hparams.get("moe_intermediate_size") is not None:
            writer.add_expert_feed_forward_length(hparams["moe_intermediate_size"])
        if hparams.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(hparams["shared_expert_intermediate_size"])
    if arch == "gpt_oss":  # GptOssModel.set_gguf_parameters
        writer.add_sliding_window(hparams["sliding_window"])
        writer.add_expert_feed_forward_length(hparams["intermediate_size"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(hparams["_rope"]["factor"])
        writer.add_rope_scaling_orig_ctx_len(hparams["_rope"].get("original_max_position_embeddings", 4096))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(hparams["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
    if arch in GEMMA:
        writer.add_sliding_window(hparams["sliding_window"])
    if arch == "gemma3":  # Gemma3Model: the global layers' base (the windowed layers' is llama.cpp's constant)
        writer.add_rope_freq_base(hparams["_rope"]["full_attention"]["rope_theta"])
        if hparams.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
    if arch in LLAMA_LAYOUT:
        writer.add_vocab_size(hparams["vocab_size"])
        rope_dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
        writer.add_rope_dimension_count(rope_dim)


def _phi3_longrope(hparams: dict) -> tuple[float, list[tuple[str, torch.Tensor]]] | None:
    """Phi3MiniModel.generate_extra_tensors: the attention factor and rope_factors_long / _short, or None.

    The converter derives the attention factor from max / original context alone, where transformers takes the
    scaling's own factor or attention_factor first; where they would disagree, raise (see _llama3_rope_factors)."""
    rope = hparams["_rope"]
    if not rope.get("long_factor"):
        return None
    original = rope["original_max_position_embeddings"]
    scale = hparams["max_position_embeddings"] / original
    if rope.get("rope_type", "").lower() not in ("su", "longrope"):
        raise NotImplementedError(f"The rope scaling type {rope.get('rope_type')} is not supported yet")
    attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    if rope.get("factor") not in (None, scale) or rope.get("attention_factor") not in (None, attn_factor):
        raise ValueError("longrope: llama.cpp's converter derives the attention factor from max_position_embeddings /"
                         " original_max_position_embeddings only; leave out factor and attention_factor")
    long, short = rope["long_factor"], rope.get("short_factor")
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * hparams["hidden_size"]) // hparams["num_attention_heads"]
    if short is None or len(long) != len(short) or len(long) != rope_dims / 2:
        raise ValueError(f"The length of rope long and short factors must be {rope_dims / 2}")
    return attn_factor, [
        (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight", torch.tensor(long, dtype=torch.float32)),
        (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight", torch.tensor(short, dtype=torch.float32)),
    ]


def _set_phi3_parameters(writer: gguf.GGUFWriter, hparams: dict, n_blocks: int, ftype: gguf.LlamaFileType,
                         attn_factor: float | None) -> None:
    """Phi3MiniModel.set_gguf_parameters (no head_dim or vocab_size keys; 0 for no window), and the attention factor
    its generate_extra_tensors writes with the longrope factors."""
    rope = hparams["_rope"]
    n_embd, n_head = hparams["hidden_size"], hparams["num_attention_heads"]
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_block_count(n_blocks)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_file_type(ftype)
    writer.add_sliding_window(hparams.get("sliding_window") or 0)
    if attn_factor is not None:
        writer.add_rope_scaling_attn_factors(attn_factor)


def _set_vocab_gpt2(writer: gguf.GGUFWriter, hf_dir: Path, hparams: dict) -> None:
    """TextModel._set_vocab_gpt2 / get_vocab_base, with tokenizer.ggml.pre fixed to "gpt-2"."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = hparams.get("vocab_size", len(vocab))
    assert max(vocab.values()) < vocab_size
    reverse_vocab = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()  # id -> AddedToken
    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in reverse_vocab:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        token = reverse_vocab[i]
        if i in added:
            looks_special = token.startswith("<|") and token.endswith("|>")
            toktypes.append(gguf.TokenType.CONTROL if added[i].special or looks_special else gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    special_vocab = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens))
    special_vocab.add_to_gguf(writer, quiet=True)


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------

def gguf_to_hf_name(arch: str, gguf_name: str, n_blocks: int) -> str | None:
    """HF parameter name for a GGUF tensor name (None for tensors with no HF parameter, e.g. rope_freqs)."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) != 4 or not (0 <= int(parts[1]) < n_blocks):
        return None
    norms = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"} if arch in GEMMA else {"ffn_norm": "post_attention_layernorm"}
    per_block = {
        "attn_norm": "input_layernorm", **norms,
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.gate_up_proj" if arch == "phi3" else "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        # MoE: transformers holds each layer's experts fused, gate and up in one [experts, 2 x FFN, hidden]
        "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_up_proj",
        "ffn_up_exps": "mlp.experts.gate_up_proj", "ffn_down_exps": "mlp.experts.down_proj",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    }
    if arch == "gpt_oss":  # sinks a bare parameter; the router's own name; the experts' biases as ..._bias
        per_block |= {"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm",
                      "ffn_gate_inp": "mlp.router"}
        if parts[2] == "attn_sinks":
            return f"model.layers.{parts[1]}.self_attn.sinks"
        if parts[2].endswith("_exps") and parts[3] == "bias":
            return f"model.layers.{parts[1]}.{per_block[parts[2]]}_bias"
    if parts[2] not in per_block:
        return None
    if parts[2].endswith("_exps"):  # a bare nn.Parameter, no .weight
        return f"model.layers.{parts[1]}.{per_block[parts[2]]}"
    return f"model.layers.{parts[1]}.{per_block[parts[2]]}.{parts[3]}"


def gguf_tensor_as_hf(reader: gguf.GGUFReader, t, arch: str) -> torch.Tensor:
    """One GGUF tensor dequantized to fp32 in HF layout (llama q/k rows un-permuted)."""
    data = gguf.quants.dequantize(np.array(t.data), t.tensor_type)  # a copy: the reader's memmap is read-only
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGML ne order -> numpy order
    data = data.reshape(shape)
    kind = t.name.split(".")[-2]
    if arch in LLAMA_LAYOUT and kind in ("attn_q", "attn_k"):
        n_head = _field(reader, "llama.attention.head_count" if kind == "attn_q" else "llama.attention.head_count_kv")
        data = unpermute_qk(data, n_head)
    if arch in GEMMA and t.name.endswith("norm.weight"):
        data = data - 1  # the GGUF stores 1 + weight
    return torch.from_numpy(np.array(data, dtype=np.float32, order="C"))


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    if f is None:
        raise KeyError(f"GGUF has no metadata key {key!r}")
    return f.contents()


def reference_model(hf_dir: Path, gguf_path: Path | None = None) -> torch.nn.Module:
    """The transformers model from hf_dir in fp32 eval mode (eager attention). With gguf_path, every
    parameter stored in the GGUF is replaced by that tensor dequantized (and un-permuted for llama q/k),
    so the reference computes with exactly the weights churon reads from the file."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        Path(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if gguf_path is None:
        return model
    reader = gguf.GGUFReader(Path(gguf_path))
    arch = _arch(model.config.model_type)
    params = dict(model.named_parameters(remove_duplicate=False))
    seen = set()
    with torch.no_grad():
        for t in reader.tensors:
            hf_name = gguf_to_hf_name(arch, t.name, model.config.num_hidden_layers)
            if hf_name is None:
                continue
            if hf_name not in params:
                raise KeyError(f"{gguf_path}: tensor {t.name!r} maps to {hf_name!r}, which the model lacks")
            value = gguf_tensor_as_hf(reader, t, arch)
            p = params[hf_name]
            if arch == "gpt_oss" and "_exps." in t.name:  # gate/up interleaved in gate_up_proj's last dimension
                if t.name.endswith("_exps.weight"):
                    value = value.transpose(1, 2)  # [experts, cols, rows] as transformers multiplies x @ W
                if "ffn_gate_exps." in t.name or "ffn_up_exps." in t.name:
                    p = p[..., 0::2] if "ffn_gate_exps." in t.name else p[..., 1::2]
            elif t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):  # its half of gate_up_proj's rows
                half = p.shape[1] // 2
                p = p[:, :half] if ".ffn_gate_exps." in t.name else p[:, half:]
            if tuple(p.shape) != tuple(value.shape):
                raise ValueError(f"{gguf_path}: {t.name} has shape {tuple(value.shape)}, model wants {tuple(p.shape)}")
            p.copy_(value)
            seen.add(hf_name)
    missing = [n for n in params if n not in seen and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"{gguf_path}: no GGUF tensor for {missing}")
    return model


# --------------------------------------------------------------------------------------------------
# BERT (an encoder as a sentence-transformers directory, and its GGUF)
# --------------------------------------------------------------------------------------------------

BERT_MAX_POSITIONS = 128
BERT_TYPE_VOCAB = 2
BERT_LN_EPS = 1e-12
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4, as in bert-base's order of kinds
# An uncased WordPiece vocabulary that covers whole words, ##-continuations, single letters (so every
# lower-case word tokenizes without [UNK]), digits, punctuation and a few CJK characters (each one is
# its own word after BertNormalizer's handle_chinese_chars).
BERT_WORDS = (
    "the", "an", "is", "it", "was", "in", "on", "of", "to", "and", "or", "not", "for", "with", "by",
    "quick", "brown", "fox", "jump", "over", "lazy", "dog", "cat", "sat", "mat", "hello", "world",
    "sea", "ship", "red", "sail", "town", "fish", "morning", "evening", "story", "child", "father",
    "cafe", "naive", "resume", "un", "believ", "token", "model", "text", "embed", "search", "query",
)
BERT_PIECES = ("##believ", "##ing", "##ed", "##er", "##ly", "##able", "##ion", "##ation", "##ment", "##est", "##ness")
BERT_CJK = ("中", "文", "日", "本", "語", "你", "好", "世", "界")
BERT_PUNCT = tuple(".,!?;:'\"()[]{}-_/\\&%$#@*+=<>~`^|")
BERT_POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}


def bert_vocab() -> list[str]:
    """The tiny BERT's vocabulary, id order (no duplicates)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    digits = [str(d) for d in range(10)]
    vocab = [*BERT_SPECIAL_TOKENS, *BERT_PUNCT, *digits, *letters, *BERT_WORDS,
             *(f"##{c}" for c in letters + digits), *BERT_PIECES, *BERT_CJK]
    assert len(vocab) == len(set(vocab))
    return vocab


def make_bert_tokenizer_files(out_dir: Path, max_positions: int = BERT_MAX_POSITIONS) -> None:
    """tokenizer.json (WordPiece, BertNormalizer, BertPreTokenizer, [CLS] $A [SEP]), vocab.txt,
    tokenizer_config.json and special_tokens_map.json, laid out as bert-base-uncased ships them."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = bert_vocab()
    ids = {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.WordPiece(ids, unk_token="[UNK]", continuing_subword_prefix="##",
                                     max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens(list(BERT_SPECIAL_TOKENS))
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "vocab.txt").write_text("".join(t + "\n" for t in vocab), encoding="utf-8")
    specials = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                "mask_token": "[MASK]"}
    _write_json(out_dir / "special_tokens_map.json", specials)
    _write_json(out_dir / "tokenizer_config.json", {
        **specials, "do_lower_case": True, "do_basic_tokenize": True, "never_split": None,
        "tokenize_chinese_chars": True, "strip_accents": None, "clean_up_tokenization_spaces": True,
        "model_max_length": max_positions, "tokenizer_class": "BertTokenizer",
    })


def make_bert_model(
    out_dir: Path,
    *,
    seed: int = 0,
    normalize: bool = True,
    pooling: str = "mean",
    max_seq_length: int | None = 64,
    max_positions: int = BERT_MAX_POSITIONS,
    type_vocab_size: int = BERT_TYPE_VOCAB,
    hidden_act: str = "gelu",
) -> Path:
    """A tiny random fp32 BERT (hidden 64, 2 layers, 4 heads, intermediate 128) saved as a complete
    sentence-transformers directory: config.json + model.safetensors (BertModel, weights without a
    "bert." prefix, as all-MiniLM-L6-v2 ships them), the WordPiece tokenizer files, modules.json
    (Transformer, Pooling, and Normalize when normalize), 1_Pooling/config.json in the classic
    pooling_mode_* layout (pooling "mean" | "cls" | "last") and sentence_bert_config.json
    (max_seq_length; None leaves it out). Loads in sentence_transformers.SentenceTransformer(out_dir)
    and transformers.AutoModel. Returns out_dir."""
    import transformers

    if pooling not in BERT_POOLING_KEYS:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {tuple(BERT_POOLING_KEYS)}")
    out_dir = Path(out_dir)
    make_bert_tokenizer_files(out_dir, max_positions)
    transformers.utils.logging.disable_progress_bar()
    config = transformers.BertConfig(
        vocab_size=len(bert_vocab()),
        hidden_size=HIDDEN,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        intermediate_size=INTERMEDIATE,
        hidden_act=hidden_act,
        max_position_embeddings=max_positions,
        type_vocab_size=type_vocab_size,
        layer_norm_eps=BERT_LN_EPS,
        pad_token_id=0,
        position_embedding_type="absolute",
    )
    config.architectures = ["BertModel"]
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = transformers.BertModel(config, add_pooling_layer=True).to(torch.float32)
    _randomize(model, seed)
    model.eval().save_pretrained(out_dir, safe_serialization=True)

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:  # the Normalize module has no files; all-MiniLM-L6-v2 ships no 2_Normalize folder either
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2) + "\n", encoding="utf-8")
    pooling_config = {"word_embedding_dimension": HIDDEN, **{key: mode == pooling for mode, key in BERT_POOLING_KEYS.items()},
                      "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
                      "pooling_mode_weightedmean_tokens": False, "include_prompt": True}
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    _write_json(out_dir / "1_Pooling" / "config.json", pooling_config)
    sbert = {"do_lower_case": False}
    if max_seq_length is not None:
        sbert["max_seq_length"] = max_seq_length
    _write_json(out_dir / "sentence_bert_config.json", sbert)
    return out_dir


def _bert_hf_tensor_name(name: str) -> str | None:
    """BertModel.filter_tensors: drop the "bert." prefix, gamma/beta -> weight/bias, skip the pooler,
    position_ids and the masked-LM / next-sentence heads (None)."""
    name = name.removeprefix("bert.")
    if name.endswith(".gamma"):
        name = name[: -len(".gamma")] + ".weight"
    if name.endswith(".beta"):
        name = name[: -len(".beta")] + ".bias"
    if name in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"):
        return None
    if name.startswith(("cls.predictions", "cls.seq_relationship")):
        return None
    return name


def write_bert_gguf(hf_dir: Path, out_path: Path, qtype: str = "F32") -> Path:
    """Convert a BERT sentence-transformers directory to GGUF like convert_hf_to_gguf.py's BertModel
    (TextModel.set_gguf_parameters + causal_attention false + _try_set_pooling_type, set_vocab's phantom-
    space WordPiece vocabulary and token_type_count, gguf.SpecialVocab, prepare_tensors' types: 1-D
    tensors, norms, position_embd and token_types F32, the rest qtype with the F16 fallback).
    tokenizer.ggml.pre is "default": the converter hashes the tokenizer's output on a fixed text and a
    random tiny vocabulary matches no known hash (llama.cpp ignores pre for WordPiece). Returns out_path."""
    import transformers

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; expected one of {tuple(QTYPES)}")
    data_qtype, ftype = QTYPES[qtype]
    hparams = transformers.AutoConfig.from_pretrained(hf_dir).to_dict()
    if hparams["model_type"] != "bert":
        raise ValueError(f"{hf_dir}/config.json: model_type {hparams['model_type']!r} is not 'bert'")
    n_blocks = hparams["num_hidden_layers"]
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, n_blocks)
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])

    always_f32 = (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.POS_EMBD] + ".weight",
                  gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_TYPES] + ".weight")
    for hf_name, t in _read_safetensors(hf_dir):
        name = _bert_hf_tensor_name(hf_name)
        if name is None:
            continue
        new_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"{hf_dir}: cannot map tensor {hf_name!r} to a GGUF name")
        data = t.to(torch.float32).numpy() if t.dtype not in (torch.float16, torch.float32) else t.numpy()
        q = data_qtype
        if data.ndim <= 1 or new_name.endswith("_norm.weight") or new_name in always_f32:
            q = gguf.GGMLQuantizationType.F32
        try:
            qdata = gguf.quants.quantize(data, q)
        except gguf.QuantError:  # llama.cpp: "falling back to F16"
            q = gguf.GGMLQuantizationType.F16
            qdata = gguf.quants.quantize(data, q)
        writer.add_tensor(new_name, qdata, raw_dtype=q)

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("tiny-bert")
    writer.add_block_count(n_blocks)
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_layer_norm_eps(hparams["layer_norm_eps"])
    writer.add_file_type(ftype)
    writer.add_causal_attention(False)
    if (pooling := _st_pooling_type(hf_dir)) is not None:
        writer.add_pooling_type(pooling)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _set_vocab_bert(writer, hf_dir, hparams)

    return _write_file(writer, out_path)


def _st_pooling_type(hf_dir: Path) -> gguf.PoolingType | None:
    """TextModel._try_set_pooling_type: the first sentence_transformers.models.Pooling module's config."""
    modules_file = hf_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    path = next((m["path"] for m in modules if m["type"] == "sentence_transformers.models.Pooling"), None)
    if path is None:
        return None
    pooling = json.loads((hf_dir / path / "config.json").read_text(encoding="utf-8"))
    if pooling["pooling_mode_mean_tokens"]:
        return gguf.PoolingType.MEAN
    if pooling["pooling_mode_cls_token"]:
        return gguf.PoolingType.CLS
    if pooling["pooling_mode_lasttoken"]:
        return gguf.PoolingType.LAST
    raise NotImplementedError("Only MEAN, CLS, and LAST pooling types supported")


def _set_vocab_bert(writer: gguf.GGUFWriter, hf_dir: Path, hparams: dict) -> None:
    """BertModel.set_vocab over TextModel.get_vocab_base (AutoTokenizer's vocabulary, added special
    tokens CONTROL), with tokenizer.ggml.pre "default" (see write_bert_gguf)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    vocab_size = hparams.get("vocab_size", len(tokenizer.vocab))
    assert max(tokenizer.vocab.values()) < vocab_size
    reverse_vocab = {i: t for t, i in tokenizer.vocab.items()}
    added_vocab = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in reverse_vocab:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        token = reverse_vocab[i]
        if token in added_vocab:
            toktypes.append(gguf.TokenType.CONTROL if added_decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_token_type_count(hparams.get("type_vocab_size", 1))

    def phantom(tok: str, toktype: int) -> str:  # "##x" continues a word; any other piece starts one
        if toktype == gguf.TokenType.CONTROL:
            return tok
        return tok[2:] if tok.startswith("##") else "\u2581" + tok

    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([phantom(t, k) for t, k in zip(tokens, toktypes)])
    writer.add_token_types(toktypes)
    gguf.SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _write_file(writer: gguf.GGUFWriter, out_path: Path) -> Path:
    """Header, key/values and tensors, in GGUFWriter's order."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(path=out_path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


# --------------------------------------------------------------------------------------------------
# LoRA adapters (PEFT is the reference for them)
# --------------------------------------------------------------------------------------------------

LORA_ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(hf_dir: Path, out_dir: Path, *, rank: int = 4, alpha: float = 8.0,
                      targets: tuple[str, ...] = LORA_ALL_TARGETS, use_rslora: bool = False, seed: int = 0,
                      std: float = 0.1, rank_pattern: dict | None = None, alpha_pattern: dict | None = None) -> Path:
    """A random LoRA adapter for the model in hf_dir, saved by PEFT's save_pretrained (adapter_config.json +
    adapter_model.safetensors). A and B ~ N(0, std), seeded: PEFT's own init leaves B zero, which would make
    every adapter a no-op. Returns out_dir."""
    import peft

    model = reference_model(hf_dir)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                             lora_dropout=0.0, bias="none", rank_pattern=rank_pattern or {},
                             alpha_pattern=alpha_pattern or {})
    model = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(Path(out_dir))
    return Path(out_dir)


def peft_model(hf_dir: Path, adapter_dir: Path, gguf_path: Path | None = None) -> torch.nn.Module:
    """reference_model(hf_dir, gguf_path) with the PEFT adapter in adapter_dir attached (unmerged), fp32 eval."""
    import peft

    return peft.PeftModel.from_pretrained(reference_model(hf_dir, gguf_path), Path(adapter_dir)).eval()
