"""Ollama's Modelfiles (churon.modelfile), its options (churon.ollama_options) with the sampler's repeat_last_n, and
its Go-template TEMPLATEs translated to Jinja (churon.tokenizer.go_template), against Ollama's own renderings."""

import pytest
import torch

from churon.modelfile import Modelfile, ModelfileError, chat_template, parse_modelfile
from churon.ollama_options import UP_TO_THE_CONTEXT, check_options, format_parameters, sampling_kwargs
from churon.sampling import Sampler, SamplingParams
from churon.tokenizer.chat_template import CHATML_TEMPLATE, ChatTemplate
from churon.tokenizer.go_template import GoTemplateError, to_jinja

# --- the Modelfile's syntax --------------------------------------------------------------------------------------

MODELFILE = '''# a pirate
from ./tiny.gguf
  # an indented comment
SYSTEM """You are a pirate.
Answer in one line."""
parameter temperature 0.2
PARAMETER top_k "40"
PARAMETER stop <|im_end|>
PARAMETER stop "Human: "
Template """{{ if .System }}SYS {{ .System }}
{{ end }}USER {{ .Prompt }}
BOT {{ .Response }}"""
MESSAGE user Who are you? # not a comment: a value runs to its line's end
message assistant "Captain Flint,
at your service."
LICENSE MIT
LICENSE """Apache
2.0"""
'''


def test_a_modelfile_is_read_as_ollama_reads_it():
    m = parse_modelfile(MODELFILE)
    assert m.from_ == "./tiny.gguf" and m.from_line == 2
    assert m.system == "You are a pirate.\nAnswer in one line."
    assert m.parameters == {"temperature": 0.2, "top_k": 40, "stop": ["<|im_end|>", "Human: "]}  # typed; stop adds up
    assert isinstance(m.parameters["top_k"], int)
    assert m.template == "{{ if .System }}SYS {{ .System }}\n{{ end }}USER {{ .Prompt }}\nBOT {{ .Response }}"
    assert m.messages == [{"role": "user", "content": "Who are you? # not a comment: a value runs to its line's end"},
                          {"role": "assistant", "content": "Captain Flint,\nat your service."}]
    assert m.license == "MIT\n\nApache\n2.0"


def test_the_canonical_text_reads_back_as_the_same_recipe():
    m = parse_modelfile(MODELFILE)
    text = m.text()
    assert text.startswith("FROM ./tiny.gguf\n")
    assert 'PARAMETER stop "Human: "\n' in text and "PARAMETER stop <|im_end|>\n" in text  # quoted where it must be
    assert parse_modelfile(text) == m
    assert parse_modelfile(parse_modelfile("FROM a\nSYSTEM \"\"\"\n\"\"\"\n").text()).system == "\n"


def test_a_recipe_inherits_what_it_leaves_out():
    parent = Modelfile("base", system="S", parameters={"temperature": 0.5, "top_k": 3}, template="T",
                       messages=[{"role": "user", "content": "m"}], license="L")
    child = Modelfile("parent", system="S2", parameters={"top_k": 7})
    assert child.inherit(parent) == Modelfile("parent", system="S2", parameters={"temperature": 0.5, "top_k": 7},
                                              template="T", messages=[{"role": "user", "content": "m"}], license="L")


