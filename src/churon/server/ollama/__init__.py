"""Ollama's API (what the `ollama` clients, Open WebUI and editor plugins speak), as one router over the
server's state, on the same port as the OpenAI and Anthropic routes:

    protocol.py    request bodies (pydantic), Ollama's field names
    errors.py      Ollama's 404 wording (every error is rendered {"error": "..."} by server/errors.py for /api/ paths)
    streaming.py   NDJSON lines; `stream: false` answers the last object alone
    sampling.py    options (churon.ollama_options) and format -> SamplingParams
    render.py      the objects of an answer, the last one's counts and nanosecond durations
    completion.py  what chat and generate share: the model held while it answers, a created model's recipe
    chat.py        POST /api/chat (tools as Ollama returns them)
    generate.py    POST /api/generate (system, template, raw, context)
    embed.py       POST /api/embed, /api/embeddings
    model_info.py  size, digest, details and model_info of a model's files
    catalog.py     GET /api/tags, POST /api/show, GET /api/ps, GET /api/version
    manage.py      POST /api/pull, /api/create, /api/copy, DELETE /api/delete
"""

from fastapi import APIRouter

from churon.server.ollama import catalog, chat, embed, generate, manage

router = APIRouter()
for module in (chat, generate, embed, catalog, manage):
    router.include_router(module.router)
