"""A Modelfile's ADAPTER: a created model with a LoRA adapter (a PEFT directory or a GGUF adapter) on its base,
recorded at `churon create` (its path resolved, the adapter read against the base's config), applied to every
request by `churon run` and by the server (/api/generate, /api/chat, OpenAI's routes, for a model loaded on demand
or preloaded). Every answer is checked against LLM(base, lora_adapters={"a": path}) with SamplingParams(lora="a"),
greedy, and differs from the base model's."""

import json
import shutil

import httpx2 as httpx
import ollama
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli import churon
from test_server import start_server, stop_server

from churon import LLM, SamplingParams
from churon import model_store
from churon.errors import ChuronError
from churon.formats.lora import read_lora, write_lora_gguf
from churon.loader import open_model
from churon.modelfile import ModelfileError
from tiny_models import make_peft_adapter

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter") / "lora", seed=1)


@pytest.fixture(scope="module")
def gguf_adapter(adapter, tiny_llama_q8, tmp_path_factory):
    config = open_model(tiny_llama_q8, pull=False).config
    return write_lora_gguf(read_lora(adapter, config), config, tmp_path_factory.mktemp("gguf-adapter") / "lora.gguf")


@pytest.fixture(scope="module")
def llm(tiny_llama_q8, adapter):
    """The reference: the base model with the adapter loaded as "a"."""
    return LLM(tiny_llama_q8, lora_adapters={"a": adapter}, threads=1)


@pytest.fixture
def folder(tmp_path, tiny_llama_q8, adapter, gguf_adapter, monkeypatch):
    """A Modelfile's folder: the base GGUF and both adapters beside it; CHURON_HOME in tmp_path."""
    monkeypatch.setenv("CHURON_HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(tiny_llama_q8, work / "tiny.gguf")
    shutil.copytree(adapter, work / "lora")
    shutil.copy(gguf_adapter, work / "lora.gguf")
    return work


def greedy(llm, ids, n, lora=None):
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, lora=lora), use_tqdm=False)[0]


# --- create: what is recorded ------------------------------------------------------------------------------------


@pytest.mark.parametrize("written", ["./lora", "lora.gguf"])
def test_create_records_the_adapter_resolved_in_the_manifest_and_the_modelfile(folder, written):
    model = model_store.create_model("tuned", f"FROM ./tiny.gguf\nSYSTEM Be brief.\nADAPTER {written}\n", base_dir=folder)
    path = (folder / written).resolve()
    assert model.adapter == path and model.lora_adapters == {model_store.ADAPTER_LORA: path}
    # the canonical Modelfile: ADAPTER by its path, right after FROM, as `ollama show --modelfile` writes it
    assert model.modelfile.splitlines()[:3] == [f"FROM {folder / 'tiny.gguf'}", f"ADAPTER {path}", "SYSTEM Be brief."]
    assert model.recipe.adapter == str(path)
    manifest = model_store.manifests_dir() / "tuned" / "latest.json"
    assert json.loads(manifest.read_text())["adapter"] == str(path)
    assert model_store.get_model("tuned") == model
    assert model_store.resolve("tuned") == (folder / "tiny.gguf", model)


def test_a_model_from_a_created_one_inherits_its_adapter_unless_it_gives_its_own(folder):
    parent = model_store.create_model("parent", "FROM ./tiny.gguf\nADAPTER ./lora\n", base_dir=folder)
    child = model_store.create_model("child", "FROM parent\nSYSTEM S\n", base_dir=folder)
    assert child.adapter == parent.adapter and f"ADAPTER {parent.adapter}\n" in child.modelfile
    over_http = model_store.create_from_fields("fields", {"from": "parent"})  # no path named: the parent's is kept
    assert over_http.adapter == parent.adapter
    other = model_store.create_model("other", "FROM parent\nADAPTER ./lora.gguf\n", base_dir=folder)
    assert other.adapter == (folder / "lora.gguf").resolve()  # one adapter: its own replaces the parent's
    assert model_store.copy_model("parent", "copy").adapter == parent.adapter
    assert model_store.create_model("plain", "FROM ./tiny.gguf\n", base_dir=folder).lora_adapters == {}


# --- create: what is refused -------------------------------------------------------------------------------------


def _wider(adapter, out):
    """The adapter as one for a model of hidden size 128: every A that reads the hidden state twice as wide."""
    shutil.copytree(adapter, out)
    tensors = load_file(out / "adapter_model.safetensors")
    save_file({k: torch.cat([t, t], dim=1) if "lora_A" in k and t.shape[1] == 64 else t for k, t in tensors.items()},
              out / "adapter_model.safetensors")
    return out


def test_bad_adapters_are_the_creates_clear_errors(folder, adapter, tmp_path):
    def refused(modelfile, base_dir=folder):
        with pytest.raises(ModelfileError) as e:
            model_store.create_model("bad", modelfile, base_dir=base_dir)
        return str(e.value)

    missing = refused("FROM ./tiny.gguf\nADAPTER ./nope\n")
    assert missing.startswith("line 2 (ADAPTER): ./nope does not exist: not a file or directory") and \
        str(folder / "nope") in missing
    wider = _wider(adapter, folder / "wider")
    other = refused("FROM ./tiny.gguf\n\nADAPTER ./wider\n")
    assert other.startswith("line 3 (ADAPTER): not a LoRA adapter for") and str(wider / "adapter_model.safetensors") \
        in other and "lora_A.weight' has shape [4, 128]" in other and "takes 64 (hidden_size)" in other
    not_lora = refused("FROM ./tiny.gguf\nADAPTER ./tiny.gguf\n")  # the base model itself
    assert not_lora.startswith("line 2 (ADAPTER): not a LoRA adapter for") and "tiny.gguf" in not_lora
    two = refused("FROM ./tiny.gguf\nADAPTER ./lora\nADAPTER ./lora.gguf\n")
    assert two == "line 3: a second ADAPTER (the first is on line 2); a model takes one LoRA adapter"
    # over HTTP a Modelfile has no folder: an ADAPTER path is not opened on the server, as FROM's is not
    models = model_store.models_dir()
    models.mkdir(parents=True)
    shutil.copy(folder / "tiny.gguf", models / "base.gguf")
    for path in ("./lora", str(folder / "lora"), "../work/lora"):
        http = refused(f"FROM base\nADAPTER {path}\n", base_dir=None)
        assert http.startswith(f"line 2 (ADAPTER): {path} does not exist: not an adapter in the server's cache")
    assert model_store.list_models() == []  # nothing was created


