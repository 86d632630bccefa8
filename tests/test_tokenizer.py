"""Tokenizer tests on tiny tokenizers built here: byte-level BPE trained with `tokenizers`,
SentencePiece BPE trained with `sentencepiece`, both turned into GGUF-style metadata."""

from __future__ import annotations

import io
import json
import random

import pytest
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from churon.errors import ChuronError, ModelFileError, UnsupportedModelError
from churon.tokenizer import ChatTemplateError, Detokenizer, Tokenizer, from_gguf, from_hf_dir

CORPUS = """\
The quick brown fox jumps over the lazy dog. A tokenizer turns text into token ids, and a
detokenizer turns them back. Byte pair encoding merges the most frequent pairs, again and again.
In 2024 there were 365 days; in 2023 there were 365 too. Call 555-1234 or 555-9876 today!
def main(argv):
    for i in range(10):
        print(i, argv[i])
    return 0
Don't panic. It's fine. We'll see, they're here, I've got it, you'd know, I'm sure.
Emoji are fun: 😀 😃 👍 and Korean 안녕하세요 and Chinese 你好世界 appear once or twice.
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

STRINGS = [
    "Hello world",
    " leading space",
    "  two spaces",
    "a  12 and   345",
    "The year 2024 had 365 days.",
    "line one\nline two\n\n\tindented\r\n",
    "def f(x):\n    return x + 1\n",
    "don't we'll it's THEY'RE",
    "emoji 😀👍🏽 and 👨\u200d👩\u200d👧",
    "안녕하세요 세계, 你好",
    "trailing   ",
    "",
    " ",
    "\n\n",
    "1234567890123",
    "mixed<|im_start|>user\nhi<|im_end|>done",
]


# --- builders ---------------------------------------------------------------------------


def train_byte_level_bpe(pre_tokenizer=None, vocab_size=400) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 5, trainer=trainer)
    return tok


def gguf_metadata_from_hf(tok: HFTokenizer, pre: str = "gpt-2", **extra) -> dict:
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }
    meta.update(extra)
    return meta


@pytest.fixture(scope="module")
def trained_bpe() -> HFTokenizer:
    return train_byte_level_bpe()


@pytest.fixture(scope="module")
def bpe(trained_bpe) -> Tokenizer:
    return from_gguf(gguf_metadata_from_hf(trained_bpe), source="tiny-bpe")


SPM_TEXT = """The quick brown fox jumps over the lazy dog. A tokenizer turns text into token ids.
Byte pair encoding merges the most frequent pairs of symbols, one after another.
SentencePiece treats the input as a raw stream and escapes spaces with a special character.
Numbers like 12345 and 2024 appear too, as do words such as don't, we'll and it's.
Hello world! Hello there, general Kenobi. The model reads, the model writes.
"""


@pytest.fixture(scope="module")
def spm_model():
    import sentencepiece as spm  # a test dependency: a missing install must fail, not skip
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_TEXT.splitlines() * 20),
        model_writer=buf,
        vocab_size=500,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",  # llama.cpp does not normalize
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["<tool>"],
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]

    def token_type(i):  # sentencepiece's piece types use GGUF's numbering
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if tokens[i] == "<tool>" else 1

    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return sp, meta


@pytest.fixture(scope="module")
def spm(spm_model) -> Tokenizer:
    return from_gguf(spm_model[1], source="tiny-spm")


# --- byte-level BPE -------------------------------------------------------------------


@pytest.mark.parametrize("text", STRINGS)
def test_bpe_matches_trained_tokenizer(trained_bpe, bpe, text):
    assert bpe.encode(text, add_bos=False) == trained_bpe.encode(text, add_special_tokens=False).ids


def test_bpe_matches_trained_tokenizer_on_random_text(trained_bpe, bpe):
    rng = random.Random(0)
    alphabet = list("abcdefXYZ0123456789 '\n\t.,;:!?()")
    alphabet += ["  ", "'s", "😀", "한", "中", "é", "\u00a0", "<|im_end|>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert bpe.encode(text, add_bos=False) == trained_bpe.encode(text, add_special_tokens=False).ids, repr(text)


@pytest.mark.parametrize("text", STRINGS)
def test_bpe_decode_roundtrip(bpe, text):
    assert bpe.decode(bpe.encode(text, add_bos=False), skip_special_tokens=False) == text


def test_bpe_properties(trained_bpe, bpe):
    vocab = trained_bpe.get_vocab()
    assert bpe.vocab_size == trained_bpe.get_vocab_size()
    assert bpe.bos_id == vocab["<|im_start|>"]
    assert bpe.eos_id == vocab["<|im_end|>"]
    assert bpe.add_bos is False  # gpt2 models default to no BOS
    # eos, and <|endoftext|> / <|im_end|> recognised by their text as llama.cpp does
    assert bpe.eog_ids == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
    assert bpe.id_to_piece(vocab["<|im_end|>"]) == "<|im_end|>"
    assert bpe.id_to_piece(bpe.encode(" fox", add_bos=False)[0]).startswith(" ")
    assert bpe.token_to_id("<|im_end|>") == vocab["<|im_end|>"]


def test_special_tokens_parsed_or_not(trained_bpe, bpe):
    vocab = trained_bpe.get_vocab()
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = bpe.encode(text, add_bos=False)
    assert ids[0] == vocab["<|im_start|>"] and ids[-1] == vocab["<|im_end|>"]
    assert bpe.decode(ids) == "user\nhi"  # special tokens skipped
    assert bpe.decode(ids, skip_special_tokens=False) == text
    plain = bpe.encode(text, add_bos=False, parse_special=False)
    assert not set(plain) & {vocab[s] for s in SPECIALS}
    reference = HFTokenizer.from_str(trained_bpe.to_str())
    reference.encode_special_tokens = True
    assert plain == reference.encode(text, add_special_tokens=False).ids
    assert bpe.decode(plain) == text
    # the parse_special=True path is unaffected by an earlier parse_special=False call
    assert bpe.encode(text, add_bos=False) == ids


def test_user_defined_tokens_always_parsed(trained_bpe):
    meta = gguf_metadata_from_hf(trained_bpe)
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["<tool_call>"]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [4]
    tok = from_gguf(meta)
    tool = len(meta["tokenizer.ggml.tokens"]) - 1
    for parse_special in (True, False):
        assert tool in tok.encode("call <tool_call> now", add_bos=False, parse_special=parse_special)
    assert tok.decode([tool]) == "<tool_call>"  # user-defined tokens are text, never skipped


def test_encode_batch_is_encode_of_each_text(bpe, spm):
    texts = ["", "hi", "<|im_start|>user\nhi<|im_end|>", "  spaces  and\ttabs ", "unicode: naïve café 😀", "hi"]
    for tok in (bpe, spm):
        for kwargs in ({}, {"add_bos": True}, {"add_bos": False, "add_eos": True}, {"parse_special": False}):
            assert tok.encode_batch(texts, **kwargs) == [tok.encode(t, **kwargs) for t in texts], kwargs
    assert bpe.encode_batch([]) == []


def test_bos_rules(trained_bpe, bpe):
    bos = bpe.bos_id
    assert bpe.encode("hi") == bpe.encode("hi", add_bos=False)
    assert bpe.encode("hi", add_bos=True) == [bos] + bpe.encode("hi", add_bos=False)
    assert bpe.encode("", add_bos=True) == [bos]
    assert bpe.encode("") == []
    # never twice: text that starts with the BOS token keeps only that one
    assert bpe.encode("<|im_start|>hi", add_bos=True) == [bos] + bpe.encode("hi", add_bos=False)
    # metadata decides the default
    tok = from_gguf(gguf_metadata_from_hf(trained_bpe, **{"tokenizer.ggml.add_bos_token": True}))
    assert tok.add_bos is True
    assert tok.encode("hi")[0] == bos
    assert tok.encode("hi", add_bos=False) == bpe.encode("hi", add_bos=False)
    # llama3 pre-tokenizer: llama.cpp adds BOS unless the metadata says otherwise
    assert from_gguf(gguf_metadata_from_hf(trained_bpe, pre="llama-bpe")).add_bos is True
    meta = gguf_metadata_from_hf(trained_bpe, **{"tokenizer.ggml.add_bos_token": True})
    del meta["tokenizer.ggml.bos_token_id"]
    with pytest.raises(ModelFileError, match="bos_token_id"):
        from_gguf(meta)


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    """The pre-tokenizer's split, as text (private access: the split is what is being checked)."""
    byte_level = decoders.ByteLevel()
    return [byte_level.decode([piece]) for piece, _ in tok._hf.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    "pre, text, expected",
    [
        # GPT-2: digits stay together, the last space of a run joins the next word
        ("gpt-2", "a  12", ["a", " ", " 12"]),
        ("gpt-2", "x 1234567", ["x", " 1234567"]),
        # smollm: every digit alone first (llama.cpp's \p{N} split), then GPT-2
        ("smollm", "a  12", ["a", "  ", "1", "2"]),
        ("smollm", "x   345", ["x", "   ", "3", "4", "5"]),
        ("smollm", "v2.0 is 10x", ["v", "2", ".", "0", " is", " ", "1", "0", "x"]),
        ("smollm", "don't  stop", ["don", "'t", " ", " stop"]),
        ("smollm", "line\n\n  x", ["line", "\n\n ", " x"]),
        # llama3: up to three digits, contractions in any case, newlines kept together
        ("llama-bpe", "1234567", ["123", "456", "7"]),
        ("llama-bpe", "DON'T stop", ["DON", "'T", " stop"]),
        ("llama-bpe", "a\n\n  b", ["a", "\n\n", " ", " b"]),
        ("llama-bpe", "  hello", [" ", " hello"]),
        # qwen2: single digits
        ("qwen2", "x 1234", ["x", " ", "1", "2", "3", "4"]),
        ("qwen2", "it's", ["it", "'s"]),
    ],
)
def test_pre_tokenizer_splits(trained_bpe, pre, text, expected):
    tok = from_gguf(gguf_metadata_from_hf(trained_bpe, pre=pre))
    assert _pieces(tok, text) == expected


