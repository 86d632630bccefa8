"""Tool calling below the server (churon.tool_calls): the parsers of each format, whole and streamed,
the formats' detection from chat templates, the prompts (Hugging Face's rendering of the same template
is the reference), the forcing grammars on a random model (jsonschema checks every forced call), and
the errors that name the field at fault."""

import json

import jsonschema
import pytest

from churon import LLM
from churon.sampling import SamplingParams
from churon.tool_calls import TextDelta, Tool, ToolCallArguments, ToolCallError, ToolCallStart, ToolChoice, ToolPlan
from churon.tool_calls.formats import HERMES, LLAMA3_JSON, MISTRAL, detect_format
from churon.tool_calls.grammar import calls_grammar
from churon.tool_calls.stream import ToolCallStream
from tiny_models import CHAT_TEMPLATE, QWEN_TOOLS_TEMPLATE, make_hf_model, write_gguf

WEATHER = Tool("get_weather", "The weather in a city", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
})
TIME = Tool("get_time", None, {
    "type": "object",
    "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}, "utc": {"type": "boolean"}},
    "required": ["hours", "utc"],
    "additionalProperties": False,
})
NOW = Tool("now", "The time now; no arguments", None)
TOOLS = [WEATHER, TIME, NOW]
NAMES = frozenset(t.name for t in TOOLS)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def events_of(fmt, text, pieces=None, **kw):
    """The stream's events for `text` fed in `pieces` (default: one character at a time)."""
    stream = ToolCallStream(fmt, NAMES, **kw)
    pieces = pieces if pieces is not None else list(text)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    return events, stream


def assembled(events):
    """(text, [(name, arguments)]) from stream events, checking their order: a call's start before its fragments."""
    text, calls = "", {}
    for e in events:
        if isinstance(e, TextDelta):
            text += e.text
        elif isinstance(e, ToolCallStart):
            assert e.index == len(calls) and e.id.startswith("call_")
            calls[e.index] = [e.name, ""]
        else:
            assert isinstance(e, ToolCallArguments) and e.index in calls
            calls[e.index][1] += e.fragment
    return text, [tuple(c) for c in calls.values()]


# --- parsing --------------------------------------------------------------------------------


HERMES_CASES = [
    # (output, content, calls)
    ("Just text, no call.", "Just text, no call.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ('Let me check.\n\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"hours": 3, "utc": true}}\n</tool_call>',
     "Let me check.", [("now", "{}"), ("get_time", '{"hours": 3, "utc": true}')]),
    # the arguments key first; a JSON string holding the arguments; no arguments at all
    ('<tool_call>{"arguments": {"hours": 1, "utc": false}, "name": "get_time"}</tool_call>', "",
     [("get_time", '{"hours": 1, "utc": false}')]),
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"hours\\": 2, \\"utc\\": true}"}\n</tool_call>', "",
     [("get_time", '{"hours": 2, "utc": true}')]),
    ('<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    # strings with braces, quotes and escapes inside the arguments
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "a}\\"{b\\\\", "unit": "celsius"}}</tool_call>', "",
     [("get_weather", '{"city": "a}\\"{b\\\\", "unit": "celsius"}')]),
    # not calls: a tag that is no marker, a function that is not among the tools, no JSON after the marker
    ("a < b and <tool_cal is not a tag", "a < b and <tool_cal is not a tag", []),
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),
    ("see <tool_call> here", "see <tool_call> here", []),
    # the model's JSON strings broken (a bad escape, a raw newline) in a key, the name, string-held arguments
    ('<tool_call>{"na\\qme": "now"}</tool_call>', '<tool_call>{"na\\qme": "now"}</tool_call>', []),
    ('<tool_call>{"name": "no\\qw"}</tool_call>', '<tool_call>{"name": "no\\qw"}</tool_call>', []),
    ('<tool_call>{"na\nme": "now"}</tool_call>', '<tool_call>{"na\nme": "now"}</tool_call>', []),
    ('<tool_call>{"arguments": "\\q", "name": "now"}</tool_call>', '<tool_call>{"arguments": "\\q", "name": "now"}</tool_call>', []),
    ("  spaced answer \n", "  spaced answer \n", []),
]