@pytest.mark.parametrize("text, message", [
    ("FROM a\nFOO bar\n", "line 2: unknown instruction 'FOO'"),
    ("FROM a\n\nPARAMETR temperature 1\n", "line 3: unknown instruction 'PARAMETR'"),
    ("SYSTEM hi\n", "no FROM line"),
    ("FROM a\nSYSTEM x\nFROM b\n", "line 3: a second FROM (the first is on line 1)"),
    ("FROM a\nPARAMETER temperature hot\n", "line 2 (PARAMETER): temperature='hot': must be a number"),
    ("FROM a\nPARAMETER top_k 1.5\n", "line 2 (PARAMETER): top_k='1.5': must be an integer"),
    ("FROM a\nPARAMETER top_p 2\n", "line 2 (PARAMETER): top_p='2': must be in (0, 1]"),
    ("FROM a\nPARAMETER colour blue\n", "line 2 (PARAMETER): unknown option 'colour'"),
    ("FROM a\nPARAMETER mirostat 1\n", "line 2 (PARAMETER): mirostat is an Ollama option churon does not implement"),
    ("FROM a\nPARAMETER temperature\n", "line 2 (PARAMETER temperature): a value is missing"),
    ("FROM a\nMESSAGE bot hello\n", "line 2 (MESSAGE): role 'bot': must be one of system, user, assistant"),
    ("FROM a\nADAPTER ./a.gguf\nADAPTER ./b.gguf\n", "line 3: a second ADAPTER (the first is on line 2); a model takes one"
     " LoRA adapter"),
    ("FROM a\nADAPTER\n", "line 2 (ADAPTER): a value is missing"),
    ("FROM a\nSYSTEM\n", "line 2 (SYSTEM): a value is missing"),
    ('FROM a\nSYSTEM """never\nclosed\n', 'line 2 (SYSTEM): the value\'s opening """ is never closed'),
    ('FROM a\nSYSTEM """x""" y\n', 'line 2 (SYSTEM): text after the value\'s closing """'),
    ("FROM a\nREQUIRES 0.5\n", "line 2: REQUIRES is an Ollama instruction churon does not support"),
    ('FROM a\nTEMPLATE """\n{{ .Prompt }}\n{{ .Tools }}\n"""\n', "line 4 (TEMPLATE): {{ .Tools }}: .Tools is not supported"),
    ("FROM a\nTEMPLATE {% if %}\n", "line 2 (TEMPLATE): a Jinja template"),
])
def test_bad_modelfiles_name_the_line_and_the_instruction(text, message):
    with pytest.raises(ModelfileError) as e:
        parse_modelfile(text)
    assert message in str(e.value)


# --- Ollama's options ------------------------------------------------------------------------------------------------

def test_options_are_typed_from_text_and_from_json():
    assert check_options({"temperature": "0.7", "top_k": "40", "seed": "-1", "stop": "###"}, "x") == \
        {"temperature": 0.7, "top_k": 40, "seed": -1, "stop": ["###"]}
    assert check_options({"temperature": 1, "top_k": 40.0, "num_predict": -1, "stop": ["a", "b"]}, "x") == \
        {"temperature": 1.0, "top_k": 40, "num_predict": -1, "stop": ["a", "b"]}


@pytest.mark.parametrize("options, message", [
    ({"top_k": True}, "options.top_k: top_k=True: must be an integer"),
    ({"temperature": "nan"}, "options.temperature: temperature='nan': must be a number"),
    ({"temperature": -1}, "must be >= 0"),
    ({"repeat_last_n": -2}, "repeat_last_n=-2: must be an integer >= -1"),
    ({"num_ctx": 1}, "num_ctx=1: must be an integer >= 2"),
    ({"stop": ["", "x"]}, "stop=['', 'x']: must be a non-empty string or a list of them"),
    ({"mirostat": 1}, "mirostat is an Ollama option churon does not implement"),
])
def test_bad_options_name_where_the_option_and_the_value(options, message):
    where = f"options.{next(iter(options))}"
    with pytest.raises(ValueError) as e:
        check_options(options, where)
    assert str(e.value).startswith(where) and message.split(": ", 1)[-1] in str(e.value)


def test_options_become_sampling_params_under_their_names():
    kwargs = sampling_kwargs(check_options({"num_ctx": 4096, "num_predict": 64, "repeat_penalty": 1.1, "repeat_last_n": 32,
                                            "presence_penalty": 0.5, "seed": 7, "stop": ["x"]}, "o"))
    assert kwargs == {"max_tokens": 64, "repetition_penalty": 1.1, "repeat_last_n": 32, "presence_penalty": 0.5,
                      "seed": 7, "stop": ["x"]}
    assert SamplingParams(**kwargs).repeat_last_n == 32
    for unlimited in (-1, -2, 0):  # up to the context: the engine lowers max_tokens to what it leaves
        assert sampling_kwargs({"num_predict": unlimited}) == {"max_tokens": UP_TO_THE_CONTEXT}
    assert sampling_kwargs({"seed": -1}) == {"seed": None}  # Ollama's random seed