GPT4O_TEXTS = ["HelloWorld DON'T stop, it'S fine", "x 1234567 a/b//\n\n  c", "Ünïcode ÀBCdef 3.14\r\n\tok",
               "path/to/file.py: line  42", "  leading and trailing  ", "mixedCASEWords and 'quotes'"]


@pytest.mark.parametrize("text", GPT4O_TEXTS)
def test_gpt4o_pre_tokenizer_is_o200k_s_pattern(trained_bpe, text, monkeypatch):
    """tokenizer.ggml.pre "gpt-4o" (gpt-oss's GGUFs, Llama 4's) splits as tiktoken's o200k_base pattern does."""
    import regex
    from tiktoken_ext import openai_public

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: {})  # its pattern, not its ranks
    pattern = openai_public.o200k_base()["pat_str"]
    tok = from_gguf(gguf_metadata_from_hf(trained_bpe, pre="gpt-4o"))
    assert _pieces(tok, text) == regex.findall(pattern, text)


def test_smollm_digits_ids(trained_bpe):
    gpt2 = from_gguf(gguf_metadata_from_hf(trained_bpe, pre="gpt-2"))
    smollm = from_gguf(gguf_metadata_from_hf(trained_bpe, pre="smollm"))
    vocab = trained_bpe.get_vocab()
    digits = [vocab[d] for d in "2024"]
    assert smollm.encode("2024", add_bos=False) == digits
    assert len(gpt2.encode("2024", add_bos=False)) < 4  # merged: the corpus has 2024
    assert smollm.decode(smollm.encode("In 2024, 365 days", add_bos=False)) == "In 2024, 365 days"


