"""POST /v1/responses (OpenAI's Responses API) on a real `churon serve` process, driven by the official
openai client and parsed by its types (openai.types.responses).

Every answer is checked against the engine in this process on the same model file: the conversation a
request's items make, rendered by the model's chat template (the tool-calling plan where tools are
given), then greedy. A previous_response_id continues a conversation exactly as sending it whole does.
"""

import asyncio
import json

import httpx2 as httpx
import jsonschema
import openai
import pytest
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)

from churon import LLM, SamplingParams
from churon.server import create_app
from churon.server.openai.response_store import ResponseStore, StoredResponse
from churon.tool_calls import Tool, ToolChoice, ToolPlan
from test_server import MODEL, start_server, stop_server

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
ANSWER_FORMAT = {"format": {"type": "json_schema", "name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
    "required": ["ok", "kind"], "additionalProperties": False}}}
WEATHER_TOOL = Tool("get_weather", WEATHER["description"], WEATHER["parameters"])


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
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def reference(llm, messages, max_tokens, tools=(), choice=ToolChoice("auto"), json_schema=None, parallel=True):
    """The engine's greedy answer to the conversation, through the same plan the server builds, parsed."""
    plan = ToolPlan.build(llm, messages, list(tools), choice, parallel=parallel, json_schema=json_schema)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, grammar=plan.grammar)
    out = llm.generate([plan.prompt_ids], params, use_tqdm=False)[0]
    return plan, out, plan.parse(out.text)


def events_of(stream):
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


# --- text ------------------------------------------------------------------------------------


def test_text_response_is_the_engines_greedy_answer(client, llm):
    r = client.responses.create(model=MODEL, instructions="be brief", input="hello there", temperature=0,
                                max_output_tokens=8)
    ids = llm.chat_prompt_ids([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert isinstance(r, Response) and r.object == "response" and r.id.startswith("resp_")
    [message] = r.output
    assert isinstance(message, ResponseOutputMessage) and message.id.startswith("msg_") and message.role == "assistant"
    assert r.output_text == ref.text and message.content[0].type == "output_text"
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    assert ref.finish_reason == "length"  # the random model runs on: max_output_tokens cut it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    assert (r.instructions, r.max_output_tokens, r.temperature, r.model, r.store) == ("be brief", 8, 0, MODEL, True)


def test_message_items_are_the_chat_templates_messages(client, llm):
    items = [{"role": "developer", "content": "answer in French"},
             {"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "bonjour", "annotations": []}]},
             {"role": "user", "content": "and then?"}]
    r = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=6)
    messages = [{"role": "system", "content": "answer in French"}, {"role": "user", "content": "hi\nthere"},
                {"role": "assistant", "content": "bonjour"}, {"role": "user", "content": "and then?"}]
    ids = llm.chat_prompt_ids(messages)
    assert r.usage.input_tokens == len(ids)
    assert r.output_text == llm.generate([ids], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].text


def test_streamed_text_is_the_whole_answer_in_the_responses_event_sequence(client):
    whole = client.responses.create(model=MODEL, input="tell me a story", temperature=0, max_output_tokens=10)
    events = events_of(client.responses.create(model=MODEL, input="tell me a story", temperature=0,
                                               max_output_tokens=10, stream=True))
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert [type(e) for e in events] == [
        ResponseCreatedEvent, ResponseInProgressEvent, ResponseOutputItemAddedEvent, ResponseContentPartAddedEvent,
        *[ResponseTextDeltaEvent] * len(deltas),
        ResponseTextDoneEvent, ResponseContentPartDoneEvent, ResponseOutputItemDoneEvent, ResponseIncompleteEvent]
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    item_id = events[2].item.id
    assert events[2].item.status == "in_progress" and events[3].part.text == ""
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text and events[-4].text == text and events[-3].part.text == text
    assert events[-2].item.content[0].text == text and events[-2].item.status == "incomplete"
    assert final.status == "incomplete" and final.output_text == text and final.usage.output_tokens == 10
    assert final.output[0].id == item_id


def test_stream_helper_accumulates_the_events(client):
    """The client's responses.stream() checks every event against the snapshot it builds; its final
    response is a completed one's (a JSON answer ends itself; max_output_tokens would end it incomplete)."""
    kw = dict(model=MODEL, input="once upon", temperature=0, max_output_tokens=120, text=ANSWER_FORMAT)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and text == final.output_text == whole.output_text


def test_json_schema_text_format_completes_with_valid_json(client, llm):
    schema = ANSWER_FORMAT["format"]["schema"]
    r = client.responses.create(model=MODEL, input="hello there", temperature=0, max_output_tokens=120, text=ANSWER_FORMAT)
    assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    _, _, (content, _) = reference(llm, [{"role": "user", "content": "hello there"}], 120, json_schema=schema)
    assert r.output_text == content
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == schema


# --- function tools --------------------------------------------------------------------------


def test_function_call_output_item_is_the_plans_parse(client, llm):
    # one call: the random model, left to make several, makes them until max_output_tokens
    r = client.responses.create(model=MODEL, input="weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, temperature=0, max_output_tokens=120)
    _, out, (_, [call]) = reference(llm, [{"role": "user", "content": "weather in Paris?"}], 120,
                                          [WEATHER_TOOL], ToolChoice("required"), parallel=False)
    [item] = [i for i in r.output if i.type == "function_call"]
    assert isinstance(item, ResponseFunctionToolCall) and item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert (item.name, item.arguments, item.status) == ("get_weather", call.arguments, "completed")
    jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
    assert r.status == "completed" and r.usage.output_tokens == len(out.token_ids)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required" and r.parallel_tool_calls is False


def test_streamed_function_call_events(client):
    kw = dict(model=MODEL, input="weather in Paris?", tools=[WEATHER], temperature=0, max_output_tokens=120,
              tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(**kw)
    events = events_of(client.responses.create(stream=True, **kw))
    assert isinstance(events[-1], ResponseCompletedEvent)
    final = events[-1].response
    fresh = {"id", "call_id"}  # each response's own
    assert [i.model_dump(exclude=fresh) for i in final.output] == [i.model_dump(exclude=fresh) for i in whole.output]
    index = next(i for i, item in enumerate(final.output) if item.type == "function_call")
    item = final.output[index]
    added = [e for e in events if isinstance(e, ResponseOutputItemAddedEvent) and e.output_index == index]
    assert added[0].item.type == "function_call" and added[0].item.arguments == "" and added[0].item.id == item.id
    deltas = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)]
    assert deltas and all(e.item_id == item.id and e.output_index == index for e in deltas)
    [done] = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDoneEvent)]
    assert "".join(e.delta for e in deltas) == done.arguments == item.arguments
    [item_done] = [e for e in events if isinstance(e, ResponseOutputItemDoneEvent) and e.output_index == index]
    assert item_done.item.status == "completed" and item_done.item.call_id == item.call_id
    with client.responses.stream(**kw) as stream:
        assert stream.get_final_response().output[index].arguments == item.arguments


