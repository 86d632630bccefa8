"""ToolPlan: one chat request's tool calling, for every API that offers it (OpenAI's chat completions and
Responses, Anthropic's Messages): the prompt, the grammar that constrains the output, and the parser that
reads calls back out of it.

Which syntax: the one the model's chat template renders tools in (formats.detect_format); a template
with no tool support gets the generic fallback (fallback.py: tools described in the system turn, the
hermes syntax). How constrained, by tool_choice:

    none       no tools in the prompt, text out (parsed as text)
    auto       native template: unconstrained, the model's own format parsed out (vLLM's "auto");
               fallback: an answer or calls (the grammar keeps a started call valid)
    required   calls only (one, or several with parallel), each valid against its function's schema
    function   exactly one call, to that function

A response format's JSON schema constrains the answer: the grammar is then the schema alone, or the
schema or calls. Callers pass plan.grammar as SamplingParams(grammar=...) and no json_schema.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Sequence

from churon.tool_calls.fallback import fallback_messages, tools_system_prompt
from churon.tool_calls.formats import HERMES, ToolFormat, detect_format
from churon.tool_calls.grammar import calls_grammar, json_grammar, lark_json
from churon.tool_calls.stream import ToolCallStream
from churon.tool_calls.tool import (
    NAME_PATTERN,
    StreamEvent,
    TextDelta,
    Tool,
    ToolCall,
    ToolCallArguments,
    ToolCallError,
    ToolCallStart,
    ToolChoice,
)

if TYPE_CHECKING:
    from churon.llm import LLM

_ROLES = ("system", "user", "assistant", "tool")
_MODES = ("auto", "none", "required", "function")


class ToolPlan:
    def __init__(self, prompt_ids: list[int], grammar: str | None, fmt: ToolFormat | None, tools: list[Tool],
                 parallel: bool, native: bool):
        self.prompt_ids = prompt_ids
        self.grammar = grammar
        self.format = fmt  # None: the output holds no calls (no tools, or tool_choice none)
        self.tools = tools
        self.parallel = parallel
        self.native = native  # the template renders the tools itself

    @classmethod
    def build(cls, llm: LLM, messages: Sequence[dict[str, Any]], tools: Sequence[Tool], choice: ToolChoice,
              parallel: bool = True, json_schema: dict[str, Any] | None = None) -> ToolPlan:
        """Raises ToolCallError naming the field for bad tools, tool_choice, messages or json_schema."""
        tools = list(tools)
        _check_tools(llm, tools)
        _check_choice(choice, tools)
        if json_schema is not None:
            _compiles(llm, json_schema, "json_schema")
        messages = template_messages(messages)
        calling = bool(tools) and choice.mode != "none"
        native = detect_format(llm.tokenizer.chat_template)
        fmt = native or HERMES
        try:
            if native is not None:
                prompt_ids = llm.chat_prompt_ids(messages, tools=[t.as_openai() for t in tools] if calling else None)
            else:
                system = tools_system_prompt(tools, choice) if calling else None
                prompt_ids = llm.chat_prompt_ids(fallback_messages(messages, system))
        except ValueError as e:  # the chat template refused the conversation
            raise ToolCallError(str(e), "messages") from e
        if not calling:
            grammar = None if json_schema is None else json_grammar(json_schema)
            return cls(prompt_ids, grammar, None, tools, parallel, native is not None)
        begin_token = llm.tokenizer.token_to_id(fmt.begin_token) if fmt.begin_token else None
        if choice.mode == "function":
            named = [t for t in tools if t.name == choice.name]
            grammar = calls_grammar(fmt, named, parallel=False, begin_token_id=begin_token, answer=None)
            parallel = False
        elif choice.mode == "required":
            grammar = calls_grammar(fmt, tools, parallel=parallel, begin_token_id=begin_token, answer=None)
        elif json_schema is not None:
            grammar = calls_grammar(fmt, tools, parallel=parallel, begin_token_id=begin_token, answer=lark_json(json_schema))
        elif native is None:
            grammar = calls_grammar(fmt, tools, parallel=parallel, begin_token_id=begin_token, answer="text")
        else:
            grammar = None
        return cls(prompt_ids, grammar, fmt, tools, parallel, native is not None)

    def stream(self) -> ToolCallStream | _PlainText:
        """A parser for one output (one per choice)."""
        if self.format is None:
            return _PlainText()
        return ToolCallStream(self.format, frozenset(t.name for t in self.tools), max_calls=None if self.parallel else 1)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output as (content, tool calls): content None when there are calls and no text.
        An output whose calls do not parse is all content (as vLLM answers it)."""
        if self.format is None:
            return text, []
        stream = self.stream()
        events = stream.feed(text) + stream.finish()
        content = "".join(e.text for e in events if isinstance(e, TextDelta))
        calls: dict[int, list[str]] = {}
        for e in events:
            if isinstance(e, ToolCallStart):
                calls[e.index] = [e.id, e.name, ""]
            elif isinstance(e, ToolCallArguments):
                calls[e.index][2] += e.fragment
        done = [ToolCall(*calls[i]) for i in sorted(calls) if i in stream.completed]
        if stream.malformed or not all(_is_object(c.arguments) for c in done):
            return text, []
        return (content or None) if done else content, done


