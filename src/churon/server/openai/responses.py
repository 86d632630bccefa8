"""POST /v1/responses: OpenAI's Responses API, answered whole or streamed as its typed events; GET and
DELETE /v1/responses/{id} for the responses the server keeps (response_store.py).

A request's input becomes one chat-template conversation: `instructions` as the system message, then
the conversation a `previous_response_id` ended, then the input items. It runs through the tool-calling
plan (churon.tool_calls) as chat's does; the output is `message` and `function_call` items, one
OutputItems state machine building them for both the whole answer and the stream's events.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request

from churon.engine import CompletionOutput
from churon.sampling import SamplingParams
from churon.server.errors import APIError
from churon.server.generation import EngineRequest, Generation, finish_generation, start_generation
from churon.server.offload import build_plan
from churon.server.openai.response_store import ResponseStore, StoredResponse
from churon.server.openai.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
)
from churon.server.openai.streaming import named_sse
from churon.server.state import ServerState, server_state
from churon.tool_calls import (
    TextDelta,
    Tool,
    ToolCallArguments,
    ToolCallError,
    ToolCallStart,
    ToolChoice,
    ToolPlan,
)

router = APIRouter()


def response_store(request: Request) -> ResponseStore:
    """The app's kept responses: one store per server, made on its first use (on app.state, beside the
    ServerState, which knows nothing of any one API)."""
    app_state = request.app.state
    if not hasattr(app_state, "responses"):
        app_state.responses = ResponseStore()
    return app_state.responses


Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """OpenAI's Responses ids: resp_..., msg_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


# --- the input: items -> chat-template messages --------------------------------------------


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def input_messages(input: str | list[InputItem], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat-template messages. A function_call joins the assistant turn before it (its text,
    the calls before it); a function_call_output is a tool message, named after its call (in the input
    or the history)."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    names = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls", ())}
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(input):
        if isinstance(item, MessageItem):
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            try:
                arguments = json.loads(item.arguments)
            except json.JSONDecodeError as e:
                raise APIError(400, f"input[{i}].arguments is not valid JSON: {e}", param=f"input.{i}.arguments")
            if not isinstance(arguments, dict):
                raise APIError(400, f"input[{i}].arguments must be a JSON object", param=f"input.{i}.arguments")
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
            names[item.call_id] = item.name
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id}
            if item.call_id in names:
                message["name"] = names[item.call_id]
            messages.append(message)
    return messages


def _tools(body: ResponsesRequest) -> tuple[list[Tool], ToolChoice]:
    tools = [Tool(t.name, t.description, t.parameters) for t in body.tools]
    c = body.tool_choice
    return tools, ToolChoice(c) if isinstance(c, str) else ToolChoice("function", c.name)


def _json_schema(body: ResponsesRequest) -> dict | None:
    f = body.text.format if body.text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "object"}
    if f.schema_ is None:
        raise APIError(400, "text.format json_schema needs its schema field", param="text.format.schema")
    return f.schema_


async def _plan(llm, body: ResponsesRequest, messages: list[dict[str, Any]]) -> ToolPlan:
    tools, choice = _tools(body)
    try:
        return await build_plan(llm, messages, tools, choice, parallel=body.parallel_tool_calls,
                                json_schema=_json_schema(body))
    except ToolCallError as e:
        # the plan's messages come of the input items and the history, not one to one: "input" is what
        # names them; the others are this body's own fields, dotted as the rest of its 400s ("tools.0.name")
        if e.param.startswith("messages"):
            param = "input"
        elif e.param == "json_schema":
            param = "text.format.schema"
        else:
            param = re.sub(r"\[(\d+)\]", r".\1", e.param)
        raise APIError(400, str(e), param=param)


def _sampling_params(body: ResponsesRequest, max_tokens: int, grammar: str | None) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, grammar=grammar,
                              temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p)
    except ValueError as e:
        named = re.match(r"invalid sampling parameter (\w+)=", str(e))
        raise APIError(400, str(e), param=named.group(1) if named else None)


# --- the output: items, and the events that build them --------------------------------------


class OutputItems:
    """The response's output items, built from the plan's parsed pieces (TextDelta, ToolCallStart,
    ToolCallArguments). Each method returns the stream events its step makes: an item is added, grows,
    and is done when a piece of another kind (or the end) comes."""

    def __init__(self, event: Callable[..., Event]):
        self.event = event
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def feed(self, piece: TextDelta | ToolCallStart | ToolCallArguments) -> list[Event]:
        events: list[Event] = []
        if isinstance(piece, TextDelta):
            if not piece.text:
                return events
            if self._open is None or self._open["type"] != "message":
                events += self._close() + self._add_message()
            self._open["content"][0]["text"] += piece.text
            events.append(self.event("response.output_text.delta", item_id=self._open["id"], output_index=len(self.items) - 1,
                                     content_index=0, delta=piece.text, logprobs=[]))
        elif isinstance(piece, ToolCallStart):
            events += self._close()
            self._open = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": piece.id,
                          "name": piece.name, "arguments": ""}
            events += self._add(self._open)
        elif isinstance(piece, ToolCallArguments) and piece.fragment:
            self._open["arguments"] += piece.fragment
            events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                     output_index=len(self.items) - 1, delta=piece.fragment))
        return events

    def finish(self, status: str) -> list[Event]:
        """The end: the open item is done with `status` ("incomplete" where max_output_tokens cut it). An
        output with nothing in it is one empty message, as a model that said nothing said that."""
        events = self._add_message() if not self.items else []
        return events + self._close(status)

    def _add_message(self) -> list[Event]:
        self._open = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        events = self._add(self._open)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open["content"].append(part)
        return events + [self.event("response.content_part.added", item_id=self._open["id"],
                                    output_index=len(self.items) - 1, content_index=0, part=dict(part))]

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))]

    def _close(self, status: str = "completed") -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = len(self.items) - 1, []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=_copy(part)))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     arguments=item["arguments"]))
        item["status"] = status
        return events + [self.event("response.output_item.done", output_index=index, item=_copy(item))]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))  # an event's snapshot: later deltas must not change what was sent


