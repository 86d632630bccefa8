"""POST /api/generate: one prompt, answered whole (stream: false) or as NDJSON `response` pieces.

    prompt    rendered as the user turn of the model's chat template (generate's `template`, else a created
              model's TEMPLATE, in place of the model's own), after `system` (else the created model's SYSTEM);
              a model without a chat template takes the prompt as it is, as Ollama's default "{{ .Prompt }}"
    raw       the prompt as it is: no template, no system
    context   the token ids an earlier answer returned, put before this prompt's; the answer's `context` is its
              prompt's ids and its own (not with raw, as Ollama)
    format    "json" or a JSON schema the answer is constrained to
    suffix    fill-in-the-middle, which churon's templates do not do: a 400 when given
An empty prompt loads the model (done_reason "load"), or with keep_alive 0 unloads it ("unload").
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request

from churon.errors import ContextLengthError
from churon.llm import LLM
from churon.server.errors import APIError
from churon.server.generation import EngineRequest, Generation, finish_generation, start_generation
from churon.server.offload import off_loop
from churon.server.ollama import render
from churon.server.ollama.chat import load_or_unload
from churon.server.ollama.completion import created_parameters, no_images, request_template, templated, with_model
from churon.server.ollama.protocol import GenerateRequest
from churon.server.ollama.render import Timer
from churon.server.ollama.sampling import context_length, format_schema, merged_options, sampling_params
from churon.server.state import ServedModel, ServerState, server_state
from churon.tokenizer import ChatTemplateError

router = APIRouter()


def prompt_ids(llm: LLM, body: GenerateRequest, system: str | None) -> list[int]:
    """The request's context, then its prompt as the model takes it. Tokenizes: runs off the event loop."""
    context = list(body.context or [])
    if body.raw:
        return context + llm.encode(body.prompt, add_bos=None if not context else False)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": body.prompt}]
    try:
        text = llm.tokenizer.apply_chat_template(messages)
    except ChatTemplateError:
        if llm.tokenizer.chat_template is not None:  # the model's template refused this conversation
            raise
        return context + llm.encode(body.prompt if system is None else f"{system}\n\n{body.prompt}",
                                    add_bos=None if not context else False)
    return context + llm.encode(text, add_bos=False)  # the template writes the BOS itself when the model wants one


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request, state: ServerState = Depends(server_state)):
    if body.suffix:
        raise APIError(400, "suffix: churon does not do fill-in-the-middle; leave suffix out", param="suffix")
    if not body.prompt and not body.images:
        return await load_or_unload(request, state, body.model, body.keep_alive, {"response": ""})

    async def work(served: ServedModel, timer: Timer):
        no_images(body.images, "images", body.model)
        created = served.created
        template = request_template(body.template) if body.template is not None else created and created.template
        llm = templated(served.llm, template)
        system = body.system if body.system is not None else created.system if created is not None else None
        options = merged_options(created_parameters(served), body.options)
        vocab = llm.tokenizer.vocab_size
        bad = next((i for i, t in enumerate(body.context or []) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"context[{bad}]={body.context[bad]}: not a token id of this model (0..{vocab - 1})",
                           param=f"context[{bad}]")
        try:
            ids = await off_loop(prompt_ids, llm, body, system)
        except ContextLengthError as e:
            raise APIError(400, str(e), param="prompt", code="context_length_exceeded")
        except ValueError as e:  # the chat template refused the prompt
            raise APIError(400, f"the model's chat template: {e}", param="prompt")
        state.limits.check_prompt_tokens(len(ids), "prompt")
        state.limits.check_stop(options.get("stop") or [], "options.stop")
        context = context_length(options, llm.max_model_len)
        params = sampling_params(options, len(ids), context, json_schema=format_schema(body.format))
        generation = await start_generation(request, state, served, [EngineRequest(ids, params)], prompt_param="prompt")
        if body.stream:
            return _generate_stream(generation, body.model, timer, not body.raw)
        [output] = await finish_generation(request, generation)
        return render.header(body.model) | {"response": output.text} | _final(output, timer, not body.raw)

    return await with_model(request, state, body.model, "generate", body.keep_alive, work)


def _final(output, timer: Timer, with_context: bool) -> dict[str, Any]:
    final = render.final_fields(output, timer)
    if with_context:
        final["context"] = list(output.prompt_token_ids) + list(output.token_ids)
    return final


async def _generate_stream(generation: Generation, model: str, timer: Timer, with_context: bool) -> AsyncIterator[dict[str, Any]]:
    async for _, d in generation.deltas():
        if d.text:
            yield render.header(model) | {"response": d.text, "done": False}
        if d.finish_reason is not None:
            yield render.header(model) | {"response": ""} | _final(d.output, timer, with_context)