class _PlainText:
    """The parser of a plan without tools: every delta is answer text."""

    completed: set[int] = set()
    malformed = False

    def feed(self, text: str) -> list[StreamEvent]:
        return [TextDelta(text)] if text else []

    def finish(self) -> list[StreamEvent]:
        return []


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _compiles(llm: LLM, schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise ToolCallError(f"{param} must be a JSON schema object", param)
    try:
        llm.engine.structured_output.grammar(schema)
    except ValueError as e:
        raise ToolCallError(f"{param}: {e}", param) from e


def _check_tools(llm: LLM, tools: list[Tool]) -> None:
    seen = set()
    for i, t in enumerate(tools):
        if not isinstance(t.name, str) or not NAME_PATTERN.match(t.name):
            raise ToolCallError(f"tools[{i}].name {t.name!r}: must be 1 to 64 letters, digits, '_' or '-'", f"tools[{i}].name")
        if t.name in seen:
            raise ToolCallError(f"tools[{i}].name {t.name!r}: two tools have this name", f"tools[{i}].name")
        seen.add(t.name)
        param = f"tools[{i}].parameters"
        if isinstance(t.parameters, dict) and t.parameters.get("type", "object") != "object":
            raise ToolCallError(f"{param}: a function's parameters must be an object schema "
                                f"(type \"object\"), not {t.parameters.get('type')!r}", param)
        _compiles(llm, t.parameters, param)


def _check_choice(choice: ToolChoice, tools: list[Tool]) -> None:
    if choice.mode not in _MODES:
        raise ToolCallError(f"tool_choice {choice.mode!r}: must be one of {', '.join(_MODES)}", "tool_choice")
    if choice.mode in ("required", "function") and not tools:
        raise ToolCallError(f"tool_choice {choice.mode!r} needs tools", "tool_choice")
    if choice.mode == "function" and not choice.name:
        raise ToolCallError("tool_choice 'function' needs the function's name", "tool_choice")
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise ToolCallError(f"tool_choice names the function {choice.name!r}, which is not among the tools", "tool_choice")


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages checked and put the way Hugging Face templates take them: a call's arguments as a dict (a
    JSON string is parsed, as vLLM does), every content a string but that of an assistant that only calls
    tools. ToolCallError names the message at fault."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _ROLES:
            raise ToolCallError(f"messages[{i}].role {role!r}: must be one of {', '.join(_ROLES)}", f"messages[{i}].role")
        message = dict(m)
        if role == "tool" and not (isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]):
            raise ToolCallError(f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                                f"messages[{i}].tool_call_id")
        if m.get("tool_calls"):
            if role != "assistant":
                raise ToolCallError(f"messages[{i}]: only assistant messages have tool_calls", f"messages[{i}].tool_calls")
            message["tool_calls"] = [_checked_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
        else:
            message.pop("tool_calls", None)
            if message.get("content") is None:
                message["content"] = ""
        out.append(message)
    return out


def _checked_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function") or {}
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise ToolCallError(f"{where}.function.name: a tool call needs the function's name", f"{where}.function.name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ToolCallError(f"{where}.function.arguments is not JSON: {e}", f"{where}.function.arguments") from e
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}
