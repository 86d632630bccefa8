"""Bad input gets a clear error naming the file, tensor, field or value; nothing crashes bare."""

import re
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from churon import LLM, ChuronError, ContextLengthError, ModelFileError, SamplingParams, UnsupportedModelError
from churon.config import EngineConfig
from churon.formats.gguf import LONGROPE_TENSORS
from churon.loader import load_model


def rewrite_gguf(src, dst, arch=None, drop=(), replace=None, fields=None, drop_fields=()):
    """Copy a GGUF, optionally under another architecture name, without some tensors, or with some replaced,
    with some metadata fields set or left out.

    replace: tensor name -> (array, raw GGML type or None); fields: key -> (value, GGUFValueType[, element type])."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch or old_arch)
    fields = fields or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in fields or key in drop_fields:
            continue
        if arch and key.startswith(old_arch + "."):
            key = arch + key[len(old_arch) :]
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, *types) in fields.items():
        writer.add_key_value(key, value, *types)
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
    with pytest.raises(UnsupportedModelError, match=r"'mamba'.*supported: gemma2, gemma3, gpt-oss, llama, mistral, mixtral, olmoe,"
                                                 r" phi3, qwen2, qwen2moe, qwen3, qwen3moe"):
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


def test_cli_refuses_a_raw_prompt_longer_than_the_context_before_encoding(tiny_llama_q8, monkeypatch, capsys):
    from churon import cli
    from churon.tokenizer import Tokenizer

    llm = LLM(tiny_llama_q8, threads=1)
    limit = llm.max_model_len * max(len(llm.tokenizer.token_bytes(i)) for i in range(llm.tokenizer.vocab_size))

    def encode(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(Tokenizer, "encode", encode)
    assert cli.main(["run", "--raw", str(tiny_llama_q8), "x" * (limit + 1)]) == 1
    assert f"more than {llm.max_model_len} tokens (the context window)" in capsys.readouterr().err


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


# --------------------------------------------------------------------------------------------------
# Model files that lie: every count, size and value is checked before anything is sized by it, and
# each error is a ModelFileError naming the file and the key or tensor.
# --------------------------------------------------------------------------------------------------

T = gguf.GGUFValueType


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"llama.attention.head_count": (0, T.UINT32)}, r"llama\.attention\.head_count = 0 must be at least 1"),
        ({"llama.embedding_length": (0, T.UINT32)}, r"llama\.embedding_length = 0 must be at least 1"),
        ({"llama.block_count": (0, T.UINT32)}, r"llama\.block_count = 0 must be at least 1"),
        ({"llama.attention.head_count_kv": (0, T.UINT32)}, r"llama\.attention\.head_count_kv = 0 must be at least 1"),
        ({"llama.attention.key_length": (0, T.UINT32)}, r"llama\.attention\.key_length = 0 must be at least 1"),
        ({"llama.block_count": ([2, 2], T.ARRAY, T.UINT32)}, r"llama\.block_count = \[2, 2\] is not an integer"),
        ({"llama.block_count": ("2", T.STRING)}, r"llama\.block_count = '2' is not an integer"),
        ({"llama.block_count": (2.0, T.FLOAT32)}, r"llama\.block_count = 2\.0 is not an integer"),
        ({"llama.attention.head_count": (True, T.BOOL)}, r"llama\.attention\.head_count = True is not an integer"),
        ({"llama.block_count": (2**31 - 1, T.UINT32)}, r"llama\.block_count = 2147483647 is more than 512"),
        ({"llama.context_length": (2**31, T.UINT64)}, r"llama\.context_length = 2147483648 is more than 4194304"),
        ({"llama.embedding_length": (2**40, T.UINT64)}, r"llama\.embedding_length = 1099511627776 is more than \d+: "
                                                        r"the weights it sizes cannot fit"),
        ({"llama.vocab_size": (2**40, T.UINT64)}, r"llama\.vocab_size = 1099511627776 is more than"),
        ({"llama.attention.head_count": (64, T.UINT32)},
         r"tensor 'blk\.0\.attn_q\.weight' has shape \[64, 64\], expected \[1024, 64\]"),
        ({"llama.attention.head_count_kv": (3, T.UINT32)},
         r"llama\.attention\.head_count_kv = 3 does not divide llama\.attention\.head_count = 4"),
        ({"llama.attention.key_length": (7, T.UINT32)}, r"llama\.attention\.key_length = 7 is odd"),
        ({"llama.rope.freq_base": (float("nan"), T.FLOAT32)}, r"llama\.rope\.freq_base = nan must be a finite number"),
        ({"llama.rope.freq_base": (0.0, T.FLOAT32)}, r"llama\.rope\.freq_base = 0\.0 must be a finite number greater"),
        ({"llama.rope.freq_base": (-1.0, T.FLOAT32)}, r"llama\.rope\.freq_base = -1\.0 must be"),
        ({"llama.rope.freq_base": ([1.0], T.ARRAY, T.FLOAT32)}, r"llama\.rope\.freq_base = \[1\.0\] is not a number"),
        ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), T.FLOAT32)}, r"layer_norm_rms_epsilon = nan must be"),
        ({"llama.attention.layer_norm_rms_epsilon": (0.0, T.FLOAT32)}, r"layer_norm_rms_epsilon = 0\.0 must be"),
        ({"llama.attention.layer_norm_rms_epsilon": (-0.5, T.FLOAT32)}, r"layer_norm_rms_epsilon = -0\.5 must be"),
        ({"llama.rope.scaling.type": ("linear", T.STRING)}, r"'llama\.rope\.scaling\.factor' is missing"),
        ({"llama.rope.scaling.type": ("linear", T.STRING), "llama.rope.scaling.factor": (0.0, T.FLOAT32)},
         r"llama\.rope\.scaling\.factor = 0\.0 must be"),
        ({"llama.rope.scaling.type": (1, T.UINT32)}, r"llama\.rope\.scaling\.type = 1 is not a string"),
        ({"general.architecture": (1, T.UINT32)}, r"architecture 1 is not a string"),
        ({"general.alignment": (3, T.UINT32)}, r"general\.alignment = 3 is not a power of two"),
        ({"tokenizer.ggml.token_type": (["1"] * 400, T.ARRAY, T.STRING)},
         r"tokenizer\.ggml\.token_type\[0\] = '1' is not one of the integers"),
        ({"tokenizer.ggml.token_type": (1, T.INT32)}, r"tokenizer\.ggml\.token_type = 1 is not an array"),
        ({"tokenizer.ggml.merges": ([1, 2], T.ARRAY, T.INT32)}, r"tokenizer\.ggml\.merges\[0\] = 1 is not one of the strings"),
    ],
    ids=lambda v: None if isinstance(v, str) else "-".join(f"{k}={x[0]!r:.12}" for k, x in v.items()),
)
def test_lying_gguf_metadata_is_a_model_file_error(tiny_llama_q8, tmp_path, fields, match):
    path = rewrite_gguf(tiny_llama_q8, tmp_path / "lies.gguf", fields=fields)
    with pytest.raises(ModelFileError, match=re.escape(str(path)) + ".*" + match):
        load_model(path)


def test_inspect_reads_a_gguf_with_2d_f32_tensors(tiny_llama_dir, tmp_path):
    from tiny_models import write_gguf

    path = write_gguf(tiny_llama_dir, tmp_path / "f32.gguf", "F32")
    result = subprocess.run([sys.executable, "-m", "churon.cli", "inspect", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "native kernels" in result.stdout and "F32" in result.stdout


def _tensor_info_at(data: bytes, name: str) -> int:
    """The byte position of a tensor's type field (its offset follows): after its name, n_dims and dims."""
    pos = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    return pos + 4 + 8 * n_dims


