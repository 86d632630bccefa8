"""Ollama's API on `churon serve`: a real server process driven by the official `ollama` client.

One server serves the tiny chat model (as MODEL) and the tiny BERT (as its path), with its cache in a
temporary CHURON_HOME and pip finding packages only in a local folder that holds a fake registry wheel;
another serves the tiny Qwen2.5-style model whose template renders tools. Every answer is checked against
churon run in this process on the same files: greedy texts, seeded tool calls, vectors, token counts.
"""

import base64
import hashlib
import json
import math
import os
import shutil
import re
import textwrap
import zipfile
from datetime import datetime
from importlib.metadata import version

import httpx2 as httpx
import jsonschema
import ollama
import pytest
from test_server import MODEL, gguf, llm, start_server, stop_server  # noqa: F401 (fixtures)

from churon import LLM, SamplingParams
from churon.loader import open_model
from churon.tool_calls import Tool, ToolChoice, ToolPlan

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
FAKE = {"name": "fake-tiny", "package": "fake-tiny", "version": "1.0", "member": "fake_tiny/tiny.gguf",
        "description": "the tiny test model in a local wheel"}


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fake_wheel(folder, model_bytes: bytes) -> None:
    """A wheel as the registry's are: the GGUF under fake_tiny/, every file in RECORD with its sha256."""
    folder.mkdir(parents=True)
    files = {
        "fake_tiny-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: fake-tiny\nVersion: 1.0\n",
        "fake_tiny-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        FAKE["member"]: model_bytes,
    }
    with zipfile.ZipFile(folder / "fake_tiny-1.0-py3-none-any.whl", "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        record = [f"{name},{_record_hash(data)},{len(data)}" for name, data in files.items()]
        zf.writestr("fake_tiny-1.0.dist-info/RECORD", "\n".join(record + ["fake_tiny-1.0.dist-info/RECORD,,"]) + "\n")


@pytest.fixture(scope="module")
def home(tmp_path_factory, gguf):  # noqa: F811
    """The server's environment: its own CHURON_HOME, pip on a local folder with the fake wheel, and the fake
    registry entry added at the server's start (a sitecustomize on its PYTHONPATH)."""
    root = tmp_path_factory.mktemp("ollama")
    _fake_wheel(root / "links", gguf.read_bytes())
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(
        f"from churon import registry\nregistry.REGISTRY['fake-tiny'] = registry.RegistryModel(**{FAKE!r})\n")
    env = {"CHURON_HOME": str(root / "home"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(root / "links"),
           "PYTHONPATH": os.pathsep.join([str(root / "site"), os.environ.get("PYTHONPATH", "")])}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def bert(tiny_bert_dir):
    return str(tiny_bert_dir)


@pytest.fixture(scope="module")
def server(home, gguf, bert):  # noqa: F811
    proc, url = start_server(gguf, "--embedding-model", bert)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server)


@pytest.fixture(scope="module")
def embedder(bert):
    return LLM(bert, threads=1)


def greedy(llm, ids, n):  # noqa: F811
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0]


def check_final(r, prompt_tokens: int, output_tokens: int, finish_reason: str) -> None:
    """The last object: done, its reason, counts equal to the token counts, durations in nanoseconds that fit
    inside the total."""
    assert r.done is True and r.done_reason == ("length" if finish_reason == "length" else "stop")
    assert (r.prompt_eval_count, r.eval_count) == (prompt_tokens, output_tokens)
    for d in (r.total_duration, r.load_duration, r.prompt_eval_duration, r.eval_duration):
        assert isinstance(d, int) and d >= 0
    assert r.prompt_eval_duration > 0
    assert r.load_duration + r.prompt_eval_duration + r.eval_duration <= r.total_duration
    assert r.total_duration < 120 * 10**9  # nanoseconds, not microseconds: a tiny model answers within seconds
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", r.created_at)
    datetime.fromisoformat(r.created_at.replace("Z", "+00:00"))


# --- chat and generate ----------------------------------------------------------------------