@pytest.mark.parametrize("output,content,calls", HERMES_CASES)
def test_hermes_output_parses_the_same_whole_and_streamed(output, content, calls):
    for pieces in (None, [output], [output[i:i + 5] for i in range(0, len(output), 5)]):
        text, got = assembled(events_of(HERMES, output, pieces)[0])
        assert (text, got) == (content, calls)
        for _, arguments in got:
            json.loads(arguments)


def test_a_call_streams_its_name_first_then_its_arguments_as_they_come():
    stream = ToolCallStream(HERMES, NAMES)
    assert stream.feed("<tool") == []  # may be the marker: held back
    assert stream.feed('_call>\n{"name": "get_time", "arg') == []
    start = stream.feed('uments": {"ho')
    assert [type(e) for e in start] == [ToolCallStart, ToolCallArguments] and start[0].name == "get_time"
    assert start[1] == ToolCallArguments(0, '{"ho')
    assert stream.feed('urs": 5, "utc": true}') == [ToolCallArguments(0, 'urs": 5, "utc": true}')]
    assert stream.feed("}\n</tool_call>") == []
    assert stream.finish() == [] and stream.completed == {0}


def test_text_before_a_call_streams_without_the_whitespace_that_separates_them():
    stream = ToolCallStream(HERMES, NAMES)
    assert stream.feed("Sure") == [TextDelta("Sure")]
    assert stream.feed(",\n\n") == [TextDelta(",")]  # the newlines may only separate the answer from a call
    assert stream.feed("ok ") == [TextDelta("\n\nok")]  # they did not
    assert stream.feed("<tool_call>") == []
    assert stream.finish() == []  # a call cut off: not text


def test_a_call_cut_off_by_max_tokens_is_not_a_call():
    output = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    events, stream = events_of(HERMES, output)
    assert assembled(events) == ("", [("get_weather", '{"city": "Par')]) and stream.completed == set()
    plan = ToolPlan(prompt_ids=[], grammar=None, fmt=HERMES, tools=TOOLS, parallel=True, native=True)
    assert plan.parse(output) == ("", [])
    content, calls = plan.parse('<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "get_ti')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("now", "{}")]


def test_a_call_that_breaks_after_its_start_makes_the_whole_output_text():
    output = '<tool_call>\n{"name": "get_time", "arguments": {"hours": 1}] oops'
    plan = ToolPlan(prompt_ids=[], grammar=None, fmt=HERMES, tools=TOOLS, parallel=True, native=True)
    assert plan.parse(output) == (output, [])


def test_parallel_false_keeps_the_first_call_only():
    output = '<tool_call>{"name": "now"}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"hours": 1, "utc": true}}</tool_call>'
    events, stream = events_of(HERMES, output, max_calls=1)
    assert assembled(events) == ("", [("now", "{}")]) and stream.completed == {0}
    plan = ToolPlan(prompt_ids=[], grammar=None, fmt=HERMES, tools=TOOLS, parallel=False, native=True)
    assert [c.name for c in plan.parse(output)[1]] == ["now"]


@pytest.mark.parametrize("output,content,calls", [
    ('{"name": "get_time", "parameters": {"hours": 4, "utc": false}}', "", [("get_time", '{"hours": 4, "utc": false}')]),
    ('  {"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
     "", [("now", "{}"), ("get_weather", '{"city": "Oslo", "unit": "celsius"}')]),
    ('{"answer": 42}', '{"answer": 42}', []),  # a JSON answer is no call
    ("The weather is {fine}.", "The weather is {fine}.", []),
])
def test_llama3_json_output_parses(output, content, calls):
    assert assembled(events_of(LLAMA3_JSON, output)[0]) == (content, calls)
    assert assembled(events_of(LLAMA3_JSON, output, [output])[0]) == (content, calls)


