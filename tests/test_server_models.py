"""Many models in one server: loaded when a request names them (the models of a temporary $CHURON_HOME), weighed
against the memory budget (the least recently used idle one unloaded, its figures logged), keep_alive, concurrent
requests for a model that is loading, a model whose file is broken; `churon serve` with no model."""

import asyncio
import logging
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx2 as httpx
import pytest
import torch
from gguf import GGMLQuantizationType
from test_server import free_port, loaded_client, stop_server
from tiny_models import make_hf_model, write_gguf

from churon import LLM, SamplingParams, kernels
from churon.config import EngineConfig
from churon.engine.kv_cache import kv_bytes_per_token
from churon.engine.memory import MemoryPlan, activation_bytes, plan_share
from churon.formats.tensor_info import TensorInfo
from churon.loader import open_model
from churon.server import create_app
from churon.server.catalog import ModelCatalog
from churon.server.keep_alive import parse_keep_alive
from churon.server.state import ModelPolicy

KV = 1 << 18  # each text model's KV cache, fixed so its size does not depend on the budget's share
OPTIONS = {"kv_cache_memory": KV, "max_num_seqs": 2}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Three tiny text models (a and c alike, b another architecture) and an embedding model, as GGUF files."""
    out = tmp_path_factory.mktemp("files")
    qwen = make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))
    llama = make_hf_model("llama", tmp_path_factory.mktemp("llama"))
    return {"a": write_gguf(qwen, out / "a.gguf", "Q8_0"), "b": write_gguf(llama, out / "b.gguf", "Q8_0"),
            "c": write_gguf(qwen, out / "c.gguf", "Q8_0")}


@pytest.fixture
def home(tmp_path, monkeypatch, files):
    """A $CHURON_HOME whose models directory holds a, b and c."""
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    for name, path in files.items():
        shutil.copy(path, models / f"{name}.gguf")
    monkeypatch.setenv("CHURON_HOME", str(tmp_path / "home"))
    return models


class CountingCatalog(ModelCatalog):
    """The catalog, counting the loads of each model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loads: dict[str, int] = {}

    def load(self, plan, pooling=None):
        self.loads[plan.name] = self.loads.get(plan.name, 0) + 1
        return super().load(plan, pooling)


def catalog() -> CountingCatalog:
    return CountingCatalog(1 << 40, threads=1, engine_options=OPTIONS)


def size(name: str) -> int:
    """What the model will hold, by hand: its file, the planner's activations, the whole KV blocks of KV bytes."""
    path = catalog()._cached()[name]
    config = open_model(path, pull=False).config
    block = 16 * kv_bytes_per_token(config, torch.float32)
    return path.stat().st_size + activation_bytes(config, EngineConfig(**OPTIONS)) + KV // block * block


def app_with(cat: ModelCatalog, memory: int = 1 << 40, **policy):
    return create_app(catalog=cat, policy=ModelPolicy(memory, **policy))


def complete(http, model: str, prompt: str = "hello", **body):
    return http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **body})


def greedy(path, prompt: str = "hello") -> str:
    llm = LLM(path, threads=1, **OPTIONS)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].text


def loaded(app) -> list[str]:
    return [m.name for m in app.state.server.loaded()]


# --- on demand -------------------------------------------------------------------------------------


def test_two_models_load_on_demand_and_answer_as_their_files_do(home):
    app = app_with(catalog())

    async def main():
        async with loaded_client(app) as http:
            before = (await http.get("/v1/models")).json()["data"]
            a = await complete(http, "a")
            b = await complete(http, "b:latest")  # Ollama's tag for the name as it is
            return before, a, b, (await http.get("/v1/models")).json()["data"]

    before, a, b, after = asyncio.run(main())
    assert [(m["id"], m["loaded"]) for m in before] == [("a", False), ("b", False), ("c", False)]
    assert a.status_code == 200 and a.json()["choices"][0]["text"] == greedy(home / "a.gguf") and a.json()["model"] == "a"
    assert b.status_code == 200 and b.json()["choices"][0]["text"] == greedy(home / "b.gguf") and b.json()["model"] == "b"
    # the loaded ones first, the most recently used first, with when they unload (the default keep_alive, 5m)
    assert [(m["id"], m["loaded"]) for m in after] == [("b", True), ("a", True), ("c", False)]
    assert after[0]["task"] == "generate" and after[0]["max_model_len"] == 256
    assert all(time.time() + 200 < m["expires_at"] <= time.time() + 300 for m in after[:2])
    assert set(after[2]) == {"id", "object", "created", "owned_by", "loaded", "task"} and after[2]["task"] == "generate"


