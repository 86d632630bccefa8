"""Bad input gets a clear error naming the file, tensor, field or value; nothing crashes bare."""

import re
import subprocess
import sys

import gguf
import numpy as np
import pytest

from churon import LLM, ChuronError, ContextLengthError, ModelFileError, SamplingParams, UnsupportedModelError
from churon.config import EngineConfig
from churon.loader import load_model


def rewrite_gguf(src, dst, arch=None, drop=(), replace=None):
    """Copy a GGUF, optionally under another architecture name, without some tensors, or with some replaced.

    replace: tensor name -> (array, raw GGML type or None)."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if arch and key.startswith(old_arch + "."):
            key = arch + key[len(old_arch) :]
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if replace and t.name in replace:
            array, raw = replace[t.name]
            writer.add_tensor(t.name, array, raw_dtype=raw)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_missing_file():
    with pytest.raises(ChuronError, match="/no/such/model.gguf"):
        load_model("/no/such/model.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am not a model")
    with pytest.raises(ModelFileError, match=r"notes\.gguf.*not a GGUF file"):
        load_model(path)


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.99])
def test_truncated_gguf(tiny_llama_q8, tmp_path, fraction):
    data = tiny_llama_q8.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelFileError, match=r"truncated\.gguf.*(truncated|malformed)"):
        load_model(path)


def test_unsupported_quant_type(tiny_llama_q8, tmp_path):
    # IQ4_NL: blocks of 32 weights in 18 bytes, a type churon does not read; ffn_up is [128, 64]
    raw = np.zeros((128, 64 // 32 * 18), dtype=np.uint8)
    iq4 = gguf.GGMLQuantizationType.IQ4_NL
    path = rewrite_gguf(tiny_llama_q8, tmp_path / "iq4.gguf", replace={"blk.1.ffn_up.weight": (raw, iq4)})
    with pytest.raises(UnsupportedModelError, match=r"iq4\.gguf.*blk\.1\.ffn_up\.weight.*IQ4_NL"):
        load_model(path)


def test_missing_tensor(tiny_llama_q8, tmp_path):
    path = rewrite_gguf(tiny_llama_q8, tmp_path / "missing.gguf", drop={"blk.1.ffn_down.weight"})
    with pytest.raises(ModelFileError, match=r"missing\.gguf.*blk\.1\.ffn_down\.weight.*missing"):
        load_model(path)


def test_tensor_of_the_wrong_shape(tiny_llama_q8, tmp_path):
    wrong = np.zeros((3, 64), dtype=np.float32)
    path = rewrite_gguf(tiny_llama_q8, tmp_path / "shape.gguf", replace={"blk.0.attn_v.weight": (wrong, None)})
    with pytest.raises(ModelFileError, match=r"blk\.0\.attn_v\.weight.*shape \[3, 64\].*expected \[32, 64\]"):
        load_model(path)


def test_unknown_architecture(tiny_llama_q8, tmp_path):
    path = rewrite_gguf(tiny_llama_q8, tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(UnsupportedModelError, match=r"'mamba'.*supported: llama, qwen2, qwen3"):
        load_model(path)


def test_unknown_architecture_in_hf_config(tiny_llama_dir, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*'gpt_neox'.*supported"):
        load_model(bad)


def test_malformed_config_json(tiny_llama_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"config\.json.*not valid JSON"):
        load_model(bad)


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    with pytest.raises(ModelFileError, match=r"model\.safetensors"):
        load_model(bad)


@pytest.fixture(scope="module")
def llm(tiny_llama_q8):
    return LLM(tiny_llama_q8, threads=1)


def test_prompt_longer_than_the_context(llm):
    prompt = [5] * llm.config.context_length
    with pytest.raises(ContextLengthError, match=f"{len(prompt)} tokens.*context window is {llm.config.context_length}"):
        llm.generate([prompt], SamplingParams(max_tokens=1))


def test_generation_stops_at_the_context_end(llm):
    n = llm.config.context_length - 3
    out = llm.generate([[5] * n], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("prompt, match", [([], "empty"), ([10**6], "outside the vocabulary")])
def test_bad_prompt_ids(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt])


def test_invalid_sampling_parameters_through_the_cli(tiny_llama_q8):
    for flag, value in [("--temperature", "-1"), ("--top-p", "1.5"), ("--max-tokens", "0")]:
        result = subprocess.run(
            [sys.executable, "-m", "churon.cli", "run", str(tiny_llama_q8), "hi", flag, value],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 1
        assert "error" in result.stderr and flag.lstrip("-").replace("-", "_").replace("repeat", "") in result.stderr
        assert "Traceback" not in result.stderr


def test_cli_reports_a_missing_model_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "churon.cli", "inspect", "/no/such.gguf"], capture_output=True, text=True)
    assert result.returncode == 1
    assert "/no/such.gguf" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "setting,match",
    [
        ({"kv_dtype": "fp8"}, "kv_dtype='fp8': must be one of auto, float32, bfloat16, float16, int8"),
        ({"block_size": 0}, "block_size=0: must be an integer >= 1"),
        ({"max_num_seqs": 2.5}, "max_num_seqs=2.5"),
        ({"kv_cache_memory": 0}, "kv_cache_memory=0"),
        ({"kv_cache_fraction": 1.5}, "kv_cache_fraction=1.5"),
        ({"max_model_len": 1}, "max_model_len=1"),
    ],
)
def test_invalid_engine_settings(setting, match):
    with pytest.raises(ValueError, match=re.escape(f"invalid engine setting {match}")):
        EngineConfig(**setting)
