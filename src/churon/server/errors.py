"""The server's errors: APIError (raised under a route or a dependency) and the handlers that turn it,
a body pydantic refused, a Starlette HTTP error and any other exception into an error body with its
status, in the shape the request's API dialect parses (its path says which):

    OpenAI (every other path)            {"error": {"message", "type", "param", "code"}}
    Anthropic (/v1/messages...)          {"type": "error", "error": {"type", "message"}}
    Ollama (/api/...)                    {"error": "..."}

Routes and middleware raise one APIError, OpenAI's fields; error_body_for renders it per dialect."""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

# pydantic puts the union member it tried into an error's location ("str", "list[int]", "TextPart"),
# between the field names, which are OpenAI's snake_case
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|(list|dict)\[.*\]|[A-Z]\w*)$")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = status, message, param, code, type, headers


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error types by status (docs.anthropic.com/en/api/errors); a local server's 503s (loading,
# a full queue) are Anthropic's overloaded_error, which its clients retry
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's shape has no `param`: the message names the field, as Anthropic's own do ("max_tokens: ...")."""
    if param is not None and param not in message:
        message = f"{param}: {message}"
    type = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": type, "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def ollama_error_body(message: str) -> dict[str, Any]:
    """Ollama's shape: the message alone, which its clients read as ollama.ResponseError's `error`."""
    return {"error": message}


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def error_body_for(path: str, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> dict[str, Any]:
    """The error body in the dialect of the API the request at `path` speaks."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message, param)
    if is_ollama_path(path):
        return ollama_error_body(message)
    return error_body(message, type, param, code)


def _error_response(
    request: Request, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
    code: str | None = None, headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = error_body_for(request.url.path, status, message, type, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return _error_response(request, e.status, e.message, e.type, e.param, e.code, e.headers)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    errors = e.errors()
    # text that is not Unicode fails every branch of a union (a string, or a list of parts): name the one that holds it
    first = next((x for x in errors if x["type"] == "lone_surrogate"), errors[0])
    if first["type"] == "json_invalid":
        return _error_response(request, 400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                               f" at position {first['loc'][-1]}", code="invalid_json")
    param = ".".join(str(p) for p in first["loc"] if p != "body" and not _UNION_BRANCH.match(str(p))) or None
    if param is None:
        return _error_response(request, 400, f"the request body must be a JSON object: {first['msg']}")
    return _error_response(request, 400, f"invalid request field {param}: {first['msg']}", param=param)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    type = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    code = "request_too_large" if e.status_code == 413 else None  # the body limit, found while reading
    return _error_response(request, e.status_code, str(e.detail), type, code=code, headers=getattr(e, "headers", None))


def server_error_message(e: BaseException) -> str:
    return f"internal error: {type(e).__name__}: {e}"


async def _server_error(request: Request, e: Exception) -> JSONResponse:  # a bug or an engine failure: say so
    return _error_response(request, 500, server_error_message(e), "server_error")


async def _client_disconnect(request: Request, e: ClientDisconnect) -> JSONResponse:
    # the client left (or its body timed out, server/connections.py) while its body was read: nobody reads this
    return _error_response(request, 499, "the client disconnected while sending its request")


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    RequestValidationError: _validation_error,
    HTTPException: _http_error,
    ClientDisconnect: _client_disconnect,
    Exception: _server_error,  # reached only from the middleware: RequestGuard answers the routes' own
}
