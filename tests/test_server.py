"""`churon serve`: a real server process on a tiny random model, driven by the official openai client.

Every answer is checked against the engine run in this process (LLM on the same file): greedy
texts, seeded samples, logprobs recomputed from a full forward pass.
"""

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx2 as httpx
import jsonschema
import openai
import pytest
import torch

from churon import LLM, SamplingParams
from churon.engine.kv_cache import SequenceKVCache
from tiny_models import make_hf_model, write_gguf

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path, *flags: str):
    port = free_port()
    cmd = [sys.executable, "-m", "churon.cli", "serve", str(model_path), "--port", str(port), "--threads", "1",
           "--served-model-name", MODEL, "--log-level", "warning", *flags]
    # an empty model cache unless the test set one: the server serves what the test gives it, not what this
    # machine has pulled
    env = dict(os.environ)
    env.setdefault("CHURON_HOME", tempfile.mkdtemp(prefix="churon-home-"))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become ready")


@contextlib.asynccontextmanager
async def loaded_client(app):
    """An in-process client of app (its lifespan run, so the model loads), once /health says it is loaded."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            while (await http.get("/health")).status_code != 200:
                await asyncio.sleep(0.05)
            yield http


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    hf = make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / "m.gguf", "Q8_0")


@pytest.fixture(scope="module")
def server(gguf):
    proc, url = start_server(gguf)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def llm(gguf):
    """The same model in this process: the reference every answer is checked against."""
    return LLM(gguf, threads=1)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def greedy(llm, prompt_ids, n, **kw):
    return llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=n, **kw), use_tqdm=False)[0]


def full_logprobs(llm, ids):
    """log_softmax of the model's logits at every position, from one full forward pass (no KV cache)."""
    logits = llm.model(torch.tensor(ids), 0, SequenceKVCache.for_model(llm.model, len(ids)), all_logits=True)
    return torch.log_softmax(logits.float(), dim=-1)


def metrics(url) -> dict[str, float]:
    """/metrics parsed strictly: every line a comment or `name{labels} value`."""
    text = httpx.get(f"{url}/metrics").text
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})? (\S+)$')
    out = {}
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("# HELP ") or re.match(r"^# TYPE \S+ (counter|gauge|histogram|summary)$", line):
            continue
        m = sample.match(line)
        assert m, f"not Prometheus text: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(4))
    return out


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


# --- answers equal the engine's ------------------------------------------------------------


def test_chat_completion_is_the_engines_greedy_answer(client, llm):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    ids = llm.chat_prompt_ids(MESSAGES)
    ref = greedy(llm, ids, 8)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    # content as a list of text parts is the same conversation
    parts = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}, MESSAGES[1]]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=8)
    assert r2.choices[0].message.content == ref.text