def _patch_offset(src, dst, name, offset):
    data = bytearray(src.read_bytes())
    struct.pack_into("<Q", data, _tensor_info_at(data, name) + 4, offset(data))
    dst.write_bytes(data)
    return dst


@pytest.mark.parametrize(
    "offset, match",
    [
        (lambda d: 0, r"tensors '.*' and '.*' overlap"),
        (lambda d: 32 + 1, r"offset 33, not a multiple of the alignment 32"),
        (lambda d: 2**64 - 32, r"truncated: tensor 'blk\.0\.attn_q\.weight' needs bytes"),
        (lambda d: len(d), r"truncated: tensor 'blk\.0\.attn_q\.weight' needs bytes"),
    ],
    ids=["overlap", "misaligned", "wraps", "beyond-the-end"],
)
def test_tensor_offsets_are_checked(tiny_llama_q8, tmp_path, offset, match):
    path = _patch_offset(tiny_llama_q8, tmp_path / "offsets.gguf", "blk.0.attn_q.weight", offset)
    with pytest.raises(ModelFileError, match=r"offsets\.gguf.*" + match):
        load_model(path)


def _gguf_header(n_tensors: int, kvs: bytes, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload


@pytest.mark.parametrize(
    "blob, match",
    [
        (_gguf_header(0, _kv("x", T.ARRAY, struct.pack("<IQ", T.INT32, 2**60)), 1),
         r"array 'x' declares 1152921504606846976 elements of INT32, more than the 0 bytes that remain can hold"),
        (_gguf_header(0, _kv("x", T.ARRAY, struct.pack("<IQ", T.STRING, 2**40)) + b"\0" * 64, 1),
         r"array 'x' declares 1099511627776 elements of STRING"),
        (_gguf_header(0, _kv("x", T.ARRAY, struct.pack("<IQ", T.ARRAY, 1)), 1), r"'x' is an array of arrays"),
        (_gguf_header(0, _kv("x", T.STRING, struct.pack("<Q", 2**63)), 1),
         r"truncated GGUF header: the value of 'x' \(9223372036854775808 bytes\) at byte 45 needs"),
        (_gguf_header(0, _kv("x", T.UINT8, b"\1") * 2, 2), r"duplicate metadata key 'x'"),
        (_gguf_header(0, _kv("\xff", T.UINT8, b"\1").replace(b"\xc3\xbf", b"\xff\xff"), 1), r"is not UTF-8"),
        (_gguf_header(0, _kv("x", 99, b""), 1), r"'x' has unknown value type 99"),
        (_gguf_header(2**60, b"", 0), r"truncated GGUF header: the length of the name of tensor 0"),
        (_gguf_header(1, struct.pack("<Q", 1) + b"t" + struct.pack("<I", 9), 0), r"tensor 't' has 9 dimensions"),
        (b"GGUF" + struct.pack("<I", 1) + b"\0" * 16, r"GGUF version 1 is not supported"),
    ],
    ids=["int-array-2^60", "string-array-2^40", "nested-array", "string-2^63", "duplicate-key", "not-utf8",
         "unknown-type", "tensor-count-2^60", "nine-dims", "version-1"],
)
def test_gguf_header_lies_are_short_errors(tmp_path, blob, match):
    from churon.formats.gguf import GGUFFile

    path = tmp_path / "header.gguf"
    path.write_bytes(blob)
    with pytest.raises(ModelFileError, match=r"header\.gguf: .*" + match):
        GGUFFile.open(path)


def test_a_400k_character_token_loads_in_linear_time(tiny_llama_q8, tmp_path):
    """SentencePiece merges are every split of a token into two tokens: one slice per character was
    quadratic (18 s for this token); the splits tried are only those into lengths tokens have. Counted,
    not timed: the vocabulary lookups the merges make."""
    from churon.tokenizer.gguf_vocab import _spm_merges

    class CountingVocab(dict):
        lookups = 0

        def __contains__(self, key):
            CountingVocab.lookups += 1
            return super().__contains__(key)

    reader = gguf.GGUFReader(tiny_llama_q8)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    tokens[300] = "a" * 400_000
    _spm_merges(tokens, [0.0] * len(tokens), CountingVocab((t, i) for i, t in enumerate(tokens)))
    assert CountingVocab.lookups < 20 * len(tokens)  # one per character would be 400,000 for the long token alone
    path = rewrite_gguf(tiny_llama_q8, tmp_path / "long.gguf", fields={
        "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING), "tokenizer.ggml.model": ("llama", T.STRING)})
    tok = LLM(path, threads=1).tokenizer
    assert tok.decode(tok.encode("quick", add_bos=False)) == "quick"


def test_spm_merges_are_every_split_into_two_tokens():
    """The merges tried by token length are exactly those of trying every split."""
    from churon.tokenizer.gguf_vocab import _spm_merges

    tokens = ["a", "b", "ab", "ba", "aab", "abab", "a" * 7, "a" * 3, "a" * 4, "bab", "x" * 30, "ab" * 9]
    scores = [float(-i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    every = sorted(
        (-scores[tid], tid, k, t[:k], t[k:]) for tid, t in enumerate(tokens) for k in range(1, len(t))
        if t[:k] in vocab and t[k:] in vocab
    )
    assert _spm_merges(tokens, scores, vocab) == [(left, right) for *_, left, right in every]


def _hf_copy(src, dst, config=None, raw=None, files=None):
    import json
    import shutil

    shutil.copytree(src, dst)
    if raw is not None:
        (dst / "config.json").write_text(raw)
    elif config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            if v is ...:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (dst / "config.json").write_text(json.dumps(cfg))
    for name, text in (files or {}).items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(text)
    return dst


_LLAMA3_NO_ORIGINAL = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    "config, raw, match",
    [
        (None, "[1, 2]", r": expected a JSON object, found list"),
        (None, "[" * 100_000 + "]" * 100_000, r": not valid JSON: nested too deeply"),
        ({"num_attention_heads": 0}, None, r"num_attention_heads = 0 must be at least 1"),
        ({"hidden_size": 0}, None, r"hidden_size = 0 must be at least 1"),
        ({"num_hidden_layers": 0}, None, r"num_hidden_layers = 0 must be at least 1"),
        ({"num_hidden_layers": 10**9}, None, r"num_hidden_layers = 1000000000 is more than 512"),
        ({"max_position_embeddings": 2**31}, None, r"max_position_embeddings = 2147483648 is more than 4194304"),
        ({"vocab_size": 10**12}, None, r"vocab_size = 1000000000000 is more than \d+: the weights it sizes"),
        ({"num_hidden_layers": [2]}, None, r"num_hidden_layers = \[2\] is not an integer"),
        ({"num_hidden_layers": None}, None, r"field 'num_hidden_layers' is missing"),
        ({"hidden_size": 64.5}, None, r"hidden_size = 64\.5 is not an integer"),
        ({"num_key_value_heads": 3}, None, r"num_key_value_heads = 3 does not divide num_attention_heads = 4"),
        ({"num_attention_heads": 128, "head_dim": ...}, None, r"num_attention_heads = 128 is more than hidden_size = 64"),
        ({"rms_norm_eps": float("nan")}, None, r"rms_norm_eps = nan must be a finite number greater than 0"),
        ({"rms_norm_eps": 0}, None, r"rms_norm_eps = 0 must be"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, None, r"rope_theta = -1\.0 must be"),
        ({"rope_parameters": _LLAMA3_NO_ORIGINAL}, None, r"field 'original_max_position_embeddings' is missing"),
        ({"rope_parameters": {**_LLAMA3_NO_ORIGINAL, "original_max_position_embeddings": 8192, "low_freq_factor": 4.0}},
         None, r"high_freq_factor = 4\.0 must be greater than low_freq_factor = 4\.0"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, None, r"field 'factor' is missing"),
        ({"rope_parameters": [1, 2]}, None, r"rope_parameters = \[1, 2\] is not an object"),
        ({"rope_scaling": "linear"}, None, r"rope_scaling = 'linear' is not an object"),
        ({"model_type": ["llama"]}, None, r"architecture \['llama'\] is not a string"),
        ({"tie_word_embeddings": "no"}, None, r"tie_word_embeddings = 'no' is not a boolean"),
    ],
    ids=lambda v: None if v is None else re.sub(r"\W+", "-", str(v))[:40],
)
def test_lying_config_json_is_a_model_file_error(tiny_llama_dir, tmp_path, config, raw, match):
    bad = _hf_copy(tiny_llama_dir, tmp_path / "bad", config, raw)
    with pytest.raises(ModelFileError, match=re.escape(str(bad / "config.json")) + ".*" + match):
        load_model(bad)


def test_unsupported_rope_scaling_names_the_file(tiny_llama_dir, tmp_path):
    bad = _hf_copy(tiny_llama_dir, tmp_path / "bad", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match=r"bad/config\.json: rope_parameters: RoPE scaling type 'dynamic'"):
        load_model(bad)


@pytest.mark.parametrize(
    "shard, match",
    [
        ("../outside/model.safetensors", r"names the shard '\.\./outside/model\.safetensors', which is outside"),
        ("/etc/model.safetensors", r"names the shard '/etc/model\.safetensors', which is outside"),
        (7, r"names the shard 7, which is not a file name"),
    ],
)
def test_safetensors_index_shards_stay_inside_the_model_directory(tiny_llama_dir, tmp_path, shard, match):
    import json
    import shutil

    (tmp_path / "outside").mkdir()
    shutil.copy(tiny_llama_dir / "model.safetensors", tmp_path / "outside" / "model.safetensors")
    from safetensors import safe_open

    with safe_open(tiny_llama_dir / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    index = json.dumps({"weight_map": dict.fromkeys(names, shard)})
    bad = _hf_copy(tiny_llama_dir, tmp_path / "bad", files={"model.safetensors.index.json": index})
    with pytest.raises(ModelFileError, match=r"model\.safetensors\.index\.json: weight_map " + match):
        load_model(bad)


def test_partial_rope_is_unsupported(tiny_llama_q8, tmp_path):
    path = rewrite_gguf(tiny_llama_q8, tmp_path / "nrot.gguf", fields={"llama.rope.dimension_count": (8, T.UINT32)})
    with pytest.raises(UnsupportedModelError, match=r"nrot\.gguf: llama\.rope\.dimension_count = 8 differs from the head"):
        load_model(path)


@pytest.mark.parametrize(
    "gen, match",
    [({"eos_token_id": "x"}, r"eos_token_id = 'x' is not a token id"),
     ({"eos_token_id": [2, 2**40]}, r"eos_token_id\[1\] = 1099511627776 is not a token id \(tokenizer\.json has 400 tokens\)"),
     ({"bos_token_id": -1}, r"bos_token_id = -1 is not a token id")],
)
def test_generation_config_token_ids_are_in_the_vocabulary(tiny_llama_dir, tmp_path, gen, match):
    import json

    bad = _hf_copy(tiny_llama_dir, tmp_path / "bad", files={"generation_config.json": json.dumps(gen)})
    (bad / "tokenizer_config.json").write_text("{}")  # bos/eos from generation_config.json alone
    with pytest.raises(ModelFileError, match=r"bad/generation_config\.json: " + match):
        load_model(bad)


def test_integer_weights_are_unsupported(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = _hf_copy(tiny_llama_dir, tmp_path / "bad")
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"].to(torch.int32)
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has type I32"):
        load_model(bad)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_an_unreadable_json_file_is_a_model_file_error(tiny_llama_dir, tmp_path, name):
    """A directory where a JSON file belongs (or any OSError reading it) names the file, no traceback."""
    bad = tmp_path / "m"
    _hf_copy(tiny_llama_dir, bad)
    (bad / name).unlink()
    (bad / name).mkdir()
    with pytest.raises(ModelFileError, match=f"{bad / name}: cannot read it"):
        LLM(bad, threads=1)


# --------------------------------------------------------------------------------------------------
# LongRoPE (Phi-3): its factors, one per rotated pair, and its type, from a directory and from a GGUF
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_phi3_longrope(tmp_path_factory):
    from tiny_models import PHI3_LONGROPE, make_hf_model, write_gguf

    scaling = {**PHI3_LONGROPE, "original_max_position_embeddings": 8}
    hf = make_hf_model("phi3", tmp_path_factory.mktemp("tiny-phi3"), rope_scaling=scaling)
    return hf, write_gguf(hf, tmp_path_factory.mktemp("tiny-phi3-gguf") / "phi3.gguf", "F32")


def _longrope_config(hf_dir, **changes):
    import json

    rope = json.loads((hf_dir / "config.json").read_text())["rope_parameters"]
    return {"rope_parameters": {k: v for k, v in {**rope, **changes}.items() if v is not ...}}


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"short_factor": [1.0] * 7}, r"rope_parameters: short_factor has 7 factors, the head dimension 16 needs 8"),
        ({"long_factor": [1.0] * 9}, r"rope_parameters: long_factor has 9 factors, the head dimension 16 needs 8"),
        ({"long_factor": "1.0"}, r"rope_parameters: long_factor = '1\.0' is not a list of numbers"),
        ({"short_factor": [1.0, 1.0, 0.0] + [1.0] * 5}, r"rope_parameters: short_factor\[2\] = 0\.0 must be a finite number greater"),
        ({"long_factor": ...}, r"rope_parameters: field 'long_factor' is missing"),
        ({"attention_factor": -1.0}, r"rope_parameters: attention_factor = -1\.0 must be"),
    ],
    ids=["short-of-7", "long-of-9", "long-a-string", "short-zero", "long-missing", "attention-factor-negative"],
)
def test_lying_longrope_config_is_a_model_file_error(tiny_phi3_longrope, tmp_path, changes, match):
    hf, _ = tiny_phi3_longrope
    bad = _hf_copy(hf, tmp_path / "bad", _longrope_config(hf, **changes))
    with pytest.raises(ModelFileError, match=re.escape(str(bad / "config.json")) + ": " + match):
        load_model(bad)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"partial_rotary_factor": 0.75}, r"partial_rotary_factor = 0\.75 is not supported \(RoPE over part of each"),
        ("dynamic", r"rope_parameters: RoPE scaling type 'dynamic' is not supported \(supported: linear, llama3, longrope,"
                    r" yarn\)"),
    ],
)
def test_unsupported_phi3_rope_names_the_field(tiny_phi3_longrope, tmp_path, config, match):
    hf, _ = tiny_phi3_longrope
    bad = _hf_copy(hf, tmp_path / "bad", _longrope_config(hf, rope_type="dynamic") if config == "dynamic" else config)
    with pytest.raises(UnsupportedModelError, match=re.escape(str(bad / "config.json")) + ": " + match):
        load_model(bad)


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"replace": {"rope_factors_long.weight": (np.ones(7, np.float32), None)}},
         r"rope_factors_long\.weight has 7 factors, the head dimension 16 needs 8"),
        ({"replace": {"rope_factors_short.weight": (np.array([1, 1, 1, np.nan, 1, 1, 1, 1], np.float32), None)}},
         r"rope_factors_short\.weight\[3\] = nan must be a finite number"),
        ({"drop": ("rope_factors_short.weight",)},
         r"tensor 'rope_factors_short\.weight' is missing: LongRoPE needs it beside 'rope_factors_long\.weight'"),
        ({"drop": LONGROPE_TENSORS, "fields": {"phi3.rope.scaling.type": ("longrope", T.STRING)}},
         r"phi3\.rope\.scaling\.type is 'longrope' but tensor 'rope_factors_long\.weight' is missing"),
        ({"drop_fields": ("phi3.rope.scaling.original_context_length",)},
         r"field 'phi3\.rope\.scaling\.original_context_length' is missing"),
    ],
    ids=["long-of-7", "short-nan", "short-missing", "longrope-without-factors", "no-original-context"],
)
def test_lying_longrope_gguf_is_a_model_file_error(tiny_phi3_longrope, tmp_path, edit, match):
    assert_edited_gguf_is_a_model_file_error(tiny_phi3_longrope[1], tmp_path, edit, match)