def test_function_call_output_round_trip_whole_and_by_previous_response_id(client, llm):
    first = client.responses.create(model=MODEL, input="weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=120)
    [call] = [i for i in first.output if i.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}
    whole = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=12,
                                    input=[{"role": "user", "content": "weather in Paris?"}, *first.output, result])
    chained = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=12,
                                      previous_response_id=first.id, input=[result])
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}]},
                {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": call.call_id, "name": "get_weather"}]
    plan, out, _ = reference(llm, messages, 12, [WEATHER_TOOL])
    assert "celsius" in llm.tokenizer.decode(plan.prompt_ids)  # the tool's result is in the prompt
    for r in (whole, chained):
        assert r.usage.input_tokens == len(plan.prompt_ids)
        assert [i.model_dump(exclude={"id", "call_id"}) for i in r.output] == [
            i.model_dump(exclude={"id", "call_id"}) for i in whole.output]
        assert r.usage.output_tokens == len(out.token_ids)
    assert chained.previous_response_id == first.id


# --- kept responses ----------------------------------------------------------------------------


def test_stored_responses_get_delete_and_store_false(server, client):
    r = client.responses.create(model=MODEL, input="keep me", temperature=0, max_output_tokens=3)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    gone = httpx.delete(f"{server}/v1/responses/{r.id}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    unkept = client.responses.create(model=MODEL, input="forget me", temperature=0, max_output_tokens=3, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="more", previous_response_id=unkept.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


def test_previous_response_id_continues_the_text_conversation(client, llm):
    first = client.responses.create(model=MODEL, instructions="be brief", input="hi", temperature=0, max_output_tokens=4)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="and then?", temperature=0,
                                     max_output_tokens=4)
    # the instructions do not carry over (OpenAI's rule); the conversation does
    ids = llm.chat_prompt_ids([{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "and then?"}])
    assert second.usage.input_tokens == len(ids)
    assert second.output_text == llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].text


