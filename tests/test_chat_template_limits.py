"""Chat templates are bounded from inside the sandbox: a template that runs past its time limit,
renders past its output limit or builds a huge value is a ChatTemplateLimitError of that rendering,
within the limit; a model whose template cannot render a one-message conversation in time does not
load; a rendered prompt longer than the context can hold is refused before it is tokenized. Real
templates render exactly as Hugging Face renders them."""

import time

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from churon import LLM
from churon.errors import ContextLengthError
from churon.tokenizer import ChatTemplateError, ChatTemplateLimitError
from churon.tokenizer.chat_template import CHATML_TEMPLATE, MAX_RENDERED_CHARS, RENDER_TIMEOUT_SECONDS, ChatTemplate
from tiny_models import QWEN_TOOLS_TEMPLATE, make_hf_model

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"celsius": 21}'},
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "assistant", "content": "21 °C and clear."},
    {"role": "user", "content": "Thanks <3"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# loops (loop.last, loop.length, else, recursive), macros, namespace, filters, slicing and operators
FEATURES_TEMPLATE = (
    "{% macro turn(m) %}<{{ m.role|upper }}>{{ m.content|trim }}{% endmacro %}"
    "{% set ns = namespace(users=0, text='') %}"
    "{% for m in messages if m.role != 'tool' %}{{ turn(m) }}{{ '|' if not loop.last }}"
    "{% if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% set ns.text = ns.text ~ m.content[:4] %}{% endif %}"
    "{% else %}none{% endfor %}"
    "[{{ ns.users }}/{{ messages|length }} {{ ns.text }} {{ '-' * 3 }} {{ 2 ** 10 }} {{ messages[::-1][0].role }}]"
    "{% for n in [{'c': [{'c': []}, {'c': []}]}] recursive %}({{ loop.length }}{{ loop(n.c) }}){% endfor %}"
    "{{ messages|map(attribute='role')|unique|join(',') }}{% if add_generation_prompt %}<ASSISTANT>{% endif %}"
)


def render(template: str, timeout: float = RENDER_TIMEOUT_SECONDS, **variables) -> str:
    return ChatTemplate(template, "model.gguf", timeout=timeout).render([{"role": "user", "content": "hi"}], True, **variables)


@pytest.mark.parametrize("template, tools", [(CHATML_TEMPLATE, None), (QWEN_TOOLS_TEMPLATE, None),
                                             (QWEN_TOOLS_TEMPLATE, TOOLS), (FEATURES_TEMPLATE, None)])
def test_real_templates_render_as_hugging_face_does(template, tools):
    messages = MESSAGES if template != CHATML_TEMPLATE else [m for m in MESSAGES if m["role"] in ("system", "user")]
    ours = ChatTemplate(template, "model.gguf").render(messages, True, tools=tools)
    reference, _ = render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=True)
    assert ours == reference[0]


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # the issue's
    "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",  # no range, no call
    "{% for i in range(100000) %}{% set xs = range(100000)|list %}{% endfor %}",
    "{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(60) }}",  # 2^60 calls
])
def test_a_template_past_its_time_limit_stops_within_it(template):
    # the deadline's own error, not the 2 s default's: the 0.3 s limit is what stopped each of these
    with pytest.raises(ChatTemplateLimitError, match=r"model.gguf: the chat template ran past its limit of 0.3 s"):
        render(template, timeout=0.3)


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",  # 100 MB of output
    "{{ 'x' * 10 ** 12 }}",  # one multiplication, refused before it runs
    "{{ (range(1000)|list) * 10 ** 9 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",  # doubling
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ 'x'.ljust(10 ** 8) }}",  # a method call's result
    "{{ 'x'|center(10 ** 8)|length }}",  # a filter's result, even if it is not output
])
def test_a_template_past_its_size_limit_stops_at_once(template):
    with pytest.raises(ChatTemplateLimitError, match=f"past its limit of {MAX_RENDERED_CHARS}"):  # the size, not the clock
        render(template)


@pytest.mark.parametrize("template", [
    "{{ 10 ** (10 ** 8) }}",
    "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",  # squaring
])
def test_a_template_computing_a_giant_integer_stops_before_it(template):
    with pytest.raises(ChatTemplateLimitError, match="integer of about .* bits, past its limit"):
        render(template)


def test_the_limits_are_per_rendering():
    template = ChatTemplate("{% for i in range(100) %}{{ i }}{% endfor %}", "model.gguf", timeout=0.2)
    for _ in range(3):  # each rendering gets its own deadline
        assert template.render([], False) == "".join(str(i) for i in range(100))
        time.sleep(0.1)


# -- the model ----------------------------------------------------------------------------


def model_with_template(path, template: str):
    make_hf_model("qwen3", path)
    (path / "chat_template.jinja").write_text(template)
    return path


def test_a_model_whose_template_cannot_render_in_time_does_not_load(tmp_path):
    path = model_with_template(tmp_path, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="cannot render a one-message conversation: .* ran past its limit"):
        LLM(path, threads=1)


def test_a_template_that_refuses_the_conversation_still_loads(tmp_path):
    llm = LLM(model_with_template(tmp_path, "{{ raise_exception('roles must alternate') }}"), threads=1)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        llm.chat_prompt_ids([{"role": "user", "content": "hi"}])


def test_a_prompt_longer_than_the_context_holds_is_refused_before_encoding(tmp_path, monkeypatch):
    llm = LLM(make_hf_model("qwen3", tmp_path), threads=1)
    longest = max(len(llm.tokenizer.token_bytes(i)) for i in range(llm.tokenizer.vocab_size))
    limit = llm.max_model_len * longest
    conversation = [{"role": "user", "content": "hi " * 100}]
    fits = llm.chat_prompt_ids(conversation)
    assert fits == llm.tokenizer.encode(llm.tokenizer.apply_chat_template(conversation), add_bos=False)

    def encode(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(llm.tokenizer, "encode", encode)
    too_long = rf"more than {llm.max_model_len} tokens \(the context window\) of this model can hold"
    with pytest.raises(ContextLengthError, match=too_long):
        llm.chat_prompt_ids([{"role": "user", "content": "x" * limit}])
    with pytest.raises(ContextLengthError):
        llm.generate("x" * (limit + 1))
