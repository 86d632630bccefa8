"""A tokenizer from a GGUF file's metadata: what llama.cpp's llama-vocab.cpp builds from the same file.

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
  tokenizer.ggml.model "bert"  WordPiece (llama.cpp's WPM): the vocabulary convert_hf_to_gguf.py
                               wrote in "phantom space" form ("▁x" starts a word, "x"
                               continues one) mapped back to BERT's "##" form, then
                               Hugging Face's BertNormalizer, BertPreTokenizer and WordPiece;
                               every text is wrapped in [CLS] ... [SEP].

Control, unknown and user-defined tokens (tokenizer.ggml.token_type 3, 2, 4) are added
tokens: with parse_special=True the text "<|im_start|>" becomes its one id; with
parse_special=False control and unknown tokens are plain text, user-defined ones are still
matched (llama.cpp does the same).
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from churon.errors import ModelFileError, UnsupportedModelError
from churon.tokenizer.byte_level import SPM_SPACE, byte_level_to_bytes
from churon.tokenizer.core import Tokenizer

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6


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

# GPT-4o's (o200k_base: gpt-oss, Llama 4): words split before each capital run, contractions in any case kept on
# their word, up to three digits, a run of punctuation with the newlines and slashes after it
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
    **dict.fromkeys(["gpt-4o", "llama4"], _BPEPre((_GPT4O,))),
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


def from_gguf(metadata: dict[str, Any], source: str = "<gguf>") -> Tokenizer:
    """Build the tokenizer llama.cpp would build from a GGUF file's metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFileError(f"{source}: no tokenizer.ggml.model in the metadata")
    if model not in ("gpt2", "llama", "bert"):
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.model = {model!r} is not supported (known: 'gpt2', 'llama', 'bert')"
        )
    tokens, types, vocab = _vocabulary(metadata, source)
    if model == "bert":
        return _wordpiece(metadata, tokens, types, vocab, source)
    n = len(tokens)
    if model == "gpt2":
        hf, add_bos_default = _byte_level_bpe(metadata, vocab, source)
        default_bos = default_eos = None
        strip_leading_space = False
    else:
        hf, strip_leading_space = _sentencepiece_bpe(metadata, tokens, types, vocab, source)
        add_bos_default = True
        default_bos, default_eos = (1 if n > 1 else None), (2 if n > 2 else None)
    _add_special_tokens(hf, tokens, types, vocab, source)

    bos_id = _token_id(metadata, "tokenizer.ggml.bos_token_id", default_bos, n, source)
    eos_id = _token_id(metadata, "tokenizer.ggml.eos_token_id", default_eos, n, source)
    eot_id = _token_id(metadata, "tokenizer.ggml.eot_token_id", None, n, source)
    eom_id = _token_id(metadata, "tokenizer.ggml.eom_token_id", None, n, source)
    add_bos = _add_special(metadata, "bos", add_bos_default, bos_id, source)
    add_eos = _add_special(metadata, "eos", False, eos_id, source)
    return Tokenizer(
        hf,
        source=source,
        bos_id=bos_id,
        eos_id=eos_id,
        eog_ids=_eog_ids(vocab, (eos_id, eot_id, eom_id)),
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=_chat_template(metadata, source),
        piece_bytes=_piece_bytes(tokens, types, byte_level=model == "gpt2"),
        special_ids=frozenset(i for i in range(n) if types[i] in (TOKEN_CONTROL, TOKEN_UNKNOWN)),
        strip_leading_space=strip_leading_space,
    )


def _token_id(metadata: dict[str, Any], key: str, default: int | None, n: int, source: str) -> int | None:
    """A special token's id, or default when the key is absent; llama.cpp ignores a bad one with a warning."""
    v = metadata.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < n:
        warnings.warn(f"{source}: {key} = {v!r} is not a token id (the vocabulary has {n} tokens); ignored")
        return default
    return int(v)


def _chat_template(metadata: dict[str, Any], source: str) -> str | None:
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(f"{source}: tokenizer.chat_template is not a string")
    return template


