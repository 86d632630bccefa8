"""POST /v1/chat/completions: messages through the model's chat template, answered whole or streamed
as chat.completion.chunk events (vLLM's serving_chat)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request

from churon.server.errors import APIError
from churon.server.generation import EngineRequest, Generation, finish_generation, start_generation
from churon.server.openai import render
from churon.server.openai.models import check_model
from churon.server.openai.protocol import ChatCompletionRequest, ChatMessage
from churon.server.openai.sampling import sampling_params
from churon.server.openai.streaming import sse
from churon.server.state import ServerState, server_state
from churon.tokenizer import Tokenizer

router = APIRouter()


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """OpenAI messages as the chat template takes them: text parts joined, "developer" as "system"."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    llm, _ = state.ready()
    check_model(state, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    try:
        prompt_ids = llm.chat_prompt_ids(template_messages(body.messages))
    except ValueError as e:  # the chat template refused the conversation
        raise APIError(400, str(e), param="messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as vLLM: whatever the context leaves
        max_tokens = max(1, llm.max_model_len - len(prompt_ids))
    elif max_tokens < 1:
        raise APIError(400, f"max_tokens={max_tokens}: must be >= 1", param="max_tokens")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = [EngineRequest(prompt_ids, sampling_params(body, i, max_tokens, logprobs)) for i in range(body.n)]
    generation = await start_generation(request, state, requests, prompt_param="messages")
    id, tokenizer, model = render.new_id("chatcmpl"), llm.tokenizer, state.model_name
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse(_chat_stream(generation, id, model, tokenizer, logprobs is not None, include_usage))
    outputs = await finish_generation(request, generation)
    choices = [
        render.chat_choice(i, o.text, o.finish_reason,
                           render.chat_logprobs(tokenizer, o.logprobs) if logprobs is not None else None)
        for i, o in enumerate(outputs)
    ]
    usage = render.usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs))
    return render.chat_response(id, model, choices, usage)


async def _chat_stream(generation: Generation, id: str, model: str, tokenizer: Tokenizer, logprobs: bool,
                       include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    for i in range(len(generation.requests)):
        yield render.chat_chunk(id, model, i, {"role": "assistant", "content": ""})
    completion_tokens = 0
    async for i, d in generation.deltas():
        entry = d.logprob if logprobs else None
        if d.text or entry is not None:
            chunk_logprobs = render.chat_logprobs(tokenizer, [entry]) if entry is not None else None
            yield render.chat_chunk(id, model, i, {"content": d.text}, logprobs=chunk_logprobs)
        if d.finish_reason is not None:
            completion_tokens += len(d.output.token_ids)
            yield render.chat_chunk(id, model, i, {}, d.finish_reason)
    if include_usage:
        prompt_tokens = len(generation.requests[0].prompt_ids)
        yield render.usage_chunk(id, "chat.completion.chunk", model, render.usage(prompt_tokens, completion_tokens))
