"""Prompt lookup replayed: its steps on bench_speculative.py's workloads, costed, beside what any proposer of its
kind could do at most; no timing noise in the comparison.

Greedy outputs do not depend on speculation (every output token is the target's own draw), so churon-none's greedy
outputs, replayed through the engine's Speculator as the engine calls it (each step: the sequence's tokens so far,
the most it may take; then what verification kept), give exactly the steps a speculative run takes: how many, how
many rows each, how many proposed tokens accepted. Each step is then costed with this machine's step times,
measured once in the same process: the model run on m = 1 .. K + 1 rows of one sequence at --context tokens
(`ModelRunner.execute`, the median of --reps), plus the engine's own time around it (a decode step's wall time less
its execute, the median over a generation), or given (--step-ms). A proposer's change can be judged this way in
seconds and without noise, where bench_speculative.py's wall times drift by 10% on a shared VM; its verdict stays
bench_speculative.py's. The step times themselves drift with the machine: on a shared VM one row's step (bound by
the cache's bandwidth) slows more than the rows it adds (arithmetic), so the ratios it prints are those of the
hour the times were taken in.

Beside each configuration, oracles that know the output (each step proposes exactly the tokens that will be
accepted, at most K):
  ngram       the longest continuation that follows an earlier occurrence of the last n >= ngram_min tokens: the
              best a prompt-lookup proposer could do, whichever occurrence it took and wherever it stopped
  ngram 1     the same from the last token alone
  any         the longest continuation found anywhere earlier in the sequence
and, per configuration, the tokens it accepted fewer than the ngram oracle would have at the same points: where
every proposed token was accepted (it stopped short) and where one was rejected (it took another occurrence).
End to end: the prompts' prefill (measured, or --prefill-s) plus the modelled decoding, over churon-none's.

    python benchmarks/replay_speculative.py --threads 2
    python benchmarks/replay_speculative.py --configs num_tokens=8 num_tokens=16 num_tokens=8,adaptive=false
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_batching import first_equal
from bench_speculative import build_workload

from churon import LLM, SamplingParams
from churon.config import SpeculativeConfig
from churon.engine.scheduler import ScheduledSeq
from churon.engine.speculative import Speculator


@dataclass
class Replay:
    """One configuration's (or oracle's) decoding of the outputs."""

    steps: int = 0
    one_row: int = 0
    proposed: int = 0
    accepted: int = 0
    short: int = 0  # tokens the ngram oracle would have added where every proposal was accepted
    other: int = 0  # ... where a proposal was rejected
    seconds: float = 0.0


class _Seq:
    """What the Speculator reads of a sequence."""

    def __init__(self, seq_id: int, token_ids: list[int]):
        self.seq_id, self.token_ids = seq_id, token_ids


def longest_continuation(context: list[int], future: list[int], n: int, limit: int) -> int:
    """How many of future's first tokens (at most limit) follow some earlier occurrence of context's last n tokens
    in context (n = 0: any position of context)."""
    suffix = context[len(context) - n :] if n else []
    best = 0
    for e in range(n, len(context)):
        if n and context[e - n : e] != suffix:
            continue
        length = 0
        while (length < limit and e + length < len(context) and length < len(future)
               and context[e + length] == future[length]):
            length += 1
        best = max(best, length)
    return best


class Oracle:
    """Proposes exactly the tokens that will be accepted: the longest continuation of the output (at most
    num_tokens) that follows an earlier occurrence of the last n tokens (n = 0: anywhere)."""

    def __init__(self, n: int, num_tokens: int, prompts: list[list[int]], outputs: list[list[int]]):
        self.n, self.num_tokens, self.prompts, self.outputs = n, num_tokens, prompts, outputs

    def propose(self, seq_id: int, context: list[int], limit: int) -> list[int]:
        future = self.outputs[seq_id][len(context) - len(self.prompts[seq_id]) :]
        return future[: longest_continuation(context, future, self.n, min(self.num_tokens, limit))]

    def verified(self, seq_id: int, proposed: int, accepted: int) -> None:
        pass

    def finish(self, seq_id: int) -> None:
        pass


class Lookup:
    """The engine's Speculator with a configuration, told each verification's outcome as the engine tells it."""

    def __init__(self, config: SpeculativeConfig):
        self.speculator = Speculator(config)

    def propose(self, seq_id: int, context: list[int], limit: int) -> list[int]:
        return self.speculator.propose([(_Seq(seq_id, context), limit)]).get(seq_id, [])

    def verified(self, seq_id: int, proposed: int, accepted: int) -> None:
        self.speculator.record(seq_id, proposed, accepted)

    def finish(self, seq_id: int) -> None:
        self.speculator.drop(seq_id)


def replay(prompts, outputs, max_tokens: int, cost, proposer, oracle_n: int = -1, num_tokens: int = 0) -> Replay:
    """Decode every output again, a sequence at a time as batch 1 does; its first token comes from the prefill.
    proposer None: no speculation. oracle_n >= 0: also count what the ngram oracle (n >= oracle_n, at most
    num_tokens) would have accepted more at each step."""
    r = Replay()
    for seq_id, (prompt, out) in enumerate(zip(prompts, outputs)):
        i = 1
        while i < len(out):
            context = prompt + out[:i]
            draft = proposer.propose(seq_id, context, max_tokens - i - 1) if proposer else []
            a = first_equal(draft, out[i:])  # greedy verification keeps the proposals the output repeats
            if draft:
                proposer.verified(seq_id, len(draft), a)
            if oracle_n >= 0:
                best = longest_continuation(context, out[i:], oracle_n, num_tokens)
                if best > a:
                    if a == len(draft):
                        r.short += best - a
                    else:
                        r.other += best - a
            r.steps += 1
            r.one_row += not draft
            r.proposed += len(draft)
            r.accepted += a
            r.seconds += cost(1 + len(draft))
            i += a + 1
        if proposer:
            proposer.finish(seq_id)
    return r


def measure_step_costs(llm: LLM, prompt: list[int], context: int, max_rows: int, reps: int) -> list[float]:
    """Seconds of ModelRunner.execute on 1 .. max_rows rows of one sequence after `context` tokens (index m - 1)."""
    engine = llm.engine
    tokens = (prompt * (1 + context // max(1, len(prompt))))[:context]
    request_id = engine.add_request(tokens, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    seq = engine.requests[request_id].seq
    while seq.num_uncomputed_tokens != 1:  # the prefill, in chunks where the token budget asks
        engine.step()
    if not engine.scheduler.block_manager.allocate(seq, max_rows):
        raise RuntimeError("no KV blocks for the measurement's proposed rows")
    # proposed tokens: any will do (a row costs the same whatever it holds)
    steps = [ScheduledSeq(seq, 1, [tokens[j % context] for j in range(m - 1)]) for m in range(1, max_rows + 1)]
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(reps):  # every row count once a round: the machine's drift reaches them all alike
        for step, t in zip(steps, times):
            t0 = time.perf_counter()
            engine.runner.execute([step], [False], True)
            t.append(time.perf_counter() - t0)
    engine.abort(request_id)
    return [statistics.median(t) for t in times]


def engine_overhead(llm: LLM, prompt: list[int], tokens: int) -> float:
    """The median of a decode step's wall time less its ModelRunner.execute."""
    engine = llm.engine
    runner_execute = engine.runner.execute
    inside: list[float] = []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = runner_execute(*args, **kwargs)
        inside.append(time.perf_counter() - t0)
        return out

    engine.runner.execute = timed
    try:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        engine.step()  # the prefill
        gaps = []
        while engine.has_unfinished():
            inside.clear()
            t0 = time.perf_counter()
            engine.step()
            gaps.append(time.perf_counter() - t0 - sum(inside))
    finally:
        engine.runner.execute = runner_execute
    return statistics.median(gaps)


