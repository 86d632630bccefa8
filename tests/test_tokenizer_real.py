"""The tokenizer of the real SmolLM2-135M-Instruct GGUF against llama.cpp's token ids.

The expected ids were recorded once with llama-cpp-python by
benchmarks/record_llamacpp_token_ids.py into tests/data/smollm2_llamacpp_token_ids.json.
The model comes from the `smollm2_gguf` fixture (tests/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from churon.formats.gguf import GGUFFile
from churon.tokenizer import Detokenizer, Tokenizer, from_gguf

pytestmark = pytest.mark.slow

RECORD = json.loads((Path(__file__).parent / "data" / "smollm2_llamacpp_token_ids.json").read_text(encoding="utf-8"))
CASES = RECORD["cases"]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf) -> Tokenizer:
    return from_gguf(GGUFFile.open(smollm2_gguf).metadata, source=str(smollm2_gguf))


def test_record_is_for_this_model(smollm2_gguf):
    assert RECORD["model"] == Path(smollm2_gguf).name
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"])[:40] for c in CASES])
def test_ids_match_llama_cpp(smollm2_tokenizer, case):
    tok = smollm2_tokenizer
    assert tok.encode(case["text"], add_bos=False) == case["ids"]
    assert tok.encode(case["text"], add_bos=False, parse_special=False) == case["ids_no_special"]
    assert tok.encode(case["text"]) == case["ids"]  # SmolLM2 asks for no BOS


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"])[:40] for c in CASES])
def test_decode_roundtrip(smollm2_tokenizer, case):
    tok = smollm2_tokenizer
    text = case["text"]
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    assert tok.id_to_piece(2) == "<|im_end|>"
    # <|im_end|> (eos) and <|endoftext|>, as llama.cpp's end-of-generation list
    assert {0, 2} <= tok.eog_ids
    assert 1 not in tok.eog_ids


def test_chat_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    ids = tok.encode(tok.apply_chat_template(messages))
    assert ids[0] == 1 and ids.count(2) == 3 and ids[-4:] == [1] + tok.encode("assistant\n")


def test_incremental_detokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    text = "Sure! 😀👍🏽 안녕하세요, 你好. 👨\u200d👩\u200d👧\u200d👦 done."
    detok = Detokenizer(tok, prompt)
    parts = [detok.update(i) for i in tok.encode(text) + [2]]
    parts.append(detok.finish())
    assert "".join(parts) == text
    assert not any("\ufffd" in p for p in parts)
