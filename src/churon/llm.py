"""LLM: the Python front door. Load a model once, then generate, chat or stream."""

from __future__ import annotations

import functools
import os
from dataclasses import fields
from typing import Iterator, Sequence

import torch

from churon import kernels as native_kernels
from churon.config import EngineConfig, default_threads
from churon.engine import CompletionOutput, Delta, LLMEngine
from churon.errors import ContextLengthError
from churon.loader import load_model
from churon.registry import DEFAULT_MODEL
from churon.sampling import SamplingParams
from churon.tokenizer import ChatTemplateError, ChatTemplateLimitError

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """llm = LLM("smollm2-135m"); llm.generate(["Hello"], SamplingParams(temperature=0))

    model: a registry name (pulled on first use), a .gguf file or a Hugging Face directory.
    dtype: "float32" or "bfloat16" (reference kernels only).
    threads: CPU threads (the native kernels' pool, or torch's on the reference path); default: physical cores.
    """

    def __init__(
        self,
        model: str | os.PathLike = DEFAULT_MODEL,
        *,
        dtype: str = "float32",
        kernels: str = "auto",
        threads: int | None = None,
        **engine_options,
    ):
        """kernels: "native" (churon's CPU kernels), "reference" (plain PyTorch, exact), "auto" (native when built).

        engine_options: EngineConfig fields (kv_cache_memory, max_num_seqs, block_size, ...).
        """
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r}: must be an integer >= 1")
        unknown = set(engine_options) - {f.name for f in fields(EngineConfig)}
        if unknown:
            raise ValueError(f"unknown LLM option(s) {sorted(unknown)}; engine options are {[f.name for f in fields(EngineConfig)]}")
        engine_config = EngineConfig(**engine_options)
        self.threads = threads or default_threads()
        torch.set_num_threads(self.threads)
        if native_kernels.cpu is not None:
            native_kernels.cpu.set_num_threads(self.threads)
        self.model, self.tokenizer, self.source = load_model(model, dtype=dtype, kernels=kernels)
        if self.model.backend.name == "native":
            # torch only runs small glue ops here; its OpenMP threads would fight the kernels' own pool
            torch.set_num_threads(1)
        self.config = self.model.config
        self.engine = LLMEngine(self.model, self.tokenizer, engine_config)
        try:  # a template that cannot render this within its limits would cost every chat request as much
            self.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
        except ChatTemplateLimitError as e:
            raise ChatTemplateError(f"the model's chat template cannot render a one-message conversation: {e}") from e
        except ChatTemplateError:
            pass  # no template, or one that refuses this conversation: chat requests say so

    @property
    def fingerprint(self) -> str:
        """What decides this process's arithmetic: outputs are bitwise reproducible between processes with
        the same fingerprint (and model); another ISA rounds differently. Logged by churon serve at load, so
        a run whose outputs differ can be traced to its configuration."""
        backend = self.model.backend.name
        if backend == "native":
            backend += f"-{native_kernels.cpu.isa()}"
        return f"{backend} threads={self.threads} kv={self.engine.cache.k.dtype}".replace("torch.", "")

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        return [int(t) for t in prompt]

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """text's token ids (tokenizer.encode), after refusing text that can never fit the context: encoding
        costs seconds and gigabytes per few million characters, a template's output or a prompt could be more."""
        if len(text) > self._max_prompt_chars:
            raise ContextLengthError(
                f"the prompt has {len(text)} characters, more than {self.max_model_len} tokens (the context window)"
                f" of this model can hold: its longest token has {self._max_prompt_chars // self.max_model_len} bytes;"
                " shorten the prompt (nothing was truncated)"
            )
        return self.tokenizer.encode(text, add_bos=add_bos)

    @functools.cached_property
    def _max_prompt_chars(self) -> int:
        # a token stands for at most its longest text, which has no more characters than bytes
        longest = max(len(self.tokenizer.token_bytes(i)) for i in range(self.tokenizer.vocab_size))
        return self.max_model_len * max(1, longest)

    @property
    def max_model_len(self) -> int:
        """The most tokens one sequence may hold, prompt and output: the model's context, or less by max_model_len."""
        return self.engine.context_length

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raise ValueError (ContextLengthError when too long) for a prompt this LLM can never run."""
        self.engine.check_prompt(prompt_ids)

    def chat_prompt_ids(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                        tools: Sequence[dict] | None = None) -> list[int]:
        """The conversation rendered by the model's chat template, by default ready for the assistant's turn.
        tools: function tools in OpenAI's shape, passed to the template as Hugging Face passes them."""
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  tools=None if tools is None else list(tools))
        # The template writes the BOS itself when the model wants one.
        return self.encode(text, add_bos=False)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """One output per prompt, all run together in continuous batches.

        prompts: a string, a list of strings, or a list of token-id lists. params: one for all, or one per prompt.
        """
        params = params or SamplingParams()
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self._prompt_ids(p) for p in prompts]
        return self.engine.generate(ids, params, use_tqdm=use_tqdm and len(ids) > 1)

    def chat(self, messages: Sequence[Message], params: SamplingParams | None = None) -> CompletionOutput:
        return self.engine.generate([self.chat_prompt_ids(messages)], params or SamplingParams())[0]

    def stream_deltas(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Iterator[Delta]:
        return self.engine.stream(prompt_ids, params or SamplingParams())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Text pieces as they are generated (never a broken UTF-8 character, never part of a stop string)."""
        for delta in self.engine.stream(self._prompt_ids(prompt), params or SamplingParams()):
            if delta.text:
                yield delta.text
