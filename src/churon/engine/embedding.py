"""EmbeddingEngine: inputs -> one vector each, batched as generation is but without a KV cache.

An embedding is one forward over a whole input: no decode steps and nothing kept between calls. The engine
packs inputs of different lengths back to back into one forward up to the step's token budget
(EngineConfig.max_num_batched_tokens; an input longer than the budget runs alone), runs the model and pools
each input's rows (model/pooling.py). No KV-cache blocks are taken: an encoder attends within the packed
batch itself; a decoder writes its keys and values into a scratch cache the size of the step, dropped after.

AsyncEmbeddingEngine runs it on a thread of its own for the server, so that the inputs of concurrent
requests share forwards.
"""

from __future__ import annotations

import asyncio
import numbers
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from churon.config import EngineConfig, PoolingConfig
from churon.engine.kv_cache import PagedKVCache
from churon.errors import ContextLengthError
from churon.model.batch import ForwardBatch, PackedBatch, SequenceChunk
from churon.model.encoder import Encoder
from churon.model.pooling import pool
from churon.model.transformer import Transformer


class EmbeddingEngine:
    """Not thread-safe: one caller at a time (AsyncEmbeddingEngine serializes the server's)."""

    def __init__(self, model: Encoder | Transformer, pooling: PoolingConfig, max_length: int, config: EngineConfig):
        self.model = model
        self.pooling = pooling
        self.max_length = max_length  # the most tokens one input may have
        self.config = config
        self.vocab_size = model.config.vocab_size

    @property
    def dimensions(self) -> int:
        return self.model.config.hidden_size

    def check_input(self, ids: Sequence[int]) -> None:
        """Raise ValueError (ContextLengthError when too long) for an input that cannot be embedded."""
        if len(ids) == 0:
            raise ValueError("an input is empty: give at least one token")
        bad = None
        if min(ids) < 0 or max(ids) >= self.vocab_size:  # one pass each in C; the culprit looked for only then
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
        if bad is not None:
            raise ValueError(f"input token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(ids) > self.max_length:
            raise ContextLengthError(
                f"an input has {len(ids)} tokens, more than the {self.max_length} this model embeds;"
                " shorten it or ask for truncation (nothing was truncated)"
            )

    def prepare(self, ids: Sequence[int], truncate: bool = False) -> list[int]:
        """ids as the engine runs them: checked, cut to max_length first when truncate."""
        if all(type(t) is int for t in ids):  # the common case, without numbers.Integral's ABC check per token
            ids = list(ids)
        else:
            if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
                bad = next(t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral))
                raise ValueError(f"input token id {bad!r:.40} is not an integer")
            ids = [int(t) for t in ids]
        if truncate:
            ids = ids[: self.max_length]
        self.check_input(ids)
        return ids

    def embed(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """float32 [inputs, dimensions], in input order; every input checked before any runs."""
        inputs = [self.prepare(ids) for ids in inputs]
        if not inputs:
            return torch.empty(0, self.dimensions)
        out = torch.empty(len(inputs), self.dimensions)
        for indices in self.batches([len(ids) for ids in inputs]):
            out[indices] = self.forward([inputs[i] for i in indices])
        return out

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Input indices per forward: consecutive inputs up to the token budget (a longer input alone)."""
        budget = self.config.max_num_batched_tokens
        out: list[list[int]] = []
        tokens = budget + 1
        for i, n in enumerate(lengths):
            if tokens + n > budget:
                out.append([])
                tokens = 0
            out[-1].append(i)
            tokens += n
        return out

    def forward(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """One forward over prepared inputs: their pooled vectors, float32 [inputs, dimensions]."""
        if isinstance(self.model, Encoder):
            packed = PackedBatch.build(inputs)
            return pool(self.model.forward(packed), packed.seq_starts.tolist(), self.pooling)
        return self._decoder_forward(inputs)

    def _decoder_forward(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """A decoder's causal forward, every input on its own blocks of a scratch cache that is dropped after."""
        block_size = self.config.block_size
        chunks, first = [], 0
        for ids in inputs:
            blocks = -(-len(ids) // block_size)
            chunks.append(SequenceChunk(ids, 0, range(first, first + blocks), all_logits=True))
            first += blocks
        batch = ForwardBatch.build(chunks, block_size)
        cache = PagedKVCache(self.model.config, first, block_size, self.model.kv_dtype)
        return pool(self.model.hidden_states(batch, cache), batch.query_start, self.pooling)


@dataclass
class _Job:
    """One call's inputs, its vectors as they come, and the future its caller awaits."""

    inputs: list[list[int]]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    vectors: list[list[float] | None] = field(default_factory=list)
    taken: int = 0  # inputs handed to a forward so far
    done: int = 0
    failed: bool = False  # a forward of its failed: its other inputs are not run


class AsyncEmbeddingEngine:
    """The server's front end of an EmbeddingEngine: a thread runs forwards over the queued inputs of every
    waiting request, taking them round-robin across requests (a large request does not hold up small ones)."""

    def __init__(self, engine: EmbeddingEngine):
        self.engine = engine
        self._jobs: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="churon-embedding", daemon=True)
        self._thread.start()

    async def embed(self, inputs: Sequence[Sequence[int]], truncate: bool = False) -> list[list[float]]:
        """The inputs' vectors, in order. Raises ValueError (ContextLengthError) before queueing anything."""
        prepared = [self.engine.prepare(ids, truncate) for ids in inputs]
        if not prepared:
            return []
        loop = asyncio.get_running_loop()
        job = _Job(prepared, loop.create_future(), loop, vectors=[None] * len(prepared))
        with self._wake:
            if self._stopped or not self._thread.is_alive():
                raise RuntimeError("the embedding engine has shut down")
            self._jobs.append(job)
            self._wake.notify()
        return await job.future  # a cancelled caller's future is skipped by the thread

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    def _take(self) -> list[tuple[_Job, int]]:
        """The next forward's inputs, round-robin over the waiting jobs up to the token budget."""
        budget = self.engine.config.max_num_batched_tokens
        taken: list[tuple[_Job, int]] = []
        tokens = 0
        while self._jobs:
            job = self._jobs.popleft()
            if job.failed or job.future.done():  # a forward of its failed, or its caller left
                continue
            n = len(job.inputs[job.taken])
            if taken and tokens + n > budget:
                self._jobs.appendleft(job)
                break
            taken.append((job, job.taken))
            job.taken += 1
            tokens += n
            if job.taken < len(job.inputs):
                self._jobs.append(job)
        return taken

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # a bug here: fail every waiting request rather than leave it hanging
            with self._wake:
                self._stopped = True
                jobs, self._jobs = list(self._jobs), deque()
            for job in jobs:
                _resolve(job, _fail, e)
            raise

    def _step(self) -> bool:
        """Run one forward over the waiting inputs; False once shut down."""
        with self._wake:
            while not self._jobs and not self._stopped:
                self._wake.wait()
            if self._stopped:
                for job in self._jobs:
                    _resolve(job, _fail, RuntimeError("the embedding engine has shut down"))
                return False
            work = self._take()
        if not work:
            return True
        jobs = list({id(j): j for j, _ in work}.values())
        try:
            vectors = self.engine.forward([job.inputs[i] for job, i in work]).tolist()
        except Exception as e:  # the forward itself failed: every request in it hears why
            for job in jobs:
                job.failed = True
                _resolve(job, _fail, e)
            return True
        for (job, i), vector in zip(work, vectors):
            job.vectors[i] = vector
            job.done += 1
            if job.done == len(job.inputs):
                _resolve(job, _succeed, job.vectors)
        return True


def _resolve(job: _Job, how, value) -> None:
    """Settle a job's future on its caller's loop; a loop that has closed (its caller gave up) has no one to tell."""
    try:
        job.loop.call_soon_threadsafe(how, job.future, value)
    except RuntimeError:
        pass


def _succeed(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
