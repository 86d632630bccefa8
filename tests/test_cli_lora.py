"""LoRA adapters on the `churon` command, run as a user would (a subprocess): `run --lora` answers with the
adapter (checked against LLM with the adapter, greedy), `inspect ADAPTER` says what the adapter is (checked
against its adapter_config.json and the tensors read), `serve --lora` refuses a bad adapter at start."""

import re

import pytest

from churon import LLM, SamplingParams
from churon.cli import main
from churon.formats.lora import read_lora, write_lora_gguf
from churon.loader import open_model
from test_cli import churon
from test_server import free_port
from tiny_models import make_peft_adapter


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("cli-lora") / "pirate", rank=4, alpha=8.0, seed=7)


def fields(stdout: str) -> dict[str, str]:
    """inspect's lines: the name, padding, the value."""
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in stdout.splitlines())


def test_run_with_lora_prints_the_adapters_greedy_answer(tiny_llama_dir, adapter):
    args = ["run", tiny_llama_dir, "The quick brown fox", "--raw", "--temperature", "0", "--max-tokens", "12",
            "--threads", "1"]
    result = churon(*args, "--lora", adapter)
    assert result.returncode == 0, result.stderr
    llm = LLM(tiny_llama_dir, threads=1, lora_adapters={"pirate": adapter})
    params = SamplingParams(temperature=0, max_tokens=12, lora="pirate")
    expected = llm.generate(["The quick brown fox"], params)[0].text
    assert result.stdout == expected + "\n"
    base = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12))[0].text
    assert base != expected


def test_inspect_prints_a_peft_adapters_fields(tiny_llama_dir, adapter):
    result = churon("inspect", adapter)
    assert result.returncode == 0, result.stderr
    got = fields(result.stdout)
    read = read_lora(adapter)
    assert got["kind"] == "peft LoRA adapter"
    assert got["rank"] == "4" and got["alpha"] == "8" and got["rsLoRA"] == "no (alpha / r)"
    assert got["targets"] == "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    assert got["modules"] == "14" and got["layers"] == "2 (0-1)"  # 7 targets x 2 layers
    assert got["size"].startswith(f"{read.nbytes / 1e6:.2f} MB")
    assert got["base model"] == str(tiny_llama_dir)  # adapter_config's base_model_name_or_path


def test_inspect_prints_ranks_by_module_rslora_and_a_gguf_adapters_architecture(tiny_llama_dir, tmp_path):
    mixed = make_peft_adapter(tiny_llama_dir, tmp_path / "mixed", rank=4, alpha=16.0, use_rslora=True,
                              targets=("q_proj", "v_proj"), rank_pattern={"v_proj": 8})
    got = fields(churon("inspect", mixed).stdout)
    assert got["rank"] == "8 (the largest; by module 4, 8)" and got["rsLoRA"] == "yes (alpha / sqrt(r))"
    assert got["targets"] == "q_proj, v_proj" and got["modules"] == "4"
    gguf = write_lora_gguf(read_lora(mixed), open_model(tiny_llama_dir).config, tmp_path / "mixed.gguf")
    got = fields(churon("inspect", gguf).stdout)
    assert got["kind"] == "gguf LoRA adapter" and got["architecture"] == "llama"
    assert got["alpha"].startswith("0 (llama.cpp: no scaling")  # per-module scales folded into B
    assert got["targets"] == "q_proj, v_proj" and got["layers"] == "2 (0-1)"


def test_serve_refuses_a_bad_adapter_at_start(tiny_llama_dir, tmp_path, capsys):
    result = churon("serve", tiny_llama_dir, "--lora", f"bad={tmp_path / 'missing'}", "--port", free_port(),
                    "--threads", "1", "--log-level", "critical")
    assert result.returncode == 1 and "'bad'" in result.stderr and "no such file" in result.stderr
    # before any model loads: an adapter needs a MODEL to run on, and a name of its own
    assert main(["serve", "--lora", f"x={tmp_path}"]) == 1 and "--lora" in capsys.readouterr().err
    twice = ["serve", tiny_llama_dir.as_posix(), "--lora", f"{tmp_path}/a", "--lora", f"a={tmp_path}"]
    assert main(twice) == 1 and "two adapters are named 'a'" in capsys.readouterr().err