def _assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the chat template's assistant turn, for a later previous_response_id."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": _arguments(i)}}
             for i in items if i["type"] == "function_call"]
    return {"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {})


def _arguments(item: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(item["arguments"])
    except json.JSONDecodeError:  # a call max_output_tokens cut short: the template still needs an object
        return {}
    return arguments if isinstance(arguments, dict) else {}


# --- the Response object ----------------------------------------------------------------------


class ResponseBuilder:
    """One request's Response object: the request's settings echoed, the output and usage once known."""

    def __init__(self, body: ResponsesRequest, model: str, prompt_tokens: int):
        self.id = new_id("resp")
        self.body = body
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]] | None = None,
                 result: CompletionOutput | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
        b = self.body
        text_format = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        usage = None
        if result is not None:
            usage = {"input_tokens": self.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": result.metrics.cached_prompt_tokens, "cache_write_tokens": 0},
                     "output_tokens": len(result.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.prompt_tokens + len(result.token_ids)}
        tool_choice = b.tool_choice if isinstance(b.tool_choice, str) else b.tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output or [], "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "temperature": 1.0 if b.temperature is None else b.temperature, "top_p": 1.0 if b.top_p is None else b.top_p,
            "tool_choice": tool_choice, "tools": [t.model_dump() for t in b.tools],
            "text": {"format": text_format}, "truncation": "disabled", "store": b.store,
            "metadata": b.metadata or {}, "user": b.user, "usage": usage,
        }


def _status(result: CompletionOutput) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


# --- the routes ---------------------------------------------------------------------------------


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, state: ServerState = Depends(server_state),
                          store: ResponseStore = Depends(response_store)):
    served = await state.model_for(request, body.model, "generate")
    llm = served.llm
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise APIError(404, f"previous response with id {body.previous_response_id!r} not found",
                           param="previous_response_id", code="previous_response_not_found")
        history = previous.messages
    conversation = history + input_messages(body.input, history)
    if not conversation:
        raise APIError(400, "input has no items, and no previous_response_id holds a conversation", param="input")
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    plan = await _plan(llm, body, instructions + conversation)
    state.limits.check_prompt_tokens(len(plan.prompt_ids), "input")
    max_tokens = body.max_output_tokens
    if max_tokens is None:  # as chat's: whatever the context leaves
        max_tokens = max(1, llm.max_model_len - len(plan.prompt_ids))
    elif max_tokens < 1:
        raise APIError(400, f"max_output_tokens={max_tokens}: must be >= 1", param="max_output_tokens")
    params = _sampling_params(body, max_tokens, plan.grammar)
    generation = await start_generation(request, state, served, [EngineRequest(plan.prompt_ids, params)],
                                        prompt_param="input")
    builder = ResponseBuilder(body, served.name, len(plan.prompt_ids))

    def keep(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if body.store:
            store.put(StoredResponse(response, conversation + [_assistant_message(items)]))

    if body.stream:
        return named_sse(_stream(generation, plan, builder, keep))
    [result] = await finish_generation(request, generation)
    output = OutputItems(lambda type, **fields: {})  # the whole answer: the stream's items, no events sent
    content, calls = plan.parse(result.text)
    pieces = [TextDelta(content or "")]
    for index, call in enumerate(calls):
        pieces += [ToolCallStart(index, call.id, call.name), ToolCallArguments(index, call.arguments)]
    for piece in pieces:
        output.feed(piece)
    status = _status(result)
    output.finish(status)
    response = builder.response(status, output.items, result)
    keep(response, output.items)
    return response


async def _stream(generation: Generation, plan: ToolPlan, builder: ResponseBuilder,
                  keep: Callable[[dict[str, Any], list[dict[str, Any]]], None]) -> AsyncIterator[Event]:
    numbers = itertools.count()

    def event(type: str, **fields: Any) -> Event:
        return {"type": type, "sequence_number": next(numbers), **fields}

    yield event("response.created", response=builder.response("in_progress"))
    yield event("response.in_progress", response=builder.response("in_progress"))
    output, parser = OutputItems(event), plan.stream()
    try:
        async for _, delta in generation.deltas():
            for piece in parser.feed(delta.text):
                for e in output.feed(piece):
                    yield e
            if delta.finish_reason is not None:
                result = delta.output
        for piece in parser.finish():
            for e in output.feed(piece):
                yield e
    except Exception as e:  # the engine failed mid-stream: the status is sent, so the stream says it
        error = {"code": "server_error", "message": str(e) or type(e).__name__}
        yield event("response.failed", response=builder.response("failed", output.items, error=error))
        return
    status = _status(result)
    for e in output.finish(status):
        yield e
    response = builder.response(status, output.items, result)
    keep(response, output.items)
    yield event("response.completed" if status == "completed" else "response.incomplete", response=response)


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise APIError(404, f"response with id {response_id!r} not found", param="response_id", code="response_not_found")
    return stored


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, store: ResponseStore = Depends(response_store)) -> dict[str, Any]:
    return _stored(store, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, store: ResponseStore = Depends(response_store)) -> dict[str, Any]:
    _stored(store, response_id)
    store.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
