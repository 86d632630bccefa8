"""LLM: the Python front door. Load a model once, then generate, chat or stream, or embed."""

from __future__ import annotations

import functools
import os
from dataclasses import fields
from typing import Iterator, Mapping, Sequence

import torch

from churon import kernels as native_kernels
from churon.config import POOLING_MODES, EncoderConfig, EngineConfig, ModelConfig, PoolingConfig, default_threads
from churon.engine import CompletionOutput, Delta, LLMEngine
from churon.engine.embedding import EmbeddingEngine
from churon.errors import ContextLengthError, TaskError
from churon.loader import load_model
from churon.registry import DEFAULT_MODEL
from churon.sampling import SamplingParams
from churon.tokenizer import ChatTemplateError, ChatTemplateLimitError

Prompt = str | Sequence[int]
Message = dict[str, str]
TASKS = ("auto", "generate", "embed")


def check_draft_model(name: str, config: ModelConfig | EncoderConfig) -> None:
    """A speculative draft model is a decoder: an encoder has no next token to propose."""
    if isinstance(config, EncoderConfig):
        raise TaskError(f"draft model {name}: an encoder (an embedding model) cannot propose tokens")


class LLM:
    """llm = LLM("smollm2-135m"); llm.generate(["Hello"], SamplingParams(temperature=0))
    embedder = LLM("all-minilm"); embedder.embed(["Hello", "world"])

    model: a registry name (pulled on first use), a .gguf file or a Hugging Face directory.
    task: "generate" (text), "embed" (one vector per input) or "auto": embed for an encoder (BERT) and for a
    model whose files declare a pooling (a sentence-transformers directory, a GGUF pooling type), else generate.
    pooling: for task embed, "mean", "cls" or "last" instead of what the files say (a decoder without a
    declared pooling: last, L2-normalized).
    dtype: "float32" or "bfloat16" (reference kernels only).
    threads: CPU threads (the native kernels' pool, or torch's on the reference path); default: physical cores.
    lora_adapters: {"name": path} LoRA adapters (PEFT directories or GGUF adapters) loaded at start; a request
    picks one with SamplingParams(lora="name"). load_lora / unload_lora change them later.
    speculative (an engine option, config.SpeculativeConfig's fields): speculative decoding, the same output in
    fewer steps. {"method": "ngram", "num_tokens": 4} proposes what followed an earlier occurrence of the text's
    last few tokens (prompt lookup); {"method": "draft", "model": PATH, "num_tokens": 4} has a smaller
    model with the same vocabulary propose, loaded as this one (the same kernels, dtype and threads).
    """

    def __init__(
        self,
        model: str | os.PathLike = DEFAULT_MODEL,
        *,
        task: str = "auto",
        pooling: str | None = None,
        dtype: str = "float32",
        kernels: str = "auto",
        threads: int | None = None,
        lora_adapters: Mapping[str, str | os.PathLike] | None = None,
        **engine_options,
    ):
        """kernels: "native" (churon's CPU kernels), "reference" (plain PyTorch, exact), "auto" (native when built).

        engine_options: EngineConfig fields (kv_cache_memory, max_num_seqs, block_size, max_loras, max_lora_rank, ...).
        """
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r}: must be an integer >= 1")
        if lora_adapters is not None and not isinstance(lora_adapters, Mapping):  # a bare path: refused before loading
            raise ValueError(f"lora_adapters={lora_adapters!r:.200}: must map names to adapter paths, {{'name': path}}")
        if task not in TASKS:
            raise ValueError(f"task={task!r}: must be one of {', '.join(TASKS)}")
        if pooling is not None and pooling not in POOLING_MODES:
            raise ValueError(f"pooling={pooling!r}: must be one of {', '.join(POOLING_MODES)}")
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
        self.name = str(model)
        self.task = self._task(task, pooling)
        self.engine: LLMEngine | None = None
        self.embedder: EmbeddingEngine | None = None
        if self.task == "embed":
            if lora_adapters:
                raise TaskError(f"{self.name} is loaded as an embedding model; LoRA adapters are for generating text")
            if engine_config.speculative is not None:
                raise TaskError(f"{self.name} is loaded as an embedding model; speculative decoding is for generating text")
            self.embedder = self._embedding_engine(pooling, engine_config)
            return
        self.engine = self._generation_engine(engine_config)
        for name, path in (lora_adapters or {}).items():
            self.engine.add_lora(name, path)
        try:  # a template that cannot render this within its limits would cost every chat request as much
            self.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
        except ChatTemplateLimitError as e:
            raise ChatTemplateError(f"the model's chat template cannot render a one-message conversation: {e}") from e
        except ChatTemplateError:
            pass  # no template, or one that refuses this conversation: chat requests say so

    def _task(self, task: str, pooling: str | None) -> str:
        encoder = isinstance(self.config, EncoderConfig)
        if task == "generate" and encoder:
            raise TaskError(f"{self.name} is an encoder (an embedding model); it cannot generate text")
        if task == "auto":
            task = "embed" if encoder or self.source.pooling is not None else "generate"
        if task == "generate" and pooling is not None:
            raise ValueError(f"pooling={pooling!r} is for task='embed'; {self.name} is loaded to generate text")
        return task

    def _generation_engine(self, engine_config: EngineConfig) -> LLMEngine:
        speculative = engine_config.speculative
        if speculative is None or speculative.method != "draft":
            return LLMEngine(self.model, self.tokenizer, engine_config)
        # the target's backend by name, not "auto" again: the draft runs on the very kernels the target runs on
        draft, draft_tokenizer, _ = load_model(speculative.model, dtype=self.model.backend.dtype,
                                               kernels=self.model.backend.name)
        check_draft_model(speculative.model, draft.config)
        return LLMEngine(self.model, self.tokenizer, engine_config, draft_model=draft, draft_tokenizer=draft_tokenizer)

    def _embedding_engine(self, mode: str | None, engine_config: EngineConfig) -> EmbeddingEngine:
        declared = self.source.pooling
        if declared is None:  # nothing in the files: BERT's mean, a decoder's last token; unit vectors
            declared = PoolingConfig("mean" if isinstance(self.config, EncoderConfig) else "last", normalize=True)
        pooling = PoolingConfig(mode or declared.mode, declared.normalize, declared.max_length)
        max_length = min(self.config.context_length, pooling.max_length or 1 << 62, engine_config.max_model_len or 1 << 62)
        return EmbeddingEngine(self.model, pooling, max_length, engine_config)

    def _generation(self) -> LLMEngine:
        if self.engine is None:
            raise TaskError(f"{self.name} is loaded as an embedding model; it cannot generate text (use embed)")
        return self.engine

    def _embedding(self) -> EmbeddingEngine:
        if self.embedder is None:
            raise TaskError(f"{self.name} is loaded to generate text; load it with task='embed' to embed")
        return self.embedder

    @property
    def pooling(self) -> PoolingConfig:
        """How inputs become vectors (task embed)."""
        return self._embedding().pooling

    @property
    def embedding_dim(self) -> int:
        return self._embedding().dimensions

    @property
    def max_embed_len(self) -> int:
        """The most tokens one input to embed may have (special tokens included)."""
        return self._embedding().max_length

    def encode_for_embedding(self, text: str, truncate: bool = False) -> list[int]:
        """text's token ids as the model embeds it, its special tokens included ([CLS] ... [SEP] for BERT).
        truncate: keep the first max_embed_len tokens, the final special token kept last (as sentence-transformers
        truncates); otherwise a longer text is a ContextLengthError when it is embedded."""
        limit = self._embedding().max_length
        text = self._embedded_text(text)
        if not truncate:
            return self.tokenizer.encode(text)
        # Only the text's beginning is needed: cut it at the first space after as many characters as limit tokens
        # can cover (what comes before a space does not depend on what follows), unless that holds too few tokens.
        cut = text.find(" ", limit * self._longest_token)
        ids = self.tokenizer.encode(text[:cut]) if cut >= 0 else []
        if len(ids) <= limit:
            ids = self.tokenizer.encode(text)
        if len(ids) > limit:
            ids = ids[: limit - 1] + ids[-1:] if self.tokenizer.add_eos else ids[:limit]
        return ids

    def encode_batch_for_embedding(self, texts: Sequence[str]) -> list[list[int]]:
        """[encode_for_embedding(text) for text in texts], tokenized in parallel."""
        return self.tokenizer.encode_batch([self._embedded_text(text) for text in texts])

    def _embedded_text(self, text: str) -> str:
        # sentence_bert_config.json's do_lower_case: sentence-transformers lowers texts before tokenizing
        return text.lower() if self.config.extra.get("do_lower_case") else text

    def embed(self, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
              truncate: bool = False) -> list[list[float]]:
        """One vector per input (the model's pooling, unit length when it normalizes), in order.

        inputs: a string, a list of strings, a token-id list or a list of them; strings get the model's special
        tokens, token ids are used as given. An input longer than max_embed_len is a ContextLengthError unless
        truncate (which keeps its beginning). The inputs run together, packed into as few forwards as fit."""
        embedder = self._embedding()
        if isinstance(inputs, str) or (len(inputs) and isinstance(inputs[0], int)):
            inputs = [inputs]
        texts = [x for x in inputs if isinstance(x, str)]
        encoded = iter(self.encode_batch_for_embedding(texts) if not truncate else
                       [self.encode_for_embedding(x, truncate=True) for x in texts])
        ids = [next(encoded) if isinstance(x, str) else embedder.prepare(x, truncate) for x in inputs]
        return embedder.embed(ids).tolist()

    @property
    def fingerprint(self) -> str:
        """What decides this process's arithmetic: outputs are bitwise reproducible between processes with
        the same fingerprint (and model); another ISA rounds differently. Logged by churon serve at load, so
        a run whose outputs differ can be traced to its configuration."""
        backend = self.model.backend.name
        if backend == "native":
            backend += f"-{native_kernels.cpu.isa()}"
        if self.engine is None:
            return f"{backend} threads={self.threads} task=embed"
        return f"{backend} threads={self.threads} kv={self.engine.cache.k.dtype}".replace("torch.", "")

    def load_lora(self, name: str, path: str | os.PathLike) -> None:
        """Load a LoRA adapter (a PEFT directory or a GGUF adapter) for SamplingParams(lora=name)."""
        self._generation().add_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Unload an adapter: new requests can no longer name it; a stream already using it finishes with it."""
        self._generation().remove_lora(name)

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """The names of the loaded LoRA adapters, in load order."""
        return self.engine.lora_names() if self.engine is not None else ()

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
        # a prompt is continued, never closed: no EOS even where the model's files append one (embedders)
        return self.tokenizer.encode(text, add_bos=add_bos, add_eos=False)

    @functools.cached_property
    def _longest_token(self) -> int:
        # a token stands for at most its longest text, which has no more characters than bytes
        return max(1, max(len(self.tokenizer.token_bytes(i)) for i in range(self.tokenizer.vocab_size)))

    @property
    def _max_prompt_chars(self) -> int:
        return self.max_model_len * self._longest_token

    @property
    def max_model_len(self) -> int:
        """The most tokens one sequence may hold, prompt and output: the model's context, or less by max_model_len."""
        return self._generation().context_length

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raise ValueError (ContextLengthError when too long) for a prompt this LLM can never run."""
        self._generation().check_prompt(prompt_ids)

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
        return self._generation().generate(ids, params, use_tqdm=use_tqdm and len(ids) > 1)

    def chat(self, messages: Sequence[Message], params: SamplingParams | None = None) -> CompletionOutput:
        return self._generation().generate([self.chat_prompt_ids(messages)], params or SamplingParams())[0]

    def stream_deltas(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Iterator[Delta]:
        return self._generation().stream(prompt_ids, params or SamplingParams())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Text pieces as they are generated (never a broken UTF-8 character, never part of a stop string)."""
        for delta in self._generation().stream(self._prompt_ids(prompt), params or SamplingParams()):
            if delta.text:
                yield delta.text
