"""BERT's WordPiece tokenizer, from a Hugging Face directory (tokenizer.json) and from a GGUF file as
llama.cpp's convert_hf_to_gguf.py writes it ("phantom space" vocabulary), against transformers' own
tokenizer of the same directory: ids, special tokens and decoded text.

A tiny BERT vocabulary built here (uncased and cased) keeps the suite self-contained; the real
all-MiniLM-L6-v2 directory is used when it is there.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers  # a test dependency: a missing install must fail, not skip
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from churon.errors import ModelFileError
from churon.formats.gguf import GGUFFile
from churon.tokenizer import Tokenizer, from_gguf, from_hf_dir


STRINGS = [
    "Hello, world! This is a test.",
    "Café naïve résumé",
    "Ångström",
    "cafe\u0301 (a decomposed accent)",
    "ÀÉÎÕÜ ß İstanbul ǅ ﬁ",
    "東京は日本の首都です",
    "Tokyo 東京 is the capital of 日本, ok?",
    "中文and English混合",
    "hello...world!!!",
    "U.S.A.",
    "e-mail@x.com",
    "$100 + 5% = ^_^ ~`|",
    "don't can't it's",
    "emoji 😀 here 🎉🎉",
    "nul\u0000byte",
    "bell\x07 and \x1b escape \x7f del",
    "private \ue000 use \U000f0000",
    "zero\u200bwidth\ufeffbom \ufffd",
    "a" * 100,
    "a" * 101,
    "x" * 150 + " after",
    "3.14159 1,000,000 42nd 2024-01-01",
    "Ⅻ ½ ²",
    "multiple     spaces   here",
    "tab\there\nnew\r\nline\u00a0nbsp\u3000ideographic",
    "",
    " ",
    "\n\t ",
    "[SEP] inside [MASK] text",
    "Привет мир Σίσυφος مرحبا नमस्ते 한국어",
    "\u2581phantom",
    "word " * 60,
]


# --- a tiny BERT vocabulary ---------------------------------------------------------------


def _tiny_vocab() -> list[str]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]"]
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    chars += list("0123456789éåïüσπд") + list("はのでてすか東京日本首都中文混合")
    punct = list(".,!?;:'\"()[]{}-_@#$%&*+=/\\<>^`|~")
    words = ["hello", "Hello", "world", "this", "is", "test", "the", "cafe", "Café", "naive", "resume",
             "ang", "mail", "com", "tok", "capital", "##ing", "##fe", "##strom", "##yo", "##s", "##ed", "##ll"]
    vocab = specials + punct + words
    for c in dict.fromkeys(chars):
        vocab += [c, "##" + c]
    return list(dict.fromkeys(vocab))


def _make_bert_dir(path: Path, lowercase: bool) -> Path:
    vocab = {t: i for i, t in enumerate(_tiny_vocab())}
    tok = HFTokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    # as sentence-transformers saves it: padded and truncated to 128 tokens, which encoding must not apply
    tok.enable_padding(length=128, pad_id=vocab["[PAD]"], pad_token="[PAD]")
    tok.enable_truncation(128)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": lowercase, "strip_accents": None,
        "tokenize_chinese_chars": True, "model_max_length": 512, "unk_token": "[UNK]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]",
    }))
    return path


# --- a GGUF as convert_hf_to_gguf.py writes one -------------------------------------------


def _phantom(token: str, token_type: int, older: bool) -> str:
    """convert_hf_to_gguf.py's BertModel.set_vocab spelling (older converters kept every "[X]")."""
    if (older and token.startswith("[") and token.endswith("]")) or token_type == gguf.TokenType.CONTROL:
        return token
    if token.startswith("##"):
        return token[2:]
    return "\u2581" + token


def bert_gguf_metadata(model_dir: Path, path: Path, *, older: bool = False, lowercase: bool | None = None) -> dict:
    """Write model_dir's tokenizer into a GGUF file the way llama.cpp's converter does (vocabulary, token
    types, gguf's SpecialVocab ids and flags) with one dummy tensor, and read its metadata back."""
    tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a for a in tj["added_tokens"]}
    tokens, types = [], []
    for i in range(max(by_id) + 1):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if i in added:
            ttype = gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED
        else:
            ttype = gguf.TokenType.NORMAL
        tokens.append(_phantom(by_id[i], ttype, older))
        types.append(ttype)
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=len(tokens))
    if older:  # before gguf named [CLS] as BOS, it was tokenizer.ggml.cls_token_id
        cls_id = special.special_token_ids.pop("bos")
        w.add_uint32("tokenizer.ggml.cls_token_id", cls_id)
    special.add_to_gguf(w, quiet=True)
    if lowercase is not None:
        w.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile.open(path).metadata


