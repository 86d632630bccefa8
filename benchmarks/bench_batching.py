"""Continuous batching: churon batched vs churon one-at-a-time vs llama.cpp batched, side by side in one run.

SmolLM2-135M-Instruct Q4_1, the same GGUF and thread count for every engine.

1. Throughput. --num-requests prompts of --prompt-len tokens (distinct slices of license texts tokenized by
   churon), --max-tokens greedy output tokens each, EOS ignored. Output tokens/s = all generated tokens /
   wall seconds from the first request in to the last token out (prompt processing included):
     churon batched     LLM.generate on all requests at once (continuous batching, max_num_seqs per row)
     churon sequential  a loop of LLM.generate([p]); only the first --sequential-requests are run and the
                        wall time for all of them is extrapolated from their rate (the output says so)
     llama.cpp          llama-cpp-python's low-level API: one llama_batch carrying several sequences
                        (one seq_id each), llama_decode, greedy argmax over llama_get_logits_ith in numpy;
                        --llamacpp-parallel slots, a finished slot takes the next waiting prompt (as
                        llama-server does). A few requests are rerun one at a time in the same context: their
                        rate shows the batching gain, and their tokens are compared with the batched ones
                        (llama.cpp's rounding depends on the batch, so a greedy near-tie may flip after some
                        dozens of tokens: the output gives where and the logit gap there; mixed-up sequences
                        would differ at once and by a wide gap).
   Ratios: churon batched / churon sequential (target >= 4x) and churon batched / llama.cpp best (>= 1.5x).
   Ceiling: the workload's matmuls alone (every prompt and generated token through the layers, every
   sampled token's logits) at the rate churon's kernels reach with 512 rows, measured in the batched
   phase's process; the most batching could give over sequential before attention and the rest.
2. Peak resident memory (ru_maxrss) per row: every engine setting runs in a subprocess of its own
   (this script with --only PHASE), so each peak is that phase's alone. The CPU % column is the share of
   --threads cores each timed phase got (CPU time / wall / threads): well under 100 flags a run slowed by
   other work on the machine.
3. Prefix cache. 16 requests sharing a 512-token system prompt plus a distinct ~20-token user part,
   max_tokens=1: time to first token (arrival -> first token, mean and p50) and total wall time, prefix
   cache on vs off, with requests arriving one after another (each once the previous finished) and all at
   once (a burst: the first few are scheduled together before any prefix block is cached).

    python benchmarks/bench_batching.py --threads 2 [--json out.json]
    python benchmarks/bench_batching.py --num-requests 16 --max-tokens 32 --sequential-requests 2   # quick check

churon's KV cache is sized for the workload by default (--kv-cache-memory auto), so its peak memory is
comparable with llama.cpp's context sized for --llamacpp-parallel sequences; --kv-cache-memory default
leaves the engine's own default (a fraction of free memory, touched at start-up).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llamacpp_peer as peer

TEXT_FILES = ["GPL-3", "Apache-2.0", "GPL-2", "MPL-2.0", "LGPL-2.1", "Artistic"]
TEXT_DIR = Path("/usr/share/common-licenses")
FALLBACK_TEXT = " ".join(
    f"Paragraph {i}: the history of computing is a story of ever smaller machines doing ever larger jobs; "
    f"machine {i * 7 % 13} filled a room, drew {i * 3} kilowatts and was programmed by rewiring panels."
    for i in range(600)
)
TARGET_VS_SEQUENTIAL = 4.0
TARGET_VS_LLAMACPP = 1.5


# ---------------------------------------------------------------- helpers

def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds() -> float:
    """User + system CPU time of this process (every thread) so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_share(cpu: float, wall: float, threads: int) -> float:
    """Percent of `threads` cores this process got over `wall` seconds: well under 100 means other work took
    the CPUs (or the engine left its threads idle), and every rate measured then is low."""
    return 100 * cpu / (wall * threads) if wall > 0 else float("nan")


def current_rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 16 or 8,16,32")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1")
    return values