def test_parameters_print_as_ollama_show_prints_them():
    assert format_parameters({"temperature": 0.2, "stop": ["<|im_end|>", "a b"]}) == (
        "temperature                    0.2\n"
        'stop                           "<|im_end|>"\n'
        'stop                           "a b"')


# --- repeat_last_n: the penalties over the last N tokens ----------------------------------------------------------

def greedy(sampler: Sampler, logits) -> int:
    return sampler(torch.tensor(logits))


LOGITS = [2.0, 1.5, 0.0, 0.0]  # token 0 wins unless a penalty halves it (2.0 -> 1.0 < 1.5)


@pytest.mark.parametrize("repeat_last_n, expected", [(-1, 1), (2, 1), (1, 0), (0, 0)])
def test_the_repetition_penalty_sees_only_the_last_n_prompt_tokens(repeat_last_n, expected):
    params = SamplingParams(temperature=0, repetition_penalty=2.0, repeat_last_n=repeat_last_n)
    # prompt [0, 3]: the last 1 token is 3 alone; 0 = disabled; -1 = every token
    assert greedy(Sampler(params, 4, [0, 3]), LOGITS) == expected


def test_the_window_slides_as_tokens_are_generated():
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0, repeat_last_n=2), 4, [0])
    assert greedy(sampler, LOGITS) == 1
    sampler.accept(2)
    assert greedy(sampler, LOGITS) == 1  # window [0, 2]
    sampler.accept(3)
    assert greedy(sampler, LOGITS) == 0  # window [2, 3]: token 0 has left it
    unbounded = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0), 4, [0])
    for token in (2, 3, 2, 3):
        unbounded.accept(token)
    assert unbounded.params.repeat_last_n == -1 and greedy(unbounded, LOGITS) == 1  # the default: every token, as before


def test_presence_and_frequency_penalties_count_generated_tokens_in_the_window():
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=1.0, repeat_last_n=2), 4, [0])
    assert greedy(sampler, LOGITS) == 0  # the prompt's 0 is not an output token
    sampler.accept(0)
    assert greedy(sampler, LOGITS) == 1  # 2.0 - 1 < 1.5
    sampler.accept(2)
    sampler.accept(3)
    assert greedy(sampler, LOGITS) == 0  # the generated 0 has left the window
    frequency = Sampler(SamplingParams(temperature=0, frequency_penalty=0.3, repeat_last_n=3), 4, [])
    for token in (0, 0):
        frequency.accept(token)
    assert greedy(frequency, LOGITS) == 1  # 2.0 - 2 x 0.3 = 1.4 < 1.5
    frequency.accept(2)
    frequency.accept(2)
    assert greedy(frequency, LOGITS) == 0  # window [0, 2, 2]: 2.0 - 0.3 = 1.7


def test_repeat_last_n_must_be_minus_one_or_more():
    with pytest.raises(ValueError, match="invalid sampling parameter repeat_last_n=-2"):
        SamplingParams(repeat_last_n=-2)


# --- TEMPLATE: Go templates as Ollama writes them, rendered as Ollama renders them --------------------------------

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER1 = {"role": "user", "content": "Hello, how are you?"}
ASSISTANT = {"role": "assistant", "content": "I'm doing great. How can I help you today?"}
USER2 = {"role": "user", "content": "I'd like to show off how chat templating works!"}
CONVERSATIONS = {"user": [USER1], "user-assistant-user": [USER1, ASSISTANT, USER2],
                 "system-user-assistant-user": [SYSTEM, USER1, ASSISTANT, USER2]}

# Ollama's template/chatml.gotmpl, and the ChatML of its library's Qwen models (a system block, roles by eq)
CHATML_GO = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
CHATML_GO_LIBRARY = '''{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- range .Messages }}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}<|im_end|>
{{ end }}
{{- end }}<|im_start|>assistant
'''
# Ollama's template/llama3-instruct.gotmpl, and its library's llama3 template (a "legacy" one: .Prompt, .Response)
LLAMA3_GO = ("{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>\n"
             "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n")
