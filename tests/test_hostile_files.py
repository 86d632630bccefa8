"""Model files built to exhaust memory or time fail fast: a clear ModelFileError in well under a second,
with the address space capped (RLIMIT_AS) so that a reader that sizes anything by a lying count dies
instead of passing.

benchmarks/hostile_files.py is the wider campaign (a few hundred broken files through LLM() and
`churon inspect`); its slow test here asserts that none of them gives a traceback, hangs or runs out
of memory.
"""

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest
from test_bad_input import _hf_copy, rewrite_gguf

T = gguf.GGUFValueType
ROOT = Path(__file__).resolve().parent.parent

# Each case runs in one child that imported churon first, then capped its address space at what it
# had plus this much: a 2^60-element array read the way the gguf package read it grows past it in seconds.
HEADROOM = 1 << 30

_CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    from churon import LLM, ModelFileError
    from churon import cli

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom}, vm + {headroom}))
    results = []
    for target, path in json.loads(sys.argv[1]):
        start = time.perf_counter()
        try:
            if target == "llm":
                LLM(path, threads=1)
            else:
                args = cli.build_parser().parse_args(["inspect", path])
                args.func(args)
            outcome = ("accepted", "")
        except ModelFileError as e:
            outcome = ("ModelFileError", str(e))
        except BaseException as e:
            outcome = (type(e).__name__, str(e)[:300])
        results.append([*outcome, time.perf_counter() - start])
    print(json.dumps(results))
    """
).format(headroom=HEADROOM)


def run_capped(cases: list[tuple[str, Path]], timeout: float = 120) -> list[tuple[str, str, float]]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([(t, str(p)) for t, p in cases])],
        capture_output=True, text=True, timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hostile(tiny_llama_q8, tiny_llama_dir, tmp_path_factory):
    """(file, the message its error must carry) for each way a file used to exhaust memory or time."""
    tmp = tmp_path_factory.mktemp("hostile")
    data = tiny_llama_q8.read_bytes()
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    first_tensor = data.index(struct.pack("<Q", len("token_embd.weight")) + b"token_embd.weight")
    eof_array = struct.pack("<Q", 1) + b"x" + struct.pack("<IIQ", T.ARRAY, T.INT32, 2**60)
    files = {}
    # the file: the real metadata, then an array declared with 2^60 elements at the end of the file
    (tmp / "array-2^60.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv + 1) + data[24:first_tensor] + eof_array)
    files["array-2^60.gguf"] = "array 'x' declares 1152921504606846976 elements of INT32"
    for key, value, match in [
        ("llama.block_count", 2**31 - 1, "llama.block_count = 2147483647 is more than 512"),
        ("llama.block_count", 10**9, "llama.block_count = 1000000000 is more than 512"),
        ("llama.context_length", 2**31, "llama.context_length = 2147483648 is more than 4194304"),
        ("llama.context_length", 2**63, "llama.context_length = 9223372036854775808 is more than 4194304"),
        ("llama.embedding_length", 2**40, "llama.embedding_length = 1099511627776 is more than"),
    ]:
        name = f"{key}-{value}.gguf"
        rewrite_gguf(tiny_llama_q8, tmp / name, fields={key: (value, T.UINT64)})
        files[name] = match
    for key, value, match in [
        ("num_hidden_layers", 10**9, "num_hidden_layers = 1000000000 is more than 512"),
        ("max_position_embeddings", 2**31, "max_position_embeddings = 2147483648 is more than 4194304"),
        ("hidden_size", 2**40, "hidden_size = 1099511627776 is more than"),
    ]:
        name = f"hf-{key}-{value}"
        _hf_copy(tiny_llama_dir, tmp / name, {key: value})
        files[name] = match
    return tmp, files


@pytest.mark.parametrize("target", ["llm", "inspect"])
def test_files_that_exhausted_memory_fail_fast_with_bounded_memory(hostile, target):
    tmp, files = hostile
    results = run_capped([(target, tmp / name) for name in files])
    # no timing asserted (the seconds are reported in the closing notes): the memory cap and the child's
    # timeout are what fail a reader that sizes anything by a lying count
    for (name, match), (outcome, message, _) in zip(files.items(), results):
        assert outcome == "ModelFileError", (name, outcome, message)
        assert str(tmp / name) in message and match in message, (name, message)


@pytest.mark.slow  # up to 20 s of the gguf package's loop
def test_the_old_reader_fails_this_test(hostile):
    """What the test above guards against: the gguf package's reader, which read zero bytes per element
    at the end of the file, loops on the 2^60-element array until the cap stops it (MemoryError) or the
    clock does, whichever comes first on a loaded machine."""
    tmp, _ = hostile
    # the child says MemoryError by its exit status alone: at the cap, even formatting the exception can fail
    child = textwrap.dedent(
        """
        import os, resource, sys
        import gguf

        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom}, vm + {headroom}))
        try:
            gguf.GGUFReader(sys.argv[1])
        except MemoryError:
            os._exit(3)
        os._exit(0)
        """
    ).format(headroom=HEADROOM)
    try:
        out = subprocess.run([sys.executable, "-c", child, str(tmp / "array-2^60.gguf")], capture_output=True,
                             timeout=20)
    except subprocess.TimeoutExpired:
        return
    assert out.returncode == 3, (out.returncode, out.stderr[-2000:])


@pytest.mark.slow
def test_hostile_file_campaign_has_no_tracebacks_or_hangs(tmp_path):
    """benchmarks/hostile_files.py: every broken file is refused with a churon error or loads; none gives a
    Python traceback, hangs or exhausts memory (a few minutes)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hostile_files.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(results) > 800
    bad = [r for r in results if r["outcome"] in ("traceback", "hang/memory")]
    assert not bad, "\n".join(f"{r['target']} {r['path']}: {r['type']}: {r['message']}" for r in bad[:20])
    bases = [r for r in results if "/base/" in r["path"]]
    assert bases and all(r["outcome"] == "accepted" for r in bases), bases
