"""Ollama's API request bodies as pydantic models (ollama's api/types.go; the `ollama` Python client's
_types.py sends them). Field names are Ollama's.

`options` stays a plain object here: churon.ollama_options checks it (its names, its values) the same way
for a request, a Modelfile's PARAMETERs and /api/create's `parameters`. `keep_alive` is a duration string
("5m") or a number of seconds, parsed where a model is acquired. `format` is "" / "json" or a JSON schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from churon.server.request_model import RequestModel

Duration = str | int | float
Format = str | dict[str, Any]


def _name_as_model(data: Any) -> Any:
    """Ollama's older bodies name the model `name`; its newer ones `model` (both are accepted)."""
    if isinstance(data, dict) and "model" not in data and "name" in data:
        return {**data, "model": data["name"]}
    return data


class Named(RequestModel):
    model: str = Field(min_length=1)
    name: str | None = None

    _name = model_validator(mode="before")(_name_as_model)


class ToolCallFunction(RequestModel):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = {}  # an object, as Ollama sends and returns them (never a JSON string)


class ToolCall(RequestModel):
    function: ToolCallFunction


class Message(RequestModel):
    UNIMPLEMENTED = frozenset({"thinking"})
    role: str
    content: str = ""
    images: list[str] | None = None  # base64 images: no churon model reads them (a 400)
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # the tool whose result a "tool" message carries


class ToolFunction(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(RequestModel):
    type: str = "function"
    function: ToolFunction


class Generation(RequestModel):
    """What chat and generate share."""

    UNIMPLEMENTED = frozenset({"think", "logprobs", "top_logprobs"})
    model: str = Field(min_length=1)
    format: Format | None = None
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama's default: an NDJSON stream
    keep_alive: Duration | None = None


class ChatRequest(Generation):
    messages: list[Message] = []
    tools: list[Tool] | None = None


class GenerateRequest(Generation):
    UNIMPLEMENTED = Generation.UNIMPLEMENTED | {"width", "height", "steps"}
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(RequestModel):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True  # Ollama's default: a longer input is cut to the model's context
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: Duration | None = None


class EmbeddingsRequest(RequestModel):
    """The older /api/embeddings: one prompt, one vector."""

    model: str = Field(min_length=1)
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: Duration | None = None


class ShowRequest(Named):
    UNIMPLEMENTED = frozenset({"verbose", "system", "template"})


class DeleteRequest(Named):
    pass


class PullRequest(Named):
    UNIMPLEMENTED = frozenset({"insecure", "username", "password"})
    stream: bool = True


class CopyRequest(RequestModel):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


class CreateRequest(Named):
    """A Modelfile's text (`modelfile`, Ollama's older body) or its fields (the newer one: from, system, ...)."""

    stream: bool = True
    # blobs uploaded to /api/blobs, a LoRA, quantizing at create: churon has none of them (a 400 naming the field)
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    quantize: str | None = None
    modelfile: str | None = None
    from_: str | None = Field(None, alias="from")
    system: str | None = None
    template: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[Message] | None = None
    license: str | list[str] | None = None
