"""churon: an LLM inference engine.

    from churon import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    print(llm.generate(["The capital of France is"], SamplingParams(temperature=0))[0].text)
"""

from churon.engine import CompletionOutput
from churon.errors import ChuronError, ContextLengthError, ModelFileError, UnsupportedModelError
from churon.llm import LLM
from churon.loader import load_model
from churon.sampling import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "CompletionOutput",
    "load_model",
    "ChuronError",
    "ContextLengthError",
    "ModelFileError",
    "UnsupportedModelError",
]
