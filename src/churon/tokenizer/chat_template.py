"""Chat templates: jinja2 rendered in its immutable sandbox, with the helpers Hugging Face provides
(raise_exception, strftime_now, a tojson that does not escape HTML).

A model without a template gets ChatML when its vocabulary has <|im_start|> and <|im_end|>; any
other model without one raises ChatTemplateError.

A template is the model file's code, and a rendering is bounded: it stops with ChatTemplateLimitError
past `timeout` seconds or `max_chars` characters of output (a request's error; the model's load
fails when a one-message conversation cannot render, see LLM). Jinja cannot be interrupted from
outside, so the bounds are checked from inside: on every call the template makes (functions,
methods, macros), on every iteration of its loops (each {% for %}'s iterable is wrapped at
compile time: even an empty nested loop counts), and on every piece of output, rendered through
template.generate(). The operators that can build a huge value from small ones in one step (`*`
and `**`) are checked before they run; `+`, `~`, calls and filters (which at most double a value,
or make it once) after, so that no loop can grow a value past the output limit.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import time
from typing import Any, Iterable, Iterator

from churon.errors import ChuronError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's own template (text only), for GGUFs that carry none (Gemma 3 270M's): a system message opens the
# first user turn, the assistant's turns are the model's. llama.cpp's built-in "gemma" template renders the same.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (prefix if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
RENDER_TIMEOUT_SECONDS = 2.0  # real templates render a conversation in milliseconds
MAX_RENDERED_CHARS = 1 << 24  # 16 Mi characters; a 128k-token context holds about 0.5 Mi of ordinary text
MAX_INT_BITS = 1 << 16  # an integer a template computes (`**`, `*`) is at most this wide

_ITERATE = "churon_bounded_iteration"  # the filter each loop's iterable is wrapped in
_SIZED = "churon_bounded_size"  # the filter each `~` concatenation and filter's result is wrapped in


class ChatTemplateError(ChuronError, ValueError):
    """A chat template failed to compile or to render (raise_exception, sandbox violation, a limit, ...)."""


class ChatTemplateLimitError(ChatTemplateError):
    """A rendering ran past its time or output-size limit: the template's fault, not the conversation's."""


class _Budget:
    """One rendering's limits."""

    def __init__(self, source: str, timeout: float, max_chars: int):
        self.source, self.timeout, self.max_chars = source, timeout, max_chars
        self.deadline = time.monotonic() + timeout

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(f"{self.source}: the chat template ran past its limit of {self.timeout:g} s")

    def size(self, value: Any) -> Any:
        """value, unless it is a string or list longer than the output may be."""
        if isinstance(value, (str, list, tuple)) and len(value) > self.max_chars:
            raise self.too_long(len(value))
        return value

    def too_long(self, n: int) -> ChatTemplateLimitError:
        return ChatTemplateLimitError(
            f"{self.source}: the chat template made {n} characters or items, past its limit of {self.max_chars}"
        )


# The rendering in progress on this thread (or task): the sandbox's hooks get no argument of ours.
_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("churon_chat_template_budget")


class ChatTemplate:
    """One model's template, compiled on first use. source: the model file, named in errors."""

    def __init__(self, text: str, source: str, timeout: float = RENDER_TIMEOUT_SECONDS,
                 max_chars: int = MAX_RENDERED_CHARS):
        self.text = text
        self.source = source
        self.timeout = timeout
        self.max_chars = max_chars
        self._compiled = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **variables: Any) -> str:
        template = self._compile()
        budget = _Budget(self.source, self.timeout, self.max_chars)
        token = _budget.set(budget)
        pieces, size = [], 0
        try:
            for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
                size += len(piece)
                if size > self.max_chars:
                    raise budget.too_long(size)
                budget.tick()
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2.TemplateError, SecurityError, or a Python error inside the template
            raise ChatTemplateError(f"{self.source}: chat template failed: {type(e).__name__}: {e}") from e
        finally:
            _budget.reset(token)
        return "".join(pieces)

    def check(self) -> None:
        """Compile it now (a template given by a user is checked when it is given): ChatTemplateError if it does not."""
        self._compile()

    def _compile(self):
        if self._compiled is None:
            try:
                env = _jinja_env()
                self._compiled = env.from_string(_bounded(env.parse(self.text), env))
            except Exception as e:
                line = getattr(e, "lineno", None)
                where = f" (line {line})" if line else ""
                raise ChatTemplateError(f"{self.source}: chat template does not compile{where}: {e}") from e
        return self._compiled


def _bounded(tree, env):
    """The parsed template with every loop's iterable, `~` concatenation and filter's result passed
    through the budget's filters."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def wrap(node, name):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    class Bound(NodeTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = wrap(node.iter, _ITERATE)
            return node

        def visit_Concat(self, node):
            return wrap(self.generic_visit(node), _SIZED)

        visit_Filter = visit_Concat  # a filter's result (|center(10**9)) is checked as a call's is

    tree = Bound().visit(tree)
    tree.set_environment(env)
    return tree


def _iterate(iterable: Iterable) -> Iterator:
    budget = _budget.get()
    for item in iterable:
        budget.tick()
        yield item


def _size(value: Any) -> Any:
    return _budget.get().size(value)


def _jinja_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call(self, context, obj, /, *args, **kwargs):
            budget = _budget.get()
            budget.tick()
            return budget.size(super().call(context, obj, *args, **kwargs))

        def call_binop(self, context, operator, left, right):
            budget = _budget.get()
            budget.tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > budget.max_chars:
                        raise budget.too_long(len(seq) * n)
                if isinstance(left, int) and isinstance(right, int):
                    _check_int_bits(budget, abs(left).bit_length() + abs(right).bit_length())
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                _check_int_bits(budget, right * abs(left).bit_length())
            return budget.size(super().call_binop(context, operator, left, right))

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Hugging Face's version: jinja's own escapes HTML characters, which templates do not want
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.filters[_ITERATE] = _iterate
    env.filters[_SIZED] = _size
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _check_int_bits(budget: _Budget, bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise ChatTemplateLimitError(
            f"{budget.source}: the chat template computes an integer of about {bits} bits, past its limit of {MAX_INT_BITS}"
        )
