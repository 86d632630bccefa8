"""Reproducibility campaign: the same greedy workload in many fresh processes, compared bit for bit.

Issue 13 saw one server run in eight whose outputs differed from every other run. This script runs a
64-request greedy workload (a burst, half the prompts sharing a system prompt of a few KV blocks so
that the prefix cache and batch composition come into play), then 8 probe requests one at a time,
in --runs fresh processes per mode:

    llm     LLM(model, threads=T).generate(burst), then each probe alone (in-process engine)
    server  `churon serve` in a subprocess; the burst as concurrent HTTP /v1/completions requests
            (arrival order and batch composition vary with timing), then the probes one by one

Each run varies what differs between processes: the thread count (cycled over --threads) and
PYTHONHASHSEED (a fresh random one per run unless --hashseed is given); addresses (ASLR), the contents
of recycled memory, the KV pool size (a share of free memory) and the thread pool's timing vary by
themselves. Every request is fingerprinted by its text and the exact float logprob of every token it
generated (logprobs=1: a change anywhere in a token's logits changes its logprob's bits even when
the argmax holds); a run differs when any request's fingerprint is not that request's most common
one over all runs of both modes.

--poison fills memory nobody wrote (torch.empty with NaN, malloc with 0x5a bytes), so that a kernel
reading memory before writing it changes the output every time instead of once in a while; a small
--kv-cache-memory forces preemption (recomputation) and prefix-cache eviction.

    python benchmarks/reproducibility.py --runs 30 --mode both --threads 1,2 --json repro.json
    python benchmarks/reproducibility.py --runs 3 --mode llm --poison --kv-cache-memory 5160960   # 7 blocks

Exit status 1 when runs differ, 2 when some failed (a server that would not start); every run's
fingerprints and texts go to --json. tests/test_reproducibility.py (slow) runs a small version.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

SYSTEM = ("You are a careful assistant. Answer in one short paragraph, plainly, without lists, and say so"
          " when you do not know something. The user is a student preparing for an exam.")
TOPICS = ["the water cycle", "photosynthesis", "the French revolution", "prime numbers", "plate tectonics",
          "the printing press", "black holes", "vaccines", "the Roman empire", "electric motors",
          "the immune system", "supply and demand", "the moon landing", "volcanoes", "DNA replication",
          "the steam engine"]
ASKS = ["Explain {t} in simple words.", "What is the most surprising fact about {t}?",
        "Write two sentences about {t}.", "Why does {t} matter today?"]
PROBES = ["The capital of France is", "Once upon a time,", "def fibonacci(n):", "1, 2, 3, 5, 8,",
          SYSTEM + " Question: what is gravity?", "The three primary colors are", "In 1969,", SYSTEM]


def workload() -> list[str]:
    """64 prompts: every (topic, ask) pair, the odd ones after the shared system prompt."""
    prompts = []
    for i, (t, a) in enumerate((t, a) for a in ASKS for t in TOPICS):
        q = a.format(t=t)
        prompts.append(f"{SYSTEM} Question: {q} Answer:" if i % 2 else f"Question: {q} Answer:")
    return prompts


def fingerprint(text: str, logprobs: list[float]) -> str:
    """sha256 of the text and each logprob's float64 bits."""
    h = hashlib.sha256(text.encode())
    for lp in logprobs:
        h.update(float(lp).hex().encode())
    return h.hexdigest()[:16]


# -- one run (in a fresh child process) ---------------------------------------------------------------

def poison_memory() -> None:
    """From now on torch.empty memory is NaN (integers: their maximum) instead of whatever was there, so a
    kernel that reads memory nobody wrote changes the output (or fails) every time instead of rarely."""
    import torch

    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def child_llm(model: str, threads: int, max_tokens: int, engine_options: dict) -> dict:
    from churon import LLM, SamplingParams, kernels

    llm = LLM(model, threads=threads, **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    outs = llm.generate(workload(), params, use_tqdm=False)
    outs += [llm.generate([p], params, use_tqdm=False)[0] for p in PROBES]
    return {
        "outputs": [[o.text, [lp.logprob for lp in o.logprobs]] for o in outs],
        "isa": kernels.cpu.isa() if kernels.cpu else None,
        "num_blocks": llm.engine.memory_plan.num_blocks,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "evictions": llm.engine.block_manager.num_evictions,
        "pool_stats": kernels.cpu.pool_stats() if kernels.cpu else None,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_server(model: str, threads: int, max_tokens: int, env: dict, poison: bool, serve_flags: list[str]) -> dict:
    import httpx

    port = _free_port()
    serve = [sys.executable, __file__, "--serve-poisoned"] if poison else [sys.executable, "-m", "churon.cli"]
    # --max-queue: the whole burst waits for its turn however small the KV pool, none is refused
    cmd = serve + ["serve", model, "--port", str(port), "--threads", str(threads), "--served-model-name", "m",
                   "--log-level", "warning", "--max-queue", "1000", *serve_flags]
    # the server's stderr goes to a file, not a pipe: nobody reads it while the server runs
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
        url = f"http://127.0.0.1:{port}"

        def server_log() -> str:
            log.seek(0)
            return log.read()[-3000:]

        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {server_log()}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("server did not become ready")
                time.sleep(0.2)

            async def complete(client: httpx.AsyncClient, prompt: str) -> list:
                body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
                r = await client.post(f"{url}/v1/completions", json=body, timeout=600)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}\nserver log: {server_log()}")
                choice = r.json()["choices"][0]
                return [choice["text"], choice["logprobs"]["token_logprobs"]]

            async def main() -> list:
                async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as client:
                    outs = await asyncio.gather(*(complete(client, p) for p in workload()))
                    for p in PROBES:
                        outs.append(await complete(client, p))
                    return list(outs)

            outputs = asyncio.run(main())
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            preemptions = next((line.split()[-1] for line in metrics.splitlines()
                                if "preemption" in line and not line.startswith("#")), None)
            return {"outputs": outputs, "preemptions": preemptions}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def one_run(mode: str, args: argparse.Namespace, threads: int, hashseed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hashseed, HF_HUB_OFFLINE="1")
    if args.poison:  # glibc: fresh malloc memory filled with 0x5a bytes, every allocation below 32 MiB from the heap
        env |= {"MALLOC_PERTURB_": "165", "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
    kv_flags = ["--kv-cache-memory", str(args.kv_cache_memory)] if args.kv_cache_memory else []
    t0 = time.monotonic()
    if mode == "server":
        result = run_server(args.model, threads, args.max_tokens, env, args.poison, kv_flags)
    else:
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--threads", str(threads),
               "--max-tokens", str(args.max_tokens), *kv_flags, *(["--poison"] if args.poison else [])]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"child failed ({p.returncode}): {p.stderr[-3000:]}")
        result = json.loads(p.stdout.strip().splitlines()[-1])
    result.update(mode=mode, threads=threads, hashseed=hashseed, seconds=round(time.monotonic() - t0, 1))
    result["fingerprints"] = [fingerprint(text, lps) for text, lps in result["outputs"]]
    return result


