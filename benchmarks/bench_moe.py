"""churon vs llama.cpp (llama-cpp-python) on a mixture-of-experts model: a random Qwen3-MoE of ~0.85 B parameters
(16 layers, hidden 1024, 16 heads / 4 KV heads of 64, 32 experts of FFN 512, 4 active per token: ~0.14 B active),
one Q4_K GGUF, side by side in one run.

The model is built once in --work-dir and reused: seeded random weights saved by transformers (fp16 safetensors,
the tiny test models' 400-token tokenizer), converted to an F16 GGUF as llama.cpp's converter does
(tests/tiny_models.write_gguf), then `churon quantize --type Q4_K` (rtn). Both engines run that file, batch 1,
the same thread count, each in a process of its own (one engine's threads and memory never touch the other's
figures), timed as bench_llamacpp.py times them (its functions, imported):
  pp128, pp512  prompt tokens/s: one prefill of a 128- / 512-token prompt on an empty cache
  tg128         generation tokens/s: 128 greedy tokens, one at a time, after an 8-token prompt
Each figure is the median of --repeats runs after one warm-up; the ratios are churon / llama.cpp. Before timing,
each engine's first greedy tokens on the 8-token prompt are printed: they must agree (else the file or an engine
is wrong, and no figure means anything).

    python benchmarks/bench_moe.py [--threads 2] [--repeats 5] [--rounds 1] [--work-dir DIR] [--json out.json]

On a shared host, --rounds 5 or more: the engines run in turn, each round's ratio from figures taken minutes
apart at most, and the median of the rounds' ratios is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the tokenizer and the GGUF conversion

import torch  # noqa: E402

import bench_llamacpp as bench  # noqa: E402
import llamacpp_peer as peer  # noqa: E402

# the model: Qwen3-30B-A3B's shape scaled down (its 128 experts of 768, 8 active, to 32 of 512, 4 active)
SHAPE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, intermediate_size=2048,
             max_position_embeddings=2048)
SEED = 0
CHECK_TOKENS = 16  # greedy tokens both engines must agree on


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------- the model

def randomize(model: torch.nn.Module) -> None:
    """Seeded weights at the scale of a trained model's, so the logits are neither flat nor chaotic: matrices
    N(0, 1/fan_in), the residual branches' outputs (o_proj, the experts' down_proj) further / sqrt(2 layers) so
    the residual stream grows slowly over 16 layers, routers 3x (decisive routing: 8-bit activations rarely swap a
    token's 4th and 5th experts), embeddings N(0, 1), the output matrix's logits ~ N(0, 3)."""
    g = torch.Generator().manual_seed(SEED)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights
                p.fill_(1.0)
                continue
            std = p.shape[-1] ** -0.5
            if name.endswith("embed_tokens.weight"):
                std = 1.0
            elif name.endswith("lm_head.weight"):
                std *= 3.0
            elif name.endswith("mlp.gate.weight"):
                std *= 3.0
            elif "o_proj" in name or "down_proj" in name:
                std /= (2 * layers) ** 0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)


def build_model(work_dir: Path) -> Path:
    """The Q4_K GGUF in work_dir, made (HF directory, F16 GGUF, Q4_K) where a step's output is missing."""
    import tiny_models
    from tokenizers import Tokenizer

    hf, f16, q4k = work_dir / "hf", work_dir / "qwen3moe-f16.gguf", work_dir / "qwen3moe-Q4_K.gguf"
    if not (hf / "model.safetensors.index.json").exists() and not (hf / "model.safetensors").exists():
        import transformers

        print(f"building the model in {hf}", flush=True)
        tiny_models.make_tokenizer_files(hf)
        tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
        config = transformers.Qwen3MoeConfig(
            **SHAPE, vocab_size=tok.get_vocab_size(with_added_tokens=True), norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            bos_token_id=tok.token_to_id(tiny_models.BOS_TOKEN), eos_token_id=tok.token_to_id(tiny_models.EOS_TOKEN),
            pad_token_id=tok.token_to_id(tiny_models.PAD_TOKEN))
        config.architectures = ["Qwen3MoeForCausalLM"]
        model = transformers.Qwen3MoeForCausalLM(config)
        randomize(model)
        model.to(torch.float16).save_pretrained(hf, safe_serialization=True)
        del model
    if not f16.exists():
        print(f"converting to {f16}", flush=True)
        tiny_models.write_gguf(hf, f16, "F16")
    if not q4k.exists():
        print(f"quantizing to {q4k}", flush=True)
        subprocess.run([sys.executable, "-m", "churon.cli", "quantize", str(f16), str(q4k), "--type", "Q4_K", "-q"],
                       check=True)
    return q4k


# ---------------------------------------------------------------- one engine, in its own process

def run_churon(path: Path, prompts: dict, args) -> dict:
    from churon import SamplingParams

    llm, info = bench.churon_llm(path, args)
    check = llm.generate([prompts["tg"]], SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True))
    out = {"info": info, "greedy": check[0].token_ids}
    for n in bench.PP_SIZES:
        out[f"pp{n}"] = bench.median_rate(lambda: bench.churon_pp(llm, prompts[f"pp{n}"]), args.repeats)
    out[f"tg{bench.TG_TOKENS}"] = bench.median_rate(lambda: bench.churon_tg(llm, prompts["tg"]), args.repeats)
    return out


