"""The Python API on a tiny model: generate, chat, stream, tokenizer, outputs."""

import pytest
import torch

from churon import LLM, SamplingParams
from churon.errors import ContextLengthError
from churon.engine.kv_cache import SequenceKVCache
from tiny_models import make_hf_model, write_gguf


@pytest.fixture(scope="module", params=["hf", "gguf"])
def llm(request, tmp_path_factory):
    hf = make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))
    path = hf if request.param == "hf" else write_gguf(hf, tmp_path_factory.mktemp("gguf") / "m.gguf", "Q8_0")
    return LLM(path, threads=1)


def greedy_reference(llm: LLM, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence each step: no KV cache involved."""
    tokens = list(prompt)
    for _ in range(n):
        logits = llm.model(torch.tensor(tokens), 0, SequenceKVCache.for_model(llm.model, len(tokens)))
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) :]


def test_generate_accepts_strings_and_token_id_lists(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text_prompt = "The quick brown fox"
    ids = llm.tokenizer.encode(text_prompt)
    outs = llm.generate([text_prompt, ids], params)
    assert len(outs) == 2
    assert outs[0].token_ids == outs[1].token_ids == greedy_reference(llm, ids, 6)
    assert outs[0].prompt_token_ids == ids
    assert outs[0].finish_reason == "length"
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)
    # a single string and a single id list are one prompt each
    assert llm.generate(text_prompt, params)[0].token_ids == outs[0].token_ids
    assert llm.generate(ids, params)[0].token_ids == outs[0].token_ids


def test_end_of_generation_token_finishes_with_stop(llm):
    eos = sorted(llm.tokenizer.eog_ids)[0]
    # make the end-of-generation token the certain choice after 3 tokens
    params = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 1000.0})
    out = llm.generate(["hello"], params)[0]
    assert out.finish_reason == "stop" and out.token_ids == [eos] and out.text == ""  # the stop token adds no text
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 1000.0}, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == [eos] * 5


def test_stop_token_ids(llm):
    free = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(free.token_ids[:first])  # the stop token is not part of the text


def test_stop_string_is_not_emitted_and_stream_agrees(llm):
    free = llm.generate(["The dog"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].text
    assert len(free) > 6
    stop = free[3:6]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    out = llm.generate(["The dog"], params)[0]
    assert out.finish_reason == "stop"
    assert out.text == free[: free.index(stop)]
    assert "".join(llm.stream("The dog", params)) == out.text


def test_stream_joins_to_generate_text(llm):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=25, ignore_eos=True)
    pieces = list(llm.stream("Once upon a time", params))
    assert len(pieces) > 1
    assert "".join(pieces) == llm.generate(["Once upon a time"], params)[0].text


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    ids = llm.chat_prompt_ids(messages)
    start = llm.tokenizer.token_to_id("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 3  # system (default), user, assistant
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.chat(messages, params).token_ids == llm.generate([ids], params)[0].token_ids


def test_chat_prompt_without_the_generation_prompt(llm):
    messages = [{"role": "user", "content": "hi"}]
    start = llm.tokenizer.token_to_id("<|im_start|>")
    ids = llm.chat_prompt_ids(messages, add_generation_prompt=False)
    assert ids.count(start) == 2  # system (default), user: no assistant turn opened
    with_turn = llm.chat_prompt_ids(messages)
    assert with_turn[: len(ids)] == ids and llm.tokenizer.decode(with_turn[len(ids):], skip_special_tokens=False) == "<|im_start|>assistant\n"


def test_max_model_len_and_check_prompt(llm):
    assert llm.max_model_len == llm.config.context_length
    capped = LLM(llm.source.path, threads=1, max_model_len=16)
    assert capped.max_model_len == 16
    assert capped.check_prompt(list(range(15))) is None
    with pytest.raises(ContextLengthError, match="the prompt has 16 tokens but the context window is 16 tokens"):
        capped.check_prompt(list(range(16)))
    with pytest.raises(ValueError, match="the prompt is empty"):
        capped.check_prompt([])
    vocab = llm.config.vocab_size
    with pytest.raises(ValueError, match=f"prompt token id {vocab} is outside the vocabulary"):
        capped.check_prompt([1, vocab])


def test_tokenizer_parses_special_tokens(llm):
    ids = llm.tokenizer.encode("<|im_start|>user")
    assert ids[0] == llm.tokenizer.token_to_id("<|im_start|>")
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user"


def test_invalid_threads():
    with pytest.raises(ValueError, match="threads"):
        LLM("unused", threads=0)


def test_fingerprint_names_what_decides_the_arithmetic(tiny_llama_q8):
    from churon import kernels

    if kernels.cpu is None:
        pytest.skip("the native kernels are not built")
    assert LLM(tiny_llama_q8, threads=1).fingerprint == f"native-{kernels.cpu.isa()} threads=1 kv=float32"
    assert LLM(tiny_llama_q8, threads=2, kv_dtype="float16").fingerprint.endswith("threads=2 kv=float16")
    assert LLM(tiny_llama_q8, kernels="reference", threads=1).fingerprint == "reference threads=1 kv=float32"