@pytest.mark.parametrize("output,content,calls", [
    ('[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "get_time", "arguments": {"hours": 9, "utc": true}}]',
     "", [("now", "{}"), ("get_time", '{"hours": 9, "utc": true}')]),
    # decoding without special tokens drops [TOOL_CALLS]: the bare array at the output's start
    (' [{"name": "now", "arguments": {}}]', "", [("now", "{}")]),
    ("[1, 2] is a list", "[1, 2] is a list", []),
    ("No calls here.", "No calls here.", []),
])
def test_mistral_output_parses(output, content, calls):
    assert assembled(events_of(MISTRAL, output)[0]) == (content, calls)


def test_formats_are_detected_from_the_template():
    assert detect_format(QWEN_TOOLS_TEMPLATE) is HERMES
    assert detect_format(CHAT_TEMPLATE) is None and detect_format(None) is None
    llama = "{%- if tools %}<|start_header_id|>user<|end_header_id|>{{ tools }} \"parameters\"{% endif %}<|python_tag|>"
    assert detect_format(llama) is LLAMA3_JSON
    assert detect_format("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") is MISTRAL
    assert detect_format("<tool_call> in a template that never renders the tools") is None


# --- prompts and grammars on tiny models ------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_tools_dir(tmp_path_factory):
    return make_hf_model("qwen2", tmp_path_factory.mktemp("qwen-tools"), chat_template=QWEN_TOOLS_TEMPLATE,
                         max_positions=2048)


@pytest.fixture(scope="module")
def native(qwen_tools_dir, tmp_path_factory):
    """A tiny Qwen2.5-style model whose template renders tools (hermes format)."""
    return LLM(write_gguf(qwen_tools_dir, tmp_path_factory.mktemp("gguf") / "tools.gguf", "Q8_0"), threads=1)


@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    """A tiny model whose template knows no tools: the generic fallback."""
    hf = make_hf_model("llama", tmp_path_factory.mktemp("plain"), max_positions=2048, seed=1)
    return LLM(write_gguf(hf, tmp_path_factory.mktemp("gguf") / "plain.gguf", "Q8_0"), threads=1)


HISTORY = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]


def test_native_prompt_is_the_template_rendered_as_transformers_renders_it(native, qwen_tools_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen_tools_dir)
    hf_history = [dict(m) for m in HISTORY]
    hf_history[1] = {**HISTORY[1], "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"]) if isinstance(c["function"]["arguments"], str) else c["function"]["arguments"]}}
        for c in HISTORY[1]["tool_calls"]]}
    tools = [t.as_openai() for t in TOOLS]
    for choice in ("auto", "required"):
        plan = ToolPlan.build(native, HISTORY, TOOLS, ToolChoice(choice))
        text = hf.apply_chat_template(hf_history, tools=tools, add_generation_prompt=True, tokenize=False)
        assert plan.native and plan.prompt_ids == native.tokenizer.encode(text, add_bos=False)
        assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    none = ToolPlan.build(native, HISTORY, TOOLS, ToolChoice("none"))
    text = hf.apply_chat_template(hf_history, add_generation_prompt=True, tokenize=False)
    assert none.prompt_ids == native.tokenizer.encode(text, add_bos=False) and none.grammar is None
    assert "<tools>" not in text


