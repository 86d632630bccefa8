"""The `churon` command: pull, list, run, chat, embed, inspect, serve, bench, quantize, export, eval; create, show,
rm, cp and ps for created models (Ollama's Modelfiles) and a running server's loaded ones."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter
from pathlib import Path

from churon.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from churon.errors import ChuronError
from churon.registry import DEFAULT_MODEL, REGISTRY, cached_models, pull_model, registry_entry

KV_DTYPE_ARGS = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i8": "int8"}


# The sampling flags' defaults. A flag left out is None (stop: []), so that a created model's PARAMETERs come
# between the two: a flag given, else the model's PARAMETER, else this default.
SAMPLING_DEFAULTS = {"max_tokens": 512, "temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                     "repetition_penalty": 1.0, "seed": None, "stop": []}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SAMPLING_DEFAULTS
    p.add_argument("--max-tokens", type=int, default=None, help=f"most tokens to generate (default {d['max_tokens']})")
    p.add_argument("--temperature", type=float, default=None, help=f"0 is greedy (default {d['temperature']})")
    p.add_argument("--top-k", type=int, default=None, help=f"0 disables (default {d['top_k']})")
    p.add_argument("--top-p", type=float, default=None, help=f"(default {d['top_p']})")
    p.add_argument("--min-p", type=float, default=None, help=f"(default {d['min_p']})")
    p.add_argument("--repeat-penalty", dest="repetition_penalty", metavar="REPEAT_PENALTY", type=float, default=None,
                   help=f"1 disables (default {d['repetition_penalty']})")  # llama.cpp's flag, SamplingParams' name
    p.add_argument("--seed", type=int, default=None, help="same seed and prompt give the same text")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not printed")
    p.add_argument("--system", default=None, help="system message for chat-templated models (a created model's SYSTEM"
                   " otherwise)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activations (bfloat16: reference kernels)")
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "reference"],
                   help="native CPU kernels, or the plain PyTorch reference (default: native when built)")


def _speculative_tokens(text: str) -> int:
    """--num-speculative-tokens' value: argparse names the flag when this refuses it."""
    try:
        k = int(text)
    except ValueError:
        k = 0
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
    return k


def _add_speculative_args(p: argparse.ArgumentParser, served: bool = False) -> None:
    which = ("every text model served (a draft model loads with each one that loads)" if served
             else "the model")
    p.add_argument("--speculative", default=None, metavar="ngram|DRAFT_MODEL",
                   help="speculative decoding, the same output in fewer steps, for " + which + ": 'ngram' proposes"
                        " what followed an earlier occurrence of the text's last few tokens (prompt lookup;"
                        " pays where answers repeat their prompt: code edits, extraction, summaries); anything else"
                        " is a draft model (registry name, .gguf file or HF directory; ./ngram for a file so named)"
                        " with the same vocabulary, loaded as the model is (same --kernels, --dtype, --threads)")
    p.add_argument("--num-speculative-tokens", type=_speculative_tokens, default=None, metavar="K",
                   help=f"most tokens proposed per step, 1..{MAX_SPECULATIVE_TOKENS} (default 4; a request proposes"
                        " fewer, or none for a while, where its proposals are rejected)")


def _speculative(args) -> SpeculativeConfig | None:
    """--speculative and --num-speculative-tokens as EngineConfig's speculative (None: off)."""
    if args.speculative is None:
        if args.num_speculative_tokens is not None:
            raise ValueError("--num-speculative-tokens is for speculative decoding: give --speculative ngram or"
                             " --speculative DRAFT_MODEL")
        return None
    k = {"num_tokens": args.num_speculative_tokens} if args.num_speculative_tokens is not None else {}
    if args.speculative == "ngram":
        return SpeculativeConfig("ngram", **k)
    return SpeculativeConfig("draft", model=args.speculative, **k)


def _sampling_params(args, created=None):
    """The flags given (named as SamplingParams' fields), over a created model's PARAMETERs, over SAMPLING_DEFAULTS;
    a created model's ADAPTER on every request (_load loads it)."""
    from churon.model_store import ADAPTER_LORA
    from churon.ollama_options import sampling_kwargs
    from churon.sampling import SamplingParams

    given = {name: getattr(args, name) for name in SAMPLING_DEFAULTS if getattr(args, name) not in (None, [])}
    parameters = sampling_kwargs(created.parameters) if created is not None else {}
    if created is not None and created.adapter is not None:
        parameters["lora"] = ADAPTER_LORA
    return SamplingParams(**(SAMPLING_DEFAULTS | parameters | given))


def _created(model: str | None):
    """The created model a `run` / `chat` names, or None (a registry name, a path)."""
    from churon.model_store import get_model

    return get_model(model or DEFAULT_MODEL)


def _load(args, created=None, lora_adapters=None):
    """The model of `churon run` / `chat`, loaded to generate text; a created model on its base, with its num_ctx,
    its ADAPTER and its TEMPLATE as the chat template; lora_adapters: LLM's (--lora); --speculative's draft model
    loaded beside it."""
    from churon.errors import TaskError
    from churon.llm import LLM
    from churon.model_store import resolve

    model = args.model or DEFAULT_MODEL
    speculative = _speculative(args)  # a bad flag fails before the (slow) model load
    path = resolve(created.name)[0] if created is not None else model
    num_ctx = created.parameters.get("num_ctx") if created is not None else None
    if created is not None:
        lora_adapters = {**created.lora_adapters, **(lora_adapters or {})}
    try:
        llm = LLM(path, task="generate", dtype=args.dtype, kernels=args.kernels, threads=args.threads,
                  lora_adapters=lora_adapters, speculative=speculative,
                  **({"max_model_len": num_ctx} if num_ctx is not None else {}))
    except TaskError as e:
        raise TaskError(f"{e}: `churon {args.command}` needs a text-generation model (`churon embed {model} TEXT`"
                        " embeds text with this one)") from None
    if created is not None and created.template is not None:
        llm.tokenizer.chat_template = created.template
    return llm


def _opening(args, created) -> list[dict[str, str]]:
    """What a conversation starts with: the system turn (--system, else a created model's SYSTEM), then a created
    model's MESSAGEs."""
    system = args.system if args.system is not None else created.system if created is not None else None
    seeded = list(created.messages) if created is not None else []
    return ([{"role": "system", "content": system}] if system else []) + seeded


def _lora_name(path: str) -> str:
    """The name an adapter given by its path alone goes by: its directory's or file's, less ".gguf"."""
    return Path(path).expanduser().resolve().name.removesuffix(".gguf")


