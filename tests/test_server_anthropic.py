"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) on a real `churon serve`
process, driven by the official anthropic client and parsed by its types (anthropic.types).

Every answer is checked against the engine in this process on the same model file: the conversation a
request's content blocks make, written out here by hand in chat-template form, rendered through the
tool-calling plan (or the chat template alone), then greedy.
"""

import asyncio
import json
import threading

import anthropic
import httpx2 as httpx
import jsonschema
import openai
import pytest
from anthropic.types import Message, TextBlock, ToolUseBlock

from churon import LLM, SamplingParams
from churon.tool_calls import Tool, ToolChoice, ToolPlan
from test_server import MODEL, start_server, stop_server

WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
WEATHER_TOOL = Tool("get_weather", WEATHER["description"], WEATHER["input_schema"])
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                             "required": ["zone"], "additionalProperties": False}}
GREEDY = {"temperature": 0}  # anthropic 2.15's create() has no sampling arguments: they go in the body
USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def gguf(qwen_tools_gguf):
    return qwen_tools_gguf


@pytest.fixture(scope="module")
def server(gguf):
    proc, url = start_server(gguf)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def llm(gguf):
    return LLM(gguf, threads=1)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def greedy(llm, ids, max_tokens, **kw):
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, **kw), use_tqdm=False)[0]


def reference(llm, messages, max_tokens, tools=(), choice=ToolChoice("auto"), parallel=True):
    """The engine's greedy answer to the conversation through the plan the server builds, and its parse."""
    plan = ToolPlan.build(llm, messages, list(tools), choice, parallel=parallel)
    out = llm.generate([plan.prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens, grammar=plan.grammar),
                       use_tqdm=False)[0]
    return plan, out, plan.parse(out.text)


def client_kw(body):
    """A raw body as the client's keyword arguments: the sampling fields it has no arguments for in extra_body."""
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}
    return {k: v for k, v in body.items() if k not in sampling} | {"extra_body": sampling}


def raw_events(server, body):
    """The stream's events as sent (the client's iterator drops pings): (SSE event name, data) pairs."""
    with httpx.stream("POST", f"{server}/v1/messages", json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    assert all(name == data["type"] for name, data in events)
    return events


# --- text ------------------------------------------------------------------------------------


def test_message_is_the_engines_greedy_answer(client, llm):
    r = client.messages.create(model=MODEL, max_tokens=8, system="be brief", messages=USER, extra_body=GREEDY)
    ids = llm.chat_prompt_ids([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    ref = greedy(llm, ids, 8)
    assert isinstance(r, Message) and r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    [block] = r.content
    assert isinstance(block, TextBlock) and block.text == ref.text
    assert ref.finish_reason == "length"  # the random model runs on: max_tokens cut it
    assert (r.stop_reason, r.stop_sequence, r.model) == ("max_tokens", None, MODEL)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ids), 8)
    # system as text blocks, content as text blocks: the same conversation
    blocks = client.messages.create(model=MODEL, max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}],
        system=[{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}], extra_body=GREEDY)
    ids2 = llm.chat_prompt_ids([{"role": "system", "content": "be\nbrief"}, {"role": "user", "content": "hello\nthere"}])
    assert blocks.content[0].text == greedy(llm, ids2, 8).text and blocks.usage.input_tokens == len(ids2)


def test_multi_turn_conversation_and_prefill(client, llm):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "and then?"}]
    r = client.messages.create(model=MODEL, max_tokens=6, messages=turns, extra_body=GREEDY)
    ids = llm.chat_prompt_ids(turns)
    assert r.content[0].text == greedy(llm, ids, 6).text and r.usage.input_tokens == len(ids)
    # a final assistant message is continued, not answered: its text follows the assistant's header
    prefilled = client.messages.create(model=MODEL, max_tokens=6, messages=[*turns, {"role": "assistant", "content": "Well,"}],
                                       extra_body=GREEDY)
    ids = llm.chat_prompt_ids(turns) + llm.tokenizer.encode("Well,", add_bos=False)
    assert prefilled.content[0].text == greedy(llm, ids, 6).text and prefilled.usage.input_tokens == len(ids)


