"""Created models (churon.model_store): names, manifests under $CHURON_HOME, FROM resolution and inheritance."""

import json
import shutil

import pytest

from churon import model_store
from churon.errors import ChuronError
from churon.modelfile import ModelfileError
from churon.registry import REGISTRY, models_dir

LLAMA3_GO = '''{{ if .System }}<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>{{ end }}{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>

{{ .Prompt }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>

{{ .Response }}<|eot_id|>'''


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHURON_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def weights(tmp_path, tiny_llama_q8):
    """A Modelfile's folder with a GGUF beside it."""
    folder = tmp_path / "work"
    folder.mkdir()
    shutil.copy(tiny_llama_q8, folder / "tiny.gguf")
    return folder


def test_names_are_ollamas_with_latest_as_the_default_tag():
    assert model_store.check_name("mario") == "mario:latest"
    assert model_store.check_name("me/mario_2.1-x:v1.0") == "me/mario_2.1-x:v1.0"


@pytest.mark.parametrize("name, message", [
    ("", "a name is needed"),
    ("../x", "'..' is not allowed"),
    ("a/../../x", "'..' is not allowed"),
    ("/x", "a name is not a path"),
    ("a\\b", "a name is not a path"),
    ("x" * 201, "201 characters, more than 200"),
    ("a b", "must be parts of letters, digits"),
    (".hidden", "must be parts of letters, digits"),
    ("a:b:c", "must be parts of letters, digits"),
])
def test_names_that_are_not_ollamas_or_leave_the_store_are_refused(name, message):
    with pytest.raises(ValueError) as e:
        model_store.check_name(name)
    assert message in str(e.value) and "model name" in str(e.value)


def test_a_created_model_is_a_small_manifest_beside_the_weights(home, weights):
    text = f"FROM ./tiny.gguf\nSYSTEM Be brief.\nPARAMETER temperature 0\nPARAMETER num_ctx 128\nTEMPLATE \"\"\"{LLAMA3_GO}\"\"\"\n" \
           "MESSAGE user hi\nMESSAGE assistant hello\nLICENSE MIT\n"
    model = model_store.create_model("mario", text, base_dir=weights)
    assert model.name == "mario:latest" and model.base == "./tiny.gguf" and model.base_path == weights / "tiny.gguf"
    assert model.system == "Be brief." and model.parameters == {"temperature": 0.0, "num_ctx": 128}
    assert model.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert model.license == "MIT"
    assert "{% macro _turn" in model.template and model.recipe.template == LLAMA3_GO  # stored as Jinja, shown as written
    assert model.modelfile.startswith(f"FROM {weights / 'tiny.gguf'}\n")  # the canonical text names the base's path
    files = [p for p in (home / "manifests").rglob("*") if p.is_file()]
    assert files == [home / "manifests" / "mario" / "latest.json"]  # one manifest, no copy of the weights, no .part left
    assert json.loads(files[0].read_text())["base_path"] == str(weights / "tiny.gguf")
    assert model_store.get_model("mario") == model_store.get_model("mario:latest") == model
    assert model_store.resolve("mario") == (weights / "tiny.gguf", model)
    assert model_store.resolve(str(weights / "tiny.gguf")) == (weights / "tiny.gguf", None)  # a path: no created model


def test_from_a_registry_name_uses_its_cached_file(home, tiny_llama_q8):
    entry = REGISTRY["smollm2-135m"]
    models_dir().mkdir(parents=True)
    shutil.copy(tiny_llama_q8, models_dir() / entry.filename)  # as `churon pull` leaves it: no download
    model = model_store.create_model("small", "FROM smollm2\n", base_dir=home)
    assert model.base == "smollm2" and model.base_path == models_dir() / entry.filename


def test_from_a_created_model_inherits_its_base_and_recipe(home, weights):
    model_store.create_model("parent", "FROM ./tiny.gguf\nSYSTEM S\nPARAMETER temperature 0.5\nPARAMETER top_k 3\n"
                             "PARAMETER stop a\nMESSAGE user m\n", base_dir=weights)
    child = model_store.create_model("child:v2", "FROM parent\nPARAMETER top_k 7\nTEMPLATE {{ .Prompt }}\n",
                                     base_dir=weights)
    assert child.base == "parent" and child.base_path == weights / "tiny.gguf"
    assert child.system == "S" and child.parameters == {"temperature": 0.5, "top_k": 7, "stop": ["a"]}
    assert child.messages == [{"role": "user", "content": "m"}] and child.recipe.template == "{{ .Prompt }}"
    grandchild = model_store.create_model("grandchild", "FROM child:v2\nSYSTEM S3\n", base_dir=home)
    assert grandchild.system == "S3" and grandchild.template == child.template
    # the canonical Modelfile creates the same model from anywhere
    again = model_store.create_model("again", child.modelfile, base_dir=home)
    assert (again.base_path, again.system, again.parameters, again.template, again.messages) == \
        (child.base_path, child.system, child.parameters, child.template, child.messages)


