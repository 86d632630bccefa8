"""create_app: the server wired from its parts: state, middleware, exception handlers, routers.

The port is bound before the models are loaded: the preloads run on a thread while /health
answers 503, and every model route waits for them with a 503 too; the catalog's models load when
a request names them (state.py).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable, Mapping

from fastapi import FastAPI

from churon.llm import LLM
from churon.server import anthropic, ollama, openai, page, system
from churon.server.admission import Admission
from churon.server.errors import EXCEPTION_HANDLERS
from churon.server.limits import RequestLimits
from churon.server.middleware import RequestGuard
from churon.server.catalog import ModelCatalog
from churon.server.state import ModelPolicy, ReleaseModels, ServerState

DEFAULT_MAX_BODY_BYTES = 4 << 20


def create_app(
    load_llm: Callable[[], LLM] | None = None,
    model_name: str | None = None,
    *,
    embedding_model: tuple[Callable[[], LLM], str] | None = None,
    catalog: ModelCatalog | None = None,
    policy: ModelPolicy | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: RequestLimits = RequestLimits(),
    lora_adapters: Mapping[str, str | Path] | None = None,
    allow_lora_loading: bool = False,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """load_llm runs on a thread at startup; the model it loads is served as model_name for its task (LLM.task:
    text generation or embeddings). embedding_model: (load, name) of a second model, loaded after the first and
    served beside it (`churon serve MODEL --embedding-model M`). catalog: the models loaded when a request
    names them (`churon serve`; None: the preloaded ones only); policy: their memory budget, how many stay
    loaded and for how long (None: ModelPolicy(default_models_memory())). max_queue: most requests waiting for their first
    token (or their vectors) before new ones get a 503 (None: as many as the generation model's KV cache has
    blocks; without a generation model, no limit). limits: the work one request may ask for. lora_adapters: name ->
    path of the LoRA adapters served on model_name (`--lora`: a request naming one runs on that model with it).
    allow_lora_loading: POST /v1/load_lora_adapter and /v1/unload_lora_adapter allowed (`--allow-lora-loading`).
    on_load_error: called (on the loading thread) when a preload raises."""
    admission = Admission(max_queue)
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r}: must be >= 1")
    models = ([(load_llm, model_name)] if load_llm is not None else []) + ([embedding_model] if embedding_model else [])
    state = ServerState(models, admission, limits, catalog, policy, lora_adapters, allow_lora_loading)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start(on_load_error)
        yield
        state.shutdown()

    # FastAPI's /docs and /redoc load their scripts from a CDN, which an offline machine cannot reach:
    # they are off, and /openapi.json (the same schema, for any viewer or client generator) stays
    app = FastAPI(title="churon", lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(ReleaseModels)
    app.add_middleware(RequestGuard, metrics=state.metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    app.include_router(system.router)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(ollama.router)
    app.include_router(page.router)
    return app