def test_completions_take_strings_token_ids_and_batches(client, llm):
    ids = llm.tokenizer.encode("The quick brown fox")
    ref = greedy(llm, ids, 6, ignore_eos=True)
    for prompt in ("The quick brown fox", ids):
        r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 6)
    other = llm.tokenizer.encode("jumps over")
    r = client.completions.create(model=MODEL, prompt=[ids, other], temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [ref.text, greedy(llm, other, 6, ignore_eos=True).text]
    assert r.usage.prompt_tokens == len(ids) + len(other)
    r2 = client.completions.create(model=MODEL, prompt=["The quick brown fox", "jumps over"], temperature=0, max_tokens=6,
                                   extra_body={"ignore_eos": True})
    assert [c.text for c in r2.choices] == [c.text for c in r.choices]


def test_streaming_chat_equals_the_whole_answer(client, llm):
    ids = llm.chat_prompt_ids(MESSAGES)
    ref = greedy(llm, ids, 10, ignore_eos=True)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == len(ids)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, llm):
    """vLLM's stream_options.continuous_usage_stats, GuideLLM's default: each chunk's usage counts its choice's tokens."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    ids = llm.chat_prompt_ids(MESSAGES)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, stream=True,
                                                 logprobs=True, stream_options=options, extra_body={"ignore_eos": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens == len(ids) for c in chunks)
    tokens = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]  # logprobs: one chunk per token
    assert chunks[0].usage.completion_tokens == 0 and [c.usage.completion_tokens for c in tokens] == [1, 2, 3, 4, 5, 6]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    prompt_ids = llm.tokenizer.encode("Once upon")
    chunks = list(client.completions.create(model=MODEL, prompt=["Once upon", "a time"], n=2, temperature=0, max_tokens=4,
                                            stream=True, logprobs=0, stream_options=options, extra_body={"ignore_eos": True}))
    per_choice = {i: [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].index == i] for i in range(4)}
    assert per_choice == {i: [1, 2, 3, 4] for i in range(4)}
    assert {c.usage.prompt_tokens for c in chunks if c.choices and c.choices[0].index < 2} == {len(prompt_ids)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    # include_usage alone: the usage comes once, at the end
    plain = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_streaming_completion(client, llm):
    ids = llm.tokenizer.encode("Once upon")
    ref = greedy(llm, ids, 7, ignore_eos=True)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=7, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_system_fingerprint_names_the_configuration_that_decides_the_arithmetic(client, llm):
    # the server runs the model as the in-process LLM does (one thread, its kernels, a float32 cache)
    assert llm.fingerprint.startswith("native-") and "threads=1 kv=float32" in llm.fingerprint
    answers = [client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2),
               client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)]
    answers += list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2, stream=True))
    answers += list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
                                                   stream_options={"include_usage": True}))
    assert {a.system_fingerprint for a in answers} == {llm.fingerprint}


def test_n_choices_use_consecutive_seeds_and_seeds_reproduce(client, llm):
    ids = llm.chat_prompt_ids(MESSAGES)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=12, n=3, seed=7,
                                       extra_body={"ignore_eos": True})
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, text in enumerate(texts):
        ref = llm.generate([ids], SamplingParams(temperature=1.0, max_tokens=12, seed=7 + j, ignore_eos=True), use_tqdm=False)[0]
        assert text == ref.text
    assert len(set(texts)) > 1  # different seeds, different samples (a random tiny model is far from peaked)
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=12, seed=7,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == texts[0]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 36


def test_streamed_n_choices_and_logprobs_equal_the_whole_answer(client):
    kw = dict(model=MODEL, prompt="Once upon", temperature=1.0, seed=3, max_tokens=8, n=2, logprobs=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    texts, logprobs = ["", ""], [[], []]
    for chunk in client.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        texts[c.index] += c.text
        if c.logprobs is not None:
            logprobs[c.index] += c.logprobs.token_logprobs
    assert texts == [c.text for c in whole.choices] and texts[0] != texts[1]
    assert logprobs == [c.logprobs.token_logprobs for c in whole.choices]
    assert all(len(lp) == 8 for lp in logprobs)


def test_stop_string_ends_the_answer_before_it(client, llm):
    free = greedy(llm, llm.tokenizer.encode("The dog"), 30, ignore_eos=True).text
    stop = free[10:13]
    r = client.completions.create(model=MODEL, prompt="The dog", temperature=0, max_tokens=30, stop=[stop, "@@never"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(stop)]


# --- logprobs ------------------------------------------------------------------------------


def test_chat_logprobs_are_the_models(client, llm):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=5, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    ids = llm.chat_prompt_ids(MESSAGES)
    out = greedy(llm, ids, 5, ignore_eos=True)
    ref = full_logprobs(llm, ids + out.token_ids)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for i, (entry, token) in enumerate(zip(content, out.token_ids)):
        row = ref[len(ids) - 1 + i]
        assert bytes(entry.bytes) == llm.tokenizer.token_bytes(token)
        assert entry.logprob == pytest.approx(float(row[token]), abs=2e-3)
        top = torch.topk(row, 3)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [llm.tokenizer.token_bytes(int(t)) for t in top.indices]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_completion_echo_returns_prompt_logprobs_first_null(client, llm, max_tokens):
    """lm-eval-harness's loglikelihood request: echo + logprobs, max_tokens 0 or 1."""
    prompt = "The quick brown fox jumps"
    ids = llm.tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    n = len(ids) + max_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    all_ids = ids + greedy(llm, ids, 1).token_ids[:max_tokens]
    ref = full_logprobs(llm, all_ids)
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, all_ids[i]]), abs=2e-3)
        assert lp.tokens[i] in lp.top_logprobs[i]
    assert r.choices[0].text.startswith(prompt)
    assert r.usage.completion_tokens == max_tokens and r.usage.prompt_tokens == len(ids)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]


