"""Structured output: constrain decoding to JSON valid against a JSON schema, or to a Lark grammar
(llguidance's dialect: tool calls embed each function's schema with %json), with llguidance.

Per engine, a StructuredOutput holds llguidance's view of the vocabulary (an LLTokenizer:
every token's bytes, which ones are special, the end-of-generation ids), built once on the
first constrained request because it walks the whole vocabulary. Per request, a Grammar
wraps an LLMatcher compiled from the schema or grammar: before each draw it gives the tokens allowed
next (the sampler sends the others to -inf), after it consumes the drawn token. When the
matcher stops (the JSON value is complete) the request is done.

The mask depends only on the request's own tokens, so batching cannot change it.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import numpy as np
import torch

from churon.tokenizer import Tokenizer


# One canonical layout, json.dumps's: {"a": 1, "b": [2, 3]}. llguidance's default allows any
# whitespace between tokens, and small models then often emit newlines until max_tokens.
# A schema's own "x-guidance" key overrides this.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammar:
    """One request's matcher: which tokens may come next, and the tokens drawn so far."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed_tokens(self) -> torch.Tensor:
        """bool [vocab]: True where the grammar accepts the token next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        # llguidance packs token i into bit i % 32 of 32-bit word i // 32 (little endian)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return torch.from_numpy(mask)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            # the sampler only draws allowed tokens, so this is a bug, not bad input
            raise RuntimeError(f"structured output: token {token} rejected by the grammar: {self.matcher.get_error()}")

    def num_valid(self, tokens: list[int]) -> int:
        """How many of tokens, in order, the grammar would accept from here (changes nothing): speculative
        decoding cuts a proposal there, since the sampler would never draw the token after."""
        return self.matcher.validate_tokens(tokens)

    @property
    def is_terminated(self) -> bool:
        """The output is a complete value and nothing more can follow."""
        return self.matcher.is_stopped()


class StructuredOutput:
    """Compiles JSON schemas and Lark grammars into per-request Grammars for one model's vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def grammar(self, json_schema: dict[str, Any] | None = None, *, lark: str | None = None) -> Grammar:
        """A fresh matcher for the JSON schema or the Lark grammar (exactly one); ValueError naming
        the problem ("invalid json_schema: ...", "invalid grammar: ...") when it does not compile."""
        if (json_schema is None) == (lark is None):
            raise ValueError("structured output needs exactly one of json_schema and lark")
        what = "json_schema" if lark is None else "grammar"
        try:
            if lark is None:
                source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(json_schema), defaults=JSON_FORMAT)
            else:
                source = llguidance.LLMatcher.grammar_from_lark(lark)
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid {what}: {e}") from e
        lltokenizer = self._get_lltokenizer()
        error = llguidance.LLMatcher.validate_grammar(source, lltokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid {what}: {error}")
        matcher = llguidance.LLMatcher(lltokenizer, source, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {what}: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size)

    def _get_lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # the async front end calls add_request from its event loop
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_VocabularyView(self.tokenizer, self.vocab_size)),
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self.tokenizer.eog_ids) or None,  # None: the wrapper's eos_token_id
                )
        return self._lltokenizer


class _VocabularyView:
    """The attributes and the encode call llguidance.TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        """vocab_size: the model's (its logits' width), which may exceed the tokenizer's: extra ids have no bytes."""
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        n = min(vocab_size, tokenizer.vocab_size)
        # special tokens (the ones skip_special_tokens drops) get llguidance's 0xFF marker so the
        # grammar never matches their text ("<|im_end|>") as if it were ordinary output
        self.special_token_ids = [i for i in range(n) if tokenizer.decode([i]) != tokenizer.decode([i], skip_special_tokens=False)]
        special = set(self.special_token_ids)
        self.tokens = [(b"\xff" if i in special else b"") + tokenizer.token_bytes(i) for i in range(vocab_size)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_bos=False, parse_special=False)
