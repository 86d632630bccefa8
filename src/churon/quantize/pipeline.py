"""quantize_model: read a model (HF directory or GGUF), choose each tensor's type, quantize it with a
method, and write a GGUF that churon and llama.cpp both load; with a LoRA adapter, the merged model
(`churon export`: every tensor read already merged, quantize.lora).

    source -> types (mixed.py; a --target-bpw budget first runs a calibration without Hessians)
           -> per transformer block, in layer order: calibrate the block (calibration.calibrate_layerwise)
              -> method.transform(block tensors) -> method.quantize(each tensor) -> GGUF writer
           -> the tensors outside the blocks (the output matrix, calibrated on the final norm's output)

Tensors travel in llama.cpp's layout (llama attn_q / attn_k rows interleaved), as float32, one
transformer block at a time, whatever the source (quantize.source): memory holds one block's
weights, its calibration statistics (Hessians included) and the calibration windows' hidden states,
never the whole model.
"""

from __future__ import annotations

import itertools
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType
from tqdm import tqdm

from churon.config import EncoderConfig
from churon.errors import ModelFileError, UnsupportedModelError
from churon.formats.gguf import GGUFModel
from churon.formats.gguf_writer import FILE_TYPES, GGUFModelWriter, TensorSpec
from churon.formats.lora import LoraAdapter
from churon.formats.quants import quant_type, quantize
from churon.loader import open_model
from churon.quantize.calibration import ActivationStats, calibrate_layerwise, calibration_windows, collect_stats
from churon.quantize.mixed import FLOAT_TYPES, apply_keep, check_budget, default_type, parse_keep, spend_budget
from churon.quantize.lora import check_lora_scale, lora_for
from churon.quantize.source import SourceTensors