def test_chat_whole_and_streamed_is_the_engines_greedy_answer(client, llm):  # noqa: F811
    ids = llm.chat_prompt_ids(MESSAGES)
    ref = greedy(llm, ids, 8)
    r = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY | {"num_predict": 8}, stream=False)
    assert r.model == MODEL and r.message.role == "assistant" and r.message.content == ref.text
    check_final(r, len(ids), len(ref.token_ids), ref.finish_reason)
    parts = list(client.chat(model=MODEL, messages=MESSAGES, options=GREEDY | {"num_predict": 8}, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == ref.text
    check_final(parts[-1], len(ids), len(ref.token_ids), ref.finish_reason)


def test_generate_renders_system_and_prompt_and_returns_the_context(client, llm):  # noqa: F811
    ids = llm.chat_prompt_ids([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    ref = greedy(llm, ids, 6)
    r = client.generate(model=MODEL, prompt="hello", system="be brief", options=GREEDY | {"num_predict": 6})
    assert r.response == ref.text
    check_final(r, len(ids), len(ref.token_ids), ref.finish_reason)
    assert list(r.context) == ids + ref.token_ids
    parts = list(client.generate(model=MODEL, prompt="hello", system="be brief", options=GREEDY | {"num_predict": 6},
                                 stream=True))
    assert "".join(p.response for p in parts) == ref.text and list(parts[-1].context) == list(r.context)
    # the next turn continues from the context: its prompt is the context, then the new prompt's ids
    follow = llm.chat_prompt_ids([{"role": "user", "content": "and then"}])
    ref2 = greedy(llm, list(r.context) + follow, 4)
    r2 = client.generate(model=MODEL, prompt="and then", context=r.context, options=GREEDY | {"num_predict": 4})
    assert r2.response == ref2.text and r2.prompt_eval_count == len(r.context) + len(follow)
    assert list(r2.context) == list(r.context) + follow + ref2.token_ids


def test_generate_raw_takes_the_prompt_as_it_is(client, llm):  # noqa: F811
    ids = llm.encode("once upon a time")
    ref = greedy(llm, ids, 5)
    r = client.generate(model=MODEL, prompt="once upon a time", raw=True, options=GREEDY | {"num_predict": 5})
    assert r.response == ref.text and r.prompt_eval_count == len(ids) and r.context is None


def test_a_template_and_a_stop_option_change_the_answer_as_the_engine_does(client, llm):  # noqa: F811
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    ids = llm.encode("[user] hi\n[assistant] ", add_bos=False)
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, stop=["e"]), use_tqdm=False)[0]
    r = client.generate(model=MODEL, prompt="hi", template=template, options=GREEDY | {"num_predict": 12, "stop": ["e"]})
    assert r.response == ref.text and r.prompt_eval_count == len(ids)


def test_format_schema_and_json_constrain_the_answer(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
              "required": ["ok", "kind"], "additionalProperties": False}
    r = client.chat(model=MODEL, messages=MESSAGES, format=schema, options=GREEDY | {"num_predict": 60})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)
    g = client.generate(model=MODEL, prompt="hello", format=schema, options=GREEDY | {"num_predict": 60})
    jsonschema.validate(json.loads(g.response), schema)
    j = client.generate(model=MODEL, prompt="hello", format="json", options=GREEDY | {"num_predict": 60})
    assert j.response.lstrip().startswith("{")


def test_an_empty_request_loads_the_model(client):
    r = client.generate(model=MODEL)
    assert r.done and r.done_reason == "load" and r.response == ""
    c = client.chat(model=MODEL, messages=[])
    assert c.done and c.done_reason == "load"


# --- tools ------------------------------------------------------------------------------------

# what the ollama client sends of a schema (its Tool model keeps type, required, properties' type and enum)
WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_server(home, qwen_tools_gguf):
    proc, url = start_server(qwen_tools_gguf)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def tools_llm(qwen_tools_gguf):
    return LLM(qwen_tools_gguf, threads=1)


def test_a_tool_call_comes_back_as_ollamas_message_tool_calls(tools_server, tools_llm):
    """With format "json" and tools the answer is a JSON object or calls (the grammar); a seed for which the
    engine here writes a call is asked of the server, which must return that call with its arguments an object."""
    tools = [Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in TOOLS]
    plan = ToolPlan.build(tools_llm, ASK, tools, ToolChoice("auto"), json_schema={"type": "object"})
    for seed in range(64):
        out = tools_llm.generate(plan.prompt_ids, SamplingParams(temperature=1, seed=seed, max_tokens=120,
                                                                 grammar=plan.grammar), use_tqdm=False)[0]
        content, calls = plan.parse(out.text)
        if calls:
            break
    else:
        pytest.fail("no seed in 0..63 makes the tiny model call the tool")
    client = ollama.Client(host=tools_server)
    options = GREEDY | {"temperature": 1, "seed": seed, "num_predict": 120}
    r = client.chat(model=MODEL, messages=ASK, tools=TOOLS, format="json", options=options)
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls] == \
        [(c.name, json.loads(c.arguments)) for c in calls]
    jsonschema.validate(dict(r.message.tool_calls[0].function.arguments), WEATHER)
    assert r.prompt_eval_count == len(plan.prompt_ids) and r.eval_count == len(out.token_ids)
    streamed = list(client.chat(model=MODEL, messages=ASK, tools=TOOLS, format="json", options=options, stream=True))
    calls_streamed = [c for p in streamed for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls_streamed] == \
        [(c.name, json.loads(c.arguments)) for c in calls]
    show = client.show(MODEL)
    assert show.capabilities == ["completion", "tools"]


