"""Detokenizer: one request's generated ids as a stream of text, cut at its stop strings.

Incremental decoding uses the prefix/read-offset technique: decode a short window of recent ids
twice, without and with the ids not yet shown, and take only the difference. Text ending in U+FFFD
(an unfinished multi-byte character) is held back until its last byte arrives.

Stop strings are searched in the decoded text; text that could be the start of one is held back
until it is not, so no part of a stop string is ever emitted.
"""

from __future__ import annotations

from typing import Sequence

from churon.tokenizer.core import Tokenizer


class Detokenizer:
    PREFIX_WINDOW = 5  # prompt ids decoded as context for the first generated token

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 stop: Sequence[str] = ()):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids]
        self._read_offset = len(self._ids)  # ids before this are decoded
        self._prefix_offset = max(len(self._ids) - self.PREFIX_WINDOW, 0)  # window start
        self._stops = list(stop)
        self._text = ""  # everything decoded so far (cut at a stop string once one is found)
        self._emitted = 0  # how much of it was released
        self.stopped = False  # a stop string was found: nothing more comes out

    def update(self, token_id: int) -> str:
        """Add one generated id; return the text that is now complete and cannot be part of a stop string."""
        self._ids.append(int(token_id))
        return self._release(self._decode(final=False))

    def finish(self) -> str:
        """The end of the request: everything left (an unfinished character comes out as U+FFFD), up to
        a stop string if the rest completes one."""
        text = self._release(self._decode(final=True))
        if not self.stopped:
            text += self._text[self._emitted :]
            self._emitted = len(self._text)
        return text

    def _decode(self, final: bool) -> str:
        p, r = self._prefix_offset, self._read_offset
        at_start = p == 0
        prefix = self._tok.decode(self._ids[p:r], self._skip, at_start)
        text = self._tok.decode(self._ids[p:], self._skip, at_start)
        if len(text) > len(prefix) and (final or not text.endswith("\ufffd")):
            self._prefix_offset, self._read_offset = r, len(self._ids)
            return text[len(prefix):]
        return ""

    def _release(self, piece: str) -> str:
        """Add decoded text; return what is safe to emit now (setting `stopped` at a stop string)."""
        if self.stopped:
            return ""
        self._text += piece
        if not self._stops:
            out = self._text[self._emitted :]
            self._emitted = len(self._text)
            return out
        longest = max(len(s) for s in self._stops)
        search_from = max(0, self._emitted - longest + 1)
        hits = [i for s in self._stops if (i := self._text.find(s, search_from)) >= 0]
        if hits:
            end = min(hits)
            out = self._text[self._emitted : end]
            self._text = self._text[:end]
            self._emitted = end
            self.stopped = True
            return out
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(self._text) - self._emitted), 0, -1):
                if self._text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = len(self._text) - hold
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
