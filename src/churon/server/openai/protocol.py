"""The OpenAI API's request bodies as pydantic models.

Field names are OpenAI's (plus vLLM's /tokenize and /detokenize and its `ignore_eos`
vendor field). Strict about the fields they know, lenient about others (RequestModel).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from churon.server.request_model import RequestModel


MAX_N = 128  # choices per request: each is a whole engine request


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class JsonSchemaFormat(RequestModel):
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """The fields chat and completions requests share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False  # vendor field (vLLM's): generate max_tokens tokens whatever the model says
    user: str | None = None  # accepted, as OpenAI does; churon has no use for it


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = None
    echo: bool = False


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # the BOS, when the model wants one (prompt only)
    add_generation_prompt: bool = True  # messages only


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
