"""Native CPU matmul kernels (churon._cpu) on SmolLM2-135M shapes, next to memory bandwidth.

For every weight type and shape: time of y = x @ W.T for M = 1, 4, 16, 64 rows of x, and the
effective weight bandwidth (weight bytes / time). Each measurement cycles through enough
distinct copies of the matrix that the working set is far larger than the caches (default
160 MiB against a 32 MiB L3), so M = 1 numbers are what decode sees. Printed beside:

  * read:  churon's own multi-threaded read kernel over a 256 MiB buffer (the GEMV ceiling)
  * copy:  numpy copy of 256 MiB (STREAM copy; bytes read + written)
  * torch: torch fp32 F.linear on the dequantized weights (same working-set rule)

Results are the best of several passes (other processes may share the CPU).

    python benchmarks/bench_kernels.py                       # all types, all shapes, 2 threads
    python benchmarks/bench_kernels.py --types Q4_1,Q8_0 --ms 1 --threads 1,2
    python benchmarks/bench_kernels.py --json results.json
    python benchmarks/bench_kernels.py --decode ~/.cache/churon/models/SmolLM2-135M-Instruct.Q4_1.gguf --ctx 100,1000
    python benchmarks/bench_kernels.py --attention-rows 1,5,9,16 --ctx 800 --kv-dtype float32

--attention-rows: attention_decode for R query rows of one sequence at the end of a context (a speculative
verification, a prefill chunk: one block table, read once for the group) against the same R rows as R
sequences holding copies of those blocks (R tables: each row reads its own), SmolLM2's heads (9 q, 3 kv, 64
dims), the caches of 30 layers cycled through so K and V come from memory, as in a decode step.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from churon import kernels
from churon.formats.quants import dequantize
from churon.kernels.ground_truth import random_weight_bytes

# SmolLM2-135M: q/o, k/v, gate/up, fused gate_up, down, lm_head (tied Q8_0 embedding)
SHAPES = [(576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (49152, 576)]
LM_HEAD = (49152, 576)


def weight_bytes(qtype: T, rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{qtype.name}{rows}x{cols}".encode()))
    return random_weight_bytes(qtype, rows, cols, rng, scale=0.05)


def best_time(fn, passes: int) -> float:
    fn()  # warm up (page faults, thread start)
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bandwidth(cpu, passes: int) -> dict[str, float]:
    buf = np.ones(256 << 20, np.uint8)
    dst = np.empty_like(buf)
    read = buf.nbytes / best_time(lambda: cpu.read_bytes(buf.ctypes.data, buf.nbytes), passes) / 1e9
    copy = 2 * buf.nbytes / best_time(lambda: np.copyto(dst, buf), passes) / 1e9
    return {"read_GBps": read, "numpy_copy_GBps": copy}


def bench_native(cpu, qtype: T, rows: int, cols: int, ms: list[int], ws: int, passes: int) -> dict[int, float]:
    raw = weight_bytes(qtype, rows, cols)
    first = cpu.QMatrix(raw, int(qtype), rows, cols)
    copies = [first] + [cpu.QMatrix(raw, int(qtype), rows, cols) for _ in range(max(1, ws // first.nbytes) - 1)]
    out = {}
    for m in ms:
        x = torch.randn(m, cols)
        y = torch.empty(m, rows)
        xp, yp = x.data_ptr(), y.data_ptr()

        def run():
            for q in copies:
                q.matmul(xp, yp, m)

        out[m] = best_time(run, passes) / len(copies)
    return out, first.nbytes, first.layout


def bench_torch(rows: int, cols: int, ms: list[int], ws: int, passes: int) -> dict[int, float]:
    w = dequantize(weight_bytes(T.Q8_0, rows, cols), T.Q8_0, (rows, cols))
    copies = [w] + [w.clone() for _ in range(max(2, ws // (w.numel() * 4)) - 1)]
    out = {}
    for m in ms:
        x = torch.randn(m, cols)

        def run():
            for c in copies:
                F.linear(x, c)

        out[m] = best_time(run, passes) / len(copies)
    return out


def bench_decode(cpu, path: str, ctx: int, threads: list[int], tokens: int, torch_ops: bool,
                 kv_dtype: str = "float32") -> list[dict]:
    """One decode step of a Llama-style GGUF (e.g. SmolLM2-135M) through the raw kernel API from
    Python, with fused qkv and gate_up weights: what the model's decode costs when every op is a
    native call. torch_ops adds the torch work a sampler does per token (softmax + argmax over
    the vocabulary), to show the interplay of torch's OpenMP threads with churon's pool."""
    from churon.formats.gguf import GGUFFile

    f = GGUFFile.open(path)
    t = f.tensors
    md = f.metadata
    arch = md["general.architecture"]
    n_layers = int(md[f"{arch}.block_count"])
    n_heads = int(md[f"{arch}.attention.head_count"])
    n_kv = int(md[f"{arch}.attention.head_count_kv"])
    hidden = t["token_embd.weight"].shape[1]
    hd = hidden // n_heads
    eps = float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))

    def qmat(names):
        raws = [np.ascontiguousarray(t[n].data).reshape(-1) for n in names]
        return cpu.QMatrix(np.concatenate(raws), int(t[names[0]].qtype), sum(t[n].shape[0] for n in names),
                           t[names[0]].shape[1])

    def vec(name):
        return torch.from_numpy(np.array(t[name].data).view(np.float32).copy())

    block = 16
    nblocks = (ctx + block) // block + 1
    layers = []
    for i in range(n_layers):
        p = f"blk.{i}."
        layers.append(dict(
            qkv=qmat([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
            o=qmat([p + "attn_output.weight"]),
            gu=qmat([p + "ffn_gate.weight", p + "ffn_up.weight"]),
            down=qmat([p + "ffn_down.weight"]),
            n1=vec(p + "attn_norm.weight"), n2=vec(p + "ffn_norm.weight"),
            k=(torch.randn(nblocks, block, n_kv, hd) * 0.3).to(getattr(torch, kv_dtype)),
            v=torch.randn(nblocks, block, n_kv, hd).to(getattr(torch, kv_dtype))))
    lm = qmat(["output.weight" if "output.weight" in t else "token_embd.weight"])
    final_norm = vec("output_norm.weight")
    inter = layers[0]["down"].cols
    qkv_w = (n_heads + 2 * n_kv) * hd
    buf = {name: torch.randn(1, n) * 0.1 for name, n in
           [("x", hidden), ("h", hidden), ("qkv", qkv_w), ("att", n_heads * hd), ("o", hidden),
            ("gu", 2 * inter), ("act", inter), ("dn", hidden), ("logits", lm.rows)]}
    ptr = {k: v.data_ptr() for k, v in buf.items()}
    table = torch.arange(nblocks, dtype=torch.int32).reshape(1, -1)
    seq_len = torch.tensor([ctx], dtype=torch.int32)
    pos = torch.tensor([ctx - 1], dtype=torch.int64)
    cos, sin = torch.randn(ctx + 1, hd), torch.randn(ctx + 1, hd)
    keep = [table, seq_len, pos, cos, sin]
    tp, sp, pp, cp, snp = (a.data_ptr() for a in keep)
    L = [(l["qkv"], l["o"], l["gu"], l["down"], l["n1"].data_ptr(), l["n2"].data_ptr(), l["k"].data_ptr(),
          l["v"].data_ptr()) for l in layers]
    res = buf["x"].clone()
    rp = res.data_ptr()
    scale = hd**-0.5
    logits = buf["logits"]

    def step():
        cpu.add_rms_norm(rp, ptr["x"], L[0][4], ptr["h"], 1, hidden, eps)
        for i, (qkv, o, gu, down, n1, n2, k, v) in enumerate(L):
            if i:
                cpu.add_rms_norm(rp, ptr["dn"], n1, ptr["h"], 1, hidden, eps)
            qkv.matmul(ptr["h"], ptr["qkv"], 1)
            cpu.rope_and_cache(ptr["qkv"], 1, n_heads, n_kv, hd, pp, cp, snp, k, v, pp, 0, kv_dtype)
            cpu.attention_decode(ptr["qkv"], k, v, tp, sp, ptr["att"], 1, n_heads, n_kv, hd, block, scale, nblocks,
                                 qkv_w, kv_dtype)
            o.matmul(ptr["att"], ptr["o"], 1)
            cpu.add_rms_norm(rp, ptr["o"], n2, ptr["h"], 1, hidden, eps)
            gu.matmul(ptr["h"], ptr["gu"], 1)
            cpu.swiglu(ptr["gu"], ptr["act"], 1, inter)
            down.matmul(ptr["act"], ptr["dn"], 1)
        cpu.add_rms_norm(rp, ptr["dn"], final_norm.data_ptr(), ptr["h"], 1, hidden, eps)
        lm.matmul(ptr["h"], ptr["logits"], 1)
        if torch_ops:
            torch.softmax(logits, -1).argmax()

    weights = sum(l[k].nbytes for l in layers for k in ("qkv", "o", "gu", "down")) + lm.nbytes
    out = []
    for n in threads:
        cpu.set_num_threads(n)
        for _ in range(5):
            step()
        times = []
        cpu.pool_stats(True)
        for _ in range(tokens):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        times.sort()
        best, med = times[0], times[len(times) // 2]
        jobs, items, caller_items, wait_ns, long_waits, solo = cpu.pool_stats(True)
        pool = (f"; pool: caller ran {caller_items / max(items, 1):.0%} of parallel items, waited"
                f" {wait_ns / 1e3 / tokens:.0f} us/token for workers, {solo / max(jobs + solo, 1):.0%} of jobs solo")
        print(f"decode {arch} {n_layers} layers, ctx {ctx} ({kv_dtype} KV), {n} threads"
              f"{' + torch sampling ops' if torch_ops else ''}:"
              f" best {best * 1e3:.2f} ms, median {med * 1e3:.2f} ms = {1 / med:.0f} tokens/s;"
              f" weights {weights / 2**20:.1f} MiB at {weights / best / 1e9:.1f} GB/s (best)"
              + (pool if n > 1 else ""), flush=True)
        out.append({"threads": n, "ctx": ctx, "kv_dtype": kv_dtype, "torch_ops": torch_ops, "best_s": best,
                    "median_s": med})
    return out


def bench_attention_rows(cpu, rows: list[int], ctx: int, kv_dtype: str, passes: int) -> list[dict]:
    """Seconds per layer of attention for R rows of one sequence vs R sequences with the same blocks copied."""
    heads, kv_heads, head_dim, block, layers = 9, 3, 64, 16, 30
    g = torch.Generator().manual_seed(0)
    out = []
    print(f"attention_decode, context {ctx}, {kv_dtype} cache, {layers} layers' caches cycled; best of {passes}")
    print(f"{'rows':>5} {'one sequence':>14} {'R sequences':>14} {'ratio':>6}")
    for r in rows:
        nb = (ctx + r + block - 1) // block
        # R copies of the sequence's blocks, per layer: copy c of block i is block c * nb + i
        shape = (layers, r * nb, block, kv_heads, head_dim)
        k = torch.randn(*shape, generator=g).to(getattr(torch, kv_dtype))
        v = torch.randn(*shape, generator=g).to(getattr(torch, kv_dtype))
        lens = torch.arange(ctx + 1, ctx + r + 1, dtype=torch.int32)
        q = torch.randn(r, heads, head_dim, generator=g)
        res = torch.empty_like(q)
        one = torch.arange(nb, dtype=torch.int32).repeat(r, 1).contiguous()
        copies = (torch.arange(nb, dtype=torch.int32) + nb * torch.arange(r, dtype=torch.int32)[:, None]).contiguous()
        times = {}
        for name, table in (("one", one), ("copies", copies)):
            def step():
                for layer in range(layers):
                    cpu.attention_decode(q.data_ptr(), k[layer].data_ptr(), v[layer].data_ptr(), table.data_ptr(),
                                         lens.data_ptr(), res.data_ptr(), r, heads, kv_heads, head_dim, block,
                                         head_dim**-0.5, nb, 0, kv_dtype)
            times[name] = best_time(step, passes) / layers
        print(f"{r:>5} {times['one'] * 1e6:11.1f} us {times['copies'] * 1e6:11.1f} us {times['copies'] / times['one']:5.2f}x",
              flush=True)
        out.append({"rows": r, "ctx": ctx, "kv_dtype": kv_dtype, "one_sequence_s": times["one"],
                    "r_sequences_s": times["copies"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K,F16")
    ap.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES),
                    help=f"rowsxcols list; {LM_HEAD[0]}x{LM_HEAD[1]} runs for Q8_0 only unless --all-lm-head")
    ap.add_argument("--all-lm-head", action="store_true")
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--ws-mib", type=int, default=160, help="working set per measurement (MiB)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads for the torch rows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--decode", default=None, metavar="GGUF",
                    help="instead: time whole decode steps of this GGUF through the kernel API")
    ap.add_argument("--ctx", default="100", help="--decode: context lengths")
    ap.add_argument("--tokens", type=int, default=100, help="--decode: steps timed")
    ap.add_argument("--torch-ops", action="store_true", help="--decode: add torch softmax+argmax per step")
    ap.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--attention-rows", default=None, metavar="R,R",
                    help="attention for R rows of one sequence vs R sequences, at context --ctx")
    args = ap.parse_args()

    if not kernels.native_available():
        raise SystemExit(f"no native kernels: {kernels.reason}")
    cpu = kernels.cpu
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.isa:
        cpu.set_isa(args.isa)
    if args.attention_rows:
        cpu.set_num_threads(int(args.threads.split(",")[0]))
        runs = [r for ctx in args.ctx.split(",") for r in bench_attention_rows(
            cpu, [int(v) for v in args.attention_rows.split(",")], int(ctx), args.kv_dtype, args.passes)]
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"isa": cpu.isa(), "attention_rows": runs}, f, indent=1)
        return
    if args.decode:
        runs = []
        for ctx in [int(v) for v in args.ctx.split(",")]:
            runs += bench_decode(cpu, args.decode, ctx, [int(v) for v in args.threads.split(",")], args.tokens,
                                 args.torch_ops, args.kv_dtype)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"isa": cpu.isa(), "decode": runs}, f, indent=1)
        return
    types = [T[name] for name in args.types.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    ws = args.ws_mib << 20
    results = {"isa": cpu.isa(), "torch_threads": torch.get_num_threads(), "runs": []}
    print(f"isa {cpu.isa()}; torch threads {torch.get_num_threads()}; working set {args.ws_mib} MiB; best of {args.passes}")
    for threads in [int(v) for v in args.threads.split(",")]:
        cpu.set_num_threads(threads)
        bw = bandwidth(cpu, args.passes)
        results["runs"].append({"threads": threads, **bw, "matmul": []})
        print(f"\n== {threads} threads: read {bw['read_GBps']:.1f} GB/s, numpy copy {bw['numpy_copy_GBps']:.1f} GB/s")
        head = "".join(f"{'M=' + str(m):>22}" for m in ms)
        print(f"{'type':6} {'shape':>11} {'MiB':>7}{head}")
        for rows, cols in shapes:
            for qtype in types:
                if (rows, cols) == LM_HEAD and qtype != T.Q8_0 and not args.all_lm_head:
                    continue
                block = GGML_QUANT_SIZES[qtype][0]
                if cols % block:
                    continue
                times, nbytes, layout = bench_native(cpu, qtype, rows, cols, ms, ws, args.passes)
                cells = "".join(f"{times[m] * 1e6:9.1f}us {nbytes / times[m] / 1e9:6.1f}GB/s" for m in ms)
                print(f"{qtype.name:6} {rows:>5}x{cols:<5} {nbytes / 2**20:7.2f}{cells}", flush=True)
                results["runs"][-1]["matmul"].append(
                    {"type": qtype.name, "rows": rows, "cols": cols, "bytes": nbytes, "layout": layout,
                     "seconds": {str(m): times[m] for m in ms}})
            if not args.no_torch:
                times = bench_torch(rows, cols, ms, ws, args.passes)
                nbytes = rows * cols * 4
                cells = "".join(f"{times[m] * 1e6:9.1f}us {nbytes / times[m] / 1e9:6.1f}GB/s" for m in ms)
                print(f"{'torch':6} {rows:>5}x{cols:<5} {nbytes / 2**20:7.2f}{cells}  (fp32 F.linear)", flush=True)
                results["runs"][-1]["matmul"].append(
                    {"type": "torch_fp32", "rows": rows, "cols": cols, "bytes": nbytes,
                     "seconds": {str(m): times[m] for m in ms}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
