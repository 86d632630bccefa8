"""POST /v1/embeddings on `churon serve`: a real server process serving a chat model and an embedding model
(the tiny random BERT) at once, driven by the official openai client and LangChain's OpenAIEmbeddings.

Every vector is checked against LLM.embed on the same files in this process (bitwise: the same backend and
thread count) and against sentence-transformers' own; usage counts against the Hugging Face tokenizer's.
Bad requests, the limits and an embedding model served alone run on the app in this process.
"""

import asyncio
import base64
import math
import threading

import httpx2 as httpx
import numpy as np
import openai
import pytest

from churon import LLM
from churon.server import create_app
from churon.server.limits import RequestLimits
from test_server import MODEL, gguf, llm, loaded_client, metrics, start_server, stop_server  # noqa: F401 (fixtures)

TEXTS = ["hello world", "the quick brown fox jumped over the lazy dog", "a red sail on the sea", "中文 日本語",
         "an unbelievable story of a child and his father, told in the evening"]


@pytest.fixture(scope="module")
def bert_dir(tiny_bert_dir):
    return tiny_bert_dir


@pytest.fixture(scope="module")
def embedder(bert_dir):
    """The embedding model in this process, as the server runs it (one thread, the same kernels)."""
    return LLM(bert_dir, threads=1)


@pytest.fixture(scope="module")
def server(gguf, bert_dir):  # noqa: F811
    """The chat model (served as MODEL) and the embedding model (served as its path) in one server."""
    proc, url = start_server(gguf, "--embedding-model", str(bert_dir))
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(bert_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(bert_dir))


