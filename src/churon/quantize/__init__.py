"""Quantization: HF or GGUF model -> GGUF file of chosen types, by round-to-nearest, imatrix, AWQ or GPTQ."""

from churon.quantize.pipeline import METHODS, QuantizeReport, quantize_model

__all__ = ["METHODS", "QuantizeReport", "quantize_model"]
