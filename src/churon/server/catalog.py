"""The models a server can load by name, what each will hold once loaded, and how it is loaded.

    names()   every model in $CHURON_HOME: a cached registry model by its registry name ("smollm2-135m"),
              another cached file or directory by its own name less ".gguf", a created model (model_store) by
              its name ("mario:latest")
    find()    the name a request means: one of those, a registry alias ("smollm2"), or either without ":latest"
    plan()    the model's header read (never its weights): its task, and what it will hold (plan_share:
              weights as the file's size, activations, a KV cache from the server's per-model share); a created
              model's is its base's (and its ADAPTER's), with its num_ctx as max_model_len; a text model's weights
              count the speculative draft model's file, which loads with each of them
    load()    the LLM, with that KV cache and a created model's TEMPLATE and ADAPTER (loaded as
              model_store.ADAPTER_LORA, which ServerState has every request to it run with; its SYSTEM, MESSAGEs
              and PARAMETERs are for the routes to apply)

Only names() are loaded for a request: a request naming a path is a 404, never a file opened on the server.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from churon.config import EncoderConfig, EngineConfig
from churon.engine.memory import plan_share
from churon.llm import LLM, check_draft_model
from churon.loader import DTYPES, open_model
from churon.model.native_backend import coarse_copy_bytes
from churon.model_store import CreatedModel, get_model, list_models, resolve
from churon.registry import REGISTRY, cached_models, registry_entry, resolve_model

# engine options that bear on an embedding model (its token budget, its longest input)
_EMBED_OPTIONS = ("max_num_batched_tokens", "max_model_len")


@dataclass(frozen=True)
class LoadPlan:
    name: str  # what requests call it
    path: Path  # a GGUF file or a Hugging Face directory
    task: str  # "generate" or "embed"
    created: CreatedModel | None  # when it is a created model
    engine_options: dict[str, Any]  # the LLM's; a text model's kv_cache_memory is set
    resident_bytes: int  # what it holds once loaded


@dataclass
class ModelCatalog:
    memory_share: int  # bytes one model plans for: the server's budget over the models it keeps loaded
    dtype: str = "float32"
    kernels: str = "auto"
    threads: int | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields for every model
    draft_bytes: int = field(init=False, default=0)  # the speculative draft model's file, held beside each text model

    def __post_init__(self):
        speculative = EngineConfig(**self.engine_options).speculative  # bad settings fail now, not at a request's load
        if speculative is not None and speculative.method == "draft":
            # opened (pulled) now: a draft that cannot load would fail every text model's load
            draft = open_model(speculative.model)
            check_draft_model(speculative.model, draft.config)
            self.draft_bytes = _file_bytes(draft.path)

    def names(self) -> list[str]:
        return list(self._cached()) + [m.name for m in list_models()]

    def find(self, name: str) -> str | None:
        """The name among names() a request's `model` means, or None."""
        created = get_model(name)
        if created is not None:
            return created.name
        names = self._cached()
        for candidate in (name, name.removesuffix(":latest")):
            if candidate in names:
                return candidate
            entry = registry_entry(candidate)
            if entry is not None and entry.name in names:
                return entry.name
        return None

    def not_pulled(self, name: str) -> str | None:
        """The registry name of `name` when it is a registry model not in the cache yet."""
        entry = registry_entry(name.removesuffix(":latest"))
        return entry.name if entry is not None and entry.name not in self._cached() else None

    def plan(self, name: str, source: str | Path | None = None, task: str = "auto") -> LoadPlan:
        """The plan of the model named `name` (one of names()), or of `source` served as `name`: what the operator
        gave (`churon serve MODEL`: a path, a created model, a registry name, pulled if need be). Reads the header:
        run it off the event loop."""
        path, created = self._locate(source if source is not None else name, pull=source is not None)
        options = dict(self.engine_options)
        if created is not None and "num_ctx" in created.parameters:
            options["max_model_len"] = created.parameters["num_ctx"]
        model = open_model(path, pull=False)
        weights = _file_bytes(model.path)
        if created is not None and created.adapter is not None:  # its A and B, held beside the weights
            weights += _file_bytes(created.adapter)
        if task == "auto":
            task = _task(model)
        if task == "embed":
            options = {k: v for k, v in options.items() if k in _EMBED_OPTIONS}
            return LoadPlan(name, model.path, task, created, options, weights)
        if self.kernels != "reference":  # the native backend's greedy logits copy, built by the generation engine
            weights += coarse_copy_bytes(model)
        engine = EngineConfig(**options)
        context = min(model.config.context_length, engine.max_model_len or 1 << 62)
        kv_dtype = engine.kv_torch_dtype(DTYPES[self.dtype])  # both backends' default: the activations' dtype
        plan = plan_share(model.config, weights + self.draft_bytes, engine, context, kv_dtype, self.memory_share)
        options["kv_cache_memory"] = plan.kv_bytes
        return LoadPlan(name, model.path, task, created, options, plan.total_bytes)

    def task(self, name: str) -> str | None:
        """The task the model named `name` (one of names()) loads for, from its header; None when it cannot be
        read (its load will say why). Reads the header: run it off the event loop."""
        try:
            path, _ = self._locate(name, pull=False)
            return _task_of(path, path.stat().st_mtime_ns)
        except Exception:  # a broken file is a load error for the request that names it, not a listing's
            return None

    def load(self, plan: LoadPlan, pooling: str | None = None) -> LLM:
        llm = LLM(plan.path, task=plan.task, pooling=pooling, dtype=self.dtype, kernels=self.kernels,
                  threads=self.threads, lora_adapters=plan.created.lora_adapters if plan.created is not None else None,
                  **plan.engine_options)
        if plan.created is not None and plan.created.template is not None:  # its TEMPLATE, on every API
            llm.tokenizer.chat_template = plan.created.template
        return llm

    def _locate(self, model: str | Path, pull: bool) -> tuple[Path, CreatedModel | None]:
        created = get_model(str(model))
        if created is not None:
            return resolve(created.name)
        cached = self._cached().get(str(model))
        return (cached, None) if cached is not None else (resolve_model(model, pull=pull), None)

    def _cached(self) -> dict[str, Path]:
        by_file = {entry.filename: entry.name for entry in REGISTRY.values()}
        return {by_file.get(p.name, p.name.removesuffix(".gguf")): p for p in cached_models()}


def _task(model) -> str:
    """As LLM's task "auto": an encoder, or files that declare a pooling, embed; other models generate."""
    return "embed" if isinstance(model.config, EncoderConfig) or model.pooling is not None else "generate"


@functools.lru_cache(maxsize=256)
def _task_of(path: Path, mtime_ns: int) -> str:  # mtime_ns: a file replaced since is read again
    return _task(open_model(path, pull=False))


def _file_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