def from_base64(text: str) -> list[float]:
    """OpenAI's base64 encoding: the vector's float32 values, little-endian."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# --- vectors equal the in-process model's ----------------------------------------------------------


def test_openai_client_float_and_base64_equal_llm_embed(client, bert_dir, embedder, hf_tokenizer):
    ref = embedder.embed(TEXTS)
    for encoding_format in ("float", "base64", openai.omit):  # omitted: the client asks for base64 and decodes it
        r = client.embeddings.create(model=str(bert_dir), input=TEXTS, encoding_format=encoding_format)
        assert r.object == "list" and r.model == str(bert_dir)
        assert [d.index for d in r.data] == list(range(len(TEXTS))) and {d.object for d in r.data} == {"embedding"}
        vectors = [d.embedding for d in r.data]
        if encoding_format == "base64":  # asked for by name, it is the caller's to decode
            vectors = [from_base64(v) for v in vectors]
        assert vectors == ref
        tokens = sum(len(hf_tokenizer(t)["input_ids"]) for t in TEXTS)
        assert (r.usage.prompt_tokens, r.usage.total_tokens) == (tokens, tokens)
    one = client.embeddings.create(model=str(bert_dir), input=TEXTS[1])
    assert len(one.data) == 1 and one.data[0].embedding == ref[1]
    assert one.usage.prompt_tokens == len(hf_tokenizer(TEXTS[1])["input_ids"])
    assert len(ref[0]) == embedder.embedding_dim and math.isclose(np.linalg.norm(ref[0]), 1.0, rel_tol=1e-5)


def test_token_ids_and_lists_of_them_are_embedded_as_given(client, bert_dir, embedder, hf_tokenizer):
    ids = [hf_tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    r = client.embeddings.create(model=str(bert_dir), input=ids[0])
    assert [d.embedding for d in r.data] == embedder.embed(ids[0]) == embedder.embed(TEXTS[:1])
    assert r.usage.prompt_tokens == len(ids[0])
    r = client.embeddings.create(model=str(bert_dir), input=ids)
    assert [d.embedding for d in r.data] == embedder.embed(TEXTS[:3])
    assert r.usage.prompt_tokens == sum(map(len, ids))
    bare = [5, 60, 61, 62]  # no [CLS] / [SEP]: ids are used as given, not wrapped in special tokens
    r = client.embeddings.create(model=str(bert_dir), input=[bare])
    assert r.data[0].embedding == embedder.embed([bare])[0] and r.usage.prompt_tokens == 4


def test_vectors_are_close_to_sentence_transformers(client, bert_dir, embedder):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(bert_dir), device="cpu").encode(TEXTS, convert_to_numpy=True)
    r = client.embeddings.create(model=str(bert_dir), input=TEXTS)
    floor = 0.999 if embedder.model.backend.name == "native" else 0.9999
    assert min(cosine(d.embedding, s) for d, s in zip(r.data, st)) >= floor


def test_langchain_openai_embeddings(server, bert_dir, embedder):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=True would tokenize with tiktoken, whose files come from the internet
    lc = OpenAIEmbeddings(model=str(bert_dir), base_url=f"{server}/v1", api_key="unused",
                          check_embedding_ctx_length=False, max_retries=0)
    assert lc.embed_documents(TEXTS) == embedder.embed(TEXTS)
    assert lc.embed_query(TEXTS[2]) == embedder.embed(TEXTS[2])[0]


def test_concurrent_clients_each_get_their_solo_vectors(server, bert_dir, embedder):
    """16 clients at once: their inputs share forwards, and each vector is the one its text gets alone
    (bitwise on the native kernels, which are batch-invariant)."""
    words = "the quick brown fox jumped over the lazy dog in the morning and the evening".split()
    requests = [[" ".join(words[: 1 + (i * 3 + j) % len(words)]) for j in range(1 + i % 4)] for i in range(16)]
    solo = {t: embedder.embed(t)[0] for r in requests for t in r}

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(aclient.embeddings.create(model=str(bert_dir), input=r) for r in requests))

    results = asyncio.run(main())
    native = embedder.model.backend.name == "native"
    for texts, r in zip(requests, results):
        for t, d in zip(texts, r.data):
            if native:
                assert d.embedding == solo[t]
            else:
                assert cosine(d.embedding, solo[t]) >= 0.99999


def test_metrics_count_embedding_requests_and_tokens(server, client, bert_dir, hf_tokenizer):
    before = metrics(server)
    client.embeddings.create(model=str(bert_dir), input=TEXTS[:2])
    after = metrics(server)
    assert after["churon_embedding_requests_total"] == before["churon_embedding_requests_total"] + 1
    tokens = sum(len(hf_tokenizer(t)["input_ids"]) for t in TEXTS[:2])
    assert after["churon_embedding_tokens_total"] == before["churon_embedding_tokens_total"] + tokens
    assert "churon_kv_cache_usage_ratio" in after  # the chat model's engine gauges are still there


# --- two models in one server ----------------------------------------------------------------------


def test_one_server_chats_with_one_model_and_embeds_with_the_other(server, client, bert_dir, llm, embedder):  # noqa: F811
    from churon import SamplingParams

    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6)
    assert r.choices[0].message.content == llm.chat(messages, SamplingParams(temperature=0, max_tokens=6)).text
    assert r.model == MODEL
    e = client.embeddings.create(model=str(bert_dir), input="hello there")
    assert e.data[0].embedding == embedder.embed("hello there")[0]
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, str(bert_dir)}
    card = client.models.retrieve(str(bert_dir))
    assert card.id == str(bert_dir) and card.task == "embed" and card.dimensions == embedder.embedding_dim
    assert card.max_model_len == embedder.max_embed_len
    assert cards[MODEL].task == "generate" and cards[MODEL].max_model_len == llm.max_model_len


WRONG_TASK = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ("/tokenize", {"prompt": "hi"}),
]


@pytest.mark.parametrize("path,body", WRONG_TASK, ids=[p for p, _ in WRONG_TASK])
def test_a_text_request_to_the_embedding_model_is_a_400_naming_its_task(server, bert_dir, path, body):
    r = httpx.post(f"{server}{path}", json={**body, "model": str(bert_dir)}, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"{str(bert_dir)!r} is an embedding model; use /v1/embeddings" in message
    assert f"this server's text-generation model is {MODEL!r}" in message


def test_embeddings_of_the_chat_model_are_a_400_naming_its_task(server, bert_dir):
    r = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_task_mismatch"
    assert error["message"] == (f"{MODEL!r} is a text-generation model, not an embedding model"
                                f" (this server's embedding model is {str(bert_dir)!r})")
    # without a model, each API takes the model of its task
    assert httpx.post(f"{server}/v1/embeddings", json={"input": "hi"}, timeout=30).status_code == 200
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_a_model_not_served_is_a_404_naming_both(server, bert_dir):
    r = httpx.post(f"{server}/v1/embeddings", json={"model": "text-embedding-3-small", "input": "hi"}, timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == (f"the model 'text-embedding-3-small' does not exist: this server serves"
                                            f" {MODEL!r} and {str(bert_dir)!r}")


def test_a_decoder_served_to_embed_with_last_token_pooling(gguf):  # noqa: F811
    """`churon serve MODEL --task embed --pooling last` (the Qwen3-Embedding way): the vectors are LLM.embed's. An
    empty string is no token at all for a model without a BOS: a 400, not a vector of nothing."""
    ref = LLM(gguf, task="embed", pooling="last", threads=1)
    proc, url = start_server(gguf, "--task", "embed", "--pooling", "last")
    try:
        r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[:3]}, timeout=30)
        assert r.status_code == 200, r.text
        assert [d["embedding"] for d in r.json()["data"]] == ref.embed(TEXTS[:3]) and r.json()["model"] == MODEL
        assert ref.encode_for_embedding("") == []  # qwen2 has no BOS
        r = httpx.post(f"{url}/v1/embeddings", json={"input": ["hi", ""]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("input[1]: an input is empty")
    finally:
        stop_server(proc)


# --- bad input, limits, an embedding model alone (the app in this process) -------------------------

EMBED = "bert"


@pytest.fixture
def app(embedder):
    """A fresh app per test: an app's drain belongs to the event loop of its first use."""
    return create_app(lambda: embedder, EMBED, limits=RequestLimits(max_embedding_inputs=4, max_prompt_tokens=100))


