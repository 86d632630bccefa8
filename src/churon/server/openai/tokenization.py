"""POST /tokenize, /detokenize and GET /tokenizer_info: vLLM's extensions to OpenAI's API, over the served
model's tokenizer. With them a client tokenizes exactly as churon does (lm-eval's
`tokenizer_backend=remote`), instead of rebuilding a tokenizer that may split text differently."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from churon.server.errors import APIError
from churon.server.offload import off_loop
from churon.server.openai.chat import template_messages
from churon.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from churon.server.state import ServerState, server_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    llm = (await state.model_for(request, body.model, "generate")).llm
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        try:
            ids = await off_loop(llm.chat_prompt_ids, template_messages(body.messages),
                                 add_generation_prompt=body.add_generation_prompt)
        except ValueError as e:  # the chat template refused the conversation, or ran past its limits on it
            raise APIError(400, str(e), param="messages")
    else:
        # any length the body limit lets through, not only what fits the context: lm-eval tokenizes whole
        # documents here to score them window by window
        special = None if body.add_special_tokens else False
        ids = await off_loop(llm.tokenizer.encode, body.prompt, add_bos=special, add_eos=special)
    return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    llm = (await state.model_for(request, body.model, "generate")).llm
    vocab = llm.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    return {"prompt": await off_loop(llm.tokenizer.decode, body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """vLLM's shape: the tokenizer_config.json fields and tokenizer_class (here churon's own Tokenizer)."""
    llm = (await state.model_for(request, None, "generate")).llm
    tokenizer = llm.tokenizer
    info = {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": False,
        "model_max_length": llm.max_model_len,
    }
    if tokenizer.chat_template is not None:
        info["chat_template"] = tokenizer.chat_template
    return info
