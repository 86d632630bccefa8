"""Embeddings: churon vs sentence-transformers (PyTorch) vs llama.cpp's embedding server, side by side in one run.

all-MiniLM-L6-v2, --threads each (default 2), 1,000 synthetic English sentences of 8-128 tokens
([CLS] and [SEP] included) built from a fixed word list and --seed, so every run embeds the same texts
without a dataset download. The peers, each in a fresh process of its own, every round:

  churon HF dir / Q8_0 / F16
                            LLM(model, task="embed", threads=T).embed(sentences) on the native kernels: the
                            sentence-transformers directory (F32 weights, which the native path quantizes to Q8_0
                            at load), and the GGUFs `churon quantize DIR OUT.gguf --type Q8_0` (and F16) writes
  st fp32 / st bf16         SentenceTransformer(DIR, device="cpu"[, model_kwargs={"dtype": torch.bfloat16}])
                            .encode(sentences, batch_size=32): its own length-sorted batching,
                            torch.set_num_threads(T)
  llama.cpp Q8_0 / F16      llama-server --embedding --pooling mean on churon's GGUFs, driven through
                            /v1/embeddings: requests of 64 strings (base64 vectors, as the openai client asks
                            for them) from 2 concurrent clients, 16 sequences (--parallel) batched per forward,
                            flash attention on: the fastest of the settings tried (docs/BENCHMARKS.md); others
                            with --llama-config

Printed per peer: sentences/s (min / median / max over --repeats rounds; model loading and a warm-up excluded),
tokens/s, single-sentence latency (p50 over --latency-calls calls of one 16-token sentence), churon's best
divided by the peer, and the cosine similarity of the peer's vectors with the reference's (sentence-transformers
fp32): mean and min over the 1,000 sentences. Targets (issue 15): churon >= 2x sentence-transformers' best,
>= 1.5x llama.cpp's best, cosine >= 0.999.

    python benchmarks/bench_embeddings.py --llama-server /tmp/llama-build/build/bin/llama-server [--json out.json]
    python benchmarks/bench_embeddings.py --peers "churon Q8_0,st fp32" --repeats 1        # a quick look

--model is a sentence-transformers directory or a registry name (default all-minilm, `churon pull all-minilm`).
Without --llama-server the llama.cpp rows are left out. llama-server is built from llama.cpp's sources, here
the copy inside llama-cpp-python's sdist (the pip-installed llama_cpp bundles the library, not the server):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llsdist
    mkdir -p /tmp/llama-build && tar xzf /tmp/llsdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama-build
    cmake -S /tmp/llama-build/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llama-build/build -G Ninja \\
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \\
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    cmake --build /tmp/llama-build/build --target llama-server -j1     # -> /tmp/llama-build/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import platform
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TARGET_VS_ST = 2.0
TARGET_VS_LLAMA_CPP = 1.5
TARGET_COSINE = 0.999
REFERENCE = "st fp32"
LATENCY_SENTENCE = "The small library near the old station opens early on quiet winter mornings."

# Common English words, a few long or rare ones among them so that WordPiece splits some into several pieces
# as it does real text.
WORDS = """
the a an of to in on at for with from by about over under after before between through during without
and or but so because while although if when where which who that this these those it they we you he she
is are was were be been being has have had do does did will would can could should may might must
people time year day week world life hand part child eye woman man place work case point government company
number group problem fact water room mother area money story month lot right study book word business issue
side kind head house service friend father power hour game line end member law car city community name
president team minute idea body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force education river garden
say get make go know take see come think look want give use find tell ask seem feel try leave call keep
begin show hear play run move live believe bring happen write provide sit stand lose pay meet include
continue set learn lead understand watch follow stop create speak read allow add spend grow open walk win
good new first last long great little own other old right big high different small large next early young
important few public bad same able late hard major better economic strong possible whole free military true
federal international full special easy clear recent certain personal open red difficult available likely
quickly slowly carefully often never always sometimes perhaps nearly almost already still again together
photosynthesis infrastructure electroencephalography unbelievably counterintuitive thermodynamics
microprocessor bureaucratization archaeologist cryptocurrency mitochondria hippopotamus onomatopoeia
kaleidoscope quintessential serendipity juxtaposition anthropomorphic
""".split()
COMMA_PROBABILITY = 0.08


# ---------------------------------------------------------------- sentences

def make_sentences(tokenizer, count: int, seed: int, min_tokens: int, max_tokens: int) -> list[str]:
    """`count` sentences whose token counts ([CLS] and [SEP] included) are drawn uniformly from
    [min_tokens, max_tokens]: words are added until the sentence reaches its drawn length. BERT's pre-tokenizer
    splits on spaces and punctuation, so a sentence's count is the sum of its words' counts plus its commas,
    its full stop and the two special tokens."""
    pieces = {w: len(tokenizer.encode(w, add_special_tokens=False).ids) for w in WORDS}
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        target = rng.randint(min_tokens, max_tokens)
        words: list[str] = []
        length = 3  # [CLS], the full stop, [SEP]
        while length < target:
            word = rng.choice(WORDS)
            comma = bool(words) and rng.random() < COMMA_PROBABILITY
            added = pieces[word] + comma
            if length + added > max_tokens:
                break
            if comma:
                words[-1] += ","
            words.append(word)
            length += added
        words[0] = words[0].capitalize()
        sentences.append(" ".join(words) + ".")
    return sentences


def token_lengths(tokenizer, sentences: list[str]) -> list[int]:
    return [len(e.ids) for e in tokenizer.encode_batch(sentences)]


def length_summary(lengths: list[int]) -> dict:
    q = np.percentile(lengths, [10, 25, 50, 75, 90])
    edges = [8, 32, 64, 96, 129]
    buckets = {f"{lo}-{hi - 1}": sum(lo <= n < hi for n in lengths) for lo, hi in itertools.pairwise(edges)}
    return {"sentences": len(lengths), "tokens": sum(lengths), "mean": round(statistics.mean(lengths), 1),
            "min": min(lengths), "p10": q[0], "p25": q[1], "p50": q[2], "p75": q[3], "p90": q[4],
            "max": max(lengths), "buckets": buckets}


# ---------------------------------------------------------------- the peers, each run in a process of its own

def measure(embed, sentences: list[str], latency_calls: int) -> dict:
    """Warm up, time one pass over every sentence, then the latency of one short sentence."""
    embed(sentences[:64])
    embed([LATENCY_SENTENCE])
    t0 = time.perf_counter()
    vectors = np.asarray(embed(sentences), dtype=np.float32)
    seconds = time.perf_counter() - t0
    latencies = []
    for _ in range(latency_calls):
        t0 = time.perf_counter()
        embed([LATENCY_SENTENCE])
        latencies.append(time.perf_counter() - t0)
    return {"vectors": vectors, "seconds": seconds, "latency_s": latencies}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_churon(spec: dict, sentences: list[str], args) -> dict:
    from churon import LLM

    llm = LLM(spec["model"], task="embed", threads=args.threads)
    result = measure(llm.embed, sentences, args.latency_calls)
    return result | {"peak_rss_mib": peak_rss_mib(), "info": f"LLM({spec['model']}, task='embed', "
                                                           f"threads={args.threads}) {llm.fingerprint}"}


def run_sentence_transformers(spec: dict, sentences: list[str], args) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    kwargs = {"model_kwargs": {"dtype": torch.bfloat16}} if spec["dtype"] == "bfloat16" else {}
    model = SentenceTransformer(spec["model"], device="cpu", **kwargs)

    def embed(texts: list[str]) -> np.ndarray:
        return model.encode(texts, batch_size=32, show_progress_bar=False)

    result = measure(embed, sentences, args.latency_calls)
    return result | {"peak_rss_mib": peak_rss_mib(),
                     "info": f"SentenceTransformer({spec['model']}, device='cpu', {kwargs}).encode(batch_size=32)"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_command(spec: dict, args, port: int) -> list[str]:
    parallel, ubatch = spec["parallel"], spec["ubatch"]
    # a slot's context (-c / --parallel) holds the longest input; a non-causal model computes an input in one
    # micro-batch, so -ub must hold it too, and -b = -ub lets every slot's input join one forward
    return [args.llama_server, "-m", spec["model"], "--embedding", "--pooling", "mean",
            "-t", str(args.threads), "-tb", str(args.threads), "-c", str(512 * parallel), "--parallel", str(parallel),
            "-b", str(ubatch), "-ub", str(ubatch), "-fa", spec["fa"], "--host", "127.0.0.1", "--port", str(port)]


def vm_hwm_mib(pid: int) -> float:
    """A process's peak resident memory, read before it exits."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_healthy(proc: subprocess.Popen, client, log: Path, timeout: float = 120) -> None:
    import httpx2 as httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {proc.returncode}; see {log}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"llama-server was not ready after {timeout:.0f} s; see {log}")
        time.sleep(0.2)


