r"""The tool-call syntaxes models are trained on, and which one a chat template speaks.

Each format is the exact text a model writes for its calls (what a constraining grammar produces)
and, from it, what the parser looks for:

    hermes        <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (Hermes 2 Pro, Qwen2.5,
                  Qwen3; one block per call, answer text may come before them)
    llama3_json   {"name": ..., "parameters": {...}}                             (Llama 3.1 / 3.2 / 3.3:
                  the whole output is the call; several are joined with "; ", as vLLM's llama3_json parser reads them)
    mistral       [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]             (Mistral 7B v0.3, Nemo, Small)

A template that never renders `tools` has no format of its own: the generic fallback describes the
tools in the system turn and asks for the hermes syntax, which grammars then enforce.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    arguments_key: str  # the call object's key for the arguments: "arguments" or "parameters"
    begin: str = ""  # before the first call (mistral's "[TOOL_CALLS][")
    call_open: str = ""  # around each call's JSON object (hermes's tags)
    call_close: str = ""
    joiner: str = ""  # between two calls (the grammar writes it; the parser also takes whitespace around it)
    end: str = ""  # after the last call
    # a special token that opens the calls (mistral's [TOOL_CALLS]): the grammar writes it as the token,
    # and decoding with skip_special_tokens drops it from the text, so the parser also takes calls that
    # open the output bare
    begin_token: str | None = None
    bare_start: bool = False  # calls may open the output without any marker (llama3_json: always)

    @property
    def array(self) -> bool:
        """The calls are one JSON array (mistral's)."""
        return self.begin.endswith("[")

    @property
    def marker(self) -> str | None:
        """The text that opens a call anywhere in the output (None: calls only open the output)."""
        return self.begin_token or self.call_open.strip() or None


# Forced hermes calls go back to back, no newline between: after a call the grammar offers the end of the
# turn or the next "<tool_call>". A model that would go on in text after its call (SmolLM2 does) writes a
# newline first, and with "\n" as the joiner the grammar then forces it into another call, and another.
HERMES = ToolFormat("hermes", "arguments", call_open="<tool_call>\n", call_close="\n</tool_call>")
LLAMA3_JSON = ToolFormat("llama3_json", "parameters", joiner="; ", bare_start=True)
MISTRAL = ToolFormat("mistral", "arguments", begin="[TOOL_CALLS][", joiner=", ", end="]", begin_token="[TOOL_CALLS]",
                     bare_start=True)

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}

# the `tools` variable inside a {% ... %} or {{ ... }} (not the word in the template's text)
_RENDERS_TOOLS = re.compile(r"\{[%{][^}]*\btools\b")


def detect_format(template: str | None) -> ToolFormat | None:
    """The format a chat template renders tools and tool calls in; None when it renders no `tools`
    (or in a syntax churon does not know), which is the generic fallback's case."""
    if not template or not _RENDERS_TOOLS.search(template):
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        return LLAMA3_JSON
    return None
