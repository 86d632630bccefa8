"""Incremental parsing of a model's output into answer text and tool calls, as OpenAI streams them:
text as TextDelta; a call as ToolCallStart (once its name is known) then its arguments' JSON text in
ToolCallArguments fragments as the tokens arrive.

Text that may be the start of a call marker ("<tool_" of "<tool_call>") is held back until the next
delta says what it is, and so is whitespace that may only separate the answer from a call: what is
streamed as text is exactly the answer. A region that opened like a call but turns out not to be one
(not JSON, no known function's name) before its start went out is given back as text; one that breaks
after it did marks the output malformed, and a whole-output parse then answers it as text only (as
vLLM's parsers do). A region still open when the output ends was a call cut off (max_tokens): it is
neither text nor a call.
"""

from __future__ import annotations

import json

from churon.tool_calls.formats import ToolFormat
from churon.tool_calls.tool import StreamEvent, TextDelta, ToolCallArguments, ToolCallStart, new_call_id

_WHITESPACE = " \t\r\n"
# the keys a call object may open with; any other first key ({"answer": ...}) says it is not a call
_CALL_KEYS = {"name", "arguments", "parameters", "type", "id"}


class _NotACall(Exception):
    pass


class _JsonValue:
    """Finds where one JSON value ends, a character at a time (json.loads validates it later)."""

    def __init__(self):
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def push(self, ch: str) -> bool:
        """Take ch; False when ch lies past the value's end (a number's or literal's terminator)."""
        if self.in_string:
            self.text += ch
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                self.done = self.depth == 0
            return True
        if self.text and self.depth == 0:  # inside a number, true, false or null
            if ch in _WHITESPACE or ch in ",}]":
                self.done = True
                return False
            self.text += ch
            return True
        self.text += ch
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth < 0:
                raise _NotACall(f"unbalanced {ch!r}")
            self.done = self.depth == 0
        return True


class _CallObject:
    """One call's JSON object, {"name": ..., "arguments": {...}}, scanned a character at a time.

    The arguments stream as they arrive once the name is known (the usual key order); in the other
    order they are kept until the name comes. Arguments given as a JSON string holding the object
    ("arguments": "{\\"city\\": ...}") go out decoded, in one piece at their end."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str], index: int):
        self.names = names
        self.index = index
        self.arguments_keys = {fmt.arguments_key, "arguments"}
        self.state = "open"
        self.key = ""
        self.value = _JsonValue()
        self.name: str | None = None
        self.arguments: str | None = None  # the arguments' JSON text, once read
        self.streaming = False  # the arguments value is going out as it comes
        self.started = False  # ToolCallStart went out
        self.keys = 0

    @property
    def done(self) -> bool:
        return self.state == "done"

    def push(self, ch: str, out: list[StreamEvent]) -> None:
        if self.state == "value":
            if not self.value.text:
                if ch in _WHITESPACE:
                    return
                if self.key in self.arguments_keys and self.arguments is None and self.name is not None and ch != '"':
                    self._start(out)
                    self.streaming = True
            taken = self.value.push(ch)
            if taken and self.streaming:
                _append_fragment(out, self.index, ch)
            if self.value.done:
                self._end_value(out)
            if taken:
                return
        if self.state == "key":
            if ch == '"' and not _escaped(self.key):
                self.key = _string(f'"{self.key}"')
                if self.keys == 0 and self.key not in _CALL_KEYS:
                    raise _NotACall(f"an object with key {self.key!r} is not a call")
                self.keys += 1
                self.state = "colon"
            else:
                self.key += ch
            return
        if ch in _WHITESPACE:
            return
        if self.state == "open":
            self._expect(ch, "{", "key_start")
        elif self.state == "key_start":
            self._expect(ch, '"', "key")
            self.key = ""
        elif self.state == "colon":
            self._expect(ch, ":", "value")
            self.value = _JsonValue()
        elif self.state == "after_value" and ch == ",":
            self.state = "key_start"
        elif self.state == "after_value" and ch == "}":
            self._close(out)
        else:
            raise _NotACall(f"unexpected {ch!r} in a call object")

    def _expect(self, ch: str, want: str, next_state: str) -> None:
        if ch != want:
            raise _NotACall(f"expected {want!r}, got {ch!r}")
        self.state = next_state

    def _end_value(self, out: list[StreamEvent]) -> None:
        text = self.value.text
        self.state = "after_value"
        if self.key == "name":
            name = _string(text) if text.startswith('"') else None
            if name not in self.names:
                raise _NotACall(f"{text} names none of the tools")
            self.name = name
            if self.arguments is not None:  # they came first
                self._start(out)
                _append_fragment(out, self.index, self.arguments)
        elif self.key in self.arguments_keys and self.arguments is None:
            if self.streaming:
                self.streaming = False
            else:
                if text.startswith('"'):  # the arguments object serialized into a string
                    text = _string(text)
                if self.name is not None:
                    self._start(out)
                    _append_fragment(out, self.index, text)
            self.arguments = text

    def _start(self, out: list[StreamEvent]) -> None:
        if not self.started:
            self.started = True
            out.append(ToolCallStart(self.index, new_call_id(), self.name))

    def _close(self, out: list[StreamEvent]) -> None:
        if self.name is None:
            raise _NotACall("a call object without a name")
        if self.arguments is None:  # a function that takes no arguments
            self.arguments = "{}"
            self._start(out)
            _append_fragment(out, self.index, "{}")
        self.state = "done"


def _string(text: str) -> str:
    """A JSON string's value; the model's own text, so a bad escape or a raw control character says it is
    not a call rather than failing the response."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise _NotACall(f"not a JSON string: {e}") from e


