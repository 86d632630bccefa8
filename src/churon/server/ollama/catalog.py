"""What this server has: GET /api/tags (every model it can serve: cached, registry-pulled, created),
POST /api/show (one model's recipe and architecture), GET /api/ps (the models loaded now), GET /api/version.

A created model is described by its base model's files, with its own name, a digest of its recipe and its
Modelfile, SYSTEM, TEMPLATE and PARAMETERs; details.parent_model names its FROM, details.adapter (churon's: Ollama's
details have no such field) the path of its ADAPTER. A LoRA adapter the server serves by name (`--lora`,
/v1/load_lora_adapter) is listed and shown as its base model with that adapter: parent_model the base model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends

from churon.server.offload import off_loop
from churon import model_store
from churon.server.lora import ServedAdapter
from churon.server.ollama.errors import model_not_found
from churon.server.ollama.model_info import ModelFiles, capabilities, describe
from churon.server.ollama.protocol import ShowRequest
from churon.server.state import ServerState, server_state

log = logging.getLogger("churon.server")

router = APIRouter()

# the expires_at of a model kept loaded for good, as Ollama shows keep_alive -1
FOREVER = "2318-01-01T00:00:00Z"


@dataclasses.dataclass
class Entry:
    name: str
    path: Path
    created: Any  # CreatedModel | None
    files: ModelFiles
    lora: ServedAdapter | None = None  # when `name` is a LoRA adapter's, on the model the rest describes

    @property
    def digest(self) -> str:
        if self.lora is not None:  # another model than its base: a digest of its own
            return f"sha256:{hashlib.sha256(f'{self.files.digest} {self.lora.path}'.encode()).hexdigest()}"
        if self.created is None:
            return self.files.digest
        recipe = json.dumps(dataclasses.asdict(self.created), sort_keys=True, default=str)
        return f"sha256:{hashlib.sha256(recipe.encode()).hexdigest()}"

    @property
    def details(self) -> dict[str, Any]:
        if self.lora is not None:
            return self.files.details | {"parent_model": self.lora.base, "adapter": self.lora.path}
        if self.created is None:
            return self.files.details
        adapter = {"adapter": str(self.created.adapter)} if self.created.adapter is not None else {}
        return self.files.details | {"parent_model": self.created.base} | adapter

    @property
    def modified_at(self) -> str:
        stamp = self.created.created_at if self.created is not None else self.path.stat().st_mtime
        return rfc3339(stamp)


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")


def entry(state: ServerState, name: str) -> Entry:
    """The model `name` and its files: loaded, created, or in the server's catalog (a cached registry model or
    file), or a LoRA adapter's (its base model's files). Reads and hashes them: runs off the event loop."""
    lora = state.adapters.get(name)
    if lora is not None:  # as /api/chat and /api/generate take its name: a model to an Ollama client too
        return dataclasses.replace(entry(state, lora.base), name=name, lora=lora)
    served = next((m for m in state.loaded() if m.name == name), None)
    created = served.created if served is not None else model_store.get_model(name)
    if created is not None:
        path = created.base_path
    elif served is not None:
        path = Path(served.llm.source.path)
    else:
        found = state.catalog.find(name) if state.catalog is not None else None
        if found is None:
            raise model_not_found(name)
        path = state.catalog.plan(found).path
    return Entry(name, path, created, describe(path))


def names(state: ServerState) -> list[str]:
    """Every model this server can serve: loaded, preloaded, in its catalog, created; its LoRA adapters."""
    return list(dict.fromkeys(state.available() + [m.name for m in model_store.list_models()] + list(state.adapters)))


def _listed(state: ServerState, name: str) -> dict[str, Any]:
    e = entry(state, name)
    return {"name": name, "model": name, "modified_at": e.modified_at, "size": e.files.size, "digest": e.digest,
            "details": e.details}


def _listed_or_none(state: ServerState, name: str) -> dict[str, Any] | None:
    try:
        return _listed(state, name)
    except Exception as e:  # one unreadable file (or a created model whose base is gone) is not the listing's error
        log.warning("/api/tags: leaving out %r: %s", name, e)
        return None


@router.get("/api/tags")
async def tags(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    listed = [await off_loop(_listed_or_none, state, name) for name in names(state)]
    return {"models": [m for m in listed if m is not None]}


def _parameters_text(parameters: dict[str, Any]) -> str:
    """A Modelfile's PARAMETER lines as Ollama's show prints them: name, padding, value; a list one line each."""
    lines = []
    for name, value in parameters.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"{name:<30} {json.dumps(v) if isinstance(v, str) else v}")
    return "\n".join(lines)


def _modelfile(e: Entry) -> str:
    if e.created is not None:
        text = e.created.modelfile
    else:
        template = f'TEMPLATE """{e.files.chat_template}"""\n' if e.files.chat_template else ""
        text = f"# Modelfile generated by churon for {e.name}\nFROM {e.path}\n{template}"
    if e.lora is None:
        return text
    # the adapter a request naming it runs with, in place of any ADAPTER of its base (a request runs with one)
    lines = [line for line in text.splitlines() if not line.startswith("ADAPTER ")]
    at = next(i for i, line in enumerate(lines) if line.startswith("FROM ")) + 1
    return "\n".join(lines[:at] + [f"ADAPTER {e.lora.path}"] + lines[at:]) + "\n"


def _show(state: ServerState, name: str) -> dict[str, Any]:
    e = entry(state, name)
    created = e.created
    template = created.template if created is not None and created.template is not None else e.files.chat_template
    out = {"modelfile": _modelfile(e), "parameters": _parameters_text(created.parameters if created else {}),
           "template": template or "", "details": e.details, "model_info": e.files.model_info,
           "capabilities": capabilities(e.files, template), "modified_at": e.modified_at}
    if created is not None and created.system is not None:
        out["system"] = created.system
    if created is not None and created.license is not None:
        out["license"] = created.license
    if created is not None and created.messages:
        out["messages"] = created.messages
    return out


@router.post("/api/show")
async def show(body: ShowRequest, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    return await off_loop(_show, state, body.model)


def _running(state: ServerState) -> list[dict[str, Any]]:
    out = []
    for served in state.loaded():
        e = entry(state, served.name)
        expires = served.expires_at
        out.append({"name": served.name, "model": served.name, "size": served.size_bytes,
                    "digest": e.digest, "details": e.details,
                    # a model kept for good shows a far date, as Ollama's keep_alive -1 does
                    "expires_at": rfc3339(expires) if expires is not None else FOREVER, "size_vram": 0,
                    "context_length": served.llm.max_model_len if served.task == "generate" else served.llm.max_embed_len})
    return out


@router.get("/api/ps")
async def ps(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    return {"models": await off_loop(_running, state)}


@router.get("/api/version")
async def api_version() -> dict[str, str]:
    return {"version": version("churon")}
