"""LoRA serving: churon with no adapter, one adapter and 4 mixed adapters vs llama.cpp's llama-server with one.

SmolLM2-135M-Instruct Q4_1, the same GGUF, prompts and thread count for every row. --num-requests prompts
of --prompt-len tokens (distinct slices of license texts tokenized by churon), --max-tokens greedy output
tokens each, EOS ignored, all submitted at once. Output tokens/s = all generated tokens / wall seconds from
the first request in to the last token out (prompt processing included). The adapters are random, seeded
PEFT adapters (adapter_config.json + adapter_model.safetensors) of rank --rank on all seven targets
(q/k/v/o/gate/up/down), written once by the parent:
  churon none    LLM.generate, no adapter loaded
  churon one     adapter 0 loaded, every request SamplingParams(lora="a0")
  churon four    adapters 0-3 loaded, request i uses adapter i % 4: every step mixes the four
  llama.cpp one  llama-server --lora (adapter 0 written as a llama.cpp GGUF adapter by churon's
                 write_lora_gguf), -np parallel slots, continuous batching, the requests all at once over
                 HTTP (/completion with the token ids, n_predict, ignore_eos, temperature 0). llama.cpp applies
                 adapters to the whole batch: it cannot serve requests of different adapters in one step, so
                 one adapter is its best case.
Every row runs in a process of its own (this script with --only ROW; llama-server in its own), after a
warm-up, --repeats times, the rows in turn; each row's figure is its median run. Targets: churon four
>= 75% of churon none (mixing 4 adapters costs <= 25%), and churon four >= 2x llama.cpp one.

    python benchmarks/bench_lora.py --threads 2 [--json out.json]
    python benchmarks/bench_lora.py --num-requests 8 --max-tokens 16 --repeats 1 --no-llama-server   # quick check

The CPU % column is the share of --threads cores each row got (CPU time / wall / threads; llama-server:
its process's): well under 100 flags a run slowed by other work on the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_batching import FALLBACK_TEXT, TEXT_DIR, TEXT_FILES, cpu_seconds, cpu_share, first_equal, peak_rss_mib

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = 4
TARGET_MIXED_COST = 0.25  # churon four costs at most this share of churon none's throughput
TARGET_VS_LLAMACPP = 2.0  # churon four / llama.cpp one
ROWS = ("none", "one", "four", "llama-server")
DEFAULT_LLAMA_SERVER = "/tmp/llama-build/build/bin/llama-server"


# ---------------------------------------------------------------- workload (built once, in the parent)

def build_prompts(model: str, n: int, length: int) -> list[list[int]]:
    """n distinct token-id prompts of `length` tokens, tokenized by churon's tokenizer (no weights loaded)."""
    from churon.loader import open_model
    from churon.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(open_model(model))
    files = [TEXT_DIR / name for name in TEXT_FILES if (TEXT_DIR / name).exists()]
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files) or FALLBACK_TEXT
    tokens = tokenizer.encode(text, add_bos=False)
    if len(tokens) < length + n:
        raise SystemExit(f"the benchmark text has {len(tokens)} tokens: too few for {n} distinct {length}-token"
                         " prompts; lower --num-requests or --prompt-len")
    stride = min(length, (len(tokens) - length) // n)  # non-overlapping when the text is long enough
    return [tokens[i * stride : i * stride + length] for i in range(n)]


def target_shape(config, target: str) -> tuple[int, int]:
    """(out_features, in_features) of one target module in Hugging Face's layout."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}[target]


def write_peft_adapter(config, out: Path, rank: int, alpha: float, seed: int) -> Path:
    """A random LoRA adapter in PEFT's files, as save_pretrained writes them (without PEFT and the model in
    transformers, which the benchmark does not otherwise need). A ~ N(0, 1/in) as PEFT's Kaiming init gives
    A's scale, B ~ N(0, 0.05): PEFT's own B starts at zero, which would make the adapter a no-op. The values
    change nothing of the work; these change SmolLM2's greedy text within a few tokens and keep it plausible."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in TARGETS:
            rows, cols = target_shape(config, target)
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, cols, generator=g) / math.sqrt(cols)
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.05
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "target_modules": list(TARGETS), "fan_in_fan_out": False, "inference_mode": True,
    }, indent=1))
    return out


def build_adapters(model: str, tmp: Path, rank: int) -> dict:
    """ADAPTERS PEFT directories (seeds 0..), and adapter 0 as a llama.cpp GGUF adapter for llama-server."""
    from churon.formats.lora import read_lora, write_lora_gguf
    from churon.loader import open_model

    config = open_model(model).config
    peft_dirs = [write_peft_adapter(config, tmp / f"a{i}", rank, 2.0 * rank, seed=i) for i in range(ADAPTERS)]
    gguf = write_lora_gguf(read_lora(peft_dirs[0], config), config, tmp / "a0.gguf")
    return {"peft": [str(p) for p in peft_dirs], "gguf": str(gguf)}


