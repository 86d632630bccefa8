"""Ollama's options (a Modelfile's PARAMETERs, the `options` of its API) checked, and turned into SamplingParams'
keyword arguments.

A Modelfile gives every value as text ("0.7"); the API sends JSON numbers: check_options takes both and
returns them typed. The names and meanings are Ollama's: num_predict -1 (or -2, or 0) generates up to the
context, repeat_last_n 0 disables the penalties and -1 lets them see the whole context, seed -1 is a random one.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from typing import Any, Mapping

log = logging.getLogger("churon")

OPTIONS: dict[str, type] = {
    "num_ctx": int,
    "num_predict": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repeat_penalty": float,
    "repeat_last_n": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "seed": int,
    "stop": list,
}
# Sampling options Ollama has and churon does not implement: they would change the output, so they are refused,
# named as such in the error rather than as unknown words
OLLAMA_ONLY = ("num_keep", "typical_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline")
# How llama.cpp runs under Ollama (GPU layers, threads, mmap): they do not change the output, and clients send them
# (Open WebUI's settings page has them), so they are ignored, said once per name
RUNTIME_ONLY = ("num_batch", "num_gpu", "main_gpu", "num_thread", "numa", "use_mmap", "use_mlock", "low_vram",
                "f16_kv", "logits_all", "vocab_only")
_ignored: set[str] = set()
# What each option may be: (test, what the error says it must be)
_RANGES = {
    "num_ctx": (lambda v: v >= 2, "an integer >= 2"),
    "num_predict": (lambda v: v >= -2, "an integer >= 1, or -1 / -2 / 0 for up to the context"),
    "temperature": (lambda v: v >= 0, ">= 0 (0 is greedy)"),
    "top_k": (lambda v: v >= 0, "an integer >= 0 (0 disables it)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repeat_penalty": (lambda v: 1e-2 <= v <= 1e2, "in [0.01, 100] (1 disables it)"),
    "repeat_last_n": (lambda v: v >= -1, "an integer >= -1 (0 disables the penalties, -1 is num_ctx)"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "seed": (lambda v: -(1 << 63) <= v < 1 << 63, "a 64-bit integer"),
}
# num_predict's "no limit": the engine lowers max_tokens to what the context leaves
UP_TO_THE_CONTEXT = sys.maxsize
# Ollama's option -> SamplingParams' field, where the names differ (num_ctx is the engine's, not sampling's)
_SAMPLING_NAMES = {"num_predict": "max_tokens", "repeat_penalty": "repetition_penalty"}


def check_options(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A typed copy of `options`; an unknown option or a bad value is a ValueError naming `where` (a Modelfile's
    line, a request's field), the option and the value."""
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}: options must be an object of option names and values, not {options!r}")
    checked = {}
    for name, value in options.items():
        if name in RUNTIME_ONLY:
            if name not in _ignored:
                _ignored.add(name)
                log.warning("%s: %s tunes how Ollama runs llama.cpp; churon ignores it", where, name)
            continue
        if name not in OPTIONS:
            if name in OLLAMA_ONLY:
                raise ValueError(f"{where}: {name} is an Ollama option churon does not implement"
                                 f" (churon's options: {', '.join(OPTIONS)})")
            raise ValueError(f"{where}: unknown option {name!r} (churon's options: {', '.join(OPTIONS)})")
        checked[name] = _typed(name, value, where)
    return checked


def _typed(name: str, value: Any, where: str) -> Any:
    kind = OPTIONS[name]
    if kind is list:  # stop: one string (a Modelfile's PARAMETER stop) or a list of them
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"{where}: stop={value!r}: must be a non-empty string or a list of them")
        return list(stops)
    number = _number(value, kind)
    if number is None:
        expected = "an integer" if kind is int else "a number"
        raise ValueError(f"{where}: {name}={value!r}: must be {expected}")
    ok, expected = _RANGES[name]
    if not ok(number):
        raise ValueError(f"{where}: {name}={value!r}: must be {expected}")
    return number


def _number(value: Any, kind: type) -> int | float | None:
    """value as an int or a finite float, from a JSON number or a Modelfile's text; None if it is not one."""
    if isinstance(value, bool):  # JSON's true is no number, though Python's bool is an int
        return None
    if isinstance(value, str):
        try:
            value = float(value) if kind is float else int(value.strip())
        except ValueError:
            return None
    if kind is int and isinstance(value, float) and value.is_integer():  # JSON may send 40.0 for 40
        value = int(value)
    if kind is int:
        return value if isinstance(value, int) else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def sampling_kwargs(options: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments of checked options (num_ctx, the context, is the caller's to apply)."""
    kwargs = {}
    for name, value in options.items():
        if name == "num_ctx":
            continue
        if name == "num_predict" and value <= 0:
            value = UP_TO_THE_CONTEXT
        if name == "seed" and value == -1:  # Ollama's default: a random seed
            value = None
        kwargs[_SAMPLING_NAMES.get(name, name)] = value
    return kwargs


def format_parameters(parameters: Mapping[str, Any]) -> str:
    """Checked options as `ollama show --parameters` prints them: a name, padding, the value (a string quoted);
    a list (stop) one line a value."""
    lines = []
    for name, value in parameters.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"{name:<30} {json.dumps(v, ensure_ascii=False) if isinstance(v, str) else v}")
    return "\n".join(lines)
