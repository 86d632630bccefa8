"""The LoRA adapters a server serves, each by a name a request's `model` may give (vLLM's rule: a request that
names an adapter runs on the adapter's base model, with that adapter).

    ServedAdapter  one adapter: its name, the served model it runs on, the file it is read from
    AdapterView    what a route gets for a request that names an adapter: the base model's LLM and engine
                   under the adapter's name (a response says the model its request named, as vLLM's do)
                   and `lora`, which start_generation sets in each of its engine requests' SamplingParams

ServerState keeps the server's adapters (`churon serve --lora`, POST /v1/load_lora_adapter) and loads each into
its base model's engine, whose LoraManager holds its weights in a slot; a base model unloaded (LRU, keep_alive)
and loaded back reads its adapters again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from churon.engine.async_engine import AsyncLLMEngine
    from churon.llm import LLM
    from churon.model_store import CreatedModel
    from churon.server.state import ServedModel


@dataclass(frozen=True)
class ServedAdapter:
    name: str  # what a request's `model` says
    base: str  # the served model it runs on
    path: str  # as it was given (GET /v1/models' `root`, as vLLM's)


@dataclass(frozen=True, eq=False)
class AdapterView:
    """A request's adapter on its base model, held as the base model is (ServerState.release takes either)."""

    model: ServedModel
    name: str  # the adapter's

    @property
    def lora(self) -> str:
        return self.name

    @property
    def llm(self) -> LLM:
        return self.model.llm

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.model.engine  # type: ignore[return-value]  # an adapter's model generates (ServerState._serve)

    @property
    def created(self) -> CreatedModel | None:
        return self.model.created

    @property
    def task(self) -> str:
        return self.model.task
