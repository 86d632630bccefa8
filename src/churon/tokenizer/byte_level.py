"""GPT-2's byte-level alphabet (every byte as a printable character) and SentencePiece's escaped space."""

from __future__ import annotations

SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def byte_level_to_bytes(text: str) -> bytes:
    """A byte-level BPE token back to its bytes (llama.cpp's llama_decode_text)."""
    try:
        return bytes(_BYTE_DECODER[c] for c in text)
    except KeyError:  # not a byte-level string; llama.cpp prints [UNK_BYTE_...], we keep the text
        return text.encode("utf-8")