LLAMA3_GO_LIBRARY = '''{{ if .System }}<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>{{ end }}{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>

{{ .Prompt }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>

{{ .Response }}<|eot_id|>'''
LLAMA3_JINJA = ("{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
                " + message['content'] + '<|eot_id|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Ollama's template/testdata renderings of these conversations
OLLAMA_CHATML = {
    "user": "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n",
    "system-user-assistant-user": (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n"
        "<|im_start|>assistant\nI'm doing great. How can I help you today?<|im_end|>\n<|im_start|>user\n"
        "I'd like to show off how chat templating works!<|im_end|>\n<|im_start|>assistant\n"),
}
OLLAMA_LLAMA3 = {
    "user": "<|start_header_id|>user<|end_header_id|>\n\nHello, how are you?<|eot_id|><|start_header_id|>assistant"
            "<|end_header_id|>\n\n",
    "system-user-assistant-user": (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|><|start_header_id|>user"
        "<|end_header_id|>\n\nHello, how are you?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI'm doing"
        " great. How can I help you today?<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nI'd like to show off how"
        " chat templating works!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
}


def render(template: str, messages: list[dict]) -> str:
    """Through churon's sandboxed chat template, as a tokenizer renders it."""
    return ChatTemplate(to_jinja(template), "test").render(messages, add_generation_prompt=True)


@pytest.mark.parametrize("go, jinja, ollama", [
    (CHATML_GO, CHATML_TEMPLATE, OLLAMA_CHATML),
    (CHATML_GO_LIBRARY, CHATML_TEMPLATE, OLLAMA_CHATML),
    (LLAMA3_GO, LLAMA3_JINJA, OLLAMA_LLAMA3),
    (LLAMA3_GO_LIBRARY, LLAMA3_JINJA, OLLAMA_LLAMA3),
], ids=["chatml", "chatml-library", "llama3", "llama3-library"])
def test_ollamas_chatml_and_llama3_templates_render_as_the_equivalent_jinja(go, jinja, ollama):
    for name, messages in CONVERSATIONS.items():
        expected = ChatTemplate(jinja, "jinja").render(messages, add_generation_prompt=True)
        assert render(go, messages) == expected, name
        if name in ollama:
            assert expected == ollama[name]


def test_a_go_template_becomes_the_tokenizers_chat_template(tiny_llama_dir):
    from churon.loader import open_model
    from churon.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(open_model(tiny_llama_dir))
    before = tokenizer.apply_chat_template([USER1])
    tokenizer.chat_template = chat_template(LLAMA3_GO_LIBRARY, "TEMPLATE")
    assert tokenizer.apply_chat_template([USER1]) == OLLAMA_LLAMA3["user"] != before


def test_a_legacy_template_continues_a_prefilled_answer_and_gets_its_response_appended():
    # the last turn is cut after {{ .Response }}: a prefilled assistant message is continued, not closed
    prefilled = [USER1, {"role": "assistant", "content": "I am"}]
    assert render(LLAMA3_GO_LIBRARY, prefilled).endswith("<|start_header_id|>assistant<|end_header_id|>\n\nI am")
    # a template that never names .Response gets one at its end (Ollama's Parse): earlier answers are kept
    assert render("{{ .System }}U:{{ .Prompt }} A:", [SYSTEM, USER1, ASSISTANT, USER2]) == (
        f"{SYSTEM['content']}U:{USER1['content']} A:{ASSISTANT['content']}U:{USER2['content']} A:")


def test_consecutive_messages_of_one_role_are_merged_and_system_messages_joined():
    two_users = [USER1, {"role": "user", "content": "Still there?"}]
    merged = "Hello, how are you?\n\nStill there?"
    assert render(CHATML_GO, two_users) == f"<|im_start|>user\n{merged}<|im_end|>\n<|im_start|>assistant\n"
    assert render(LLAMA3_GO_LIBRARY, two_users).startswith(f"<|start_header_id|>user<|end_header_id|>\n\n{merged}<|eot")
    systems = [{"role": "system", "content": "A"}, USER1, {"role": "system", "content": "B"}, USER2]
    assert render("{{ .System }}|{{ range .Messages }}{{ .Role }} {{ end }}", systems) == "A\n\nB|system user system user "


def test_the_supported_subset():
    cases = {
        "a  {{- .Prompt -}}  \n b": ([USER1], "aHello, how are you?b"),  # Go's trimming, both sides
        "{{/* a comment */}}x{{- /* trimmed */ -}} y": ([USER1], "xy"),
        '{{ if eq .Prompt "hi" "Hello, how are you?" }}yes{{ else }}no{{ end }}': ([USER1], "yes"),
        '{{ if ne .Prompt "hi" }}ne{{ end }}{{ if not .System }}!S{{ end }}{{ if and .Prompt (not .System) }}&{{ end }}'
        '{{ if or .System .Prompt }}|{{ end }}': ([USER1], "ne!S&|"),
        '{{ if .System }}S{{ else if .Prompt }}P{{ else }}-{{ end }}': ([USER1], "P"),
        "{{ range .Messages }}{{ .Content }}{{ else }}none{{ end }}": ([], "none"),
        "{{ `raw {{ text }}` }}{{ \"q\\\"uote\" }}": ([USER1], 'raw {{ text }}q"uote'),
        "{{ range .Messages }}{{ if eq .Role \"user\" }}U{{ end }}{{ end }}{{ .Response }}!": ([USER1, USER2], "U!"),
    }
    for template, (messages, expected) in cases.items():
        assert render(template, messages) == expected, template


def test_a_jinja_template_is_taken_as_it_is():
    assert to_jinja(CHATML_TEMPLATE) == CHATML_TEMPLATE


@pytest.mark.parametrize("template, message", [
    ("{{ .Prompt | upper }}", "line 1: {{ .Prompt | upper }}: pipelines (|) are not supported"),
    ("x\n{{ $.System }}", "line 2: {{ $.System }}: variables ($.System) are not supported"),
    ("{{ range $i, $m := .Messages }}{{ end }}", "variables ($i) are not supported"),
    ("{{ if gt (len .Messages) 1 }}{{ end }}", "the function gt is not supported"),
    ("{{ json .Tools }}", "the function json is not supported"),
    ("{{ if .Tools }}{{ end }}", "{{ if .Tools }}: .Tools is not supported"),
    ("{{ with .System }}{{ . }}{{ end }}", "with is not supported"),
    ("{{ range .Messages }}{{ range .Messages }}{{ end }}{{ end }}", "a range inside a range"),
    ("{{ range .Messages }}{{ .System }}{{ end }}", "inside {{ range .Messages }}, . is the message"),
    ("{{ .Content }}", ".Content is not supported (they are a message's, inside {{ range .Messages }})"),
    ("{{ range .Messages }}{{ .ToolCalls }}{{ end }}", "only .Role and .Content are supported there"),
    ("\n\n{{ if .System }}x", "line 3: {{ if }} has no {{ end }}"),
    ("{{ end }}", "{{ end }} without an if or range to end"),
    ("{{ eq .Prompt }}", "only a field or a string can be printed"),
    ("{{ if eq .Prompt }}{{ end }}", "eq takes at least 2 argument(s), not 1"),
    ("{{ .Prompt", "unclosed action"),
])
def test_go_templates_outside_the_subset_are_refused_naming_the_line_and_what_they_use(template, message):
    with pytest.raises(GoTemplateError) as e:
        to_jinja(template)
    assert message in str(e.value)


def test_runtime_options_are_ignored_and_said_once(caplog, monkeypatch):
    """num_gpu, num_thread, ... tune how Ollama runs llama.cpp, not what it answers: clients send them."""
    import churon.ollama_options

    monkeypatch.setattr(churon.ollama_options, "_ignored", set())
    with caplog.at_level("WARNING", logger="churon"):
        assert check_options({"num_thread": 8, "num_gpu": 99, "temperature": 0}, "options") == {"temperature": 0.0}
        check_options({"num_thread": 4}, "options")
    assert sum("num_thread" in r.message for r in caplog.records) == 1
