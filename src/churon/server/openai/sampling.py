"""An OpenAI request body -> SamplingParams, for chat and text completions alike.

SamplingParams.from_fields reads the fields the command line shares; of those, a request derives
max_tokens (chat's default fills the context) and the seed (one per choice) itself. Then come what
only OpenAI's bodies carry: presence and frequency penalties, logit_bias keyed by token id strings,
response_format, ignore_eos, logprobs. A value SamplingParams refuses, or one past the server's
RequestLimits, is a 400 naming its field.
"""

from __future__ import annotations

import re

from churon.sampling import SamplingParams
from churon.server.errors import APIError
from churon.server.limits import RequestLimits
from churon.server.openai.protocol import SamplingFields

LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias is in [-100, 100]
# a token id, in ASCII digits only: str.isdigit() also takes "²" and "١", which int() then refuses or reads
_TOKEN_ID = re.compile(r"-?[0-9]+")
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # OpenAI's and vLLM's seeds are 64-bit integers


def check_request(body: SamplingFields, limits: RequestLimits, logprobs: int | None, logprobs_param: str) -> None:
    """What one request asks of every choice, against the server's limits: once, before any choice is built."""
    limits.check_logit_bias(len(body.logit_bias or {}))
    limits.check_stop([body.stop] if isinstance(body.stop, str) else body.stop or [])
    limits.check_logprobs(logprobs, logprobs_param)
    low, high = SEED_RANGE
    if body.seed is not None and not low <= body.seed <= high:
        raise APIError(400, f"seed={body.seed}: must be a 64-bit integer, in [-2**63, 2**63 - 1]", param="seed")


def sampling_params(body: SamplingFields, choice: int, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
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
            json_schema=response_format_schema(body),
        )
    except ValueError as e:
        named = re.match(r"invalid sampling parameter (\w+)=", str(e))
        raise APIError(400, str(e), param=named.group(1) if named else None)


def response_format_schema(body: SamplingFields) -> dict | None:
    """The JSON schema response_format asks for; None for text."""
    f = body.response_format
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "object"}
    if f.json_schema is None:
        raise APIError(400, "response_format json_schema needs its json_schema field", param="response_format.json_schema")
    return f.json_schema.schema_