# -- the comparison ---------------------------------------------------------------------------------

def compare(runs: list[dict]) -> dict:
    """Per request, the most common fingerprint over all runs; which runs and requests differ from it."""
    n = len(runs[0]["fingerprints"])
    majority = [Counter(r["fingerprints"][i] for r in runs).most_common(1)[0][0] for i in range(n)]
    differing = {}
    for k, r in enumerate(runs):
        bad = [i for i in range(n) if r["fingerprints"][i] != majority[i]]
        if bad:
            differing[k] = bad
    return {"requests": n, "runs": len(runs), "identical_runs": len(runs) - len(differing),
            "differing_runs": {str(k): v for k, v in differing.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=30, help="fresh processes per mode")
    ap.add_argument("--mode", choices=["llm", "server", "both"], default="both")
    ap.add_argument("--threads", default="1,2", help="thread counts, cycled over the runs")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--hashseed", default=None, help="PYTHONHASHSEED for every run (default: random per run)")
    ap.add_argument("--kv-cache-memory", type=int, default=None,
                    help="KV cache bytes (default: the engine's share of free memory); small values force eviction")
    ap.add_argument("--poison", action="store_true",
                    help="fill memory nobody wrote: torch.empty with NaN, malloc with 0x5a bytes")
    ap.add_argument("--json", default=None, help="write every run's fingerprints and the comparison here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    if argv is None and sys.argv[1:2] == ["--serve-poisoned"]:  # `churon serve ...` after poison_memory()
        from churon.cli import main as churon_main

        poison_memory()
        return churon_main(sys.argv[2:])
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    if args.child:
        if args.poison:
            poison_memory()
        options = {"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}
        print(json.dumps(child_llm(args.model, threads[0], args.max_tokens, options)))
        return 0
    modes = ["llm", "server"] if args.mode == "both" else [args.mode]
    runs, failed = [], []
    for k in range(args.runs):
        for mode in modes:
            seed = args.hashseed if args.hashseed is not None else str(secrets.randbelow(2**32))
            t = threads[k % len(threads)]
            try:
                r = one_run(mode, args, t, seed)
            except Exception as e:  # noqa: BLE001 - a run that could not finish is reported, not compared
                failed.append({"mode": mode, "threads": t, "hashseed": seed, "error": str(e)[-3000:]})
                print(f"run {mode:6s} threads={t} PYTHONHASHSEED={seed:>10s} FAILED: {str(e)[-3000:]}", flush=True)
                continue
            runs.append(r)
            print(f"run {len(runs) - 1:3d} {mode:6s} threads={t} PYTHONHASHSEED={seed:>10s}"
                  f" {r['seconds']:6.1f} s  digest {hashlib.sha256(''.join(r['fingerprints']).encode()).hexdigest()[:12]}",
                  flush=True)
    if not runs:
        print(f"every run failed ({len(failed)})")
        return 2
    report = {mode: compare([r for r in runs if r["mode"] == mode]) for mode in modes if any(r["mode"] == mode for r in runs)}
    report["all"] = compare(runs)
    report["failed_runs"] = len(failed)
    for name, c in report.items():
        if name != "failed_runs":
            print(f"{name:6s}: {c['runs']} runs x {c['requests']} requests: {c['identical_runs']} identical,"
                  f" {len(c['differing_runs'])} differing {c['differing_runs'] or ''}")
    print(f"failed runs (not compared): {len(failed)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"report": report, "failed": failed, "runs": [{k: v for k, v in r.items() if k != "outputs"} | {"texts": [o[0] for o in r["outputs"]]}
                                                  for r in runs]}, f, indent=1)
    return 1 if report["all"]["differing_runs"] else 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