def test_without_tools_the_prompt_is_the_plain_chat_prompt(native, fallback):
    for llm in (native, fallback):
        plan = ToolPlan.build(llm, MESSAGES, [], ToolChoice("auto"))
        assert plan.prompt_ids == llm.chat_prompt_ids(MESSAGES) and plan.grammar is None
        assert plan.parse("any <tool_call> text") == ("any <tool_call> text", [])
        assert plan.stream().feed("<tool_call>") == [TextDelta("<tool_call>")]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    plan = ToolPlan.build(fallback, MESSAGES, [WEATHER], ToolChoice("none"), json_schema=schema)
    out = fallback.generate(plan.prompt_ids, SamplingParams(max_tokens=60, temperature=0, grammar=plan.grammar))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_fallback_prompt_describes_the_tools_and_renders_the_history_as_text(fallback):
    plan = ToolPlan.build(fallback, HISTORY, TOOLS, ToolChoice("auto"))
    text = fallback.tokenizer.decode(plan.prompt_ids, skip_special_tokens=False)
    assert not plan.native and plan.format is HERMES and plan.grammar is not None
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER.as_openai()) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>" in text
    system = [{"role": "system", "content": "Be brief."}] + MESSAGES
    text = fallback.tokenizer.decode(ToolPlan.build(fallback, system, TOOLS, ToolChoice("required")).prompt_ids,
                                     skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and "You must call one or more" in text
    none = ToolPlan.build(fallback, MESSAGES, TOOLS, ToolChoice("none"))
    assert none.prompt_ids == fallback.chat_prompt_ids(MESSAGES) and none.grammar is None


SEEDS = range(24)


def forced_outputs(llm, plan, seeds=SEEDS, max_tokens=300):
    params = [SamplingParams(max_tokens=max_tokens, seed=s, temperature=1.0, grammar=plan.grammar) for s in seeds]
    return llm.generate([plan.prompt_ids] * len(params), params, use_tqdm=False)


@pytest.mark.parametrize("model", ["native", "fallback"])
def test_forced_calls_always_parse_and_validate_against_their_schema(model, request):
    llm = request.getfixturevalue(model)
    schemas = {t.name: t.parameters for t in TOOLS}
    for choice, parallel in [(ToolChoice("required"), False), (ToolChoice("function", "get_weather"), True),
                             (ToolChoice("required"), True)]:
        plan = ToolPlan.build(llm, MESSAGES, TOOLS, choice, parallel=parallel)
        for out in forced_outputs(llm, plan):
            content, calls = plan.parse(out.text)
            several = parallel and choice.mode == "required"
            if several and out.finish_reason == "length":
                assert calls  # a later call cut off; the ones before it stand
            else:
                assert out.finish_reason == "stop", out.text
                assert content is None and (len(calls) >= 1 if several else len(calls) == 1), out.text
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
                assert choice.mode != "function" or call.name == "get_weather"
            stream = plan.stream()
            streamed = [e for t in out.text for e in stream.feed(t)] + stream.finish()
            assert assembled(streamed)[1] == [(c.name, c.arguments) for c in calls] or out.finish_reason == "length"


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_each_formats_grammar_writes_what_its_parser_reads(fallback, fmt):
    """Every format's forcing grammar (mistral's marker as text: the tiny vocabulary has no [TOOL_CALLS] token)
    against the same format's parser, whole and streamed, on sampled outputs."""
    prompt = fallback.chat_prompt_ids(MESSAGES)
    for parallel in (False, True):
        grammar = calls_grammar(fmt, TOOLS, parallel=parallel, begin_token_id=None, answer=None)
        plan = ToolPlan(prompt, grammar, fmt, TOOLS, parallel, native=True)
        for out in forced_outputs(fallback, plan, seeds=range(12)):
            content, calls = plan.parse(out.text)
            if out.finish_reason == "length":
                assert parallel, out.text
                continue
            assert out.finish_reason == "stop" and content is None and calls, out.text
            assert len(calls) == 1 or parallel
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), {t.name: t.parameters for t in TOOLS}[call.name])
            stream = plan.stream()
            streamed = [e for t in out.text for e in stream.feed(t)] + stream.finish()
            assert assembled(streamed) == ("", [(c.name, c.arguments) for c in calls])


