"""churon vs llama.cpp (llama-cpp-python) on one GGUF (SmolLM2-135M-Instruct Q4_1 by default; --model gemma3-270m
for Gemma 3 270M Q4_K_M), side by side in one run.

Same GGUF, same thread count, batch 1:
  pp128, pp512  prompt processing tokens/s: one full prefill of a 128- / 512-token prompt on an empty cache
  tg128         generation tokens/s: 128 greedy tokens, one at a time, after an 8-token prompt
plus Hugging Face transformers in bf16 (the same GGUF, dequantized) prefilling the 512-token prompt.
The prompts are the first tokens of the GNU GPL v3 (tests/data/GPL-3, a copy of Debian's
/usr/share/common-licenses/GPL-3), tokenized by churon.
Each figure is the median of --repeats runs after one warm-up; the ratios are churon / peer.
Each engine runs in a process of its own (this script again, with --engine), with its own thread
settings: churon's LLM sets torch to one thread, which would otherwise also hold for a peer measured
after it in the same process (transformers measured on one of its two threads, as this script once did).

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
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from churon import LLM, SamplingParams  # noqa: E402
from churon.loader import open_model  # noqa: E402
from churon.registry import resolve_model  # noqa: E402
from churon.tokenizer import load_tokenizer  # noqa: E402

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

    return median_rate(run, repeats)


ENGINES = ("churon", "llama.cpp", "transformers bf16")


def run_engine(engine: str, path: Path, prompts: dict[int, list[int]], tg_prompt: list[int], args) -> dict:
    """This process measures one engine: {figure: (median, runs)}, and what it ran with."""
    torch.set_num_threads(args.threads)  # the engine's own setting below may change it (churon's LLM does)
    out: dict = {"figures": {}, "info": {}}
    if engine == "churon":
        llm, out["info"] = churon_llm(path, args)
        for n, prompt in prompts.items():
            out["figures"][f"pp{n}"] = median_rate(lambda: churon_pp(llm, prompt), args.repeats)
        out["figures"][f"tg{TG_TOKENS}"] = median_rate(lambda: churon_tg(llm, tg_prompt), args.repeats)
        from churon import kernels
        out["info"]["isa"] = kernels.cpu.isa() if kernels.native_available() else None
    elif engine == "llama.cpp":
        lc = LlamaCpp(path, args.threads, n_ctx=1024)
        out["info"] = {"llama_cpp_python": peer.version()}
        for n, prompt in prompts.items():
            out["figures"][f"pp{n}"] = median_rate(lambda: lc.pp(prompt), args.repeats)
        out["figures"][f"tg{TG_TOKENS}"] = median_rate(lambda: lc.tg(tg_prompt), args.repeats)
    else:
        hf = transformers_pp(path, prompts[512], args.repeats)
        if hf is not None:
            out["figures"]["pp512"] = hf
        out["info"] = {"torch_threads": torch.get_num_threads()}
    return out


def measure_in_child(engine: str, prompts_file: Path, argv: list[str], site: Path | None = None) -> dict | None:
    """run_engine in a process of its own (site: a directory put first on its sys.path, where another build of
    the peer is installed); None when it failed (its stderr is shown)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--engine", engine, "--prompts", str(prompts_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=peer.child_env(site))
    if proc.returncode != 0:
        print(f"  {engine}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m", help="a registry name or a GGUF path")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--churon-dtype", default="float32")
    parser.add_argument("--kernels", default="auto", choices=["auto", "native", "reference"], help="churon's kernels")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--llama-cpp-site", type=Path, action="append", default=[],
                        help="also measure the llama-cpp-python installed in this directory (pip install --target DIR), "
                             "e.g. a build with a fix of its own; repeatable")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # a child: measure this one only
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)      # the child's token lists
    args = parser.parse_args()
    path = resolve_model(args.model)

    if args.engine:
        given = json.loads(args.prompts.read_text())
        prompts = {int(n): p for n, p in given["pp"].items()}
        print(json.dumps(run_engine(args.engine, path, prompts, given["tg"], args)))
        return

    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        print(f"note: 1-minute load average {load_start:.2f} before the run; other work on the CPUs skews every figure")
    tokens = load_tokenizer(open_model(path)).encode(TEXT_PATH.read_text(encoding="utf-8"), add_bos=False)
    assert len(tokens) >= max(PP_SIZES), "benchmark text too short"
    prompts = {n: tokens[:n] for n in PP_SIZES}
    tg_prompt = tokens[:TG_PROMPT]
    prompts_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_llamacpp_prompts_{os.getpid()}.json"
    prompts_file.write_text(json.dumps({"pp": prompts, "tg": tg_prompt}))
    child_argv = ["--threads", str(args.threads), "--model", args.model, "--repeats", str(args.repeats),
                  "--churon-dtype", args.churon_dtype, "--kernels", args.kernels]

    # (label, engine, site)
    engines = [(e, e, None) for e in ENGINES if not (e == "llama.cpp" and args.no_llama_cpp)
               and not (e == "transformers bf16" and args.no_transformers)]
    engines[1:1] = [(f"llama.cpp {site.name}", "llama.cpp", site) for site in args.llama_cpp_site]
    results: dict[str, dict[str, float]] = {}
    runs: dict[str, dict[str, list[float]]] = {}
    infos: dict[str, dict] = {}
    loads: dict[str, float] = {}
    try:
        for engine, kind, site in engines:
            loads[engine] = os.getloadavg()[0]
            print(f"{engine} (load average {loads[engine]:.2f})", flush=True)
            got = measure_in_child(kind, prompts_file, child_argv, site)
            if got is None or not got["figures"]:
                continue
            infos[engine] = got["info"]
            results[engine] = {k: v[0] for k, v in got["figures"].items()}
            runs[engine] = {k: v[1] for k, v in got["figures"].items()}
            for k, (median, rs) in got["figures"].items():
                print(f"  {engine:<18}{k:<7}{median:>9.1f} tok/s   runs {[round(r, 1) for r in rs]}", flush=True)
    finally:
        prompts_file.unlink(missing_ok=True)

    names = [f"pp{n}" for n in PP_SIZES] + [f"tg{TG_TOKENS}"]
    ratios = {}
    for peer_name in (label for label, _, _ in engines if label != "churon"):
        for k in names:
            if "churon" in results and k in results.get(peer_name, {}):
                ratios[f"churon/{peer_name} {k}"] = results["churon"][k] / results[peer_name][k]

    print(f"\n{path.name}, {args.threads} threads, batch 1, median of {args.repeats}, each engine in its own process; "
          f"churon {args.churon_dtype}, kernels={args.kernels} ({infos.get('churon', {}).get('isa')})")
    print(f"{'tok/s':<20}" + "".join(f"{k:>10}" for k in names))
    for engine, row in results.items():
        print(f"{engine:<20}" + "".join(f"{row[k]:>10.1f}" if k in row else f"{'-':>10}" for k in names))
    for name, r in ratios.items():
        print(f"{name}: {r:.2f}x")
    elapsed = time.perf_counter() - t_start
    spread = max((max(r) - min(r)) / statistics.median(r) for engine in runs.values() for r in engine.values())
    print(f"({elapsed:.0f} s; load average {load_start:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"largest spread between runs {100 * spread:.0f}% of the median)")

    if args.json:
        args.json.write_text(json.dumps({
            "model": path.name,
            "threads": args.threads,
            "repeats": args.repeats,
            "engines": infos,
            "torch_version": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "tokens_per_second": results,
            "runs": runs,
            "ratios": ratios,
            "load_average_before_each": loads,
            "seconds": round(elapsed, 1),
            "load_average_before": load_start,
        }, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
