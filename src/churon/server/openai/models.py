"""The served models: GET /v1/models lists them (a text-generation model, an embedding model, or both),
GET /v1/models/{id} retrieves one. A request's `model` is looked up by ServerState.model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from churon.server.state import ServedModel, ServerState, server_state

router = APIRouter()


def _model_card(served: ServedModel) -> dict[str, Any]:
    llm = served.llm
    card = {"id": served.name, "object": "model", "created": 0, "owned_by": "churon"}
    if served.task == "embed":  # the longest input it embeds, and its vectors' length
        return {**card, "max_model_len": llm.max_embed_len, "task": "embed", "dimensions": llm.embedding_dim}
    return {**card, "max_model_len": llm.max_model_len, "task": "generate"}


@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(m) for m in state.ready()]}


@router.get("/v1/models/{model:path}")  # :path: a served name may hold slashes ("HuggingFaceTB/SmolLM2-135M")
async def model(model: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    return _model_card(state.named(model))
