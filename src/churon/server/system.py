"""The routes that belong to no API: /health for liveness probes and load balancers, /metrics for
Prometheus. /health answers 503 until every served model is loaded; /metrics answers from the start."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from churon.server.state import ServerState, server_state

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(server_state)) -> JSONResponse:
    state.ready()
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def prometheus(state: ServerState = Depends(server_state)) -> PlainTextResponse:
    # stats() waits for the engine's lock, held during a step: off the event loop
    engine = state.generation_engine()
    stats = await asyncio.to_thread(engine.stats) if engine is not None else None
    return PlainTextResponse(state.metrics.render(stats), media_type="text/plain; version=0.0.4")