class QuantMethod(Protocol):
    name: str
    needs_calibration: bool  # the pipeline gathers stats via calibration.calibrate_layerwise when True
    needs_hessian: bool

    def transform(
        self, layer: dict[str, torch.Tensor], stats: dict[str, ActivationStats], qtypes: dict[str, str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Float32 tensors of one transformer block by GGUF name (incl. its norms), in llama.cpp's layout, and
        the type each will be written in; returns them possibly rewritten (AWQ folds per-channel scales into
        the preceding norm / weight). Identity for the others."""

    def quantize(self, name: str, w: torch.Tensor, qtype: str, stats: ActivationStats | None) -> np.ndarray:
        """w float32 [rows, cols] -> raw GGUF blocks (formats.quants.quantize, with importance where it helps)."""


def _methods() -> dict[str, Callable[[], QuantMethod]]:
    from churon.quantize.awq import AWQMethod
    from churon.quantize.gptq import GPTQMethod
    from churon.quantize.imatrix import ImatrixMethod
    from churon.quantize.rtn import RTNMethod

    return {"rtn": RTNMethod, "imatrix": ImatrixMethod, "awq": AWQMethod, "gptq": GPTQMethod}


METHODS: dict[str, Callable[[], QuantMethod]] = _methods()  # name -> factory (AWQ keeps per-run state)


def default_calibration_text() -> str:
    """The calibration text shipped with churon (varied prose, code and numbers)."""
    return (resources.files("churon") / "data" / "calibration.txt").read_text(encoding="utf-8")


@dataclass
class QuantizeReport:
    path: Path
    qtype: str
    method: str
    tensors: list[TensorSpec]
    seconds: float
    file_bytes: int
    kept: list[str] = field(default_factory=list)  # tensors whose type a --keep pattern set

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.tensors)

    @property
    def n_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        """Tensor bytes * 8 / parameters, over every tensor (norms included), as llama.cpp reports it."""
        return self.n_bytes * 8 / max(self.n_params, 1)

    def by_type(self) -> dict[str, tuple[int, int, int]]:
        """type name -> (tensors, parameters, bytes)."""
        out: dict[str, tuple[int, int, int]] = {}
        for t in self.tensors:
            count, params, size = out.get(t.qtype.name, (0, 0, 0))
            out[t.qtype.name] = (count + 1, params + int(np.prod(t.shape)), size + t.n_bytes)
        return out


def quantize_model(
    src: str | os.PathLike,
    out: str | os.PathLike,
    qtype: str | GGMLQuantizationType,
    method: str = "rtn",
    calib_text: str | None = None,
    keep: Iterable[str] | dict[str, str] | None = None,
    target_bpw: float | None = None,
    progress: bool = True,
    pure: bool = False,
    lora: LoraAdapter | str | os.PathLike | None = None,
    lora_scale: float = 1.0,
) -> QuantizeReport:
    """Quantize model `src` (registry name, HF directory or GGUF file) to the GGUF file `out`.

    qtype: the type of the 2-D weights (see mixed.py for the exceptions llama.cpp makes; pure=True makes none).
    method: "rtn", "imatrix", "awq" or "gptq". calib_text: calibration text for the methods that need it and
    for target_bpw (default: churon's own). keep: "PATTERN=TYPE" items, glob patterns over GGUF tensor names.
    target_bpw: spend bits up to this many per weight on the tensors most sensitive on the calibration text.
    lora: a LoRA adapter (PEFT directory, GGUF adapter or one read for this model) merged into the weights
    before anything else sees them: W + lora_scale * s * B @ A (types, calibration and rounding all work on
    the merged model). A mismatched adapter is an error before the output file is opened.
    """
    start = time.perf_counter()
    qtype = quant_type(qtype)
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of: {', '.join(METHODS)}")
    keep_rules = parse_keep(keep)
    if target_bpw is not None and not target_bpw > 0:
        raise ValueError(f"--target-bpw must be positive, got {target_bpw}")
    lora_scale = check_lora_scale(lora_scale)
    quantizer = METHODS[method]()
    out = Path(out)
    if out.is_dir() or not out.parent.is_dir():
        raise ModelFileError(f"{out}: cannot write the output file there (a directory, or its directory does not exist)")
    source = open_model(src)
    if isinstance(source, GGUFModel) and out.resolve() == Path(source.path).resolve():
        raise ValueError(f"{out}: the output would overwrite the source model")
    if isinstance(lora, (str, os.PathLike)) and out.resolve() == Path(lora).resolve():
        raise ValueError(f"{out}: the output would overwrite the LoRA adapter")
    source.check_types()
    c = source.config
    encoder = isinstance(c, EncoderConfig)
    calibrates = quantizer.needs_calibration or target_bpw is not None
    needs = f"method {method!r}" if quantizer.needs_calibration else "--target-bpw"
    if encoder and calibrates:  # calibration runs a decoder
        raise UnsupportedModelError(
            f"{source.path}: {needs} calibrates on a decoder's forward pass; an encoder ({c.architecture}) is"
            " written with rtn only: F32, F16, Q8_0 or another type with method 'rtn' and no --target-bpw")
    if not encoder and c.num_experts and calibrates:
        raise UnsupportedModelError(
            f"{source.path}: {needs} calibrates on the inputs of every linear layer, which churon does not gather for"
            f" a mixture-of-experts model's routed experts ({c.num_experts} per MoE layer, {c.num_experts_per_tok}"
            " active per token); quantize it with method 'rtn' and no --target-bpw")
    adapter = lora_for(source, lora) if lora is not None else None
    tensors = SourceTensors(source, adapter, lora_scale)

    no_output = encoder or c.tie_word_embeddings  # llama-quantize then gives token_embd the output's type
    types = {n: default_type(n, s, qtype, c.num_layers, no_output, pure) for n, s in tensors.shapes.items()}
    kept = apply_keep(types, tensors.shapes, keep_rules)
    if target_bpw is not None:
        check_budget(types, tensors.shapes, target_bpw)
    windows: list[list[int]] = []
    if calibrates:
        text = calib_text if calib_text is not None else default_calibration_text()
        windows = calibration_windows(source, text)
    all_stats: dict[str, ActivationStats] = {}
    if target_bpw is not None:
        all_stats = collect_stats(tensors, windows, hessian=False, progress=progress)  # no Hessians: small
        with _single_threaded_torch():
            candidates = [n for n, t in types.items() if len(tensors.shapes[n]) >= 2 and n not in kept]
            types = spend_budget(
                types, tensors.shapes, candidates, target_bpw, tensors.read,
                lambda n: all_stats[n].mean_sq.float() if n in all_stats else None,
                lambda names: tqdm(names, desc="sensitivity", unit="tensor", disable=not progress))

    # blocks in layer order, then the tensors outside them (the output matrix's inputs are known last);
    # the writer puts each at its place in the file
    groups = [tensors.block(i) for i in range(c.num_layers)]
    groups.append([n for n in tensors.order if not n.startswith("blk.")])
    calibrating = quantizer.needs_calibration and (quantizer.needs_hessian or not all_stats)
    if calibrating:
        group_stats: Iterator[dict[str, ActivationStats]] = calibrate_layerwise(tensors, windows, quantizer.needs_hessian)
    else:  # no statistics needed, or the budget's (without Hessians) serve
        group_stats = itertools.repeat(all_stats)
    specs = [TensorSpec(n, tensors.shapes[n], types[n]) for n in tensors.order]
    with GGUFModelWriter(out, source, specs, FILE_TYPES[qtype]) as writer:
        bar = tqdm(total=len(specs), desc="quantize", unit="tensor", disable=not progress)
        for i, group in enumerate(groups):
            if calibrating:
                bar.set_postfix_str(f"calibrating blk.{i}" if i < c.num_layers else "calibrating output")
            stats = next(group_stats)  # the block's forward on the calibration windows: every torch thread
            bar.set_postfix_str("")
            transform = quantizer.transform if i < c.num_layers else None
            with _single_threaded_torch():
                for name, raw in _quantize_group(group, tensors, types, stats, quantizer, transform):
                    writer.write(name, raw)
                    bar.update(1)
            del stats  # before the next block is calibrated: one block's statistics at a time
        bar.close()
    return QuantizeReport(out, qtype.name, method, specs, time.perf_counter() - start, out.stat().st_size,
                          sorted(kept))


def _quantize_group(
    group: list[str], tensors: SourceTensors, types: dict[str, GGMLQuantizationType],
    stats: dict[str, ActivationStats], quantizer: QuantMethod, transform: Callable | None,
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, raw GGUF bytes) of each tensor of one group; the group's float weights live only in here."""
    layer = {n: tensors.read(n) for n in group}
    if transform is not None:
        layer = transform(layer, stats, {n: types[n].name for n in group})
    for name in group:
        w, t = layer.pop(name), types[name]
        if t in FLOAT_TYPES or w.dim() < 2:  # nothing to round: no method involved
            yield name, quantize(w.reshape(-1, w.shape[-1]), t)
        else:  # an MoE layer's stacked experts [experts, rows, cols] as rows: blocks run along a row either way
            yield name, quantizer.quantize(name, w.reshape(-1, w.shape[-1]), t.name, stats.get(name))


@contextmanager
def _single_threaded_torch() -> Iterator[None]:
    """Quantizing is many small elementwise passes over chunks of a tensor: with several torch threads
    the synchronisation costs more than the work (17x slower with 2 threads on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
