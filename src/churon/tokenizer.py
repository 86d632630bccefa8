"""Tokenizer: text -> token ids -> text, the chat template, and the incremental detokenizer.

Encoding is done by Hugging Face `tokenizers` (the Rust library). A GGUF file carries no
tokenizer.json, so `Tokenizer.from_gguf` builds one from the metadata to reproduce what
llama.cpp's llama-vocab.cpp does with the same file:

  tokenizer.ggml.model "gpt2"  byte-level BPE from tokens + merges. The pre-tokenizer is
                               the list of regexes llama.cpp picks for tokenizer.ggml.pre,
                               applied one after another (each splits the pieces of the
                               previous one, matches and gaps both kept), then the GPT-2
                               byte-to-unicode mapping.
  tokenizer.ggml.model "llama" SentencePiece-style BPE: spaces escaped to "▁", a "▁" put in
                               front of every piece of text (the first one, and every one
                               that follows a special token, as llama.cpp does) when
                               tokenizer.ggml.add_space_prefix, the whole piece merged at
                               once with the merge whose result has the best score, unknown
                               characters as <0xXX> byte tokens.

Control, unknown and user-defined tokens (tokenizer.ggml.token_type 3, 2, 4) are added
tokens: with parse_special=True the text "<|im_start|>" becomes its one id; with
parse_special=False control and unknown tokens are plain text, user-defined ones are still
matched (llama.cpp does the same).

Decoding a GGUF tokenizer goes through a table of the bytes of every token (llama.cpp's
token_to_piece), so a multi-byte character split across tokens comes out whole once all of
its tokens are there. `IncrementalDetokenizer` streams text with the prefix/read-offset
technique and never emits half a character.

Chat templates are rendered in jinja2's immutable sandbox with the helpers Hugging Face
provides (raise_exception, strftime_now, a tojson that does not escape HTML). A model
without a template gets ChatML when its vocabulary has <|im_start|> and <|im_end|>; any
other model without one raises ChatTemplateError.
"""

from __future__ import annotations

import datetime
import json
import numbers
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from churon.errors import ChuronError, ModelFileError, UnsupportedModelError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space


class ChatTemplateError(ChuronError, ValueError):
    """A chat template failed to compile or to render (raise_exception, sandbox violation, ...)."""


# ---------------------------------------------------------------------------------------
# Pre-tokenizers for byte-level BPE, copied from llama.cpp's llm_tokenizer_bpe (llama-vocab.cpp).
# llama.cpp runs the regexes of a list one after another; each splits the pieces produced
# by the one before, keeping both the matches and the text between them.

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _BPEPre:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is taken as is (llama3)
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_DEFAULT_PRE = _BPEPre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_PRE = _BPEPre((_GPT2,))
_DIGITS_GPT2_PRE = _BPEPre((r"\p{N}", _GPT2))
_LLAMA3_PRE = _BPEPre((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _BPEPre((_QWEN2,))

BPE_PRE_TOKENIZERS: dict[str, _BPEPre] = {
    "default": _DEFAULT_PRE,
    # GPT-2 regex
    **dict.fromkeys(
        ["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
         "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat", "a.x-4.0", "mellum", "modern-bert",
         "exaone4", "trillion", "granite-docling"],
        _GPT2_PRE,
    ),
    # each digit alone, then the GPT-2 regex
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    _DIGITS_GPT2_PRE),
    # Llama 3
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
                    _LLAMA3_PRE),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _BPEPre((_LLAMA3,))),
    # Qwen2: the Llama 3 regex with single digits
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"], _QWEN2_PRE),
    "falcon": _BPEPre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
}

# Tokens llama.cpp treats as end of generation wherever they are in the vocabulary
# (llama_vocab::impl::load, "maintain a list of tokens that cause end-of-generation").
EOG_TOKEN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
})
# llama.cpp also stops on its FIM pad/repo/file-separator tokens.
_FIM_EOG_TOKEN_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
})

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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


def _byte_level_to_bytes(text: str) -> bytes:
    """A byte-level BPE token back to its bytes (llama.cpp's llama_decode_text)."""
    try:
        return bytes(_BYTE_DECODER[c] for c in text)
    except KeyError:  # not a byte-level string; llama.cpp prints [UNK_BYTE_...], we keep the text
        return text.encode("utf-8")


