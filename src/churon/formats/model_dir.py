"""The files of a model directory: JSON read so that every failure is a ModelFileError naming the file,
and the file names one file gives for another (a shard, a sentence-transformers module's folder) held
inside the directory."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from churon.errors import ModelFileError


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except OSError as e:  # a directory, no permission, an I/O error: still the model file's fault, named
        raise ModelFileError(f"{path}: cannot read it: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON: {e}") from e
    except RecursionError:
        raise ModelFileError(f"{path}: not valid JSON: nested too deeply") from None


def read_json_object(path: Path) -> dict[str, Any]:
    data = read_json(path)
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def inside(model_dir: Path, name: Any, named_in: str, what: str) -> Path:
    """model_dir / name for a relative name another file gives (named_in: that file and field; what: what
    it names), nowhere else. The check is on the name, not the resolved path: a Hugging Face cache
    snapshot's files are symlinks to its blobs."""
    if not isinstance(name, str):
        raise ModelFileError(f"{named_in} names the {what} {name!r:.80}, which is not a file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
        raise ModelFileError(f"{named_in} names the {what} {name!r}, which is outside the model directory")
    return model_dir / name
