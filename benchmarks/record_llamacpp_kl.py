"""Record how far llama.cpp's logits are from churon's fp32 reference on a long text, as test data.

    python benchmarks/record_llamacpp_kl.py [--out tests/data/llamacpp_kl_gpl3.json]

Text: the GNU GPL version 3 as Debian ships it (tests/data/GPL-3, a copy of /usr/share/common-licenses/GPL-3),
tokenized by churon (its ids equal llama.cpp's for SmolLM2). Model: SmolLM2-135M-Instruct Q4_1 (`smollm2-135m`).
Reference: churon in float32 (the plain-PyTorch model on dequantized weights). Test: llama.cpp through
llama-cpp-python (`pip install llama-cpp-python`), every position's logits, each window from an empty
KV cache. Windows and scoring follow llama-perplexity --kl-divergence (see churon.evaluation): 512-token
windows, the second half of each scored. Writes mean / median / p99 / max KL(ref || llama.cpp), top-1
agreement and both perplexities. Also prints churon bfloat16 against the same reference, for information.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from churon import LLM
from churon.evaluation import ComparisonAccumulator, Comparison, text_windows, window_logits
from churon.registry import resolve_model

import llamacpp_peer as peer

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "GPL-3"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def show(name: str, c: Comparison) -> None:
    print(f"{name:<28} mean KL {c.mean_kl:.6f}  median {c.median_kl:.6f}  p99 {c.p99_kl:.6f}  max {c.max_kl:.6f}  "
          f"top-1 {100 * c.top1_agreement:.2f}%  PPL {c.ppl_test:.4f} (ref {c.ppl_ref:.4f})  [{c.n_tokens} tokens]")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/data/llamacpp_kl_gpl3.json")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--no-bf16", action="store_true", help="skip the informational churon bfloat16 comparison")
    args = parser.parse_args(argv[1:])

    model_path = resolve_model("smollm2-135m")
    ref = LLM(model_path, dtype="float32", threads=args.threads)
    tok = ref.tokenizer
    tokens = tok.encode(TEXT.read_text(encoding="utf-8"))
    windows = text_windows(tokens, args.ctx, args.max_windows, bos_id=tok.bos_id if tok.add_bos else None)
    print(f"{TEXT}: {len(tokens)} tokens -> {len(windows)} windows of {args.ctx}")

    # every position's logits, one eval per window: n_batch = ctx
    llamacpp = peer.load(model_path, threads=args.threads, n_ctx=args.ctx, n_batch=args.ctx, logits_all=True)
    bf16 = None if args.no_bf16 else LLM(model_path, dtype="bfloat16", threads=args.threads)
    acc_llamacpp, acc_bf16 = ComparisonAccumulator(), ComparisonAccumulator()
    t0 = time.perf_counter()
    for i, window in enumerate(windows):
        ref_logits = window_logits(ref.model, window)
        s = acc_llamacpp.add_window(ref_logits, torch.from_numpy(peer.window_logits(llamacpp, window)), window)
        line = f"window {i + 1:>2}/{len(windows)}: llama.cpp mean KL {s.kl.mean().item():.6f}"
        if bf16 is not None:
            s = acc_bf16.add_window(ref_logits, window_logits(bf16.model, window), window)
            line += f", churon bf16 mean KL {s.kl.mean().item():.6f}"
        print(f"{line}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    print()
    result = acc_llamacpp.result()
    show("llama.cpp vs churon fp32", result)
    if bf16 is not None:
        show("churon bf16 vs churon fp32", acc_bf16.result())

    record = {
        "description": "KL(churon fp32 || llama.cpp) over GPL-3, scored as llama-perplexity --kl-divergence does",
        "model": model_path.name,
        "model_sha256": sha256(model_path),
        "model_bytes": model_path.stat().st_size,
        "llama_cpp_python_version": peer.version(),
        "llama_cpp_call": f"Llama(model, n_ctx={args.ctx}, n_batch={args.ctx}, n_threads={args.threads}, "
                          "logits_all=True); reset(); eval(window); scores[:ctx]",
        "reference": "churon LLM(model, dtype='float32'): window_logits(llm.model, window)",
        "text": str(TEXT.relative_to(ROOT)),
        "text_sha256": sha256(TEXT),
        "text_tokens": len(tokens),
        "ctx": args.ctx,
        "n_windows": len(windows),
        "scored_positions": f"ctx//2 .. ctx-2 of each window ({args.ctx - 1 - args.ctx // 2} per window)",
        "bos_replaces_first_token": tok.add_bos,
        "metrics": result.as_dict(),
        "command": " ".join(["python", "benchmarks/record_llamacpp_kl.py", *map(shlex.quote, argv[1:])]),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
