"""LoRA adapters on `churon serve`: a real server process on a tiny random llama with random PEFT adapters,
driven by the official openai client (and plain HTTP for the other dialects and vLLM's load/unload routes).

vLLM's rules: a request whose `model` is an adapter's name runs on the base model with that adapter, in every
API; /v1/models lists each adapter after its base ("parent" the base, "root" its path); POST
/v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time, with --allow-lora-loading only.
Every answer is checked against LLM(...).generate in this process with SamplingParams(lora=...), greedy.
"""

import asyncio
import json
import shutil

import httpx2 as httpx
import openai
import pytest

from churon import LLM, SamplingParams
from churon.server import create_app
from test_server import MODEL, start_server, stop_server
from tiny_models import make_hf_model, make_peft_adapter

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about the fox."}]
MAX_LORAS, MAX_RANK = 3, 8
CONTEXT = 1024  # room for the stream that outlives its adapter's unload
LONG = 900


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("lora-llama"), max_positions=CONTEXT)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "alpha": dict(rank=4, seed=1),
        "beta": dict(rank=8, use_rslora=True, targets=("q_proj", "v_proj", "gate_proj", "up_proj"), seed=2),
        "gamma": dict(rank=2, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=3),
        "delta": dict(rank=4, seed=4),
        "epsilon": dict(rank=4, targets=("down_proj", "o_proj"), seed=5),
        "wide": dict(rank=16, seed=6),  # past --max-lora-rank
    }
    return {name: make_peft_adapter(model_dir, root / name, **spec) for name, spec in specs.items()}


@pytest.fixture(scope="module")
def server(model_dir, adapters):
    # alpha named, beta by its directory's name
    proc, url = start_server(model_dir, "--lora", f"alpha={adapters['alpha']}", "--lora", str(adapters["beta"]),
                             "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(MAX_RANK), "--allow-lora-loading")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir, adapters):
    names = ("alpha", "beta", "gamma", "epsilon")
    return LLM(model_dir, threads=1, lora_adapters={n: adapters[n] for n in names}, max_loras=len(names))


def greedy(max_tokens: int, lora: str | None = None, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, lora=lora, ignore_eos=ignore_eos)


def load(url: str, name: str, path) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def test_a_request_naming_an_adapter_gets_the_base_model_with_that_adapter(client, reference):
    texts = {}
    for name in ("alpha", "beta", MODEL):
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        want = reference.generate([PROMPT], greedy(16, None if name == MODEL else name, ignore_eos=True))[0]
        assert got.model == name  # vLLM's: the model the request named
        assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids) == 16
        texts[name] = want.token_ids
    assert len({tuple(ids) for ids in texts.values()}) == 3  # each adapter changes the answer, differently


def test_every_api_with_a_model_field_runs_the_adapter(server, client, reference):
    chat = reference.chat(MESSAGES, greedy(12, "alpha")).text
    assert chat != reference.chat(MESSAGES, greedy(12)).text
    got = client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == chat and got.model == "alpha"
    got = client.responses.create(model="alpha", input=MESSAGES[0]["content"], max_output_tokens=12, temperature=0)
    assert got.output_text == chat
    got = httpx.post(f"{server}/v1/messages", json={"model": "alpha", "max_tokens": 12, "temperature": 0,
                                                    "messages": MESSAGES}, timeout=60).json()
    assert got["content"][0]["text"] == chat and got["model"] == "alpha"
    options = {"temperature": 0, "num_predict": 12}
    got = httpx.post(f"{server}/api/chat", json={"model": "alpha", "messages": MESSAGES, "stream": False,
                                                 "options": options}, timeout=60).json()
    assert got["message"]["content"] == chat
    got = httpx.post(f"{server}/api/generate", json={"model": "alpha", "prompt": PROMPT, "raw": True, "stream": False,
                                                     "options": options}, timeout=60).json()
    assert got["response"] == reference.generate([PROMPT], greedy(12, "alpha"))[0].text


def test_models_lists_each_adapter_after_its_base_model(server, client, adapters):
    cards = httpx.get(f"{server}/v1/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "alpha", "beta"]
    assert cards[1] == {"id": "alpha", "object": "model", "created": 0, "owned_by": "churon", "parent": MODEL,
                        "root": str(adapters["alpha"]), "task": "generate"}
    assert cards[2]["parent"] == MODEL and cards[2]["root"] == str(adapters["beta"])
    beta = client.models.retrieve("beta")
    assert beta.id == "beta" and beta.model_extra["parent"] == MODEL
    with pytest.raises(openai.NotFoundError, match="alpha"):  # the 404 names the adapters among the models
        client.models.retrieve("nope")


def test_ollamas_tags_and_show_know_each_adapter_as_a_model(server, adapters):
    tags = {m["name"]: m for m in httpx.get(f"{server}/api/tags", timeout=30).json()["models"]}
    assert {MODEL, "alpha", "beta"} <= set(tags)  # as /api/chat takes the name, an Ollama client lists it
    assert tags["alpha"]["details"]["parent_model"] == MODEL and tags["alpha"]["details"]["adapter"] == str(adapters["alpha"])
    assert len({tags[n]["digest"] for n in (MODEL, "alpha", "beta")}) == 3
    shown = httpx.post(f"{server}/api/show", json={"model": "alpha"}, timeout=30)
    assert shown.status_code == 200, shown.text  # `ollama run alpha` asks for it before it chats
    base = httpx.post(f"{server}/api/show", json={"model": MODEL}, timeout=30).json()
    shown = shown.json()
    assert shown["details"] == tags["alpha"]["details"] and shown["model_info"] == base["model_info"]
    lines = shown["modelfile"].splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("FROM "))
    assert lines[at + 1] == f"ADAPTER {adapters['alpha']}"  # where a Modelfile's ADAPTER goes