def test_a_generated_stop_token_is_in_the_tokens_and_logprobs_not_the_text(client, llm):
    """vLLM's and OpenAI's rule, which lm-eval's loglikelihood relies on: it drops the last logprobs entry as the
    generated token's. Were an end-of-generation token left out, that would drop the last prompt token's instead."""
    eos = sorted(llm.tokenizer.eog_ids)[0]
    prompt = "The quick brown fox jumps"
    ids = llm.tokenizer.encode(prompt)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0,
              logit_bias={str(eos): 100})  # the stop token for sure; logprobs are the model's own, before the bias
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == prompt and r.usage.completion_tokens == 1
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.tokens[-1] == llm.tokenizer.token_bytes(eos).decode()
    all_ids = ids + [eos]
    ref = full_logprobs(llm, all_ids)
    assert lp.token_logprobs[1:] == pytest.approx([float(ref[i - 1, all_ids[i]]) for i in range(1, len(all_ids))], abs=2e-3)
    streamed = [tp for chunk in client.completions.create(stream=True, **kw) for tp in chunk.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs

    # chat: the stop token ends the logprobs content, and adds nothing to the message
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                       logit_bias={str(eos): 100})
    chat_ids = llm.chat_prompt_ids(MESSAGES)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert [bytes(e.bytes) for e in content] == [llm.tokenizer.token_bytes(eos)]
    assert content[0].logprob == pytest.approx(float(full_logprobs(llm, chat_ids)[-1, eos]), abs=2e-3)


def test_max_tokens_zero_with_echo_returns_the_prompt(client):
    r = client.completions.create(model=MODEL, prompt="just this", max_tokens=0, echo=True)
    assert r.choices[0].text == "just this" and r.usage.completion_tokens == 0 and r.choices[0].logprobs is None


# --- structured output ---------------------------------------------------------------------


def test_json_schema_response_parses_and_validates(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
              "required": ["ok", "kind"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    assert not free.choices[0].message.content.lstrip().startswith("{")  # the random model alone writes no JSON
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


# --- concurrency ---------------------------------------------------------------------------


def test_32_concurrent_streams_each_equal_their_greedy_answer_alone(server, llm):
    prompts = [f"story {i}: the {'cat' if i % 2 else 'dog'} went" for i in range(32)]
    refs = [greedy(llm, llm.tokenizer.encode(p), 4 + i % 5, ignore_eos=True).text for i, p in enumerate(prompts)]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)

        async def one(i):
            stream = await aclient.completions.create(model=MODEL, prompt=prompts[i], temperature=0, max_tokens=4 + i % 5,
                                                      stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == refs


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


# --- bad requests --------------------------------------------------------------------------

BAD = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi",', 400, None),
    ("wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("wrong type in a message", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("wrong type beside an unknown field", "/v1/completions", {"prompt": "hi", "store": True, "n": "2"}, 400, "n"),
    ("wrong type in stream_options", "/v1/completions", {"prompt": "hi", "stream": True,
                                                         "stream_options": {"continuous_usage_stats": 1}}, 400,
     "stream_options.continuous_usage_stats"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens in chat", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above one", "/v1/chat/completions", {"messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("prompt over the context", "/v1/completions", {"prompt": "hi " * 400}, 400, "prompt"),
    ("chat over the context", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 400}]}, 400, "messages"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("logit_bias key not a token id", "/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("logprobs above 20", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("invalid JSON schema", "/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}, 400, None),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("unknown route", "/v1/audio/speech", {"input": "hi"}, 404, None),
    ("embeddings of a generation model", "/v1/embeddings", {"input": "hi"}, 400, "model"),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [10**6]}, 400, "tokens"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_status_and_error_while_others_are_served(server, client, llm, name, path, body, status, param):
    ref = greedy(llm, llm.tokenizer.encode("good"), 6, ignore_eos=True).text
    result = {}

    def good():
        stream = client.completions.create(model=MODEL, prompt="good", temperature=0, max_tokens=6, stream=True,
                                           extra_body={"ignore_eos": True})
        result["text"] = "".join(c.choices[0].text for c in stream)

    t = threading.Thread(target=good)
    t.start()
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}{path}", timeout=30, **kw)
    t.join()
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert result["text"] == ref


