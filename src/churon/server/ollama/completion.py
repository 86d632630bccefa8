"""What /api/chat and /api/generate share: the model a request names, held for as long as its answer runs
(ServerState.model_for: released once the last line is sent, or the client leaves), its created model's recipe
(SYSTEM, TEMPLATE, PARAMETERs), and the answer, whole or as an NDJSON stream ending in the object with the
timings.

A created model's TEMPLATE (or generate's `template`) renders the prompt in place of the model's own chat
template, on a view of the LLM whose tokenizer carries it: the engine, its weights and its cache are shared."""

from __future__ import annotations

import copy
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from churon.llm import LLM
from churon.modelfile import chat_template
from churon.server.errors import APIError
from churon.server.keep_alive import parse_keep_alive
from churon.server.ollama.errors import model_not_found
from churon.server.ollama.render import Timer
from churon.server.ollama.streaming import ndjson
from churon.server.state import ServedModel, ServerState

Work = Callable[[ServedModel, Timer], Awaitable[dict[str, Any] | AsyncIterator[dict[str, Any]]]]


def keep_alive_seconds(value: Any) -> float | None:
    try:
        return parse_keep_alive(value)
    except ValueError as e:
        raise APIError(400, str(e), param="keep_alive")


async def acquire(request: Request, state: ServerState, name: str, task: str, keep_alive: Any) -> ServedModel:
    """The model, held until the response is sent; a name this server cannot serve in Ollama's words."""
    seconds = keep_alive_seconds(keep_alive)
    try:
        return await state.model_for(request, name, task, seconds)
    except APIError as e:
        if e.status == 404:
            raise model_not_found(name) from e
        raise


async def with_model(request: Request, state: ServerState, name: str, task: str, keep_alive: Any, work: Work) -> Response:
    """work(served, timer) gives the answer: an object (sent as JSON) or the objects of a stream (NDJSON)."""
    timer = Timer()
    served = await acquire(request, state, name, task, keep_alive)
    timer.loaded()
    answer = await work(served, timer)
    return JSONResponse(answer) if isinstance(answer, dict) else ndjson(answer)


def request_template(template: str | None) -> str | None:
    """A request's `template` as Jinja: Ollama's Go-template subset translated (churon.modelfile), Jinja as it is."""
    if template is None:
        return None
    try:
        return chat_template(template, "template")
    except ValueError as e:
        raise APIError(400, str(e), param="template")


def templated(llm: LLM, jinja: str | None) -> LLM:
    """llm, or a view of it whose chat prompts render with the Jinja template `jinja`."""
    if jinja is None:
        return llm
    view = copy.copy(llm)
    view.tokenizer = copy.copy(llm.tokenizer)
    view.tokenizer.chat_template = jinja
    return view


def no_images(images: list[str] | None, param: str, name: str) -> None:
    if images:
        raise APIError(400, f"{param}: the model \"{name}\" is a text model and does not take images", param=param)


def created_parameters(served: ServedModel) -> dict[str, Any] | None:
    return served.created.parameters if served.created is not None else None
