"""POST /v1/chat/completions: messages through the model's chat template, answered whole or streamed
as chat.completion.chunk events (vLLM's serving_chat). With `tools`, a ToolPlan (churon.tool_calls)
renders the prompt, constrains the output as tool_choice asks and parses the calls back out of it."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request

from churon.server.errors import APIError
from churon.server.generation import EngineRequest, Generation, finish_generation, start_generation
from churon.server.offload import build_plan
from churon.server.openai import render
from churon.server.openai.protocol import ChatCompletionRequest, ChatMessage, StreamOptions
from churon.server.openai.sampling import check_request, response_format_schema, sampling_params
from churon.server.openai.streaming import sse
from churon.server.state import ServerState, server_state
from churon.tokenizer import Tokenizer
from churon.tool_calls import Tool, ToolCallError, ToolChoice, ToolPlan
from churon.tool_calls import plan as tool_plan

router = APIRouter()


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them: text parts joined, "developer" as "system", a call's
    arguments as the object their JSON holds, a tool result with the id of the call it answers."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None and not m.tool_calls:
            raise APIError(400, f"messages[{i}].content: only an assistant message with tool_calls may leave it out",
                           param=f"messages[{i}].content")
        content = m.content if m.content is None or isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
        out.append(message)
    try:
        return tool_plan.template_messages(out)
    except ToolCallError as e:
        raise APIError(400, str(e), param=e.param)


def _tool_choice(body: ChatCompletionRequest) -> ToolChoice:
    choice = body.tool_choice
    if choice is None:  # OpenAI's default
        return ToolChoice("auto" if body.tools else "none")
    if isinstance(choice, str):
        return ToolChoice(choice)
    return ToolChoice("function", choice.function.name)


def _openai_param(param: str) -> str:
    """A ToolCallError's field in OpenAI's request: tools[i].name is tools[i].function.name."""
    if param == "json_schema":
        return "response_format"
    return re.sub(r"^tools\[(\d+)\]\.", r"tools[\1].function.", param)


def _finish_reason(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason == "stop" else reason


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    served = await state.model_for(request, body.model, "generate")
    llm = served.llm
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    state.limits.check_choices(body.n, 1)
    check_request(body, state.limits, logprobs, "top_logprobs")
    tools = [Tool(t.function.name, t.function.description, t.function.parameters) for t in body.tools or []]
    choice = _tool_choice(body)
    calling = bool(tools) and choice.mode != "none"
    # without calls in play the response format stays the sampler's json_schema; with them it is part of the grammar
    try:
        messages = template_messages(body.messages)
        if served.created is not None:  # a created model's SYSTEM and MESSAGEs (its TEMPLATE is its tokenizer's)
            messages = served.created.conversation(messages)
        plan = await build_plan(llm, messages, tools, choice, parallel=body.parallel_tool_calls,
                                json_schema=response_format_schema(body) if calling else None)
    except ToolCallError as e:  # bad tools or tool_choice, or the chat template refused the conversation
        raise APIError(400, str(e), param=_openai_param(e.param))
    prompt_ids = plan.prompt_ids
    state.limits.check_prompt_tokens(len(prompt_ids) * body.n, "messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as vLLM: whatever the context leaves
        max_tokens = max(1, llm.max_model_len - len(prompt_ids))
    elif max_tokens < 1:
        raise APIError(400, f"max_tokens={max_tokens}: must be >= 1", param="max_tokens")
    params = [sampling_params(body, i, max_tokens, logprobs) for i in range(body.n)]
    if plan.grammar is not None:
        params = [dataclasses.replace(p, json_schema=None, grammar=plan.grammar) for p in params]
    requests = [EngineRequest(prompt_ids, p) for p in params]
    generation = await start_generation(request, state, served, requests, prompt_param="messages")
    origin, tokenizer = render.Origin(render.new_id("chatcmpl"), served.name, llm.fingerprint), llm.tokenizer
    if body.stream:
        return sse(_chat_stream(generation, origin, tokenizer, plan, logprobs is not None,
                                body.stream_options or StreamOptions()))
    outputs = await finish_generation(request, generation)
    choices = []
    for i, o in enumerate(outputs):
        content, calls = plan.parse(o.text)
        choice_logprobs = render.chat_logprobs(tokenizer, o.logprobs) if logprobs is not None else None
        choices.append(render.chat_choice(i, content, _finish_reason(o.finish_reason, bool(calls)), choice_logprobs, calls))
    usage = render.usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs))
    return render.chat_response(origin, choices, usage)


async def _chat_stream(generation: Generation, origin: render.Origin, tokenizer: Tokenizer, plan: ToolPlan,
                       logprobs: bool, options: StreamOptions) -> AsyncIterator[dict[str, Any]]:
    prompt_tokens = len(generation.requests[0].prompt_ids)
    generated = [0] * len(generation.requests)  # tokens of each choice so far: one per delta

    def chunk(i: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs: dict[str, Any] | None = None):
        c = render.chat_chunk(origin, i, delta, finish_reason, logprobs)
        return render.with_usage(c, prompt_tokens, generated[i]) if options.continuous_usage else c

    parsers = [plan.stream() for _ in generation.requests]  # text held back while it may open a tool call
    for i in range(len(generation.requests)):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for i, d in generation.deltas():
        generated[i] += 1
        entry = d.logprob if logprobs else None
        chunk_logprobs = render.chat_logprobs(tokenizer, [entry]) if entry is not None else None
        events = parsers[i].feed(d.text) if d.text else []
        if d.finish_reason is not None:
            events += parsers[i].finish()
        deltas = [render.chat_stream_delta(e) for e in events]
        if not deltas and chunk_logprobs is not None:  # every token's logprob goes out, held-back text or not
            deltas = [{"content": ""}]
        for k, delta in enumerate(deltas):
            yield chunk(i, delta, logprobs=chunk_logprobs if k == 0 else None)
        if d.finish_reason is not None:
            yield chunk(i, {}, _finish_reason(d.finish_reason, bool(parsers[i].completed)))
    if options.include_usage:
        yield render.usage_chunk(origin, "chat.completion.chunk", render.usage(prompt_tokens, sum(generated)))
