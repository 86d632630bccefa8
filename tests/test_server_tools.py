"""Tool calling in /v1/chat/completions: a real `churon serve` process driven by the official openai
client (and LangChain's ChatOpenAI), on a tiny model whose template renders tools (Qwen2.5-style,
the hermes format) and one whose template knows none (the generic fallback), and on SmolLM2.

The reference is the same model file in this process: ToolPlan.build renders the same prompt, the
engine generates the same greedy or seeded text, and ToolPlan.parse reads the same calls out of it.
Forced calls are checked against their schemas with jsonschema.
"""

import json

import httpx2 as httpx
import jsonschema
import openai
import pytest

from churon import LLM, SamplingParams
from churon.tool_calls import Tool, ToolChoice, ToolPlan
from test_server import MODEL, start_server, stop_server
from tiny_models import make_hf_model, write_gguf

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hours"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = ["auto", "none", "required", {"type": "function", "function": {"name": "get_time"}}]
MAX_TOKENS = 200  # the tiny byte-level vocabulary spends about a token per character of a call


def neutral_tools(tools):
    return [Tool(t["function"]["name"], t["function"].get("description"), t["function"].get("parameters")) for t in tools]


def neutral_choice(choice):
    return ToolChoice("function", choice["function"]["name"]) if isinstance(choice, dict) else ToolChoice(choice)


def reference(llm, messages, choice, tools=TOOLS, **params):
    """What the server must answer: (content, [(name, arguments)], finish_reason, prompt tokens)."""
    plan = ToolPlan.build(llm, messages, neutral_tools(tools), neutral_choice(choice))
    params = {"temperature": 0, "max_tokens": MAX_TOKENS} | params
    out = llm.generate(plan.prompt_ids, SamplingParams(grammar=plan.grammar, **params))[0]
    content, calls = plan.parse(out.text)
    finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
    return content, [(c.name, c.arguments) for c in calls], finish, len(plan.prompt_ids)


@pytest.fixture(scope="module", params=["native", "fallback"])
def model_file(request, tmp_path_factory):
    """native: the tiny Qwen2.5-style model whose template renders tools; fallback: one whose template does not."""
    if request.param == "native":
        return request.getfixturevalue("qwen_tools_gguf")
    hf = make_hf_model("qwen2", tmp_path_factory.mktemp(request.param), max_positions=2048)
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", "Q8_0")


@pytest.fixture(scope="module")
def served(model_file):
    proc, url = start_server(model_file)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(model_file):
    return LLM(model_file, threads=1)


def collect_stream(stream):
    """(content per choice, {choice: [[id, name, arguments]]}, finish_reason per choice), checking OpenAI's
    delta shapes: a call's first delta carries its index, id, type and name with arguments "", later
    ones only their index and an arguments fragment."""
    content, calls, finish = {}, {}, {}
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            content[c.index] = content.get(c.index, "") + (d.content or "")
            for t in d.tool_calls or []:
                mine = calls.setdefault(c.index, [])
                if t.id is not None:
                    assert t.index == len(mine) and t.type == "function" and t.id.startswith("call_")
                    assert t.function.name and t.function.arguments == ""
                    mine.append([t.id, t.function.name, ""])
                else:
                    assert t.index == len(mine) - 1 and t.function.name is None and t.type is None
                    mine[t.index][2] += t.function.arguments
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return content, calls, finish


@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "none", "required", "named"])
def test_tool_choice_answers_as_the_engine_in_process(client, llm, choice):
    content, calls, finish, prompt_tokens = reference(llm, MESSAGES, choice)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                       max_tokens=MAX_TOKENS, temperature=0)
    message = r.choices[0].message
    got = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert (message.content, got, r.choices[0].finish_reason) == (content, calls, finish)
    assert r.usage.prompt_tokens == prompt_tokens
    if choice in ("required",) or isinstance(choice, dict):
        assert finish == "tool_calls" and content is None and calls
        for c in message.tool_calls:
            assert c.id.startswith("call_") and c.type == "function"
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        assert not isinstance(choice, dict) or {c.function.name for c in message.tool_calls} == {"get_time"}
    if choice == "none":  # no tools in the prompt: the plain chat answer
        plain = llm.generate(llm.chat_prompt_ids(MESSAGES), SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
        assert message.content == plain.text and not message.tool_calls

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    s_content, s_calls, s_finish = collect_stream(stream)
    assert s_content[0] == (content or "") and s_finish[0] == finish
    assert [(name, args) for _, name, args in s_calls.get(0, [])] == calls


def test_several_seeded_choices_stream_as_they_answer_whole(client, llm):
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
              temperature=1.0, seed=11, n=3)
    whole = client.chat.completions.create(**kw)
    s_content, s_calls, s_finish = collect_stream(client.chat.completions.create(**kw, stream=True))
    for c in whole.choices:
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        assert [(name, args) for _, name, args in s_calls.get(c.index, [])] == calls
        assert s_finish[c.index] == c.finish_reason
        ref = reference(llm, MESSAGES, "required", temperature=1.0, seed=11 + c.index)
        assert (c.message.content, calls, c.finish_reason) == ref[:3]
        for name, args in calls:
            jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_parallel_tool_calls_false_makes_one_call(client):
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=MAX_TOKENS, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