def test_unknown_and_unimplemented_fields_are_accepted_and_logged_once(gguf, caplog):
    """vLLM's rule: a field churon does not know (a newer OpenAI one, another server's vendor field) is ignored
    with one warning per name; a documented OpenAI field churon does not implement is named as such."""
    from churon.server import create_app

    llm = LLM(gguf, threads=1)
    app = create_app(lambda: llm, MODEL)
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    extra = {"best_of": 2, "suffix": "!", "max_tokenz": 5, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    chat = {"messages": MESSAGES, "max_tokens": 2, "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
            "reasoning_effort": "low", "top_a": 0.1}

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                for _ in range(600):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                plain = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
                with caplog.at_level(logging.WARNING, logger="churon.server"):
                    for _ in range(2):
                        r = await http.post("/v1/completions", json=body | extra)
                        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain
                        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200

    asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.name == "churon.server" and r.levelno == logging.WARNING]
    unimplemented = [("CompletionRequest", "best_of"), ("CompletionRequest", "suffix"), ("StreamOptions", "include_obfuscation"),
                     ("ChatCompletionRequest", "store"), ("ChatCompletionRequest", "metadata"),
                     ("ChatCompletionRequest", "service_tier"), ("ChatCompletionRequest", "reasoning_effort")]
    unknown = [("CompletionRequest", "max_tokenz"), ("ChatCompletionRequest", "top_a")]
    assert sorted(warnings) == sorted(
        [f"{model}: ignoring field {name!r}: churon does not implement it" for model, name in unimplemented]
        + [f"{model}: ignoring unknown field {name!r}" for model, name in unknown]
    )


