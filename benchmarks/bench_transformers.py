"""churon vs Hugging Face transformers on SmolLM2-135M-Instruct, side by side in one run.

Batch 1, a 128-token prompt, 128 new tokens (greedy, end-of-sequence ignored), same thread count.
transformers loads the same GGUF (dequantized) and runs its own KV-cache decode loop, in fp32
and in bf16; churon runs on its native kernels and on its PyTorch reference path in fp32 and bf16. Prints prefill and decode tokens/s and the ratios
of churon's best to transformers' best.

    pip install -e '.[test]' accelerate
    python benchmarks/bench_transformers.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from churon import LLM, SamplingParams  # noqa: E402
from churon.registry import resolve_model  # noqa: E402

TEXT = (
    "The history of computing is a story of ever smaller machines doing ever larger jobs. "
    "Early computers filled rooms, drew enormous power and were programmed by rewiring panels. "
    "Transistors replaced vacuum tubes, integrated circuits replaced hand-soldered boards, and "
    "microprocessors put a whole central processing unit on a single chip. Each step made "
    "computers cheaper, faster and more reliable, and each step opened new uses that nobody had "
    "planned for. Today a phone in a pocket holds more computing power than the machines that "
    "guided the first missions to the moon, and language models run on laptops. "
) * 4


def hf_run(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        t1 = time.perf_counter()
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), (new_tokens - 1) / (t2 - t1)


def churon_run(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    return out.metrics.prefill_tokens_per_second, out.metrics.decode_tokens_per_second


def best_of(fn, repeats: int) -> tuple[float, float]:
    runs = [fn() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model("smollm2-135m")

    from transformers import AutoModelForCausalLM

    rows = {}
    prompt = None
    churon_configs = {
        "churon native": {"kernels": "native"},
        "churon reference fp32": {"kernels": "reference"},
        "churon reference bf16": {"kernels": "reference", "dtype": "bfloat16"},
    }
    for name, options in churon_configs.items():
        # no prefix cache: each repeat computes its whole prompt
        llm = LLM(path, threads=args.threads, enable_prefix_caching=False, **options)
        prompt = llm.tokenizer.encode(TEXT)[: args.prompt_tokens]
        assert len(prompt) == args.prompt_tokens
        churon_run(llm, prompt, 8)  # warm up
        rows[name] = best_of(lambda: churon_run(llm, prompt, args.new_tokens), args.repeats)
        del llm
    torch.set_num_threads(args.threads)  # the native path set torch to one thread for its glue ops
    for dtype in ("float32", "bfloat16"):
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)).eval()
        hf_run(hf, prompt, 8)
        rows[f"transformers {dtype}"] = best_of(lambda: hf_run(hf, prompt, args.new_tokens), args.repeats)
        del hf

    print(f"\nSmolLM2-135M-Instruct Q4_1, {args.threads} threads, batch 1, {args.prompt_tokens}-token prompt, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    print(f"{'engine':<24}{'prefill tok/s':>15}{'decode tok/s':>14}")
    for name, (pp, tg) in rows.items():
        print(f"{name:<24}{pp:>15.1f}{tg:>14.1f}")
    best = lambda prefix, i: max(v[i] for k, v in rows.items() if k.startswith(prefix))  # noqa: E731
    print(f"\nratio churon best / transformers best: prefill {best('churon', 0) / best('transformers', 0):.2f}x, "
          f"decode {best('churon', 1) / best('transformers', 1):.2f}x")


if __name__ == "__main__":
    main()
