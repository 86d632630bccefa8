"""The OpenAI-compatible HTTP API over an AsyncLLMEngine: routes and error handlers.

The port is bound before the model is loaded: the load runs on a thread while /health
answers 503, and every model route waits for it with a 503 too. Each route turns its
request into engine requests (prompt ids + SamplingParams), runs them as one Generation
and renders the outputs in OpenAI's shapes (render.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from churon.engine.async_engine import AsyncLLMEngine
from churon.errors import ContextLengthError
from churon.llm import LLM
from churon.sampling import SamplingParams
from churon.server import render
from churon.server.generation import ClientDisconnected, EngineRequest, Generation, until_disconnected
from churon.server.metrics import ServerMetrics
from churon.server.middleware import RequestGuard
from churon.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    SamplingFields,
    error_response,
)

log = logging.getLogger("churon.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
# pydantic puts the union member it tried into an error's location ("str", "list[int]", "TextPart"),
# between the field names, which are OpenAI's snake_case
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|(list|dict)\[.*\]|[A-Z]\w*)$")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = status, message, param, code, type, headers


class ServerState:
    """The model once loaded; None before (and forever when loading failed)."""

    def __init__(self):
        self.llm: LLM | None = None
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None

    def ready(self) -> tuple[LLM, AsyncLLMEngine]:
        if self.engine is None:
            why = f"loading the model failed: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, why, type="service_unavailable", code="model_not_ready", headers={"Retry-After": "1"})
        return self.llm, self.engine  # type: ignore[return-value]


def create_app(
    load_llm: Callable[[], LLM],
    model_name: str,
    *,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """load_llm runs on a thread at startup. max_queue: most engine requests waiting for their first token
    before new ones get a 503. on_load_error: called (on the loading thread) when load_llm raises."""
    if max_queue is not None and max_queue < 1:
        raise ValueError(f"max_queue={max_queue!r}: must be >= 1 (or None for no limit)")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r}: must be >= 1")
    state = ServerState()
    metrics = ServerMetrics()

    def load() -> None:
        try:
            llm = load_llm()
            state.llm = llm
            state.engine = AsyncLLMEngine(llm.engine)
            log.info("model %s loaded; serving", model_name)
        except BaseException as e:  # reported by /health and to the caller, never lost in a thread
            state.load_error = e
            log.error("loading the model failed: %s", e)
            if on_load_error is not None:
                on_load_error(e)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load, name="churon-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="churon", lifespan=lifespan)
    app.add_middleware(RequestGuard, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                                  f" at position {first['loc'][-1]}", code="invalid_json")
        param = ".".join(str(p) for p in first["loc"] if p != "body" and not _UNION_BRANCH.match(str(p))) or None
        if param is None:
            return error_response(400, f"the request body must be a JSON object: {first['msg']}")
        return error_response(400, f"invalid request field {param}: {first['msg']}", param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        type = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if e.status_code == 413 else None  # the body limit, found while reading
        return error_response(e.status_code, str(e.detail), type, code=code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:  # a bug or an engine failure: say so
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {model_name!r}",
                           param="model", code="model_not_found", type="not_found_error")

    # Engine requests admitted and still without their first token (queued or in prefill). Counted
    # here, not read from the scheduler: requests reach the scheduler a moment after admission.
    not_started = 0

    async def start(request: Request, engine: AsyncLLMEngine, requests: list[EngineRequest]) -> Generation:
        nonlocal not_started
        if max_queue is not None and not_started + len(requests) > max_queue:
            raise APIError(503, f"the server is busy: more than {max_queue} requests would wait (--max-queue); retry later",
                           type="service_unavailable", code="queue_full", headers={"Retry-After": "1"})
        generation = Generation(engine, metrics, requests)
        not_started += len(requests)
        try:
            await until_disconnected(request, generation.start())
        except ContextLengthError as e:
            raise APIError(400, str(e), param="messages" if request.url.path.endswith("chat/completions") else "prompt",
                           code="context_length_exceeded")
        except ValueError as e:  # sampling parameters, token ids, a JSON schema the engine refused
            raise APIError(400, str(e))
        finally:
            not_started -= len(requests)
        return generation

    # --- routes -------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        state.ready()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        llm, _ = state.ready()
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "churon",
                 "max_model_len": llm.engine.context_length}
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        # stats() waits for the engine's lock, held during a step: off the event loop
        stats = await asyncio.to_thread(state.engine.stats) if state.engine is not None else None
        return PlainTextResponse(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        llm, _ = state.ready()
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            try:
                text = llm.tokenizer.apply_chat_template(_messages(body.messages), add_generation_prompt=body.add_generation_prompt)
            except ValueError as e:  # the chat template refused the conversation
                raise APIError(400, str(e), param="messages")
            ids = llm.tokenizer.encode(text, add_bos=False)
        else:
            ids = llm.tokenizer.encode(body.prompt, add_bos=None if body.add_special_tokens else False)
        return {"count": len(ids), "max_model_len": llm.engine.context_length, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        llm, _ = state.ready()
        check_model(body.model)
        vocab = llm.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        llm, engine = state.ready()
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        try:
            prompt_ids = llm.chat_prompt_ids(_messages(body.messages))
        except ValueError as e:  # the chat template refused the conversation
            raise APIError(400, str(e), param="messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # as vLLM: whatever the context leaves
            max_tokens = max(1, llm.engine.context_length - len(prompt_ids))
        elif max_tokens < 1:
            raise APIError(400, f"max_tokens={max_tokens}: must be >= 1", param="max_tokens")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requests = [EngineRequest(prompt_ids, _params(body, i, max_tokens, logprobs)) for i in range(body.n)]
        generation = await start(request, engine, requests)
        id, tokenizer = render.new_id("chatcmpl"), llm.tokenizer
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_chat_stream(generation, id, model_name, tokenizer, logprobs is not None, include_usage))
        outputs = await _finish(request, generation)
        choices = [
            render.chat_choice(i, o.text, o.finish_reason,
                               render.chat_logprobs(tokenizer, o.logprobs) if logprobs is not None else None)
            for i, o in enumerate(outputs)
        ]
        usage = render.usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs))
        return render.chat_response(id, model_name, choices, usage)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        llm, engine = state.ready()
        check_model(body.model)
        prompts = _prompts(body.prompt, llm)
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = 16
        if max_tokens < 0:
            raise APIError(400, f"max_tokens={max_tokens}: must be >= 0", param="max_tokens")
        if max_tokens == 0 and body.stream:
            raise APIError(400, "max_tokens=0 (the prompt only, with echo) cannot be streamed", param="max_tokens")
        want_prompt_logprobs = body.echo and body.logprobs is not None
        # max_tokens=0 runs one token to get the prompt's logprobs; that token is not returned
        run_tokens = max(max_tokens, 1)
        requests = [
            EngineRequest(ids, _params(body, j, run_tokens, body.logprobs, body.logprobs if want_prompt_logprobs else None))
            for ids, _ in prompts for j in range(body.n)
        ]
        id, tokenizer = render.new_id("cmpl"), llm.tokenizer
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        if max_tokens == 0 and not want_prompt_logprobs:
            for r in requests:  # nothing to run, but a bad prompt is still a 400
                _check_prompt(llm, r.prompt_ids)
            choices = [render.completion_choice(i, prompts[i // body.n][1] if body.echo else "", "length", None)
                       for i in range(len(requests))]
            return render.completion_response(id, model_name, choices, render.usage(prompt_tokens, 0))
        generation = await start(request, engine, requests)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_completion_stream(generation, id, model_name, tokenizer, body, prompts, include_usage))
        outputs = await _finish(request, generation)
        choices = []
        for i, o in enumerate(outputs):
            prompt_text = prompts[i // body.n][1]
            token_ids, entries = (list(o.token_ids), list(o.logprobs or [])) if max_tokens else ([], [])
            text = o.text if max_tokens else ""
            finish = o.finish_reason if max_tokens else "length"
            if body.echo:
                text = prompt_text + text
                if want_prompt_logprobs:
                    token_ids, entries = o.prompt_token_ids + token_ids, list(o.prompt_logprobs) + entries
            logprobs = render.completion_logprobs(tokenizer, token_ids, entries) if body.logprobs is not None else None
            choices.append(render.completion_choice(i, text, finish, logprobs))
        completion_tokens = sum(len(o.token_ids) for o in outputs) if max_tokens else 0
        return render.completion_response(id, model_name, choices, render.usage(prompt_tokens, completion_tokens))

    return app


# --- request -> engine -------------------------------------------------------------------


def _messages(messages) -> list[dict[str, str]]:
    """OpenAI messages as the chat template takes them: text parts joined, "developer" as "system"."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def _prompts(prompt, llm: LLM) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt: a string, a list of strings, a list of ids, a list of id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: give a string, a list of strings or a list of token ids", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((llm.tokenizer.encode(p), p))
        else:
            _check_prompt(llm, p)
            out.append((list(p), llm.tokenizer.decode(p)))
    return out