def assert_edited_gguf_is_a_model_file_error(path, tmp_path, edit, match):
    """path rewritten with edit (rewrite_gguf's arguments) fails to load with a ModelFileError naming the file."""
    bad = rewrite_gguf(path, tmp_path / "bad.gguf", **edit)
    with pytest.raises(ModelFileError, match=re.escape(str(bad)) + ": " + match):
        load_model(bad)


def test_unsupported_gguf_rope_scaling_names_the_key(tiny_phi3_longrope, tmp_path):
    _, path = tiny_phi3_longrope
    bad = rewrite_gguf(path, tmp_path / "bad.gguf", fields={"phi3.rope.scaling.type": ("dynamic", T.STRING)})
    with pytest.raises(UnsupportedModelError, match=r"bad\.gguf: phi3\.rope\.scaling\.type 'dynamic' is not supported"):
        load_model(bad)


# --------------------------------------------------------------------------------------------------
# Mixture of experts: the expert counts a file gives against its expert tensors and each other
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    from tiny_models import make_hf_model, write_gguf

    hf = make_hf_model("qwen3_moe", tmp_path_factory.mktemp("tiny-qwen3-moe"))
    return hf, write_gguf(hf, tmp_path_factory.mktemp("tiny-qwen3-moe-gguf") / "moe.gguf", "Q8_0")


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"fields": {"qwen3moe.expert_count": (4, T.UINT32)}},
         r"tensor 'blk\.0\.ffn_gate_inp\.weight' holds 8 experts \(shape \[8, 64\]\), but qwen3moe\.expert_count = 4"),
        ({"fields": {"qwen3moe.expert_used_count": (9, T.UINT32)}},
         r"qwen3moe\.expert_used_count = 9 is more than 8 \(qwen3moe\.expert_count = 8\)"),
        ({"fields": {"qwen3moe.expert_used_count": (0, T.UINT32)}}, r"qwen3moe\.expert_used_count = 0 must be at least 1"),
        ({"drop_fields": ("qwen3moe.expert_count",)},
         r"metadata field 'qwen3moe\.expert_count' is missing \(the file has expert tensors\)"),
        ({"drop_fields": ("qwen3moe.expert_used_count",)}, r"field 'qwen3moe\.expert_used_count' is missing"),
    ],
    ids=["count-4-of-8", "used-9-of-8", "used-0", "count-missing", "used-missing"],
)
def test_lying_expert_counts_in_a_gguf_name_the_key(tiny_qwen3_moe, tmp_path, edit, match):
    assert_edited_gguf_is_a_model_file_error(tiny_qwen3_moe[1], tmp_path, edit, match)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok = 9 must be between 1 and num_experts = 8"),
        ({"num_experts_per_tok": 0}, r"num_experts_per_tok = 0 must be at least 1"),
        ({"num_local_experts": 4},
         r"tensor 'model\.layers\.0\.mlp\.gate\.weight' has shape \[8, 64\], expected \[4, 64\]"),
    ],
    ids=["used-9-of-8", "used-0", "count-4-of-8"],
)
def test_lying_expert_counts_in_a_directory_name_the_field(tiny_qwen3_moe, tmp_path, config, match):
    hf, _ = tiny_qwen3_moe
    bad = _hf_copy(hf, tmp_path / "bad", config)
    with pytest.raises(ModelFileError, match=match):
        load_model(bad)


def test_a_directory_missing_an_expert_names_its_tensor(tiny_qwen3_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    hf, _ = tiny_qwen3_moe
    bad = _hf_copy(hf, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=r"tensor 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight' is missing"):
        load_model(bad)
