"""Ollama's Modelfiles: the recipe of a created model (a base model, a system prompt, parameters, a template, a
seeded conversation, a license), read as Ollama's parser/parser.go reads it and written back as `ollama show
--modelfile` writes it.

    # a comment
    FROM smollm2-135m                   a registry name, a path (relative to the Modelfile), or a created model
    ADAPTER ./my-lora                   a LoRA adapter on it (a PEFT directory or a GGUF adapter; relative to
                                        the Modelfile too), applied to every request: one, as Ollama takes
    SYSTEM You are a pirate.            the system turn
    PARAMETER temperature 0.2           an Ollama option (churon.ollama_options); PARAMETER stop accumulates
    TEMPLATE \"\"\"{{ .Prompt }}\"\"\"        the chat template: Go-template syntax (the subset in
                                        churon.tokenizer.go_template) or Jinja
    MESSAGE user Hello                  seeded history: role system, user or assistant
    LICENSE \"\"\"...\"\"\"                   the model's license (repeatable)

Instructions are case-insensitive. A value runs to the end of its line; one in "quotes" or \"\"\"triple quotes\"\"\"
may span lines and ends at the first line end where its closing quotes are the last characters. A `#` starts a
comment only where an instruction could start. Ollama's DRAFT, RENDERER, PARSER and REQUIRES are refused. Every
error names its line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from churon.errors import ChuronError
from churon.ollama_options import check_options
from churon.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from churon.tokenizer.go_template import GoTemplateError, is_jinja, to_jinja

INSTRUCTIONS = ("FROM", "SYSTEM", "PARAMETER", "TEMPLATE", "MESSAGE", "ADAPTER", "LICENSE")
ROLES = ("system", "user", "assistant")
_NOT_SUPPORTED = ("DRAFT", "RENDERER", "PARSER", "REQUIRES")  # Ollama's, for models churon does not run
_SPACE = " \t"


class ModelfileError(ChuronError, ValueError):
    """A Modelfile (or /api/create's fields) churon cannot create a model from; the message names the line
    (or the field) and the instruction."""


@dataclass
class Modelfile:
    """A recipe. None (messages: None) is "not given": a model created FROM another created model inherits it."""

    from_: str
    adapter: str | None = None  # ADAPTER as written (model_store resolves and checks it)
    system: str | None = None
    parameters: dict = field(default_factory=dict)  # checked Ollama options; stop a list
    template: str | None = None  # as written: a Go template or a Jinja one
    messages: list[dict] | None = None
    license: str | None = None
    from_line: int | None = field(default=None, compare=False, repr=False)  # where a Modelfile's FROM is, for errors
    adapter_line: int | None = field(default=None, compare=False, repr=False)  # and its ADAPTER

    def inherit(self, parent: Modelfile) -> Modelfile:
        """This recipe over its parent's: what this one leaves out comes from the parent, parameters key by key
        (as Ollama merges them)."""
        return replace(
            self,
            adapter=parent.adapter if self.adapter is None else self.adapter,  # one adapter: this one replaces it
            system=parent.system if self.system is None else self.system,
            parameters={**parent.parameters, **self.parameters},
            template=parent.template if self.template is None else self.template,
            messages=parent.messages if self.messages is None else self.messages,
            license=parent.license if self.license is None else self.license,
        )

    def text(self) -> str:
        """The canonical Modelfile, as `ollama show --modelfile` writes one (parse_modelfile reads it back)."""
        lines = [f"FROM {self.from_}"]
        if self.adapter is not None:  # where Ollama writes it: right after FROM
            lines.append(f"ADAPTER {_quote(self.adapter)}")
        if self.template is not None:
            lines.append(f"TEMPLATE {_quote(self.template)}")
        if self.system is not None:
            lines.append(f"SYSTEM {_quote(self.system)}")
        for name, value in self.parameters.items():
            for v in value if isinstance(value, list) else [value]:
                lines.append(f"PARAMETER {name} {_quote(str(v))}")
        for m in self.messages or []:
            lines.append(f"MESSAGE {m['role']} {_quote(m['content'])}")
        if self.license is not None:
            lines.append(f"LICENSE {_quote(self.license)}")
        return "\n".join(lines) + "\n"


def _quote(value: str) -> str:
    """Ollama's quote(): plain unless the value has a line break or spaces at its ends."""
    if "\n" in value or value != value.strip(_SPACE) or value == "":
        return f'"""{value}"""' if '"' in value or "\n" in value else f'"{value}"'
    return value


def parse_modelfile(text: str) -> Modelfile:
    """The recipe a Modelfile's text writes; ModelfileError naming the line for anything churon cannot use."""
    text = text.replace("\r\n", "\n").removeprefix("\ufeff")
    froms: list[tuple[int, str]] = []
    adapter_line = None
    recipe = {"parameters": {}}
    for line, name, argument, value in _instructions(text):
        where = f"line {line} ({name})"
        if name == "FROM":
            froms.append((line, value))
            if len(froms) > 1:
                raise ModelfileError(f"line {line}: a second FROM (the first is on line {froms[0][0]}); a Modelfile"
                                     " has one base model")
            if not value:
                raise ModelfileError(f"{where}: FROM names no model")
        elif name == "SYSTEM":
            recipe["system"] = value
        elif name == "PARAMETER":
            try:
                checked = check_options({argument: value}, where)[argument]
            except ValueError as e:
                raise ModelfileError(str(e)) from None
            if argument == "stop":
                recipe["parameters"].setdefault("stop", []).extend(checked)
            else:
                recipe["parameters"][argument] = checked
        elif name == "TEMPLATE":
            chat_template(value, name, first_line=line)
            recipe["template"] = value
        elif name == "MESSAGE":
            recipe.setdefault("messages", []).append({"role": argument, "content": value})
        elif name == "LICENSE":
            recipe["license"] = value if recipe.get("license") is None else recipe["license"] + "\n\n" + value
        elif name == "ADAPTER":
            if adapter_line is not None:  # Ollama applies one adapter per model, and so does a request here
                raise ModelfileError(f"line {line}: a second ADAPTER (the first is on line {adapter_line}); a model"
                                     " takes one LoRA adapter")
            recipe["adapter"], adapter_line = value, line
    if not froms:
        raise ModelfileError("no FROM line: a Modelfile needs one (FROM a registry name, a path or a created model)")
    return Modelfile(from_=froms[0][1], from_line=froms[0][0], adapter_line=adapter_line, **recipe)


def chat_template(template: str, where: str, first_line: int = 1) -> str:
    """A TEMPLATE as the Jinja chat template churon renders, checked now: a Go template's unsupported parts, or a
    Jinja one that does not compile, are a ModelfileError naming `where` (TEMPLATE, or the field "template") and the
    line, counted from first_line (a Modelfile's line the template starts on)."""
    try:
        jinja = to_jinja(template)
        ChatTemplate(jinja, "the template").check()
    except GoTemplateError as e:
        raise ModelfileError(f"line {first_line + e.line - 1} ({where}): {e.reason}") from None
    except ChatTemplateError as e:
        kind = "a Jinja template" if is_jinja(template) else "the Go template's translation"
        raise ModelfileError(f"line {first_line} ({where}): {kind}: {e}") from None
    return jinja


_NAME = re.compile(r"[A-Za-z]+")
_PARAMETER_NAME = re.compile(r"[A-Za-z0-9_]+")


def _instructions(text: str):
    """(line, INSTRUCTION, argument, value) of every instruction; argument: PARAMETER's name, MESSAGE's role."""
    pos, line = 0, 1
    while pos < len(text):
        c = text[pos]
        if c == "\n":
            pos, line = pos + 1, line + 1
            continue
        if c in _SPACE:
            pos += 1
            continue
        if c == "#":
            end = text.find("\n", pos)
            pos = len(text) if end < 0 else end
            continue
        m = _NAME.match(text, pos)
        word = m.group() if m else text[pos:].split(None, 1)[0]
        name = word.upper()
        after = pos + len(word)
        if not m or name not in INSTRUCTIONS:
            if name in _NOT_SUPPORTED:
                raise ModelfileError(f"line {line}: {name} is an Ollama instruction churon does not support")
            raise ModelfileError(f"line {line}: unknown instruction {word!r} (a Modelfile's instructions are"
                                 f" {', '.join(INSTRUCTIONS)})")
        if after < len(text) and text[after] not in _SPACE + "\n":
            raise ModelfileError(f"line {line}: unknown instruction {text[pos:].split(None, 1)[0]!r}")
        argument = None
        if name in ("PARAMETER", "MESSAGE"):
            after, argument = _argument(text, after, line, name)
        start_line = line
        pos, line, value = _value(text, after, line, name)
        yield start_line, name, argument, value


def _argument(text: str, pos: int, line: int, name: str) -> tuple[int, str]:
    """PARAMETER's option name or MESSAGE's role, after the instruction."""
    while pos < len(text) and text[pos] in _SPACE:
        pos += 1
    pattern = _PARAMETER_NAME if name == "PARAMETER" else _NAME
    m = pattern.match(text, pos)
    what = "an option name" if name == "PARAMETER" else "a role (system, user or assistant)"
    if not m or (m.end() < len(text) and text[m.end()] not in _SPACE + "\n"):
        found = text[pos:].split("\n", 1)[0].strip()
        raise ModelfileError(f"line {line} ({name}): expected {what}, found {found!r}" if found else
                             f"line {line} ({name}): expected {what} and a value")
    if name == "MESSAGE" and m.group() not in ROLES:
        raise ModelfileError(f"line {line} (MESSAGE): role {m.group()!r}: must be one of {', '.join(ROLES)}")
    if m.end() >= len(text) or text[m.end()] == "\n":
        raise ModelfileError(f"line {line} ({name} {m.group()}): a value is missing")
    return m.end(), m.group()


def _value(text: str, pos: int, line: int, name: str) -> tuple[int, int, str]:
    """The value from pos: (where the next instruction may start, its line, the value unquoted)."""
    start_line = line
    while pos < len(text) and text[pos] in _SPACE:
        pos += 1
    if pos >= len(text) or text[pos] == "\n":
        raise ModelfileError(f"line {line} ({name}): a value is missing")
    quote = '"""' if text.startswith('"""', pos) else '"' if text.startswith('"', pos) else ""
    end = pos
    while True:
        eol = text.find("\n", end)
        eol = len(text) if eol < 0 else eol
        raw = text[pos:eol].strip(_SPACE)
        if not quote or (len(raw) >= 2 * len(quote) and raw.endswith(quote)):
            value = raw[len(quote):len(raw) - len(quote)] if quote else raw
            return eol, line, value
        if eol >= len(text):
            if quote in raw[len(quote):]:
                raise ModelfileError(f"line {start_line} ({name}): text after the value's closing {quote} (a quoted"
                                     " value ends its line)")
            raise ModelfileError(f"line {start_line} ({name}): the value's opening {quote} is never closed")
        end, line = eol + 1, line + 1
