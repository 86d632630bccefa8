"""Lark grammars (llguidance's dialect) that constrain an output to tool calls in a format's syntax,
each call's JSON written by %json from a schema that fixes the function's name and holds its
parameters' schema, so that forced calls always parse and validate:

    calls only (tool_choice required)    start: calls
    one named function                   start: BEGIN call END
    an answer or calls (auto)            start: TEXT | calls     TEXT: any text without the call marker
                                         start: answer | calls   answer: %json{response_format's schema}

The JSON layout is json.dumps's (structured.JSON_FORMAT), the one chat templates render calls in.
"""

from __future__ import annotations

import json
from typing import Any

from churon.structured import JSON_FORMAT
from churon.tool_calls.formats import ToolFormat
from churon.tool_calls.tool import Tool


def call_schema(tools: list[Tool], fmt: ToolFormat) -> dict[str, Any]:
    """The JSON schema of one call object to any of `tools`: {"name": <one of them>, <arguments key>: <its parameters>}."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, fmt.arguments_key: t.parameters},
            "required": ["name", fmt.arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def lark_json(schema: dict[str, Any]) -> str:
    """%json {...} in churon's JSON layout (a schema's own "x-guidance" overrides it)."""
    return "%json " + json.dumps({"x-guidance": JSON_FORMAT} | schema)


def _literal(text: str) -> str:
    return json.dumps(text)  # Lark's string literals take JSON's escapes


def calls_grammar(fmt: ToolFormat, tools: list[Tool], *, parallel: bool, begin_token_id: int | None,
                  answer: str | None) -> str:
    """A grammar for calls to `tools` (one or, with parallel, several), alone (answer None) or as the
    alternative to an answer: "text" (any text that does not hold the format's marker) or a JSON schema's
    %json (answer text, as a string)."""
    begin = [f"<[{begin_token_id}]>"] if begin_token_id is not None else []
    rest = fmt.begin[len(fmt.begin_token):] if begin_token_id is not None else fmt.begin
    begin += [_literal(rest)] if rest else []
    end = [_literal(fmt.end)] if fmt.end else []
    call = [_literal(fmt.call_open)] if fmt.call_open else []
    call += ["call_json"] + ([_literal(fmt.call_close)] if fmt.call_close else [])
    repeat = [f"({_literal(fmt.joiner)} call)*"] if parallel else []
    lines = [
        "calls: " + " ".join(begin + ["call"] + repeat + end),
        "call: " + " ".join(call),
        "call_json: " + lark_json(call_schema(tools, fmt)),
    ]
    if answer is None:
        lines.insert(0, "start: calls")
    elif answer == "text":
        marker = fmt.marker
        lines[:0] = ["start: TEXT | calls", f"TEXT: /(?s:.*)/ & ~/(?s:.*){_regex_escape(marker)}(?s:.*)/"]
    else:
        lines[:0] = ["start: answer | calls", f"answer: {answer}"]
    return "\n".join(lines) + "\n"


def json_grammar(schema: dict[str, Any]) -> str:
    """A response format's JSON schema as a grammar (an answer with no tools in play)."""
    return f"start: {lark_json(schema)}\n"


def _regex_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in r"\/.^$|?*+()[]{}" else c for c in text)
