r"""The generic fallback, for chat templates that render no `tools` (SmolLM2's, ChatML): churon writes
the tools into the system turn itself, in the Hermes / Qwen2.5 wording small models have seen most, and
turns the history's tool calls and results into text the template accepts:

    assistant tool_calls  ->  the assistant's text, then <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> per call
    tool results          ->  one user turn of <tool_response>\n...\n</tool_response> blocks (as Qwen2.5's template)

The calls the model answers with are then in the hermes format, which grammars enforce.
"""

from __future__ import annotations

import json
from typing import Any

from churon.tool_calls.tool import Tool, ToolChoice


def tools_system_prompt(tools: list[Tool], choice: ToolChoice) -> str:
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    if choice.mode == "function":
        rule = f"You must call the function {choice.name}."
    elif choice.mode == "required":
        rule = "You must call one or more of these functions."
    else:
        rule = "Answer in plain text when no function is needed."
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n' + rule
    )


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def fallback_messages(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """The conversation in roles and plain-text content every chat template takes."""
    out: list[dict[str, Any]] = []
    previous = None
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if previous == "tool":  # one user turn for a run of results
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": role, "content": content})
        previous = role
    if system_prompt is not None:
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" if out[0]["content"] else "") + system_prompt
        else:
            out.insert(0, {"role": "system", "content": system_prompt})
    return out