def test_sampling_fields_reach_the_sampler(client, llm):
    ids = llm.chat_prompt_ids(USER)
    want = greedy(llm, ids, 12).text

    def text(**fields):
        r = client.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=fields)
        return "".join(b.text for b in r.content)  # no block when a draw ends the turn at once

    assert len({text(temperature=1.0) for _ in range(3)}) > 1  # Anthropic's default temperature samples
    # each field alone narrows a temperature-1 draw to the most likely token: the answer is the greedy one
    assert text(temperature=1.0, top_k=1) == want
    assert text(temperature=1.0, top_p=1e-6) == want


def test_stop_sequence_ends_the_answer_before_it(client, llm):
    free = greedy(llm, llm.chat_prompt_ids(USER), 30).text
    stop = free[10:13]
    r = client.messages.create(model=MODEL, max_tokens=30, messages=USER, stop_sequences=["@@never", stop],
                               extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == free[: free.index(stop)]
    with client.messages.stream(model=MODEL, max_tokens=30, messages=USER, stop_sequences=["@@never", stop],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop, r.content[0].text)


def test_end_turn_and_the_context_window(client, llm):
    # the model's own end-of-turn token: a prompt whose greedy answer ends by itself (the random model's
    # <|im_end|> is one of 400 tokens; these prompts were found by trying)
    for prompt in (f"question {i}" for i in range(40)):
        messages = [{"role": "user", "content": prompt}]
        ref = greedy(llm, llm.chat_prompt_ids(messages), 40)
        if ref.finish_reason == "stop":
            break
    else:
        pytest.fail("no prompt's greedy answer ended by itself")
    r = client.messages.create(model=MODEL, max_tokens=40, messages=messages, extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)
    assert r.content == ([TextBlock(type="text", text=ref.text)] if ref.text else [])
    assert r.usage.output_tokens == len(ref.token_ids)  # the end-of-turn token counts, as Anthropic bills it
    # max_tokens beyond what the context window leaves: the answer runs to the window's end
    n = 0
    while llm.max_model_len - len(llm.chat_prompt_ids([{"role": "user", "content": "go on " * n}])) > 30:
        n += 5  # about 20 tokens
    long = [{"role": "user", "content": "go on " * n}]
    ids = llm.chat_prompt_ids(long)
    room = llm.max_model_len - len(ids)
    ref = greedy(llm, ids, room)
    assert 0 < room <= 30 and ref.finish_reason == "length"
    r = client.messages.create(model=MODEL, max_tokens=200, messages=long, extra_body=GREEDY)
    assert r.stop_reason == "model_context_window_exceeded" and r.content[0].text == ref.text


def test_output_config_json_schema_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
              "required": ["ok", "kind"], "additionalProperties": False}
    r = client.messages.create(model=MODEL, max_tokens=60, messages=USER, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)
    free = client.messages.create(model=MODEL, max_tokens=20, messages=USER, extra_body=GREEDY)
    assert not free.content[0].text.lstrip().startswith("{")  # the random model alone writes no JSON


# --- streaming -------------------------------------------------------------------------------


def test_streamed_text_is_the_whole_answer_in_anthropics_event_sequence(server, client):
    body = {"model": MODEL, "max_tokens": 10, "messages": USER, "temperature": 0}
    whole = client.messages.create(**client_kw(body))
    events = raw_events(server, body)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for n, d in events if n == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                             "usage": {"output_tokens": 10}}