def test_a_third_model_that_does_not_fit_unloads_the_least_recently_used_idle_one(home, caplog):
    sizes = {name: size(name) for name in "abc"}
    budget = sizes["a"] + sizes["b"] + sizes["c"] // 2  # two fit, not three
    cat = catalog()
    app = app_with(cat, budget)

    async def main():
        async with loaded_client(app) as http:
            answers = [await complete(http, name) for name in "abc"]
            counted = {m.name: m.size_bytes for m in app.state.server.loaded()}
            return answers, loaded(app), counted, await http.get("/v1/models")

    with caplog.at_level(logging.INFO, logger="churon.server"):
        answers, after, counted, models = asyncio.run(main())
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert counted == {"b": sizes["b"], "c": sizes["c"]}
    lines = [r.getMessage() for r in caplog.records if "unloading the least recently used idle" in r.getMessage()]
    assert len(lines) == 1
    m = re.match(r"loading 'c' needs (\d+) bytes: (\d+) of the budget of (\d+) bytes \(--models-memory\) are in use by 2"
                 r" models \(at most 3, --max-loaded-models\); unloading the least recently used idle: 'a' \((\d+) bytes\)$",
                 lines[0])
    assert m, lines[0]
    assert [int(x) for x in m.groups()] == [sizes["c"], sizes["a"] + sizes["b"], budget, sizes["a"]]
    assert after == ["c", "b"] and [(d["id"], d["loaded"]) for d in models.json()["data"]][-1] == ("a", False)
    assert cat.loads == {"a": 1, "b": 1, "c": 1}


def test_max_loaded_models_unloads_the_least_recently_used_one(home):
    app = app_with(catalog(), max_loaded=2)

    async def main():
        async with loaded_client(app) as http:
            for name in "abac":  # a used after b: b goes for c
                assert (await complete(http, name)).status_code == 200
            return loaded(app)

    assert asyncio.run(main()) == ["c", "a"]


