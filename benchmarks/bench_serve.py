"""Serving: `churon serve` vs llama-cpp-python's OpenAI server, under the same load, side by side in one run.

Both serve SmolLM2-135M-Instruct Q4_1 (the same GGUF) with the same thread count, one after the other
on a free loopback port, and `churon bench serve` drives each: streaming /v1/completions requests of
--prompt-len random words and exactly --output-len output tokens (churon: ignore_eos; llama-cpp-python:
min_tokens), --concurrency clients at a time. Printed: both tables, then per concurrency the ratios
churon / llama.cpp of output tokens/s (target >= 2x at 16) and of TTFT p95 (target <= 1, i.e. no worse).

    python benchmarks/bench_serve.py --threads 2 [--json out.json]
    python benchmarks/bench_serve.py --concurrency 1,4 --num-requests 4,8 --output-len 32   # quick check

llama-cpp-python's server runs one request at a time (its requests queue on one context), which is what
an unbatched server does; churon batches them.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import httpx2 as httpx

from churon import bench
from churon.registry import resolve_model

TARGET_THROUGHPUT_RATIO = 2.0  # churon / llama.cpp output tokens/s at the highest concurrency


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, probe: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}{probe}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready after {timeout:.0f} s")


def run_server(name: str, cmd: list[str], probe: str, args, extra_body: dict) -> list[bench.LevelResult]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"\n== {name}: {' '.join(cmd + ['--port', str(port)])}", flush=True)
    proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(proc, url, probe)
        results = bench.bench_serve(url, args.concurrency, args.num_requests, args.prompt_len, args.output_len,
                                    extra_body=extra_body)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(bench.format_table(results), flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--num-requests", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", default=None, help="write both result sets and the ratios here")
    args = p.parse_args()
    if len(args.num_requests) != len(args.concurrency):
        p.error("give one --num-requests per --concurrency level")
    gguf = str(resolve_model("smollm2-135m"))

    churon_cmd = [sys.executable, "-m", "churon.cli", "serve", gguf, "--threads", str(args.threads), "--log-level", "warning"]
    llamacpp_cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", str(args.threads),
                    "--n_threads_batch", str(args.threads), "--n_ctx", "2048", "--verbose", "False",
                    "--interrupt_requests", "False"]  # its default cuts a running stream short when another request arrives
    churon = run_server("churon", churon_cmd, "/health", args, {})
    llamacpp = run_server("llama.cpp (llama-cpp-python server)", llamacpp_cmd, "/v1/models", args,
                          {"min_tokens": args.output_len})

    print("\nchuron / llama.cpp")
    ratios = []
    for name, results in (("churon", churon), ("llama.cpp", llamacpp)):
        short = sum(r.short_outputs for r in results)
        if short:
            print(f"warning: {short} {name} requests returned fewer than {args.output_len} tokens")
    for c, l in zip(churon, llamacpp):
        throughput = c.output_tokens_per_s / l.output_tokens_per_s if l.output_tokens_per_s else float("nan")
        ttft = c.ttft_p95_ms / l.ttft_p95_ms if l.ttft_p95_ms else float("nan")
        ratios.append({"concurrency": c.concurrency, "output_tokens_per_s": throughput, "ttft_p95": ttft})
        print(f"concurrency {c.concurrency:>3}: output tok/s x{throughput:.2f}, TTFT p95 x{ttft:.2f}")
    last = ratios[-1]
    ok = last["output_tokens_per_s"] >= TARGET_THROUGHPUT_RATIO and last["ttft_p95"] <= 1.0
    print(f"target at concurrency {last['concurrency']}: throughput >= {TARGET_THROUGHPUT_RATIO}x and TTFT p95 no worse:"
          f" {'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args) | {"model": gguf}, "churon": bench.to_json(churon)["results"],
                       "llama.cpp": bench.to_json(llamacpp)["results"], "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
