"""create_app: the server wired from its parts: state, middleware, exception handlers, routers.

The port is bound before the models are loaded: the load runs on a thread while /health
answers 503, and every model route waits for it with a 503 too (state.py).
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI

from churon.llm import LLM
from churon.server import anthropic, openai, system
from churon.server.admission import Admission
from churon.server.errors import EXCEPTION_HANDLERS
from churon.server.limits import RequestLimits
from churon.server.middleware import RequestGuard
from churon.server.state import ServerState

DEFAULT_MAX_BODY_BYTES = 4 << 20


def create_app(
    load_llm: Callable[[], LLM],
    model_name: str,
    *,
    embedding_model: tuple[Callable[[], LLM], str] | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: RequestLimits = RequestLimits(),
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """load_llm runs on a thread at startup; the model it loads is served as model_name for its task (LLM.task:
    text generation or embeddings). embedding_model: (load, name) of a second model, loaded after the first and
    served beside it (`churon serve MODEL --embedding-model M`). max_queue: most requests waiting for their first
    token (or their vectors) before new ones get a 503 (None: as many as the generation model's KV cache has
    blocks; without a generation model, no limit). limits: the work one request may ask for. on_load_error: called (on the loading thread) when a load raises."""
    admission = Admission(max_queue)
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r}: must be >= 1")
    models = [(load_llm, model_name)] + ([embedding_model] if embedding_model is not None else [])
    state = ServerState(models, admission, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, args=(on_load_error,), name="churon-load", daemon=True).start()
        yield
        state.shutdown()

    app = FastAPI(title="churon", lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = state
    app.add_middleware(RequestGuard, metrics=state.metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    app.include_router(system.router)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    return app
