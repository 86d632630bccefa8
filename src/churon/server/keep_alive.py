"""keep_alive: how long a model stays loaded after its last request, as Ollama spells it.

    a number        seconds (300, 2.5)
    a string        Go's duration syntax: "5m", "30s", "1h30m", "500ms", or a bare number of seconds ("300")
    0               unload the model as soon as this request is answered
    negative        keep it loaded for good (-1, "-1m"): math.inf here

A request's keep_alive holds for the time after that request; a request that gives none gets the server's
--keep-alive again (Ollama's behaviour). A duration past MAX_SECONDS (a century) is for good: no clock
date is that far.
"""

from __future__ import annotations

import math
import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")

FOREVER = math.inf
MAX_SECONDS = 100 * 365 * 86400.0


def parse_keep_alive(value: str | int | float | None, where: str = "keep_alive") -> float | None:
    """Seconds (math.inf: for good; 0: unload once answered); None stays None (the server's default).
    Anything else is a ValueError naming `where` and the value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}={value!r}: {_EXPECTED}")
    if isinstance(value, str):
        seconds = _duration(value.strip(), where)
    else:
        seconds = float(value)
        if math.isnan(seconds):
            raise ValueError(f"{where}={value!r}: {_EXPECTED}")
    return FOREVER if seconds < 0 or seconds > MAX_SECONDS else seconds


_EXPECTED = ('give seconds (300), a duration ("5m", "30s", "1h"), 0 to unload the model once answered,'
             " or a negative value to keep it loaded")


def _duration(text: str, where: str) -> float:
    if _NUMBER.fullmatch(text):
        return float(text)
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    parts = list(_PART.finditer(body))
    if not body or not parts or "".join(p.group(0) for p in parts) != body:
        raise ValueError(f"{where}={text!r}: not a duration; {_EXPECTED}")
    return sign * sum(float(p.group(1)) * _UNITS[p.group(2)] for p in parts)