def first_equal(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------- workload (built once, in the parent)

def build_workload(args) -> dict:
    """Token-id prompts for every phase, tokenized by churon's tokenizer (read from the GGUF, no weights)."""
    from churon.config import EngineConfig
    from churon.engine.kv_cache import kv_bytes_per_token
    from churon.loader import open_model
    from churon.tokenizer import load_tokenizer

    source = open_model(args.model)
    tokenizer = load_tokenizer(source)
    files = [TEXT_DIR / name for name in TEXT_FILES if (TEXT_DIR / name).exists()]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    text = "\n\n".join(texts) if texts else FALLBACK_TEXT
    tokens = tokenizer.encode(text, add_bos=False)

    n, length = args.num_requests, args.prompt_len
    if len(tokens) < length + n:
        raise SystemExit(f"the benchmark text has {len(tokens)} tokens: too few for {n} distinct {length}-token"
                         " prompts; lower --num-requests or --prompt-len")
    stride = min(length, (len(tokens) - length) // n)  # non-overlapping when the text is long enough
    prompts = [tokens[i * stride : i * stride + length] for i in range(n)]

    # prefix-cache workload: two different system prompts (one per arrival pattern, so that the burst run
    # cannot reuse blocks the one-by-one run cached), each followed by distinct user parts
    s, u, k = args.system_len, args.user_len, args.prefix_requests
    need = 2 * s + k * u
    if len(tokens) < need:
        raise SystemExit(f"the benchmark text has {len(tokens)} tokens: too few for the prefix workload ({need})")
    tail = tokens[len(tokens) - need :]  # from the end of the text, away from the throughput prompts
    systems = [tail[:s], tail[s : 2 * s]]
    users = [tail[2 * s + i * u : 2 * s + (i + 1) * u] for i in range(k)]
    warmup = tokens[::-1][: max(length, s + u) + 8]  # reversed text: no prefix in common with any prompt
    return {
        "prompts": prompts,
        "prefix": {"systems": systems, "users": users},
        "warmup": warmup,
        "text_tokens": len(tokens),
        "kv_bytes_per_token": kv_bytes_per_token(source.config, churon_kv_dtype(args)),
        "block_size_hint": EngineConfig().block_size,
    }


# ---------------------------------------------------------------- churon phases

def churon_kv_dtype(args):
    """The torch dtype churon's KV cache will have for these arguments."""
    import torch

    from churon.loader import make_backend
    from churon.engine.kv_cache import KV_DTYPES

    if args.churon_kv_dtype != "auto":
        return KV_DTYPES[args.churon_kv_dtype]
    return make_backend("auto", getattr(torch, args.churon_dtype)).kv_dtype


def churon_llm(args, workload: dict, max_num_seqs: int, seq_len: int, concurrent: int,
               enable_prefix_caching: bool = True):
    """An LLM for one phase. With --kv-cache-memory auto its KV cache holds `concurrent` sequences of seq_len tokens."""
    from churon import LLM

    options = {"max_num_seqs": max_num_seqs, "enable_prefix_caching": enable_prefix_caching,
               "kv_dtype": args.churon_kv_dtype}
    if args.kv_cache_memory == "auto":
        bytes_per_token = workload["kv_bytes_per_token"]
        block = workload["block_size_hint"]
        seq_tokens = block * math.ceil((seq_len + 1) / block)
        options["kv_cache_memory"] = (concurrent + 1) * seq_tokens * bytes_per_token  # one sequence of slack
    elif args.kv_cache_memory != "default":
        options["kv_cache_memory"] = int(float(args.kv_cache_memory) * 2**20)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.churon_dtype, threads=args.threads, **options)
    load_seconds = time.perf_counter() - t0
    plan = llm.engine.memory_plan
    info = {
        "options": options,
        "load_seconds": round(load_seconds, 2),
        "kv_cache_tokens": getattr(plan, "kv_tokens", None),
        "kv_cache_mib": round(getattr(plan, "kv_bytes", 0) / 2**20, 1),
    }
    return llm, info


def churon_warmup(llm, workload: dict, prompt_len: int, batch: int) -> None:
    """First calls pay one-time costs (thread pools, allocator, kernel set-up): run the phase's shapes once.

    The warm-up prompts are reversed text, so they share no prefix-cache block with any timed prompt."""
    from churon import SamplingParams

    w = workload["warmup"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [w[i : i + prompt_len] for i in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts[:1], params, use_tqdm=False)


def matmul_ceiling(model) -> dict:
    """What the matmuls alone cost: the model's multiply-adds per token (the decoder layers) and per sampled
    token (the logits, computed at 16-bit activation precision: twice the multiply-adds), and the rate
    churon's kernels reach on the model's own layer matrices with 512 activation rows (a prompt chunk),
    which is where they run fastest."""
    import torch

    layer = model.layers[0]
    matrices = [layer.qkv, layer.o, layer.gate_up, layer.down]
    macs, seconds = 0, 0.0
    for w in matrices:
        x = torch.randn(512, w.cols)
        model.backend.linear(w, x)  # warm-up
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            model.backend.linear(w, x)
            best = min(best, time.perf_counter() - t0)
        macs, seconds = macs + 512 * w.rows * w.cols, seconds + best
    return {"macs_per_token": len(model.layers) * sum(w.rows * w.cols for w in matrices),
            "macs_per_logits_row": 2 * model.lm_head.rows * model.lm_head.cols,
            "matmul_gmacs": macs / seconds / 1e9}


def phase_churon_batched(args, workload: dict, max_num_seqs: int) -> dict:
    from churon import SamplingParams

    llm, info = churon_llm(args, workload, max_num_seqs, args.prompt_len + args.max_tokens,
                           min(max_num_seqs, args.num_requests))
    rss_loaded = current_rss_mib()
    churon_warmup(llm, workload, args.prompt_len, min(4, max_num_seqs))
    prompts = workload["prompts"]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    c0, t0 = cpu_seconds(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    generated = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.prefill_seconds for o in outs]
    return {
        **info,
        "requests": len(prompts),
        "generated_tokens": generated,
        "wall_seconds": wall,
        "output_tokens_per_second": generated / wall,
        "ttft_mean_seconds": statistics.mean(ttft),
        "ttft_max_seconds": max(ttft),
        "cpu_percent": cpu_share(cpu, wall, args.threads),
        "rss_after_load_mib": rss_loaded,
        "peak_rss_mib": peak_rss_mib(),
        "check_token_ids": [o.token_ids for o in outs[: args.sequential_requests]],
        "prompt_tokens": sum(len(p) for p in prompts),
        "ceiling": matmul_ceiling(llm.model),
    }


def phase_churon_sequential(args, workload: dict) -> dict:
    from churon import SamplingParams

    llm, info = churon_llm(args, workload, 1, args.prompt_len + args.max_tokens, 1)
    rss_loaded = current_rss_mib()
    churon_warmup(llm, workload, args.prompt_len, 1)
    prompts = workload["prompts"]
    run = prompts[: args.sequential_requests] if args.sequential_requests else prompts
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = []
    c0, t0 = cpu_seconds(), time.perf_counter()
    for p in run:
        outs.extend(llm.generate([p], params, use_tqdm=False))
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    generated = sum(len(o.token_ids) for o in outs)
    rate = generated / wall
    return {
        **info,
        "requests": len(run),
        "requests_total": len(prompts),
        "extrapolated": len(run) < len(prompts),
        "generated_tokens": generated,
        "wall_seconds_measured": wall,
        "wall_seconds": wall * len(prompts) / len(run),  # for every request, at the measured rate
        "output_tokens_per_second": rate,
        "cpu_percent": cpu_share(cpu, wall, args.threads),
        "rss_after_load_mib": rss_loaded,
        "peak_rss_mib": peak_rss_mib(),
        "check_token_ids": [o.token_ids for o in outs],
    }


def phase_prefix(args, workload: dict) -> dict:
    from churon import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    systems, users = workload["prefix"]["systems"], workload["prefix"]["users"]
    results = {}
    for cache_on in (True, False):
        llm, info = churon_llm(args, workload, args.prefix_max_num_seqs, args.system_len + args.user_len + 1,
                               len(users), enable_prefix_caching=cache_on)
        churon_warmup(llm, workload, args.system_len + args.user_len, min(4, args.prefix_max_num_seqs))
        for arrival, system in (("one-by-one", systems[0]), ("burst", systems[1])):
            prompts = [system + u for u in users]
            c0, t0 = cpu_seconds(), time.perf_counter()
            if arrival == "burst":
                outs = llm.generate(prompts, params, use_tqdm=False)
            else:
                outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            wall = time.perf_counter() - t0
            cpu = cpu_seconds() - c0
            ttft = [o.metrics.prefill_seconds for o in outs]
            results[f"{'on' if cache_on else 'off'} {arrival}"] = {
                "prefix_caching": cache_on,
                "arrival": arrival,
                "requests": len(prompts),
                "prompt_tokens": len(prompts[0]),
                "ttft_mean_seconds": statistics.mean(ttft),
                "ttft_p50_seconds": statistics.median(ttft),
                "ttft_max_seconds": max(ttft),
                "wall_seconds": wall,
                "cached_prompt_tokens_mean": statistics.mean(o.metrics.cached_prompt_tokens for o in outs),
                "cpu_percent": cpu_share(cpu, wall, args.threads),
                "load": info,
            }
        del llm
    return {"runs": results, "peak_rss_mib": peak_rss_mib()}


# ---------------------------------------------------------------- llama.cpp phase (low-level API)

class LlamaCppBatched:
    """Several sequences in one llama_batch: a slot per sequence (seq_id = slot), greedy argmax in numpy."""

    def __init__(self, path: str, threads: int, parallel: int, seq_tokens: int, n_batch: int, n_ubatch: int,
                 kv_unified: bool):
        import ctypes

        self.L = L = peer.import_llama_cpp()
        self._quiet = L.llama_log_callback(lambda level, text, data: None)  # keep a reference: C holds the pointer
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.parallel = parallel
        self.n_batch = n_batch
        cparams = L.llama_context_default_params()
        # without kv_unified every sequence gets its own KV stream of n_ctx / n_seq_max cells
        cparams.n_ctx = parallel * seq_tokens
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_ubatch
        cparams.n_seq_max = parallel
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = kv_unified
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={cparams.n_ctx}, n_seq_max={parallel})")
        self.n_ctx_seq = L.llama_n_ctx_seq(self.ctx) if hasattr(L, "llama_n_ctx_seq") else L.llama_n_ctx(self.ctx)
        if self.n_ctx_seq < seq_tokens:
            raise RuntimeError(f"llama.cpp gives each sequence {self.n_ctx_seq} KV cells, {seq_tokens} needed")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(n_batch, 0, 1)  # token batch, up to n_batch tokens, 1 seq_id per token

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def generate(self, prompts: list[list[int]], max_tokens: int, parallel: int | None = None,
                 reference: list[list[int]] | None = None) -> list[list[int]]:
        """Greedy outputs, prompts admitted into free slots in order; at most `parallel` run at once.

        reference: other greedy outputs of the same prompts; self.divergence gets, for each request, the first
        token where this run's argmax differs from the reference and by how much its logit beats the reference
        token's there (a small gap: a near-tie decided by rounding, not sequences mixed up)."""
        from collections import deque

        L, batch = self.L, self.batch
        parallel = parallel or self.parallel
        L.llama_memory_clear(self.mem, True)
        # seconds in llama_decode calls that carried prompt tokens, and in those that carried only decode tokens
        self.stats = {"mixed_or_prefill_seconds": 0.0, "decode_only_seconds": 0.0, "decode_only_tokens": 0}
        self.divergence: dict[int, dict] = {}
        waiting = deque(range(len(prompts)))
        slots: list[dict | None] = [None] * parallel
        outputs: list[list[int]] = [[] for _ in prompts]

        while waiting or any(slots):
            for s in range(parallel):  # admit
                if slots[s] is None and waiting:
                    slots[s] = {"req": waiting.popleft(), "pos": 0, "last": None}
            n = 0
            sample: list[tuple[int, int]] = []  # (batch index, slot)

            def add(token: int, pos: int, seq: int, logits: bool) -> None:
                nonlocal n
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = logits
                if logits:
                    sample.append((n, seq))
                n += 1

            for s, st in enumerate(slots):  # decodes first: one token per running sequence
                if st is not None and st["last"] is not None:
                    add(st["last"], st["pos"], s, True)
                    st["pos"] += 1
            for s, st in enumerate(slots):  # then prompt chunks in the room left
                if st is None or st["last"] is not None:
                    continue
                prompt = prompts[st["req"]]
                take = min(self.n_batch - n, len(prompt) - st["pos"])
                for j in range(st["pos"], st["pos"] + take):
                    add(prompt[j], j, s, j == len(prompt) - 1)
                st["pos"] += take
                if n >= self.n_batch:
                    break
            batch.n_tokens = n
            t0 = time.perf_counter()
            rc = L.llama_decode(self.ctx, batch)
            dt = time.perf_counter() - t0
            if n == len(sample) and all(slots[s]["pos"] > len(prompts[slots[s]["req"]]) for _, s in sample):
                self.stats["decode_only_seconds"] += dt
                self.stats["decode_only_tokens"] += n
            else:
                self.stats["mixed_or_prefill_seconds"] += dt
            if rc != 0:
                running = sum(x is not None for x in slots)
                raise RuntimeError(f"llama_decode returned {rc} ({n} tokens, {running} sequences)")
            for i, s in sample:
                st = slots[s]
                logits = peer.logits_ith(self.ctx, i, self.n_vocab)
                token = int(logits.argmax())
                out = outputs[st["req"]]
                ref = reference[st["req"]] if reference is not None else None
                first_difference = ref is not None and len(out) < len(ref) and ref[len(out)] != token
                if first_difference and st["req"] not in self.divergence:
                    gap = float(logits[token] - logits[ref[len(out)]])
                    self.divergence[st["req"]] = {"token_index": len(out), "logit_gap": gap,
                                                  "gap_over_logit_range": gap / float(logits.max() - logits.min())}
                out.append(token)
                st["last"] = token
                if len(out) >= max_tokens:
                    L.llama_memory_seq_rm(self.mem, s, -1, -1)
                    slots[s] = None
        return outputs


def phase_llamacpp(args, workload: dict, parallel: int, kv_unified: bool) -> dict:
    prompts = workload["prompts"]
    seq_tokens = 256 * math.ceil((args.prompt_len + args.max_tokens + 16) / 256)
    t0 = time.perf_counter()
    lc = LlamaCppBatched(str(args.model), args.threads, parallel, seq_tokens, args.llamacpp_batch,
                         min(args.llamacpp_ubatch, args.llamacpp_batch), kv_unified)
    load_seconds = time.perf_counter() - t0
    rss_loaded = current_rss_mib()
    w = workload["warmup"]
    lc.generate([w[i : i + args.prompt_len] for i in range(min(4, parallel))], 4)  # warm-up
    c0, t0 = cpu_seconds(), time.perf_counter()
    outs = lc.generate(prompts, args.max_tokens)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    stats = dict(lc.stats)
    generated = sum(len(o) for o in outs)

    # sanity: a few requests alone (one sequence in the batch) give the same greedy tokens, and far fewer tokens/s
    k = min(args.llamacpp_check, len(prompts))
    t1 = time.perf_counter()
    singles = lc.generate(prompts[:k], args.max_tokens, parallel=1, reference=outs[:k]) if k else []
    single_wall = time.perf_counter() - t1
    divergence = [lc.divergence.get(i) for i in range(k)]
    single_stats = dict(lc.stats) if k else None
    lc.close()
    return {
        "llama_cpp_python_version": peer.version(),
        "parallel": parallel,
        "kv_unified": kv_unified,
        "n_ctx": parallel * seq_tokens,
        "n_ctx_seq": lc.n_ctx_seq,
        "n_batch": args.llamacpp_batch,
        "load_seconds": round(load_seconds, 2),
        "requests": len(prompts),
        "generated_tokens": generated,
        "wall_seconds": wall,
        "output_tokens_per_second": generated / wall,
        "cpu_percent": cpu_share(cpu, wall, args.threads),
        # llama_decode time alone, in steps that only decoded (one new token per running sequence)
        "decode_only_tokens_per_second": stats["decode_only_tokens"] / stats["decode_only_seconds"]
        if stats["decode_only_seconds"] else None,
        "llama_decode_seconds": stats,
        "single_requests": k,
        "single_output_tokens_per_second": sum(len(o) for o in singles) / single_wall if k else None,
        "single_decode_only_tokens_per_second": single_stats["decode_only_tokens"] / single_stats["decode_only_seconds"]
        if single_stats and single_stats["decode_only_seconds"] else None,
        "single_equal_leading_tokens": [first_equal(a, b) for a, b in zip(singles, outs)],
        "single_identical": [a == b for a, b in zip(singles, outs)],
        "single_first_divergence": divergence,
        "rss_after_load_mib": rss_loaded,
        "peak_rss_mib": peak_rss_mib(),
    }


# ---------------------------------------------------------------- orchestration

def phase_names(args) -> list[str]:
    names = [f"churon:{m}" for m in args.max_num_seqs]
    if args.sequential_requests != -1:
        names.append("sequential")
    if not args.no_llamacpp:
        names += [f"llamacpp:{p}:{'u' if args.llamacpp_kv_unified else 's'}" for p in args.llamacpp_parallel]
    if not args.no_prefix:
        names.append("prefix")
    return names


def run_phase(name: str, args, workload: dict) -> dict:
    kind, _, rest = name.partition(":")
    if kind == "churon":
        return phase_churon_batched(args, workload, int(rest))
    if kind == "sequential":
        return phase_churon_sequential(args, workload)
    if kind == "llamacpp":
        parallel, _, mode = rest.partition(":")
        return phase_llamacpp(args, workload, int(parallel), mode == "u")
    if kind == "prefix":
        return phase_prefix(args, workload)
    raise SystemExit(f"unknown phase {name!r} (churon:N, sequential, llamacpp:N[:u|s], prefix)")


def child_argv(args, phase: str, workload_path: str, result_path: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--only", phase]
    argv += ["--workload", workload_path, "--result", result_path]
    for flag in ("model", "threads", "prompt_len", "max_tokens", "num_requests", "sequential_requests", "churon_dtype",
                 "churon_kv_dtype", "kv_cache_memory", "llamacpp_batch", "llamacpp_ubatch", "llamacpp_check", "prefix_max_num_seqs"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv


def fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def report(args, results: dict, seconds: float, load_before: float) -> dict:
    rows = []  # (engine, setting, tok/s, wall s, CPU %, peak MiB, note)
    batched = {k: v for k, v in results.items() if k.startswith("churon:") and "error" not in v}
    for k, v in batched.items():
        rows.append(("churon", f"batched, max_num_seqs={k.split(':')[1]}", v["output_tokens_per_second"],
                     v["wall_seconds"], v["cpu_percent"], v["peak_rss_mib"], f"KV cache {v['kv_cache_mib']:.0f} MiB"))
    seq = results.get("sequential")
    if seq and "error" not in seq:
        note = f"ran {seq['requests']} of {seq['requests_total']}: wall extrapolated" if seq["extrapolated"] else ""
        rows.append(("churon", "one request at a time", seq["output_tokens_per_second"], seq["wall_seconds"],
                     seq["cpu_percent"], seq["peak_rss_mib"], note))
    lcs = {k: v for k, v in results.items() if k.startswith("llamacpp:") and "error" not in v}
    for k, v in lcs.items():
        same = sum(v["single_identical"])
        note = f"decode-only steps {fmt(v.get('decode_only_tokens_per_second'), '.0f')} tok/s"
        if v["single_requests"]:
            note += f"; alone vs batched: {same}/{v['single_requests']} identical"
        rows.append(("llama.cpp", f"{v['parallel']} parallel seqs" + (", kv unified" if v["kv_unified"] else ""),
                     v["output_tokens_per_second"], v["wall_seconds"], v["cpu_percent"], v["peak_rss_mib"], note))
    if lcs:
        v = max(lcs.values(), key=lambda v: v["output_tokens_per_second"])
        if v["single_requests"]:
            rows.append(("llama.cpp", f"one at a time ({v['single_requests']} requests)", v["single_output_tokens_per_second"],
                         None, None, None, "same context, sanity rerun"))

    print(f"\nSmolLM2-135M-Instruct Q4_1, {args.threads} threads; {args.num_requests} requests x {args.prompt_len} prompt"
          f" tokens -> {args.max_tokens} output tokens each (greedy, EOS ignored); churon {args.churon_dtype},"
          f" KV cache {churon_kv_dtype(args)}")
    print(f"{'engine':<11}{'setting':<34}{'out tok/s':>10}{'wall s':>9}{'CPU %':>7}{'peak RSS MiB':>14}  note")
    for engine, setting, rate, wall, cpu, rss, note in rows:
        print(f"{engine:<11}{setting:<34}{fmt(rate):>10}{fmt(wall):>9}{fmt(cpu, '.0f'):>7}{fmt(rss, '.0f'):>14}  {note}")
    print(f"(out tok/s: generated tokens / wall time, prompt processing included; CPU %: share of {args.threads} cores"
          f" the phase got: under 100 when other work competed or the engine left threads idle; peak RSS: ru_maxrss"
          f" of the phase's own process)")
    for k, v in results.items():
        if "error" in v:
            print(f"{k}: FAILED: {v['error']}")

    ratios = {}
    best_churon = max(batched.values(), key=lambda v: v["output_tokens_per_second"]) if batched else None
    best_lc = max(lcs.values(), key=lambda v: v["output_tokens_per_second"]) if lcs else None
    print()
    if best_churon and seq and "error" not in seq:
        r = best_churon["output_tokens_per_second"] / seq["output_tokens_per_second"]
        ratios["churon_batched_over_sequential"] = r
        print(f"churon batched / churon sequential : {r:6.2f}x   target >= {TARGET_VS_SEQUENTIAL:.1f}x "
              f"{'met' if r >= TARGET_VS_SEQUENTIAL else 'NOT met'}")
    if best_churon and seq and "error" not in seq and best_churon.get("ceiling"):
        # every prompt token and every generated token but the last of each request runs through the layers once
        c, v = best_churon["ceiling"], best_churon
        tokens = v["prompt_tokens"] + v["generated_tokens"] - v["requests"]
        floor = (tokens * c["macs_per_token"] + v["generated_tokens"] * c["macs_per_logits_row"]) / (c["matmul_gmacs"] * 1e9)
        most = v["generated_tokens"] / floor / seq["output_tokens_per_second"]
        ratios["churon_batched_over_sequential_matmul_ceiling"] = most
        print(f"  ceiling: the workload's matmuls alone, at the {c['matmul_gmacs']:.0f} GMAC/s the kernels reach with 512"
              f" rows, take {floor:.1f} s: at most {v['generated_tokens'] / floor:.0f} tok/s = {most:.2f}x sequential"
              f" (attention, norms and sampling not counted)")
    if best_churon and best_lc:
        r = best_churon["output_tokens_per_second"] / best_lc["output_tokens_per_second"]
        ratios["churon_batched_over_llamacpp_best"] = r
        print(f"churon batched / llama.cpp best    : {r:6.2f}x   target >= {TARGET_VS_LLAMACPP:.1f}x "
              f"{'met' if r >= TARGET_VS_LLAMACPP else 'NOT met'}   (llama.cpp best: {best_lc['parallel']} parallel)")
    if best_lc and best_lc["single_requests"]:
        r = best_lc["output_tokens_per_second"] / best_lc["single_output_tokens_per_second"]
        ratios["llamacpp_batched_over_single"] = r
        print(f"llama.cpp batched / one at a time  : {r:6.2f}x   decode-only steps: "
              f"{fmt(best_lc['decode_only_tokens_per_second'], '.0f')} tok/s batched vs "
              f"{fmt(best_lc.get('single_decode_only_tokens_per_second'), '.0f')} alone (its sequences really run together;"
              f" prompt processing, the same either way, narrows the end-to-end gain)")
        print(f"llama.cpp greedy tokens alone vs batched, leading tokens equal: {best_lc['single_equal_leading_tokens']}"
              f" of {args.max_tokens}")
        for i, d in enumerate(best_lc.get("single_first_divergence") or []):
            if d:
                near_tie = d["gap_over_logit_range"] < 0.01
                print(f"  request {i}: first differs at token {d['token_index']}, where the alone run's top logit beats the"
                      f" batched run's token by {d['logit_gap']:.4f} ({100 * d['gap_over_logit_range']:.3f}% of the logit"
                      f" range): " + ("a near-tie flipped by batch-dependent rounding, not sequences mixed up" if near_tie
                                      else "NOT a near-tie: check that sequences are kept apart"))
    if best_churon and seq and "error" not in seq:
        pairs = list(zip(seq["check_token_ids"], best_churon["check_token_ids"]))
        same = [first_equal(a, b) for a, b in pairs]
        ratios["churon_batched_vs_sequential_equal_leading_tokens"] = same
        print(f"churon batched vs alone, leading greedy tokens equal: {same} of {args.max_tokens}")

    pre = results.get("prefix")
    if pre and "error" not in pre:
        runs = pre["runs"]
        print(f"\nPrefix cache: {args.prefix_requests} requests = the same {args.system_len}-token system prompt + a distinct"
              f" {args.user_len}-token user part, max_tokens=1; TTFT = arrival -> first token")
        print(f"{'cache':<7}{'arrival':<12}{'TTFT mean s':>12}{'p50 s':>9}{'max s':>9}{'wall s':>9}{'CPU %':>7}"
              f"{'cached tok/req':>16}")
        for v in runs.values():
            print(f"{'on' if v['prefix_caching'] else 'off':<7}{v['arrival']:<12}{v['ttft_mean_seconds']:>12.3f}"
                  f"{v['ttft_p50_seconds']:>9.3f}{v['ttft_max_seconds']:>9.3f}{v['wall_seconds']:>9.2f}"
                  f"{v['cpu_percent']:>7.0f}{v['cached_prompt_tokens_mean']:>16.0f}")
        for arrival in ("one-by-one", "burst"):
            on, off = runs.get(f"on {arrival}"), runs.get(f"off {arrival}")
            if on and off:
                r_mean = off["ttft_mean_seconds"] / on["ttft_mean_seconds"]
                r_p50 = off["ttft_p50_seconds"] / on["ttft_p50_seconds"]
                r_wall = off["wall_seconds"] / on["wall_seconds"]
                ratios[f"prefix_speedup_{arrival}"] = {"ttft_mean": r_mean, "ttft_p50": r_p50, "wall": r_wall}
                print(f"prefix cache speed-up ({arrival}, off / on): TTFT mean {r_mean:.2f}x, p50 {r_p50:.2f}x, wall {r_wall:.2f}x")
        print(f"(prefix phase peak RSS {pre['peak_rss_mib']:.0f} MiB)")

    load_after = os.getloadavg()[0]
    print(f"\n({seconds:.0f} s in all; 1-minute load average {load_before:.2f} before, {load_after:.2f} after"
          f"{'; other work on the CPUs skews every figure' if max(load_before, load_after) > args.threads + 0.5 else ''})")
    return {"rows": [dict(zip(("engine", "setting", "output_tokens_per_second", "wall_seconds", "cpu_percent", "peak_rss_mib",
                               "note"), r))
                     for r in rows], "ratios": ratios,
            "targets": {"churon_batched_over_sequential": TARGET_VS_SEQUENTIAL,
                        "churon_batched_over_llamacpp_best": TARGET_VS_LLAMACPP},
            "load_average_before": load_before, "load_average_after": load_after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--model", default=None, help="GGUF path (default: the registry's smollm2-135m)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int_list, default=[64], help="churon batched rows, e.g. 32,64")
    parser.add_argument("--sequential-requests", type=int, default=8,
                        help="churon one-at-a-time: run only the first N requests and extrapolate (0: all, -1: skip)")
    parser.add_argument("--churon-dtype", default="float32")
    parser.add_argument("--churon-kv-dtype", default="auto", help="churon's KV cache dtype (auto: the kernels' default)")
    parser.add_argument("--kv-cache-memory", default="auto",
                        help="churon KV cache: auto (sized for the workload), default (the engine's), or MiB")
    parser.add_argument("--llamacpp-parallel", type=int_list, default=[16, 32],
                        help="llama.cpp rows (parallel sequences), the best one is compared; e.g. 8,16,32")
    parser.add_argument("--llamacpp-kv-unified", action="store_true", help="one KV buffer shared by all sequences")
    parser.add_argument("--llamacpp-batch", type=int, default=2048, help="n_batch: tokens per llama_decode call")
    parser.add_argument("--llamacpp-ubatch", type=int, default=512)
    parser.add_argument("--llamacpp-check", type=int, default=2, help="requests rerun alone as a sanity check")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--no-prefix", action="store_true")
    parser.add_argument("--prefix-requests", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=20)
    parser.add_argument("--prefix-max-num-seqs", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--only", default=None, metavar="PHASE",
                        help="run one phase in this process and print its results: churon:N (max_num_seqs), sequential,"
                             " llamacpp:N[:u|s] (parallel sequences; u: unified KV), prefix. Alone, it tokenizes the"
                             " workload itself, which adds torch and the tokenizer to its peak RSS")
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.model is None:
        from churon.registry import resolve_model

        args.model = str(resolve_model("smollm2-135m"))

    if args.only:
        if args.workload:
            workload = json.loads(Path(args.workload).read_text())
        else:
            workload = build_workload(args)
        try:
            result = run_phase(args.only, args, workload)
        except Exception as e:  # reported by the parent next to the other rows
            result = {"error": f"{type(e).__name__}: {e}"}
            if not args.result:
                raise
        if args.result:
            Path(args.result).write_text(json.dumps(result))
        else:
            print(json.dumps({k: v for k, v in result.items() if k != "check_token_ids"}, indent=1))
        return

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"note: 1-minute load average {load_before:.2f} before the run; other work on the CPUs skews every figure")
    workload = build_workload(args)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_batching_") as tmp:
        workload_path = os.path.join(tmp, "workload.json")
        Path(workload_path).write_text(json.dumps(workload))
        for phase in phase_names(args):
            result_path = os.path.join(tmp, phase.replace(":", "_") + ".json")
            t0 = time.perf_counter()
            print(f"[{time.perf_counter() - t_start:5.0f} s] {phase} ...", end=" ", flush=True)
            proc = subprocess.run(child_argv(args, phase, workload_path, result_path), capture_output=True, text=True)
            if proc.returncode != 0 or not os.path.exists(result_path):
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                results[phase] = {"error": f"exit code {proc.returncode}: {' | '.join(tail)}"}
            else:
                results[phase] = json.loads(Path(result_path).read_text())
            r = results[phase]
            summary = (f"{r['output_tokens_per_second']:.1f} out tok/s" if "output_tokens_per_second" in r
                       else "failed" if "error" in r else "done")
            print(f"{summary} ({time.perf_counter() - t0:.0f} s)", flush=True)

    seconds = time.perf_counter() - t_start
    summary = report(args, results, seconds, load_before)
    if args.json:
        import torch

        config = {k: v for k, v in vars(args).items() if k not in ("json", "only", "workload", "result")}
        args.json.write_text(json.dumps({
            "benchmark": "bench_batching",
            "model": Path(args.model).name,
            "config": config,
            "torch_version": torch.__version__,
            "llama_cpp_python_version": peer.version(),
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "phases": {k: {kk: vv for kk, vv in v.items() if kk != "check_token_ids"} for k, v in results.items()},
            **summary,
            "seconds": round(seconds, 1),
        }, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
