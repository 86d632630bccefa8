"""Quantization quality: churon's methods against llama.cpp's quantizer on SmolLM2-135M-Instruct.

    python benchmarks/bench_quantize.py [--types Q4_0,Q4_K] [--methods rtn,imatrix,awq,gptq] [--max-windows N]
                                        [--stats FILE] [--json FILE]

1. reference: the registry's SmolLM2 Q4_1 GGUF dequantized and written as an F32 GGUF (churon quantize --type F32);
   every quantized model below starts from that same file, and is judged against it;
2. llama.cpp: llama_cpp.llama_model_quantize with llama_model_quantize_default_params() and ftype Q4_0, or
   Q4_K_M for Q4_K (churon's Q4_K mix follows Q4_K_M). No importance matrix: llama-cpp-python can only hand
   the C++ quantizer a pointer to a std::unordered_map, which Python cannot build, so llama.cpp runs its
   plain round-to-nearest search here;
3. churon: quantize_model with each method, every tensor given the type llama.cpp chose for it (so both
   files have the same size to the byte); calibration on churon's default text, collected once (with
   the Hessian) and shared by all methods;
4. evaluation: GPL-3 (tests/data/GPL-3, a copy of Debian's /usr/share/common-licenses/GPL-3) in windows of
   512 tokens, scored as llama-perplexity --kl-divergence does (churon.evaluation), every model run by
   churon's native kernels: perplexity, mean / p99 KL(reference || model), top-1 agreement.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from churon import kernels
from churon.evaluation import ComparisonAccumulator, text_windows, window_logits
from churon.formats.gguf import GGUFFile
from churon.loader import load_model
from churon.quantize import pipeline
from churon.quantize.calibration import collect_stats
from churon.registry import resolve_model

import llamacpp_peer as peer

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "GPL-3"
LLAMA_FTYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def llama_quantize(src: Path, out: Path, qtype: str, threads: int) -> None:
    llama_cpp = peer.import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_FTYPES[qtype])
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {qtype}) returned {rc}")


def tensor_types(path: Path) -> dict[str, str]:
    """GGUF name -> type name of every 2-D tensor."""
    return {t.name: t.qtype.name for t in GGUFFile.open(path).tensors.values() if len(t.shape) >= 2}


def bits_per_weight(path: Path) -> float:
    tensors = GGUFFile.open(path).tensors.values()
    return sum(t.n_bytes for t in tensors) * 8 / sum(t.n_elements for t in tensors)


def share_calibration(saved: Path | None) -> None:
    """Collect the calibration statistics once (Hessians of every layer included) and hand the same ones to
    every run instead of its block-by-block calibration; with `saved`, keep them in that file for later runs
    (about 0.8 GB for SmolLM2)."""
    cache: dict = {}
    if saved is not None and saved.exists():
        cache["stats"] = torch.load(saved, weights_only=False)

    def cached(tensors, windows, hessian):
        if "stats" not in cache:
            t0 = time.perf_counter()
            cache["stats"] = collect_stats(tensors.source, windows, hessian=True, progress=False)
            print(f"calibration: {time.perf_counter() - t0:.0f} s", flush=True)
            if saved is not None:
                torch.save(cache["stats"], saved)
        return itertools.repeat(cache["stats"])  # every group looks its tensors up by name

    pipeline.calibrate_layerwise = cached


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default="Q4_0,Q4_K")
    parser.add_argument("--methods", default="rtn,imatrix,awq,gptq")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/churon-bench-quantize"))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--stats", type=Path, default=None, help="calibration statistics: read if present, else saved there")
    args = parser.parse_args(argv[1:])
    types, methods = args.types.split(","), args.methods.split(",")
    args.workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    if kernels.cpu is not None:
        kernels.cpu.set_num_threads(args.threads)

    reference = args.workdir / "smollm2-f32.gguf"
    if not reference.exists():
        pipeline.quantize_model(resolve_model("smollm2-135m"), reference, "F32", pure=True, progress=False)
    share_calibration(args.stats)

    rows = []  # (label, type, path, quantize seconds)
    for qtype in types:
        out = args.workdir / f"llamacpp-{qtype}.gguf"
        t0 = time.perf_counter()
        llama_quantize(reference, out, qtype, args.threads)
        rows.append((f"llama.cpp {LLAMA_FTYPES[qtype].removeprefix('LLAMA_FTYPE_MOSTLY_')}", qtype, out,
                     time.perf_counter() - t0))
        keep = tensor_types(out)
        for method in methods:
            path = args.workdir / f"churon-{qtype}-{method}.gguf"
            report = pipeline.quantize_model(reference, path, qtype, method=method, keep=keep, progress=False)
            assert tensor_types(path) == keep, "churon's tensor types must be llama.cpp's"
            rows.append((f"churon {method}", qtype, path, report.seconds))
            print(f"{qtype} {method}: {report.seconds:.0f} s", flush=True)

    torch.set_num_threads(1)  # the native kernels run their own pool
    ref_model, tokenizer, _ = load_model(reference, kernels="native")
    tokens = tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_bos=False)
    windows = text_windows(tokens, args.ctx, args.max_windows, bos_id=tokenizer.bos_id if tokenizer.add_bos else None)
    models = [load_model(path, kernels="native")[0] for _, _, path, _ in rows]
    accs = [ComparisonAccumulator() for _ in rows]
    t0 = time.perf_counter()
    for i, window in enumerate(windows):
        ref_logits = window_logits(ref_model, window)
        for model, acc in zip(models, accs):
            acc.add_window(ref_logits, window_logits(model, window), window)
        print(f"window {i + 1}/{len(windows)} ({time.perf_counter() - t0:.0f} s)", flush=True)

    results = []
    header = f"{'model':<20} {'type':<5} {'size':>10} {'bpw':>6} {'PPL':>8} {'mean KL':>9} {'p99 KL':>8} {'top-1':>7} {'quantize':>9}"
    lines = [header, "-" * len(header)]
    ppl_ref = None
    for (label, qtype, path, seconds), acc in zip(rows, accs):
        c = acc.result()
        ppl_ref = c.ppl_ref
        size = path.stat().st_size
        bpw = bits_per_weight(path)
        lines.append(f"{label:<20} {qtype:<5} {size / 2**20:>6.2f} MiB {bpw:>6.3f} {c.ppl_test:>8.4f} {c.mean_kl:>9.6f} "
                     f"{c.p99_kl:>8.5f} {100 * c.top1_agreement:>6.2f}% {seconds:>7.0f} s")
        results.append({"model": label, "type": qtype, "file_bytes": size, "bits_per_weight": bpw,
                        "quantize_seconds": seconds, **c.as_dict()})
    print(f"\nreference: {reference.name}, PPL {ppl_ref:.4f}; {TEXT}: {len(tokens)} tokens, {len(windows)} windows "
          f"of {args.ctx}, {accs[0].result().n_tokens} scored")
    print("\n".join(lines))
    if args.json:
        command = " ".join(["python", "benchmarks/bench_quantize.py", *map(shlex.quote, argv[1:])])
        args.json.write_text(json.dumps({"command": command, "reference_ppl": ppl_ref, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
