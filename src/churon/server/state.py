"""What the routes share, kept on app.state and handed to them by Depends(server_state): the models loaded
and those this server can load, the metrics, the admission count, the request limits and the shutdown's
drain (while draining, ready() answers 503 to every new request).

A server serves the models it preloads (`churon serve MODEL --embedding-model M`: loaded on a thread after
the port is bound; until every one has, ready() answers 503, for good when a load failed) and, given a
ModelCatalog (catalog.py), every model in $CHURON_HOME by name, loaded when a request names it:

    acquire(name, task)  the model a request names, held until release(): loaded on demand on the load
                         thread (the event loop never waits on it), one load at a time; concurrent requests
                         for a model that is loading wait for that one load; a failed load is those requests'
                         503 naming the model and the reason, and the next request tries again
    model_for(request, name, task)  the same, released once the request's response is sent (a stream: when
                         it ends; ReleaseModels, the middleware, does it), for routes
    memory               before a load the catalog's plan says what the model will hold (weights, activations,
                         the KV cache of its share of the budget); when that does not fit the budget
                         (ModelPolicy.memory, --models-memory) beside the models loaded, or max_loaded models
                         are loaded, the least recently used idle ones (no request holds them) are unloaded,
                         the figures logged; when unloading every idle one would not do, the load waits for
                         models to go idle (fit_timeout), then it is a 503
    keep_alive           seconds a model stays loaded after its last request (keep_alive.py): the request's,
                         else the server's (--keep-alive) for a model loaded on demand, for good for a preloaded
                         one; 0 unloads it once released; a background task unloads the expired ones

Each model has a task ("generate" or "embed", LLM.task); a request for the other task's API is a 400 naming the
model and its task.

A name may also be a LoRA adapter's (lora.py): the `churon serve MODEL --lora NAME=PATH` ones, on MODEL, loaded
into its engine as MODEL loads (and loads back); and, with --allow-lora-loading, those load_adapter adds at run
time (on the same model: vLLM's one base). acquire() gives a request naming one an AdapterView of its base model,
which it holds as it would the base model itself. unload_adapter() makes the name unknown at once; the requests
running with it finish with it (the engine frees its slot after the last). A created model with an ADAPTER
(model_store) loads with it (catalog.load) and runs every request with it (ServedModel.lora) but for those that
name another adapter on it: a request runs with one.

Routes look their model up after FastAPI has validated the body, so a malformed request is a 400 even while the
models load. Only the event loop touches the loaded models, but for the preload thread, which fills them before
ready() lets any request in.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from fastapi import Request

from churon.engine.async_engine import AsyncLLMEngine
from churon.engine.embedding import AsyncEmbeddingEngine
from churon.engine.memory import available_memory
from churon.errors import ChuronError, ModelFileError
from churon.llm import LLM
from churon.model_store import ADAPTER_LORA, CreatedModel, get_model
from churon.server.admission import Admission
from churon.server.catalog import LoadPlan, ModelCatalog
from churon.server.offload import off_loop
from churon.server.drain import Drain
from churon.server.errors import APIError
from churon.server.keep_alive import FOREVER
from churon.server.limits import RequestLimits
from churon.server.lora import AdapterView, ServedAdapter
from churon.server.metrics import ServerMetrics

log = logging.getLogger("churon.server")

# a task as a request's error names it
_TASK_MODELS = {"generate": "text-generation model", "embed": "embedding model"}

DEFAULT_KEEP_ALIVE = 300.0  # Ollama's 5m
DEFAULT_MAX_LOADED = 3  # Ollama's OLLAMA_MAX_LOADED_MODELS per device
# of the memory available at start, what the default budget leaves to the server itself (its Python, the
# requests' prompts and outputs, the page cache of the model files)
_RESERVE_FRACTION, _MIN_RESERVE = 10, 512 << 20

_HOLDS = "churon.models"  # the scope key of the models a request holds (model_for)


def default_models_memory() -> int:
    """The budget when --models-memory is not given: the memory available now, less a reserve."""
    available = available_memory()
    return max(1, available - max(available // _RESERVE_FRACTION, _MIN_RESERVE))


@dataclass(frozen=True)
class ModelPolicy:
    """How many models a server keeps loaded, in how much memory, for how long."""

    memory: int  # bytes for every loaded model together (--models-memory)
    max_loaded: int = DEFAULT_MAX_LOADED  # --max-loaded-models
    keep_alive: float = DEFAULT_KEEP_ALIVE  # seconds a model loaded on demand stays after its last request
    fit_timeout: float = 30.0  # seconds a load waits for busy models to go idle before its 503

    def __post_init__(self):
        if not isinstance(self.memory, int) or self.memory < 1:
            raise ValueError(f"models_memory={self.memory!r}: must be a number of bytes >= 1")
        if not isinstance(self.max_loaded, int) or self.max_loaded < 1:
            raise ValueError(f"max_loaded_models={self.max_loaded!r}: must be an integer >= 1")
        if not self.keep_alive >= 0:
            raise ValueError(f"keep_alive={self.keep_alive!r}: must be >= 0 seconds (math.inf: for good)")
        if not self.fit_timeout >= 0:
            raise ValueError(f"fit_timeout={self.fit_timeout!r}: must be >= 0 seconds")

    @property
    def memory_share(self) -> int:
        """What one model plans for (its KV cache gets what its weights and activations leave of it)."""
        return self.memory // self.max_loaded


@dataclass(eq=False)
class ServedModel:
    name: str  # what a request's `model` says
    llm: LLM
    engine: AsyncLLMEngine | AsyncEmbeddingEngine  # by llm.task
    size_bytes: int  # what it holds, as counted against the budget
    created: CreatedModel | None = None  # when it is a created model (its SYSTEM, TEMPLATE, ... for the routes)
    default_keep_alive: float = FOREVER  # when a request gives none: --keep-alive's, or for good (preloaded)
    keep_alive: float = FOREVER  # seconds it stays loaded once idle: the last request's
    expires_at: float | None = None  # time.time() when it unloads, if idle by then; None: kept for good
    in_flight: int = 0  # requests holding it
    last_used: float = field(default_factory=time.monotonic)
    lora: str | None = None  # the adapter its every request runs with: a created model's ADAPTER (else None; an
    #                          AdapterView's request runs with the adapter it names instead)

    @property
    def task(self) -> str:
        return self.llm.task


class ServerState:
    def __init__(self, models: Sequence[tuple[Callable[[], LLM], str]], admission: Admission, limits: RequestLimits,
                 catalog: ModelCatalog | None = None, policy: ModelPolicy | None = None,
                 lora_adapters: Mapping[str, str | Path] | None = None, allow_lora_loading: bool = False):
        """models: (load, name) of each model to preload, in this order (load may run again, to load it back
        after it was unloaded). catalog: the models loaded on demand (None: the preloaded ones only).
        policy: None, the budget of default_models_memory(). lora_adapters: name -> path of the LoRA adapters
        the first model serves (read when it loads). allow_lora_loading: load_adapter / unload_adapter allowed."""
        names = [name for _, name in models]
        if not names and catalog is None:
            raise ValueError("a server needs a model to serve")
        if len(set(names)) < len(names):
            raise ValueError(f"two models are served as the same name ({names}): give each its own")
        lora_adapters = {name: str(path) for name, path in (lora_adapters or {}).items()}
        if lora_adapters and not names:
            raise ValueError("LoRA adapters need a model to preload, for them to run on")
        taken = sorted(set(lora_adapters) & set(names))
        if taken:
            raise ValueError(f"the LoRA adapter name {taken[0]!r} is a served model's: give the adapter another")
        self._preloads = {name: load for load, name in models}
        self.catalog = catalog
        self.policy = policy or ModelPolicy(default_models_memory())
        self.admission = admission
        self.limits = limits
        self.drain = Drain()
        self.metrics = ServerMetrics()
        self._loaded: dict[str, ServedModel] = {}
        self._loading: dict[str, asyncio.Future[ServedModel]] = {}
        self._waiters: dict[str, int] = {}  # requests waiting for a model's load: each holds it once loaded
        self._sizes: dict[str, int] = {}  # a preloaded model's size, as measured when it last loaded
        self._one_load = asyncio.Lock()  # loads one at a time: each is weighed against the models already in
        self._released = asyncio.Event()  # a model went idle or away: a load waiting for room looks again
        self._changed = asyncio.Event()  # an expiry changed: the unloader looks again
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="churon-load")
        self._unloader: asyncio.Task | None = None
        self.preloaded = not self._preloads  # every preloaded model has loaded
        self.load_error: BaseException | None = None
        self.lora_base = names[0] if names else None  # the model the adapters run on
        # by name, in load order; changed on the event loop under _one_load, or by a load holding it (_serve)
        self.adapters = {name: ServedAdapter(name, self.lora_base, path) for name, path in lora_adapters.items()}
        self.allow_lora_loading = allow_lora_loading

    # --- startup and shutdown ----------------------------------------------------------------------

    def start(self, on_load_error: Callable[[BaseException], None] | None) -> None:
        """On the event loop, at startup: the preloads on the load thread, the unloader of expired models."""
        if not self.preloaded:
            self._loader.submit(self.preload, on_load_error)
        self._unloader = asyncio.ensure_future(self._unload_expired())

    def preload(self, on_load_error: Callable[[BaseException], None] | None) -> None:
        """Runs on the load thread, before ready() lets any request in."""
        loaded: list[ServedModel] = []
        try:
            for name, load in self._preloads.items():
                loaded.append(self._serve(name, load(), None, FOREVER, self._adapters_of(name), preload=True))
            self._loaded.update((m.name, m) for m in loaded)
            self.preloaded = True
        except BaseException as e:  # reported by /health and to the caller, never lost in a thread
            for served in loaded:
                served.engine.shutdown()
            self.load_error = e
            log.error("loading the model failed: %s", e)
            if on_load_error is not None:
                on_load_error(e)

    def shutdown(self) -> None:
        if self._unloader is not None:
            self._unloader.cancel()
        for served in self._loaded.values():
            served.engine.shutdown()
        self._loaded.clear()
        self._loader.shutdown(wait=False)

    def ready(self) -> None:
        """The 503 of a server that is draining, or whose preloaded models are not (yet) loaded."""
        refusal = self.drain.refusing()
        if refusal is not None:
            raise refusal
        if not self.preloaded:
            why = f"loading the model failed: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, why, type="service_unavailable", code="model_not_ready", headers={"Retry-After": "1"})

    # --- what routes call --------------------------------------------------------------------------

    async def acquire(self, name: str | None, task: str, keep_alive: float | None = None) -> ServedModel | AdapterView:
        """The model a request names for an API of `task` ("generate" or "embed"), loaded if need be, held
        until release(). name None: the first model loaded (else preloaded) for that task. keep_alive: seconds
        it stays loaded once idle (keep_alive.py; None: the model's default). A 503 as ready() or for a load
        that failed or found no room; a 404 for a name this server does not serve; a 400 for a model without
        that task, naming the model's task and the API for it. A LoRA adapter's name: an AdapterView of its base
        model."""
        self.ready()
        adapter = self.adapters.get(name) if name is not None else None
        key = self._key(adapter.base if adapter is not None else name, task)
        while True:
            served = self._loaded.get(key)
            if served is not None:
                served.in_flight += 1
                break
            loading = self._loading.get(key)
            if loading is None:
                if self.catalog is not None and key not in self._preloads:
                    # a request for the other task is its 400 before the load, which could unload an idle model
                    self._check_model_task(key, await off_loop(self.catalog.task, key), task)
                    if key in self._loaded or key in self._loading:  # loaded meanwhile: take that one
                        continue
                loading = self._loading[key] = asyncio.ensure_future(self._load(key))
            self._waiters[key] = self._waiters.get(key, 0) + 1
            try:
                served = await asyncio.shield(loading)  # a request that leaves does not end the others' load
            except asyncio.CancelledError:
                if loading.done() and not loading.cancelled() and loading.exception() is None:
                    self.release(loading.result())  # it had been given its hold
                elif key in self._waiters:
                    self._waiters[key] -= 1
                raise
            if self._loaded.get(key) is served:  # else unloaded before this request ran again: load it back
                break
            self.release(served)
        if keep_alive is not None:
            served.keep_alive = keep_alive
        else:
            served.keep_alive = served.default_keep_alive
        served.expires_at = None if served.keep_alive == FOREVER else time.time() + served.keep_alive
        served.last_used = time.monotonic()
        try:
            self._check_task(served, task)
        except APIError:
            self.release(served)
            raise
        return served if adapter is None else AdapterView(served, adapter.name)

    def release(self, served: ServedModel | AdapterView) -> None:
        """A request is done with it: once no request holds it, it unloads (keep_alive 0) or its keep_alive runs."""
        if isinstance(served, AdapterView):
            served = served.model
        served.in_flight -= 1
        served.last_used = time.monotonic()
        if served.in_flight > 0:
            return
        if served.keep_alive == 0:
            self._unload(served, "keep_alive 0")
        else:
            served.expires_at = None if served.keep_alive == FOREVER else time.time() + served.keep_alive
            self._changed.set()
        self._released.set()

    async def model_for(self, request: Request, name: str | None, task: str,
                        keep_alive: float | None = None) -> ServedModel | AdapterView:
        """acquire(), released once the request's response has been sent: for a stream, when it ends."""
        served = await self.acquire(name, task, keep_alive)
        request.scope[_HOLDS].append((self, served))
        return served

    def loaded(self) -> list[ServedModel]:
        """The models loaded, the most recently used first."""
        return sorted(self._loaded.values(), key=lambda m: m.last_used, reverse=True)

    def available(self) -> list[str]:
        """Every name this server serves: its preloaded models, then the catalog's, then any other loaded."""
        names = list(self._preloads) + (self.catalog.names() if self.catalog is not None else []) + list(self._loaded)
        return list(dict.fromkeys(names))

    def unload(self, name: str) -> None:
        """Unload the model a request names, now (Ollama's keep_alive 0 with no prompt) or when its last request
        ends; nothing when it is not loaded (it is never loaded to be unloaded)."""
        found = self.catalog.find(name) if self.catalog is not None else None
        served = next((self._loaded[c] for c in (name, name.removesuffix(":latest"), found) if c in self._loaded), None)
        if served is None:
            return
        served.keep_alive = 0
        if served.in_flight == 0:
            self._unload(served, "asked to")

    async def load_adapter(self, name: str, path: str) -> ServedAdapter:
        """Serve the LoRA adapter at path (read and checked off the event loop) as `name` on lora_base, loading
        that model if need be. A 400 for a name in use, a file that is no adapter for the model (the reader's
        message), every slot taken (--max-loras); vLLM's 404 for a path where there is nothing; a 403 unless
        --allow-lora-loading."""
        self._check_lora_loading()
        self.ready()
        if self.lora_base is None:
            raise APIError(400, "LoRA adapters run on the model `churon serve MODEL` preloads: this server preloads"
                           " none", param="lora_name")
        self._check_adapter_name(name)
        # before the base model is loaded back for it (which may unload other models to make room)
        if not await off_loop(_exists, Path(path).expanduser()):
            raise APIError(404, f"Loading lora {name} failed: No adapter found for {path}", param="lora_path",
                           code="lora_adapter_not_found", type="not_found_error")
        served = await self.acquire(self.lora_base, "generate")
        try:
            async with self._one_load:  # one change at a time, none while a model (and its adapters) loads
                self._check_adapter_name(name)  # another request may have taken it meanwhile
                try:  # read on a worker thread, into its slot between two steps
                    await served.engine.add_lora(name, Path(path).expanduser())
                except ModelFileError as e:  # names the file and tensor
                    raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from e
                except (ChuronError, ValueError, OSError) as e:  # every slot taken (--max-loras)
                    raise APIError(400, str(e), param="lora_name") from e
                adapter = self.adapters[name] = ServedAdapter(name, served.name, path)
        finally:
            self.release(served)
        log.info("LoRA adapter %s loaded from %s on %s", name, path, served.name)
        return adapter

    async def unload_adapter(self, name: str) -> None:
        """Serve the LoRA adapter `name` no more: a request naming it is a 404 from now on; those running with
        it finish with it. A 404 for a name that is no adapter's; a 403 unless --allow-lora-loading."""
        self._check_lora_loading()
        self.ready()
        async with self._one_load:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise APIError(404, f"The lora adapter {name!r} cannot be found (this server's:"
                               f" {', '.join(map(repr, self.adapters)) or 'none'})", param="lora_name",
                               code="lora_adapter_not_found", type="not_found_error")
            served = self._loaded.get(adapter.base)
            if served is not None and name in served.engine.lora_names():  # else its model left, or loaded back
                await served.engine.remove_lora(name)                      # without it (_serve)
        log.info("LoRA adapter %s unloaded", name)

    def _check_lora_loading(self) -> None:
        if not self.allow_lora_loading:
            raise APIError(403, "loading and unloading LoRA adapters at run time is off: start the server with"
                           " --allow-lora-loading (it has the server read the files its clients name)",
                           type="permission_error", code="lora_loading_disabled")

    def _adapters_of(self, name: str) -> list[ServedAdapter]:
        return [a for a in self.adapters.values() if a.base == name]

    def _check_adapter_name(self, name: str) -> None:
        if name in self.adapters:
            raise APIError(400, f"The lora adapter {name!r} has already been loaded: unload it first",
                           param="lora_name", code="lora_adapter_exists")
        if name in self.available():
            raise APIError(400, f"{name!r} is the name of a model this server serves: give the adapter another",
                           param="lora_name", code="lora_adapter_exists")

    def generation_engine(self) -> AsyncLLMEngine | None:
        """A text-generation model's engine (its stats for /metrics); None without one loaded."""
        return next((m.engine for m in self._loaded.values() if m.task == "generate"), None)  # type: ignore[return-value]

    # --- lookup ------------------------------------------------------------------------------------

    def _key(self, name: str | None, task: str) -> str:
        if name is None:
            served = list(self._loaded.values())
            first = next((m.name for m in served if m.task == task), None) or (served[0].name if served else None)
            first = first or next(iter(self._preloads), None)
            if first is None:
                raise APIError(400, f"give `model`: this server loads models by name ({self._names()})", param="model")
            return first
        for candidate in (name, name.removesuffix(":latest")):
            if candidate in self._loaded or candidate in self._preloads:
                return candidate
        found = self.catalog.find(name) if self.catalog is not None else None
        if found is not None:
            return found
        pull = self.catalog.not_pulled(name) if self.catalog is not None else None
        if pull is not None:
            raise APIError(404, f"the model {name!r} is not pulled yet: `churon pull {pull}` (or POST /api/pull)",
                           param="model", code="model_not_found", type="not_found_error")
        raise self.not_found(name)

    def not_found(self, name: str) -> APIError:
        """The 404 of a name this server does not serve, naming those it does."""
        return APIError(404, f"the model {name!r} does not exist: this server serves {self._names()}",
                        param="model", code="model_not_found", type="not_found_error")

    def _names(self) -> str:
        names = [*self.available(), *self.adapters]  # the LoRA adapters are models to a client too
        return " and ".join(repr(n) for n in names) or "no model yet (`churon pull NAME`)"

    def _check_task(self, served: ServedModel, task: str) -> None:
        self._check_model_task(served.name, served.task, task)

    def _check_model_task(self, name: str, model_task: str | None, task: str) -> None:
        """The 400 of a request for `task` naming a model of another task (None: not known yet)."""
        if model_task is None or model_task == task:
            return
        other = next((m.name for m in self._loaded.values() if m.task == task), None)
        if model_task == "embed":
            message = f"{name!r} is an embedding model; use /v1/embeddings"
        else:
            message = f"{name!r} is a text-generation model, not an embedding model"
        if other is not None:
            message += f" (this server's {_TASK_MODELS[task]} is {other!r})"
        elif task == "embed" and self.catalog is None:
            message += ": this server serves none (churon serve MODEL --embedding-model EMBEDDING_MODEL)"
        raise APIError(400, message, param="model", code="model_task_mismatch")

    # --- loading and unloading ---------------------------------------------------------------------

    async def _load(self, name: str) -> ServedModel:
        """Load `name` on the load thread, making room first; hand it to the requests waiting for it."""
        loop = asyncio.get_running_loop()
        try:
            async with self._one_load:
                if name in self._preloads:  # loaded back: as big as it was
                    load, plan = self._preloads[name], None
                    needed = self._sizes.get(name, 0)
                else:
                    plan = await loop.run_in_executor(self._loader, self.catalog.plan, name)
                    load, needed = (lambda: self.catalog.load(plan)), plan.resident_bytes
                await self._make_room(name, needed)
                started = time.perf_counter()
                adapters = self._adapters_of(name)  # loaded back: with its adapters
                served = await loop.run_in_executor(self._loader, self._load_served, name, load, plan, adapters)
                log.info("model %s loaded on demand in %.1f s (%d bytes)", name, time.perf_counter() - started,
                         served.size_bytes)
        except APIError:
            self._waiters.pop(name, None)
            raise
        except Exception as e:  # this request's error (a broken file, a model the machine cannot hold), never the server's
            self._waiters.pop(name, None)
            log.error("loading the model %s failed: %s", name, e)
            raise APIError(503, f"loading the model {name!r} failed: {type(e).__name__}: {e}", param="model",
                           type="service_unavailable", code="model_load_failed") from e
        finally:
            self._loading.pop(name, None)
        served.in_flight = self._waiters.pop(name, 0)  # the waiting requests hold it from here
        self._loaded[name] = served
        return served

    def _load_served(self, name: str, load: Callable[[], LLM], plan: LoadPlan | None,
                     adapters: list[ServedAdapter]) -> ServedModel:
        keep_alive = FOREVER if plan is None else self.policy.keep_alive
        return self._serve(name, load(), plan, keep_alive, adapters)

    def _serve(self, name: str, llm: LLM, plan: LoadPlan | None, keep_alive: float, adapters: list[ServedAdapter],
               preload: bool = False) -> ServedModel:
        """On the load thread: the loaded LLM, its LoRA adapters loaded, behind its engine's front end. An adapter
        that fails fails a preload (`churon serve --lora`: the operator's mistake, said at start); a model loaded
        back serves without one that fails now (its file changed or went away since), which it logs."""
        # a created model's ADAPTER came with the LLM (catalog.load), before the server's adapters are added
        lora = ADAPTER_LORA if ADAPTER_LORA in llm.lora_adapters else None
        if adapters and llm.task != "generate":
            raise ValueError(f"--lora: {name!r} is an embedding model; LoRA adapters are for text generation")
        for adapter in adapters:
            try:
                llm.load_lora(adapter.name, Path(adapter.path).expanduser())
            except Exception as e:
                if preload:
                    raise ModelFileError(f"LoRA adapter {adapter.name!r} ({adapter.path}): {e}") from e
                log.error("model %s loaded back without its LoRA adapter %s (%s): %s", name, adapter.name,
                          adapter.path, e)
                self.adapters.pop(adapter.name, None)  # under _one_load, which _load holds
        if llm.task == "embed":
            engine: AsyncLLMEngine | AsyncEmbeddingEngine = AsyncEmbeddingEngine(llm.embedder)
            size = llm.model.weight_bytes()
        else:
            self.admission.size_for(llm)
            engine = AsyncLLMEngine(llm.engine)
            size = llm.engine.memory_plan.total_bytes
        if plan is not None:  # counted as it was weighed before the load
            size = plan.resident_bytes
        else:
            self._sizes[name] = size
        log.info("model %s loaded (%s); serving (%s)", name, llm.task, llm.fingerprint)
        if plan is not None:
            created = plan.created
        else:  # `churon serve NAME` of a created model: its recipe is the routes' to apply
            created = get_model(name) if self.catalog is not None else None
        return ServedModel(name, llm, engine, size, created, default_keep_alive=keep_alive, keep_alive=keep_alive,
                           lora=lora)

    async def _make_room(self, name: str, needed: int) -> None:
        """Unload the least recently used idle models until `needed` bytes and one more model fit; wait (up to
        fit_timeout) for busy ones to go idle when unloading every idle one would not do."""
        budget, most = self.policy.memory, self.policy.max_loaded
        if needed > budget:
            raise APIError(503, f"the model {name!r} needs {needed} bytes, more than this server's budget of {budget}"
                           " bytes for all its models (--models-memory)", param="model", type="service_unavailable",
                           code="model_too_large")
        deadline = time.monotonic() + self.policy.fit_timeout
        while True:
            self._released.clear()
            loaded = sorted(self._loaded.values(), key=lambda m: m.last_used)
            in_use = sum(m.size_bytes for m in loaded)
            evict: list[ServedModel] = []
            for m in loaded:
                if in_use - sum(e.size_bytes for e in evict) + needed <= budget and len(loaded) - len(evict) < most:
                    break
                if m.in_flight == 0:
                    evict.append(m)
            freed = sum(e.size_bytes for e in evict)
            if in_use - freed + needed <= budget and len(loaded) - len(evict) < most:
                if evict:
                    log.info("loading %r needs %d bytes: %d of the budget of %d bytes (--models-memory) are in use by %d"
                             " models (at most %d, --max-loaded-models); unloading the least recently used idle: %s",
                             name, needed, in_use, budget, len(loaded), most,
                             ", ".join(f"{e.name!r} ({e.size_bytes} bytes)" for e in evict))
                for e in evict:
                    self._unload(e, f"to make room for {name!r}")
                return
            left = deadline - time.monotonic()
            busy = ", ".join(f"{m.name!r} ({m.size_bytes} bytes)" for m in loaded if m.in_flight)
            if left <= 0:
                raise APIError(503, f"no room for the model {name!r} ({needed} bytes): {in_use} of the budget of {budget}"
                               f" bytes (--models-memory) are in use, by models serving requests ({busy}); retry later",
                               param="model", type="service_unavailable", code="models_busy", headers={"Retry-After": "5"})
            log.info("loading %r needs %d bytes: %d of %d in use, by busy models (%s); waiting for one to go idle",
                     name, needed, in_use, budget, busy)
            try:
                await asyncio.wait_for(self._released.wait(), left)
            except TimeoutError:
                pass

    def _unload(self, served: ServedModel, why: str) -> None:
        """Forget it now; its engine stops on the load thread (before any load that comes after)."""
        if self._loaded.get(served.name) is served:
            del self._loaded[served.name]
        served.expires_at = None
        try:
            self._loader.submit(served.engine.shutdown)
        except RuntimeError:  # the server has shut down (a stream released it after): its load thread is gone
            served.engine.shutdown()
        log.info("model %s unloaded (%s); %d bytes freed", served.name, why, served.size_bytes)
        self._released.set()

    async def _unload_expired(self) -> None:
        while True:
            now, soonest = time.time(), math.inf
            for served in list(self._loaded.values()):
                if served.in_flight or served.expires_at is None:
                    continue
                if served.expires_at <= now:
                    self._unload(served, f"idle for its keep_alive of {served.keep_alive:g} s")
                else:
                    soonest = min(soonest, served.expires_at)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), None if soonest == math.inf else soonest - now)
            except TimeoutError:
                pass


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte: no file is there either
        return False


class ReleaseModels:
    """ASGI middleware: the models a request acquired with ServerState.model_for are released once its response
    has been sent, a stream's included, or once it failed or the client left."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holds = scope[_HOLDS] = []
        try:
            await self.app(scope, receive, send)
        finally:
            for state, served in holds:
                state.release(served)


def server_state(request: Request) -> ServerState:
    return request.app.state.server
