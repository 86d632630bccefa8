"""POST /v1/completions: text completions of one or several prompts (text or token ids), with echo
and prompt logprobs, answered whole or streamed as text_completion events (vLLM's serving_completion)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request

from churon.errors import ContextLengthError
from churon.llm import LLM
from churon.server.errors import APIError
from churon.server.generation import EngineRequest, Generation, finish_generation, start_generation
from churon.server.offload import off_loop
from churon.server.openai import render
from churon.server.openai.protocol import CompletionRequest, StreamOptions
from churon.server.openai.sampling import check_request, sampling_params
from churon.server.openai.streaming import sse
from churon.server.state import ServerState, server_state
from churon.tokenizer import Tokenizer

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    served = await state.model_for(request, body.model, "generate")
    llm = served.llm
    state.limits.check_choices(body.n, _count(body.prompt))
    check_request(body, state.limits, body.logprobs, "logprobs")
    prompts = await off_loop(_prompts, body.prompt, llm)
    state.limits.check_prompt_tokens(sum(len(ids) for ids, _ in prompts) * body.n, "prompt")
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = 16
    if max_tokens < 0:
        raise APIError(400, f"max_tokens={max_tokens}: must be >= 0", param="max_tokens")
    if max_tokens == 0 and body.stream:
        raise APIError(400, "max_tokens=0 (the prompt only, with echo) cannot be streamed", param="max_tokens")
    want_prompt_logprobs = body.echo and body.logprobs is not None
    # max_tokens=0 runs one token to get the prompt's logprobs; that token is not returned
    run_tokens = max(max_tokens, 1)
    requests = [
        EngineRequest(ids, sampling_params(body, j, run_tokens, body.logprobs, body.logprobs if want_prompt_logprobs else None))
        for ids, _ in prompts for j in range(body.n)
    ]
    origin, tokenizer = render.Origin(render.new_id("cmpl"), served.name, llm.fingerprint), llm.tokenizer
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    if max_tokens == 0 and not want_prompt_logprobs:
        for r in requests:  # nothing to run, but a bad prompt is still a 400
            _check_prompt(llm, r.prompt_ids)
        choices = [render.completion_choice(i, prompts[i // body.n][1] if body.echo else "", "length", None)
                   for i in range(len(requests))]
        return render.completion_response(origin, choices, render.usage(prompt_tokens, 0))
    generation = await start_generation(request, state, served, requests, prompt_param="prompt")
    if body.stream:
        return sse(_completion_stream(generation, origin, tokenizer, body, prompts, body.stream_options or StreamOptions()))
    outputs = await finish_generation(request, generation)
    choices = []
    for i, o in enumerate(outputs):
        prompt_text = prompts[i // body.n][1]
        token_ids, entries = (list(o.token_ids), list(o.logprobs or [])) if max_tokens else ([], [])
        text = o.text if max_tokens else ""
        finish = o.finish_reason if max_tokens else "length"
        if body.echo:
            text = prompt_text + text
            if want_prompt_logprobs:
                token_ids, entries = o.prompt_token_ids + token_ids, list(o.prompt_logprobs) + entries
        logprobs = render.completion_logprobs(tokenizer, token_ids, entries) if body.logprobs is not None else None
        choices.append(render.completion_choice(i, text, finish, logprobs))
    completion_tokens = sum(len(o.token_ids) for o in outputs) if max_tokens else 0
    return render.completion_response(origin, choices, render.usage(prompt_tokens, completion_tokens))


def _count(prompt) -> int:
    """How many prompts the body's `prompt` holds, before any is tokenized."""
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


def _prompts(prompt, llm: LLM) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt: a string, a list of strings, a list of ids, a list of id lists.
    Tokenizes and decodes: runs off the event loop."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: give a string, a list of strings or a list of token ids", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            try:
                out.append((llm.encode(p), p))
            except ContextLengthError as e:  # refused by its length, before it is tokenized
                raise APIError(400, str(e), param="prompt", code="context_length_exceeded")
        else:
            _check_prompt(llm, p)
            out.append((list(p), llm.tokenizer.decode(p)))
    return out


def _check_prompt(llm: LLM, ids: list[int]) -> None:
    try:
        llm.check_prompt(ids)
    except ContextLengthError as e:
        raise APIError(400, str(e), param="prompt", code="context_length_exceeded")
    except ValueError as e:
        raise APIError(400, str(e), param="prompt")


async def _completion_stream(generation: Generation, origin: render.Origin, tokenizer: Tokenizer, body: CompletionRequest,
                             prompts: list[tuple[list[int], str]], options: StreamOptions) -> AsyncIterator[dict[str, Any]]:
    offsets = [0] * len(generation.requests)  # text_offset of each choice's next token
    generated = [0] * len(generation.requests)  # tokens of each choice so far: one per delta
    echoed: set[int] = set()

    def chunk(i: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        c = render.completion_chunk(origin, render.completion_choice(i, text, finish_reason, logprobs))
        return render.with_usage(c, len(prompts[i // body.n][0]), generated[i]) if options.continuous_usage else c

    async for i, d in generation.deltas():
        if body.echo and i not in echoed:  # the prompt goes first, with its logprobs when asked
            echoed.add(i)
            text = prompts[i // body.n][1]
            logprobs = None
            if body.logprobs is not None:
                logprobs = render.completion_logprobs(tokenizer, d.output.prompt_token_ids, d.output.prompt_logprobs)
            yield chunk(i, text, None, logprobs)
            offsets[i] = len(text)
        generated[i] += 1
        logprobs = None
        if body.logprobs is not None and d.logprob is not None:
            logprobs = render.completion_logprobs(tokenizer, [d.logprob.token_id], [d.logprob], offsets[i])
        offsets[i] += len(d.text)
        if d.text or logprobs is not None or d.finish_reason is not None:
            yield chunk(i, d.text, d.finish_reason, logprobs)
    if options.include_usage:
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        yield render.usage_chunk(origin, "text_completion", render.usage(prompt_tokens, sum(generated)))