def test_a_tool_result_round_trip(client, llm):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=MAX_TOKENS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})},
    ]
    content, calls, finish, prompt_tokens = reference(llm, history, "auto", max_tokens=12)
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=12, temperature=0)
    got = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
    assert (r.choices[0].message.content, got, r.choices[0].finish_reason) == (content, calls, finish)
    assert r.usage.prompt_tokens == prompt_tokens
    # the result is in the prompt: a longer result makes a longer prompt
    longer = history[:-1] + [{"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "wind": 3})}]
    r2 = client.chat.completions.create(model=MODEL, messages=longer, tools=TOOLS, max_tokens=1, temperature=0)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_without_tools_chat_is_unchanged(client, llm):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    ref = llm.generate(llm.chat_prompt_ids(MESSAGES), SamplingParams(temperature=0, max_tokens=20))[0]
    assert r.choices[0].message.content == ref.text and r.choices[0].message.tool_calls is None


BAD = [
    ("a tool with an invalid JSON schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}]},
     "tools[0].function.parameters"),
    ("parameters that are not an object schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
    ("a bad function name", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ("tool_choice naming an unknown function", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("an unknown tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("a tool of another type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ("a tool message without tool_call_id", {"messages": MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                             "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "3"}]}, "messages[2].tool_call_id"),
    ("call arguments that are not JSON", {"messages": MESSAGES + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_time", "arguments": "{hours: 3"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("a user message without content", {"messages": [{"role": "user"}]}, "messages[0].content"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_input_is_a_400_naming_the_field(served, name, body, param):
    r = httpx.post(f"{served}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4} | body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error


# --- third-party clients and the real model -------------------------------------------------


@pytest.mark.slow
def test_langchain_bind_tools_round_trip_and_structured_output(served, model_file):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class GetTime(BaseModel):
        """The time in some hours."""

        hours: int = Field(ge=0, le=23)

    chat = ChatOpenAI(base_url=f"{served}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=MAX_TOKENS,
                      max_retries=0)
    # strict: the schema gets additionalProperties false, which a random model needs to ever finish its object
    bound = chat.bind_tools([GetTime], tool_choice="GetTime", strict=True)
    asked = [HumanMessage("What time is it in 3 hours?")]
    ai = bound.invoke(asked)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "GetTime"
    GetTime(**ai.tool_calls[0]["args"])  # validates
    answer = chat.bind_tools([GetTime], strict=True).invoke(asked + [ai, ToolMessage("It is noon.", tool_call_id=ai.tool_calls[0]["id"])])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")

    structured = chat.with_structured_output(GetTime, method="function_calling", strict=True).invoke("In 5 hours?")
    assert isinstance(structured, GetTime) and 0 <= structured.hours <= 23


@pytest.mark.slow
def test_smollm2_calls_tools_through_the_fallback(smollm2_gguf):
    proc, url = start_server(smollm2_gguf)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        llm = LLM(smollm2_gguf, threads=1)
        assert not ToolPlan.build(llm, MESSAGES, neutral_tools(TOOLS), ToolChoice("auto")).native
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               max_tokens=MAX_TOKENS, temperature=0)
            assert r.choices[0].finish_reason == "tool_calls"
            for c in r.choices[0].message.tool_calls:
                jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
            assert (r.choices[0].message.content, [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls],
                    r.choices[0].finish_reason) == reference(llm, MESSAGES, choice)[:3]
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=0)
        message = r.choices[0].message
        assert (message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
                r.choices[0].finish_reason) == reference(llm, MESSAGES, "auto", max_tokens=80)[:3]
        call = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              max_tokens=MAX_TOKENS, temperature=0).choices[0].message
        history = MESSAGES + [call.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "18 degrees and sunny"}]
        r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40,
                                           temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    finally:
        stop_server(proc)