def test_a_conversation_with_a_call_and_its_result_renders_as_the_template_does(tools_server, tools_llm):
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    neutral = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1_0"}]
    tools = [Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in TOOLS]
    plan = ToolPlan.build(tools_llm, neutral, tools, ToolChoice("auto"))
    ref = greedy(tools_llm, plan.prompt_ids, 6)
    r = ollama.Client(host=tools_server).chat(model=MODEL, messages=history, tools=TOOLS,
                                              options=GREEDY | {"num_predict": 6})
    assert r.prompt_eval_count == len(plan.prompt_ids)
    assert (r.message.content, r.message.tool_calls) == (plan.parse(ref.text)[0] or "", None)


# --- embeddings -------------------------------------------------------------------------------


def test_embed_and_embeddings_are_llm_embeds_vectors(client, bert, embedder):
    texts = ["hello world", "a red sail on the sea"]
    r = client.embed(model=bert, input=texts)
    assert r.model == bert and [list(v) for v in r.embeddings] == embedder.embed(texts)
    assert r.prompt_eval_count == sum(len(embedder.encode_for_embedding(t)) for t in texts)
    assert 0 <= r.load_duration <= r.total_duration
    one = client.embed(model=bert, input="hello world")
    assert [list(v) for v in one.embeddings] == embedder.embed(["hello world"])
    old = client.embeddings(model=bert, prompt="hello world")
    assert list(old.embedding) == embedder.embed(["hello world"])[0]
    # dimensions keeps the first ones, normalized again
    short = client.embed(model=bert, input="hello world", dimensions=8).embeddings[0]
    head = embedder.embed(["hello world"])[0][:8]
    norm = sum(x * x for x in head) ** 0.5
    assert list(short) == pytest.approx([x / norm for x in head], rel=1e-12)


def test_embed_truncates_by_default_and_refuses_when_told_not_to(client, bert, embedder):
    long = "word " * 2000
    r = client.embed(model=bert, input=long)
    assert [list(v) for v in r.embeddings] == [embedder.embed([embedder.encode_for_embedding(long, truncate=True)])[0]]
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=bert, input=long, truncate=False)
    assert e.value.status_code == 400 and "input" in e.value.error


# --- the models this server has ---------------------------------------------------------------


def test_tags_show_ps_and_version(client, gguf, bert):  # noqa: F811
    tags = {m.model: m for m in client.list().models}
    tiny = tags[MODEL]
    assert tiny.digest == "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert tiny.size == gguf.stat().st_size
    assert (tiny.details.format, tiny.details.family, tiny.details.quantization_level) == ("gguf", "qwen2", "Q8_0")
    assert tiny.details.parameter_size.endswith(("K", "M"))
    assert tags[bert].details.format == "safetensors" and tags[bert].details.family == "bert"

    llm = LLM(gguf, threads=1)  # noqa: F811
    show = client.show(MODEL)
    info = show.modelinfo
    assert info["general.architecture"] == "qwen2"
    assert info["qwen2.context_length"] == llm.config.context_length
    assert info["qwen2.embedding_length"] == llm.config.hidden_size
    assert info["qwen2.block_count"] == llm.config.num_layers
    assert info["qwen2.attention.head_count_kv"] == llm.config.num_kv_heads
    assert info["general.parameter_count"] == sum(math.prod(t.shape) for t in open_model(gguf).tensors)
    assert show.capabilities == ["completion"] and show.details.family == "qwen2"
    assert show.template == (llm.tokenizer.chat_template or "")
    assert client.show(bert).capabilities == ["embedding"]

    ps = {m.model: m for m in client.ps().models}
    assert MODEL in ps and bert in ps
    assert ps[MODEL].size_vram == 0 and ps[MODEL].digest == tiny.digest and ps[MODEL].expires_at is not None
    assert client._client.get("/api/version").json() == {"version": version("churon")}


def test_pull_streams_progress_from_a_local_registry_wheel(client, home, gguf):  # noqa: F811
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    parts = list(client.pull("fake-tiny", stream=True))
    assert parts[0].status == "pulling manifest" and parts[-1].status == "success"
    progress = [p for p in parts if p.digest]
    assert progress and progress[-1].digest == digest and progress[-1].completed == progress[-1].total == gguf.stat().st_size
    assert (home / "home" / "models" / "tiny.gguf").read_bytes() == gguf.read_bytes()
    assert client.pull("fake-tiny").status == "success"  # stream false: the last object alone
    assert client.delete("fake-tiny").status == "success"  # a registry model's cached file goes
    assert not (home / "home" / "models" / "tiny.gguf").exists()


# --- created models ---------------------------------------------------------------------------


RIDDLER = textwrap.dedent("""\
    FROM {base}
    SYSTEM You answer in riddles.
    PARAMETER temperature 0
    PARAMETER num_predict 7
    """)


