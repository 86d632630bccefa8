"""gpt-oss specifics beyond the decoder families' shared tests (test_model_reference.py, test_native_model.py and
test_moe.py run the tiny gpt-oss too): YaRN against transformers' own inverse frequencies, truncate false from a
directory, the clamped SwiGLU at a limit that clamps most of gate and up, an MXFP4 GGUF against transformers, what
`churon inspect` says, files that lie (no sinks, a bad YaRN factor, expert counts), and the harmony chat format
through churon's chat-template code with harmony's special tokens."""

import datetime
import json
import math
import re

import gguf
import numpy as np
import pytest
import torch

from churon import kernels
from churon.cli import main
from churon.config import ModelConfig, check_rope_scaling
from churon.engine.kv_cache import SequenceKVCache
from churon.errors import ModelFileError
from churon.loader import load_model, open_model
from churon.model.rope import rope_inv_freq, rope_tables
from churon.tokenizer import load_tokenizer
from test_bad_input import assert_edited_gguf_is_a_model_file_error
from test_model_reference import compare_prefill_and_decode
from tiny_models import GPT_OSS_YARN, N_EXPERTS, make_hf_model, reference_model, write_gguf

T = gguf.GGUFValueType


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny gpt-oss (tiny_models) and its MXFP4 GGUF."""
    d = tmp_path_factory.mktemp("gpt_oss")
    hf = make_hf_model("gpt_oss", d / "hf")
    return hf, write_gguf(hf, d / "m-MXFP4.gguf", "MXFP4")


def _edit_config(hf, **changes):
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


# --- YaRN ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("head_dim, theta, factor, original, betas", [
    (16, 1e4, 4.0, 64, (32.0, 1.0)),
    (64, 150000.0, 32.0, 4096, (32.0, 1.0)),  # gpt-oss's release
    (64, 5e5, 8.0, 8192, (16.0, 2.0)),
])
def test_yarn_frequencies_and_attention_factor_are_transformers(head_dim, theta, factor, original, betas, truncate):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": betas[0], "beta_slow": betas[1], "truncate": truncate}
    hf_config = transformers.GptOssConfig(head_dim=head_dim, hidden_size=64, num_attention_heads=4,
                                          max_position_embeddings=131072, rope_parameters=dict(rope))
    want, want_attention = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    scaling = check_rope_scaling(rope, "rope_parameters", "test", head_dim=head_dim, context_length=131072)
    config = ModelConfig("gpt-oss", 400, 64, 32, 2, 4, 2, head_dim, 256, 1e-5, theta, rope_scaling=scaling)
    assert torch.equal(rope_inv_freq(config), want)
    assert scaling["attention_factor"] == pytest.approx(want_attention, rel=1e-12)
    cos, _ = rope_tables(config)
    assert cos[0, 0].item() == pytest.approx(want_attention, rel=1e-6)  # cos and sin times the attention factor


def test_yarn_not_truncated_from_a_directory(tmp_path):
    """gpt-oss's release says truncate false (the ramp's ends kept as computed); llama.cpp always rounds them, so only a
    directory can say it (the converter refuses, see tiny_models)."""
    hf = make_hf_model("gpt_oss", tmp_path / "hf", rope_scaling={**GPT_OSS_YARN, "truncate": False})
    transformer, _, _ = load_model(hf, kernels="reference")
    assert transformer.config.rope_scaling["truncate"] is False
    compare_prefill_and_decode(hf, reference_model(hf))
    with pytest.raises(ValueError, match="truncate"):
        write_gguf(hf, tmp_path / "m.gguf")


# --- the clamped SwiGLU, MXFP4 -------------------------------------------------------------------

def test_a_limit_that_clamps_most_of_gate_and_up(tmp_path):
    """swiglu_limit 0.5 from a directory (a GGUF cannot say it: llama.cpp's is 7): against transformers, and on the
    native kernels near the reference path."""
    hf = _edit_config(make_hf_model("gpt_oss", tmp_path / "hf"), swiglu_limit=0.5)
    compare_prefill_and_decode(hf, reference_model(hf))
    if kernels.native_available():
        native, _, _ = load_model(hf, kernels="native")
        reference, _, _ = load_model(hf, kernels="reference")
        assert native.config.swiglu_limit == 0.5
        tokens = torch.tensor([5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 8])
        want = reference(tokens, 0, SequenceKVCache.for_model(reference, 16), all_logits=True)
        got = native(tokens, 0, SequenceKVCache(native.config, 16, dtype=torch.float32), all_logits=True)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_mxfp4_gguf_matches_transformers_on_the_stored_weights(tiny):
    hf, path = tiny
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.0.ffn_gate_exps.bias"] == gguf.GGMLQuantizationType.F32
    compare_prefill_and_decode(path, reference_model(hf, path))


def test_inspect_shows_the_family(tiny, capsys):
    hf, path = tiny
    for source in (hf, path):
        assert main(["inspect", str(source)]) == 0
        out = capsys.readouterr().out
        assert "architecture       gpt-oss" in out
        assert ("RoPE               theta 10000, YaRN factor 4 over 64 original positions (beta_fast 32, beta_slow 1,"
                f" truncated, cos and sin x {0.1 * math.log(4) + 1:.4g})") in out
        assert "attention sinks    a learned logit per head" in out
        assert "MLP                clamped SwiGLU with biases: (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)" in out
        assert "router             softmax over the top-k logits, with a bias" in out
        assert "sliding window     1 of 2 layers see the last 8 positions" in out
    assert "MXFP4    Q8_0 repacked" in out or not kernels.native_available()


# --- files that lie ------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, match", [
    ({"drop": ("blk.1.attn_sinks.weight",)}, r"tensor 'blk\.1\.attn_sinks\.weight' is missing"),
    ({"fields": {"gpt-oss.rope.scaling.factor": (0.0, T.FLOAT32)}},
     r"gpt-oss\.rope\.scaling\.factor = 0\.0 must be a finite number greater than 0"),
    ({"fields": {"gpt-oss.rope.scaling.factor": (-4.0, T.FLOAT32)}}, r"gpt-oss\.rope\.scaling\.factor = -4\.0 must be"),
    ({"fields": {"gpt-oss.rope.scaling.factor": (float("nan"), T.FLOAT32)}}, r"gpt-oss\.rope\.scaling\.factor = nan must"),
    ({"fields": {"gpt-oss.rope.scaling.factor": (float("inf"), T.FLOAT32)}}, r"gpt-oss\.rope\.scaling\.factor = inf must"),
    ({"drop_fields": ("gpt-oss.rope.scaling.original_context_length",)},
     r"field 'gpt-oss\.rope\.scaling\.original_context_length' is missing"),
    ({"fields": {"gpt-oss.expert_count": (4, T.UINT32)}},
     r"tensor 'blk\.0\.ffn_gate_inp\.weight' holds 8 experts \(shape \[8, 64\]\), but gpt-oss\.expert_count = 4"),
    ({"replace": {"blk.1.ffn_down_exps.bias": (np.zeros((N_EXPERTS - 1, 64), np.float32), None)}},
     r"tensor 'blk\.1\.ffn_down_exps\.bias' holds 7 experts \(shape \[7, 64\]\), but gpt-oss\.expert_count = 8"),
    ({"drop_fields": ("gpt-oss.attention.sliding_window",)}, r"field 'gpt-oss\.attention\.sliding_window' is missing"),
], ids=["no-sinks", "factor-0", "factor-negative", "factor-nan", "factor-inf", "no-original-context",
        "expert-count-4", "down-bias-of-7", "no-window"])
def test_lying_gpt_oss_gguf_is_a_model_file_error(tiny, tmp_path, edit, match):
    assert_edited_gguf_is_a_model_file_error(tiny[1], tmp_path, edit, match)


@pytest.mark.parametrize("rope, match", [
    ({"factor": 0.0}, r"rope_parameters: factor = 0\.0 must be a finite number greater than 0"),
    ({"factor": float("nan")}, r"rope_parameters: factor = nan must be a finite number"),
    ({"truncate": "no"}, r"rope_parameters: truncate = 'no' is not a boolean"),
    ({"beta_fast": -1}, r"rope_parameters: beta_fast = -1 must be a finite number greater than 0"),
], ids=["factor-0", "factor-nan", "truncate-string", "beta-negative"])
def test_lying_gpt_oss_config_is_a_model_file_error(tiny, tmp_path, rope, match):
    import shutil

    hf = shutil.copytree(tiny[0], tmp_path / "bad")
    cfg = json.loads((hf / "config.json").read_text())
    _edit_config(hf, rope_parameters={**cfg["rope_parameters"], **rope})
    with pytest.raises(ModelFileError, match=re.escape(str(hf / "config.json")) + ": " + match):
        load_model(hf)


def test_fused_experts_of_another_shape_are_named(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    hf = shutil.copytree(tiny[0], tmp_path / "bad")
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = tensors["model.layers.0.mlp.experts.gate_up_proj"][..., :-1].contiguous()
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \[8, 64, 63\]"):
        load_model(hf)


# --- harmony -------------------------------------------------------------------------------------

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>")

# harmony as gpt-oss's own template writes it (abridged: the system and developer turns, channels, tool calls to
# functions.*, tool results, the analysis channel kept only after the last final answer), with the template features
# it relies on: strftime_now, raise_exception, namespace, loop controls, tojson, `is defined`, a macro
HARMONY_TEMPLATE = """{#- harmony, after gpt-oss's chat_template.jinja -#}
{%- macro render_tool(tool) -%}
{{- "// " + tool.description + "\\ntype " + tool.name + " = (_: " + (tool.parameters | tojson) + ") => any;\\n" }}
{%- endmacro -%}
{%- if not reasoning_effort is defined %}{%- set reasoning_effort = "medium" %}{%- endif %}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n" }}
{{- "Knowledge cutoff: 2024-06\\nCurrent date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
{{- "Reasoning: " + reasoning_effort + "\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools %}{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- "<|end|>" }}
{%- if messages[0].role in ("developer", "system") %}
{%- set developer_message = messages[0].content %}{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set developer_message = "" %}{%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message or tools %}
{{- "<|start|>developer<|message|>" }}
{%- if developer_message %}{{- "# Instructions\\n\\n" + developer_message }}{%- endif %}
{%- if tools %}
{{- "\\n\\n# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n" }}
{%- for tool in tools %}{%- set tool = tool.function if tool.function is defined else tool %}{{- render_tool(tool) }}{%- endfor %}
{{- "\\n} // namespace functions" }}
{%- endif %}
{{- "<|end|>" }}
{%- endif %}
{%- set last_tool_call = namespace(name=none) %}
{%- set ns = namespace(last_final=-1) %}
{%- for message in loop_messages %}
{%- if message.role == "assistant" and not message.tool_calls %}{%- set ns.last_final = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in loop_messages %}
{%- if message.role in ("system", "developer") %}
{{- raise_exception("a " + message.role + " message is only allowed first") }}
{%- elif message.role == "user" %}
{%- if not message.content %}{% continue %}{%- endif %}
{{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
{%- elif message.role == "assistant" %}
{%- if message.thinking is defined and message.thinking and loop.index0 > ns.last_final %}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
{%- endif %}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{%- set call = call.function if call.function is defined else call %}
{{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary <|constrain|>json<|message|>" }}
{{- call.arguments | tojson + "<|call|>" }}
{%- set last_tool_call.name = call.name %}
{%- break %}
{%- endfor %}
{%- else %}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + ("<|return|>" if loop.last and not add_generation_prompt else "<|end|>") }}
{%- endif %}
{%- elif message.role == "tool" %}
{%- if last_tool_call.name is none %}
{{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
{%- endif %}
{{- "<|start|>functions." + last_tool_call.name + " to=assistant<|channel|>commentary<|message|>" + message.content | tojson + "<|end|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start|>assistant" }}{%- endif %}"""


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """The tiny gpt-oss with harmony's special tokens in its vocabulary (in the padding rows of its embedding), the
    harmony template, <|return|> its EOS; its directory and its GGUF (which carries the template and the tokens)."""
    from tokenizers import AddedToken, Tokenizer

    d = tmp_path_factory.mktemp("harmony")
    hf = make_hf_model("gpt_oss", d / "hf", extra_vocab=len(HARMONY_TOKENS), chat_template=HARMONY_TEMPLATE)
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    tok.save(str(hf / "tokenizer.json"))
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    ids = {t: tok.token_to_id(t) for t in HARMONY_TOKENS}
    cfg["added_tokens_decoder"] |= {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                             "single_word": False, "special": True} for t, i in ids.items()}
    cfg["eos_token"] = "<|return|>"
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    gen = json.loads((hf / "generation_config.json").read_text())
    gen["eos_token_id"] = [ids["<|return|>"], ids["<|call|>"]]  # as gpt-oss's: <|return|>, <|endoftext|>, <|call|>
    (hf / "generation_config.json").write_text(json.dumps(gen))
    return hf, write_gguf(hf, d / "m.gguf", "F32"), ids


CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "thinking": "Need the tool.",
     "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"},
    {"role": "user", "content": ""},
    {"role": "assistant", "thinking": "It is sunny.", "content": "Sunny"},
    {"role": "user", "content": "Thanks!"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _expected_rendering() -> str:
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer in one word.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// The weather in a city.\ntype get_weather = (_: "
        '{"type": "object", "properties": {"city": {"type": "string"}}}) => any;\n\n} // namespace functions<|end|>'
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant<|channel|>final<|message|>Sunny<|end|>"
        "<|start|>user<|message|>Thanks!<|end|><|start|>assistant"
    )


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_harmony_renders_through_churon_s_template_and_tokens(harmony, source):
    hf, path, ids = harmony
    tokenizer = load_tokenizer(open_model(hf if source == "hf" else path))
    assert tokenizer.chat_template == HARMONY_TEMPLATE
    before = _expected_rendering()
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, reasoning_effort="high")
    assert text in (before, _expected_rendering())  # the date may turn over while it renders
    encoded = tokenizer.encode(text, add_bos=False)
    for token, i in ids.items():  # each special token one id, as many times as the text has it
        assert tokenizer.token_to_id(token) == i
        assert encoded.count(i) == text.count(token), token
    assert tokenizer.decode(encoded, skip_special_tokens=False) == text
    # harmony's ends of generation: <|return|> and <|call|>, not <|end|> (which ends the analysis channel's message)
    assert {ids["<|return|>"], ids["<|call|>"]} <= tokenizer.eog_ids
    assert ids["<|end|>"] not in tokenizer.eog_ids
    with pytest.raises(Exception, match="no previous assistant message with a tool call"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(Exception, match="a system message is only allowed first"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_harmony_chat_generates(harmony):
    """LLM.chat on the harmony model: its template renders at load and under a chat turn, and generation runs."""
    from churon import LLM, SamplingParams

    llm = LLM(str(harmony[1]), kernels="reference")
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4))
    assert out.finish_reason in ("stop", "length")


def test_quantize_keeps_the_biases_f32(tiny, tmp_path):
    """`churon quantize` of the MXFP4 gpt-oss: its experts' 2-D biases stay F32 (llama.cpp quantizes only *weight
    tensors), the matrices take the type, and the file loads and runs."""
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(tiny[1]), str(out), "--type", "Q8_0"]) == 0
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.ffn_down_exps.bias"] == types["blk.1.ffn_gate_exps.bias"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    transformer, _, _ = load_model(out, kernels="reference")
    logits = transformer(torch.tensor([5, 17, 42]), 0, SequenceKVCache.for_model(transformer, 8))
    assert torch.isfinite(logits).all()


# --- the release's MXFP4 checkpoint layout -------------------------------------------------------

def _openai_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [experts, rows, cols] as gpt-oss's checkpoint stores an MXFP4 matrix: _blocks [experts, rows, cols / 32, 16]
    (element 2j in byte j's low nibble, 2j + 1 in its high one) and _scales [experts, rows, cols / 32] (E8M0), the
    blocks' values chosen by gguf's MXFP4 quantizer (ggml's layout: byte j holds elements j and j + 16)."""
    e, rows, cols = w.shape
    q = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4)).reshape(e, rows, cols // 32, 17)
    qs = q[..., 1:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # element order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), q[..., 0].contiguous()


@pytest.fixture(scope="module")
def release_layout(tiny, tmp_path_factory):
    """The tiny gpt-oss saved as the release is: its experts' gate_up_proj and down_proj as MXFP4 _blocks / _scales
    (rows the outputs: gate_up's transposed), quantization_config mxfp4 in config.json."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf = shutil.copytree(tiny[0], tmp_path_factory.mktemp("release") / "hf")
    tensors = load_file(hf / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = _openai_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    _edit_config(hf, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                             "model.layers.*.mlp.router",
                                                                                             "model.embed_tokens", "lm_head"]})
    return hf


def test_the_release_s_mxfp4_checkpoint_layout_matches_transformers_dequantization(tiny, release_layout):
    """Experts read from _blocks / _scales (kept MXFP4, not widened to float32) give transformers' logits with the
    weights its own MXFP4 integration dequantizes them to (convert_moe_packed_tensors)."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(release_layout / "model.safetensors")
    reference = reference_model(tiny[0])
    with torch.no_grad():
        for i, layer in enumerate(reference.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                prefix = f"model.layers.{i}.mlp.experts.{proj}"
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(
                    tensors[prefix + "_blocks"], tensors[prefix + "_scales"], dtype=torch.float32))
    transformer, _, _ = load_model(release_layout, kernels="reference")
    assert all(w.dtype == torch.float32 for w in transformer.layers[0].experts.down)
    raw = open_model(release_layout).load_weights()["layers.0.mlp.experts.up_proj.weight"]
    assert raw.qtype == gguf.GGMLQuantizationType.MXFP4 and raw.shape == (N_EXPERTS, 32, 64)
    compare_prefill_and_decode(release_layout, reference)
    if kernels.native_available():  # the native path reads them as Q8_0 blocks of the same values
        native, _, _ = load_model(release_layout, kernels="native")
        assert native.layers[0].experts.gate_up[0].qtype == int(gguf.GGMLQuantizationType.Q8_0)


def test_mxfp4_blocks_without_their_scales_are_named(release_layout, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    hf = shutil.copytree(release_layout, tmp_path / "bad")
    tensors = load_file(hf / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=r"tensor 'model\.layers\.1\.mlp\.experts\.down_proj_scales' is missing"):
        load_model(hf)
