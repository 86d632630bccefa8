"""The Responses API's request body (POST /v1/responses) as pydantic models.

Field names are OpenAI's. `input` is a string or a list of items: messages (their `type` may be left
out), `function_call` items (an assistant's call, as a previous response output it) and
`function_call_output` items (the caller's result). Items a client sends back from a response's
`output` carry its `id`, `status` and `annotations`: accepted, read for nothing. Only function tools
exist here: the hosted ones (web search, file search, computer use, ...) are OpenAI's servers' own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from churon.server.request_model import RequestModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def _text_or_list(item: Any, what: str) -> Any:
    """A string or a list of `item`s. Picked by the value's JSON type, so that a wrong one is one error
    ("must be a string or a list of ...") rather than each branch's, the string's first."""
    return Annotated[
        Union[Annotated[str, Tag("str")], Annotated[list[item], Tag("list[item]")]],
        Discriminator(lambda v: "str" if isinstance(v, str) else "list[item]" if isinstance(v, list) else None,
                      custom_error_type="text_or_list", custom_error_message=f"must be a string or a list of {what}"),
    ]


class InputText(RequestModel):
    type: Literal["input_text"]
    text: str


class OutputText(RequestModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: _text_or_list(Annotated[InputText | OutputText, Field(discriminator="type")], "content parts")
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: _text_or_list(InputText, "input_text parts")
    id: str | None = None
    status: ItemStatus | None = None


_ITEM_MODELS = {"message": "MessageItem", "function_call": "FunctionCallItem", "function_call_output": "FunctionCallOutputItem"}


def _item_tag(item: Any) -> str | None:
    # an item's `type` picks its model; a message may leave it out (OpenAI's EasyInputMessage). The
    # tags are the models' names, which errors.py leaves out of an error's param ("input.2.call_id").
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return _ITEM_MODELS.get(kind) if isinstance(kind, str) else None


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("MessageItem")],
        Annotated[FunctionCallItem, Tag("FunctionCallItem")],
        Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
    ],
    Discriminator(_item_tag, custom_error_type="invalid_item_type",
                  custom_error_message="an input item's type must be message, function_call or function_call_output"),
]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON schema
    strict: bool | None = None


class ToolChoiceFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    # json_schema's fields sit beside its type here (chat's response_format nests them)
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; churon's take none


class ResponsesRequest(RequestModel):
    UNIMPLEMENTED = frozenset({
        "background", "conversation", "include", "max_tool_calls", "prompt", "prompt_cache_key", "reasoning",
        "service_tier", "stream_options", "top_logprobs", "truncation",
    })

    model: str | None = None
    input: _text_or_list(InputItem, "input items")
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None  # null: OpenAI's default, 1
    top_p: float | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True  # kept in memory for GET /v1/responses/{id} and a later previous_response_id
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # echoed in the response
    user: str | None = None
    safety_identifier: str | None = None