def create(server, name: str, modelfile: str) -> list[dict]:
    """POST /api/create with a Modelfile's text (Ollama's older body, which the client no longer sends)."""
    r = httpx.post(f"{server}/api/create", json={"model": name, "modelfile": modelfile}, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(x) for x in r.text.splitlines()]


@pytest.fixture(scope="module")
def riddler_base(home, gguf):  # noqa: F811
    """The base of the created models: a model of the server's cache, named (over HTTP, FROM takes no path)."""
    path = home / "home" / "models" / "riddler-base.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf, path)
    return path


def test_create_from_a_modelfile_show_copy_and_delete(client, server, riddler_base):
    assert create(server, "riddler", RIDDLER.format(base="riddler-base"))[-1] == {"status": "success"}
    show = client.show("riddler")
    assert show.details.parent_model == "riddler-base" and str(riddler_base.resolve()) in show.modelfile
    assert "temperature" in show.parameters
    assert "You answer in riddles." in show.modelfile and show.capabilities == ["completion"]
    assert "riddler:latest" in {m.model for m in client.list().models}
    # the newer body's fields make the same kind of model
    assert client.create("riddler2", from_="riddler", system="Be short.").status == "success"
    assert client.copy("riddler", "riddler-copy").status == "success"
    assert client.show("riddler-copy").modelfile == show.modelfile
    for name in ("riddler", "riddler2", "riddler-copy"):
        assert client.delete(name).status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.show("riddler")
    assert e.value.status_code == 404


def test_a_created_models_system_and_parameters_are_in_effect(client, server, riddler_base, llm):  # noqa: F811
    create(server, "riddler", RIDDLER.format(base="riddler-base"))
    # its SYSTEM is the system turn and temperature 0 its sampling: the engine's greedy answer to that prompt
    ids = llm.chat_prompt_ids([{"role": "system", "content": "You answer in riddles."}, {"role": "user", "content": "hi"}])
    ref = greedy(llm, ids, 7)
    r = client.chat(model="riddler", messages=[{"role": "user", "content": "hi"}], options={"top_k": 0, "repeat_penalty": 1.0})
    assert r.message.content == ref.text and r.prompt_eval_count == len(ids) and r.eval_count == len(ref.token_ids)
    g = client.generate(model="riddler", prompt="hi", options={"top_k": 0, "repeat_penalty": 1.0})
    assert g.response == ref.text and list(g.context) == ids + ref.token_ids
    # everywhere a model name is: OpenAI's chat gets its SYSTEM too
    o = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": "riddler", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 7})
    assert o.status_code == 200 and o.json()["usage"]["prompt_tokens"] == len(ids)
    assert o.json()["choices"][0]["message"]["content"] == ref.text
    client.delete("riddler")


# --- bad input ----------------------------------------------------------------------------------


def test_an_unknown_model_is_ollamas_404(client, server):
    for call in (lambda: client.chat(model="nope", messages=MESSAGES), lambda: client.generate(model="nope", prompt="x"),
                 lambda: client.show("nope"), lambda: client.embed(model="nope", input="x")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and e.value.error == 'model "nope" not found, try pulling it first'
    r = httpx.post(f"{server}/api/chat", json={"model": "nope", "messages": MESSAGES})
    assert r.status_code == 404 and r.json() == {"error": 'model "nope" not found, try pulling it first'}


@pytest.mark.parametrize("path,body,status,words", [
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "what is this?", "images": ["aGk="]}]},
     400, "messages[0].images"),
    ("/api/generate", {"model": MODEL, "prompt": "what is this?", "images": ["aGk="]}, 400, "images"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "keep_alive": "five minutes"}, 400, "keep_alive"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"temperature": "hot"}}, 400, "temperature"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"no_such_option": 1}}, 400, "no_such_option"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "format": "yaml"}, 400, "format"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "context": [10**9]}, 400, "context[0]"),
    ("/api/generate", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/api/embed", {"model": MODEL, "input": "x"}, 400, "text-generation model"),
    ("/api/pull", {"model": "no-such-model"}, 404, "no-such-model"),
])
def test_bad_input_is_an_error_in_ollamas_shape_naming_it(server, path, body, status, words):
    r = httpx.post(f"{server}{path}", json=body)
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"] and words in r.json()["error"]


def test_create_with_a_name_escaping_the_store_is_a_400(server, gguf):  # noqa: F811
    # over HTTP, FROM names a model: a path on the server is not opened
    r = httpx.post(f"{server}/api/create", json={"model": "x", "modelfile": f"FROM {gguf}\n"})
    assert r.status_code == 400 and "does not exist: not a model in the server's cache" in r.json()["error"]
    r = httpx.post(f"{server}/api/create", json={"model": "../x", "modelfile": f"FROM {gguf}\n"})
    assert r.status_code == 400 and "../x" in r.json()["error"]