# ---------------------------------------------------------------- churon rows

def row_churon(args, workload: dict, row: str) -> dict:
    import torch

    from churon import LLM, SamplingParams
    from churon.config import EngineConfig
    from churon.engine.kv_cache import kv_bytes_per_token
    from churon.loader import make_backend, open_model

    n_adapters = {"none": 0, "one": 1, "four": ADAPTERS}[row]
    names = [f"a{i}" for i in range(n_adapters)]
    prompts = workload["prompts"]
    # the KV cache holds every running sequence at once (plus one of slack), as llama-server's context does
    block = EngineConfig().block_size
    seq_tokens = block * math.ceil((args.prompt_len + args.max_tokens + 1) / block)
    per_token = kv_bytes_per_token(open_model(args.model).config, make_backend("auto", torch.float32).kv_dtype)
    kv_memory = (min(args.max_num_seqs, len(prompts)) + 1) * seq_tokens * per_token
    t0 = time.perf_counter()
    llm = LLM(args.model, threads=args.threads, max_num_seqs=args.max_num_seqs,
              kv_cache_memory=kv_memory, max_loras=max(n_adapters, 1), max_lora_rank=args.rank,
              lora_adapters=dict(zip(names, workload["adapters"]["peft"])))
    load_seconds = time.perf_counter() - t0

    def params(i: int, max_tokens: int):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                              lora=names[i % n_adapters] if n_adapters else None)

    warm = [p[::-1] for p in prompts[:ADAPTERS]]  # reversed: no prefix-cache block in common with a timed prompt
    llm.generate(warm, [params(i, 4) for i in range(len(warm))], use_tqdm=False)
    c0, t0 = cpu_seconds(), time.perf_counter()
    outs = llm.generate(prompts, [params(i, args.max_tokens) for i in range(len(prompts))], use_tqdm=False)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    generated = sum(len(o.token_ids) for o in outs)
    return {
        "adapters": names,
        "load_seconds": round(load_seconds, 2),
        "requests": len(prompts),
        "generated_tokens": generated,
        "wall_seconds": wall,
        "output_tokens_per_second": generated / wall,
        "ttft_mean_seconds": statistics.mean(o.metrics.prefill_seconds for o in outs),
        "cpu_percent": cpu_share(cpu, wall, args.threads),
        "peak_rss_mib": peak_rss_mib(),
        "setting": f"{llm.model.backend.name} kernels, max_num_seqs={args.max_num_seqs}",
        "check_token_ids": [o.token_ids for o in outs[:ADAPTERS]],
    }


# ---------------------------------------------------------------- llama-server row

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:  # refused while it starts, 503 while it loads the model
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server at {url} was not ready after {timeout:.0f} s")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of another process (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def row_llama_server(args, workload: dict) -> dict:
    prompts = workload["prompts"]
    parallel = min(args.llama_server_parallel, len(prompts))
    seq_tokens = args.prompt_len + args.max_tokens + 16
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # -np slots of seq_tokens each (the context is split between the slots), continuous batching, no prompt cache
    # (every prompt is distinct), llama.cpp's default batch sizes
    cmd = [args.llama_server, "-m", args.model, "--lora", workload["adapters"]["gguf"],
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(parallel), "-c", str(parallel * seq_tokens),
           "--cont-batching", "--no-cache-prompt", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]
    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(proc, url)

        def complete(prompt: list[int], max_tokens: int) -> dict:
            return post_json(f"{url}/completion", {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True,
                                                   "temperature": 0, "cache_prompt": False, "return_tokens": True},
                             timeout=3600)

        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            list(pool.map(lambda p: complete(p[::-1], 4), prompts[:ADAPTERS]))  # warm-up, as churon's
            c0, t0 = process_cpu_seconds(proc.pid), time.perf_counter()
            outs = list(pool.map(lambda p: complete(p, args.max_tokens), prompts))
            wall = time.perf_counter() - t0
            cpu = process_cpu_seconds(proc.pid) - c0
        peak = process_peak_rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    generated = sum(o["tokens_predicted"] for o in outs)
    return {
        "command": " ".join(cmd),
        "version": (version.stdout + version.stderr).strip().splitlines()[0] if version.returncode == 0 else None,
        "requests": len(prompts),
        "generated_tokens": generated,
        "wall_seconds": wall,
        "output_tokens_per_second": generated / wall,
        "ttft_mean_seconds": statistics.mean(o["timings"]["prompt_ms"] / 1000 for o in outs),
        "cpu_percent": cpu_share(cpu, wall, args.threads),
        "peak_rss_mib": peak,
        "setting": f"-np {parallel}, continuous batching, --lora",
        "check_token_ids": [o.get("tokens", []) for o in outs[:ADAPTERS]],
    }


