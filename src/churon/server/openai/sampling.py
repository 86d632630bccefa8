"""An OpenAI request body -> SamplingParams, for chat and text completions alike.

SamplingParams.from_fields reads the fields the command line shares; of those, a request derives
max_tokens (chat's default fills the context) and the seed (one per choice) itself. Then come what
only OpenAI's bodies carry: presence and frequency penalties, logit_bias keyed by token id strings,
response_format, ignore_eos, logprobs. A value SamplingParams refuses is a 400 naming its field.
"""

from __future__ import annotations

import re

from churon.sampling import SamplingParams
from churon.server.errors import APIError
from churon.server.openai.protocol import SamplingFields

MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]


def sampling_params(body: SamplingFields, choice: int, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias[{key}]={value}: must be in [-100, 100]", param="logit_bias")
        bias[int(key)] = value
    try:
        return SamplingParams.from_fields(
            body,
            max_tokens=max_tokens,
            seed=None if body.seed is None else body.seed + choice,  # n choices differ, reproducibly
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=bias,
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