def test_the_store_forgets_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for id in ("a", "b"):
        store.put(StoredResponse({"id": id}, []))
    assert store.get("a") is not None  # now b is the least recently used
    store.put(StoredResponse({"id": "c"}, []))
    assert (store.get("b"), len(store)) == (None, 2)
    assert store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a")


# --- bad input -----------------------------------------------------------------------------------


BAD = [
    ("input of the wrong type", {"input": 5}, "input"),
    ("no input", {}, "input"),
    ("empty input", {"input": []}, "input"),
    ("an item type churon lacks", {"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ("function_call without call_id", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input.0.call_id"),
    ("function_call arguments not JSON", {"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]}, "input.0.arguments"),
    ("an image part", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ("a hosted tool", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("tool_choice naming no tool", {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
     "tool_choice"),
    ("zero max_output_tokens", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("negative temperature", {"input": "hi", "temperature": -1}, "temperature"),
    ("top_p above one", {"input": "hi", "top_p": 1.5}, "top_p"),
    ("json_schema without schema", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ("an invalid JSON schema", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}}, "text.format.schema"),
    ("a tool's invalid parameters schema", {"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "array"}}]},
     "tools.0.parameters"),
    ("input over the context", {"input": "hi " * 2100}, "input"),
    ("stream not a bool", {"input": "hi", "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(server, name, body, param):
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_an_engine_failure_mid_stream_is_a_response_failed_event(gguf, monkeypatch):
    """The 200 and the first events are sent: the stream itself says the response failed, in named events."""
    llm = LLM(gguf, threads=1)
    app = create_app(lambda: llm, MODEL)
    execute, steps = llm.engine.runner.execute, []

    def failing_after_five_steps(*args, **kwargs):
        steps.append(1)
        if len(steps) > 5:
            raise RuntimeError("kernel exploded")
        return execute(*args, **kwargs)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                while (await http.get("/health")).status_code != 200:
                    await asyncio.sleep(0.05)
                monkeypatch.setattr(llm.engine.runner, "execute", failing_after_five_steps)
                return await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 12, "temperature": 0,
                                                                  "stream": True})

    r = asyncio.run(main())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b.split("\n") for b in r.text.strip().split("\n\n")]
    events = [json.loads(data.removeprefix("data: ")) for _, data in blocks]
    assert [name.removeprefix("event: ") for name, _ in blocks] == [e["type"] for e in events]
    failed = ResponseFailedEvent.model_validate(events[-1])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert failed.response.status == "failed" and failed.response.error.code == "server_error"
    assert "kernel exploded" in failed.response.error.message
    # the answer so far was sent, and is the failed response's output
    sent = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert sent and failed.response.output[0].content[0].text == sent


def test_unknown_previous_response_id_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    assert e.value.status_code == 404 and e.value.body["code"] == "previous_response_not_found"


@pytest.mark.slow
def test_smollm2_function_call_round_trip_on_the_fallback_template(smollm2_gguf):
    """SmolLM2's template has no tools: the plan's fallback describes them and constrains the call."""
    proc, url = start_server(smollm2_gguf, "--threads", "2")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        question = "What is the weather in Paris?"
        first = client.responses.create(model=MODEL, input=question, tools=[WEATHER], parallel_tool_calls=False,
                                        tool_choice="required", temperature=0, max_output_tokens=60)
        [call] = first.output
        assert call.type == "function_call" and call.name == "get_weather" and first.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        llm = LLM(smollm2_gguf, threads=2)
        _, _, (_, [ref]) = reference(llm, [{"role": "user", "content": question}], 60, [WEATHER_TOOL],
                                     ToolChoice("required"), parallel=False)
        assert call.arguments == ref.arguments
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
        answer = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                         tool_choice="none", temperature=0, max_output_tokens=24)
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}]},
                    {"role": "tool", "content": "sunny, 21 C", "tool_call_id": call.call_id, "name": "get_weather"}]
        _, out, (content, _) = reference(llm, messages, 24, [WEATHER_TOOL], ToolChoice("none"))
        assert answer.output_text == content and answer.usage.output_tokens == len(out.token_ids) > 0
    finally:
        stop_server(proc)
