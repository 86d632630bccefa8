"""Ollama's prompt templates (Go's text/template, as Modelfiles' TEMPLATE and /api/generate's `template` write
them) translated to a Jinja chat template that renders `messages` the way Ollama renders them.

A template with `{% ... %}` tags is Jinja already and is taken as it is. A Go template may use:

- text, and actions with Go's whitespace trimming: `{{- ` trims the white space before, ` -}}` after;
  comments `{{/* ... */}}`
- `{{ .System }}`, `{{ .Prompt }}`, `{{ .Response }}`, `{{ .Messages }}`; inside `{{ range .Messages }}`,
  `{{ .Role }}` and `{{ .Content }}` of each message
- `{{ if COND }}`, `{{ else if COND }}`, `{{ else }}`, `{{ end }}`; `{{ range .Messages }} ... {{ else }} ...
  {{ end }}`; a COND is a field, a string ("..." or `...`), `eq A B [C...]` (A equals any of the others),
  `ne A B`, `not A`, `and A B...`, `or A B...`, with parentheses around a nested call

Anything else is refused with its line and what it uses: other fields (.Tools, .ToolCalls, .Think, ...),
other functions (len, slice, json, index, printf, ...), pipelines (`|`), variables (`$`, `$.System`),
`with`, `define`, `template`, `block`, `break`, `continue`, and printing anything but a field or a string.

Rendering follows Ollama's template.Execute. When the template names .Messages, it renders once: .System is
every system message's content joined by blank lines, .Messages the conversation with consecutive messages of
one role merged (tool results excepted), .Prompt and .Response are empty. Otherwise (a "legacy" template)
it renders once per turn: a system message, then a user's prompt, then the assistant's response fill .System,
.Prompt and .Response, and each completed turn is rendered whole; the last one is cut after its
`{{ .Response }}`, so the output ends where the assistant's answer (or the rest of a prefilled one) goes. A
template that never names .Response gets one appended, as Ollama appends it. A Go template always ends ready
for the assistant's turn: add_generation_prompt is not consulted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from churon.tokenizer.chat_template import ChatTemplateError

ROOT_FIELDS = ("System", "Prompt", "Response", "Messages")
MESSAGE_FIELDS = ("Role", "Content")
_SPACE = " \t\r\n"
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+)
  | (?P<dot>\.)
  | (?P<variable>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<pipe>\|)
  | (?P<other>\S+?)
""", re.VERBOSE)
_LOGIC = ("eq", "ne", "not", "and", "or")
_KEYWORDS = ("if", "else", "end", "range", "with", "define", "template", "block", "break", "continue")


class GoTemplateError(ChatTemplateError):
    """A Go template churon cannot translate. line: the template's line (1-based) the error is on."""

    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.reason = message


def is_jinja(template: str) -> bool:
    return "{%" in template


def to_jinja(template: str) -> str:
    """TEMPLATE as a Jinja chat template: Jinja as it is, a Go template translated (GoTemplateError if it uses
    what the module docstring does not list)."""
    return template if is_jinja(template) else _Translator(template).translate()


@dataclass
class _Action:
    body: str  # between the delimiters and trim markers
    line: int
    source: str  # as written, for errors


def _lex(template: str) -> list[str | _Action]:
    """Text and actions, with Go's trim markers applied to the text beside them."""
    pieces: list[str | _Action] = []
    pos, line = 0, 1
    while True:
        start = template.find("{{", pos)
        if start < 0:
            pieces.append(template[pos:])
            break
        pieces.append(template[pos:start])
        line += template.count("\n", pos, start)
        end, body, left, right = _action_end(template, start, line)
        if left:
            pieces[-1] = pieces[-1].rstrip(_SPACE)
        action = _Action(body, line, template[start:end])
        pieces.append(action)
        line += template.count("\n", start, end)
        pos = end
        if right:
            rest = len(template) - len(template[pos:].lstrip(_SPACE))
            line += template.count("\n", pos, rest)
            pos = rest
    return [p for p in pieces if p != ""]


