"""POST /v1/messages: a conversation through the model's chat template (with its tools), answered as one
Message or streamed as Anthropic's events; POST /v1/messages/count_tokens: that prompt's length."""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Depends, Request

from churon.sampling import SamplingParams
from churon.server.anthropic import render
from churon.server.anthropic.conversation import build_prompt
from churon.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from churon.server.anthropic.streaming import message_events, sse
from churon.server.errors import APIError
from churon.server.generation import EngineRequest, finish_generation, start_generation
from churon.server.state import ServerState, server_state

router = APIRouter()

# SamplingParams' names for the fields whose Anthropic names differ
_FIELD_NAMES = {"stop": "stop_sequences"}


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request, state: ServerState = Depends(server_state)):
    served = await state.model_for(request, body.model, "generate")
    llm = served.llm
    if body.max_tokens < 1:
        raise APIError(400, f"max_tokens={body.max_tokens}: must be >= 1", param="max_tokens")
    stops = body.stop_sequences or []
    state.limits.check_stop(stops, "stop_sequences")
    prompt = await build_prompt(llm, body)
    state.limits.check_prompt_tokens(len(prompt.ids), "messages")
    try:
        params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, stop=stops, grammar=prompt.plan.grammar)
    except ValueError as e:
        named = re.match(r"invalid sampling parameter (\w+)=", str(e))
        raise APIError(400, str(e), param=_FIELD_NAMES.get(named.group(1), named.group(1)) if named else None)
    generation = await start_generation(request, state, served, [EngineRequest(prompt.ids, params)], prompt_param="messages")
    id, model = render.new_id("msg"), body.model
    if body.stream:
        return sse(message_events(generation, prompt.plan, id, model, body.max_tokens, stops, llm.tokenizer))
    [output] = await finish_generation(request, generation)
    text, calls = prompt.plan.parse(output.text)
    reason, sequence = render.stop_reason(output, bool(calls), body.max_tokens, stops, llm.tokenizer)
    usage = render.usage(len(prompt.ids), len(output.token_ids))
    return render.message(id, model, render.content_blocks(text, calls), reason, sequence, usage)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    llm = (await state.model_for(request, body.model, "generate")).llm
    return {"input_tokens": len((await build_prompt(llm, body)).ids)}
