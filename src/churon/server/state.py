"""What the routes share, kept on app.state and handed to them by Depends(server_state): the models once
loaded and the names they are served as, the metrics, the admission count, the request limits and the
shutdown's drain (while draining, ready() answers 503 to every new request).

A server serves one model, or two: a text-generation model and an embedding model (`churon serve MODEL
--embedding-model M`). Each has a task ("generate" or "embed", LLM.task); a request's `model` picks one,
and a request for the other task's API is a 400 naming the model and its task (model()).

The models load on a thread, one after the other, after the port is bound; until every one has,
ready() answers 503 (for good when a load failed). Routes call model() themselves, after FastAPI has
validated the body, so a malformed request is a 400 even while the models load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from fastapi import Request

from churon.engine.async_engine import AsyncLLMEngine
from churon.engine.embedding import AsyncEmbeddingEngine
from churon.llm import LLM
from churon.server.admission import Admission
from churon.server.drain import Drain
from churon.server.errors import APIError
from churon.server.limits import RequestLimits
from churon.server.metrics import ServerMetrics

log = logging.getLogger("churon.server")

# a task as a request's error names it
_TASK_MODELS = {"generate": "text-generation model", "embed": "embedding model"}


@dataclass
class ServedModel:
    name: str  # what a request's `model` says
    llm: LLM
    engine: AsyncLLMEngine | AsyncEmbeddingEngine  # by llm.task

    @property
    def task(self) -> str:
        return self.llm.task


class ServerState:
    def __init__(self, models: Sequence[tuple[Callable[[], LLM], str]], admission: Admission, limits: RequestLimits):
        """models: (load, name) of each model to serve, loaded in this order."""
        names = [name for _, name in models]
        if not names:
            raise ValueError("a server needs a model to serve")
        if len(set(names)) < len(names):
            raise ValueError(f"two models are served as the same name ({names}): give each its own")
        self._to_load = list(models)
        self.admission = admission
        self.limits = limits
        self.drain = Drain()
        self.metrics = ServerMetrics()
        # every model once all are loaded; empty before, and for good when a load failed
        self.models: list[ServedModel] = []
        self.load_error: BaseException | None = None

    def load(self, on_load_error: Callable[[BaseException], None] | None) -> None:
        """Runs on the loading thread."""
        loaded: list[ServedModel] = []
        try:
            for load_llm, name in self._to_load:
                llm = load_llm()
                if llm.task == "embed":
                    loaded.append(ServedModel(name, llm, AsyncEmbeddingEngine(llm.embedder)))
                else:
                    self.admission.size_for(llm)
                    loaded.append(ServedModel(name, llm, AsyncLLMEngine(llm.engine)))
                log.info("model %s loaded (%s); serving (%s)", name, llm.task, llm.fingerprint)
            self.models = loaded
        except BaseException as e:  # reported by /health and to the caller, never lost in a thread
            for served in loaded:
                served.engine.shutdown()
            self.load_error = e
            log.error("loading the model failed: %s", e)
            if on_load_error is not None:
                on_load_error(e)

    def ready(self) -> list[ServedModel]:
        """Every served model, or the 503 of a server that is draining or not (yet) loaded."""
        refusal = self.drain.refusing()
        if refusal is not None:
            raise refusal
        if not self.models:
            why = f"loading the model failed: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, why, type="service_unavailable", code="model_not_ready", headers={"Retry-After": "1"})
        return self.models

    def model(self, name: str | None, task: str) -> ServedModel:
        """The model a request names for an API of `task` ("generate" or "embed"); name None: the first
        model served for that task. A 503 as ready(); a 404 for a name this server does not serve; a 400 for a
        model (or a server) without that task, naming the model's task and the API for it."""
        models = self.ready()
        served = next((m for m in models if m.task == task), models[0]) if name is None else self.named(name)
        if served.task != task:
            other = next((m.name for m in models if m.task == task), None)
            if served.task == "embed":
                message = f"{served.name!r} is an embedding model; use /v1/embeddings"
            else:
                message = f"{served.name!r} is a text-generation model, not an embedding model"
            if other is not None:
                message += f" (this server's {_TASK_MODELS[task]} is {other!r})"
            elif task == "embed":
                message += ": this server serves none (churon serve MODEL --embedding-model EMBEDDING_MODEL)"
            raise APIError(400, message, param="model", code="model_task_mismatch")
        return served

    def named(self, name: str) -> ServedModel:
        """The model served as `name`: a 503 as ready(), a 404 when this server serves none so named."""
        models = self.ready()
        served = next((m for m in models if m.name == name), None)
        if served is None:
            names = " and ".join(repr(m.name) for m in models)
            raise APIError(404, f"the model {name!r} does not exist: this server serves {names}",
                           param="model", code="model_not_found", type="not_found_error")
        return served

    def generation_engine(self) -> AsyncLLMEngine | None:
        """The text-generation model's engine (its stats for /metrics); None while loading or without one."""
        return next((m.engine for m in self.models if m.task == "generate"), None)  # type: ignore[return-value]

    def shutdown(self) -> None:
        for served in self.models:
            served.engine.shutdown()


def server_state(request: Request) -> ServerState:
    return request.app.state.server
