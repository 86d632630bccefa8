"""POST /v1/embeddings: one vector per input from the served embedding model, in OpenAI's shape.

    input             a string, a list of strings, a list of token ids, or a list of token-id lists. Strings get
                      the model's special tokens (BERT's [CLS] ... [SEP]), token ids are embedded as given. An
                      empty string is what the model makes of it: BERT embeds "" as [CLS] [SEP], its defined
                      vector; a model that gives "" no token at all (a decoder without a BOS) cannot, a 400.
    encoding_format   "float" (JSON numbers) or "base64" (each vector's little-endian float32 bytes, as the
                      official client decodes them; it asks for base64 unless told otherwise)
    dimensions        only the model's own: churon does not truncate vectors (no Matryoshka models yet)
    truncate_prompt_tokens  vLLM's field: -1, or k >= the model's max length, cuts each longer input to that
                      max length, keeping its beginning (vLLM keeps a prompt's end): a text keeps its final special
                      token as sentence-transformers does, token ids are cut as given; without it a longer input
                      is a 400 (nothing is cut silently)

Every input is tokenized and checked (empty, an id outside the vocabulary, too long) on the prompt pool
before any is embedded, and a 400 names the input; the inputs of concurrent requests share forwards
(AsyncEmbeddingEngine).
"""

from __future__ import annotations

import base64
import json
import struct
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from churon.llm import LLM
from churon.server.embedding import Input, embed_inputs
from churon.server.errors import APIError
from churon.server.offload import off_loop
from churon.server.openai.protocol import EmbeddingRequest
from churon.server.state import ServerState, server_state

router = APIRouter()

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, state: ServerState = Depends(server_state)) -> Response:
    served = await state.model_for(request, body.model, "embed")
    llm = served.llm
    if body.dimensions is not None and body.dimensions != llm.embedding_dim:
        raise APIError(400, f"dimensions={body.dimensions}: {served.name!r} does not support truncating its vectors;"
                       f" it gives {llm.embedding_dim} dimensions (leave dimensions out, or give {llm.embedding_dim})",
                       param="dimensions")
    truncate = _truncate(body.truncate_prompt_tokens, llm, served.name)
    vectors, tokens = await embed_inputs(request, state, served, _inputs(body.input), truncate,
                                         "truncate_prompt_tokens=-1 asks for it")
    # megabytes of numbers for a large request: rendered on the prompt pool, not by FastAPI on the event loop
    text = await off_loop(_response, vectors, body.encoding_format, served.name, tokens)
    return Response(text, media_type="application/json")


def _truncate(k: int | None, llm: LLM, name: str) -> bool:
    """Whether truncate_prompt_tokens asks for truncation. churon cuts an input to the model's max length only:
    -1, that length or more all ask for it ("at most k tokens"); fewer is a 400, not a vector of more tokens
    than the request allowed."""
    if k is None:
        return False
    limit = llm.max_embed_len
    if k == -1 or k >= limit:
        return True
    raise APIError(400, f"truncate_prompt_tokens={k}: churon truncates inputs to the model's max length only;"
                   f" give -1 (or {limit}, {name!r}'s max length)", param="truncate_prompt_tokens")


def _inputs(value: EmbeddingInput) -> list[Input]:
    """The request's inputs, each a string or a token-id list, with the field a 400 about it names."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [("input", value)]
    if not value:
        raise APIError(400, "input is empty: give a string, a list of strings or a list of token ids", param="input")
    return [(f"input[{i}]", x) for i, x in enumerate(value)]


def _response(vectors: list[list[float]], encoding_format: str, model: str, tokens: int) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding_format)} for i, v in enumerate(vectors)]
    body = {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return json.dumps(body, separators=(",", ":")).encode()


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    # the vector's values are float32 already: packing them as such loses nothing
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
