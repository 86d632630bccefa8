"""The OpenAI API's request bodies as pydantic models.

Field names are OpenAI's (plus vLLM's /tokenize and /detokenize, its `ignore_eos` and
`truncate_prompt_tokens` vendor fields). Strict about the fields they know, lenient about others (RequestModel).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from churon.server.request_model import RequestModel


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatToolCall(RequestModel):
    """An assistant message's call, as the chat completion returned it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant message that calls tools
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this result answers


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON schema
    strict: bool | None = None  # churon's forced calls always follow the schema; its auto calls are parsed as written


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(RequestModel):
    UNIMPLEMENTED = frozenset({"include_obfuscation"})

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; GuideLLM's default streaming asks for it

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries its choice's usage so far; as in vLLM, only together with include_usage."""
        return self.include_usage and self.continuous_usage_stats


class SamplingFields(RequestModel):
    """The fields chat and completions requests share."""

    model: str | None = None
    n: int = Field(1, ge=1)  # at most --max-choices, with the prompts (server/limits.py)
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
    UNIMPLEMENTED = frozenset({
        "store", "metadata", "service_tier", "reasoning_effort", "verbosity", "prediction", "modalities", "audio",
        "web_search_options", "prompt_cache_key", "safety_identifier",
    })

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    # "none", "auto" or "required" (ToolPlan names any other string in its 400); OpenAI's default: auto with tools
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class CompletionRequest(SamplingFields):
    UNIMPLEMENTED = frozenset({"suffix", "best_of"})

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


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own: churon does not truncate vectors (embeddings.py)
    user: str | None = None  # accepted, as OpenAI does; churon has no use for it
    truncate_prompt_tokens: int | None = None  # vLLM's: -1 or k >= 1, see embeddings.py


class LoadLoraAdapterRequest(RequestModel):
    """vLLM's POST /v1/load_lora_adapter."""

    UNIMPLEMENTED = frozenset({"load_inplace"})  # a name in use is a 400: unload it first

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(RequestModel):
    """vLLM's POST /v1/unload_lora_adapter (its lora_int_id aside: churon's adapters go by name only)."""

    UNIMPLEMENTED = frozenset({"lora_int_id"})

    lora_name: str = Field(min_length=1)