def _vocabulary(metadata: dict[str, Any], source: str) -> tuple[list[str], list[int], dict[str, int]]:
    """tokenizer.ggml.tokens and their types, checked, and the token -> id map."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelFileError(f"{source}: tokenizer.ggml.tokens is missing or empty")
    tokens = list(tokens)
    n = len(tokens)
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        types = [TOKEN_NORMAL] * n
    else:
        types = _array(metadata, "tokenizer.ggml.token_type", numbers.Integral, "integers", n, source)

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
    return tokens, types, vocab


def _array(metadata: dict[str, Any], key: str, kind: type, what: str, n: int, source: str) -> list:
    """metadata[key] as a list of at least n elements of kind (bools are not numbers here), its first n if n."""
    values = metadata[key]
    if not isinstance(values, list):
        raise ModelFileError(f"{source}: {key} = {values!r:.80} is not an array")
    if len(values) < n:
        raise ModelFileError(f"{source}: {key} has {len(values)} entries for {n} tokens")
    values = values[:n] if n else values
    for i, v in enumerate(values):
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ModelFileError(f"{source}: {key}[{i}] = {v!r:.80} is not one of the {what} it must hold")
    return values


def _byte_level_bpe(metadata: dict[str, Any], vocab: dict[str, int], source: str) -> tuple[HFTokenizer, bool]:
    """The "gpt2" model: byte-level BPE with llama.cpp's pre-tokenizer for tokenizer.ggml.pre.
    Returns it and whether that pre-tokenizer's models add a BOS by default."""
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
    if metadata.get("tokenizer.ggml.merges") is None:
        raise ModelFileError(f"{source}: tokenizer.ggml.merges is missing (needed by the gpt2 tokenizer)")
    merges_raw = _array(metadata, "tokenizer.ggml.merges", str, "strings", 0, source)
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
    return hf, pre.add_bos


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int], vocab: dict[str, int],
                       source: str) -> tuple[HFTokenizer, bool]:
    """The "llama" model: SentencePiece-style BPE. Returns it and whether decoding drops the leading space."""
    n = len(tokens)
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * n
    else:
        scores = _array(metadata, "tokenizer.ggml.scores", numbers.Real, "numbers", n, source)
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
    return hf, add_space_prefix


# llama.cpp's ids for BERT's special tokens when the file names none (llama_vocab::impl::load, "bert")
_BERT_CLS, _BERT_SEP, _BERT_UNK = 101, 102, 100
_BERT_MAX_WORD_CHARS = 100  # Hugging Face's max_input_chars_per_word: a longer word is one [UNK]


def _wordpiece(metadata: dict[str, Any], tokens: list[str], types: list[int], vocab: dict[str, int],
               source: str) -> Tokenizer:
    """The "bert" model: BERT's WordPiece as Hugging Face's BertTokenizer runs it, with the special tokens
    llama.cpp's WPM tokenizer puts around every text: BOS ([CLS]) first and the separator ([SEP]) last."""
    n = len(tokens)
    # A file names [CLS] as BOS (gguf's SpecialVocab; cls_token_id in older files), [SEP] as the separator.
    cls_key = "tokenizer.ggml.bos_token_id"
    if cls_key not in metadata and "tokenizer.ggml.cls_token_id" in metadata:
        cls_key = "tokenizer.ggml.cls_token_id"
    cls_id = _bert_special(metadata, cls_key, _BERT_CLS, "[CLS]", n, source)
    sep_id = _bert_special(metadata, "tokenizer.ggml.seperator_token_id", _BERT_SEP, "[SEP]", n, source)
    unk_id = _bert_special(metadata, "tokenizer.ggml.unknown_token_id", _BERT_UNK, "[UNK]", n, source)
    # llama.cpp lower-cases (and strips accents) unless the file says otherwise, as uncased BERT does
    lowercase = _bool(metadata, "tokenizer.ggml.normalizer.lowercase", True, source)
    strip_accents = _bool(metadata, "tokenizer.ggml.normalizer.strip_accents", lowercase, source)

    pieces = [_from_phantom_space(t, ty) for t, ty in zip(tokens, types)]
    wordpiece_vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if piece in wordpiece_vocab:
            raise ModelFileError(
                f"{source}: tokenizer.ggml.tokens {tokens[wordpiece_vocab[piece]]!r} (id {wordpiece_vocab[piece]})"
                f" and {tokens[i]!r} (id {i}) are the same WordPiece token {piece!r}"
            )
        wordpiece_vocab[piece] = i
    hf = HFTokenizer(models.WordPiece(
        vocab=wordpiece_vocab, unk_token=pieces[unk_id], continuing_subword_prefix="##",
        max_input_chars_per_word=_BERT_MAX_WORD_CHARS,
    ))
    hf.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    _add_special_tokens(hf, pieces, types, wordpiece_vocab, source)
    eos_id = _token_id(metadata, "tokenizer.ggml.eos_token_id", None, n, source)
    return Tokenizer(
        hf,
        source=source,
        bos_id=cls_id,
        eos_id=sep_id,
        eog_ids=_eog_ids(vocab, (eos_id,)),
        add_bos=True,  # llama.cpp's WPM tokenizer adds both whatever the add_*_token flags say
        add_eos=True,
        chat_template=_chat_template(metadata, source),
    )


def _from_phantom_space(token: str, token_type: int) -> str:
    """A token of the GGUF vocabulary in BERT's spelling: convert_hf_to_gguf.py's BertModel.set_vocab writes
    "x" as "▁x" and "##x" as "x", and keeps control tokens (older converters: any "[X]") as they are."""
    if token_type in (TOKEN_CONTROL, TOKEN_UNKNOWN):
        return token
    if token.startswith(SPM_SPACE) and len(token) > 1:
        return token[1:]
    if token.startswith("[") and token.endswith("]"):
        return token
    return "##" + token


