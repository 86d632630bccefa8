"""The server's errors, in OpenAI's shape, the one its clients parse: APIError (raised under a route
or a dependency) and the handlers that turn it, a body pydantic refused, a Starlette HTTP error and
any other exception into {"error": {"message", "type", "param", "code"}} with its status."""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

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


def error_response(
    status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0]
    if first["type"] == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                              f" at position {first['loc'][-1]}", code="invalid_json")
    param = ".".join(str(p) for p in first["loc"] if p != "body" and not _UNION_BRANCH.match(str(p))) or None
    if param is None:
        return error_response(400, f"the request body must be a JSON object: {first['msg']}")
    return error_response(400, f"invalid request field {param}: {first['msg']}", param=param)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    type = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    code = "request_too_large" if e.status_code == 413 else None  # the body limit, found while reading
    return error_response(e.status_code, str(e.detail), type, code=code, headers=getattr(e, "headers", None))


async def _server_error(request: Request, e: Exception) -> JSONResponse:  # a bug or an engine failure: say so
    return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    RequestValidationError: _validation_error,
    HTTPException: _http_error,
    Exception: _server_error,
}