def embeddings_request(client, texts: list[str]) -> np.ndarray:
    r = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32) for d in data])


def run_llama_server(spec: dict, sentences: list[str], args) -> dict:
    import httpx2 as httpx

    port = free_port()
    cmd = llama_server_command(spec, args, port)
    log = Path(args.workdir) / f"llama-server-{port}.log"
    clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=None) for _ in range(spec["clients"])]
    with open(log, "wb") as log_file, ThreadPoolExecutor(len(clients)) as pool:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            wait_healthy(proc, clients[0], log)

            def embed(texts: list[str]) -> np.ndarray:
                # requests of --llama-config chunk strings, taken in turn by the clients
                chunks = [texts[i:i + spec["chunk"]] for i in range(0, len(texts), spec["chunk"])]
                futures = [pool.submit(embeddings_request, clients[i % len(clients)], chunk)
                           for i, chunk in enumerate(chunks)]
                return np.concatenate([f.result() for f in futures])

            result = measure(embed, sentences, args.latency_calls)
            result["peak_rss_mib"] = vm_hwm_mib(proc.pid)
        finally:
            for client in clients:
                client.close()
            proc.terminate()
            proc.wait(timeout=30)
    settings = " ".join(cmd[:-4])  # without --host and --port
    return result | {"info": f"{settings}; {spec['clients']} clients, {spec['chunk']} inputs a request"}