# --- the three tokenizers of one directory ---------------------------------------------------


class Case:
    def __init__(self, model_dir: Path, gguf_path: Path, lowercase: bool | None = None):
        self.dir = model_dir
        self.ref = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        self.hf: Tokenizer = from_hf_dir(model_dir)
        self.metadata = bert_gguf_metadata(model_dir, gguf_path, lowercase=lowercase)
        self.gguf: Tokenizer = from_gguf(self.metadata, source=str(gguf_path))


@pytest.fixture(scope="module", params=["tiny", "tiny-cased", pytest.param("minilm", marks=pytest.mark.slow)])
def case(request, tmp_path_factory) -> Case:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "minilm":  # the registry's all-MiniLM-L6-v2
        return Case(request.getfixturevalue("minilm_dir"), tmp / "minilm.gguf")
    cased = request.param == "tiny-cased"
    # a cased model's GGUF has to say so: llama.cpp lower-cases unless tokenizer.ggml.normalizer.lowercase is false
    return Case(_make_bert_dir(tmp / "dir", lowercase=not cased), tmp / "tiny.gguf", lowercase=False if cased else None)


@pytest.mark.parametrize("text", STRINGS, ids=[repr(s)[:30] for s in STRINGS])
def test_ids_equal_transformers(case, text):
    expected = case.ref(text)["input_ids"]
    assert len(expected) < 512  # no truncation anywhere
    assert case.hf.encode(text) == expected
    assert case.gguf.encode(text) == expected
    plain = case.ref(text, add_special_tokens=False)["input_ids"]
    assert case.hf.encode(text, add_bos=False, add_eos=False) == plain
    assert case.gguf.encode(text, False, False) == plain


@pytest.mark.parametrize("text", STRINGS, ids=[repr(s)[:30] for s in STRINGS])
def test_decode_equals_transformers(case, text):
    ids = case.ref(text)["input_ids"]
    expected = case.ref.decode(ids, skip_special_tokens=True)
    assert case.hf.decode(ids) == expected
    assert case.gguf.decode(ids) == expected
    assert case.gguf.decode(ids, skip_special_tokens=False) == case.ref.decode(ids, skip_special_tokens=False)


def test_special_tokens(case):
    for tok in (case.hf, case.gguf):
        assert (tok.bos_id, tok.eos_id) == (case.ref.cls_token_id, case.ref.sep_token_id)
        assert (tok.bos_token, tok.eos_token) == ("[CLS]", "[SEP]")
        assert tok.add_bos and tok.add_eos
        assert tok.vocab_size == len(case.ref)
        assert tok.encode("") == [tok.bos_id, tok.eos_id]
        assert tok.token_to_id("[MASK]") == case.ref.mask_token_id
    assert case.hf.eog_ids == frozenset()  # the config names no EOS: nothing stops generation (none happens)


def test_readable_decode_and_long_words(case):
    for tok in (case.hf, case.gguf):
        assert tok.decode(tok.encode("Hello, world! This is a test.")).lower() == "hello, world! this is a test."
        unk = case.ref.unk_token_id
        assert tok.encode("a" * 101) == [tok.bos_id, unk, tok.eos_id]  # Hugging Face's 100-character limit
        assert unk not in tok.encode("a" * 100)
        assert tok.encode("emoji 😀")[-2] == unk


@pytest.mark.slow
def test_minilm_values(minilm_dir):
    """Known ids of the real model (bert-base-uncased's vocabulary)."""
    tok = from_hf_dir(minilm_dir)
    assert (tok.bos_id, tok.eos_id) == (101, 102)
    assert tok.encode("hello...world!!!") == [101, 7592, 1012, 1012, 1012, 2088, 999, 999, 999, 102]
    assert tok.decode(tok.encode("Café naïve résumé")) == "cafe naive resume"