def test_an_adapter_gone_since_is_the_loads_clear_error(folder):
    model_store.create_model("gone", "FROM ./tiny.gguf\nADAPTER ./lora.gguf\n", base_dir=folder)
    (folder / "lora.gguf").unlink()
    with pytest.raises(ChuronError, match=r"gone:latest: its LoRA adapter .*lora\.gguf \(ADAPTER\) no longer exists"):
        model_store.resolve("gone")


# --- churon create / show / run ----------------------------------------------------------------------------------


def test_churon_run_applies_the_adapter_to_every_request(folder, tmp_path, llm):
    home = {"CHURON_HOME": str(tmp_path / "home")}
    (folder / "Modelfile").write_text("FROM ./tiny.gguf\nADAPTER ./lora\nPARAMETER temperature 0\n")
    created = churon("create", "tuned", "-f", folder / "Modelfile", env=home)
    assert created.returncode == 0, created.stderr
    assert str((folder / "lora").resolve()) in created.stdout
    show = churon("show", "tuned", env=home)
    assert show.returncode == 0, show.stderr
    assert any(line.split()[:2] == ["adapter", str((folder / "lora").resolve())] for line in show.stdout.splitlines())
    run = churon("run", "tuned", PROMPT, "--raw", "--max-tokens", "8", "--threads", "1", env=home)
    assert run.returncode == 0, run.stderr
    ids = llm.encode(PROMPT)
    tuned, base = greedy(llm, ids, 8, lora="a"), greedy(llm, ids, 8)
    assert run.stdout == tuned.text + "\n" and tuned.token_ids != base.token_ids
    twice = churon("run", "tuned", PROMPT, "--lora", folder / "lora.gguf", env=home)
    assert twice.returncode != 0 and "tuned:latest has an ADAPTER of its own" in twice.stderr


# --- the server --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_q8, adapter):
    """A server whose CHURON_HOME holds "tuned" (FROM the tiny GGUF, ADAPTER the PEFT adapter), loaded on demand."""
    root = tmp_path_factory.mktemp("served")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHURON_HOME", str(root / "home"))
        model_store.create_model("tuned", f"FROM {tiny_llama_q8}\nADAPTER {adapter}\n", base_dir=root)
        proc, url = start_server(tiny_llama_q8)
        try:
            yield url
        finally:
            stop_server(proc)


def test_the_server_runs_every_request_to_the_model_with_its_adapter(served, llm, adapter):
    client = ollama.Client(host=served)
    messages = [{"role": "user", "content": "hello there"}]
    ids = llm.chat_prompt_ids(messages)
    tuned, base = greedy(llm, ids, 8, lora="a"), greedy(llm, ids, 8)
    assert tuned.token_ids != base.token_ids
    g = client.generate(model="tuned", prompt="hello there", options=GREEDY | {"num_predict": 8})
    assert g.response == tuned.text and list(g.context) == ids + tuned.token_ids
    c = client.chat(model="tuned", messages=messages, options=GREEDY | {"num_predict": 8})
    assert c.message.content == tuned.text
    o = httpx.post(f"{served}/v1/chat/completions", timeout=60,
                   json={"model": "tuned", "messages": messages, "temperature": 0, "max_tokens": 8})
    assert o.status_code == 200 and o.json()["choices"][0]["message"]["content"] == tuned.text
    # the base model, served beside it, answers without it
    b = client.generate(model="tiny", prompt="hello there", options=GREEDY | {"num_predict": 8})
    assert b.response == base.text
    show = client.show("tuned")
    assert f"ADAPTER {adapter.resolve()}\n" in show.modelfile
    details = httpx.post(f"{served}/api/show", json={"model": "tuned"}).json()["details"]
    assert details["adapter"] == str(adapter.resolve())


def test_over_http_an_adapter_path_is_refused(served, adapter):
    r = httpx.post(f"{served}/api/create", json={"model": "x", "modelfile": f"FROM tuned\nADAPTER {adapter}\n"})
    assert r.status_code == 400 and "line 2 (ADAPTER)" in r.json()["error"]
    assert "not an adapter in the server's cache" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=served).create("x", from_="tuned", adapters={"lora.gguf": "sha256:" + "0" * 64})
    assert e.value.status_code == 400 and "ADAPTER" in e.value.error


def test_churon_serve_of_a_created_model_preloads_it_with_its_adapter(tmp_path, folder, llm):
    model_store.create_model("tuned", "FROM ./tiny.gguf\nADAPTER ./lora.gguf\n", base_dir=folder)
    proc, url = start_server("tuned")  # served as "tiny" (--served-model-name)
    try:
        ids = llm.encode(PROMPT)
        r = ollama.Client(host=url).generate(model="tiny", prompt=PROMPT, raw=True, options=GREEDY | {"num_predict": 8})
        assert r.response == greedy(llm, ids, 8, lora="a").text  # the GGUF adapter: the PEFT one's answer
    finally:
        stop_server(proc)
