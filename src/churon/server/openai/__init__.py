"""OpenAI's API, with vLLM's extensions to it, as one router over the server's state:

    protocol.py      request bodies (pydantic)
    sampling.py      a body's sampling fields -> SamplingParams
    render.py        engine outputs in OpenAI's response shapes
    streaming.py     server-sent events ending in `data: [DONE]`
    models.py        GET /v1/models, GET /v1/models/{id}
    lora.py          POST /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's)
    tokenization.py  POST /tokenize, /detokenize
    chat.py          POST /v1/chat/completions
    completions.py   POST /v1/completions
    embeddings.py    POST /v1/embeddings
    responses.py     POST /v1/responses (the Responses API), GET and DELETE /v1/responses/{id}
    responses_protocol.py  its request body; response_store.py  the responses kept, for previous_response_id

One package per wire format: another API (Anthropic's Messages, Ollama's) sits beside this one
with its own protocol, rendering and routes, and runs its requests through the same state.py and
generation.py.
"""

from fastapi import APIRouter

from churon.server.openai import chat, completions, embeddings, lora, models, responses, tokenization

router = APIRouter()
for module in (models, lora, tokenization, chat, completions, embeddings, responses):
    router.include_router(module.router)