def _lora_flags(specs: list[str]) -> dict[str, str]:
    """`churon serve --lora NAME=PATH` (repeatable; PATH alone: _lora_name's) as name -> path."""
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or "/" in name:  # a path alone (which may itself hold a "=")
            name, path = _lora_name(spec), spec
        if not path:
            raise ValueError(f"--lora {spec}: give NAME=PATH or PATH")
        if name in adapters:
            raise ValueError(f"--lora {spec}: two adapters are named {name!r} (give each its own: NAME=PATH)")
        adapters[name] = path
    return adapters


def _is_model(text: str) -> bool:
    from churon.model_store import get_model

    return registry_entry(text) is not None or Path(text).expanduser().exists() or get_model(text) is not None


def cmd_run(args) -> int:
    positional = list(args.args)
    if len(positional) > 2:
        raise ChuronError("usage: churon run [MODEL] [PROMPT] (quote the prompt)")
    if len(positional) == 2:
        args.model, prompt = positional
    elif len(positional) == 1 and not (_is_model(positional[0]) and not sys.stdin.isatty()):
        args.model, prompt = None, positional[0]
    else:
        args.model = positional[0] if positional else None
        prompt = None if sys.stdin.isatty() else sys.stdin.read()
    if not prompt:
        raise ChuronError("no prompt: give one as an argument or on stdin")
    created = _created(args.model)
    params = _sampling_params(args, created)  # validate before the (slow) model load
    adapters = None
    if args.lora is not None:
        if created is not None and created.adapter is not None:
            raise ChuronError(f"--lora {args.lora}: {created.name} has an ADAPTER of its own ({created.adapter}), and a"
                              " request runs with one adapter")
        params.lora = _lora_name(args.lora)
        adapters = {params.lora: args.lora}
    llm = _load(args, created, adapters)
    if args.raw or not llm.tokenizer.chat_template:
        ids = llm.encode(prompt)  # refuses a prompt (stdin: a whole file) the context can never hold, untokenized
    else:
        ids = llm.chat_prompt_ids(_opening(args, created) + [{"role": "user", "content": prompt}])
    delta = None
    for delta in llm.stream_deltas(ids, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose and delta is not None:
        _print_metrics(delta.output)
        if llm.engine.config.speculative is not None:
            _print_speculation(llm.engine.config.speculative, llm.engine.stats())
    return 0


def _print_metrics(out) -> None:
    m = out.metrics
    print(
        f"prompt: {m.prompt_tokens} tokens at {m.prefill_tokens_per_second:.1f} tokens/s | "
        f"decode: {m.generated_tokens} tokens at {m.decode_tokens_per_second:.1f} tokens/s | "
        f"time to first token: {m.prefill_seconds * 1000:.0f} ms | finish: {out.finish_reason}",
        file=sys.stderr,
    )


def _print_speculation(config, stats) -> None:
    print(
        f"speculative ({config.method}): {stats.spec_proposed_tokens} tokens proposed, {stats.spec_accepted_tokens}"
        f" accepted ({stats.spec_acceptance_rate:.1%}) | {stats.spec_verifications} verifications, mean accepted"
        f" length {stats.spec_mean_accepted_length:.2f} tokens",
        file=sys.stderr,
    )


def cmd_chat(args) -> int:
    created = _created(args.model)
    params = _sampling_params(args, created)
    llm = _load(args, created)
    opening = _opening(args, created)
    history: list[dict[str, str]] = []
    print("churon chat: /reset clears the history, /exit (or Ctrl-D) quits, Ctrl-C stops an answer.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        command = line.strip()
        if command in ("/exit", "/quit", "/bye"):
            return 0
        if command == "/reset":
            history.clear()
            print("(history cleared)", file=sys.stderr)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        answer = ""
        try:
            for delta in llm.stream_deltas(llm.chat_prompt_ids(opening + history), params):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                answer += delta.text
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr)
        except ChuronError as e:  # e.g. the conversation outgrew the context: say so, keep the session
            history.pop()
            print(f"\nchuron: {e}", file=sys.stderr)
            continue
        print()
        history.append({"role": "assistant", "content": answer})


def cmd_embed(args) -> int:
    import json

    from churon.llm import LLM

    texts = list(args.texts)
    if not texts:
        if sys.stdin.isatty():
            raise ChuronError("no text: give texts as arguments, or one a line on stdin")
        texts = sys.stdin.read().splitlines()  # one vector per line, blank lines included: line i is vector i
        if not texts:
            raise ChuronError("no text: stdin was empty")
    llm = LLM(args.model, task="embed", pooling=args.pooling, kernels=args.kernels, threads=args.threads)
    vectors = llm.embed(texts, truncate=args.truncate)
    json.dump({"model": args.model, "dimensions": llm.embedding_dim, "embeddings": vectors}, sys.stdout)
    sys.stdout.write("\n")
    return 0


def cmd_pull(args) -> int:
    path = pull_model(args.model)
    print(path)
    return 0


def cmd_list(args) -> int:
    from churon.model_store import list_models

    rows = [_list_row(path.name, path) for path in cached_models()]
    rows += [_list_row(m.name, m.base_path, m.base) for m in list_models()]  # created models, by the base they use
    if not rows:
        print(f"no cached models (known registry models: {', '.join(sorted(REGISTRY))}; `churon pull NAME`)")
        return 0
    _table(["model", "size", "architecture", "type", "from"], rows)
    return 0


def _list_row(name: str, path: Path, base: str = "") -> tuple:
    from churon.loader import open_model

    if not path.exists():
        return (name, "?", "?", f"missing: {path}", base)
    try:
        m = open_model(path, pull=False)
        return (name, _size(path), m.config.architecture, _quant_type(m), base)
    except ChuronError as e:
        return (name, _size(path), "?", f"unreadable: {e}", base)


def cmd_create(args) -> int:
    from churon.model_store import check_name, create_model
    from churon.tokenizer.go_template import is_jinja

    check_name(args.name)  # a bad name is the name's error, not the Modelfile's
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChuronError(f"-f {args.file}: cannot read the Modelfile: {e}") from None
    try:
        model = create_model(args.name, text, base_dir=Path(args.file).resolve().parent)
    except ValueError as e:
        raise ChuronError(f"{args.file}: {e}") from None
    print(f"created {model.name} from {model.base} ({model.base_path})")
    template = model.recipe.template
    fields = [
        ("adapter", model.adapter),
        ("system", _one_line(model.system) if model.system is not None else None),
        ("parameters", ", ".join(f"{k} {' '.join(v) if isinstance(v, list) else v}"
                                 for k, v in model.parameters.items()) or None),
        ("template", None if template is None else "Jinja" if is_jinja(template) else "Go, translated to Jinja"),
        ("messages", len(model.messages) or None),
        ("license", _one_line(model.license) if model.license is not None else None),
    ]
    _print_fields([(k, v) for k, v in fields if v is not None] or [("recipe", "none: the base model as it is")])
    return 0


def _one_line(text: str, width: int = 60) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:width] + ("..." if len(line) > width or "\n" in text.strip() else "")