def test_when_nothing_idle_can_go_the_load_is_a_503_until_a_model_is_released(home):
    app = app_with(catalog(), size("a") + size("c") // 2, fit_timeout=0)

    async def main():
        async with loaded_client(app) as http:
            state = app.state.server
            held = await state.acquire("a", "generate")  # a request still running on a
            busy = await complete(http, "c")
            state.release(held)
            return busy, await complete(http, "c"), loaded(app)

    busy, later, after = asyncio.run(main())
    assert busy.status_code == 503, busy.text
    error = busy.json()["error"]
    assert error["code"] == "models_busy" and error["param"] == "model"
    assert error["message"].startswith(f"no room for the model 'c' ({size('c')} bytes): {size('a')} of the budget of")
    assert "by models serving requests ('a'" in error["message"] and busy.headers["retry-after"] == "5"
    assert later.status_code == 200 and after == ["c"]


def test_a_model_larger_than_the_whole_budget_is_a_503_naming_both(home):
    app = app_with(catalog(), size("a") - 1)

    async def main():
        async with loaded_client(app) as http:
            return await complete(http, "a")

    r = asyncio.run(main())
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_too_large"
    assert r.json()["error"]["message"] == (f"the model 'a' needs {size('a')} bytes, more than this server's budget of"
                                            f" {size('a') - 1} bytes for all its models (--models-memory)")


# --- keep_alive ----------------------------------------------------------------------------------


def test_keep_alive_0_unloads_once_the_request_is_done(home):
    app = app_with(catalog())

    async def main():
        async with loaded_client(app) as http:
            state = app.state.server
            served = await state.acquire("a", "generate", keep_alive=0)
            during = loaded(app)
            state.release(served)
            after = loaded(app)
            assert (await complete(http, "b")).status_code == 200
            state.unload("b")  # Ollama's keep_alive 0 with no prompt
            return during, after, loaded(app), (await http.get("/v1/models")).json()["data"]

    during, after, unloaded, models = asyncio.run(main())
    assert during == ["a"] and after == [] and unloaded == []
    assert all(not m["loaded"] for m in models)


def test_keep_alive_1s_expires_and_the_next_request_loads_it_back(home):
    cat = catalog()
    app = app_with(cat)

    async def main():
        async with loaded_client(app) as http:
            state = app.state.server
            served = await state.acquire("a", "generate", keep_alive=parse_keep_alive("1s"))
            state.release(served)
            released = time.time()
            expires_at = served.expires_at
            deadline = time.monotonic() + 30
            while loaded(app) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            gone = loaded(app)
            return released, expires_at, gone, await complete(http, "a"), served

    released, expires_at, gone, again, served = asyncio.run(main())
    assert released - 0.5 < expires_at - 1 <= released and gone == []
    assert again.status_code == 200 and cat.loads == {"a": 2}
    assert served.keep_alive == 1.0


def test_a_request_without_keep_alive_takes_the_servers_and_a_negative_one_keeps_it(home):
    app = app_with(catalog(), keep_alive=60.0)

    async def main():
        async with loaded_client(app) as http:
            state = app.state.server
            kept = await state.acquire("a", "generate", keep_alive=parse_keep_alive(-1))
            state.release(kept)
            assert (await complete(http, "b")).status_code == 200
            return kept, state._loaded["b"]

    kept, b = asyncio.run(main())
    assert kept.keep_alive == math.inf and kept.expires_at is None
    assert b.keep_alive == 60.0 and time.time() < b.expires_at <= time.time() + 60


@pytest.mark.parametrize("value,seconds", [
    (300, 300.0), (2.5, 2.5), (0, 0.0), ("0", 0.0), ("5m", 300.0), ("30s", 30.0), ("1h", 3600.0), ("1h30m", 5400.0),
    ("500ms", 0.5), ("1.5m", 90.0), ("300", 300.0), (-1, math.inf), ("-1m", math.inf), ("-1", math.inf), (None, None),
])
def test_keep_alive_durations_as_ollama_reads_them(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["5x", "", "m", "5m3", "five minutes", True, [5], float("nan")])
def test_a_keep_alive_that_does_not_parse_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=r"^keep_alive=.*(not a duration; )?give seconds \(300\), a duration"):
        parse_keep_alive(value)


# --- loading -------------------------------------------------------------------------------------


def test_concurrent_requests_for_a_model_that_is_loading_share_one_load(home):
    prompts = ["hello", "hi", "hey", "hello"]
    gate = threading.Event()  # the load goes on once every request waits for it

    class GatedCatalog(CountingCatalog):
        def load(self, plan, pooling=None):
            assert gate.wait(30)
            return super().load(plan, pooling)

    cat = GatedCatalog(1 << 40, threads=1, engine_options=OPTIONS)
    app = app_with(cat)

    async def main():
        async with loaded_client(app) as http:
            state = app.state.server
            requests = [asyncio.ensure_future(complete(http, "a", p)) for p in prompts]
            while state._waiters.get("a", 0) < len(prompts):
                await asyncio.sleep(0.01)
            gate.set()
            answers = await asyncio.gather(*requests)
            return answers, [m.in_flight for m in state.loaded()]

    answers, in_flight = asyncio.run(main())
    assert [r.status_code for r in answers] == [200] * 4
    assert [r.json()["choices"][0]["text"] for r in answers] == [greedy(home / "a.gguf", p) for p in prompts]
    assert cat.loads == {"a": 1}
    assert in_flight == [0]  # every request released it


