"""The served model: GET /v1/models lists it, GET /v1/models/{id} retrieves it, and check_model refuses a
request that names another."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from churon.server.errors import APIError
from churon.server.state import ServerState, server_state

router = APIRouter()


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist: this server serves {state.model_name!r}",
                       param="model", code="model_not_found", type="not_found_error")


def _model_card(state: ServerState) -> dict[str, Any]:
    llm, _ = state.ready()
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "churon", "max_model_len": llm.max_model_len}


@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model:path}")  # :path: a served name may hold slashes ("HuggingFaceTB/SmolLM2-135M")
async def model(model: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    card = _model_card(state)
    check_model(state, model)
    return card
