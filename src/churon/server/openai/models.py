"""The served models: GET /v1/models lists them, the loaded ones first (the most recently used first), then
those this server loads when a request names them; GET /v1/models/{id} retrieves one. A loaded model's card
says its task, its context (an embedding model's: its longest input and its vectors' length), "loaded": true
and "expires_at" (Unix seconds when it unloads if still idle; null: kept for good); another's "loaded": false
and the task its header says (null when it cannot be read), so a chat client can leave embedding models out.
Each LoRA adapter follows its base model, in vLLM's card: "parent" its base model, "root" the path it was read
from. A request's `model` is looked up by ServerState.acquire."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from churon.server.lora import ServedAdapter
from churon.server.offload import off_loop
from churon.server.state import ServedModel, ServerState, server_state

router = APIRouter()


def _card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "churon"}


def _loaded_card(served: ServedModel) -> dict[str, Any]:
    llm = served.llm
    card = _card(served.name)
    if served.task == "embed":
        card |= {"max_model_len": llm.max_embed_len, "task": "embed", "dimensions": llm.embedding_dim}
    else:
        card |= {"max_model_len": llm.max_model_len, "task": "generate"}
    expires_at = int(served.expires_at) if served.expires_at is not None else None
    return card | {"loaded": True, "expires_at": expires_at}


def _adapter_card(adapter: ServedAdapter) -> dict[str, Any]:
    return _card(adapter.name) | {"parent": adapter.base, "root": adapter.path, "task": "generate"}


def _cards(state: ServerState) -> list[dict[str, Any]]:
    """Reads the unloaded models' headers: run it off the event loop."""
    loaded = state.loaded()
    names = {m.name for m in loaded}
    unloaded = [n for n in state.available() if n not in names]
    task = state.catalog.task if state.catalog is not None else lambda name: None
    cards = [_loaded_card(m) for m in loaded] + [_card(n) | {"loaded": False, "task": task(n)} for n in unloaded]
    adapters = list(state.adapters.values())  # one snapshot: the event loop may load or unload one meanwhile
    listed: list[dict[str, Any]] = []
    for card in cards:
        listed += [card] + [_adapter_card(a) for a in adapters if a.base == card["id"]]
    return listed


@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    state.ready()
    return {"object": "list", "data": await off_loop(_cards, state)}


@router.get("/v1/models/{model:path}")  # :path: a served name may hold slashes ("HuggingFaceTB/SmolLM2-135M")
async def model(model: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    state.ready()
    card = next((c for c in await off_loop(_cards, state) if c["id"] == model), None)
    if card is None:
        raise state.not_found(model)
    return card