def post(app, *requests: tuple[str, dict]) -> list[httpx.Response]:
    async def main():
        async with loaded_client(app) as http:
            return [await http.post(path, json=body) for path, body in requests]

    return asyncio.run(main())


def too_long(embedder) -> str:
    """A text of more tokens than the model embeds."""
    return "hello " * embedder.max_embed_len


BAD = [
    ("an empty list", {"input": []}, "input", "input is empty"),
    ("an empty token list", {"input": [[]]}, "input[0]", "input[0]: an input is empty"),
    ("a token id outside the vocabulary", {"input": [[2, 7, 10**6, 3]]}, "input[0]", "token id 1000000"),
    ("a negative token id", {"input": [2, -1, 3]}, "input", "token id -1"),
    ("an input over the max length", {"input": ["hi", "TOO_LONG"]}, "input[1]", "more than the 64"),
    ("token ids over the max length", {"input": [[5] * 65]}, "input[0]", "65 tokens"),
    ("dimensions not the model's", {"input": "hi", "dimensions": 32}, "dimensions", "does not support truncating"),
    ("truncate_prompt_tokens 0", {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "give -1"),
    ("truncate_prompt_tokens below the max length", {"input": "hi", "truncate_prompt_tokens": 8},
     "truncate_prompt_tokens", "give -1 (or 64"),
    ("an encoding_format not float or base64", {"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
    ("input of mixed types", {"input": ["hi", 5]}, "input", "input"),
    ("more inputs than --max-embedding-inputs", {"input": ["a"] * 5}, "input", "limit of 4 per request (--max-embedding-inputs)"),
    ("more tokens than --max-prompt-tokens", {"input": ["hello " * 30] * 4}, "input",
     "the request's inputs come to 128 tokens: more than this server's limit of 100 per request (--max-prompt-tokens)"),
]


@pytest.mark.parametrize("name,body,param,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_it(app, embedder, name, body, param, message):
    if body["input"] == ["hi", "TOO_LONG"]:
        body = {**body, "input": ["hi", too_long(embedder)]}
    [r] = post(app, ("/v1/embeddings", body))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_the_messages_of_a_long_input_and_a_bad_id_name_the_length_and_the_limit(app, embedder):
    [long, bad_id] = post(app, ("/v1/embeddings", {"input": too_long(embedder)}),
                          ("/v1/embeddings", {"input": [2, embedder.config.vocab_size, 3]}))
    n = len(embedder.encode_for_embedding(too_long(embedder)))
    assert long.json()["error"]["code"] == "context_length_exceeded"
    assert f"{n} tokens, more than the {embedder.max_embed_len}" in long.json()["error"]["message"]
    assert "truncate_prompt_tokens=-1" in long.json()["error"]["message"]
    assert f"token id {embedder.config.vocab_size} is outside the vocabulary" in bad_id.json()["error"]["message"]


def test_truncation_keeps_the_beginning_as_llm_embed_does(app, embedder):
    text = too_long(embedder) + "the end"
    requests = [("/v1/embeddings", {"input": text, "truncate_prompt_tokens": k}) for k in (-1, embedder.max_embed_len, 10**6)]
    ref = embedder.embed(text, truncate=True)
    for r in post(app, *requests):
        assert r.status_code == 200, r.text
        assert [d["embedding"] for d in r.json()["data"]] == ref
        assert r.json()["usage"]["prompt_tokens"] == embedder.max_embed_len


def test_an_empty_string_is_berts_cls_sep(app, embedder):
    """BERT defines "": [CLS] [SEP], embedded as any other input (sentence-transformers does the same)."""
    [r] = post(app, ("/v1/embeddings", {"input": ["", "hi"]}))
    assert r.status_code == 200, r.text
    assert [d["embedding"] for d in r.json()["data"]] == embedder.embed(["", "hi"])
    assert r.json()["usage"]["prompt_tokens"] == 2 + len(embedder.encode_for_embedding("hi"))


def test_the_models_own_dimensions_unknown_fields_and_the_user_field_are_accepted(app, embedder):
    [r] = post(app, ("/v1/embeddings", {"model": EMBED, "input": "hi", "dimensions": embedder.embedding_dim,
                                        "user": "someone", "some_vendor_field": 1}))
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["embedding"] == embedder.embed("hi")[0] and r.json()["model"] == EMBED


def test_an_embedding_model_alone(app, embedder):
    """`churon serve all-minilm`: the embedding model is the server's only model; text APIs name it in a 400,
    /metrics has no generation engine to read."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}

    async def main():
        async with loaded_client(app) as http:
            return (await http.get("/v1/models"), await http.post("/v1/chat/completions", json=chat),
                    await http.post("/v1/chat/completions", json={**chat, "model": EMBED}), await http.get("/metrics"))

    models, chat_default, chat_named, metrics_page = asyncio.run(main())
    assert models.json()["data"] == [{"id": EMBED, "object": "model", "created": 0, "owned_by": "churon", "task": "embed",
                                      "max_model_len": embedder.max_embed_len, "dimensions": embedder.embedding_dim,
                                      "loaded": True, "expires_at": None}]
    for r in (chat_default, chat_named):
        assert r.status_code == 400 and r.json()["error"]["message"] == "'bert' is an embedding model; use /v1/embeddings"
    assert metrics_page.status_code == 200 and "churon_embedding_requests_total" in metrics_page.text
    assert "churon_kv_cache_usage_ratio" not in metrics_page.text


def test_health_waits_for_both_models_and_a_failed_second_load_is_reported(gguf, embedder, tmp_path):  # noqa: F811
    chat_llm = LLM(gguf, threads=1)
    release = threading.Event()

    def slow_embedder():
        release.wait(30)
        return embedder

    app = create_app(lambda: chat_llm, MODEL, embedding_model=(slow_embedder, EMBED))

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
                for _ in range(20):  # the chat model loads at once; /health still waits for the embedding model
                    loading = await http.get("/health")
                    await asyncio.sleep(0.05)
                release.set()
                while (ready := await http.get("/health")).status_code != 200:
                    await asyncio.sleep(0.05)
                return loading, ready

    loading, ready = asyncio.run(main())
    assert loading.status_code == 503 and "still loading" in loading.json()["error"]["message"]
    assert ready.status_code == 200

    failures = []
    app = create_app(lambda: chat_llm, MODEL, embedding_model=(lambda: LLM(tmp_path / "missing"), EMBED),
                     on_load_error=failures.append)

    async def failed():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
                while not failures:
                    await asyncio.sleep(0.05)
                return await http.get("/health"), await http.post("/v1/completions", json={"prompt": "hi"})

    health, completion = asyncio.run(failed())
    assert len(failures) == 1 and "missing" in str(failures[0])
    for r in (health, completion):  # the chat model loaded, but the server serves both or neither
        assert r.status_code == 503 and "loading the model failed" in r.json()["error"]["message"]


def test_two_models_may_not_share_a_name(embedder):
    with pytest.raises(ValueError, match="same name"):
        create_app(lambda: embedder, EMBED, embedding_model=(lambda: embedder, EMBED))
