"""POST /tokenize and /detokenize: vLLM's extensions to OpenAI's API, over the served model's tokenizer."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from churon.server.errors import APIError
from churon.server.openai.chat import template_messages
from churon.server.openai.models import check_model
from churon.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from churon.server.state import ServerState, server_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    llm, _ = state.ready()
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        try:
            ids = llm.chat_prompt_ids(template_messages(body.messages), add_generation_prompt=body.add_generation_prompt)
        except ValueError as e:  # the chat template refused the conversation
            raise APIError(400, str(e), param="messages")
    else:
        ids = llm.tokenizer.encode(body.prompt, add_bos=None if body.add_special_tokens else False)
    return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    llm, _ = state.ready()
    check_model(state, body.model)
    vocab = llm.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    return {"prompt": llm.tokenizer.decode(body.tokens)}