def _action_end(template: str, start: int, line: int) -> tuple[int, str, bool, bool]:
    """Where the action at `start` ends, its body, and whether it trims left and right. "}}" inside a string
    or a comment does not end it."""
    i = start + 2
    left = template.startswith("-", i) and i + 1 < len(template) and template[i + 1] in _SPACE
    if left:
        i += 2
    body_start = i
    stripped = template[i:].lstrip(_SPACE)
    if stripped.startswith("/*"):  # a comment: up to */, then the closing delimiter
        close = template.find("*/", len(template) - len(stripped))
        if close < 0:
            raise GoTemplateError(line, "unclosed comment /* without */")
        i = close + 2
    while i < len(template):
        c = template[i]
        if c in "\"`'":
            close = _string_end(template, i)
            if close < 0:
                raise GoTemplateError(line, f"unterminated string in {template[start:i + 20]!r}")
            i = close
            continue
        if template.startswith("}}", i):
            right = i >= 2 and template[i - 1] == "-" and template[i - 2] in _SPACE and i - 2 >= body_start
            body = template[body_start:i - 1 if right else i]
            return i + 2, body.strip(_SPACE), left, right
        i += 1
    raise GoTemplateError(line, f"unclosed action {template[start:start + 20]!r}... (no closing }}}})")


def _string_end(template: str, i: int) -> int:
    """The index after the string literal starting at i, or -1."""
    quote = template[i]
    j = i + 1
    while j < len(template):
        c = template[j]
        if c == "\\" and quote != "`":
            j += 2
            continue
        if c == quote:
            return j + 1
        if c == "\n" and quote != "`":
            return -1
        j += 1
    return -1


def _literal(text: str) -> str:
    """text as a Jinja string literal (Jinja decodes its escapes as Python's unicode-escape does)."""
    out = []
    for c in text:
        if c in "\\'":
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif ord(c) < 32 or c == "\x7f":
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "'" + "".join(out) + "'"