def test_an_adapter_loaded_at_run_time_serves_until_it_is_unloaded(server, client, reference, adapters):
    answer = load(server, "gamma", adapters["gamma"])
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'gamma' added successfully."
    try:
        assert [m.id for m in client.models.list()] == [MODEL, "alpha", "beta", "gamma"]
        got = client.completions.create(model="gamma", prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.choices[0].text == reference.generate([PROMPT], greedy(16, "gamma"))[0].text
    finally:
        answer = unload(server, "gamma")
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'gamma' removed successfully."
    assert [m.id for m in client.models.list()] == [MODEL, "alpha", "beta"]
    with pytest.raises(openai.NotFoundError, match="gamma"):
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=4)
    answer = unload(server, "gamma")
    assert answer.status_code == 404 and "gamma" in answer.json()["error"]["message"]


def test_unloading_an_adapter_lets_the_streams_using_it_finish(server, client, reference, adapters):
    assert load(server, "epsilon", adapters["epsilon"]).status_code == 200
    stream = client.completions.create(model="epsilon", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # it runs
    assert unload(server, "epsilon").status_code == 200
    with pytest.raises(openai.NotFoundError, match="epsilon"):  # no new request finds it
        client.completions.create(model="epsilon", prompt=PROMPT, max_tokens=4)
    text += "".join(c.choices[0].text for c in chunks)
    assert text == reference.generate([PROMPT], greedy(LONG, "epsilon", ignore_eos=True))[0].text
    # its slot was freed once the stream ended: the name loads again (beside alpha and beta, at --max-loras 3)
    assert load(server, "epsilon", adapters["epsilon"]).status_code == 200
    assert unload(server, "epsilon").status_code == 200


def test_a_model_loaded_back_gets_its_adapters_again(server, client, reference, adapters, tmp_path):
    gone = shutil.copytree(adapters["gamma"], tmp_path / "gamma")
    assert load(server, "gamma", gone).status_code == 200
    shutil.rmtree(gone)  # before its model loads back: the model serves without it (and logs why)
    stop = httpx.post(f"{server}/api/generate", json={"model": MODEL, "keep_alive": 0}, timeout=60).json()
    assert stop["done_reason"] == "unload"
    assert httpx.get(f"{server}/api/ps", timeout=30).json()["models"] == []
    got = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=16, temperature=0)  # loads it back
    assert got.choices[0].text == reference.generate([PROMPT], greedy(16, "alpha"))[0].text
    assert [m.id for m in client.models.list()] == [MODEL, "alpha", "beta"]
    with pytest.raises(openai.NotFoundError, match="gamma"):
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=4)


def test_bad_loads_are_400s_naming_the_problem(server, adapters, tmp_path):
    def error(answer: httpx.Response, status: int = 400) -> str:
        assert answer.status_code == status, answer.text
        return answer.json()["error"]["message"]

    assert "already been loaded" in error(load(server, "alpha", adapters["delta"]))
    assert "model this server serves" in error(load(server, MODEL, adapters["delta"]))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                                "target_modules": ["q_proj"]}))
    assert "adapter_model.safetensors" in error(load(server, "broken", broken))  # the reader's message
    assert "16" in error(load(server, "wide", adapters["wide"]))  # rank 16 past --max-lora-rank 8
    assert "lora_path" in error(httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=30))
    assert load(server, "gamma", adapters["gamma"]).status_code == 200  # the third of --max-loras 3
    try:
        assert "max_loras" in error(load(server, "delta", adapters["delta"]))
    finally:
        assert unload(server, "gamma").status_code == 200
    assert "nope" in error(unload(server, "nope"), 404)


def test_a_path_with_nothing_there_is_vllms_404_and_loads_no_model(server, tmp_path):
    stop = httpx.post(f"{server}/api/generate", json={"model": MODEL, "keep_alive": 0}, timeout=60).json()
    assert stop["done_reason"] == "unload"
    missing = tmp_path / "missing"
    for path in (missing, tmp_path / ("x" * 300), "nul\x00byte"):  # the last two: no file can have the name
        answer = load(server, "missing", path)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"] == {"message": f"Loading lora missing failed: No adapter found for {path}",
                                          "type": "not_found_error", "param": "lora_path",
                                          "code": "lora_adapter_not_found"}
    # refused before the base model was loaded back for it (a load that could have unloaded others)
    assert httpx.get(f"{server}/api/ps", timeout=30).json()["models"] == []


def test_runtime_loading_is_a_403_without_allow_lora_loading(model_dir, adapters):
    app = create_app(lambda: LLM(model_dir), MODEL)  # never started: the refusal needs no model

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["alpha"])}),
                               ("/v1/unload_lora_adapter", {"lora_name": "a"})):
                answer = await http.post(path, json=body)
                assert answer.status_code == 403 and "--allow-lora-loading" in answer.json()["error"]["message"]

    asyncio.run(main())