def _check_prompt(llm: LLM, ids: list[int]) -> None:
    try:
        llm.engine.check_prompt(ids)
    except ContextLengthError as e:
        raise APIError(400, str(e), param="prompt", code="context_length_exceeded")
    except ValueError as e:
        raise APIError(400, str(e), param="prompt")


def _params(body: SamplingFields, choice: int, max_tokens: int, logprobs: int | None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias[{key}]={value}: must be in [-100, 100]", param="logit_bias")
        bias[int(key)] = value
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=bias,
            seed=None if body.seed is None else body.seed + choice,  # n choices differ, reproducibly
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            json_schema=_json_schema(body),
        )
    except ValueError as e:
        named = re.match(r"invalid sampling parameter (\w+)=", str(e))
        raise APIError(400, str(e), param=named.group(1) if named else None)


def _json_schema(body: SamplingFields) -> dict | None:
    f = body.response_format
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "object"}
    if f.json_schema is None:
        raise APIError(400, "response_format json_schema needs its json_schema field", param="response_format.json_schema")
    return f.json_schema.schema_


async def _finish(request: Request, generation: Generation):
    try:
        return await until_disconnected(request, generation.outputs())
    except ClientDisconnected:
        # nobody reads the answer; the status is for the logs and /metrics (nginx's "client closed request")
        raise APIError(499, "the client disconnected")