def test_a_from_that_does_not_exist_is_named_with_its_line(home, weights):
    with pytest.raises(ModelfileError) as e:
        model_store.create_model("x", "# base\nFROM ./missing.gguf\n", base_dir=weights)
    assert "line 2 (FROM): ./missing.gguf does not exist" in str(e.value) and str(weights / "missing.gguf") in str(e.value)
    with pytest.raises(ModelfileError, match="line 1 \\(FROM\\): nosuchmodel does not exist: .* a created model or a"
                                             " registry model"):
        model_store.create_model("x", "FROM nosuchmodel\n", base_dir=weights)
    (weights / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelfileError, match="line 1 \\(FROM\\): ./junk.gguf: not a model churon can load"):
        model_store.create_model("x", "FROM ./junk.gguf\n", base_dir=weights)
    assert model_store.list_models() == []


def test_api_fields_create_the_same_model_as_the_modelfile(home, weights):
    path = str(weights / "tiny.gguf")
    by_text = model_store.create_model("a", f"FROM {path}\nSYSTEM Be brief.\nPARAMETER temperature 0\nPARAMETER stop x\n"
                                       f"PARAMETER stop y\nTEMPLATE \"\"\"{LLAMA3_GO}\"\"\"\nMESSAGE user hi\nLICENSE MIT\n",
                                       base_dir=home)
    by_fields = model_store.create_from_fields("b", {
        "from": path, "system": "Be brief.", "parameters": {"temperature": 0, "stop": ["x", "y"]}, "template": LLAMA3_GO,
        "messages": [{"role": "user", "content": "hi"}], "license": ["MIT"]}, base_dir=home)
    for field in ("base", "base_path", "system", "parameters", "template", "messages", "license", "modelfile"):
        assert getattr(by_fields, field) == getattr(by_text, field), field


@pytest.mark.parametrize("fields, message", [
    ({"from": "a", "files": {}}, "files: not a field churon creates a model from"),
    ({"system": "x"}, "from: None: the base model"),
    ({"from": "{path}", "parameters": {"temperature": "hot"}}, "parameters: temperature='hot': must be a number"),
    ({"from": "{path}", "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role: 'bot'"),
    ({"from": "{path}", "messages": [{"role": "user"}]}, "messages[0].content: None: must be a string"),
    ({"from": "{path}", "template": "ok\n{{ .Tools }}"}, "line 2 (template): {{ .Tools }}: .Tools is not supported"),
    ({"from": "nosuchmodel"}, "from: nosuchmodel does not exist"),
])
def test_bad_fields_are_named(home, weights, fields, message):
    if fields.get("from") == "{path}":
        fields = {**fields, "from": str(weights / "tiny.gguf")}
    with pytest.raises(ModelfileError) as e:
        model_store.create_from_fields("x", fields)
    assert message in str(e.value)


def test_list_copy_and_remove(home, weights, tiny_llama_q8):
    model_store.create_model("b/one", "FROM ./tiny.gguf\nSYSTEM one\n", base_dir=weights)
    copy = model_store.copy_model("b/one", "a:copy")
    assert copy.system == "one" and copy.base_path == weights / "tiny.gguf"
    plain = model_store.copy_model(str(tiny_llama_q8), "plain")  # not a created model: one FROM it, nothing changed
    assert plain.base_path == tiny_llama_q8 and plain.system is None and plain.parameters == {}
    assert [m.name for m in model_store.list_models()] == ["a:copy", "b/one:latest", "plain:latest"]
    model_store.remove_model("b/one")
    assert not (home / "manifests" / "b").exists()  # the folder its name made is gone with it
    assert [m.name for m in model_store.list_models()] == ["a:copy", "plain:latest"]
    with pytest.raises(model_store.ModelNotFoundError, match="b/one: no created model of this name"):
        model_store.remove_model("b/one")
    with pytest.raises(ValueError, match="'..' is not allowed"):
        model_store.copy_model("a:copy", "../x")
    assert (weights / "tiny.gguf").exists()  # the base stays


def test_a_broken_manifest_or_a_vanished_base_is_named(home, weights, caplog):
    model_store.create_model("good", "FROM ./tiny.gguf\n", base_dir=weights)
    bad = home / "manifests" / "bad" / "latest.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    with pytest.raises(ChuronError, match="bad/latest.json: not a readable created-model manifest"):
        model_store.get_model("bad")
    assert [m.name for m in model_store.list_models()] == ["good:latest"] and "bad/latest.json" in caplog.text
    (weights / "tiny.gguf").unlink()
    with pytest.raises(ChuronError, match="good:latest: its base model .*tiny.gguf \\(FROM ./tiny.gguf\\) no longer exists"):
        model_store.resolve("good")


def test_without_a_base_dir_from_names_a_model_never_a_path(home, weights):
    """What /api/create passes: a client names models, it does not open the server's files."""
    with pytest.raises(ModelfileError, match="not a model in the server's cache"):
        model_store.create_from_fields("c", {"from": str(weights / "tiny.gguf")})
    with pytest.raises(ModelfileError, match="not a model in the server's cache"):
        model_store.create_model("c", "FROM ../tiny.gguf\n", base_dir=None)
