"""Fuzzing the model file readers with atheris (libFuzzer for Python): GGUF files, safetensors shards,
config.json and model.safetensors.index.json. Whatever the bytes, opening the model, building its
tokenizer and reading its weights either works or raises a ChuronError; any other exception is a crash.

The default suite runs the fuzzer for 10,000 inputs from a fixed seed (test_fuzz_briefly: a few seconds,
the same inputs every run, so CI does not pass or fail by chance) from the tiny model's files, and
replays every regression file in tests/data/fuzz. A longer run, from this directory's parent:

    CHURON_FUZZ_BASE=/tmp/churon-fuzz-base python tests/test_fuzz_readers.py \\
        -max_total_time=3600 -rss_limit_mb=4096 -timeout=10 /tmp/churon-fuzz-corpus tests/data/fuzz

(CHURON_FUZZ_BASE is where the tiny model is built on first use; the first corpus directory collects
new inputs.) The first byte of an input picks the file the rest becomes (see TARGETS). A crash is
written as crash-<sha1> in the working directory; `-minimize_crash=1 -runs=10000 crash-<sha1>` shrinks
it. Save it in tests/data/fuzz as <what it broke>.bin (e.g. gguf-tensor-offset-overflow.bin), and fix
the reader: test_fuzz_regression_file replays it from then on.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REGRESSIONS = HERE / "data" / "fuzz"

# an input's first byte % len(TARGETS) -> the file the rest of it becomes
TARGETS = ["model.gguf", "model.safetensors", "config.json", "model.safetensors.index.json"]


class Reader:
    """A model directory and a GGUF path to write fuzzed bytes into, and the check of one input."""

    def __init__(self, base_hf: Path, work: Path):
        self.gguf = work / "model.gguf"
        self.hf = work / "hf"
        if not self.hf.exists():
            shutil.copytree(base_hf, self.hf)
        self.originals = {name: (self.hf / name).read_bytes() for name in ("model.safetensors", "config.json")}

    def check(self, data: bytes) -> None:
        from churon import ChuronError
        from churon.loader import open_model
        from churon.tokenizer import load_tokenizer

        if not data:
            return
        name, data = TARGETS[data[0] % len(TARGETS)], data[1:]
        path = self.gguf if name == "model.gguf" else self.hf / name
        path.write_bytes(data)
        try:
            source = open_model(self.gguf if name == "model.gguf" else self.hf, pull=False)
            source.check_types()
            load_tokenizer(source)
            source.load_weights()
        except ChuronError:
            pass
        finally:
            if name in self.originals:
                (self.hf / name).write_bytes(self.originals[name])
            elif name != "model.gguf":
                path.unlink()


def regression_files() -> list[Path]:
    return sorted(REGRESSIONS.glob("*.bin"))


@pytest.fixture(scope="module")
def reader(tiny_llama_dir, tmp_path_factory):
    return Reader(tiny_llama_dir, tmp_path_factory.mktemp("fuzz"))


@pytest.mark.parametrize("path", regression_files(), ids=lambda p: p.name)
def test_fuzz_regression_file(reader, path):
    reader.check(path.read_bytes())


def write_seeds(corpus: Path, base_gguf: Path, base_hf: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    for target, name in enumerate(TARGETS):
        if name == "model.gguf":
            data = base_gguf.read_bytes()
        elif name == "model.safetensors.index.json":
            data = b'{"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}'
        else:
            data = (base_hf / name).read_bytes()
        (corpus / f"seed-{target}").write_bytes(bytes([target]) + data)


def test_fuzz_briefly(tiny_llama_q8, tiny_llama_dir, tmp_path):
    """10,000 fuzzed inputs (a fixed seed: the same ones every run) from the tiny model's own files: none may
    crash the readers."""
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    write_seeds(corpus, tiny_llama_q8, tiny_llama_dir)
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(tiny_llama_q8, base / "tiny.gguf")
    shutil.copytree(tiny_llama_dir, base / "tiny-llama")
    result = subprocess.run(
        [sys.executable, __file__, "-runs=10000", "-seed=1", "-rss_limit_mb=4096", "-timeout=20", str(corpus)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "CHURON_FUZZ_BASE": str(base)},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    runs = re.search(r"Done (\d+) runs", result.stderr)
    assert runs and int(runs.group(1)) > 100, result.stderr[-2000:]


def main() -> None:
    import atheris

    # the libraries first, uninstrumented: coverage is wanted in churon's own code
    import numpy  # noqa: F401
    import safetensors  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401

    with atheris.instrument_imports(include=["churon"]):
        import churon.loader  # noqa: F401
        import churon.tokenizer  # noqa: F401

    base = Path(os.environ.get("CHURON_FUZZ_BASE") or Path(tempfile.gettempdir()) / "churon-fuzz-base")
    base_gguf, base_hf = base / "tiny.gguf", base / "tiny-llama"
    if not base_gguf.exists():
        sys.path.insert(0, str(HERE))
        from tiny_models import make_hf_model, write_gguf

        make_hf_model("llama", base_hf)
        write_gguf(base_hf, base_gguf, "Q8_0")
    reader = Reader(base_hf, Path(tempfile.mkdtemp(prefix="churon-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)))

    atheris.Setup(sys.argv, reader.check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