def run_row(row: str, args, workload: dict) -> dict:
    return row_llama_server(args, workload) if row == "llama-server" else row_churon(args, workload, row)


# ---------------------------------------------------------------- the parent: every row in its own process

def median_run(runs: list[dict]) -> dict:
    """The run of median throughput (the lower middle one of an even count), with every run's rate; a row
    with a failed run reports that failure."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["output_tokens_per_second"])
    return {**ordered[(len(ordered) - 1) // 2], "runs": [r["output_tokens_per_second"] for r in runs]}


def report(args, results: dict, seconds: float, load_before: float) -> dict:
    labels = {"none": "churon, no adapter", "one": "churon, 1 adapter", "four": f"churon, {ADAPTERS} mixed adapters",
              "llama-server": "llama.cpp, 1 adapter"}
    print(f"\nSmolLM2-135M-Instruct Q4_1, {args.threads} threads; {args.num_requests} requests x {args.prompt_len} prompt"
          f" tokens -> {args.max_tokens} output tokens each (greedy, EOS ignored); random rank-{args.rank} adapters"
          f" on {'/'.join(t.split('_')[0] for t in TARGETS)}")
    print(f"{'row':<28}{'out tok/s':>10}{'min-max':>14}{'wall s':>9}{'TTFT s':>8}{'CPU %':>7}{'peak RSS MiB':>14}  setting")
    for row, v in results.items():
        if "error" in v:
            print(f"{labels[row]:<28}FAILED: {v['error']}")
            continue
        spread = f"{min(v['runs']):.0f}-{max(v['runs']):.0f}"
        print(f"{labels[row]:<28}{v['output_tokens_per_second']:>10.1f}{spread:>14}{v['wall_seconds']:>9.1f}"
              f"{v['ttft_mean_seconds']:>8.2f}{v['cpu_percent']:>7.0f}{v['peak_rss_mib']:>14.0f}  {v['setting']}")
    print(f"(out tok/s: generated tokens / wall time, prompt processing included, the median of {args.repeats} runs"
          f" (min-max: all of them); the other columns are the median run's; TTFT: mean time to first token; CPU %: share of {args.threads} cores the row's process got)")

    ok = {row: v for row, v in results.items() if "error" not in v}
    rate = {row: v["output_tokens_per_second"] for row, v in ok.items()}
    ratios = {}
    print()
    if "none" in rate:
        for row in ("one", "four"):
            if row in rate:
                ratios[f"churon_{row}_over_none"] = rate[row] / rate["none"]
        if "four" in rate:
            cost = 1 - ratios["churon_four_over_none"]
            print(f"{f'churon {ADAPTERS} mixed / no adapter':<32}: {ratios['churon_four_over_none']:6.2f}x   (costs {100 * cost:.0f}%;"
                  f" target <= {100 * TARGET_MIXED_COST:.0f}% {'met' if cost <= TARGET_MIXED_COST else 'NOT met'})")
        if "one" in rate:
            print(f"{'churon 1 adapter / no adapter':<32}: {ratios['churon_one_over_none']:6.2f}x")
    if "four" in rate and "llama-server" in rate:
        r = ratios["churon_four_over_llamacpp_one"] = rate["four"] / rate["llama-server"]
        print(f"{f'churon {ADAPTERS} mixed / llama.cpp 1':<32}: {r:6.2f}x   target >= {TARGET_VS_LLAMACPP:.1f}x"
              f" {'met' if r >= TARGET_VS_LLAMACPP else 'NOT met'}")
    if "one" in rate and "llama-server" in rate:
        r = ratios["churon_one_over_llamacpp_one"] = rate["one"] / rate["llama-server"]
        print(f"{'churon 1 adapter / llama.cpp 1':<32}: {r:6.2f}x")

    # the adapters are really applied: they change the greedy text, and both engines compute the same one
    checks = {row: v["check_token_ids"] for row, v in ok.items()}
    if "none" in checks:
        for row in ("one", "four"):
            if row in checks:
                same = [first_equal(a, b) for a, b in zip(checks["none"], checks[row])]
                ratios[f"leading_tokens_equal_none_vs_{row}"] = same
                print(f"leading greedy tokens equal, churon no adapter vs {labels[row].split(', ')[1]}: {same} of"
                      f" {args.max_tokens} (the adapters change the output)")
    if "one" in checks and "llama-server" in checks:
        same = [first_equal(a, b) for a, b in zip(checks["one"], checks["llama-server"])]
        ratios["leading_tokens_equal_churon_one_vs_llamacpp_one"] = same
        print(f"leading greedy tokens equal, churon vs llama.cpp with adapter 0: {same} of {args.max_tokens}"
              f" (both apply the same adapter; rounding differs, so a near-tie may flip after a while)")

    load_after = os.getloadavg()[0]
    print(f"\n({seconds:.0f} s in all; 1-minute load average {load_before:.2f} before, {load_after:.2f} after"
          f"{'; other work on the CPUs skews every figure' if max(load_before, load_after) > args.threads + 0.5 else ''})")
    return {"ratios": ratios, "targets": {"mixed_cost_at_most": TARGET_MIXED_COST,
                                          "churon_four_over_llamacpp_one": TARGET_VS_LLAMACPP},
            "load_average_before": load_before, "load_average_after": load_after}


def child_argv(args, row: str, workload_path: str, result_path: str) -> list[str]:
    argv = [sys.executable, __file__, "--only", row, "--workload", workload_path, "--result", result_path,
            "--model", args.model, "--llama-server", args.llama_server]
    for flag in ("threads", "num_requests", "prompt_len", "max_tokens", "rank", "max_num_seqs",
                 "llama_server_parallel"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv


def add_row_process_args(parser: argparse.ArgumentParser, rows) -> None:
    """--only ROW with its hidden --workload / --result files: how the parent runs each row in a process of its own."""
    parser.add_argument("--only", default=None, choices=rows, help="run one row in this process (the parent runs each so)")
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)


def settle_model_or_run_row(args, run_row) -> bool:
    """--model's default (the registry's smollm2-135m); in a row's own process (--only) run it, write its result and
    say so (True: the caller is done)."""
    if args.model is None:
        from churon.registry import resolve_model

        args.model = str(resolve_model("smollm2-135m"))
    if not args.only:
        return False
    workload = json.loads(Path(args.workload).read_text())
    Path(args.result).write_text(json.dumps(run_row(args.only, args, workload)))
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--model", default=None, help="GGUF path (default: the registry's smollm2-135m)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs of every row, in turn; the median is reported")
    parser.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="churon's batch rows")
    parser.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER, help="the llama-server binary")
    parser.add_argument("--llama-server-parallel", type=int, default=64, help="llama-server's slots (-np)")
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"the rows to run, of {','.join(ROWS)}")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    add_row_process_args(parser, ROWS)
    args = parser.parse_args()
    if settle_model_or_run_row(args, run_row):
        return

    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        raise SystemExit(f"--rows: unknown {sorted(unknown)}; the rows are {', '.join(ROWS)}")
    if args.no_llama_server:
        rows = [r for r in rows if r != "llama-server"]
    elif "llama-server" in rows and not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"{args.llama_server}: no llama-server there; give its path with --llama-server, or"
                         " --no-llama-server")
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"note: 1-minute load average {load_before:.2f} before the run; other work on the CPUs skews every figure")
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        workload = {"prompts": build_prompts(args.model, args.num_requests, args.prompt_len),
                    "adapters": build_adapters(args.model, Path(tmp), args.rank)}
        workload_path = os.path.join(tmp, "workload.json")
        Path(workload_path).write_text(json.dumps(workload))
        runs: dict[str, list[dict]] = {row: [] for row in rows}
        for round_ in range(args.repeats):  # the rows in turn, so that a slow spell of the machine hits them all
            for row in rows:
                result_path = os.path.join(tmp, f"{row}.json")
                t0 = time.perf_counter()
                print(f"[{time.perf_counter() - t_start:5.0f} s] round {round_ + 1}: {row} ...", end=" ", flush=True)
                proc = subprocess.run(child_argv(args, row, workload_path, result_path), capture_output=True,
                                      text=True)
                if proc.returncode != 0 or not os.path.exists(result_path):
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    runs[row].append({"error": f"exit code {proc.returncode}: {' | '.join(tail)}"})
                    print("failed", flush=True)
                else:
                    runs[row].append(json.loads(Path(result_path).read_text()))
                    os.remove(result_path)
                    print(f"{runs[row][-1]['output_tokens_per_second']:.1f} out tok/s ({time.perf_counter() - t0:.0f} s)",
                          flush=True)
        results = {row: median_run(r) for row, r in runs.items()}

    seconds = time.perf_counter() - t_start
    summary = report(args, results, seconds, load_before)
    if args.json:
        import torch

        config = {k: v for k, v in vars(args).items() if k not in ("json", "only", "workload", "result")}
        args.json.write_text(json.dumps({
            "benchmark": "bench_lora",
            "model": Path(args.model).name,
            "config": config,
            "torch_version": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "rows": {k: {kk: vv for kk, vv in v.items() if kk != "check_token_ids"} for k, v in results.items()},
            **summary,
            "seconds": round(seconds, 1),
        }, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
