"""Ollama's own words for a model it does not have; every other error of its routes is rendered in its
shape, {"error": "..."}, by the server's handlers (server/errors.py picks the shape by the /api/ path), and a
stream that already started says it in its last line (streaming.py)."""

from __future__ import annotations

from churon.server.errors import APIError


def model_not_found(name: str) -> APIError:
    """Ollama's 404 wording, which clients and scripts match on."""
    return APIError(404, f'model "{name}" not found, try pulling it first', param="model", code="model_not_found",
                    type="not_found_error")
