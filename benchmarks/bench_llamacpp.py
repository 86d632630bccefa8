"""churon vs llama.cpp (llama-cpp-python) on one GGUF (SmolLM2-135M-Instruct Q4_1 by default; --model gemma3-270m
for Gemma 3 270M Q4_K_M), side by side in one run.

Same GGUF, same thread count, batch 1:
  pp128, pp512  prompt processing tokens/s: one full prefill of a 128- / 512-token prompt on an empty cache
  tg128         generation tokens/s: 128 greedy tokens, one at a time, after an 8-token prompt
plus Hugging Face transformers in bf16 (the same GGUF, dequantized) prefilling the 512-token prompt.
The prompts are the first tokens of the GNU GPL v3 (tests/data/GPL-3, a copy of Debian's
/usr/share/common-licenses/GPL-3), tokenized by churon.
Each figure is the median of --repeats runs after one warm-up; the ratios are churon / peer.

    pip install llama-cpp-python transformers accelerate
    python benchmarks/bench_llamacpp.py --threads 2 [--model NAME|PATH] [--churon-dtype bfloat16] [--kernels ...] [--json out.json]

churon is timed through its public API (LLM.generate and its metrics), llama.cpp through
Llama.eval (prefill: one eval of the prompt; decode: eval([token]) plus an argmax per step).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from churon import LLM, SamplingParams  # noqa: E402
from churon.registry import resolve_model  # noqa: E402

import llamacpp_peer as peer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT_PATH = ROOT / "tests" / "data" / "GPL-3"
PP_SIZES = (128, 512)
TG_TOKENS = 128
TG_PROMPT = 8


def median_rate(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    runs = [fn() for _ in range(repeats)]
    return statistics.median(runs), runs


# ---------------------------------------------------------------- churon

def churon_llm(path: Path, args) -> tuple[LLM, dict]:
    # no prefix cache: every timed prefill computes its whole prompt, as llama.cpp's does after reset()
    kwargs: dict = {"dtype": args.churon_dtype, "threads": args.threads, "kernels": args.kernels,
                    "enable_prefix_caching": False}
    llm = LLM(path, **kwargs)
    return llm, {"kwargs": kwargs, "backend": llm.model.backend.name}


def churon_pp(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    return out.metrics.prefill_tokens_per_second


def churon_tg(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=TG_TOKENS, ignore_eos=True))[0]
    assert out.metrics.generated_tokens == TG_TOKENS
    return out.metrics.decode_tokens_per_second


# ---------------------------------------------------------------- llama.cpp

class LlamaCpp:
    def __init__(self, path: Path, threads: int, n_ctx: int):
        self.llm = peer.load(path, threads=threads, n_ctx=n_ctx, n_batch=512)
        self.n_vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        return peer.logits_ith(self.llm._ctx.ctx, -1, self.n_vocab)

    def pp(self, prompt: list[int]) -> float:
        self.llm.reset()  # as peer.prefill, but before the clock starts: only the eval is timed
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        self._last_logits().argmax()  # the logits are there (decode is synchronous on CPU)
        return len(prompt) / (time.perf_counter() - t0)

    def tg(self, prompt: list[int]) -> float:
        peer.prefill(self.llm, prompt)
        t0 = time.perf_counter()
        for _ in range(TG_TOKENS):
            token = int(self._last_logits().argmax())
            self.llm.eval([token])
        return TG_TOKENS / (time.perf_counter() - t0)


# ---------------------------------------------------------------- transformers

def transformers_pp(path: Path, prompt: list[int], repeats: int) -> tuple[float, list[float]] | None:
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers is not installed: skipping its row")
        return None
    transformers.utils.logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):  # its GGUF dequantization progress bar
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt])

    def run() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            model(ids, use_cache=True)
            return len(prompt) / (time.perf_counter() - t0)

    result = median_rate(run, repeats)
    del model
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m", help="a registry name or a GGUF path")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--churon-dtype", default="float32")
    parser.add_argument("--kernels", default="auto", choices=["auto", "native", "reference"], help="churon's kernels")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        print(f"note: 1-minute load average {load_start:.2f} before the run; other work on the CPUs skews every figure")

    llm, churon_info = churon_llm(path, args)
    text = TEXT_PATH.read_text(encoding="utf-8")
    tokens = llm.tokenizer.encode(text, add_bos=False)
    assert len(tokens) >= max(PP_SIZES), "benchmark text too short"
    prompts = {n: tokens[:n] for n in PP_SIZES}
    tg_prompt = tokens[:TG_PROMPT]

    results: dict[str, dict[str, float]] = {"churon": {}, "llama.cpp": {}}
    runs: dict[str, dict[str, list[float]]] = {"churon": {}, "llama.cpp": {}}

    def record(engine: str, name: str, value: tuple[float, list[float]]) -> None:
        results[engine][name], runs[engine][name] = value
        print(f"  {engine:<18}{name:<7}{value[0]:>9.1f} tok/s   runs {[round(r, 1) for r in value[1]]}", flush=True)

    print(f"churon {args.churon_dtype} ({churon_info['kwargs']})")
    for n, prompt in prompts.items():
        record("churon", f"pp{n}", median_rate(lambda: churon_pp(llm, prompt), args.repeats))
    record("churon", f"tg{TG_TOKENS}", median_rate(lambda: churon_tg(llm, tg_prompt), args.repeats))
    del llm

    print(f"llama.cpp (llama-cpp-python {peer.version()})")
    lc = LlamaCpp(path, args.threads, n_ctx=1024)
    for n, prompt in prompts.items():
        record("llama.cpp", f"pp{n}", median_rate(lambda: lc.pp(prompt), args.repeats))
    record("llama.cpp", f"tg{TG_TOKENS}", median_rate(lambda: lc.tg(tg_prompt), args.repeats))
    del lc

    if not args.no_transformers:
        print("transformers bf16")
        hf = transformers_pp(path, prompts[512], args.repeats)
        if hf is not None:
            results["transformers bf16"], runs["transformers bf16"] = {}, {}
            record("transformers bf16", "pp512", hf)

    names = [f"pp{n}" for n in PP_SIZES] + [f"tg{TG_TOKENS}"]
    ratios = {f"churon/llama.cpp {k}": results["churon"][k] / results["llama.cpp"][k] for k in names}
    if "transformers bf16" in results:
        ratios["churon/transformers-bf16 pp512"] = results["churon"]["pp512"] / results["transformers bf16"]["pp512"]

    print(f"\n{path.name}, {args.threads} threads, batch 1, median of {args.repeats}; "
          f"churon {args.churon_dtype}, kernels={args.kernels}")
    print(f"{'tok/s':<20}" + "".join(f"{k:>10}" for k in names))
    for engine, row in results.items():
        print(f"{engine:<20}" + "".join(f"{row[k]:>10.1f}" if k in row else f"{'-':>10}" for k in names))
    print(f"{'churon / llama.cpp':<20}" + "".join(f"{ratios[f'churon/llama.cpp {k}']:>9.2f}x" for k in names))
    if "churon/transformers-bf16 pp512" in ratios:
        print(f"churon / transformers bf16, pp512: {ratios['churon/transformers-bf16 pp512']:.2f}x")
    elapsed = time.perf_counter() - t_start
    spread = max((max(r) - min(r)) / statistics.median(r) for engine in runs.values() for r in engine.values())
    print(f"({elapsed:.0f} s; load average {load_start:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"largest spread between runs {100 * spread:.0f}% of the median)")

    if args.json:
        args.json.write_text(json.dumps({
            "model": path.name,
            "threads": args.threads,
            "repeats": args.repeats,
            "churon": churon_info,
            "llama_cpp_python_version": peer.version(),
            "torch_version": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "tokens_per_second": results,
            "runs": runs,
            "ratios": ratios,
            "seconds": round(elapsed, 1),
            "load_average_before": load_start,
        }, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
