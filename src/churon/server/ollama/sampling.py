"""A chat or generate request's `options` and `format` -> SamplingParams.

The options are a created model's PARAMETERs overridden by the request's own, each checked by
churon.ollama_options (a bad name or value: a 400 naming options.<name>). num_ctx is the context the
request may use: at most the model's (churon never grows it), less when asked; num_predict -1 (or none)
generates up to that context, as Ollama does. `format` "json" is any JSON object, a schema constrains the
answer to it (llguidance)."""

from __future__ import annotations

import re
from typing import Any

from churon.sampling import SamplingParams
from churon.server.errors import APIError
from churon.ollama_options import check_options, sampling_kwargs


def merged_options(parameters: dict[str, Any] | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """A created model's PARAMETERs (checked at create) with the request's options over them."""
    try:
        requested = check_options(options or {}, "options")
    except ValueError as e:
        raise APIError(400, str(e), param="options")
    return dict(parameters or {}) | requested


def context_length(options: dict[str, Any], model_context: int) -> int:
    num_ctx = options.get("num_ctx")
    if num_ctx is None:
        return model_context
    if num_ctx < 1:
        raise APIError(400, f"options.num_ctx={num_ctx}: must be >= 1", param="options.num_ctx")
    return min(num_ctx, model_context)


def format_schema(format: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if format is None or format == "":
        return None
    if format == "json":
        return {"type": "object"}
    if isinstance(format, dict):
        return format
    raise APIError(400, f"format {format!r}: must be \"json\" or a JSON schema object", param="format")


def sampling_params(options: dict[str, Any], prompt_tokens: int, context: int, **fields: Any) -> SamplingParams:
    """fields: what the route adds (json_schema or grammar). A prompt that leaves no room in the context is a
    400 naming its length and the context."""
    room = context - prompt_tokens
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens: the context ({context} tokens"
                       f"{', options.num_ctx' if options.get('num_ctx') else ''}) leaves no room for an answer;"
                       " shorten the prompt", param="prompt", code="context_length_exceeded")
    kwargs = sampling_kwargs(options)
    max_tokens = kwargs.get("max_tokens")
    kwargs["max_tokens"] = room if max_tokens is None or max_tokens < 0 else min(max_tokens, room)
    try:
        return SamplingParams(**kwargs, **fields)
    except ValueError as e:
        named = re.match(r"invalid sampling parameter (\w+)=", str(e))
        raise APIError(400, f"options: {e}", param=f"options.{named.group(1)}" if named else "options")
