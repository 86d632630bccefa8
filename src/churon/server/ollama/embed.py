"""POST /api/embed (input: a string or a list of them -> embeddings, one vector each) and the older
POST /api/embeddings (prompt -> embedding), from an embedding model.

truncate (default true, as Ollama): an input longer than the model's context is cut to it, keeping its
beginning and its final special token as LLM.embed does; false makes it a 400 naming the input.
dimensions: fewer than the model's own keeps the first ones, L2-normalized again, as Ollama does; more is a 400.
The vectors are LLM.embed's, as the model's pooling makes them."""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Depends, Request

from churon.server.embedding import embed_inputs
from churon.server.errors import APIError
from churon.server.ollama.completion import with_model
from churon.server.ollama.protocol import EmbeddingsRequest, EmbedRequest
from churon.server.ollama.render import Timer
from churon.server.state import ServedModel, ServerState, server_state

router = APIRouter()
_HINT = "truncate: true cuts it to the model's context"


def _shortened(vector: list[float], dimensions: int) -> list[float]:
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


@router.post("/api/embed")
async def embed(body: EmbedRequest, request: Request, state: ServerState = Depends(server_state)):
    texts = [body.input] if isinstance(body.input, str) else body.input
    inputs = [("input", body.input)] if isinstance(body.input, str) else [(f"input[{i}]", t) for i, t in enumerate(texts)]

    async def work(served: ServedModel, timer: Timer) -> dict[str, Any]:
        dim = served.llm.embedding_dim
        if body.dimensions is not None and not 1 <= body.dimensions <= dim:
            raise APIError(400, f"dimensions={body.dimensions}: \"{body.model}\" gives {dim}-dimensional vectors;"
                           f" ask for 1 to {dim}", param="dimensions")
        vectors, tokens = await embed_inputs(request, state, served, inputs, body.truncate, _HINT) if inputs else ([], 0)
        if body.dimensions is not None and body.dimensions < dim:
            vectors = [_shortened(v, body.dimensions) for v in vectors]
        return {"model": body.model, "embeddings": vectors, "total_duration": timer.total(),
                "load_duration": timer.load_duration, "prompt_eval_count": tokens}

    return await with_model(request, state, body.model, "embed", body.keep_alive, work)


@router.post("/api/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request, state: ServerState = Depends(server_state)):
    async def work(served: ServedModel, timer: Timer) -> dict[str, Any]:
        if not body.prompt:  # Ollama's answer to an empty prompt
            return {"embedding": []}
        [vector], _ = await embed_inputs(request, state, served, [("prompt", body.prompt)], True, _HINT)
        return {"embedding": vector}

    return await with_model(request, state, body.model, "embed", body.keep_alive, work)