def cmd_show(args) -> int:
    from churon.loader import open_model
    from churon.model_store import get_model, resolve
    from churon.modelfile import Modelfile
    from churon.ollama_options import format_parameters

    created = get_model(args.model)
    source = open_model(resolve(created.name)[0] if created is not None else args.model, pull=False)
    if args.modelfile:
        text = created.modelfile if created is not None else Modelfile(str(source.path), template=_chat_template(source)).text()
        sys.stdout.write(text)
    if args.parameters and created is not None and created.parameters:
        print(format_parameters(created.parameters))
    if args.template:
        template = created.recipe.template if created is not None else None
        print(template if template is not None else _chat_template(source) or "")
    if args.system and created is not None and created.system is not None:
        print(created.system)
    if args.modelfile or args.parameters or args.template or args.system:
        return 0
    c = source.config
    params = _parameters(source)
    fields = [("model", created.name if created is not None else args.model),
              ("from", f"{created.base} ({source.path})") if created is not None else ("file", str(source.path)),
              *([("adapter", created.adapter)] if created is not None and created.adapter is not None else []),
              ("architecture", c.architecture), ("parameters", f"{params:,} ({params / 1e6:.1f} M)"),
              ("context length", c.context_length), ("embedding length", c.hidden_size),
              ("quantization", _quant_type(source))]
    _print_fields(fields)
    if created is None:
        return 0
    sections = [("parameters", format_parameters(created.parameters)), ("system", created.system or ""),
                ("template", created.recipe.template or ""),
                ("messages", "\n".join(f"{m['role']}: {m['content']}" for m in created.messages)),
                ("license", created.license or "")]
    for title, text in sections:
        if text:
            print(f"\n{title}:")
            print("\n".join("  " + line for line in text.splitlines()))
    return 0


def _chat_template(source) -> str | None:
    from churon.tokenizer import load_tokenizer

    return load_tokenizer(source).chat_template


def cmd_rm(args) -> int:
    from churon.model_store import get_model, remove_model

    for name in args.models:
        if get_model(name) is None and registry_entry(name) is not None:
            raise ChuronError(f"{name} is a registry model, not a created one: churon rm deletes created models"
                              " (a pulled model's files are in the cache, `churon list` shows them)")
        remove_model(name)
        print(f"deleted '{name}'")
    return 0


def cmd_cp(args) -> int:
    from churon.model_store import copy_model

    copy_model(args.source, args.destination)
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def cmd_ps(args) -> int:
    import datetime

    import httpx2 as httpx

    url = f"http://{args.host}:{args.port}/api/ps"
    key = os.environ.get(API_KEY_ENV)
    try:
        response = httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
    except httpx.HTTPError as e:
        raise ChuronError(f"no churon server answers at {url} ({e}); start one with `churon serve`") from None
    if response.status_code != 200:
        raise ChuronError(f"{url}: HTTP {response.status_code}: {response.text.strip()[:200]}")
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = [(m["name"], _bytes(m.get("size", 0)), _until(m.get("expires_at"), now)) for m in response.json()["models"]]
    _table(["NAME", "SIZE", "UNTIL"], rows)
    return 0


def _until(expires_at: str | None, now) -> str:
    """When a loaded model unloads, as `ollama ps` says it (format.HumanTime)."""
    import datetime

    if not expires_at:
        return "Never"
    left = (datetime.datetime.fromisoformat(expires_at) - now).total_seconds()
    if left < 0:
        return "Stopping..."
    if left > 20 * 365 * 86400:  # keep_alive -1: a date far ahead
        return "Forever"
    return _human_duration(left) + " from now"