RUNNERS = {"churon": run_churon, "st": run_sentence_transformers, "llama.cpp": run_llama_server}


def peer_main(args) -> int:
    """The child: one peer, one round. Writes its vectors (.npy) and figures (.json) to args.peer_out."""
    spec = json.loads(args.peer_run)
    sentences = json.loads(Path(args.workdir, "sentences.json").read_text())
    result = RUNNERS[spec["kind"]](spec, sentences, args)
    np.save(args.peer_out + ".npy", result.pop("vectors"))
    Path(args.peer_out + ".json").write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------- the parent

def parse_llama_config(text: str) -> dict:
    config = {"parallel": 16, "ubatch": 2048, "fa": "on", "clients": 2, "chunk": 64}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in config:
            raise argparse.ArgumentTypeError(f"--llama-config: unknown setting {key!r} (known: {', '.join(config)})")
        config[key] = value if key == "fa" else int(value)
    return config


def resolve_model_dir(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from churon.registry import resolve_model

    return resolve_model(model)


def quantize(model: Path, gguf_type: str, out: Path) -> None:
    subprocess.run([sys.executable, "-m", "churon.cli", "quantize", str(model), str(out), "--type", gguf_type, "-q"],
                   check=True, stdout=subprocess.DEVNULL)


def peer_specs(model: Path, ggufs: dict[str, Path], args) -> dict[str, dict]:
    specs = {"churon HF dir": {"kind": "churon", "model": str(model)}}
    specs |= {f"churon {t}": {"kind": "churon", "model": str(p)} for t, p in ggufs.items()}
    specs["st fp32"] = {"kind": "st", "model": str(model), "dtype": "float32"}
    specs["st bf16"] = {"kind": "st", "model": str(model), "dtype": "bfloat16"}
    if args.llama_server:
        for config in args.llama_config or [parse_llama_config("")]:
            tag = "" if len(args.llama_config or []) < 2 else " " + " ".join(f"{k}={v}" for k, v in config.items())
            for t, p in ggufs.items():
                specs[f"llama.cpp {t}{tag}"] = {"kind": "llama.cpp", "model": str(p)} | config
    return specs


def run_peer(name: str, spec: dict, round_: int, args) -> dict:
    out = str(Path(args.workdir) / f"{name.replace(' ', '_').replace('=', '-')}.{round_}")
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, __file__, "--peer-run", json.dumps(spec), "--peer-out", out, "--workdir", args.workdir,
           "--threads", str(args.threads), "--latency-calls", str(args.latency_calls)]
    if spec["kind"] == "llama.cpp":
        cmd += ["--llama-server", args.llama_server]
    subprocess.run(cmd, check=True, env=env)
    result = json.loads(Path(out + ".json").read_text())
    result["vectors_path"] = out + ".npy"
    return result