def _escaped(inside: str) -> bool:
    """Whether a quote after `inside` (a JSON string's characters so far) is escaped."""
    return (len(inside) - len(inside.rstrip("\\"))) % 2 == 1


def _append_fragment(out: list[StreamEvent], index: int, text: str) -> None:
    if out and isinstance(out[-1], ToolCallArguments) and out[-1].index == index:
        out[-1] = ToolCallArguments(index, out[-1].fragment + text)
    else:
        out.append(ToolCallArguments(index, text))


def _append_text(out: list[StreamEvent], text: str) -> None:
    if out and isinstance(out[-1], TextDelta):
        out[-1] = TextDelta(out[-1].text + text)
    else:
        out.append(TextDelta(text))


class ToolCallStream:
    """One output's parser: feed(delta) and finish() return the events the text so far settles.

    States: "start" (a bare_start format, before the first character that is not whitespace),
    "text" (the answer), "list" (after mistral's marker, before its "["), "object" (inside a call's
    JSON object), "after" (past a call object: its close tag, a joiner to the next call, or the end)."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str], max_calls: int | None = None):
        """names: the functions a call may name; max_calls: the most calls reported (parallel_tool_calls
        false: 1), later ones are dropped."""
        self.fmt = fmt
        self.names = names
        self.max_calls = max_calls
        self.state = "start" if fmt.bare_start else "text"
        self.buffer = ""  # text not yet settled
        self.pending_ws = ""  # whitespace after the answer so far: more text, or what separates it from a call
        self.raw = ""  # the region that opened like a call, given back as text if it is not one
        self.call: _CallObject | None = None
        self.calls = 0  # calls started
        self.completed: set[int] = set()  # the calls whose object closed
        self.malformed = False  # a started call broke off

    def feed(self, text: str) -> list[StreamEvent]:
        self.buffer += text
        out: list[StreamEvent] = []
        self._run(out, final=False)
        return self._limited(out)

    def finish(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        self._run(out, final=True)
        # an output that ends inside a call region (max_tokens) ends with a call cut off: neither text nor a call
        self.raw, self.call = "", None
        if self.pending_ws and not self.calls:
            _append_text(out, self.pending_ws)
        self.pending_ws = ""
        return self._limited(out)

    def _limited(self, out: list[StreamEvent]) -> list[StreamEvent]:
        if self.max_calls is None:
            return out
        self.completed = {i for i in self.completed if i < self.max_calls}
        return [e for e in out if isinstance(e, TextDelta) or e.index < self.max_calls]

    def _run(self, out: list[StreamEvent], final: bool) -> None:
        handlers = {"start": self._in_start, "text": self._in_text, "list": self._in_list,
                    "object": self._in_object, "after": self._in_after}
        while self.buffer:
            before = (self.state, len(self.buffer))
            handlers[self.state](out, final)
            if (self.state, len(self.buffer)) == before:
                return  # it needs more text

    def _in_start(self, out: list[StreamEvent], final: bool) -> None:
        body = self.buffer.lstrip(_WHITESPACE)
        if not body:
            if final:
                self.pending_ws, self.buffer = self.buffer, ""
            return
        marker = self.fmt.marker
        if marker and marker.startswith(body[: len(marker)]):  # the marker, or what may be its start
            if body.startswith(marker):
                self.state = "text"
                return
            if not final:
                return
        opener = "[" if self.fmt.array else "{"
        if body[0] == opener:
            self.raw, self.buffer = self.buffer[: len(self.buffer) - len(body)], body
            self.state = "list" if self.fmt.array else "object"
        else:
            self.state = "text"

    def _in_text(self, out: list[StreamEvent], final: bool) -> None:
        marker = self.fmt.marker
        at = self.buffer.find(marker) if marker else -1
        if at >= 0:
            self._emit_text(self.buffer[:at], out)
            self.raw, self.pending_ws = self.pending_ws + marker, ""
            self.buffer = self.buffer[at + len(marker):]
            self.state = "list" if self.fmt.array else "object"
            return
        keep = 0 if final or not marker else _partial_suffix(self.buffer, marker)
        self._emit_text(self.buffer[: len(self.buffer) - keep], out)
        self.buffer = self.buffer[len(self.buffer) - keep:]

    def _in_list(self, out: list[StreamEvent], final: bool) -> None:
        body = self.buffer.lstrip(_WHITESPACE)
        self.raw += self.buffer[: len(self.buffer) - len(body)]
        self.buffer = body
        if not body:
            return
        if body[0] == "[":
            self.raw += "["
            self.buffer = body[1:]
            self.state = "object"
        else:
            self._give_back(out)

    def _in_object(self, out: list[StreamEvent], final: bool) -> None:
        if self.call is None:
            self.call = _CallObject(self.fmt, self.names, self.calls)
        call, text = self.call, self.buffer
        for i, ch in enumerate(text):
            was_started = call.started
            if not was_started:
                self.raw += ch
            try:
                call.push(ch, out)
            except _NotACall:
                self.buffer = text[i + 1:]
                if call.started:
                    self.malformed = True
                    self.call, self.state = None, "text"
                else:
                    self._give_back(out)
                return
            if call.started and not was_started:
                self.calls += 1
                self.raw = ""
            if call.done:
                self.completed.add(call.index)
                self.call, self.state = None, "after"
                self.buffer = text[i + 1:]
                return
        self.buffer = ""

    def _in_after(self, out: list[StreamEvent], final: bool) -> None:
        body = self.buffer.lstrip(_WHITESPACE)
        self.buffer = body
        if not body:
            return
        close, joiner, end = self.fmt.call_close.strip(), self.fmt.joiner.strip(), self.fmt.end.strip()
        if close and body.startswith(close):
            self.buffer, self.state = body[len(close):], "text"
        elif close and close.startswith(body):  # part of the close tag
            if final:
                self.buffer, self.state = "", "text"
        elif joiner and body[0] == joiner:
            self.buffer, self.state = body[1:], "object"
        elif end and body[0] == end:
            self.buffer, self.state = body[1:], "text"
        else:
            self.state = "text"  # lenient: whatever follows the calls is text

    def _give_back(self, out: list[StreamEvent]) -> None:
        """The region was not a call: its text is answer text, and parsing goes on after it."""
        raw, self.raw, self.call, self.state = self.raw, "", None, "text"
        self._emit_text(raw, out)

    def _emit_text(self, text: str, out: list[StreamEvent]) -> None:
        text = self.pending_ws + text
        body = text.rstrip(_WHITESPACE)
        if body:
            _append_text(out, body)
        self.pending_ws = text[len(body):]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: it may be its start)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
