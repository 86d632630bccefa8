"""POST /api/embed (input: a string or a list of them -> embeddings, one vector each) and the older
POST /api/embeddings (prompt -> embedding), from an embedding model.

truncate (default true, as Ollama): an input longer than the model's context is cut to it, keeping its
beginning and its final special token as LLM.embed does; false makes it a 400 naming the input.
dimensions: fewer than the model's own keeps the first ones, L2-normalized again, as Ollama does; more is a 400.
The vectors are LLM.embed's, as the model's pooling makes them."""

from __future__ import annotations

import math
from typing import Any, Sequence

from fastapi import APIRouter, Depends, Request

from churon.errors import ContextLengthError
from churon.llm import LLM
from churon.server.errors import APIError
from churon.server.generation import ClientDisconnected, until_ended
from churon.server.offload import off_loop
from churon.server.ollama.completion import with_model
from churon.server.ollama.protocol import EmbeddingsRequest, EmbedRequest
from churon.server.ollama.render import Timer
from churon.server.state import ServedModel, ServerState, server_state

router = APIRouter()


def _token_ids(llm: LLM, inputs: Sequence[tuple[str, str]], truncate: bool) -> list[list[int]]:
    """Each input's ids as the model embeds them, checked. Tokenizes: runs off the event loop."""
    out = []
    for param, text in inputs:
        try:
            ids = llm.encode_for_embedding(text, truncate)
            llm.embedder.check_input(ids)
        except ContextLengthError as e:
            raise APIError(400, f"{param}: {e}; truncate: true cuts it to the model's context", param=param,
                           code="context_length_exceeded")
        except ValueError as e:  # e.g. a text the model gives no token at all
            raise APIError(400, f"{param}: {e}", param=param)
        out.append(ids)
    return out


async def _vectors(request: Request, state: ServerState, served: ServedModel, inputs: list[tuple[str, str]],
                   truncate: bool) -> tuple[list[list[float]], int]:
    state.limits.check_embedding_inputs(len(inputs))
    ids = await off_loop(_token_ids, served.llm, inputs, truncate)
    tokens = sum(len(x) for x in ids)
    state.limits.check_prompt_tokens(tokens, "input", what="inputs")
    with state.admission.admit(1):  # a --max-queue place until its vectors come
        try:
            vectors = await until_ended(request, state.drain, served.engine.embed(ids))
        except ClientDisconnected:
            raise APIError(499, "the client disconnected")
    state.metrics.embedding_requests += 1
    state.metrics.embedding_tokens += tokens
    return vectors, tokens


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
        vectors, tokens = await _vectors(request, state, served, inputs, body.truncate) if inputs else ([], 0)
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
        [vector], _ = await _vectors(request, state, served, [("prompt", body.prompt)], truncate=True)
        return {"embedding": vector}

    return await with_model(request, state, body.model, "embed", body.keep_alive, work)
