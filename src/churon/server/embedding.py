"""What every embeddings API (OpenAI's /v1/embeddings, Ollama's /api/embed) does with its inputs once it has
read them: tokenize and check each (on the prompt pool, a 400 naming the input), bound the request's work, wait
for the vectors (a --max-queue place, the drain, the client's disconnect), count them."""

from __future__ import annotations

from typing import Sequence

from fastapi import Request

from churon.errors import ContextLengthError
from churon.llm import LLM
from churon.server.errors import APIError
from churon.server.generation import ClientDisconnected, until_ended
from churon.server.offload import off_loop
from churon.server.state import ServedModel, ServerState

# an input: the request field that holds it (for the 400) and a text or token ids
Input = tuple[str, str | list[int]]


def token_ids(llm: LLM, inputs: Sequence[Input], truncate: bool, truncation_hint: str) -> list[list[int]]:
    """Each input's token ids as the model embeds them (texts get its special tokens, ids are used as given),
    checked. Tokenizes: runs off the event loop. truncation_hint: how the API asks for truncation."""
    embedder = llm.embedder
    out = []
    for param, x in inputs:
        try:
            if isinstance(x, str):
                ids = llm.encode_for_embedding(x, truncate)
                embedder.check_input(ids)
            else:
                ids = embedder.prepare(x, truncate)
        except ContextLengthError as e:
            raise APIError(400, f"{param}: {e}; {truncation_hint}", param=param, code="context_length_exceeded")
        except ValueError as e:  # empty, or a token id outside the vocabulary
            raise APIError(400, f"{param}: {e}", param=param)
        out.append(ids)
    return out


async def embed_inputs(request: Request, state: ServerState, served: ServedModel, inputs: Sequence[Input],
                       truncate: bool, truncation_hint: str) -> tuple[list[list[float]], int]:
    """The inputs' vectors and their token count, within the server's limits."""
    state.limits.check_embedding_inputs(len(inputs))
    ids = await off_loop(token_ids, served.llm, inputs, truncate, truncation_hint)
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
