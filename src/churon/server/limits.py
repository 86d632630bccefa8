"""Bounded work per request: how much engine work one HTTP request may ask for.

A request body is small (--max-body-bytes), but what it asks for multiplies: `n` copies of each of
a list of prompts, each copy a whole engine request; thousands of logit_bias entries or stop strings
that every sampled token pays for; logprobs over every token. Each limit is a 400 naming the request
field, the limit and the `churon serve` flag that sets it, before any of that work is done.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

from churon.sampling import MAX_LOGPROBS
from churon.server.errors import APIError


@dataclass(frozen=True)
class RequestLimits:
    max_choices: int = 128  # engine requests of one HTTP request: n x the number of prompts
    max_prompt_tokens: int = 1 << 20  # prompt tokens over all of a request's choices
    max_logit_bias: int = 1024  # logit_bias entries
    max_stop: int = 64  # stop strings
    max_stop_chars: int = 1024  # characters of one stop string: the detokenizer holds that much output back
    max_logprobs: int = MAX_LOGPROBS  # alternatives per token (vLLM's --max-logprobs)
    max_embedding_inputs: int = 2048  # inputs of one embeddings request (OpenAI's limit)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < (0 if f.name == "max_logprobs" else 1):
                raise ValueError(f"{f.name}={value!r}: must be an integer >= {0 if f.name == 'max_logprobs' else 1}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"max_logprobs={self.max_logprobs}: must be <= {MAX_LOGPROBS}")

    def check_choices(self, n: int, prompts: int, param: str = "n") -> None:
        """n choices of each of `prompts` prompts: checked before a prompt is tokenized or a request built."""
        if n * prompts > self.max_choices:
            of = f"n={n} x {prompts} prompts = {n * prompts} choices" if prompts > 1 else f"n={n} choices"
            raise APIError(400, f"{of}: more than this server's limit of {self.max_choices} per request (--max-choices)",
                           param=param, code="too_many_choices")

    def check_embedding_inputs(self, n: int, param: str = "input") -> None:
        if n > self.max_embedding_inputs:
            raise APIError(400, f"{param} has {n} inputs: more than this server's limit of {self.max_embedding_inputs}"
                           " per request (--max-embedding-inputs)", param=param, code="too_many_inputs")

    def check_prompt_tokens(self, total: int, param: str, what: str = "prompts") -> None:
        """what: "prompts" (n choices each, counted in total) or "inputs" (an embeddings request's)."""
        if total > self.max_prompt_tokens:
            over = " over all its choices" if what == "prompts" else ""
            raise APIError(400, f"the request's {what} come to {total} tokens{over}: more than this server's limit"
                           f" of {self.max_prompt_tokens} per request (--max-prompt-tokens)",
                           param=param, code="too_many_prompt_tokens")

    def check_logit_bias(self, entries: int, param: str = "logit_bias") -> None:
        if entries > self.max_logit_bias:
            raise APIError(400, f"{param} has {entries} entries: more than this server's limit of {self.max_logit_bias}"
                           " (--max-logit-bias)", param=param)

    def check_stop(self, stop: Sequence[str], param: str = "stop") -> None:
        if len(stop) > self.max_stop:
            raise APIError(400, f"{param} has {len(stop)} strings: more than this server's limit of {self.max_stop}"
                           " (--max-stop)", param=param)
        for s in stop:
            if len(s) > self.max_stop_chars:
                raise APIError(400, f"{param}: a stop string of {len(s)} characters is longer than this server's limit"
                               f" of {self.max_stop_chars}", param=param)

    def check_logprobs(self, k: int | None, param: str) -> None:
        if k is not None and not 0 <= k <= self.max_logprobs:
            raise APIError(400, f"{param}={k}: must be in [0, {self.max_logprobs}], this server's limit (--max-logprobs)",
                           param=param)