def cosines(vectors: np.ndarray, reference: np.ndarray) -> np.ndarray:
    a = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    b = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def summarize(runs: dict[str, list[dict]], reference_name: str, sentences: int, tokens: int) -> dict[str, dict]:
    """Per peer: its rates over the rounds and their median, latency, memory, and the cosines of its first
    round's vectors with the reference's."""
    reference = np.load(runs[reference_name][0]["vectors_path"])
    rows = {}
    for name, results in runs.items():
        rates = [sentences / r["seconds"] for r in results]
        cos = cosines(np.load(results[0]["vectors_path"]), reference)
        rows[name] = {"sentences_per_s": rates, "median": statistics.median(rates),
                      "tokens_per_s": tokens * statistics.median(rates) / sentences,
                      "latency_p50_ms": statistics.median(1000 * statistics.median(r["latency_s"]) for r in results),
                      "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
                      "peak_rss_mib": max(r["peak_rss_mib"] for r in results), "info": results[0]["info"]}
    return rows


def best(rows: dict[str, dict], prefix: str, accurate: bool = False) -> tuple[str, float] | None:
    """The fastest peer (name, median sentences/s) whose name starts with prefix; accurate: among those whose
    vectors all meet the cosine target."""
    found = [(row["median"], name) for name, row in rows.items() if name.startswith(prefix)
             and (not accurate or row["cosine_min"] >= TARGET_COSINE)]
    return (max(found)[1], max(found)[0]) if found else None


def print_table(rows: dict[str, dict], churon_best: tuple[str, float] | None) -> None:
    columns = ["peer", "sentences/s min / median / max", "tokens/s", "latency p50 ms", "churon best / peer",
               "cosine mean", "cosine min", "peak RSS MiB"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|")
    for name, row in rows.items():
        r = row["sentences_per_s"]
        ratio = f"{churon_best[1] / row['median']:.2f}x" if churon_best else "-"
        cells = [name, f"{min(r):.1f} / {row['median']:.1f} / {max(r):.1f}", f"{row['tokens_per_s']:.0f}",
                 f"{row['latency_p50_ms']:.1f}", ratio, f"{row['cosine_mean']:.6f}", f"{row['cosine_min']:.6f}",
                 f"{row['peak_rss_mib']:.0f}"]
        print("| " + " | ".join(cells) + " |")


def check_targets(rows: dict[str, dict], churon_best: tuple[str, float] | None) -> dict:
    """Print and return the issue's targets against churon's best."""
    verdicts: dict = {}
    if churon_best is None:
        return verdicts
    print(f"\nchuron best: {churon_best[0]} ({churon_best[1]:.1f} sentences/s)")
    for label, prefix, target in (("sentence-transformers", "st ", TARGET_VS_ST),
                                  ("llama.cpp", "llama.cpp", TARGET_VS_LLAMA_CPP)):
        peer = best(rows, prefix)
        if peer:
            ratio = churon_best[1] / peer[1]
            verdicts[label] = {"peer": peer[0], "ratio": ratio, "target": target, "met": ratio >= target}
            print(f"  vs {label} best ({peer[0]}, {peer[1]:.1f}): {ratio:.2f}x, target >= {target}x: "
                  f"{'met' if ratio >= target else 'NOT met'}")
    cos_min = rows[churon_best[0]]["cosine_min"]
    verdicts["cosine"] = {"min": cos_min, "target": TARGET_COSINE, "met": cos_min >= TARGET_COSINE}
    print(f"  cosine min {cos_min:.6f}, target >= {TARGET_COSINE}: {'met' if cos_min >= TARGET_COSINE else 'NOT met'}")
    return verdicts


def versions(args) -> dict:
    from importlib.metadata import version

    found = {name: version(name) for name in ("torch", "sentence-transformers", "transformers", "tokenizers")}
    found["churon"] = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                                     check=False, capture_output=True, text=True).stdout.strip() or version("churon")
    if args.llama_server:
        out = subprocess.run([args.llama_server, "--version"], check=False, capture_output=True, text=True)
        found["llama-server"] = " ".join((out.stdout + out.stderr).split("\n")[0].split())
    return found


