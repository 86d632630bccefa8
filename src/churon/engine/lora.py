"""LoraManager: the LoRA adapters an engine has loaded, by name, and the slots they hold.

The model holds up to max_loras adapters at once, each in a slot (model/lora.py's LoraSlots); a step's
tokens each name their request's slot, so requests of different adapters and of none run in one batch.
A request names its adapter (SamplingParams.lora): add_request resolves the name and the request holds
the adapter until it leaves the engine (finished, aborted or failed).

remove() makes a name stop resolving at once, so new requests get a clear error, but the adapter keeps
its slot until its last request ends: only then is the slot unloaded and free for another adapter. A
request running when its adapter is removed therefore completes exactly as it would have.

Every load gets a uid of its own, so a name loaded again is another adapter. The prefix cache chains a
sequence's block hashes from a seed of (uid, lora_scale): a block computed under one adapter, or one
scale, is never reused under another. Requests without an adapter have no seed and keep the hashes
they always had.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from churon.errors import ChuronError
from churon.formats.lora import read_lora

if TYPE_CHECKING:
    from churon.formats.lora import LoraAdapter
    from churon.model.transformer import Transformer

_next_uid = itertools.count(1)


class UnknownLoraError(ChuronError, ValueError):
    """A request or an unload names an adapter that is not loaded."""


def unknown_lora(name: str, loaded: Iterable[str]) -> UnknownLoraError:
    loaded = list(loaded)
    return UnknownLoraError(
        f"no LoRA adapter named {name!r} is loaded ({'loaded: ' + ', '.join(loaded) if loaded else 'none is loaded'})"
    )


@dataclass(eq=False)
class LoadedLora:
    name: str
    slot: int
    uid: int  # unique per load in this process: what the prefix cache tells adapters apart by
    adapter: LoraAdapter
    num_requests: int = 0  # waiting or running requests that use it
    removed: bool = False  # resolves no more; its slot is unloaded when num_requests reaches 0

    def hash_seed(self, scale: float) -> int:
        """The first parent hash of a block-hash chain computed under this adapter at this scale."""
        h = hashlib.blake2b(digest_size=8, person=b"churon-lora")
        h.update(struct.pack("<qd", self.uid, scale))
        return int.from_bytes(h.digest(), "little")


class LoraManager:
    """name -> loaded adapter, over the model's LoRA slots. Not thread-safe: the engine's caller serializes it."""

    def __init__(self, model: Transformer, max_loras: int, max_rank: int):
        if model.lora is not None:  # two managers would hand out the same slots
            raise RuntimeError("this model's LoRA slots already belong to another engine: load the model once per engine")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.slots = model.enable_lora(max_loras)
        self._by_name: dict[str, LoadedLora] = {}
        self._by_slot: dict[int, LoadedLora] = {}  # every slot in use: removed adapters still finishing included
        # the loaded names, replaced (never changed) on each load and removal: one attribute read is a
        # consistent snapshot for a thread that does not hold the engine's lock
        self.names: tuple[str, ...] = ()

    def add(self, name: str, source: str | os.PathLike | LoraAdapter) -> LoadedLora:
        """Load an adapter (a PEFT directory, a GGUF adapter, or one read already) under name into a free slot."""
        slot = self.free_slot(name)
        if isinstance(source, (str, os.PathLike)):
            adapter = read_lora(source, self.model.config, self.max_rank)
        else:  # read already (AsyncLLMEngine reads the file outside its lock)
            adapter = source
            adapter.check(self.model.config, self.max_rank)
        self.slots.load(slot, adapter)
        lora = LoadedLora(name, slot, next(_next_uid), adapter)
        self._by_name[name] = self._by_slot[slot] = lora
        self.names = tuple(self._by_name)
        return lora

    def remove(self, name: str) -> None:
        """name stops resolving now; its slot is freed now, or when the last request using it ends."""
        lora = self._by_name.pop(name, None)
        if lora is None:
            raise unknown_lora(name, self._by_name)
        self.names = tuple(self._by_name)
        lora.removed = True
        if lora.num_requests == 0:
            self._unload(lora)

    def get(self, name: str) -> LoadedLora:
        """The adapter a new request names (hold() it once the request is accepted)."""
        lora = self._by_name.get(name)
        if lora is None:
            raise unknown_lora(name, self._by_name)
        return lora

    def hold(self, lora: LoadedLora) -> None:
        """A request using lora entered the engine; release(its slot) when it leaves."""
        lora.num_requests += 1

    def release(self, slot: int) -> None:
        """A request that held the adapter in slot left the engine."""
        lora = self._by_slot[slot]
        lora.num_requests -= 1
        if lora.removed and lora.num_requests == 0:
            self._unload(lora)

    def _unload(self, lora: LoadedLora) -> None:
        del self._by_slot[lora.slot]
        self.slots.unload(lora.slot)

    def free_slot(self, name: str) -> int:
        """The slot add(name, ...) would load into; raises for a bad or taken name, or when every slot is in use."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter's name must be a non-empty string, got {name!r}")
        if name in self._by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already: unload it first")
        free = next((s for s in range(self.max_loras) if s not in self._by_slot), None)
        if free is None:
            removed = [f"{x.name} (unloads once its {x.num_requests} requests end)" for x in self._by_slot.values() if x.removed]
            raise ValueError(
                f"cannot load LoRA adapter {name!r}: max_loras={self.max_loras} adapters are loaded"
                f" ({', '.join(list(self._by_name) + removed)}); unload one, or raise max_loras"
            )
        return free