def parse_config(text: str) -> tuple[str, SpeculativeConfig]:
    """'num_tokens=16,adaptive=false' -> (text, SpeculativeConfig(method='ngram', num_tokens=16, adaptive=False))."""
    kwargs: dict = {"method": "ngram"}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        flag = {"true": True, "false": False}.get(value.strip().lower())
        kwargs[key.strip()] = int(value) if flag is None else flag
    return text, SpeculativeConfig(**kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workloads", default="grounded", help="of bench_speculative.py's: grounded, chat")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--configs", nargs="+", default=["num_tokens=8"],
                        help="SpeculativeConfig fields for method ngram, comma-separated, one configuration each")
    parser.add_argument("--context", type=int, default=690, help="tokens before the measured steps (the grounded "
                        "workload's mean: a ~550-token prompt and half of 256 output tokens)")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--step-ms", default=None, help="the step times to cost with, for m = 1, 2, ... rows, comma-"
                        "separated, instead of measuring them (another machine's, or this one's in another hour)")
    parser.add_argument("--prefill-s", type=float, default=None, help="one workload's prompt processing, seconds, for "
                        "the end to end ratio instead of what generating its outputs took (bench_speculative.py's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    if args.prefill_s is not None and "," in args.workloads:
        parser.error("--prefill-s is one workload's: give one in --workloads")
    try:
        configs = [parse_config(c) for c in args.configs]
        step_given = [float(ms) / 1e3 for ms in args.step_ms.split(",")] if args.step_ms else None
    except (TypeError, ValueError) as e:  # a field SpeculativeConfig lacks or refuses, a value that is no number
        parser.error(str(e))
    k_max = max(c.num_tokens for _, c in configs)
    if step_given and len(step_given) < k_max + 1:
        parser.error(f"--step-ms needs a time for each of 1 .. {k_max + 1} rows")
    workload = build_workload(args.model)
    llm = LLM(args.model, threads=args.threads, enable_prefix_caching=False)
    first = workload["grounded"]["prompts"][0]
    llm.generate([first[::-1]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    if step_given:
        step, source = step_given, "given"
    else:
        execute = measure_step_costs(llm, first, args.context, k_max + 1, args.reps)
        overhead = engine_overhead(llm, first, 64)
        step = [t + overhead for t in execute]
        source = f"at {args.context} tokens of context: ModelRunner.execute + {1e3 * overhead:.2f} ms of the engine's"
    print(f"step times, {args.threads} threads ({source}): "
          + ", ".join(f"{m} rows {1e3 * t:.2f} ms" for m, t in enumerate(step[: k_max + 1], 1)))

    def cost(m: int) -> float:
        return step[m - 1]

    report: dict = {"step_seconds": step, "workloads": {}}
    for name in args.workloads.split(","):
        prompts = workload[name]["prompts"]
        outs = [llm.generate([p], SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)[0]
                for p in prompts]
        outputs = [o.token_ids for o in outs]
        prefill = args.prefill_s if args.prefill_s is not None else sum(o.metrics.prefill_seconds for o in outs)

        none = replay(prompts, outputs, args.max_tokens, cost, None)
        rows = [("churon-none", none)]
        for text, config in configs:
            rows.append((f"ngram {text}", replay(prompts, outputs, args.max_tokens, cost, Lookup(config),
                                                 config.ngram_min, config.num_tokens)))
        n_min = configs[0][1].ngram_min
        for label, n in ((f"oracle: ngram (n >= {n_min})", n_min), ("oracle: ngram 1", 1), ("oracle: any", 0)):
            rows.append((f"{label}, K {k_max}",
                         replay(prompts, outputs, args.max_tokens, cost, Oracle(n, k_max, prompts, outputs))))
        given = "given" if args.prefill_s is not None else "measured"
        print(f"\n{name}: {len(prompts)} prompts, {sum(map(len, outputs))} output tokens, "
              f"prefill {prefill:.2f} s ({given})\n{'':<40}{'decode s':>9}{'x none':>8}{'end to end':>11}{'steps':>7}"
              f"{'one-row':>8}{'proposed':>9}{'accepted':>9}{'short':>7}{'other':>7}")
        for label, r in rows:
            extra = f"{r.short:>7}{r.other:>7}" if label.startswith("ngram ") else ""
            print(f"{label:<40}{r.seconds:>9.3f}{none.seconds / r.seconds:>7.2f}x"
                  f"{(prefill + none.seconds) / (prefill + r.seconds):>10.2f}x{r.steps:>7}{r.one_row:>8}"
                  f"{r.proposed:>9}{r.accepted:>9}{extra}")
        report["workloads"][name] = {"prefill_seconds": prefill, "rows": {label: vars(r) for label, r in rows}}
    print("\n(decode s: the replayed steps costed; x none: decoding alone; end to end: with the prefill; "
          "short / other: tokens the ngram oracle would have accepted more at the same steps, where every proposal "
          "was accepted / where one was rejected)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