def _human_duration(seconds: float) -> str:
    """Ollama's humanDuration."""
    s, minutes, hours = int(seconds), int(seconds // 60), round(seconds / 3600)
    if s < 1:
        return "Less than a second"
    if s < 60:
        return "1 second" if s == 1 else f"{s} seconds"
    if minutes < 60:
        return "About a minute" if minutes == 1 else f"{minutes} minutes"
    if hours == 1:
        return "About an hour"
    for limit, unit, size in ((48, "hours", 1), (24 * 14, "days", 24), (24 * 60, "weeks", 24 * 7),
                              (24 * 365 * 2, "months", 24 * 30)):
        if hours < limit:
            return f"{hours // size} {unit}"
    return f"{int(seconds // 3600) // 24 // 365} years"


def _size(path: Path) -> str:
    total = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return _bytes(total)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _bytes_by_type(m) -> Counter:
    by_type = Counter()
    for t in m.tensors:
        by_type[t.dtype] += t.n_bytes
    return by_type


def _quant_type(m) -> str:
    """The file type a GGUF declares (llama.cpp's: Gemma 3's 'Q4_K_M', whose embedding is Q8_0), else the type
    holding most of the weight bytes (a file's 'Q4_1' even if norms are F32)."""
    from gguf import LlamaFileType

    declared = m.config.extra.get("file_type")
    if isinstance(declared, int) and declared in LlamaFileType._value2member_map_:
        return LlamaFileType(declared).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    by_type = _bytes_by_type(m)
    return by_type.most_common(1)[0][0] if by_type else "?"


def _table(header: list[str], rows: list[tuple]) -> None:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def cmd_inspect(args) -> int:
    import torch

    from churon.config import EncoderConfig, EngineConfig
    from churon.engine.kv_cache import KV_DTYPES, kv_bytes_per_token
    from churon.loader import open_model
    from churon.engine.memory import plan_memory
    from churon.formats.lora import is_lora_adapter
    from churon.model.native_backend import coarse_copy_bytes

    given = Path(args.model).expanduser()
    if given.exists() and is_lora_adapter(given):
        return _inspect_adapter(given)
    m = open_model(args.model, pull=True)
    c = m.config
    if isinstance(c, EncoderConfig):
        return _inspect_encoder(m, args)
    tensors = m.tensors
    params = _parameters(m)
    weight_bytes = sum(t.n_bytes for t in tensors)
    rope = f"theta {c.rope_theta:g}" + (f", {_rope_scaling(c.rope_scaling)}" if c.rope_scaling else "")
    fields = [
        ("file", str(m.path)),
        ("format", m.format),
        ("architecture", c.architecture),
        ("layers", c.num_layers),
        ("hidden size", c.hidden_size),
        ("intermediate size", c.intermediate_size),
        ("attention heads", c.num_heads),
        ("KV heads", c.num_kv_heads),
        ("head dim", c.head_dim),
        ("vocabulary", c.vocab_size),
        ("context length", c.context_length),
        ("RoPE", rope),
        ("QKV bias", c.attention_bias),
        ("QK norm", c.qk_norm),
        *_family_fields(c),
        ("tied embeddings", c.tie_word_embeddings),
        *([("pooling", _pooling(m.pooling))] if m.pooling is not None else []),  # a decoder made to embed
        ("parameters", f"{params:,} ({params / 1e6:.1f} M)"),
    ]
    _print_fields(fields)
    _print_bytes_by_type(m)

    kv_dtype = KV_DTYPES[KV_DTYPE_ARGS[args.kv_dtype]]
    per_token = kv_bytes_per_token(c, kv_dtype)
    per_head = f"{c.head_dim} head dim x {kv_dtype.itemsize} bytes" + (" + a 4-byte scale" if kv_dtype == torch.int8 else "")
    print(f"\nmemory (KV cache in {args.kv_dtype}):")
    print(f"weights                {_bytes(weight_bytes)} in the file")
    coarse = coarse_copy_bytes(m)
    if coarse:
        print(f"greedy logits copy     {_bytes(coarse)} more at run time (a 6-bit copy of the Q8_0 output matrix, AVX-512)")
    print(f"KV cache per token     {per_token:,} bytes (2 x {c.num_layers} layers x {c.num_kv_heads} KV heads x ({per_head}))")
    plan = plan_memory(c, weight_bytes, EngineConfig(), c.context_length, kv_dtype)
    layout = plan.layout
    windowed = sum(len(g.layers) for g in layout.groups if g.window)
    if windowed:
        per_layer = kv_bytes_per_token(c, kv_dtype, 1)
        print(f"  by layer kind        global layers ({c.num_layers - windowed}): {per_layer * (c.num_layers - windowed):,}"
              f" bytes a token of context; windowed layers ({windowed}): {per_layer * windowed:,} bytes a token of"
              f" their window only (blocks behind it are freed; {layout.num_groups} KV groups of {layout.group_size}"
              " layers)")

    def context_bytes(ctx: int) -> int:  # what one sequence of ctx tokens holds at most
        return plan.sequence_slots(ctx) // plan.block_size * plan.block_bytes

    contexts = [2048, 8192, 32768]
    rows = [(f"{ctx // 1024}k" + ("" if ctx <= c.context_length else " (> model context)"),)
            + tuple(_bytes(context_bytes(ctx) * s) for s in (1, 8, 32)) for ctx in contexts]
    _table(["context", "1 sequence", "8 sequences", "32 sequences"], rows)
    print(f"\nmemory plan on this machine (default engine settings): {plan.describe(c.context_length)}")
    _print_native_layouts(m)
    _print_tensors(m, args)
    return 0


def _rope_scaling(scaling: dict) -> str:
    """ModelConfig.rope_scaling in words where it has a few numbers (YaRN), else the dict."""
    if scaling.get("rope_type") == "yarn":
        return (f"YaRN factor {scaling['factor']:g} over {scaling['original_max_position_embeddings']} original positions"
                f" (beta_fast {scaling['beta_fast']:g}, beta_slow {scaling['beta_slow']:g},"
                f"{'' if scaling['truncate'] else ' not'} truncated, cos and sin x {scaling['attention_factor']:.4g})")
    return f"scaling {scaling}"


def _family_fields(c) -> list[tuple[str, object]]:
    """What a family changes in the Llama layer, each line only where the model has it."""
    mlp = "GeGLU (tanh GELU)" if c.hidden_act == "gelu_tanh" else "SwiGLU"
    if c.expert_form == "clamped_swiglu":
        mlp = (f"clamped SwiGLU with biases: (clamp(up, -{c.swiglu_limit:g}, {c.swiglu_limit:g}) + 1) * g *"
               f" sigmoid({c.swiglu_alpha:g} g), g = min(gate, {c.swiglu_limit:g})")
    fields: list[tuple[str, object]] = [("MLP", mlp)]
    if c.attention_out_bias:
        fields.append(("output bias", True))
    if c.attention_sinks:
        fields.append(("attention sinks", "a learned logit per head in each softmax's denominator"))
    windowed = [w for w in c.layer_windows if w]
    if windowed:
        local = f", RoPE theta {c.rope_local_theta:g} there" if c.rope_local_theta is not None else ""
        sizes = "/".join(str(w) for w in sorted(set(windowed)))
        fields.append(("sliding window", f"{len(windowed)} of {c.num_layers} layers see the last {sizes} positions{local}"))
    if c.sandwich_norms:
        fields.append(("norms", "before and after attention and the MLP"))
    if c.scale_embeddings:
        fields.append(("embedding scale", f"sqrt({c.hidden_size}) = {c.hidden_size**0.5:.4g}"))
    if c.query_pre_attn_scalar is not None:
        fields.append(("query scale", f"1/sqrt({c.query_pre_attn_scalar:g})"))
    caps = [f"{what} {cap:g}" for what, cap in (("attention", c.attn_logit_softcap), ("logits", c.final_logit_softcap)) if cap]
    if caps:
        fields.append(("soft-caps", ", ".join(caps)))
    if c.num_experts:
        from churon.model.transformer import expected_weight_shapes

        moe_layers = sum(c.moe_layer(i) for i in range(c.num_layers))
        shared = f", a shared expert of FFN {c.shared_expert_intermediate_size}" if c.shared_expert_intermediate_size else ""
        dense = f", {c.num_layers - moe_layers} dense layers" if moe_layers < c.num_layers else ""
        fields.append(("experts", f"{c.num_experts} of FFN {c.moe_intermediate_size}, {c.num_experts_per_tok} active per"
                                  f" token{' (top-k renormalized)' if c.norm_topk_prob else ''}{shared}{dense}"))
        if c.router_topk_first or c.router_bias:
            fields.append(("router", ("softmax over the top-k logits" if c.router_topk_first else "top-k of a softmax")
                           + (", with a bias" if c.router_bias else "")))
        total = sum(math.prod(shape) for shape in expected_weight_shapes(c).values())
        # a token's matmuls skip the experts it is not routed to: gate, up and down of each (and their biases)
        per_expert = 3 * c.hidden_size * c.moe_intermediate_size
        if c.expert_form == "clamped_swiglu":
            per_expert += 2 * c.moe_intermediate_size + c.hidden_size
        idle = moe_layers * (c.num_experts - c.num_experts_per_tok) * per_expert
        fields.append(("active parameters", f"{total - idle:,} ({(total - idle) / 1e6:.1f} M) of {total:,} per token"))
    return fields


def _inspect_encoder(m, args) -> int:
    """An encoder (BERT): its architecture, its pooling, its tensors. It keeps no KV cache: an input is one
    forward, its memory the weights and that forward's activations."""
    c = m.config
    fields = [
        ("file", str(m.path)),
        ("format", m.format),
        ("architecture", f"{c.architecture} (encoder: embeddings)"),
        ("layers", c.num_layers),
        ("hidden size", c.hidden_size),
        ("intermediate size", c.intermediate_size),
        ("attention heads", c.num_heads),
        ("head dim", c.head_dim),
        ("vocabulary", c.vocab_size),
        ("context length", c.context_length),
        ("token types", c.type_vocab_size),
        ("layer norm eps", f"{c.layer_norm_eps:g}"),
        ("activation", c.hidden_act),
        ("pooling", _pooling(m.pooling) if m.pooling is not None else "not declared by the files"),
        ("parameters", f"{_parameters(m):,} ({_parameters(m) / 1e6:.1f} M)"),
    ]
    _print_fields(fields)
    _print_bytes_by_type(m)
    print(f"\nmemory: weights {_bytes(sum(t.n_bytes for t in m.tensors))} in the file; no KV cache (an encoder keeps"
          " none: each input is one forward)")
    _print_native_layouts(m)
    _print_tensors(m, args)
    return 0


def _inspect_adapter(path: Path) -> int:
    """A LoRA adapter: its kind, ranks and scaling, what it adapts, its size, the model it was trained on."""
    from churon.formats.lora import read_lora

    a = read_lora(path)
    ranks = sorted({m.rank for m in a.modules.values()})
    layers = sorted({int(name.split(".")[1]) for name in a.modules})  # "layers.N.self_attn.q_proj"
    fields = [
        ("file", str(a.path)),
        ("kind", f"{a.kind} LoRA adapter"),
        ("rank", str(a.rank) if len(ranks) == 1 else f"{a.rank} (the largest; by module {', '.join(map(str, ranks))})"),
        ("alpha", f"{a.alpha:g}" + (" (llama.cpp: no scaling; any scale is in B)" if a.kind == "gguf" and a.alpha == 0 else "")),
        ("rsLoRA", "yes (alpha / sqrt(r))" if a.use_rslora else "no (alpha / r)"),
        ("targets", ", ".join(a.targets)),
        ("modules", len(a.modules)),
        ("layers", f"{len(layers)} ({_ranges(layers)})"),
        ("size", f"{a.nbytes / 1e6:.2f} MB (A and B in float32; {_size(path)} on disk)"),
        ("base model", a.base_model or "not named by the file"),
        *([("architecture", a.architecture)] if a.architecture else []),
    ]
    _print_fields(fields)
    return 0


def _ranges(numbers: list[int]) -> str:
    """Sorted integers as runs: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _pooling(p) -> str:
    """A PoolingConfig as inspect prints it: "mean, normalized, max length 256"."""
    return ", ".join([p.mode, "normalized" if p.normalize else "not normalized"]
                     + ([f"max length {p.max_length}"] if p.max_length is not None else []))


def _parameters(m) -> int:
    return sum(math.prod(t.shape) for t in m.tensors if not t.name.startswith("rope_freqs"))


def _print_fields(fields: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in fields)
    for k, v in fields:
        print(f"{k:<{width}}  {v}")


def _print_bytes_by_type(m) -> None:
    print("\nbytes by tensor type:")
    by_type = _bytes_by_type(m)
    count = Counter(t.dtype for t in m.tensors)
    _table(["type", "tensors", "bytes"], [(k, count[k], _bytes(v)) for k, v in by_type.most_common()])


def _print_tensors(m, args) -> None:
    if args.tensors:
        print()
        _table(["tensor", "shape", "type", "bytes"], [(t.name, "x".join(map(str, t.shape)), t.dtype, t.n_bytes) for t in m.tensors])


def _print_native_layouts(m) -> None:
    """How the native kernels hold each weight type (repacked at load time), from one tensor of each."""
    from churon import kernels
    from churon.model.native_backend import NativeBackend
    from churon.model.weights import experts

    if not kernels.native_available():
        print(f"\nnative kernels: not available ({kernels.reason}); the PyTorch reference path runs")
        return
    backend = NativeBackend()
    weights = {}
    for name, w in m.load_weights().items():
        if len(w.shape) == 3:  # stacked experts: as the kernels hold each of them (gpt-oss's MXFP4 as Q8_0)
            w = experts(w)[0]
        if len(w.shape) == 2:
            qtype = getattr(w, "qtype", None)  # GGML type F32 is 0: test against None, not for truth
            weights.setdefault(qtype if qtype is not None else str(w.dtype), w)
    print(f"\nnative kernels ({kernels.cpu.isa()}), weight layout at run time:")
    for kind, w in weights.items():
        print(f"  {getattr(kind, 'name', kind):<8} {backend.matrix(w).layout}")


API_KEY_ENV = "CHURON_API_KEY"


def _api_key(args) -> str | None:
    """--api-key-file's key, else --api-key's (which any user can read in `ps`), else $CHURON_API_KEY's."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: {e.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: the file is empty")
        return key
    if args.api_key is not None:
        return args.api_key
    return os.environ.get(API_KEY_ENV) or None


def _given(args, *names: str) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def cmd_serve(args) -> int:
    from churon.model_store import get_model
    from churon.registry import models_dir
    from churon.server import create_app
    from churon.server.catalog import ModelCatalog
    from churon.server.connections import ConnectionLimits
    from churon.server.keep_alive import parse_keep_alive
    from churon.server.limits import RequestLimits
    from churon.server.serve import make_server
    from churon.server.state import ModelPolicy, default_models_memory

    model = args.model
    memory = args.models_memory if args.models_memory is not None else default_models_memory()
    policy = ModelPolicy(memory, args.max_loaded_models,
                         parse_keep_alive(args.keep_alive, "--keep-alive"))
    engine_options = _given(args, "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_tokens", "max_model_len",
                            "kv_cache_memory", "max_loras", "max_lora_rank")
    speculative = _speculative(args)
    if speculative is not None:
        engine_options["speculative"] = speculative
    lora_adapters = _lora_flags(args.lora)
    # bad engine settings fail now, not after the port is bound
    catalog = ModelCatalog(policy.memory_share, args.dtype, args.kernels, args.threads, engine_options)
    # as for the engine: the flags left out keep the dataclasses' defaults, bad values fail before the port is bound
    limits = RequestLimits(**_given(args, "max_choices", "max_prompt_tokens", "max_logit_bias", "max_stop", "max_logprobs",
                                    "max_embedding_inputs"))
    connection_limits = ConnectionLimits(**_given(args, "header_timeout", "body_timeout", "max_connections"))
    api_key = _api_key(args)
    if args.pooling is not None and args.embedding_model is None and args.task == "generate":
        raise ValueError("--pooling is for the model that embeds: give --embedding-model, or --task embed")
    if model is None and (args.embedding_model or args.served_model_name or args.task != "auto" or lora_adapters):
        raise ValueError("--embedding-model, --served-model-name, --task and --lora are for a MODEL to preload: give it")
    failures: list[BaseException] = []
    created = get_model(model) if model is not None else None
    name = args.served_model_name or (created.name if created is not None else model)  # "mario" as "mario:latest"

    def load():  # on the load thread, as often as the model is loaded (back): a registry model is pulled once
        # --pooling belongs to the embedding model when there is one, else to MODEL (a decoder made to embed)
        pooling = args.pooling if args.embedding_model is None else None
        return catalog.load(catalog.plan(name, model, args.task), pooling)

    def load_embedding_model():
        return catalog.load(catalog.plan(args.embedding_model, args.embedding_model, "embed"), args.pooling)

    def on_load_error(e: BaseException) -> None:
        failures.append(e)
        server.should_exit = True

    embedding = (load_embedding_model, args.embedding_model) if args.embedding_model is not None else None
    app = create_app(load if model is not None else None, name, embedding_model=embedding, catalog=catalog,
                     policy=policy, api_key=api_key, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                     limits=limits, lora_adapters=lora_adapters, allow_lora_loading=args.allow_lora_loading,
                     on_load_error=on_load_error)
    server = make_server(app, args.host, args.port, log_level=args.log_level, connection_limits=connection_limits,
                         **_given(args, "shutdown_timeout"))
    served = " and ".join(m for m in (model, args.embedding_model) if m is not None)
    if lora_adapters:
        served += f" (LoRA adapters: {', '.join(lora_adapters)})"
    on_demand = ", ".join(catalog.names()) or "none yet"
    print(f"churon: serving {served or 'no model preloaded'} on http://{args.host}:{args.port}/v1"
          f"{' (loading; GET /health says when ready)' if served else ''}; on demand, the models in"
          f" {models_dir()} ({on_demand}), in {policy.memory} bytes, at most {policy.max_loaded} at once", file=sys.stderr)
    server.run()
    if failures:
        raise ChuronError(f"loading {served} failed: {failures[0]}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def cmd_bench_serve(args) -> int:
    import json

    from churon import bench

    num_requests = args.num_requests if len(args.num_requests) > 1 else args.num_requests * len(args.concurrency)
    if args.plot:
        bench.pyplot()  # no matplotlib: say so before the run, not after it
    try:
        extra_body = json.loads(args.extra_body) if args.extra_body else None
    except json.JSONDecodeError as e:
        raise ChuronError(f"--extra-body is not valid JSON: {e}") from None
    results = bench.bench_serve(args.url, args.concurrency, num_requests, args.prompt_len, args.output_len,
                                model=args.model, extra_body=extra_body, api_key=args.api_key, seed=args.seed)
    print(f"{args.url}: {args.prompt_len}-word prompts, {args.output_len} output tokens")
    print(bench.format_table(results))
    for r in results:
        if r.failed:
            print(f"concurrency {r.concurrency}: {r.failed} requests failed, first: {r.first_error}", file=sys.stderr)
        if r.short_outputs:
            print(f"concurrency {r.concurrency}: {r.short_outputs} requests got fewer than {args.output_len} tokens"
                  " (the server ended them early: see --extra-body)", file=sys.stderr)
    if args.json:
        settings = {"url": args.url, "prompt_len": args.prompt_len, "output_len": args.output_len, "extra_body": extra_body}
        Path(args.json).write_text(json.dumps(bench.to_json(results, **settings), indent=2) + "\n")
    if args.plot:
        bench.plot(results, args.plot)
    return 0 if all(r.failed == 0 for r in results) else 1


def cmd_quantize(args) -> int:
    from churon.quantize import quantize_model

    _print_quantize_report(quantize_model(args.src, args.out, args.type, **_quantize_options(args)))
    return 0


def _quantize_options(args) -> dict:
    """quantize_model's keywords from the flags `churon quantize` and `churon export` share."""
    calib_text = None
    if args.calib is not None:
        try:
            calib_text = Path(args.calib).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChuronError(f"--calib {args.calib}: cannot read the calibration text: {e}") from None
    return dict(method=args.method, calib_text=calib_text, keep=args.keep, target_bpw=args.target_bpw,
                progress=not args.quiet, pure=args.pure)


def cmd_export(args) -> int:
    from churon.quantize import export_adapter, quantize_model

    if args.adapter:  # the adapter alone: its own tensors, nothing merged or quantized
        given = [flag for flag, value in (("--scale", args.scale is not None), ("--method", args.method != "rtn"),
                                          ("--calib", args.calib is not None), ("--keep", args.keep),
                                          ("--target-bpw", args.target_bpw is not None), ("--pure", args.pure))
                 if value]
        if given:
            raise ValueError(f"{', '.join(given)}: for a merged export; --adapter writes the adapter's own A and B"
                             " (llama.cpp takes its scale at run time: --lora-scaled)")
        path = export_adapter(args.model, args.lora, args.out, args.type or "F32")
        print(f"{path}: {_bytes(path.stat().st_size)}, LoRA adapter for {args.model}")
        return 0
    if args.type is None:
        raise ValueError("--type is required for a merged export (F32, F16, BF16, Q8_0, Q4_K, ...)")
    scale = 1.0 if args.scale is None else args.scale
    _print_quantize_report(quantize_model(args.model, args.out, args.type, lora=args.lora, lora_scale=scale,
                                          **_quantize_options(args)))
    return 0


def _print_quantize_report(report) -> None:
    rows = [(name, count, f"{params:,}", _bytes(size), f"{size * 8 / params:.2f}")
            for name, (count, params, size) in sorted(report.by_type().items(), key=lambda kv: -kv[1][2])]
    _table(["type", "tensors", "parameters", "bytes", "bits/weight"], rows)
    print(f"\n{report.path}: {_bytes(report.file_bytes)}, {report.bits_per_weight:.3f} bits per weight "
          f"({report.method}, {report.seconds:.1f} s)")


EVAL_KV_BYTES = 16 << 20  # the engine's KV cache goes unused by eval (each window runs on its own cache)


def _eval_model(model: str, args):
    from churon.llm import LLM

    return LLM(model, dtype=args.dtype, kernels=args.kernels, threads=args.threads, kv_cache_memory=EVAL_KV_BYTES)


def _eval_text(args) -> str:
    """The text to score, read (and --ctx checked) before any model loads."""
    if args.ctx < 2:
        raise ChuronError(f"--ctx {args.ctx}: a window needs at least 2 tokens")
    try:
        return Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChuronError(f"--text {args.text}: cannot read the text: {e}") from None


def _eval_windows(tokenizer, text: str, args) -> list[list[int]]:
    """The text's tokens in windows of --ctx, as llama-perplexity cuts them."""
    from churon.evaluation import text_windows

    tokens = tokenizer.encode(text, add_bos=False)
    windows = text_windows(tokens, args.ctx, args.max_windows, bos_id=tokenizer.bos_id if tokenizer.add_bos else None)
    if not windows:
        raise ChuronError(f"--text {args.text}: {len(tokens)} tokens, fewer than one window of --ctx {args.ctx}")
    return windows


def _progress(windows: list, quiet: bool):
    from tqdm import tqdm

    return tqdm(windows, desc="eval", unit="window", disable=quiet, file=sys.stderr)


def _write_json(path: str | None, record: dict) -> None:
    import json

    if path:
        Path(path).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def cmd_eval_perplexity(args) -> int:
    from churon.evaluation import perplexity, scored_positions

    text = _eval_text(args)
    llm = _eval_model(args.model, args)
    windows = _eval_windows(llm.tokenizer, text, args)
    ppl = perplexity(llm.model, _progress(windows, args.quiet))
    pos = scored_positions(args.ctx)
    n_tokens = len(windows) * (pos.stop - pos.start)
    _table(["model", "perplexity", "scored tokens"], [(args.model, f"{ppl:.4f}", n_tokens)])
    _write_json(args.json, {"model": args.model, "text": args.text, "ctx": args.ctx, "windows": len(windows),
                            "n_tokens": n_tokens, "perplexity": ppl})
    return 0


def cmd_eval_compare(args) -> int:
    from churon.evaluation import compare

    text = _eval_text(args)
    ref = _eval_model(args.reference, args)
    test = _eval_model(args.model, args)
    if ref.config.vocab_size != test.config.vocab_size:
        raise ChuronError(f"{args.model} has a vocabulary of {test.config.vocab_size} tokens and {args.reference} of "
                          f"{ref.config.vocab_size}: their distributions cannot be compared")
    windows = _eval_windows(ref.tokenizer, text, args)
    c = compare(ref.model, test.model, _progress(windows, args.quiet))
    _table(["model", "perplexity", "mean KL", "p99 KL", "top-1"], [
        (f"{args.reference} (reference)", f"{c.ppl_ref:.4f}", "", "", ""),
        (args.model, f"{c.ppl_test:.4f}", f"{c.mean_kl:.6f}", f"{c.p99_kl:.6f}", f"{100 * c.top1_agreement:.2f}%"),
    ])
    print(f"\n{len(windows)} windows of {args.ctx} tokens, {c.n_tokens} scored (KL(reference || model) per token)")
    _write_json(args.json, {"model": args.model, "reference": args.reference, "text": args.text, "ctx": args.ctx,
                            "windows": len(windows), **c.as_dict()})
    return 0


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens; the second half of each is scored (default 512)")
    p.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activations (bfloat16: reference kernels)")
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "reference"],
                   help="native CPU kernels, or the plain PyTorch reference (default: native when built)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def _add_quantize_args(p: argparse.ArgumentParser, type_required: bool) -> None:
    p.add_argument("--type", required=type_required, metavar="TYPE",
                   help="F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K (1-D tensors stay F32; llama.cpp's"
                        " choices for the output and some attn_v/ffn_down tensors unless --pure)")
    p.add_argument("--method", default="rtn", help="rtn (default), imatrix, awq or gptq (the last three calibrate)")
    p.add_argument("--calib", default=None, metavar="FILE", help="calibration text (default: churon's own)")
    p.add_argument("--keep", action="append", default=[], metavar="PATTERN=TYPE",
                   help="type for tensors whose GGUF name matches the glob, e.g. 'output.weight=Q8_0' (repeatable)")
    p.add_argument("--target-bpw", type=float, default=None, metavar="X",
                   help="raise the tensors most sensitive on the calibration text until X bits per weight")
    p.add_argument("--pure", action="store_true", help="every 2-D tensor in TYPE (llama-quantize --pure)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="churon", description="Run open-weight language models locally.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate an answer to one prompt, streamed to stdout")
    p.add_argument("args", nargs="*", metavar="[MODEL] PROMPT", help=f"model (default {DEFAULT_MODEL}) and prompt (or stdin)")
    p.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    p.add_argument("--verbose", "-v", action="store_true", help="print prompt and decode tokens/s, time to first token"
                   " (with --speculative: tokens proposed and accepted)")
    p.add_argument("--lora", default=None, metavar="PATH", help="answer with this LoRA adapter on the model (a PEFT"
                   " directory or a GGUF adapter)")
    _add_sampling_args(p)
    _add_speculative_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    p.add_argument("model", nargs="?", default=None)
    _add_sampling_args(p)
    _add_speculative_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("embed", help="embed texts (arguments, or one a line on stdin) with an embedding model; JSON out")
    p.add_argument("model", help="registry name (e.g. all-minilm), .gguf file or HF / sentence-transformers directory")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (default: one a line on stdin)")
    p.add_argument("--truncate", action="store_true",
                   help="cut a text longer than the model's max length to its beginning (default: an error)")
    p.add_argument("--pooling", default=None, choices=["mean", "cls", "last"],
                   help="how tokens become one vector (default: what the model's files say; a decoder: last)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "reference"],
                   help="native CPU kernels, or the plain PyTorch reference (default: native when built)")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("pull", help="download a registry model into the cache")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="cached models and created ones")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("create", help="create a model from a Modelfile (FROM, SYSTEM, PARAMETER, TEMPLATE, MESSAGE, ...)")
    p.add_argument("name", help="the new model's name (name or name:tag)")
    p.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default: ./Modelfile)")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("show", help="a model's architecture and, for a created model, its recipe")
    p.add_argument("model")
    p.add_argument("--modelfile", action="store_true", help="the Modelfile that creates it")
    p.add_argument("--parameters", action="store_true", help="a created model's PARAMETERs")
    p.add_argument("--template", action="store_true", help="its template (a created model's TEMPLATE as written)")
    p.add_argument("--system", action="store_true", help="a created model's SYSTEM")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("rm", help="delete created models (their base models stay)")
    p.add_argument("models", nargs="+", metavar="model")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("cp", help="copy a model to a created model of another name")
    p.add_argument("source")
    p.add_argument("destination")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("ps", help="the models a running churon serve has loaded, and until when")
    p.add_argument("--host", default="127.0.0.1", help="the server's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="(default 8000)")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("inspect", help="what a model file holds, and the memory it needs; a LoRA adapter's rank, alpha,"
                                       " targets and size")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--kv-dtype", default="f32", choices=list(KV_DTYPE_ARGS), help="KV cache element type (default f32)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/embeddings, ...)")
    p.add_argument("model", nargs="?", default=None,
                   help="registry name, .gguf file or HF directory to preload (default: none; every cached model is"
                        " loaded when a request names it)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: MODEL as given)")
    p.add_argument("--task", default="auto", choices=["auto", "generate", "embed"],
                   help="what MODEL serves: text (chat, completions, ...) or /v1/embeddings (default auto: embed for an"
                        " encoder or a model whose files declare a pooling, else generate)")
    p.add_argument("--embedding-model", default=None, metavar="EMBEDDING_MODEL",
                   help="a second model, served beside MODEL for /v1/embeddings under this name (e.g. all-minilm)")
    p.add_argument("--pooling", default=None, choices=["mean", "cls", "last"],
                   help="how the embedding model pools its tokens (default: what its files say; a decoder: last)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every API request (visible"
                   f" to every user in `ps`: prefer --api-key-file or ${API_KEY_ENV})")
    p.add_argument("--api-key-file", default=None, help=f"read the API key from this file (default: ${API_KEY_ENV}, if set)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="most requests waiting for the batch; beyond it 503 (default: the KV cache's blocks)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (default 4 MiB); beyond it 413")
    p.add_argument("--max-choices", type=int, default=None, help="n x prompts of one request (default 128); beyond it 400")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="prompt tokens over all of one request's choices (default 1048576); beyond it 400")
    p.add_argument("--max-logit-bias", type=int, default=None, help="logit_bias entries of a request (default 1024)")
    p.add_argument("--max-stop", type=int, default=None, help="stop strings of a request (default 64)")
    p.add_argument("--max-logprobs", type=int, default=None, help="most logprobs / top_logprobs a request may ask (default 20)")
    p.add_argument("--max-embedding-inputs", type=int, default=None,
                   help="inputs of one /v1/embeddings request (default 2048, as OpenAI); beyond it 400")
    p.add_argument("--header-timeout", type=float, default=None,
                   help="seconds for a connection to send a request's headers (default 10); then it is closed")
    p.add_argument("--body-timeout", type=float, default=None,
                   help="seconds for a request's whole body to arrive after its headers (default 60); then 408")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections; beyond it 503 and closed (default: the open-file limit, raised, less 128)")
    p.add_argument("--shutdown-timeout", type=float, default=None,
                   help="on SIGTERM, seconds the running requests have to finish (default 30); then they are ended")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens in one step (prompt chunks + decodes; an embedding forward's inputs)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="prompt tokens in one step while other requests wait or decode (default 256): first tokens"
                        " come in arrival order, a few requests a step; a prompt alone runs at the whole budget")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on a sequence's length (default: the model's context)")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes for each text model's KV cache (default: what its weights leave of its share of"
                        " --models-memory, at least one full context)")
    p.add_argument("--models-memory", type=int, default=None, metavar="BYTES",
                   help="bytes for every loaded model together; beyond it the least recently used idle one is"
                        " unloaded (default: the memory available at start, less a tenth, at least 512 MiB)")
    p.add_argument("--max-loaded-models", type=int, default=3, help="models loaded at once (default 3, as Ollama)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a LoRA adapter (PEFT directory or GGUF adapter) on MODEL as the model NAME (PATH alone:"
                        " named as its directory or file); repeatable")
    p.add_argument("--max-loras", type=int, default=None, help="LoRA adapters loaded at once (default 8)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest rank an adapter may have (default 64)")
    p.add_argument("--allow-lora-loading", action="store_true",
                   help="let clients load and unload adapters (POST /v1/load_lora_adapter, /v1/unload_lora_adapter):"
                        " the server then reads any file a client names")
    p.add_argument("--keep-alive", default="5m",
                   help="how long a model loaded on demand stays after its last request: 5m, 30s, 1h, seconds, 0"
                        " (unload at once), negative (for good); a request's keep_alive overrides it (default 5m)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activations (bfloat16: reference kernels)")
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "reference"],
                   help="native CPU kernels, or the plain PyTorch reference (default: native when built)")
    _add_speculative_args(p, served=True)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("quantize", help="write a model (HF directory or GGUF) as a GGUF of another type")
    p.add_argument("src", help="registry name, .gguf file or HF directory (bf16/fp16/fp32 safetensors)")
    p.add_argument("out", help="output .gguf file")
    _add_quantize_args(p, type_required=True)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("export", help="merge a LoRA adapter into a model and write it as a GGUF of any type, or"
                                      " write the adapter alone as a llama.cpp GGUF adapter")
    p.add_argument("model", help="the base model: registry name, .gguf file or HF directory")
    p.add_argument("out", help="output .gguf file: the merged model, or with --adapter the adapter alone")
    p.add_argument("--lora", required=True, metavar="PATH", help="the adapter: PEFT directory or GGUF adapter")
    p.add_argument("--scale", type=float, default=None, metavar="S",
                   help="merge W + S * (alpha / r) * B @ A (default 1; 0.5: half the adapter's effect)")
    p.add_argument("--adapter", action="store_true",
                   help="write the adapter alone to OUT as a llama.cpp GGUF adapter (--type F32 or F16, default F32)")
    _add_quantize_args(p, type_required=False)
    p.set_defaults(func=cmd_export)

    evaluate = sub.add_parser("eval", help="model quality on a text: perplexity, KL divergence from a reference")
    evaluate = evaluate.add_subparsers(dest="eval", required=True)
    p = evaluate.add_parser("perplexity", help="llama-perplexity's perplexity over windows of a text")
    p.add_argument("model", help="registry name, .gguf file or HF directory")
    p.set_defaults(func=cmd_eval_perplexity)
    _add_eval_args(p)
    p = evaluate.add_parser("compare", help="KL(REFERENCE || MODEL), top-1 agreement and both perplexities")
    p.add_argument("model", help="the model under test (e.g. a quantized GGUF)")
    p.add_argument("reference", help="the reference model (e.g. the float original)")
    p.set_defaults(func=cmd_eval_compare)
    _add_eval_args(p)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("serve", help="load-test an OpenAI-compatible server: throughput and latency per concurrency")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 16], help="comma-separated levels (default 1,4,16)")
    p.add_argument("--num-requests", type=_int_list, default=[32], help="requests per level: one number or one per level")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in random words, about a token each")
    p.add_argument("--output-len", type=int, default=128, help="tokens to generate per request")
    p.add_argument("--extra-body", default=None, help='JSON merged into every request, e.g. \'{"min_tokens": 128}\'')
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot throughput against TTFT p95 (needs matplotlib)")
    p.set_defaults(func=cmd_bench_serve)
    return parser


# the subcommands whose free words (nargs="*") may come after options too, and the attribute that holds them
FREE_WORDS = {"run": "args", "embed": "texts"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's namespace. argparse gives a nargs="*" positional only the words before the first option
    that follows them, so `churon run MODEL --verbose "PROMPT"` (the README's order) would leave PROMPT
    unrecognized: a run's or an embed's later free words join the earlier ones, in order. An unknown option is still
    an error."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        free = FREE_WORDS.get(args.command)
        unknown = [word for word in extra if word.startswith("-")] if free is not None else extra
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        setattr(args, free, list(getattr(args, free)) + extra)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return args.func(args)
    except (ChuronError, ValueError) as e:
        print(f"churon: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `churon embed ... | head`: the reader left; Python would complain again at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command the pipe ended


if __name__ == "__main__":
    sys.exit(main())
