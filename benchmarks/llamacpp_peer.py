"""llama.cpp, through llama-cpp-python, as the peer the benchmark scripts measure churon against.

What the scripts share, so that every figure and record drives llama.cpp the same way: the import (with
the command that installs it), the Llama they build, the version they report, evaluating a token window
from an empty KV cache, and reading logits straight out of llama.cpp's buffer.

    import llamacpp_peer as peer       # `python benchmarks/SCRIPT.py` puts benchmarks/ first on sys.path

    llm = peer.load(gguf, threads=2, n_ctx=512, n_batch=512, logits_all=True)
    logits = peer.window_logits(llm, window)   # (len(window), n_vocab) float32, every position
    peer.version()                     # "0.3.36", recorded next to each figure
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import llama_cpp

DISTRIBUTION = "llama_cpp_python"  # what pip installs as llama-cpp-python; its module is llama_cpp


def child_env(site: Path | None) -> dict[str, str]:
    """The environment for a child process that measures llama.cpp: this one's, with `site` (a directory where
    another llama-cpp-python build is installed, pip install --target) first on its sys.path when given."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return env


def import_llama_cpp() -> ModuleType:
    """The llama_cpp module. Imported on first use, not at the top of a script, so that the churon-only parts
    of a benchmark run without it; missing, it says how to install it."""
    try:
        import llama_cpp
    except ModuleNotFoundError as e:
        if e.name != "llama_cpp":  # one of its own dependencies: that message is the clearer one
            raise
        raise ModuleNotFoundError("the llama.cpp peer needs llama-cpp-python: pip install llama-cpp-python",
                                  name=e.name) from e
    return llama_cpp


def version() -> str | None:
    """llama-cpp-python's version, as the records report it (None where it is not installed). Read from the
    package metadata, so asking does not load libllama into a process that does not run it; importlib.metadata
    is imported here, not above, so that it stays out of a phase's peak memory (bench_batching asks after).
    """
    from importlib.metadata import PackageNotFoundError, version as package_version

    try:
        return package_version(DISTRIBUTION)
    except PackageNotFoundError:
        return None


def load(model_path: str | Path, *, threads: int | None = None, n_ctx: int | None = None,
         n_batch: int | None = None, logits_all: bool = False, vocab_only: bool = False) -> llama_cpp.Llama:
    """A llama_cpp.Llama on the GGUF at model_path, without llama.cpp's log on stderr. A setting left None
    keeps llama-cpp-python's default.

    threads: both n_threads (decoding) and n_threads_batch (prompt processing): churon is given one count.
    n_batch: n_ubatch too, so that llama.cpp computes an eval of up to n_batch tokens in one pass rather than
      in micro-batches of the default n_ubatch.
    logits_all: keep every position's logits (Llama.scores), not only the last one's.
    vocab_only: the tokenizer alone, no weights."""
    settings: dict = {}
    if threads is not None:
        settings.update(n_threads=threads, n_threads_batch=threads)
    if n_ctx is not None:
        settings["n_ctx"] = n_ctx
    if n_batch is not None:
        settings.update(n_batch=n_batch, n_ubatch=n_batch)
    return import_llama_cpp().Llama(str(model_path), logits_all=logits_all, vocab_only=vocab_only, verbose=False,
                                    **settings)


def prefill(llm: llama_cpp.Llama, tokens: Sequence[int]) -> None:
    """Evaluate `tokens` from an empty KV cache, as churon computes a prompt with no prefix cached."""
    llm.reset()  # n_tokens = 0: eval() then drops every KV cell before it decodes
    llm.eval(tokens)


def window_logits(llm: llama_cpp.Llama, window: Sequence[int]) -> np.ndarray:
    """Every position's logits for `window`, evaluated from an empty KV cache: (len(window), n_vocab) float32,
    a copy. Needs a Llama loaded with logits_all=True (otherwise llama.cpp keeps only the last row)."""
    prefill(llm, window)
    assert llm.n_tokens == len(window)
    return np.array(llm.scores[: len(window)], dtype=np.float32)


def logits_ith(ctx, i: int, n_vocab: int) -> np.ndarray:
    """Row i of the logits the last llama_decode on ctx (a llama_context pointer) computed, -1 for its last
    row: a numpy view of llama.cpp's own buffer, so reading it costs no copy inside a timed loop; it holds
    until the next decode overwrites it."""
    ptr = import_llama_cpp().llama_get_logits_ith(ctx, i)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,))
