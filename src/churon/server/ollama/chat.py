"""POST /api/chat: a conversation through the model's chat template (a created model's SYSTEM and MESSAGEs
before it, its TEMPLATE in place of the model's), answered whole (stream: false) or as NDJSON message
objects. With `tools`, a ToolPlan (churon.tool_calls) renders them and parses the calls back out, which
come as Ollama returns them: message.tool_calls, each {function: {name, arguments}}, arguments an object.

A request with no messages loads the model (done_reason "load"), or with keep_alive 0 unloads it
("unload"), as Ollama answers."""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request

from churon.server.errors import APIError
from churon.server.generation import EngineRequest, Generation, finish_generation, start_generation
from churon.server.offload import build_plan
from churon.server.ollama import render
from churon.server.ollama.completion import created_parameters, keep_alive_seconds, no_images, templated, with_model
from churon.server.ollama.protocol import ChatRequest, Message
from churon.server.ollama.render import Timer
from churon.server.ollama.sampling import context_length, format_schema, merged_options, sampling_params
from churon.server.state import ServedModel, ServerState, server_state
from churon.tool_calls import TextDelta, Tool, ToolCall, ToolCallArguments, ToolCallError, ToolCallStart, ToolChoice, ToolPlan
from churon.tool_calls import plan as tool_plan

router = APIRouter()


def template_messages(messages: list[Message], model: str) -> list[dict[str, Any]]:
    """Ollama's messages as chat templates take them. Ollama's calls have no ids and its tool results name the
    tool, not the call: each call gets an id, and each tool message answers the earliest call not yet answered."""
    out, unanswered = [], []
    for i, m in enumerate(messages):
        no_images(m.images, f"messages[{i}].images", model)
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function", "function": c.function.model_dump()}
                                     for j, c in enumerate(m.tool_calls)]
            unanswered += [c["id"] for c in message["tool_calls"]]
        if m.role == "tool":
            message["tool_call_id"] = unanswered.pop(0) if unanswered else f"call_{i}"
            if m.tool_name is not None:
                message["name"] = m.tool_name
        out.append(message)
    try:
        return tool_plan.template_messages(out)
    except ToolCallError as e:
        raise APIError(400, str(e), param=e.param)


def conversation(served: ServedModel, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A created model's seeded MESSAGEs, then the request's; its SYSTEM first unless the request has one."""
    return messages if served.created is None else served.created.conversation(messages)


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request, state: ServerState = Depends(server_state)):
    if not body.messages:
        return await load_or_unload(request, state, body.model, body.keep_alive, {"message": render.message("")})

    async def work(served: ServedModel, timer: Timer):
        created = served.created
        llm = templated(served.llm, created.template if created is not None else None)
        options = merged_options(created_parameters(served), body.options)
        tools = [Tool(t.function.name, t.function.description, t.function.parameters) for t in body.tools or []]
        schema = format_schema(body.format)
        messages = conversation(served, template_messages(body.messages, body.model))
        try:  # with tools in play the format is part of the grammar; without them it is the sampler's json_schema
            plan = await build_plan(llm, messages, tools, ToolChoice("auto" if tools else "none"),
                                    json_schema=schema if tools else None)
        except ToolCallError as e:  # bad tools, or the chat template refused the conversation
            param = "format" if e.param == "json_schema" else e.param.replace("parameters", "function.parameters")
            raise APIError(400, str(e), param=param)
        state.limits.check_prompt_tokens(len(plan.prompt_ids), "messages")
        state.limits.check_stop(options.get("stop") or [], "options.stop")
        context = context_length(options, llm.max_model_len)
        params = sampling_params(options, len(plan.prompt_ids), context, json_schema=None if tools else schema)
        if plan.grammar is not None:
            params = dataclasses.replace(params, grammar=plan.grammar)
        generation = await start_generation(request, state, served, [EngineRequest(plan.prompt_ids, params)],
                                            prompt_param="messages")
        if body.stream:
            return _chat_stream(generation, plan, body.model, timer)
        [output] = await finish_generation(request, generation)
        content, calls = plan.parse(output.text)
        return render.header(body.model) | {"message": render.message(content or "", calls)} | render.final_fields(output, timer)

    return await with_model(request, state, body.model, "generate", body.keep_alive, work)


async def _chat_stream(generation: Generation, plan: ToolPlan, model: str, timer: Timer) -> AsyncIterator[dict[str, Any]]:
    parser = plan.stream()
    calls: dict[int, ToolCall] = {}
    sent: set[int] = set()  # calls are sent whole, once complete, as Ollama streams them
    async for _, d in generation.deltas():
        events = parser.feed(d.text) if d.text else []
        if d.finish_reason is not None:
            events += parser.finish()
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        for e in events:
            if isinstance(e, ToolCallStart):
                calls[e.index] = ToolCall(e.id, e.name, "")
            elif isinstance(e, ToolCallArguments):
                calls[e.index] = dataclasses.replace(calls[e.index], arguments=calls[e.index].arguments + e.fragment)
        complete = [calls[i] for i in sorted(parser.completed - sent)]
        sent |= parser.completed
        if text or complete:
            yield render.header(model) | {"message": render.message(text, complete), "done": False}
        if d.finish_reason is not None:
            yield render.header(model) | {"message": render.message("")} | render.final_fields(d.output, timer)


async def load_or_unload(request: Request, state: ServerState, name: str, keep_alive: Any, empty: dict[str, Any]):
    """A chat or generate request with nothing to answer: the model loaded (or kept), or, with keep_alive 0,
    unloaded (at once, or as its last request ends)."""

    if keep_alive_seconds(keep_alive) == 0:  # `ollama stop`: a model that is not loaded is not loaded to be unloaded
        state.unload(name)
        return render.header(name) | empty | {"done": True, "done_reason": "unload"}

    async def work(served: ServedModel, timer: Timer):
        return render.header(name) | empty | {"done": True, "done_reason": "load"}

    return await with_model(request, state, name, "generate", keep_alive, work)