def test_fallback_auto_answers_in_text_or_in_a_valid_call(fallback):
    plan = ToolPlan.build(fallback, MESSAGES, TOOLS, ToolChoice("auto"))

    def accepts(text: str) -> bool:
        matcher = fallback.engine.structured_output.grammar(lark=plan.grammar).matcher
        return all(matcher.consume_token(t) for t in fallback.tokenizer.encode(text, add_bos=False)) and matcher.is_accepting()

    assert accepts("Plain words, an answer.") and accepts("")
    assert accepts('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    # forced calls go back to back: a newline after a call would force a small model that wanted to go on
    # in text into calling again
    assert accepts('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
                   '<tool_call>\n{"name": "get_time", "arguments": {"hours": 7, "utc": true}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n')
    assert not accepts("An answer that then <tool_call>")  # no call inside an answer: it would not parse
    assert not accepts('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>')  # no function of that name
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {"hours": 24, "utc": true}}\n</tool_call>')
    for out in forced_outputs(fallback, plan, max_tokens=120):
        content, calls = plan.parse(out.text)
        if calls:
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), {t.name: t.parameters for t in TOOLS}[call.name])
        else:
            assert "<tool_call>" not in out.text and content == out.text


def test_auto_with_a_response_format_answers_json_or_calls(native):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    plan = ToolPlan.build(native, MESSAGES, [TIME], ToolChoice("auto"), json_schema=schema)
    for out in forced_outputs(native, plan, seeds=range(8), max_tokens=120):
        content, calls = plan.parse(out.text)
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop" and not calls:
            jsonschema.validate(json.loads(content), schema)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), TIME.parameters)


def test_lark_grammars_go_through_sampling_params(native):
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar="start: \"a\"", json_schema={"type": "object"})
    with pytest.raises(ValueError, match="invalid grammar"):
        native.generate([1, 2], SamplingParams(grammar="start: nosuchrule"))
    out = native.generate([1, 2], SamplingParams(max_tokens=10, grammar='start: "yes" | "no"'))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


# --- bad input --------------------------------------------------------------------------------


BAD = [
    ("invalid parameters schema", [Tool("f", None, {"type": "object", "properties": {"a": {"type": "strin"}}})], ToolChoice(),
     MESSAGES, "tools[0].parameters"),
    ("parameters not an object schema", [Tool("f", None, {"type": "string"})], ToolChoice(), MESSAGES, "tools[0].parameters"),
    ("a bad function name", [WEATHER, Tool("has space", None, None)], ToolChoice(), MESSAGES, "tools[1].name"),
    ("two tools of one name", [WEATHER, WEATHER], ToolChoice(), MESSAGES, "tools[1].name"),
    ("tool_choice naming an unknown function", TOOLS, ToolChoice("function", "nope"), MESSAGES, "tool_choice"),
    ("required without tools", [], ToolChoice("required"), MESSAGES, "tool_choice"),
    ("an unknown tool_choice", TOOLS, ToolChoice("sometimes"), MESSAGES, "tool_choice"),
    ("a tool message without tool_call_id", TOOLS, ToolChoice(), HISTORY[:2] + [{"role": "tool", "content": "x"}],
     "messages[2].tool_call_id"),
    ("arguments that are not JSON", TOOLS, ToolChoice(), MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{nope"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ("arguments that are not an object", TOOLS, ToolChoice(), MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "[1]"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ("a call without a name", TOOLS, ToolChoice(), MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}], "messages[1].tool_calls[0].function.name"),
    ("an unknown role", TOOLS, ToolChoice(), [{"role": "robot", "content": "x"}], "messages[0].role"),
]


@pytest.mark.parametrize("name,tools,choice,messages,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_its_field(native, name, tools, choice, messages, param):
    with pytest.raises(ToolCallError) as e:
        ToolPlan.build(native, messages, tools, choice)
    assert e.value.param == param and str(e.value)
    assert isinstance(e.value, ValueError)


def test_an_invalid_response_format_schema_is_named(native):
    with pytest.raises(ToolCallError, match="Invalid type") as e:
        ToolPlan.build(native, MESSAGES, TOOLS, ToolChoice(), json_schema={"type": "nope"})
    assert e.value.param == "json_schema"