def cpu_summary() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                       "amx_tile", "amx_bf16", "amx_int8") if f in flags]
    return f"{name}, {os.cpu_count()} CPUs, {' '.join(isa)}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="all-minilm", help="sentence-transformers directory or registry name")
    p.add_argument("--llama-server", default=None, metavar="PATH", help="llama.cpp's llama-server binary")
    p.add_argument("--llama-config", type=parse_llama_config, action="append", default=None, metavar="K=V,...",
                   help="llama-server settings parallel=16,ubatch=2048,fa=on and client settings clients=2,chunk=64"
                        " (the defaults); repeat for several llama.cpp rows")
    p.add_argument("--gguf-types", default="Q8_0,F16", help="the GGUFs churon quantize writes, churon and llama.cpp"
                                                            " run")
    p.add_argument("--peers", default=None, help="a comma-separated subset of the peers' names (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="rounds; each starts every peer in a fresh process")
    p.add_argument("--latency-calls", type=int, default=50)
    p.add_argument("--workdir", default=None, help="GGUFs, vectors and logs (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None, help="write the settings and results here")
    p.add_argument("--peer-run", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer_run:
        return peer_main(args)

    from tokenizers import Tokenizer

    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_embeddings_")
        args.workdir = tmp.name
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = resolve_model_dir(args.model)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    sentences = make_sentences(tokenizer, args.sentences, args.seed, args.min_tokens, args.max_tokens)
    lengths = token_lengths(tokenizer, sentences)
    assert min(lengths) >= args.min_tokens and max(lengths) <= args.max_tokens, (min(lengths), max(lengths))
    (workdir / "sentences.json").write_text(json.dumps(sentences))
    summary = length_summary(lengths)
    latency_tokens = len(tokenizer.encode(LATENCY_SENTENCE).ids)

    load_before = os.getloadavg()[0]
    cpu, found_versions = cpu_summary(), versions(args)
    print(f"CPU: {cpu}; load average {load_before:.2f}")
    print(f"versions: {found_versions}")
    print(f"{len(sentences)} sentences, {summary['tokens']} tokens: mean {summary['mean']}, min {summary['min']}, "
          f"p10/p25/p50/p75/p90 {summary['p10']:.0f}/{summary['p25']:.0f}/{summary['p50']:.0f}/{summary['p75']:.0f}/"
          f"{summary['p90']:.0f}, max {summary['max']}; by length {summary['buckets']}")
    print(f"latency sentence: {latency_tokens} tokens")

    ggufs = {t: workdir / f"{model.name}.{t}.gguf" for t in args.gguf_types.split(",") if t}
    specs = peer_specs(model, ggufs, args)
    if args.peers:
        wanted = [n.strip() for n in args.peers.split(",")]
        unknown = [n for n in wanted if n not in specs]
        if unknown:
            p.error(f"--peers: unknown {unknown}; the peers are {list(specs)}")
        specs = {n: specs[n] for n in wanted}
    for t, path in ggufs.items():
        if any(spec["model"] == str(path) for spec in specs.values()):
            quantize(model, t, path)

    runs: dict[str, list[dict]] = {name: [] for name in specs}
    t_start = time.perf_counter()
    for round_ in range(args.repeats):
        for name, spec in specs.items():
            result = run_peer(name, spec, round_, args)
            runs[name].append(result)
            print(f"  round {round_ + 1}: {name:<16} {len(sentences) / result['seconds']:8.1f} sentences/s, "
                  f"latency p50 {1000 * statistics.median(result['latency_s']):6.1f} ms", flush=True)

    reference_name = REFERENCE if REFERENCE in runs else next(iter(runs))
    rows = summarize(runs, reference_name, len(sentences), summary["tokens"])
    churon_best = best(rows, "churon", accurate=True) or best(rows, "churon")
    print(f"\nall-MiniLM-L6-v2, {args.threads} threads, {len(sentences)} sentences of {args.min_tokens}-"
          f"{args.max_tokens} tokens (mean {summary['mean']}), {args.repeats} rounds, each peer a fresh process; "
          f"cosine against {reference_name}")
    print_table(rows, churon_best)
    verdicts = check_targets(rows, churon_best)
    print(f"({time.perf_counter() - t_start:.0f} s; load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} "
          f"after)")
    for name, row in rows.items():
        print(f"  {name}: {row['info']}")

    if args.json:
        args.json.write_text(json.dumps({
            "settings": {k: v for k, v in vars(args).items() if not k.startswith("peer_")} | {"model": str(model)},
            "cpu": cpu, "versions": found_versions, "token_lengths": summary,
            "latency_sentence_tokens": latency_tokens, "reference": reference_name, "rows": rows,
            "churon_best": churon_best, "verdicts": verdicts, "load_average_before": load_before,
        }, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
