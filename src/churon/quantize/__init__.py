"""Quantization: HF or GGUF model -> GGUF file of chosen types, by round-to-nearest, imatrix, AWQ or GPTQ;
a LoRA adapter merged in on the way (`churon export`), or written alone as a llama.cpp GGUF adapter."""

from churon.quantize.lora import export_adapter
from churon.quantize.pipeline import METHODS, QuantizeReport, quantize_model

__all__ = ["METHODS", "QuantizeReport", "export_adapter", "quantize_model"]
