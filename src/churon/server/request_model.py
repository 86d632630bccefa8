"""RequestModel: the base of every API's request bodies (OpenAI's, Anthropic's, ...).

Strict about the fields it knows: a string where a number belongs is a 400 naming the field, never a
silent coercion. Lenient about the fields it does not: clients send their dialect's newer or vendor
fields (GuideLLM's `stream_options.continuous_usage_stats`, `store`, `metadata`, `service_tier`), and
refusing them breaks the client for a field that changes nothing. As vLLM does, an unknown field is
accepted, ignored and logged once per field name; a field the API documents but churon does not
implement (a model's `UNIMPLEMENTED`) is named as such in that warning.

Every string must be Unicode text: JSON's escapes can spell a lone surrogate ("\\ud800"), which Python
decodes into a str that no tokenizer, and no UTF-8 encoder, takes. It is a 400 naming the field.
"""

from __future__ import annotations

import logging
import threading
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, field_validator, model_validator
from pydantic_core import PydanticCustomError

log = logging.getLogger("churon.server")

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    # fields of the API this model mirrors that churon accepts and ignores: named so in the warning
    UNIMPLEMENTED: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="after")
    @classmethod
    def _unicode_text(cls, value):
        _check_text(value)
        return value

    @model_validator(mode="after")
    def _ignore_unknown_fields(self):
        extra = self.__pydantic_extra__
        if extra:
            for name in list(extra):
                _warn_once(type(self), name)
            extra.clear()  # ignored: nothing downstream may read them
        return self


def _check_text(value) -> None:
    """Raise for a lone surrogate in value's strings (a nested RequestModel has checked its own)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise PydanticCustomError(
                    "lone_surrogate", "a lone surrogate ({char}) at character {at}: text must be valid Unicode",
                    {"char": f"\\u{ord(value[e.start]):04x}", "at": e.start}) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k)
            _check_text(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_text(v)


def _warn_once(model: type[RequestModel], name: str) -> None:
    key = (model.__qualname__, name)
    with _warned_lock:
        if key in _warned or len(_warned) >= 1024:  # a client inventing names cannot grow this without bound
            return
        _warned.add(key)
    if name in model.UNIMPLEMENTED:
        log.warning("%s: ignoring field %r: churon does not implement it", model.__qualname__, name)
    else:
        log.warning("%s: ignoring unknown field %r", model.__qualname__, name)
