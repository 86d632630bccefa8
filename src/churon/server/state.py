"""What the routes share, kept on app.state and handed to them by Depends(server_state): the model
once loaded, the name it is served as, the metrics, the admission count, the request limits and
the shutdown's drain (while draining, ready() answers 503 to every new request).

The model loads on a thread after the port is bound; until it has, ready() answers 503 (for good
when loading failed). Routes call ready() themselves, after FastAPI has validated the body, so a
malformed request is a 400 even while the model loads.
"""

from __future__ import annotations

import logging
from typing import Callable

from fastapi import Request

from churon.engine.async_engine import AsyncLLMEngine
from churon.llm import LLM
from churon.server.admission import Admission
from churon.server.drain import Drain
from churon.server.errors import APIError
from churon.server.limits import RequestLimits
from churon.server.metrics import ServerMetrics

log = logging.getLogger("churon.server")


class ServerState:
    def __init__(self, model_name: str, admission: Admission, limits: RequestLimits):
        self.model_name = model_name
        self.admission = admission
        self.limits = limits
        self.drain = Drain()
        self.metrics = ServerMetrics()
        self.llm: LLM | None = None  # None before the model is loaded, and forever when loading failed
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None

    def load(self, load_llm: Callable[[], LLM], on_load_error: Callable[[BaseException], None] | None) -> None:
        """Runs on the loading thread."""
        try:
            llm = load_llm()
            self.admission.size_for(llm)
            self.llm = llm
            self.engine = AsyncLLMEngine(llm.engine)
            log.info("model %s loaded; serving (%s)", self.model_name, llm.fingerprint)
        except BaseException as e:  # reported by /health and to the caller, never lost in a thread
            self.load_error = e
            log.error("loading the model failed: %s", e)
            if on_load_error is not None:
                on_load_error(e)

    def ready(self) -> tuple[LLM, AsyncLLMEngine]:
        refusal = self.drain.refusing()
        if refusal is not None:
            raise refusal
        if self.engine is None:
            why = f"loading the model failed: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, why, type="service_unavailable", code="model_not_ready", headers={"Retry-After": "1"})
        return self.llm, self.engine  # type: ignore[return-value]

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def server_state(request: Request) -> ServerState:
    return request.app.state.server