def test_oversized_body_is_413_by_length_and_while_read(server, client):
    big = json.dumps({"prompt": "x" * (5 << 20)}).encode()
    r = httpx.post(f"{server}/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "4194304 bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is found while reading
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    r = httpx.post(f"{server}/v1/completions", content=chunked(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices[0].finish_reason


# --- other endpoints -----------------------------------------------------------------------


def test_models_tokenize_detokenize(server, client, llm):
    models = httpx.get(f"{server}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{server}/v1/models/{MODEL}").json() == models["data"][0]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        client.models.retrieve("gpt-9")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/tiny")
    info = httpx.get(f"{server}/tokenizer_info").json()
    tokenizer = llm.tokenizer
    assert info == {"tokenizer_class": "Tokenizer", "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                    "add_bos_token": tokenizer.add_bos, "add_eos_token": False, "model_max_length": 256,
                    "chat_template": tokenizer.chat_template}
    # lm-eval's remote tokenizer finds the stop token's id by tokenizing its text without special tokens added
    r = httpx.post(f"{server}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert r["tokens"] == [tokenizer.eos_id]
    r = httpx.post(f"{server}/tokenize", json={"prompt": "hello world"}).json()
    assert r["tokens"] == llm.tokenizer.encode("hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    r = httpx.post(f"{server}/tokenize", json={"messages": MESSAGES}).json()
    assert r["tokens"] == llm.chat_prompt_ids(MESSAGES)
    assert httpx.post(f"{server}/detokenize", json={"tokens": r["tokens"][:5]}).json()["prompt"] == llm.tokenizer.decode(r["tokens"][:5])


def test_metrics_count_requests_tokens_and_latencies(server, client):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, extra_body={"ignore_eos": True})
    httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "temperature": -1})
    after = metrics(server)
    ok, bad = 'churon_requests_total{code="200"}', 'churon_requests_total{code="400"}'
    assert after[ok] >= before.get(ok, 0) + 1 and after[bad] == before.get(bad, 0) + 1
    assert after["churon_generation_tokens_total"] == before["churon_generation_tokens_total"] + 5
    ttft = "churon_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert after["churon_inter_token_latency_seconds_count"] == before["churon_inter_token_latency_seconds_count"] + 4
    assert after['churon_time_to_first_token_seconds_bucket{le="+Inf"}'] == after[ttft]
    # the engine's own record: one more time to first token, four more gaps, percentiles in order
    assert after["churon_engine_ttft_seconds_count"] == before["churon_engine_ttft_seconds_count"] + 1
    assert after["churon_engine_itl_seconds_count"] == before["churon_engine_itl_seconds_count"] + 4
    for name in ("ttft", "itl"):
        quantiles = [after[f'churon_engine_{name}_seconds{{quantile="{q}"}}'] for q in ("0.5", "0.9", "0.95", "0.99")]
        assert 0 < quantiles[0] <= quantiles[1] <= quantiles[2] <= quantiles[3]
    for name in ("churon_num_requests_waiting", "churon_kv_cache_usage_ratio", "churon_prefix_cache_hit_rate",
                 "churon_num_preemptions_total"):
        assert name in after


# --- API key and queue limit ---------------------------------------------------------------


def test_api_key_and_queue_limit(gguf, llm):
    proc, url = start_server(gguf, "--api-key", "sekret", "--max-queue", "1", "--max-num-seqs", "1")
    try:
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
        answer = keyed.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
        want = greedy(llm, llm.tokenizer.encode("hi"), 2)
        assert answer.choices[0].text == want.text and answer.usage.completion_tokens == len(want.token_ids)

        # one batch slot, one request may wait for its first token: of 8 long requests sent at once, most are turned away
        long = {"model": MODEL, "prompt": "hi", "max_tokens": 240, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=120, headers={"Authorization": "Bearer sekret"}) as http:
                return await asyncio.gather(*(http.post(f"{url}/v1/completions", json=long) for _ in range(8)))

        responses = asyncio.run(burst())
        busy = [r for r in responses if r.status_code == 503]
        served = [r for r in responses if r.status_code == 200]
        assert len(busy) + len(served) == 8 and busy and served
        assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in busy)
        assert all(r.json()["usage"]["completion_tokens"] == 240 for r in served)
        assert keyed.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    finally:
        stop_server(proc)


# --- startup -------------------------------------------------------------------------------


def test_health_is_503_until_the_model_is_loaded(gguf):
    from churon.server import create_app

    loaded = threading.Event()

    def load():
        loaded.wait(60)
        return LLM(gguf, threads=1)

    app = create_app(load, MODEL)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                r = await http.get("/health")
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
                r = await http.post("/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]
                loaded.set()
                for _ in range(600):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    asyncio.run(main())


def test_a_failed_load_is_reported(tmp_path):
    from churon.server import create_app

    failures = []
    app = create_app(lambda: LLM(tmp_path / "missing.gguf"), MODEL, on_load_error=failures.append)

    async def main():
        async with app.router.lifespan_context(app):
            for _ in range(200):
                if failures:
                    break
                await asyncio.sleep(0.05)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                r = await http.get("/health")
                assert r.status_code == 503 and "loading the model failed" in r.json()["error"]["message"]
                assert "missing.gguf" in r.json()["error"]["message"]

    asyncio.run(main())
    assert len(failures) == 1


def test_an_engine_failure_is_a_500_and_the_next_request_is_served(gguf, monkeypatch):
    from churon.server import create_app

    llm = LLM(gguf, threads=1)
    app = create_app(lambda: llm, MODEL)

    def broken_step(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                for _ in range(600):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                with monkeypatch.context() as m:
                    m.setattr(llm.engine.runner, "execute", broken_step)
                    r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
                assert r.status_code == 500
                assert r.json()["error"] == {"message": "internal error: RuntimeError: kernel exploded", "type": "server_error",
                                             "param": None, "code": None}
                r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    asyncio.run(main())


def test_serve_rejects_bad_settings_before_binding():
    r = subprocess.run([sys.executable, "-m", "churon.cli", "serve", "x", "--max-num-seqs", "0"], capture_output=True, text=True)
    assert r.returncode == 1 and "max_num_seqs=0" in r.stderr


# --- the real model ------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_served_chat_equals_llm_chat(smollm2_gguf):
    proc, url = start_server(smollm2_gguf, "--threads", "2")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
        ref = LLM(smollm2_gguf, threads=2).chat(messages, SamplingParams(temperature=0, max_tokens=24))
        assert r.choices[0].message.content == ref.text and len(ref.token_ids) > 0
    finally:
        stop_server(proc)