# --- streaming ---------------------------------------------------------------------------


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except Exception as e:  # the engine failed mid-stream: the status is sent, so say it in the stream
            log.exception("stream failed")
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_stream(generation: Generation, id: str, model: str, tokenizer, logprobs: bool,
                       include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    for i in range(len(generation.requests)):
        yield render.chat_chunk(id, model, i, {"role": "assistant", "content": ""})
    completion_tokens = 0
    async for i, d in generation.deltas():
        entry = d.logprob if logprobs else None
        if d.text or entry is not None:
            chunk_logprobs = render.chat_logprobs(tokenizer, [entry]) if entry is not None else None
            yield render.chat_chunk(id, model, i, {"content": d.text}, logprobs=chunk_logprobs)
        if d.finish_reason is not None:
            completion_tokens += len(d.output.token_ids)
            yield render.chat_chunk(id, model, i, {}, d.finish_reason)
    if include_usage:
        prompt_tokens = len(generation.requests[0].prompt_ids)
        yield render.usage_chunk(id, "chat.completion.chunk", model, render.usage(prompt_tokens, completion_tokens))


async def _completion_stream(generation: Generation, id: str, model: str, tokenizer, body: CompletionRequest,
                             prompts: list[tuple[list[int], str]], include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    offsets = [0] * len(generation.requests)  # text_offset of each choice's next token
    echoed: set[int] = set()
    completion_tokens = 0
    async for i, d in generation.deltas():
        if body.echo and i not in echoed:  # the prompt goes first, with its logprobs when asked
            echoed.add(i)
            text = prompts[i // body.n][1]
            logprobs = None
            if body.logprobs is not None:
                logprobs = render.completion_logprobs(tokenizer, d.output.prompt_token_ids, d.output.prompt_logprobs)
            yield render.completion_chunk(id, model, render.completion_choice(i, text, None, logprobs))
            offsets[i] = len(text)
        logprobs = None
        if body.logprobs is not None and d.logprob is not None:
            logprobs = render.completion_logprobs(tokenizer, [d.logprob.token_id], [d.logprob], offsets[i])
        offsets[i] += len(d.text)
        if d.finish_reason is not None:
            completion_tokens += len(d.output.token_ids)
        if d.text or logprobs is not None or d.finish_reason is not None:
            yield render.completion_chunk(id, model, render.completion_choice(i, d.text, d.finish_reason, logprobs))
    if include_usage:
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        yield render.usage_chunk(id, "text_completion", model, render.usage(prompt_tokens, completion_tokens))