def _bert_special(metadata: dict[str, Any], key: str, default: int, what: str, n: int, source: str) -> int:
    """The id of a special token the WordPiece tokenizer cannot do without."""
    v = metadata.get(key)
    if v is None:
        if default >= n:
            raise ModelFileError(
                f"{source}: no {key} for the {what} token, and llama.cpp's default id {default} is not in the"
                f" {n}-token vocabulary"
            )
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < n:
        raise ModelFileError(f"{source}: {key} = {v!r:.80} is not a token id (the vocabulary has {n} tokens)")
    return int(v)


def _bool(metadata: dict[str, Any], key: str, default: bool, source: str) -> bool:
    value = metadata.get(key, default)
    if not isinstance(value, bool):
        raise ModelFileError(f"{source}: {key} = {value!r:.80} is not a bool")
    return value


def _add_special_tokens(hf: HFTokenizer, tokens: list[str], types: list[int], vocab: dict[str, int], source: str) -> None:
    """Control and unknown tokens are special (parse_special decides); user-defined are always matched."""
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


def _piece_bytes(tokens: list[str], types: list[int], byte_level: bool) -> list[bytes]:
    """The bytes of every token, as llama.cpp's token_to_piece gives them."""
    piece_bytes: list[bytes] = []
    for i, t in enumerate(tokens):
        ty = types[i]
        if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED):
            piece_bytes.append(t.encode("utf-8"))
        elif ty == TOKEN_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            piece_bytes.append(bytes([int(t[3:5], 16)]))
        elif ty == TOKEN_UNUSED or ty not in (TOKEN_NORMAL, TOKEN_BYTE):
            piece_bytes.append(b"")  # llama.cpp's token_to_piece prints nothing for these
        elif byte_level:
            piece_bytes.append(byte_level_to_bytes(t))
        else:
            piece_bytes.append(t.replace(SPM_SPACE, " ").encode("utf-8"))
    return piece_bytes


def _eog_ids(vocab: dict[str, int], named_ids: tuple[int | None, ...]) -> frozenset[int]:
    """End-of-generation ids: the tokens llama.cpp stops on by their text, and the EOS / EOT / EOM ids the
    metadata names (named_ids)."""
    eog = {vocab[t] for t in (EOG_TOKEN_TEXTS | _FIM_EOG_TOKEN_TEXTS) if t in vocab}
    eog.difference_update(vocab[t] for t in not_ending_generation(vocab))
    eog.update(i for i in named_ids if i is not None)
    return frozenset(eog)


def not_ending_generation(vocab) -> set[str]:
    """The EOG_TOKEN_TEXTS of vocab (a container of token texts) that do not end a generation in its family, as
    llama.cpp excepts them: gpt-oss / solar-open continue after <|end|> (harmony's end of a message: the analysis
    channel's, before the final one), gemma4 after </s>."""
    out = set()
    if "<|end|>" in vocab and (
        ("<|return|>" in vocab and "<|call|>" in vocab) or ("<|calls|>" in vocab and "<|flush|>" in vocab)
    ):
        out.add("<|end|>")
    if "</s>" in vocab and "<|tool_response>" in vocab:
        out.add("</s>")
    return out


def _add_special(metadata: dict[str, Any], which: str, default: bool, token_id: int | None, source: str) -> bool:
    """Whether encoding puts a BOS first / an EOS last (which: "bos" / "eos"): tokenizer.ggml.add_bos_token /
    add_eos_token, else llama.cpp's default for the model."""
    key = f"tokenizer.ggml.add_{which}_token"
    add = metadata.get(key, default)
    if not isinstance(add, bool):
        raise ModelFileError(f"{source}: {key} = {add!r} is not a bool")
    if add and token_id is None:
        raise ModelFileError(f"{source}: {key} is true but tokenizer.ggml.{which}_token_id is not set")
    return add


def _spm_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SPM tokenizer (and sentencepiece's BPE).

    llama.cpp merges any two neighbouring pieces whose concatenation is a token, best score
    first (leftmost on a tie). As BPE merges: every split (left, right) of a token into two
    tokens, ranked by the score of the whole token. Only splits into lengths that some token has
    are tried: a token costs the number of distinct token lengths, not one slice per character
    (a 400,000-character token would take seconds).
    """
    length_set = {len(t) for t in tokens}
    lengths = sorted(length_set)
    ranked = []
    for tid, text in enumerate(tokens):
        n = len(text)
        for k in lengths:
            if k >= n:
                break
            if n - k not in length_set:
                continue
            left, right = text[:k], text[k:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[tid]), tid, k, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]