class _Translator:
    def __init__(self, template: str):
        self.pieces = _lex(template)
        actions = [p for p in self.pieces if isinstance(p, _Action)]
        # the fields it names anywhere (not a variable's: $.System), as Ollama's Vars() decides how it renders
        fields = {name for a in actions for name in re.findall(r"(?<![\w$])\.([A-Za-z_]\w*)", _no_strings(a.body))}
        self.messages_mode = "Messages" in fields
        self.names_response = "Response" in fields
        self.out: list[str] = []
        self.blocks: list[tuple[str, int]] = []  # ("if" | "range", line)
        self.cut = False  # legacy: past the first printed .Response, output only turns before the last one

    def translate(self) -> str:
        for piece in self.pieces:
            if isinstance(piece, str):
                self._emit("{{ " + _literal(piece) + " }}")
            else:
                self._action(piece)
        if self.blocks:
            kind, line = self.blocks[-1]
            raise GoTemplateError(line, f"{{{{ {kind} }}}} has no {{{{ end }}}}")
        if not self.messages_mode and not self.names_response:
            self._emit("{{ Response }}")
        body = "".join(self.out)
        return (_MESSAGES_PRELUDE + body) if self.messages_mode else (_LEGACY_MACRO.format(body=body) + _LEGACY_DRIVER)

    def _emit(self, piece: str) -> None:
        self.out.append("{% if not _last %}" + piece + "{% endif %}" if self.cut else piece)

    def _action(self, a: _Action) -> None:
        if a.body.startswith("/*"):
            return
        tokens = _tokens(a)
        if not tokens:
            raise GoTemplateError(a.line, f"empty action {a.source}")
        kind, value = tokens[0]
        if kind == "word" and value in _KEYWORDS:
            self._keyword(a, value, tokens[1:])
            return
        if tokens == [("field", ".Messages")]:
            raise GoTemplateError(a.line, f"{a.source}: .Messages is a list: print its messages' fields inside"
                                          " {{ range .Messages }}")
        if len(tokens) == 1 and kind in ("field", "string", "raw"):
            expr = self._operand(a, tokens[0])
            self._emit("{{ " + expr + " }}")
            if not self.messages_mode and kind == "field" and value == ".Response":
                self.cut = True  # Ollama's deleteNode: what follows the last turn's .Response goes
            return
        self._refuse_tokens(a, tokens)
        raise GoTemplateError(a.line, f"{a.source}: only a field or a string can be printed")

    def _keyword(self, a: _Action, word: str, rest: list[tuple[str, str]]) -> None:
        if word == "if":
            self.blocks.append(("if", a.line))
            self.out.append("{% if " + self._condition(a, rest) + " %}")
        elif word == "else":
            if not self.blocks:
                raise GoTemplateError(a.line, f"{a.source} outside an if or range")
            kind = self.blocks[-1][0]
            if rest and rest[0] == ("word", "if"):
                if kind != "if":
                    raise GoTemplateError(a.line, f"{a.source}: else if inside a range")
                self.out.append("{% elif " + self._condition(a, rest[1:]) + " %}")
            elif rest:
                self._refuse_tokens(a, rest)
                raise GoTemplateError(a.line, f"{a.source}: only else and else if are supported")
            else:
                self.out.append("{% else %}")
        elif word == "end":
            if rest:
                raise GoTemplateError(a.line, f"{a.source}: end takes nothing")
            if not self.blocks:
                raise GoTemplateError(a.line, f"{a.source} without an if or range to end")
            kind, _ = self.blocks.pop()
            self.out.append("{% endif %}" if kind == "if" else "{% endfor %}")
        elif word == "range":
            self._refuse_tokens(a, rest)
            if rest != [("field", ".Messages")]:
                raise GoTemplateError(a.line, f"{a.source}: only {{{{ range .Messages }}}} is supported")
            if self._in_range():
                raise GoTemplateError(a.line, f"{a.source}: a range inside a range")
            self.blocks.append(("range", a.line))
            self.out.append("{% for _m in _messages %}")
        else:
            raise GoTemplateError(a.line, f"{a.source}: {word} is not supported (only if, else, end, range .Messages)")

    def _in_range(self) -> bool:
        return any(kind == "range" for kind, _ in self.blocks)

    def _condition(self, a: _Action, tokens: list[tuple[str, str]]) -> str:
        self._refuse_tokens(a, tokens)
        expr, rest = self._expression(a, tokens)
        if rest:
            raise GoTemplateError(a.line, f"{a.source}: unexpected {rest[0][1]!r}")
        return expr

    def _expression(self, a: _Action, tokens: list[tuple[str, str]]) -> tuple[str, list]:
        """A call (`eq .Role "user"`) or a single operand, from tokens; returns it and the tokens after it."""
        if not tokens:
            raise GoTemplateError(a.line, f"{a.source}: a condition is missing")
        kind, value = tokens[0]
        if kind != "word":
            return self._operand_or_group(a, tokens)
        args, rest = [], tokens[1:]
        while rest and rest[0][0] != "close":
            arg, rest = self._operand_or_group(a, rest)
            args.append(arg)
        needed = {"not": (1, 1), "ne": (2, 2), "eq": (2, None), "and": (1, None), "or": (1, None)}[value]
        low, high = needed
        if len(args) < low or (high is not None and len(args) > high):
            count = f"{low}" if low == high else f"at least {low}"
            raise GoTemplateError(a.line, f"{a.source}: {value} takes {count} argument(s), not {len(args)}")
        if value == "not":
            return f"(not {args[0]})", rest
        if value == "ne":
            return f"({args[0]} != {args[1]})", rest
        if value == "eq":
            return "(" + " or ".join(f"{args[0]} == {other}" for other in args[1:]) + ")", rest
        return "(" + f" {value} ".join(args) + ")", rest

    def _operand_or_group(self, a: _Action, tokens: list) -> tuple[str, list]:
        if tokens[0][0] == "open":
            expr, rest = self._expression(a, tokens[1:])
            if not rest or rest[0][0] != "close":
                raise GoTemplateError(a.line, f"{a.source}: ( without )")
            return expr, rest[1:]
        if tokens[0][0] == "word":
            raise GoTemplateError(a.line, f"{a.source}: put the call {tokens[0][1]} in parentheses")
        return self._operand(a, tokens[0]), tokens[1:]

    def _operand(self, a: _Action, token: tuple[str, str]) -> str:
        kind, value = token
        if kind == "string":
            try:
                text = json.loads(value)
            except json.JSONDecodeError:
                raise GoTemplateError(a.line, f"{a.source}: the string {value} has an escape churon does not read") from None
            expr = _literal(text)
        elif kind == "raw":
            expr = _literal(value[1:-1])
        elif kind == "field":
            expr = self._field(a, value)
        else:
            raise GoTemplateError(a.line, f"{a.source}: unexpected {value!r}")
        return expr

    def _field(self, a: _Action, field: str) -> str:
        name = field[1:]
        if "." in name:
            raise GoTemplateError(a.line, f"{a.source}: {field} is not supported (fields of fields, such as"
                                          " .ToolCalls' .Function.Name, are not)")
        if self._in_range():
            if name in MESSAGE_FIELDS:
                return "_m.role" if name == "Role" else "(_m.content or '')"
            raise GoTemplateError(a.line, f"{a.source}: inside {{{{ range .Messages }}}}, . is the message: only .Role"
                                          " and .Content are supported there")
        if name in ROOT_FIELDS:
            if self.messages_mode:
                return {"System": "_system", "Messages": "_messages", "Prompt": "''", "Response": "''"}[name]
            return name
        where = " (they are a message's, inside {{ range .Messages }})" if name in MESSAGE_FIELDS else ""
        raise GoTemplateError(a.line, f"{a.source}: .{name} is not supported{where}; churon translates"
                                      f" {', '.join('.' + f for f in ROOT_FIELDS)}, and .Role and .Content inside"
                                      " {{ range .Messages }}")

    def _refuse_tokens(self, a: _Action, tokens: list[tuple[str, str]]) -> None:
        """The constructs outside the subset, named."""
        for kind, value in tokens:
            if kind == "pipe":
                raise GoTemplateError(a.line, f"{a.source}: pipelines (|) are not supported")
            if kind == "variable":
                raise GoTemplateError(a.line, f"{a.source}: variables ({value}) are not supported")
            if kind == "dot":
                raise GoTemplateError(a.line, f"{a.source}: the dot itself (.) is not supported, only its fields")
            if kind == "word" and value not in _LOGIC and value not in _KEYWORDS:
                raise GoTemplateError(a.line, f"{a.source}: the function {value} is not supported (only"
                                              f" {', '.join(_LOGIC)})")
            if kind == "word" and value in _KEYWORDS:
                raise GoTemplateError(a.line, f"{a.source}: {value} is not supported here")
            if kind == "other":
                raise GoTemplateError(a.line, f"{a.source}: {value!r} is not supported")