def run_llamacpp(path: Path, prompts: dict, args) -> dict:
    lc = bench.LlamaCpp(path, args.threads, n_ctx=1024)
    peer.prefill(lc.llm, prompts["tg"])
    greedy = []
    for _ in range(CHECK_TOKENS):
        greedy.append(int(lc._last_logits().argmax()))
        lc.llm.eval(greedy[-1:])
    out = {"info": {"llama_cpp_python": peer.version()}, "greedy": greedy}
    for n in bench.PP_SIZES:
        out[f"pp{n}"] = bench.median_rate(lambda: lc.pp(prompts[f"pp{n}"]), args.repeats)
    out[f"tg{bench.TG_TOKENS}"] = bench.median_rate(lambda: lc.tg(prompts["tg"]), args.repeats)
    return out


ENGINES = {"churon": run_churon, "llama.cpp": run_llamacpp}


def in_process(engine: str, path: Path, prompts_file: Path, args) -> dict:
    """engine's figures, from a child process of this script (--engine)."""
    result = prompts_file.with_name(f"result-{engine}.json")
    cmd = [sys.executable, __file__, "--engine", engine, "--gguf", str(path), "--prompts", str(prompts_file),
           "--result", str(result), "--threads", str(args.threads), "--repeats", str(args.repeats),
           "--kernels", args.kernels]
    site = args.llama_cpp_site if engine == "llama.cpp" else None  # another llama-cpp-python build, first on the path
    subprocess.run(cmd, check=True, env=peer.child_env(site))
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run both engines this many times, in turn; the ratios are the median of the rounds'")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/churon-bench-moe"),
                        help="where the model is built once and reused")
    parser.add_argument("--llama-cpp-site", type=Path, default=None,
                        help="measure the llama-cpp-python installed in this directory (pip install --target DIR) instead"
                             " of the one in this environment, e.g. a -march=native build")
    parser.add_argument("--kernels", default="auto", choices=["auto", "native", "reference"], help="churon's kernels")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    # a child's run of one engine (in_process)
    parser.add_argument("--engine", choices=list(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.churon_dtype = "float32"  # bench_llamacpp.churon_llm's setting: the activations' dtype
    torch.set_num_threads(args.threads)
    if args.engine:
        prompts = json.loads(args.prompts.read_text())
        args.result.write_text(json.dumps(ENGINES[args.engine](args.gguf, prompts, args)))
        return

    args.work_dir.mkdir(parents=True, exist_ok=True)
    path = build_model(args.work_dir)
    from churon.loader import open_model
    from churon.tokenizer import load_tokenizer

    source = open_model(path)
    c = source.config
    tokens = load_tokenizer(source).encode(bench.TEXT_PATH.read_text(encoding="utf-8"), add_bos=False)
    assert len(tokens) >= max(bench.PP_SIZES), "benchmark text too short"
    prompts = {f"pp{n}": tokens[:n] for n in bench.PP_SIZES} | {"tg": tokens[: bench.TG_PROMPT]}
    prompts_file = args.work_dir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    del source

    load_before = os.getloadavg()
    t_start = time.perf_counter()
    print(f"{path.name} ({path.stat().st_size / 2**20:.0f} MiB): {c.num_layers} layers, {c.num_experts} experts of FFN"
          f" {c.moe_intermediate_size}, {c.num_experts_per_tok} active; {args.threads} threads; load average"
          f" {load_before[0]:.2f} before", flush=True)
    rounds = []  # the engines in turn, round after round: a noisy neighbour's burst lands on both, not on one
    for r in range(args.rounds):
        results = {}
        for engine in ENGINES:
            print(f"round {r + 1}/{args.rounds}: {engine} ...", flush=True)
            results[engine] = in_process(engine, path, prompts_file, args)
            print(f"  first greedy tokens: {results[engine]['greedy']}", flush=True)
        rounds.append(results)
    same = all(rr["churon"]["greedy"] == rr["llama.cpp"]["greedy"] for rr in rounds)
    results = rounds[0]
    agree = next((i for i, (a, b) in enumerate(zip(*(r["greedy"] for r in results.values()))) if a != b), CHECK_TOKENS)
    load_after = os.getloadavg()

    names = [f"pp{n}" for n in bench.PP_SIZES] + [f"tg{bench.TG_TOKENS}"]
    round_ratios = {k: [rr["churon"][k][0] / rr["llama.cpp"][k][0] for rr in rounds] for k in names}
    ratios = {k: statistics.median(v) for k, v in round_ratios.items()}
    rates = {e: {k: statistics.median(rr[e][k][0] for rr in rounds) for k in names} for e in ENGINES}
    print(f"\n{path.name}, {cpu_model()}, {args.threads} threads, batch 1, median of {args.repeats} runs a round,"
          f" {args.rounds} round(s); churon kernels={args.kernels} ({results['churon']['info']['backend']})")
    print(f"greedy tokens {'agree' if same else f'DIFFER from token {agree}'} ({CHECK_TOKENS} compared)")
    print(f"{'tok/s (median)':<20}" + "".join(f"{k:>10}" for k in names))
    for engine, row in rates.items():
        print(f"{engine:<20}" + "".join(f"{row[k]:>10.1f}" for k in names))
    print(f"{'churon / llama.cpp':<20}" + "".join(f"{ratios[k]:>9.2f}x" for k in names)
          + ("  (the median of the rounds' ratios)" if args.rounds > 1 else ""))
    if args.rounds > 1:
        for k in names:
            print(f"  {k} a round: " + " ".join(f"{x:.2f}x" for x in round_ratios[k]))
    elapsed = time.perf_counter() - t_start
    print(f"({elapsed:.0f} s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)")
    if args.json:
        args.json.write_text(json.dumps({
            "model": path.name, "shape": SHAPE, "cpu": cpu_model(), "threads": args.threads, "repeats": args.repeats,
            "greedy": {e: r["greedy"] for e, r in results.items()}, "greedy_agree": same,
            "rounds": args.rounds, "tokens_per_second": rates, "ratios": ratios, "round_ratios": round_ratios,
            "runs": [{e: {k: r[k][1] for k in names} for e, r in rr.items()} for rr in rounds],
            "info": {e: r["info"] for e, r in results.items()},
            "torch_version": torch.__version__, "seconds": round(elapsed, 1),
            "load_average_before": load_before, "load_average_after": load_after,
        }, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