# ---------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Build one with `from_gguf(metadata)` or `from_hf_dir(path)`.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        source: str,
        bos_id: int | None,
        eos_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
        piece_bytes: list[bytes] | None = None,
        special_ids: frozenset[int] = frozenset(),
        strip_leading_space: bool = False,
    ) -> None:
        self._hf = hf
        self._hf_plain: HFTokenizer | None = None  # the same with special tokens not parsed; built on demand
        self._hf_bytes: list[bytes] | None = None  # Hugging Face files only: every token's bytes, built on demand
        self._lock = threading.Lock()
        self._source = source
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        # GGUF only: the bytes of every token, the ids dropped by skip_special_tokens, and
        # whether decoding drops the space SentencePiece put in front of the text.
        self._piece_bytes = piece_bytes
        self._special_ids = special_ids
        self._strip_leading_space = strip_leading_space
        self._template = None

    # --- properties -------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self._piece_bytes is not None:
            return len(self._piece_bytes)
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self._hf.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self._hf.id_to_token(self.eos_id)

    def id_to_piece(self, id: int) -> str:
        """The text of one token, special tokens included (partial UTF-8 shows as U+FFFD)."""
        if self._piece_bytes is not None:
            return self._piece_bytes[id].decode("utf-8", errors="replace")
        return self._hf.decode([id], skip_special_tokens=False)

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes token `id` stands for: byte-level BPE pieces mapped back to bytes,
        SentencePiece's "▁" to a space, byte-fallback "<0xAB>" to its byte, special tokens
        as their text. b"" for ids outside the vocabulary (a model's padding rows)."""
        table = self._piece_bytes if self._piece_bytes is not None else self._hf_token_bytes()
        return table[id] if 0 <= id < len(table) else b""

    def _hf_token_bytes(self) -> list[bytes]:
        # built once: structured output asks for every token's bytes
        if self._hf_bytes is None:
            with self._lock:
                if self._hf_bytes is None:
                    decoder = json.dumps(json.loads(self._hf.to_str()).get("decoder"))
                    byte_level = '"ByteLevel"' in decoder
                    added = self._hf.get_added_tokens_decoder()
                    vocab = self._hf.get_vocab(with_added_tokens=True)
                    table = [b""] * (max(vocab.values(), default=-1) + 1)
                    for text, i in vocab.items():
                        if i in added:
                            table[i] = added[i].content.encode("utf-8")
                        elif byte_level:
                            table[i] = _byte_level_to_bytes(text)
                        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                            table[i] = bytes([int(text[3:5], 16)])
                        else:
                            table[i] = text.replace(SPM_SPACE, " ").encode("utf-8")
                    self._hf_bytes = table
        return self._hf_bytes

    def token_to_id(self, token: str) -> int | None:
        """The id of a token given its vocabulary text (e.g. "<|im_end|>"), or None."""
        return self._hf.token_to_id(token)

    # --- encode / decode --------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`.

        add_bos: None adds BOS when the model asks for it (`self.add_bos`); True/False force it.
        BOS is never added twice: text that already starts with the BOS token (e.g. a rendered
        chat template with parse_special) keeps the one it has.
        parse_special: the text of control tokens (e.g. "<|im_start|>") becomes their id;
        False tokenizes it as plain text. User-defined added tokens are matched either way.
        """
        if parse_special:
            hf = self._hf
        else:
            hf = self._plain_tokenizer()
        ids = hf.encode(text, add_special_tokens=False).ids if text else []
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos:
            if self.bos_id is None:
                raise ModelFileError(f"{self._source}: add_bos requested but the model has no BOS token")
            if not ids or ids[0] != self.bos_id:
                ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Control tokens (BOS, EOS, <|im_end|>...) are left out when
        skip_special_tokens; ids outside the vocabulary decode to nothing."""
        return self._decode(ids, skip_special_tokens, at_start=True)

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool, at_start: bool) -> str:
        if self._piece_bytes is None:
            return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        pieces = self._piece_bytes
        n = len(pieces)
        skip = self._special_ids if skip_special_tokens else frozenset()
        data = b"".join(pieces[i] for i in ids if 0 <= i < n and i not in skip)
        text = data.decode("utf-8", errors="replace")
        if at_start and self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def _plain_tokenizer(self) -> HFTokenizer:
        if self._hf_plain is None:
            with self._lock:
                if self._hf_plain is None:
                    plain = HFTokenizer.from_str(self._hf.to_str())
                    plain.encode_special_tokens = True
                    self._hf_plain = plain
        return self._hf_plain

    # --- chat template ----------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (as Hugging Face does).

        Extra keyword arguments (tools=..., documents=...) are passed to the template.
        Without a template: ChatML when the vocabulary has <|im_start|>/<|im_end|>, else
        ChatTemplateError.
        """
        template = self._compiled_template()
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        variables.update(kwargs)
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2.TemplateError, SecurityError, or a Python error inside the template
            raise ChatTemplateError(f"{self._source}: chat template failed: {type(e).__name__}: {e}") from e

    def _compiled_template(self):
        if self._template is not None:
            return self._template
        source = self.chat_template
        if source is None:
            if self._hf.token_to_id("<|im_start|>") is not None and self._hf.token_to_id("<|im_end|>") is not None:
                source = _CHATML_TEMPLATE
            else:
                raise ChatTemplateError(
                    f"{self._source}: the model has no chat template (and no <|im_start|>/<|im_end|> tokens "
                    "for a ChatML fallback); use plain completion instead"
                )
        try:
            self._template = _jinja_env().from_string(source)
        except Exception as e:
            line = getattr(e, "lineno", None)
            where = f" (line {line})" if line else ""
            raise ChatTemplateError(f"{self._source}: chat template does not compile{where}: {e}") from e
        return self._template

    # --- constructors -----------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], source: str = "<gguf>") -> "Tokenizer":
        """Build the tokenizer llama.cpp would build from a GGUF file's metadata."""
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFileError(f"{source}: no tokenizer.ggml.model in the metadata")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"{source}: tokenizer.ggml.model = {model!r} is not supported (known: 'gpt2', 'llama')"
            )
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelFileError(f"{source}: tokenizer.ggml.tokens is missing or empty")
        tokens = list(tokens)
        n = len(tokens)
        types = metadata.get("tokenizer.ggml.token_type")
        if types is None:
            types = [TOKEN_NORMAL] * n
        elif len(types) < n:
            raise ModelFileError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        types = [int(t) for t in types[:n]]

        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if not isinstance(t, str):
                raise ModelFileError(f"{source}: tokenizer.ggml.tokens[{i}] is not a string: {t!r}")
            if t == "":
                t = tokens[i] = f"[EMPTY_{i}]"  # llama.cpp names empty tokens the same way
            if t in vocab:
                raise ModelFileError(
                    f"{source}: duplicate token {t!r} in tokenizer.ggml.tokens (ids {vocab[t]} and {i})"
                )
            vocab[t] = i

        # Tokens llama.cpp recognises by their text as end-of-generation are control tokens
        # even when the converter marked them normal.
        for i, t in enumerate(tokens):
            if (t in EOG_TOKEN_TEXTS or t in _FIM_EOG_TOKEN_TEXTS) and types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED):
                types[i] = TOKEN_CONTROL

        if model == "gpt2":
            pre_name = metadata.get("tokenizer.ggml.pre")
            if not pre_name:
                warnings.warn(f"{source}: no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
                pre_name = "default"
            pre = BPE_PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise UnsupportedModelError(
                    f"{source}: tokenizer.ggml.pre = {pre_name!r} is not supported (known: "
                    + ", ".join(sorted(BPE_PRE_TOKENIZERS)) + ")"
                )
            merges_raw = metadata.get("tokenizer.ggml.merges")
            if not isinstance(merges_raw, list):
                raise ModelFileError(f"{source}: tokenizer.ggml.merges is missing (needed by the gpt2 tokenizer)")
            merges = []
            for k, m in enumerate(merges_raw):
                pos = m.find(" ", 1)
                if pos < 0:
                    raise ModelFileError(f"{source}: tokenizer.ggml.merges[{k}] = {m!r} has no space")
                merges.append((m[:pos], m[pos + 1:]))
            try:
                bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
            except Exception as e:
                raise ModelFileError(f"{source}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {e}") from e
            hf = HFTokenizer(bpe)
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)]
            )
            hf.decoder = decoders.ByteLevel()
            default_add_bos = pre.add_bos
            default_bos = default_eos = None
            strip_leading_space = False
        else:  # "llama": SentencePiece
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None:
                scores = [0.0] * n
            elif len(scores) < n:
                raise ModelFileError(f"{source}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
            merges = _spm_merges(tokens, scores, vocab)
            has_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
            unk = next((tokens[i] for i in range(n) if types[i] == TOKEN_UNKNOWN), None)
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=has_bytes))
            escape = normalizers.Replace(" ", SPM_SPACE)
            if add_space_prefix:
                hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), escape])
            else:
                hf.normalizer = escape
            steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            if add_space_prefix:
                steps.append(decoders.Strip(" ", 1, 0))
            hf.decoder = decoders.Sequence(steps)
            default_add_bos = True
            default_bos, default_eos = (1 if n > 1 else None), (2 if n > 2 else None)
            strip_leading_space = add_space_prefix

        # Control and unknown tokens are special (parse_special decides); user-defined are always matched.
        added = []
        for i, t in enumerate(tokens):
            if types[i] in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED):
                special = types[i] != TOKEN_USER_DEFINED
                added.append(AddedToken(t, special=special, normalized=False))
        if added:
            hf.add_special_tokens([a for a in added if a.special])
            hf.add_tokens([a for a in added if not a.special])
        for a in added:
            if hf.token_to_id(a.content) != vocab[a.content]:
                raise ModelFileError(f"{source}: added token {a.content!r} did not keep id {vocab[a.content]}")

        piece_bytes: list[bytes] = []
        for i, t in enumerate(tokens):
            ty = types[i]
            if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED):
                piece_bytes.append(t.encode("utf-8"))
            elif ty == TOKEN_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                piece_bytes.append(bytes([int(t[3:5], 16)]))
            elif ty == TOKEN_UNUSED or ty not in (TOKEN_NORMAL, TOKEN_BYTE):
                piece_bytes.append(b"")  # llama.cpp's token_to_piece prints nothing for these
            elif model == "gpt2":
                piece_bytes.append(_byte_level_to_bytes(t))
            else:
                piece_bytes.append(t.replace(SPM_SPACE, " ").encode("utf-8"))
        special_ids = frozenset(i for i in range(n) if types[i] in (TOKEN_CONTROL, TOKEN_UNKNOWN))

        def token_id(key: str, default: int | None) -> int | None:
            v = metadata.get(key)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < n:
                warnings.warn(f"{source}: {key} = {v!r} is not a token id (the vocabulary has {n} tokens); ignored")
                return default
            return int(v)

        bos_id = token_id("tokenizer.ggml.bos_token_id", default_bos)
        eos_id = token_id("tokenizer.ggml.eos_token_id", default_eos)
        eot_id = token_id("tokenizer.ggml.eot_token_id", None)
        eom_id = token_id("tokenizer.ggml.eom_token_id", None)
        eog = {vocab[t] for t in (EOG_TOKEN_TEXTS | _FIM_EOG_TOKEN_TEXTS) if t in vocab}
        # llama.cpp's exceptions: gpt-oss / solar-open continue after <|end|>, gemma4 after </s>
        if "<|end|>" in vocab and (
            ("<|return|>" in vocab and "<|call|>" in vocab) or ("<|calls|>" in vocab and "<|flush|>" in vocab)
        ):
            eog.discard(vocab["<|end|>"])
        if "</s>" in vocab and "<|tool_response>" in vocab:
            eog.discard(vocab["</s>"])
        eog.update(i for i in (eos_id, eot_id, eom_id) if i is not None)

        add_bos = metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)
        if not isinstance(add_bos, bool):
            raise ModelFileError(f"{source}: tokenizer.ggml.add_bos_token = {add_bos!r} is not a bool")
        if add_bos and bos_id is None:
            raise ModelFileError(
                f"{source}: tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is not set"
            )

        template = metadata.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelFileError(f"{source}: tokenizer.chat_template is not a string")
        return cls(
            hf,
            source=source,
            bos_id=bos_id,
            eos_id=eos_id,
            eog_ids=frozenset(eog),
            add_bos=add_bos,
            chat_template=template,
            piece_bytes=piece_bytes,
            special_ids=special_ids,
            strip_leading_space=strip_leading_space,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load tokenizer.json (+ tokenizer_config.json, generation_config.json) from a model directory."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelFileError(f"{path}: no tokenizer.json (churon needs the fast-tokenizer file)")
        try:
            hf = HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise ModelFileError(f"{tj}: cannot be read by tokenizers: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def special(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                return None
            if not isinstance(value, str):
                raise ModelFileError(f"{path / 'tokenizer_config.json'}: {key} = {value!r} is not a token")
            tid = hf.token_to_id(value)
            if tid is None:
                raise ModelFileError(f"{path / 'tokenizer_config.json'}: {key} = {value!r} is not in tokenizer.json")
            return tid

        bos_id = special("bos_token")
        eos_id = special("eos_token")
        if bos_id is None and isinstance(gen.get("bos_token_id"), int):
            bos_id = gen["bos_token_id"]
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        if eos_id is None and gen_eos:
            eos_id = gen_eos[0]
        eog = {i for i in [eos_id, *gen_eos] if isinstance(i, int)}
        for tid, tok in hf.get_added_tokens_decoder().items():
            if tok.special and tok.content in EOG_TOKEN_TEXTS:
                eog.add(tid)

        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # tokenizer.json's post-processor is what adds BOS for most models: ask it
            with_special = hf.encode("a", add_special_tokens=True).ids
            without = hf.encode("a", add_special_tokens=False).ids
            add_bos = (
                bos_id is not None and with_special[:1] == [bos_id] and without[:1] != [bos_id]
            )
        if add_bos and bos_id is None:
            raise ModelFileError(f"{path}: add_bos_token is true but no bos_token is defined")

        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "chat_template.json").is_file():
            template = _read_json(path / "chat_template.json").get("chat_template")
        else:
            template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = by_name.get("default", next(iter(by_name.values()), None))
        if template is not None and not isinstance(template, str):
            raise ModelFileError(f"{path}: chat_template is not a string")
        return cls(
            hf,
            source=str(path),
            bos_id=bos_id,
            eos_id=eos_id,
            eog_ids=frozenset(eog),
            add_bos=add_bos,
            chat_template=template,
        )


def _spm_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SPM tokenizer (and sentencepiece's BPE).

    llama.cpp merges any two neighbouring pieces whose concatenation is a token, best score
    first (leftmost on a tie). As BPE merges: every split (left, right) of a token into two
    tokens, ranked by the score of the whole token.
    """
    ranked = []
    for tid, text in enumerate(tokens):
        if len(text) < 2:
            continue
        for k in range(1, len(text)):
            left, right = text[:k], text[k:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[tid]), tid, k, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return data


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


# ---------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns a stream of generated ids into a stream of text.

    Prefix/read-offset technique: decode a short window of recent ids twice, without and
    with the ids not yet shown, and emit only the difference. Text ending in U+FFFD (an
    unfinished multi-byte character) is held back until its last byte arrives.
    """

    PREFIX_WINDOW = 5  # prompt ids decoded as context for the first generated token

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids]
        self._read_offset = len(self._ids)  # ids before this are shown
        self._prefix_offset = max(len(self._ids) - self.PREFIX_WINDOW, 0)  # window start

    def add(self, token_id: int) -> str:
        """Add one id; return the text that is now complete (possibly "")."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is left at the end (an unfinished character comes out as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        p, r = self._prefix_offset, self._read_offset
        at_start = p == 0
        prefix = self._tok._decode(self._ids[p:r], self._skip, at_start)
        text = self._tok._decode(self._ids[p:], self._skip, at_start)
        if len(text) > len(prefix) and (final or not text.endswith("\ufffd")):
            self._prefix_offset, self._read_offset = r, len(self._ids)
            return text[len(prefix):]
        return ""