def test_gguf_errors(trained_bpe):
    meta = gguf_metadata_from_hf(trained_bpe)
    with pytest.raises(UnsupportedModelError, match="'t5'.*known"):
        from_gguf({**meta, "tokenizer.ggml.model": "t5"})
    with pytest.raises(UnsupportedModelError, match="'no-such-pre'.*known:.*smollm"):
        from_gguf({**meta, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ModelFileError, match="tokenizer.ggml.tokens"):
        from_gguf({k: v for k, v in meta.items() if k != "tokenizer.ggml.tokens"})
    with pytest.raises(ModelFileError, match="tokenizer.ggml.model"):
        from_gguf({k: v for k, v in meta.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(ModelFileError, match="merges"):
        from_gguf({k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(ModelFileError, match="duplicate token"):
        from_gguf({**meta, "tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"][:-1] + ["a"]})
    with pytest.raises(ModelFileError, match="token_type"):
        from_gguf({**meta, "tokenizer.ggml.token_type": [1, 1]})
    assert issubclass(ChatTemplateError, ChuronError)


def test_from_real_gguf_file(trained_bpe, tmp_path):
    """Metadata as GGUFFile hands it over (numpy-free lists, ints, bools)."""
    import gguf
    import numpy as np

    from churon.formats.gguf import GGUFFile

    meta = gguf_metadata_from_hf(trained_bpe, pre="smollm")
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile.open(path)
    tok = from_gguf(f.metadata, source=str(path))
    ref = from_gguf(meta)
    for text in STRINGS:
        assert tok.encode(text) == ref.encode(text)
    assert tok.chat_template == CHATML_TEMPLATE


# --- SentencePiece --------------------------------------------------------------------

SPM_STRINGS = [
    "Hello world",
    " Hello",
    "  two spaces",
    "The quick brown fox",
    "new\nline",
    "tabs\tand\r\n",
    "émoji 😀 한국",  # not in the training text: byte fallback
    "12345 67",
    "",
    " ",
    "don't we'll",
    "zzz qqq xyz",
    "trailing  ",
]


@pytest.mark.parametrize("text", SPM_STRINGS)
def test_spm_matches_sentencepiece(spm_model, spm, text):
    sp, _ = spm_model
    assert spm.encode(text, add_bos=False) == sp.encode(text)
    assert spm.decode(spm.encode(text)) == text


def test_spm_random_text(spm_model, spm):
    sp, _ = spm_model
    rng = random.Random(1)
    alphabet = list("The quick brown fox Hello world 0123 \n\t.,'") + ["  ", "😀", "한", "é", "zz"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert spm.encode(text, add_bos=False) == sp.encode(text), repr(text)
        assert spm.decode(spm.encode(text)) == text


def test_spm_specials_and_bos(spm_model, spm):
    sp, _ = spm_model
    assert spm.add_bos is True  # llama.cpp's default for SPM
    assert spm.bos_id == 1 and spm.eos_id == 2 and 2 in spm.eog_ids
    assert spm.encode("Hello") == [1] + sp.encode("Hello")
    assert spm.encode("<s>Hello") == [1] + sp.encode("Hello")  # BOS not added twice
    # llama.cpp puts the space prefix in front of text that follows a special token too
    assert spm.encode("Hello</s>world", add_bos=False) == sp.encode("Hello") + [2] + sp.encode("world")
    assert 2 not in spm.encode("Hello</s>world", add_bos=False, parse_special=False)
    # user-defined tokens are matched even without parse_special (llama.cpp checked by hand)
    tool = sp.piece_to_id("<tool>")
    for parse_special in (True, False):
        ids = spm.encode("Hello<tool>world", add_bos=False, parse_special=parse_special)
        assert ids == sp.encode("Hello") + [tool] + sp.encode("world")
    assert spm.decode([1] + sp.encode("Hello world") + [2]) == "Hello world"
    assert spm.decode([1] + sp.encode("Hello") + [2], skip_special_tokens=False) == "<s> Hello</s>"  # as llama.cpp
    # without add_space_prefix no "▁" is put in front
    _, meta = spm_model
    tok = from_gguf({**meta, "tokenizer.ggml.add_space_prefix": False})
    ids = tok.encode("Hello world", add_bos=False)
    assert not tok.id_to_piece(ids[0]).startswith(" ")
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(tok.encode(" Hello")) == " Hello"


def test_spm_merges_by_score():
    """Hand-built vocabulary: the merge whose result scores best wins, whatever its position."""
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "ab", "bc", "\u2581a", "abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -10.0, -5.0, -20.0, -6.0]
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1]
    tok = from_gguf({
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
    })
    # "▁abc": bc (-5) beats ab (-10) and ▁a (-20); then a+bc = abc (-6); then ▁+abc is no token
    assert tok.encode("abc", add_bos=False) == [3, 10]
    # "▁ab": ab (-10) beats ▁a (-20)
    assert tok.encode("ab", add_bos=False) == [3, 7]
    # unknown characters without byte tokens become <unk>
    assert tok.encode("x", add_bos=False)[1:] == [0]


# --- Hugging Face directory -----------------------------------------------------------


def test_from_hf_dir(trained_bpe, tmp_path):
    tok = HFTokenizer.from_str(trained_bpe.to_str())
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|endoftext|>", "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": CHATML_TEMPLATE,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id("<|im_end|>"), 7]}))
    t = from_hf_dir(tmp_path)
    assert t.bos_id == bos
    assert t.eos_id == tok.token_to_id("<|im_end|>")
    assert t.eog_ids == {tok.token_to_id("<|im_end|>"), 7, bos}  # <|endoftext|> is an EOG text
    assert t.add_bos is True  # found from the post-processor
    assert t.encode("Hello") == [bos] + trained_bpe.encode("Hello").ids
    assert t.encode("<|endoftext|>Hello") == [bos] + trained_bpe.encode("Hello").ids  # not twice
    assert t.encode("Hello", add_bos=False) == trained_bpe.encode("Hello").ids
    assert t.decode(t.encode("Hello world")) == "Hello world"
    assert t.vocab_size == trained_bpe.get_vocab_size()
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # add_bos_token in tokenizer_config wins
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    assert from_hf_dir(tmp_path).encode("Hello") == trained_bpe.encode("Hello").ids


def test_from_hf_dir_errors(tmp_path):
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        from_hf_dir(tmp_path)


# --- chat template --------------------------------------------------------------------


def test_chat_template_renders(bpe):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert bpe.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert bpe.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def _with_template(trained_bpe, template):
    return from_gguf(gguf_metadata_from_hf(trained_bpe, **{"tokenizer.chat_template": template}))


def test_chat_template_helpers(trained_bpe):
    tok = _with_template(
        trained_bpe, "{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ x | tojson }}"
    )
    assert tok.apply_chat_template([], x={"a": "<é>"}) == '<|im_start|>|<|im_end|>|4|{"a": "<é>"}'
    # trim_blocks / lstrip_blocks as in Hugging Face
    tok = _with_template(trained_bpe, "  {% for m in messages %}\n{{ m['content'] }}\n  {% endfor %}\n")
    assert tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"
    tok = _with_template(  # loop controls
        trained_bpe,
        "{% for m in messages %}{% if m['role'] == 'user' %}{% continue %}{% endif %}{{ m['content'] }}{% endfor %}",
    )
    assert tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]) == "b"


def test_chat_template_raise_exception(trained_bpe):
    tok = _with_template(trained_bpe, "{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_sandbox(trained_bpe):
    tok = _with_template(trained_bpe, "{{ ''.__class__ }}")
    assert "class" not in tok.apply_chat_template([])  # unsafe attribute: undefined, prints nothing
    tok = _with_template(trained_bpe, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="unsafe|SecurityError"):
        tok.apply_chat_template([])
    tok = _with_template(trained_bpe, "{% set xs = [] %}{{ xs.append(1) }}")  # immutable sandbox
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([])


def test_chat_template_syntax_error_and_missing(trained_bpe):
    tok = _with_template(trained_bpe, "{% for m in messages %}{{ m }")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template([])
    meta = gguf_metadata_from_hf(trained_bpe)
    del meta["tokenizer.chat_template"]
    tok = from_gguf(meta)
    assert tok.chat_template is None
    # ChatML fallback: the vocabulary has <|im_start|> and <|im_end|>
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_missing_without_chatml(spm):
    assert spm.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        spm.apply_chat_template([{"role": "user", "content": "hi"}])


# --- incremental detokenizer ----------------------------------------------------------


def _stream(tok, ids, prompt_ids=()):
    detok = Detokenizer(tok, prompt_ids)
    parts = [detok.update(i) for i in ids]
    parts.append(detok.finish())
    return parts


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_incremental_equals_full_decode_random(request, which):
    tok = request.getfixturevalue(which)
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 30))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids
        prompt = tok.encode("The quick brown fox said", add_bos=True)
        full = tok.decode(prompt + ids)
        head = tok.decode(prompt)
        assert full.startswith(head)
        assert "".join(_stream(tok, ids, prompt)) == full[len(head):], ids


@pytest.mark.parametrize("which", ["bpe", "spm"])
@pytest.mark.parametrize(
    "text", ["emoji 😀👍🏽 👨\u200d👩\u200d👧 ok", "한국어 텍스트 안녕하세요", "混合 text 中文 😃!"]
)
def test_incremental_never_emits_broken_characters(request, which, text):
    tok = request.getfixturevalue(which)
    ids = tok.encode(text, add_bos=False)
    parts = _stream(tok, ids)
    assert "".join(parts) == text
    assert not any("\ufffd" in p for p in parts)
    # the characters really were split over several tokens
    assert any(p == "" for p in parts[:-1])


def test_incremental_spm_leading_space(spm_model, spm):
    sp, _ = spm_model
    hello = sp.piece_to_id("\u2581Hello")
    assert hello != sp.unk_id()
    detok = Detokenizer(spm, spm.encode("Say"))
    assert detok.update(hello) == " Hello"
    assert detok.update(sp.piece_to_id("\u2581world")) == " world"
    # at the very start the space SentencePiece added is dropped, as decode() does
    detok = Detokenizer(spm)
    assert detok.update(hello) == "Hello"
    assert detok.update(hello) == " Hello"


def test_incremental_byte_fallback_then_flush(spm):
    ids = [spm.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    assert spm.encode("x😀", add_bos=False)[-4:] == ids
    detok = Detokenizer(spm, spm.encode("x"))
    assert [detok.update(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.finish() != ""  # an unfinished character comes out at the end
    detok = Detokenizer(spm, spm.encode("x"))
    assert "".join(detok.update(i) for i in ids) + detok.finish() == "😀"