def test_stream_helper_accumulates_the_events(client):
    """The client's messages.stream() builds the Message from the events; it must equal the whole answer."""
    whole = client.messages.create(model=MODEL, max_tokens=9, messages=USER, system="be brief", extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=9, messages=USER, system="be brief", extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


# --- tools -----------------------------------------------------------------------------------


def test_forced_tool_use_is_the_plans_parse(client, llm):
    r = client.messages.create(model=MODEL, max_tokens=150, tools=[WEATHER], messages=[{"role": "user", "content": "Paris?"}],
                               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    _, out, (content, [call]) = reference(llm, [{"role": "user", "content": "Paris?"}], 150, [WEATHER_TOOL],
                                          ToolChoice("function", "get_weather"))
    [use] = [b for b in r.content if b.type == "tool_use"]
    assert isinstance(use, ToolUseBlock) and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == json.loads(call.arguments)
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert [b.text for b in r.content if b.type == "text"] == ([content] if content else [])
    assert r.stop_reason == "tool_use" and r.usage.output_tokens == len(out.token_ids)


def test_tool_choice_any_none_and_disable_parallel_tool_use(client, llm):
    messages = [{"role": "user", "content": "Paris and Rome?"}]
    tools = [WEATHER_TOOL, Tool("get_time", None, TIME["input_schema"])]
    r = client.messages.create(model=MODEL, max_tokens=150, tools=[WEATHER, TIME], messages=messages, extra_body=GREEDY,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    _, _, (_, [call]) = reference(llm, messages, 150, tools, ToolChoice("required"), parallel=False)
    [use] = [b for b in r.content if b.type == "tool_use"]
    assert (use.name, use.input, r.stop_reason) == (call.name, json.loads(call.arguments), "tool_use")
    r = client.messages.create(model=MODEL, max_tokens=20, tools=[WEATHER, TIME], tool_choice={"type": "none"},
                               messages=messages, extra_body=GREEDY)
    _, out, (content, calls) = reference(llm, messages, 20, tools, ToolChoice("none"))
    assert calls == [] and r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[out.finish_reason]
    assert [b.text for b in r.content] == ([content] if content else [])


def test_streamed_tool_use_events(server, client):
    body = {"model": MODEL, "max_tokens": 150, "tools": [WEATHER], "messages": [{"role": "user", "content": "Paris?"}],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 0}
    whole = client.messages.create(**client_kw(body))
    events = raw_events(server, body)
    [(_, start)] = [(n, d) for n, d in events if n == "content_block_start" and d["content_block"]["type"] == "tool_use"]
    index, block = start["index"], start["content_block"]
    assert block["input"] == {} and block["id"].startswith("toolu_") and block["name"] == "get_weather"
    fragments = [d["delta"] for n, d in events if n == "content_block_delta" and d["index"] == index]
    assert fragments and all(f["type"] == "input_json_delta" for f in fragments)
    [use] = [b for b in whole.content if b.type == "tool_use"]
    assert json.loads("".join(f["partial_json"] for f in fragments)) == use.input
    assert ("content_block_stop", {"type": "content_block_stop", "index": index}) in events
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(**client_kw(body)) as stream:
        final = stream.get_final_message()
    assert final.model_dump(exclude={"id"}, mode="json")["content"][index]["input"] == use.input
    assert [b.type for b in final.content] == [b.type for b in whole.content] and final.stop_reason == "tool_use"


def test_tool_use_round_trip(client, llm):
    question = {"role": "user", "content": "weather in Paris?"}
    first = client.messages.create(model=MODEL, max_tokens=150, tools=[WEATHER], messages=[question],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    [use] = [b for b in first.content if b.type == "tool_use"]
    answer = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": '{"celsius": 21}'}]},
        {"type": "text", "text": "thanks"}]}
    r = client.messages.create(model=MODEL, max_tokens=12, tools=[WEATHER], extra_body=GREEDY,
                               messages=[question, {"role": "assistant", "content": first.content}, answer])
    text = "".join(b.text for b in first.content if b.type == "text") or None
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": text, "tool_calls": [
                    {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": use.input}}]},
                {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": use.id, "name": "get_weather"},
                {"role": "user", "content": "thanks"}]
    plan, _, (content, calls) = reference(llm, messages, 12, [WEATHER_TOOL])
    assert "celsius" in llm.tokenizer.decode(plan.prompt_ids)  # the tool's result is in the prompt
    assert r.usage.input_tokens == len(plan.prompt_ids)
    assert [b.text for b in r.content if b.type == "text"] == ([content] if content else [])
    assert [b.input for b in r.content if b.type == "tool_use"] == [json.loads(c.arguments) for c in calls]
    # a tool_result's content as a plain string, is_error: the same prompt
    answer["content"][0] = {"type": "tool_result", "tool_use_id": use.id, "content": '{"celsius": 21}', "is_error": False}
    count = client.messages.count_tokens(model=MODEL, tools=[WEATHER],
                                         messages=[question, {"role": "assistant", "content": first.content}, answer])
    assert count.input_tokens == len(plan.prompt_ids)


# --- count_tokens, ignored fields ------------------------------------------------------------


def test_count_tokens_is_the_prompts_length(client, llm):
    r = client.messages.count_tokens(model=MODEL, system="be brief", messages=USER)
    assert r.input_tokens == len(llm.chat_prompt_ids([{"role": "system", "content": "be brief"}, *USER]))
    with_tools = client.messages.count_tokens(model=MODEL, messages=USER, tools=[WEATHER, TIME])
    plan = ToolPlan.build(llm, USER, [WEATHER_TOOL, Tool("get_time", None, TIME["input_schema"])], ToolChoice("auto"))
    assert with_tools.input_tokens == len(plan.prompt_ids) > r.input_tokens
    created = client.messages.create(model=MODEL, max_tokens=1, messages=USER, tools=[WEATHER, TIME])
    assert created.usage.input_tokens == with_tools.input_tokens


def test_fields_churon_does_not_implement_are_accepted_and_ignored(client, llm):
    plain = client.messages.create(model=MODEL, max_tokens=6, messages=USER, extra_body=GREEDY)
    r = client.messages.create(
        model=MODEL, max_tokens=6, metadata={"user_id": "u1"}, thinking={"type": "disabled"}, service_tier="auto",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello there", "cache_control": {"type": "ephemeral"}}]}],
        extra_body=GREEDY | {"some_vendor_field": 1})
    assert r.content[0].text == plain.content[0].text
    # thinking blocks an agent sends back from earlier turns are not part of the rendered conversation
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"},
                                                 {"type": "text", "text": "hello"}]},
               {"role": "user", "content": "and then?"}]
    r = client.messages.count_tokens(model=MODEL, messages=history)
    assert r.input_tokens == len(llm.chat_prompt_ids([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                                      {"role": "user", "content": "and then?"}]))