def test_a_broken_model_is_that_requests_503_and_the_server_goes_on(home):
    (home / "broken.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    cat = catalog()
    app = app_with(cat)

    async def main():
        async with loaded_client(app) as http:
            broken = await asyncio.gather(complete(http, "broken"), complete(http, "broken"))
            fine = await complete(http, "a")
            again = await complete(http, "broken")
            return broken, fine, again, await http.get("/health")

    broken, fine, again, health = asyncio.run(main())
    for r in [*broken, again]:  # each attempt its own error: the next request tries again
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "model_load_failed" and error["param"] == "model"
        assert error["message"].startswith("loading the model 'broken' failed: ") and "broken.gguf" in error["message"]
    assert fine.status_code == 200 and health.status_code == 200
    assert app.state.server._waiters == {} and app.state.server._loading == {}


def test_names_that_are_not_models_of_the_store_are_404s(home):
    app = app_with(catalog())

    async def main():
        async with loaded_client(app) as http:
            return [await complete(http, name) for name in ["nope", str(home / "a.gguf"), "smollm2-135m"]]

    unknown, path, not_pulled = asyncio.run(main())
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == (
        "the model 'nope' does not exist: this server serves 'a' and 'b' and 'c'")
    assert path.status_code == 404  # a path is never opened for a request
    assert not_pulled.status_code == 404 and not_pulled.json()["error"]["message"] == (
        "the model 'smollm2-135m' is not pulled yet: `churon pull smollm2-135m` (or POST /api/pull)")


def test_a_created_model_loads_by_its_name_with_its_num_ctx(home):
    from churon.model_store import create_model

    create_model("mario", "FROM ./a.gguf\nSYSTEM be brief\nPARAMETER num_ctx 64\n", base_dir=home)
    app = app_with(catalog())

    async def main():
        async with loaded_client(app) as http:
            r = await complete(http, "mario")
            served = app.state.server.loaded()[0]
            return r, served.name, served.created, served.llm.max_model_len, (await http.get("/v1/models")).json()["data"]

    r, name, created, max_model_len, models = asyncio.run(main())
    assert r.status_code == 200 and r.json()["model"] == "mario:latest"
    assert name == "mario:latest" and created.system == "be brief" and max_model_len == 64
    assert [m["id"] for m in models] == ["mario:latest", "a", "b", "c"]


def test_a_preloaded_model_is_served_beside_the_store_and_kept(home, files):
    llm = LLM(files["a"], threads=1)
    app = create_app(lambda: llm, "tiny", catalog=catalog(), policy=ModelPolicy(1 << 40))

    async def main():
        async with loaded_client(app) as http:
            default = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            return default, await complete(http, "b"), (await http.get("/v1/models")).json()["data"]

    default, b, models = asyncio.run(main())
    assert default.json()["model"] == "tiny" and b.status_code == 200
    assert [(m["id"], m["loaded"], m.get("expires_at")) for m in models][1:] == [
        ("tiny", True, None), ("a", False, None), ("c", False, None)]


# --- the memory plan of a share ------------------------------------------------------------------


def test_the_catalog_weighs_the_greedy_logits_copy(files, monkeypatch):
    # a text model whose Q8_0 output matrix gets a coarse copy once it generates (native kernels) is weighed with it;
    # on the reference kernels, or as an embedder, without (the tiny model's matrix is small: the threshold lowered)
    from churon.model import native_backend

    def plan(**options):
        return ModelCatalog(1 << 40, threads=1, engine_options=OPTIONS, **options).plan("b", files["b"])

    before = plan()
    monkeypatch.setattr(native_backend, "COARSE_ARGMAX_BYTES", 0)
    cpu = kernels.cpu
    if cpu is None:  # no native kernels: nothing to copy
        assert native_backend.coarse_copy_bytes(open_model(files["b"], pull=False)) == 0
        return
    was = cpu.isa()
    for isa in cpu.available_isas():
        cpu.set_isa(isa)  # an ISA without the coarse kernel (AVX2, scalar) builds no copy: the catalog counts none
        try:
            copy = native_backend.coarse_copy_bytes(open_model(files["b"], pull=False))
            assert (copy > 0) == cpu.coarse_argmax() == (isa in ("avx512", "amx")), isa
            assert plan().resident_bytes == before.resident_bytes + copy, isa
            assert plan(kernels="reference").resident_bytes == before.resident_bytes
            if cpu.coarse_argmax():  # an output matrix of rows not a multiple of 16: the last group's copy is padded
                rows, cols = 16 * 70 + 5, 64
                n_bytes = rows * cols // 32 * 34
                matrix = cpu.QMatrix(bytes(n_bytes), int(GGMLQuantizationType.Q8_0), rows, cols)
                size = matrix.nbytes
                assert matrix.prepare_argmax()
                source = open_model(files["b"], pull=False)
                name = "token_embd.weight" if source.config.tie_word_embeddings else "output.weight"
                odd = SimpleNamespace(config=source.config, tensors=[TensorInfo(name, (rows, cols), "Q8_0", n_bytes)])
                assert native_backend.coarse_copy_bytes(odd) == matrix.nbytes - size
                flat = SimpleNamespace(config=source.config, tensors=[TensorInfo(name, (rows * cols,), "Q8_0", n_bytes)])
                assert native_backend.coarse_copy_bytes(flat) == 0  # a lying file: no crash here, no copy counted
        finally:
            cpu.set_isa(was)


def test_plan_share_gives_the_kv_cache_what_the_weights_leave_within_bounds(files):
    config = open_model(files["a"], pull=False).config
    engine = EngineConfig(max_num_seqs=2)
    per_token = kv_bytes_per_token(config, torch.float32)
    block, act, ctx = 16 * per_token, activation_bytes(config, engine), config.context_length

    def blocks(share):
        return plan_share(config, 1000, engine, ctx, torch.float32, share).num_blocks

    assert blocks(1000 + act + 5 * block + 1) == max(5, -(-ctx // 16))  # at least one full context
    assert blocks(1 << 40) == -(-2 * ctx // 16)  # at most max_num_seqs full contexts
    assert blocks(1000 + act + (ctx // 16 + 3) * block) == ctx // 16 + 3
    plan = plan_share(config, 1000, EngineConfig(kv_cache_memory=7 * block + 1), ctx, torch.float32, 1)
    assert isinstance(plan, MemoryPlan) and plan.num_blocks == 7 and plan.total_bytes == 1000 + plan.activation_bytes + 7 * block


# --- churon serve ---------------------------------------------------------------------------------


def test_churon_serve_without_a_model_serves_the_store(home):
    port = free_port()
    cmd = [sys.executable, "-m", "churon.cli", "serve", "--port", str(port), "--threads", "1", "--log-level", "warning",
           "--keep-alive", "2m", "--max-loaded-models", "2", "--kv-cache-memory", str(KV), "--max-num-seqs", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"model": "c", "prompt": "hello", "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(home / "c.gguf")
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["loaded"]) for m in models] == [("c", True), ("a", False), ("b", False)]
        assert time.time() + 60 < models[0]["expires_at"] <= time.time() + 120
    finally:
        stop_server(proc)


def test_churon_serve_refuses_a_keep_alive_that_does_not_parse(home):
    r = subprocess.run([sys.executable, "-m", "churon.cli", "serve", "--keep-alive", "5 minutes"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("churon: error: --keep-alive='5 minutes': not a duration; give seconds (300)")


def test_a_request_for_the_other_task_is_a_400_before_any_load(home):
    """/v1/embeddings naming a text model that is not loaded: its header says so, nothing is loaded (a load could
    have unloaded another user's idle model)."""
    cat = catalog()
    app = app_with(cat)

    async def main():
        async with loaded_client(app) as http:
            return await http.post("/v1/embeddings", json={"model": "a", "input": "hello"})

    r = asyncio.run(main())
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_task_mismatch"
    assert cat.loads == {}
