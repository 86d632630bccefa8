"""Hostile model files: a few hundred broken GGUF files and Hugging Face directories, each run through
`LLM()` and `churon inspect` under a time and memory limit, every outcome sorted into a class.

    python benchmarks/hostile_files.py [--out DIR] [--timeout 10] [--memory-gib 2] [--only gguf|hf]

The files are made from tests/tiny_models' tiny Llama (its HF directory and its Q8_0 GGUF), seeded, so
two runs make the same files:

  gguf/truncate-*   the GGUF cut at every structural boundary of its header (and a few places in the data)
  gguf/flip-*       one to four random bytes replaced, mostly in the header and metadata
  gguf/count-*      a count or length of the header set to a lie: tensor and key counts, string lengths,
                    array counts, dimension counts, dimensions, tensor types and offsets (0, 1, 2^31 - 1,
                    2^32 + 1, 2^60, 2^64 - 1, ...)
  gguf/offset-*     tensor offsets that overlap, are misaligned or wrap around
  gguf/meta-*       metadata templates: layer, head, size and context counts of 0, 2^31 - 1, 10^9; values of
                    the wrong type (arrays, strings, floats where integers belong); NaN, zero and negative
                    RoPE theta and RMS epsilon; kv heads that do not divide the heads; broken vocabularies
                    (a 400,000-character token, token types that are strings, merges that are numbers)
  hf/config-*       config.json templates: a list, deep nesting, every size field 0 / negative / huge /
                    a string / a list / null, the same RoPE and epsilon values, llama3 scaling without
                    its original length
  hf/st-*           model.safetensors truncated, byte-flipped, with a lying header length or header JSON
  hf/index-*        model.safetensors.index.json naming shards outside the directory, or not a map
  hf/tok-*          tokenizer files that are not what they should be

Each (file, target) runs in a child forked from a worker that imported churon once: RLIMIT_AS caps
the child's address space at the worker's own plus --memory-gib, and a child still running after
--timeout seconds is killed. Outcome classes:

  accepted         loaded (LLM) or printed (inspect) without an error; the untouched base files must
                   land here, and so may files whose damage only changed weight values
  ModelFileError   churon's ModelFileError, with the file's path in its message
  churon error     any other ChuronError (UnsupportedModelError for an unknown type or architecture, ...)
  traceback        any other exception (ZeroDivisionError, TypeError, a ValueError that is not churon's...)
  hang/memory      killed at the timeout, MemoryError, or the child died (out of memory, a signal)

Results go to DIR/results.jsonl (one line per file and target) and a summary to stdout; the lines that
are not clean are printed with their exception type and message.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CLASSES = ("accepted", "ModelFileError", "churon error", "traceback", "hang/memory")


# --------------------------------------------------------------------------------------------------
# The GGUF's structure: where each count, length, type and offset sits (an independent walk of the
# format, so that the lies land exactly on the fields, whatever churon's own parser does)
# --------------------------------------------------------------------------------------------------

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


def gguf_sites(data: bytes) -> list[tuple[int, str, str]]:
    """(offset, struct format, label) of every count and length in a valid GGUF's header."""
    sites = [(8, "<Q", "n_tensors"), (16, "<Q", "n_kv")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(label):
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        sites.append((pos, "<Q", f"strlen {label}"))
        s = data[pos + 8 : pos + 8 + n].decode("utf-8", "replace")
        pos += 8 + n
        return s

    def value(vtype, label, record=True):
        nonlocal pos
        if vtype == STRING:
            if record:
                string(label)
            else:
                (n,) = struct.unpack_from("<Q", data, pos)
                pos += 8 + n
        elif vtype == ARRAY:
            sub, count = struct.unpack_from("<IQ", data, pos)
            sites.append((pos, "<I", f"array type {label}"))
            sites.append((pos + 4, "<Q", f"array count {label}"))
            pos += 12
            if sub in _SCALAR:
                pos += count * struct.calcsize(_SCALAR[sub])
            else:
                for k in range(count):
                    value(sub, f"{label}[{k}]", record=k < 2)
        else:
            pos += struct.calcsize(_SCALAR[vtype])

    for _ in range(n_kv):
        key = string("key")
        (vtype,) = struct.unpack_from("<I", data, pos)
        sites.append((pos, "<I", f"value type {key}"))
        pos += 4
        value(vtype, key)
    for _ in range(n_tensors):
        name = string("tensor name")
        (n_dims,) = struct.unpack_from("<I", data, pos)
        sites.append((pos, "<I", f"n_dims {name}"))
        pos += 4
        for d in range(n_dims):
            sites.append((pos, "<Q", f"dim{d} {name}"))
            pos += 8
        sites.append((pos, "<I", f"type {name}"))
        sites.append((pos + 4, "<Q", f"offset {name}"))
        pos += 12
    sites.append((pos, "", "end of tensor infos"))
    return sites


# --------------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------------

def make_bases(out: Path) -> tuple[Path, Path, Path]:
    from tiny_models import make_hf_model, write_gguf

    hf = out / "base" / "tiny-llama"
    if not (hf / "config.json").exists():
        make_hf_model("llama", hf)
    q8 = out / "base" / "tiny-q8_0.gguf"
    f32 = out / "base" / "tiny-f32.gguf"
    if not q8.exists():
        write_gguf(hf, q8, "Q8_0")
    if not f32.exists():
        write_gguf(hf, f32, "F32")
    return hf, q8, f32


def gguf_raw_mutants(base: Path, out: Path, rng: random.Random) -> list[Path]:
    data = base.read_bytes()
    sites = gguf_sites(data)
    header_end = sites[-1][0]
    files = []

    def emit(name, blob):
        path = out / f"{name}.gguf"
        path.write_bytes(blob)
        files.append(path)

    # truncations: at every kind of boundary, and a few places in the data
    cuts = sorted({0, 3, 4, 7, 12, 23, 24} | {off for off, _, _ in rng.sample(sites, 30)}
                  | {off + 3 for off, _, _ in rng.sample(sites, 10)}
                  | {header_end + k * (len(data) - header_end) // 6 for k in range(1, 6)} | {len(data) - 1})
    for c in cuts:
        emit(f"truncate-{c}", data[:c])
    # byte flips: 80 % in the header
    for k in range(100):
        blob = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(header_end) if rng.random() < 0.8 else rng.randrange(header_end, len(data))
            blob[pos] = rng.randrange(256)
        emit(f"flip-{k}", bytes(blob))
    # lying counts
    big = {"<Q": [0, 1, 2**31 - 1, 2**32 + 1, 2**60, 2**64 - 1], "<I": [0, 7, 255, 2**31 - 1, 2**32 - 1]}
    chosen = [s for s in sites if s[2] in ("n_tensors", "n_kv") or s[2].startswith("array count")]
    chosen += rng.sample([s for s in sites if s[2].startswith("strlen")], 12)
    chosen += rng.sample([s for s in sites if s[2].startswith(("value type", "array type"))], 6)
    chosen += rng.sample([s for s in sites if s[2].split()[0] in ("n_dims", "dim0", "dim1", "type", "offset")], 14)
    for off, fmt, label in chosen:
        values = big[fmt] if label in ("n_tensors", "n_kv") or "count" in label else rng.sample(big[fmt], 3)
        for v in values:
            blob = bytearray(data)
            struct.pack_into(fmt, blob, off, v)
            emit(f"count-{label.replace(' ', '_').replace('/', '_')}-{v}", bytes(blob))
    # an array whose count runs past the end of the file, as the file's last field
    kv_end = next(off for off, _, label in sites if label == "strlen tensor name")
    eof_array = struct.pack("<Q", 1) + b"x" + struct.pack("<IIQ", ARRAY, 5, 2**60)
    emit("count-eof-array-alone", b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + eof_array)
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    emit("count-eof-array-after-metadata", b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv + 1) + data[24:kv_end] + eof_array)
    # tensor offsets that overlap, are misaligned, or wrap
    offsets = [(off, label.split()[1]) for off, fmt, label in sites if label.startswith("offset ")]
    first = struct.unpack_from("<Q", data, offsets[1][0])[0]
    for name, edit in [
        ("overlap", lambda b: struct.pack_into("<Q", b, offsets[2][0], first)),
        ("misaligned", lambda b: struct.pack_into("<Q", b, offsets[2][0], struct.unpack_from("<Q", b, offsets[2][0])[0] + 1)),
        ("wrap", lambda b: struct.pack_into("<Q", b, offsets[2][0], 2**64 - 64)),
        ("beyond", lambda b: struct.pack_into("<Q", b, offsets[2][0], len(data))),
        ("all-zero", lambda b: [struct.pack_into("<Q", b, o, 0) for o, _ in offsets]),
    ]:
        blob = bytearray(data)
        edit(blob)
        emit(f"offset-{name}", bytes(blob))
    return files


def gguf_meta_mutants(base: Path, out: Path) -> list[Path]:
    import gguf
    import numpy as np

    T = gguf.GGUFValueType
    reader = gguf.GGUFReader(base)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    files = []

    def emit(name, set_=None, drop=(), tensors=None):
        """set_: key -> (value, type, sub_type); tensors: a function over the (name, array, type) list."""
        path = out / f"meta-{name}.gguf"
        set_ = set_ or {}
        w = gguf.GGUFWriter(path, fields["general.architecture"].contents())
        for key, f in fields.items():
            if key == "general.architecture" or key in drop or key in set_:
                continue
            sub = f.types[-1] if f.types[0] == T.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub)
        if "general.architecture" in drop:
            w.kv_data[0].pop("general.architecture")  # GGUFWriter writes it on creation
        for key, (value, vtype, sub) in set_.items():
            w.add_key_value(key, value, vtype, sub)
        ts = [(t.name, np.array(t.data), t.tensor_type) for t in reader.tensors]
        for tname, array, qtype in (tensors(ts) if tensors else ts):
            w.add_tensor(tname, array, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        files.append(path)

    ints = {
        "block_count": [0, 2**31 - 1, 10**9],
        "attention.head_count": [0, 3, 2**31 - 1],
        "attention.head_count_kv": [0, 3, 8],
        "embedding_length": [0, 2**40],
        "feed_forward_length": [0, 2**40],
        "context_length": [0, 2**31, 2**63],
        "attention.key_length": [0, 7],
        "vocab_size": [0, 2**40],
        "rope.dimension_count": [0, 2**31],
    }
    for key, values in ints.items():
        for v in values:
            emit(f"{key}-{v}", {f"llama.{key}": (v, T.UINT64, None)})
        emit(f"{key}-array", {f"llama.{key}": ([4, 4], T.ARRAY, T.UINT32)})
        emit(f"{key}-string", {f"llama.{key}": ("64", T.STRING, None)})
        emit(f"{key}-missing", drop={f"llama.{key}"})
    emit("block_count-float", {"llama.block_count": (2.5, T.FLOAT32, None)})
    emit("head_count-negative", {"llama.attention.head_count": (-4, T.INT32, None)})
    emit("head_count-bool", {"llama.attention.head_count": (True, T.BOOL, None)})
    for key in ("rope.freq_base", "attention.layer_norm_rms_epsilon"):
        for v in (math.nan, 0.0, -1.0, math.inf):
            emit(f"{key}-{v}", {f"llama.{key}": (v, T.FLOAT32, None)})
        emit(f"{key}-string", {f"llama.{key}": ("1e-6", T.STRING, None)})
        emit(f"{key}-array", {f"llama.{key}": ([1.0], T.ARRAY, T.FLOAT32)})
    emit("rope-linear-no-factor", {"llama.rope.scaling.type": ("linear", T.STRING, None)})
    for v in (math.nan, 0.0, -2.0):
        emit(f"rope-linear-factor-{v}", {"llama.rope.scaling.type": ("linear", T.STRING, None),
                                         "llama.rope.scaling.factor": (v, T.FLOAT32, None)})
    emit("rope-scaling-type-int", {"llama.rope.scaling.type": (1, T.UINT32, None)})
    emit("architecture-int", {"general.architecture": (1, T.UINT32, None)})
    emit("architecture-missing", drop={"general.architecture"})
    for v in (0, 3, 2**40):
        emit(f"alignment-{v}", {"general.alignment": (v, T.UINT32 if v < 2**32 else T.UINT64, None)})
    emit("alignment-string", {"general.alignment": ("32", T.STRING, None)})
    # vocabularies
    long = list(tokens)
    long[300] = "a" * 400_000
    emit("token-400k-chars", {"tokenizer.ggml.tokens": (long, T.ARRAY, T.STRING)})
    emit("token-400k-chars-spm", {"tokenizer.ggml.tokens": (long, T.ARRAY, T.STRING),
                                  "tokenizer.ggml.model": ("llama", T.STRING, None)})
    emit("tokens-ints", {"tokenizer.ggml.tokens": (list(range(len(tokens))), T.ARRAY, T.INT32)})
    emit("tokens-string", {"tokenizer.ggml.tokens": ("abc", T.STRING, None)})
    emit("tokens-duplicate", {"tokenizer.ggml.tokens": (tokens[:5] + [tokens[4]] + tokens[6:], T.ARRAY, T.STRING)})
    emit("token_type-strings", {"tokenizer.ggml.token_type": (["1"] * len(tokens), T.ARRAY, T.STRING)})
    emit("token_type-short", {"tokenizer.ggml.token_type": ([1] * 10, T.ARRAY, T.INT32)})
    emit("token_type-scalar", {"tokenizer.ggml.token_type": (1, T.INT32, None)})
    emit("merges-ints", {"tokenizer.ggml.merges": ([1, 2, 3], T.ARRAY, T.INT32)})
    emit("merges-no-space", {"tokenizer.ggml.merges": (["ab"], T.ARRAY, T.STRING)})
    emit("merges-string", {"tokenizer.ggml.merges": ("a b", T.STRING, None)})
    emit("scores-strings-spm", {"tokenizer.ggml.model": ("llama", T.STRING, None),
                                "tokenizer.ggml.scores": (["x"] * len(tokens), T.ARRAY, T.STRING)})
    emit("bos-huge", {"tokenizer.ggml.bos_token_id": (2**31, T.UINT32, None)})
    emit("add_bos-int", {"tokenizer.ggml.add_bos_token": (1, T.UINT32, None)})
    emit("chat_template-int", {"tokenizer.chat_template": (1, T.UINT32, None)})
    emit("tokenizer-model-int", {"tokenizer.ggml.model": (1, T.UINT32, None)})
    emit("pre-int", {"tokenizer.ggml.pre": (1, T.UINT32, None)})
    # tensors
    emit("no-token_embd", tensors=lambda ts: [t for t in ts if t[0] != "token_embd.weight"])
    emit("duplicate-tensor-name", tensors=lambda ts: ts + [("blk.0.attn_norm.weight2", ts[1][1], ts[1][2])])
    emit("embd-3d", tensors=lambda ts: [(n, a.reshape(2, -1, a.shape[-1]) if n == "token_embd.weight" and a.shape[0] % 2 == 0
                                         else a, q) for n, a, q in ts])
    return files


def hf_mutants(base: Path, out: Path, rng: random.Random) -> list[Path]:
    cfg = json.loads((base / "config.json").read_text())
    st = (base / "model.safetensors").read_bytes()
    files = []

    def emit(name, config=None, raw_config=None, safetensors=None, extra=None):
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(base, d)
        if raw_config is not None:
            (d / "config.json").write_text(raw_config)
        elif config is not None:
            (d / "config.json").write_text(json.dumps(config))
        if safetensors is not None:
            (d / "model.safetensors").write_bytes(safetensors)
        for rel, text in (extra or {}).items():
            target = d / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text if isinstance(text, bytes) else text.encode())
        files.append(d)

    def with_(**changes):
        c = dict(cfg)
        for k, v in changes.items():
            if v is ...:
                c.pop(k, None)
            else:
                c[k] = v
        return c

    emit("config-list", raw_config="[1, 2, 3]")
    emit("config-string", raw_config='"llama"')
    emit("config-null", raw_config="null")
    emit("config-deep", raw_config="[" * 100_000 + "]" * 100_000)
    emit("config-deep-object", raw_config='{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    emit("config-nan-literal", raw_config=json.dumps(with_(rope_parameters={"rope_type": "default", "rope_theta": math.nan})))
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                "intermediate_size", "max_position_embeddings", "vocab_size", "head_dim"):
        for v in (0, -1, 10**9, 2**31, "64", [64], None, 64.5, True):
            emit(f"config-{key}-{json.dumps(v).replace(' ', '')}", with_(**{key: v}))
        emit(f"config-{key}-missing", with_(**{key: ...}))
    emit("config-kv-heads-3", with_(num_key_value_heads=3))
    emit("config-kv-heads-8", with_(num_key_value_heads=8))
    for v in (math.nan, 0.0, -1.0, "1e4", [1.0], None):
        emit(f"config-rope_theta-{v}", with_(rope_parameters={"rope_type": "default", "rope_theta": v}))
        emit(f"config-rms_norm_eps-{v}", with_(rms_norm_eps=v))
    emit("config-llama3-no-original", with_(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                             "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}))
    emit("config-llama3-equal-freq-factors", with_(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    emit("config-linear-no-factor", with_(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0}))
    emit("config-linear-factor-0", with_(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 0}))
    emit("config-yarn", with_(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}))
    emit("config-rope_parameters-list", with_(rope_parameters=[1, 2]))
    emit("config-rope_scaling-string", with_(rope_scaling="linear"))
    emit("config-model_type-int", with_(model_type=1))
    emit("config-model_type-list", with_(model_type=["llama"]))
    emit("config-tie-string", with_(tie_word_embeddings="no"))
    emit("config-attention_bias-string", with_(attention_bias="yes"))
    # safetensors
    (header_len,) = struct.unpack_from("<Q", st, 0)
    header = json.loads(st[8 : 8 + header_len])
    for k in (1, 4, 7, 8, 20, 8 + header_len // 2, 8 + header_len, len(st) // 2, len(st) - 1):
        emit(f"st-truncate-{k}", safetensors=st[:k])
    for v in (0, 2, header_len + 1, len(st), 2**31, 2**63, 2**64 - 1):
        emit(f"st-header-len-{v}", safetensors=struct.pack("<Q", v) + st[8:])
    for k in range(25):
        blob = bytearray(st)
        for _ in range(rng.randint(1, 3)):
            blob[rng.randrange(8, 8 + header_len)] = rng.randrange(32, 127)
        emit(f"st-flip-{k}", safetensors=bytes(blob))

    def with_header(h):
        text = json.dumps(h).encode()
        return struct.pack("<Q", len(text)) + text + st[8 + header_len :]

    names = [n for n in header if n != "__metadata__"]
    first, second = names[0], names[1]
    edits = {
        "overlap": lambda h: h[second].__setitem__("data_offsets", h[first]["data_offsets"]),
        "beyond": lambda h: h[first].__setitem__("data_offsets", [0, 2**40]),
        "reversed": lambda h: h[first].__setitem__("data_offsets", h[first]["data_offsets"][::-1]),
        "shape-huge": lambda h: h[first].__setitem__("shape", [2**40, 2**40]),
        "shape-negative": lambda h: h[first].__setitem__("shape", [-1, 64]),
        "dtype-unknown": lambda h: h[first].__setitem__("dtype", "F128"),
        "dtype-int": lambda h: [h[n].__setitem__("dtype", "I32") for n in names],
        "not-a-map": lambda h: h.__setitem__(first, [1, 2]),
    }
    for name, edit in edits.items():
        h = json.loads(json.dumps(header))
        edit(h)
        emit(f"st-header-{name}", safetensors=with_header(h))
    emit("st-header-list", safetensors=struct.pack("<Q", 2) + b"[]" + st[8 + header_len :])
    # sharded index
    weight_map = {n: "model.safetensors" for n in names}
    outside = {n: "../x/model.safetensors" for n in names}
    emit("index-outside", extra={"model.safetensors.index.json": json.dumps({"weight_map": outside}),
                                 "../x/model.safetensors": st})
    emit("index-absolute", extra={"model.safetensors.index.json": json.dumps(
        {"weight_map": {n: str(out / "base-abs.safetensors") for n in names}})})
    (out / "base-abs.safetensors").write_bytes(st)
    emit("index-list", extra={"model.safetensors.index.json": json.dumps({"weight_map": list(weight_map)})})
    emit("index-values-int", extra={"model.safetensors.index.json": json.dumps({"weight_map": dict.fromkeys(names, 1)})})
    emit("index-top-list", extra={"model.safetensors.index.json": "[]"})
    emit("index-missing-shard", extra={"model.safetensors.index.json": json.dumps({"weight_map": dict.fromkeys(names, "nope.safetensors")})})
    # tokenizer files
    tj = (base / "tokenizer.json").read_bytes()
    emit("tok-truncated", extra={"tokenizer.json": tj[: len(tj) // 2]})
    emit("tok-list", extra={"tokenizer.json": "[]"})
    emit("tok-config-list", extra={"tokenizer_config.json": "[]"})
    emit("tok-config-bos-int", extra={"tokenizer_config.json": json.dumps({"bos_token": 5})})
    emit("tok-gen-eos-string", extra={"generation_config.json": json.dumps({"eos_token_id": "x"})})
    emit("tok-gen-eos-huge", extra={"generation_config.json": json.dumps({"eos_token_id": [2**40]})})
    emit("tok-template-list-garbage", extra={"tokenizer_config.json": json.dumps({"chat_template": [1, 2]})})
    return files


# --------------------------------------------------------------------------------------------------
# The worker: churon imported once, a forked child per (file, target) under the limits
# --------------------------------------------------------------------------------------------------

def _child(path: str, target: str) -> dict:
    from churon import LLM, ChuronError, ModelFileError

    try:
        if target == "llm":
            LLM(path, threads=1)
        else:
            from churon import cli

            args = cli.build_parser().parse_args(["inspect", path])
            args.func(args)
    except MemoryError as e:
        return {"outcome": "hang/memory", "type": "MemoryError", "message": str(e)[:300]}
    except BaseException as e:  # noqa: BLE001 - sorting every outcome is the point
        if isinstance(e, ModelFileError) and path in str(e):
            outcome = "ModelFileError"
        elif isinstance(e, ChuronError):
            outcome = "churon error"
        else:
            outcome = "traceback"
        return {"outcome": outcome, "type": type(e).__name__, "message": str(e)[:300]}
    return {"outcome": "accepted", "type": "", "message": ""}


def worker(jobs: Path, timeout: float, memory_gib: float) -> None:
    import resource
    import select
    import signal

    import churon.cli  # noqa: F401 - everything the children need, imported before forking
    import churon.llm  # noqa: F401

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + int(memory_gib * 2**30)
    for line in jobs.read_text().splitlines():
        path, target = json.loads(line)
        r, w = os.pipe()
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            result = _child(path, target)
            os.write(w, json.dumps(result).encode())
            os._exit(0)
        os.close(w)
        ready, _, _ = select.select([r], [], [], timeout)
        if ready:
            chunks = []
            while chunk := os.read(r, 65536):
                chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
            chunks = []
        os.close(r)
        _, status = os.waitpid(pid, 0)
        if chunks:
            result = json.loads(b"".join(chunks))
        elif not ready:
            result = {"outcome": "hang/memory", "type": "timeout", "message": f"killed after {timeout:g} s"}
        else:
            result = {"outcome": "hang/memory", "type": "died", "message": f"wait status {status}"}
        result.update(path=path, target=target, seconds=round(time.perf_counter() - start, 3))
        print(json.dumps(result), flush=True)


def run_campaign(files: list[Path], out: Path, timeout: float, memory_gib: float) -> list[dict]:
    jobs = [(str(f), target) for f in files for target in ("llm", "inspect")]
    (out / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in jobs))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", str(out / "jobs.jsonl"), "--timeout", str(timeout),
         "--memory-gib", str(memory_gib)],
        stdout=subprocess.PIPE, text=True,
    )
    results = []
    for line in proc.stdout:
        results.append(json.loads(line))
        if len(results) % 50 == 0:
            print(f"  {len(results)}/{len(jobs)}", file=sys.stderr)
    proc.wait()
    return results


def summarize(results: list[dict], out: Path) -> None:
    print(f"{'target':<8} " + " ".join(f"{c:>15}" for c in CLASSES) + f" {'total':>6}")
    for target in ("llm", "inspect"):
        counts = Counter(r["outcome"] for r in results if r["target"] == target)
        print(f"{target:<8} " + " ".join(f"{counts[c]:>15}" for c in CLASSES) + f" {sum(counts.values()):>6}")
    by_type = Counter((r["outcome"], r["type"]) for r in results if r["outcome"] not in ("accepted", "ModelFileError"))
    if by_type:
        print("\nnot clean, by exception type:")
        for (outcome, kind), n in by_type.most_common():
            print(f"  {n:>4}  {outcome:<12} {kind}")
        print()
        for r in results:
            if r["outcome"] not in ("accepted", "ModelFileError"):
                print(f"  {r['target']:<7} {Path(r['path']).relative_to(out)}: {r['outcome']}: {r['type']}: {r['message'][:150]}")
    slow = sorted((r for r in results if r["seconds"] > 1), key=lambda r: -r["seconds"])
    if slow:
        print("\nslower than 1 s:")
        for r in slow[:20]:
            print(f"  {r['seconds']:>6.2f} s  {r['target']:<7} {Path(r['path']).relative_to(out)}  ({r['outcome']})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/churon-hostile"))
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per file and target")
    p.add_argument("--memory-gib", type=float, default=2.0, help="address space a child may add")
    p.add_argument("--only", choices=("gguf", "hf"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", type=Path, metavar="JOBS", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.timeout, args.memory_gib)
        return
    out = args.out.resolve()
    hf, q8, f32 = make_bases(out)
    rng = random.Random(args.seed)
    files = [q8, f32, hf]
    for kind in ("gguf", "hf"):
        shutil.rmtree(out / kind, ignore_errors=True)
        (out / kind).mkdir(parents=True)
    if args.only in (None, "gguf"):
        files += gguf_raw_mutants(q8, out / "gguf", rng)
        files += gguf_meta_mutants(q8, out / "gguf")
    if args.only in (None, "hf"):
        files += hf_mutants(hf, out / "hf", rng)
    print(f"{len(files)} files under {out}; {2 * len(files)} runs", file=sys.stderr)
    results = run_campaign(files, out, args.timeout, args.memory_gib)
    with open(out / "results.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    bases = [r for r in results if Path(r["path"]) in (q8, f32, hf)]
    for r in bases:
        if r["outcome"] != "accepted":
            print(f"warning: base file {r['path']} ({r['target']}) was not accepted: {r['type']}: {r['message']}")
    summarize(results, out)


if __name__ == "__main__":
    main()