# --- errors ----------------------------------------------------------------------------------

OK = {"model": MODEL, "max_tokens": 4, "messages": USER}
ASSISTANT_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                    "input": {"city": "Paris"}}]}
BAD = [
    ("no max_tokens", "/v1/messages", {"model": MODEL, "messages": USER}, 400, "max_tokens"),
    ("no model", "/v1/messages", {"max_tokens": 4, "messages": USER}, 400, "model"),
    ("malformed JSON", "/v1/messages", b'{"model": "tiny",', 400, "JSON"),
    ("max_tokens zero", "/v1/messages", OK | {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a string", "/v1/messages", OK | {"max_tokens": "4"}, 400, "max_tokens"),
    ("no messages", "/v1/messages", OK | {"messages": []}, 400, "messages"),
    ("negative temperature", "/v1/messages", OK | {"temperature": -1}, 400, "temperature"),
    ("top_p zero", "/v1/messages", OK | {"top_p": 0}, 400, "top_p"),
    ("empty stop sequence", "/v1/messages", OK | {"stop_sequences": [""]}, 400, "stop_sequences"),
    ("bad role", "/v1/messages", OK | {"messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ("content a number", "/v1/messages", OK | {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("image block", "/v1/messages", OK | {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, 400, "messages.0.content.0"),
    ("tool_result without tool_use_id", "/v1/messages", OK | {"messages": [USER[0], ASSISTANT_USE, {"role": "user", "content": [
        {"type": "tool_result", "content": "sunny"}]}]}, 400, "messages.2.content.0.tool_result.tool_use_id"),
    ("tool_result of no tool_use", "/v1/messages", OK | {"messages": [USER[0], ASSISTANT_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"}]}]}, 400, "messages.2.content.0.tool_use_id"),
    ("tool_result from the assistant", "/v1/messages", OK | {"messages": [USER[0], {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}, USER[0]]}, 400, "messages.1.content.0"),
    ("tool_use from the user", "/v1/messages", OK | {"messages": [{"role": "user", "content": ASSISTANT_USE["content"]}]},
     400, "messages.0.content.0"),
    ("tool_use without input", "/v1/messages", OK | {"messages": [USER[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather"}]}, USER[0]]}, 400, "messages.1.content.0.tool_use.input"),
    ("unknown tool in tool_choice", "/v1/messages", OK | {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     400, "tool_choice.name"),
    ("tool_choice tool without name", "/v1/messages", OK | {"tools": [WEATHER], "tool_choice": {"type": "tool"}},
     400, "tool_choice.name"),
    ("unknown tool_choice type", "/v1/messages", OK | {"tools": [WEATHER], "tool_choice": {"type": "some"}},
     400, "tool_choice.type"),
    ("tool without input_schema", "/v1/messages", OK | {"tools": [{"name": "x"}]}, 400, "tools.0.input_schema"),
    ("bad tool name", "/v1/messages", OK | {"tools": [WEATHER | {"name": "no spaces"}]}, 400, "tools.0.name"),
    ("two tools of one name", "/v1/messages", OK | {"tools": [WEATHER, WEATHER]}, 400, "tools.1.name"),
    ("input_schema not an object schema", "/v1/messages", OK | {"tools": [WEATHER | {"input_schema": {"type": "string"}}]},
     400, "tools.0.input_schema"),
    ("tool_choice any without tools", "/v1/messages", OK | {"tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ("invalid output schema", "/v1/messages", OK | {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
     400, "output_config.format.schema"),
    ("prefill with a forced tool", "/v1/messages", OK | {"messages": [USER[0], {"role": "assistant", "content": "Sure"}],
     "tools": [WEATHER], "tool_choice": {"type": "any"}}, 400, "messages.1"),
    ("server tool", "/v1/messages", OK | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0"),
    ("prompt over the context", "/v1/messages", OK | {"messages": [{"role": "user", "content": "hi " * 2100}]}, 400, "messages"),
    ("unknown model", "/v1/messages", OK | {"model": "claude-opus-4"}, 404, "model"),
    ("count_tokens without messages", "/v1/messages/count_tokens", {"model": MODEL}, 400, "messages"),
    ("unknown route under /v1/messages", "/v1/messages/batches", OK, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,field", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_an_anthropic_error_naming_the_field(server, name, path, body, status, field):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert field is None or field in error["error"]["message"], error["error"]["message"]


def test_the_client_raises_its_own_errors(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=USER, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    assert e.value.type == "invalid_request_error" and "tool_choice" in e.value.api_message
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=USER)
    assert e.value.type == "not_found_error" and "claude-opus-4" in e.value.api_message
    with pytest.raises(anthropic.BadRequestError) as e:
        with client.messages.stream(model=MODEL, max_tokens=0, messages=USER) as stream:
            stream.get_final_message()
    assert "max_tokens" in e.value.api_message


def test_openai_paths_keep_openais_error_shape(server):
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": USER, "max_tokens": 0})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "max_tokens"


# --- API key, body limit, queue --------------------------------------------------------------


def test_x_api_key_body_limit_and_queue_limit_in_anthropics_shape(gguf, llm):
    proc, url = start_server(gguf, "--api-key", "sekret", "--max-queue", "1", "--max-num-seqs", "1",
                             "--max-body-bytes", "20000")
    try:
        keyed = anthropic.Anthropic(base_url=url, api_key="sekret", max_retries=0)
        r = keyed.messages.create(model=MODEL, max_tokens=3, messages=USER, extra_body=GREEDY)
        assert r.content[0].text == greedy(llm, llm.chat_prompt_ids(USER), 3).text
        bearer = anthropic.Anthropic(base_url=url, auth_token="sekret", max_retries=0)  # Authorization: Bearer
        assert bearer.messages.count_tokens(model=MODEL, messages=USER).input_tokens == r.usage.input_tokens
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=3, messages=USER)
        assert e.value.type == "authentication_error" and "x-api-key" in e.value.api_message
        # the OpenAI routes take the x-api-key too, and keep their own shape when it is wrong
        assert httpx.get(f"{url}/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
        wrong = httpx.get(f"{url}/v1/models", headers={"x-api-key": "wrong"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(anthropic.APIStatusError) as e:
            keyed.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "x" * 30000}])
        assert e.value.status_code == 413 and e.value.type == "request_too_large" and "20000 bytes" in e.value.api_message
        assert openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0).models.list().data[0].id == MODEL

        # one batch slot, one request may wait: of 6 long requests at once, some are turned away (Anthropic's 503s)
        body = {"model": MODEL, "max_tokens": 200, "messages": [{"role": "user", "content": "a long story"}]}

        async def burst():
            async with httpx.AsyncClient(timeout=120, headers={"x-api-key": "sekret"}) as http:
                return await asyncio.gather(*(http.post(f"{url}/v1/messages", json=body) for _ in range(6)))

        responses = asyncio.run(burst())
        busy = [r for r in responses if r.status_code == 503]
        assert busy and len(busy) < 6 and all(r.status_code in (200, 503) for r in responses)
        for r in busy:
            assert r.headers["retry-after"] == "1" and r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "overloaded_error" and "--max-queue" in r.json()["error"]["message"]
    finally:
        stop_server(proc)


# --- in-process: loading, engine failures ----------------------------------------------------


def test_loading_and_engine_failures_are_anthropic_errors(gguf, monkeypatch):
    from churon.server import create_app

    loaded = threading.Event()
    llm = LLM(gguf, threads=1)

    def load():
        loaded.wait(60)
        return llm

    app = create_app(load, MODEL)

    def broken_step(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                r = await http.post("/v1/messages", json=OK)
                assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
                assert "still loading" in r.json()["error"]["message"]
                loaded.set()
                for _ in range(600):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                with monkeypatch.context() as m:
                    m.setattr(llm.engine.runner, "execute", broken_step)
                    r = await http.post("/v1/messages", json=OK)
                assert r.status_code == 500
                assert r.json() == {"type": "error", "error": {"type": "api_error",
                                                               "message": "internal error: RuntimeError: kernel exploded"}}
                r = await http.post("/v1/messages", json=OK)
                assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1

    asyncio.run(main())


# --- the real model --------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_tool_use_round_trip(smollm2_gguf):
    proc, url = start_server(smollm2_gguf, "--threads", "2")
    try:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        question = {"role": "user", "content": "What is the weather in Paris?"}
        first = client.messages.create(model=MODEL, max_tokens=150, tools=[WEATHER], messages=[question], extra_body=GREEDY,
                                       tool_choice={"type": "any"})
        [use] = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER["input_schema"])
        answer = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}
        with client.messages.stream(model=MODEL, max_tokens=40, tools=[WEATHER], extra_body=GREEDY,
                                    messages=[question, {"role": "assistant", "content": first.content}, answer]) as stream:
            final = stream.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.content
    finally:
        stop_server(proc)