def test_older_converter_file(tmp_path):
    """Files from older converters: every "[X]" kept as it is, [CLS] as tokenizer.ggml.cls_token_id."""
    model_dir = _make_bert_dir(tmp_path / "dir", lowercase=True)
    meta = bert_gguf_metadata(model_dir, tmp_path / "old.gguf", older=True)
    assert "tokenizer.ggml.bos_token_id" not in meta and "[unused0]" in meta["tokenizer.ggml.tokens"]
    old = from_gguf(meta)
    new = from_gguf(bert_gguf_metadata(model_dir, tmp_path / "new.gguf"))
    for text in STRINGS:
        assert old.encode(text) == new.encode(text)
    assert old.bos_id == new.bos_id == _tiny_vocab().index("[CLS]")
    unused = _tiny_vocab().index("[unused0]")
    assert old.decode([unused, unused]) == new.decode([unused, unused]) == "[unused0] [unused0]"


def test_llama_cpp_defaults(tmp_path):
    """Without the special-token keys, llama.cpp's ids for BERT: [UNK] 100, [CLS] 101, [SEP] 102."""
    vocab = ["[PAD]"] + [f"\u2581w{i}" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]
    types = [3] + [1] * 99 + [3, 3, 3, 3, 1]
    tok = from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": vocab,
                     "tokenizer.ggml.token_type": types})
    assert tok.encode("w5 w5a zzz") == [101, 5, 5, 104, 100, 102]
    assert tok.decode(tok.encode("w5 w5a zzz")) == "w5 w5a"


def _small_bert_metadata(**extra) -> dict:
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "\u2581hello", "lo", "\u2581world"]
    meta = {
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 3, 1, 1, 1],
        "tokenizer.ggml.unknown_token_id": 1,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.seperator_token_id": 3,
    }
    meta.update(extra)
    return {k: v for k, v in meta.items() if v is not None}


def test_bad_bert_metadata():
    tok = from_gguf(_small_bert_metadata())
    assert tok.encode("Hello HELLO world x") == [2, 4, 4, 6, 1, 3]
    for key in ("unknown_token_id", "bos_token_id", "seperator_token_id"):
        with pytest.raises(ModelFileError, match=f"tokenizer.ggml.{key}.*default id 10"):
            from_gguf(_small_bert_metadata(**{f"tokenizer.ggml.{key}": None}))
        with pytest.raises(ModelFileError, match=f"tokenizer.ggml.{key} = 7 is not a token id"):
            from_gguf(_small_bert_metadata(**{f"tokenizer.ggml.{key}": 7}))
    with pytest.raises(ModelFileError, match="tokenizer.ggml.unknown_token_id = 'x' is not a token id"):
        from_gguf(_small_bert_metadata(**{"tokenizer.ggml.unknown_token_id": "x"}))
    with pytest.raises(ModelFileError, match="normalizer.lowercase = 1 is not a bool"):
        from_gguf(_small_bert_metadata(**{"tokenizer.ggml.normalizer.lowercase": 1}))
    with pytest.raises(ModelFileError, match="same WordPiece token '\\[CLS\\]'"):
        from_gguf(_small_bert_metadata(**{"tokenizer.ggml.tokens": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "\u2581[CLS]"],
                                          "tokenizer.ggml.token_type": [3, 3, 3, 3, 1]}))


# --- what the post-processor puts around a text, in general -----------------------------------


def _wordlevel_dir(path: Path, template: str | None, config: dict) -> Path:
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "a": 3, "b": 4}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 0), ("</s>", 1)])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_post_processor_wrapping(tmp_path):
    t = from_hf_dir(_wordlevel_dir(tmp_path / "eos", "$A </s>", {}))  # T5-like: EOS after, found from the template
    assert (t.bos_id, t.eos_id, t.add_bos, t.add_eos) == (None, 1, False, True)
    assert t.encode("a b") == [3, 4, 1] and t.encode("a", add_eos=False) == [3]
    t = from_hf_dir(_wordlevel_dir(tmp_path / "both", "<s> $A </s>", {"eos_token": "</s>", "add_eos_token": False}))
    assert (t.bos_id, t.add_bos, t.add_eos) == (0, True, False)  # the config's flag wins
    assert t.encode("a b") == [0, 3, 4] and t.encode("a b", add_eos=True) == [0, 3, 4, 1]
    t = from_hf_dir(_wordlevel_dir(tmp_path / "none", None, {"bos_token": "<s>", "eos_token": "</s>"}))
    assert (t.bos_id, t.eos_id, t.add_bos, t.add_eos) == (0, 1, False, False)
    assert t.encode("a b") == [3, 4]
    with pytest.raises(ModelFileError, match="add_eos_token is true but no eos_token"):
        from_hf_dir(_wordlevel_dir(tmp_path / "bad", None, {"add_eos_token": True}))