def _tokens(a: _Action) -> list[tuple[str, str]]:
    tokens = []
    for m in _TOKEN.finditer(a.body):
        if m.lastgroup != "space":
            tokens.append((m.lastgroup, m.group()))
    return tokens


def _no_strings(body: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|`[^`]*`', '""', body)


# Ollama's collate: .System is every system message joined by blank lines; .Messages merges consecutive
# messages of one role (not tool results)
_MESSAGES_PRELUDE = (
    "{% set _ns = namespace(systems=[], messages=[]) %}"
    "{% for _m in messages %}"
    "{% if _m.role == 'system' %}{% set _ns.systems = _ns.systems + [_m.content or ''] %}{% endif %}"
    "{% if _ns.messages and _ns.messages[-1].role == _m.role and _m.role != 'tool' %}"
    "{% set _ns.messages = _ns.messages[:-1] + [{'role': _m.role, 'content':"
    " (_ns.messages[-1].content or '') ~ '\\n\\n' ~ (_m.content or '')}] %}"
    "{% else %}{% set _ns.messages = _ns.messages + [_m] %}{% endif %}"
    "{% endfor %}"
    "{% set _system = _ns.systems | join('\\n\\n') %}{% set _messages = _ns.messages %}"
)
# A legacy template is one turn: a macro, called per turn as Ollama's Execute loop calls it
_LEGACY_MACRO = "{{% macro _turn(System, Prompt, Response, _last) %}}{body}{{% endmacro %}}"
_LEGACY_DRIVER = (
    "{% set _ns = namespace(system='', prompt='', response='', role=none) %}"
    "{% for _m in messages %}"
    "{% set _content = _m.content or '' %}"
    "{% if _m.role == _ns.role and _m.role != 'tool' %}"  # collate: the same role again continues the message
    "{% if _m.role == 'system' %}{% set _ns.system = _ns.system ~ '\\n\\n' ~ _content %}"
    "{% elif _m.role == 'user' %}{% set _ns.prompt = _ns.prompt ~ '\\n\\n' ~ _content %}"
    "{% elif _m.role == 'assistant' %}{% set _ns.response = _ns.response ~ '\\n\\n' ~ _content %}{% endif %}"
    "{% elif _m.role == 'system' %}"
    "{% if _ns.prompt or _ns.response %}{{ _turn(_ns.system, _ns.prompt, _ns.response, false) }}"
    "{% set _ns.prompt = '' %}{% set _ns.response = '' %}{% endif %}"
    "{% set _ns.system = _content %}"
    "{% elif _m.role == 'user' %}"
    "{% if _ns.response %}{{ _turn(_ns.system, _ns.prompt, _ns.response, false) }}"
    "{% set _ns.system = '' %}{% set _ns.response = '' %}{% endif %}"
    "{% set _ns.prompt = _content %}"
    "{% elif _m.role == 'assistant' %}{% set _ns.response = _content %}"
    "{% endif %}"
    "{% set _ns.role = _m.role %}"
    "{% endfor %}"
    "{{ _turn(_ns.system, _ns.prompt, _ns.response, true) }}"
)
