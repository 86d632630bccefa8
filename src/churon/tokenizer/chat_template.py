"""Chat templates: jinja2 rendered in its immutable sandbox, with the helpers Hugging Face provides
(raise_exception, strftime_now, a tojson that does not escape HTML).

A model without a template gets ChatML when its vocabulary has <|im_start|> and <|im_end|>; any
other model without one raises ChatTemplateError.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from churon.errors import ChuronError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ChuronError, ValueError):
    """A chat template failed to compile or to render (raise_exception, sandbox violation, ...)."""


class ChatTemplate:
    """One model's template, compiled on first use. source: the model file, named in errors."""

    def __init__(self, text: str, source: str):
        self.text = text
        self.source = source
        self._compiled = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **variables: Any) -> str:
        template = self._compile()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2.TemplateError, SecurityError, or a Python error inside the template
            raise ChatTemplateError(f"{self.source}: chat template failed: {type(e).__name__}: {e}") from e

    def _compile(self):
        if self._compiled is None:
            try:
                self._compiled = _jinja_env().from_string(self.text)
            except Exception as e:
                line = getattr(e, "lineno", None)
                where = f" (line {line})" if line else ""
                raise ChatTemplateError(f"{self.source}: chat template does not compile{where}: {e}") from e
        return self._compiled


def _jinja_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Hugging Face's version: jinja's own escapes HTML characters, which templates do not want
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
