"""Reading and writing BERT encoders: a Hugging Face / sentence-transformers directory and a GGUF file as
llama.cpp writes them, the pooling each declares, and `churon quantize` writing a BERT GGUF.

References: transformers' BertConfig and the safetensors weights (the directory), tiny_models.write_bert_gguf
(llama.cpp's converter, on the gguf package's own writer, not churon's), sentence-transformers' loaded
modules (what a directory's pooling is), and llama-cpp-python 0.3.36 (llama.cpp loading churon's file).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFValueType as V

from churon.config import MAX_LAYERS, EncoderConfig, PoolingConfig
from churon.errors import ModelFileError, UnsupportedModelError
from churon.formats.quants import dequantize
from churon.loader import open_model
from churon.quantize import quantize_model
from test_bad_input import _hf_copy, rewrite_gguf
from tiny_models import make_bert_model, write_bert_gguf

SENTENCES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "你好世界, 日本語.",
    "Café naïve résumé: unbelievable (really)",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9",
]


@pytest.fixture(scope="module")
def bert_gguf(tiny_bert_dir, tmp_path_factory):
    """tiny_bert_dir converted by llama.cpp's converter (tiny_models.write_bert_gguf), F32."""
    return write_bert_gguf(tiny_bert_dir, tmp_path_factory.mktemp("bert-gguf") / "bert.gguf")


def hf_weights(hf_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(hf_dir / "model.safetensors")


def expected_config(hf_dir) -> EncoderConfig:
    import transformers

    c = transformers.BertConfig.from_pretrained(hf_dir)
    return EncoderConfig("bert", c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                         c.num_attention_heads, c.hidden_size // c.num_attention_heads, c.max_position_embeddings,
                         c.type_vocab_size, c.layer_norm_eps, "gelu")


def same_architecture(a: EncoderConfig, b: EncoderConfig) -> bool:
    """Equal but for `extra`, and eps compared as the float32 a GGUF stores it in."""
    fields = [f for f in vars(a) if f not in ("extra", "layer_norm_eps")]
    return all(getattr(a, f) == getattr(b, f) for f in fields) and \
        np.float32(a.layer_norm_eps) == np.float32(b.layer_norm_eps)


def as_float(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else dequantize(w.data, w.qtype, w.shape)


# --- reading a sentence-transformers directory


def test_hf_directory_reads_as_transformers_does(tiny_bert_dir):
    source = open_model(tiny_bert_dir)
    assert source.config == EncoderConfig(**{**vars(expected_config(tiny_bert_dir)), "extra": source.config.extra})
    assert source.pooling == PoolingConfig("mean", normalize=True, max_length=64)
    weights = source.load_weights()
    stored = hf_weights(tiny_bert_dir)
    assert "pooler.dense.weight" in stored and not any(name.startswith("pooler.") for name in weights)
    assert weights.keys() == {n for n in stored if not n.startswith("pooler.")}
    assert all(torch.equal(weights[n], stored[n]) for n in weights)


def test_bert_for_masked_lm_directory(tiny_bert_dir, tmp_path):
    """BertForMaskedLM's layout: every weight under "bert.", plus a masked-LM head churon does not read."""
    from safetensors.torch import save_file

    stored = hf_weights(tiny_bert_dir)
    renamed = {"bert." + n: t for n, t in stored.items()}
    renamed["cls.predictions.bias"] = torch.zeros(stored["embeddings.word_embeddings.weight"].shape[0])
    renamed["cls.predictions.transform.dense.weight"] = torch.zeros(64, 64)
    mlm = _hf_copy(tiny_bert_dir, tmp_path / "mlm", config={"architectures": ["BertForMaskedLM"]})
    save_file(renamed, mlm / "model.safetensors")
    source = open_model(mlm)
    weights = source.load_weights()
    assert weights.keys() == {n for n in stored if not n.startswith("pooler.")}
    assert all(torch.equal(weights[n], stored[n]) for n in weights)
    assert source.file_name("embeddings.word_embeddings.weight") == "bert.embeddings.word_embeddings.weight"


def test_sentence_transformers_agrees_on_the_pooling(tmp_path):
    """The directory's pooling as churon reads it is what sentence-transformers runs, in its classic layout and
    in the one sentence-transformers 6 saves."""
    from sentence_transformers import SentenceTransformer

    for pooling, normalize in (("cls", False), ("last", True), ("mean", False)):
        d = make_bert_model(tmp_path / f"{pooling}-{normalize}", pooling=pooling, normalize=normalize)
        model = SentenceTransformer(str(d), device="cpu")
        modes = {"cls": "cls", "last": "lasttoken", "mean": "mean"}
        assert model[1].pooling_mode == modes[pooling] and (len(model) == 3) == normalize
        assert open_model(d).pooling == PoolingConfig(pooling, normalize, 64)
        resaved = tmp_path / f"{pooling}-{normalize}-v6"
        model.save(str(resaved))
        assert "pooling_mode" in json.loads((resaved / "1_Pooling" / "config.json").read_text())
        assert open_model(resaved).pooling.mode == pooling and open_model(resaved).pooling.normalize == normalize


def test_no_modules_json_means_no_pooling(tiny_bert_dir, tmp_path):
    plain = _hf_copy(tiny_bert_dir, tmp_path / "plain")
    (plain / "modules.json").unlink()
    assert open_model(plain).pooling is None


def test_decoder_directory_with_last_token_pooling(tiny_llama_dir, tmp_path):
    """A causal LM saved as a sentence-transformers embedder (the Qwen3-Embedding way)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    d = _hf_copy(tiny_llama_dir, tmp_path / "embedder", files={
        "modules.json": json.dumps(modules),
        "1_Pooling/config.json": json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}),
        "sentence_bert_config.json": json.dumps({"max_seq_length": 100, "do_lower_case": True}),
    })
    source = open_model(d)
    assert source.pooling == PoolingConfig("last", normalize=True, max_length=100)
    assert source.config.extra["do_lower_case"] is True


def _with_modules(src, dst, modules=None, pooling=None, sbert=None):
    files = {}
    if modules is not None:
        files["modules.json"] = modules if isinstance(modules, str) else json.dumps(modules)
    if pooling is not None:
        files["1_Pooling/config.json"] = json.dumps(pooling)
    if sbert is not None:
        files["sentence_bert_config.json"] = json.dumps(sbert)
    return _hf_copy(src, dst, files=files)


ST = "sentence_transformers.models."
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"}


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"modules": [TRANSFORMER, POOLING, {"idx": 2, "name": "2", "path": "2_Dense", "type": ST + "Dense"}, NORMALIZE]},
         UnsupportedModelError, r"modules\.json: module 2 is Dense \(2_Dense\), a projection of the vectors"),
        ({"modules": [TRANSFORMER, POOLING, {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": ST + "LayerNorm"}]},
         UnsupportedModelError, r"module 2 is LayerNorm \(2_LayerNorm\), a module churon does not run"),
        ({"modules": [{"idx": 0, "name": "0", "path": "", "type": ST + "StaticEmbedding"}, POOLING]},
         UnsupportedModelError, r"the first module is StaticEmbedding"),
        ({"modules": [TRANSFORMER]}, UnsupportedModelError, r"modules\.json: no Pooling module"),
        ({"modules": [TRANSFORMER, NORMALIZE, POOLING]}, UnsupportedModelError, r"module 1 is Normalize"),
        ({"modules": "{}"}, ModelFileError, r"modules\.json: expected a non-empty JSON list of modules"),
        ({"modules": "[1, 2]"}, ModelFileError, r"modules\.json: module 0 is 1, not an object"),
        ({"modules": [TRANSFORMER, {**POOLING, "type": 7}]}, ModelFileError, r"module 1 has type 7, not a class name"),
        ({"modules": [TRANSFORMER, {**POOLING, "path": "../elsewhere"}]}, ModelFileError,
         r"modules\.json: module 1 names the folder '\.\./elsewhere', which is outside the model directory"),
        ({"modules": [TRANSFORMER, {**POOLING, "path": "9_Missing"}]}, ModelFileError, r"9_Missing/config\.json: no such file"),
        ({"pooling": {"pooling_mode_max_tokens": True}}, UnsupportedModelError, r"config\.json: pooling max is not supported"),
        ({"pooling": {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}}, UnsupportedModelError,
         r"pooling max \+ mean is not supported"),
        ({"pooling": {"pooling_mode_mean_sqrt_len_tokens": True}}, UnsupportedModelError, r"pooling mean_sqrt_len_tokens"),
        ({"pooling": {"pooling_mode": "weightedmean"}}, UnsupportedModelError, r"pooling weightedmean is not supported"),
        ({"pooling": {"pooling_mode": ["mean", "cls"]}}, UnsupportedModelError, r"pooling mean \+ cls is not supported"),
        ({"pooling": {"pooling_mode": 3}}, ModelFileError, r"pooling_mode = 3 is not a mode name"),
        ({"pooling": {"pooling_mode_mean_tokens": "yes"}}, ModelFileError, r"pooling_mode_mean_tokens = 'yes' is not a boolean"),
        ({"pooling": {"pooling_mode": "mean", "include_prompt": False}}, UnsupportedModelError, r"include_prompt = false"),
        ({"sbert": {"max_seq_length": 0}}, ModelFileError, r"sentence_bert_config\.json: max_seq_length = 0 must be at least 1"),
        ({"sbert": {"max_seq_length": "256"}}, ModelFileError, r"max_seq_length = '256' is not an integer"),
    ],
)
def test_bad_sentence_transformers_files(tiny_bert_dir, tmp_path, change, error, match):
    with pytest.raises(error, match=match):
        open_model(_with_modules(tiny_bert_dir, tmp_path / "bad", **change))


# --- a BERT config.json churon does not read as BERT


@pytest.mark.parametrize(
    "config, error, match",
    [
        ({"hidden_act": "relu"}, UnsupportedModelError, r"config\.json: hidden_act 'relu' is not supported"),
        ({"hidden_act": ["gelu"]}, ModelFileError, r"hidden_act = \['gelu'\] is not a string"),
        ({"position_embedding_type": "relative_key"}, UnsupportedModelError, r"position_embedding_type 'relative_key'"),
        ({"is_decoder": True}, UnsupportedModelError, r"is_decoder = true is not supported"),
        ({"add_cross_attention": True}, UnsupportedModelError, r"add_cross_attention = true is not supported"),
        ({"num_attention_heads": 5}, ModelFileError, r"num_attention_heads = 5 does not divide hidden_size = 64"),
        ({"type_vocab_size": -1}, ModelFileError, r"type_vocab_size = -1 must be at least 0"),
        ({"num_hidden_layers": MAX_LAYERS + 1}, ModelFileError, rf"num_hidden_layers = {MAX_LAYERS + 1} is more than"),
        ({"hidden_size": 10**12}, ModelFileError, r"hidden_size = 1000000000000 is more than .*cannot fit"),
        ({"layer_norm_eps": 0}, ModelFileError, r"layer_norm_eps = 0 must be a finite number greater than 0"),
        ({"max_position_embeddings": ...}, ModelFileError, r"field 'max_position_embeddings' is missing"),
        ({"type_vocab_size": 3}, ModelFileError, r"'embeddings\.token_type_embeddings\.weight' has shape \[2, 64\], expected \[3, 64\]"),
    ],
)
def test_bad_bert_config(tiny_bert_dir, tmp_path, config, error, match):
    with pytest.raises(error, match=match):
        open_model(_hf_copy(tiny_bert_dir, tmp_path / "bad", config=config))


def test_gelu_tanh_variants(tiny_bert_dir, tmp_path):
    for act in ("gelu_new", "gelu_pytorch_tanh"):
        assert open_model(_hf_copy(tiny_bert_dir, tmp_path / act, config={"hidden_act": act})).config.hidden_act == "gelu_tanh"


def test_missing_encoder_weight_is_named(tiny_bert_dir, tmp_path):
    from safetensors.torch import save_file

    d = _hf_copy(tiny_bert_dir, tmp_path / "missing")
    stored = hf_weights(d)
    del stored["encoder.layer.1.intermediate.dense.bias"]
    save_file(stored, d / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"tensor 'encoder\.layer\.1\.intermediate\.dense\.bias' is missing"):
        open_model(d)


# --- reading a GGUF file llama.cpp's converter wrote


def test_gguf_reads_like_the_directory(tiny_bert_dir, bert_gguf):
    source = open_model(bert_gguf)
    assert same_architecture(source.config, expected_config(tiny_bert_dir))
    assert source.pooling == PoolingConfig("mean", normalize=True)  # llama.cpp's server normalizes by default
    stored = hf_weights(tiny_bert_dir)
    weights = source.load_weights()
    assert weights.keys() == {n for n in stored if not n.startswith("pooler.")}
    assert all(torch.equal(as_float(weights[n]), stored[n]) for n in weights)  # F32: bitwise
    assert source.file_name("encoder.layer.0.attention.output.LayerNorm.weight") == "blk.0.attn_output_norm.weight"


@pytest.mark.parametrize("kind, mode", [(0, None), (1, "mean"), (2, "cls"), (3, "last")])
def test_gguf_pooling_types(bert_gguf, tmp_path, kind, mode):
    path = rewrite_gguf(bert_gguf, tmp_path / "p.gguf", fields={"bert.pooling_type": (kind, V.UINT32)})
    assert open_model(path).pooling == (None if mode is None else PoolingConfig(mode, normalize=True))


def test_gguf_pooling_of_a_decoder(tiny_llama_q8, tmp_path):
    path = rewrite_gguf(tiny_llama_q8, tmp_path / "emb.gguf", fields={"llama.pooling_type": (3, V.UINT32)})
    assert open_model(path).pooling == PoolingConfig("last", normalize=True)
    assert open_model(tiny_llama_q8).pooling is None


@pytest.mark.parametrize(
    "edit, error, match",
    [
        ({"fields": {"bert.attention.causal": (True, V.BOOL)}}, ModelFileError, r"bert\.attention\.causal = true"),
        ({"fields": {"bert.attention.causal": (1, V.UINT32)}}, ModelFileError, r"bert\.attention\.causal = 1 is not a boolean"),
        ({"fields": {"bert.pooling_type": (4, V.UINT32)}}, UnsupportedModelError, r"bert\.pooling_type = 4 \(rank"),
        ({"fields": {"bert.pooling_type": (9, V.UINT32)}}, ModelFileError, r"bert\.pooling_type = 9 is not one of llama\.cpp's"),
        ({"fields": {"bert.pooling_type": (-1, V.INT32)}}, ModelFileError, r"bert\.pooling_type = -1 must be at least 0"),
        ({"drop": ["token_types.weight"]}, ModelFileError, r"tensor 'token_types\.weight' is missing"),
        ({"fields": {"tokenizer.ggml.token_type_count": (3, V.UINT32)}}, ModelFileError,
         r"tensor 'token_types\.weight' has shape \[2, 64\], expected \[3, 64\]"),
        ({"drop": ["blk.1.ffn_up.bias"]}, ModelFileError, r"tensor 'blk\.1\.ffn_up\.bias' is missing"),
        ({"fields": {"bert.feed_forward_length": (256, V.UINT32)}}, ModelFileError,
         r"tensor 'blk\.0\.ffn_up\.weight' has shape \[128, 64\], expected \[256, 64\]"),
        ({"fields": {"bert.context_length": (512, V.UINT32)}}, ModelFileError,
         r"tensor 'position_embd\.weight' has shape \[128, 64\], expected \[512, 64\]"),
        ({"fields": {"bert.attention.head_count": (6, V.UINT32)}}, ModelFileError,
         r"bert\.attention\.head_count = 6 does not divide bert\.embedding_length = 64"),
        ({"drop_fields": ["bert.attention.layer_norm_epsilon"]}, ModelFileError,
         r"field 'bert\.attention\.layer_norm_epsilon' is missing"),
        ({"fields": {"bert.attention.layer_norm_epsilon": (float("nan"), V.FLOAT32)}}, ModelFileError,
         r"layer_norm_epsilon = nan must be a finite number"),
        ({"fields": {"bert.block_count": (MAX_LAYERS + 1, V.UINT32)}}, ModelFileError, rf"block_count = {MAX_LAYERS + 1} is more than"),
        ({"drop": ["token_embd.weight"]}, ModelFileError, r"tensor 'token_embd\.weight' is missing"),
    ],
)
def test_bad_bert_gguf(bert_gguf, tmp_path, edit, error, match):
    with pytest.raises(error, match=match):
        open_model(rewrite_gguf(bert_gguf, tmp_path / "bad.gguf", **edit))


def test_gguf_without_token_types(bert_gguf, tmp_path):
    """A file that declares no token types needs no token_types tensor (the embeddings are word + position)."""
    path = rewrite_gguf(bert_gguf, tmp_path / "no-types.gguf", drop=["token_types.weight"],
                        fields={"tokenizer.ggml.token_type_count": (0, V.UINT32)})
    source = open_model(path)
    assert source.config.type_vocab_size == 0 and "embeddings.token_type_embeddings.weight" not in source.load_weights()


# --- writing: churon quantize


def test_quantize_writes_what_llama_cpp_converter_writes(tiny_bert_dir, bert_gguf, tmp_path):
    out = quantize_model(tiny_bert_dir, tmp_path / "churon.gguf", "F32", progress=False).path
    ours, theirs = gguf.GGUFReader(out), gguf.GGUFReader(bert_gguf)
    fields = {k: (f.types, f.contents()) for k, f in ours.fields.items() if not k.startswith("GGUF.")}
    expected = {k: (f.types, f.contents()) for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    fields.pop("general.name"), expected.pop("general.name")
    assert fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(np.array(a.data), np.array(b.data)), a.name


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_quantized_bert_reads_back(tiny_bert_dir, tmp_path, qtype):
    out = quantize_model(tiny_bert_dir, tmp_path / f"{qtype}.gguf", qtype, progress=False).path
    source = open_model(out)
    assert same_architecture(source.config, open_model(tiny_bert_dir).config)
    assert source.pooling == PoolingConfig("mean", normalize=True)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["position_embd.weight"] == types["token_types.weight"] == types["blk.0.attn_q.bias"] == "F32"
    assert types["token_embd.weight"] == types["blk.1.ffn_down.weight"] == qtype
    stored = hf_weights(tiny_bert_dir)
    for name, w in source.load_weights().items():
        got, want = as_float(w), stored[name]
        if qtype == "F32" or want.dim() == 1 or name.startswith(("embeddings.position", "embeddings.token_type")):
            assert torch.equal(got, want), name
        elif qtype == "F16":
            assert torch.equal(got, want.half().float()), name
        else:  # Q8_0: half a step of the value's 32-value block (amax / 127), plus the step's own F16 rounding
            step = want.reshape(-1, 32).abs().amax(1, keepdim=True) / 127  # times up to 127 steps
            assert ((got - want).reshape(-1, 32).abs() <= step * (0.5 + 127 * 2**-11)).all(), name


def test_requantize_a_bert_gguf(bert_gguf, tmp_path):
    out = quantize_model(bert_gguf, tmp_path / "q8.gguf", "Q8_0", progress=False).path
    source = open_model(out)
    assert same_architecture(source.config, open_model(bert_gguf).config)
    assert source.pooling == PoolingConfig("mean", normalize=True)


@pytest.mark.parametrize("kwargs, match", [({"method": "imatrix"}, r"method 'imatrix' calibrates on a decoder"),
                                           ({"method": "gptq"}, r"method 'gptq'"),
                                           ({"method": "awq"}, r"method 'awq'"),
                                           ({"target_bpw": 9.0}, r"--target-bpw calibrates")])
def test_calibrated_methods_refuse_an_encoder(tiny_bert_dir, tmp_path, kwargs, match):
    with pytest.raises(UnsupportedModelError, match=match + r".*written with rtn only"):
        quantize_model(tiny_bert_dir, tmp_path / "m.gguf", "Q8_0", progress=False, **kwargs)
    assert not (tmp_path / "m.gguf").exists()


def test_cli_quantize_bert(tiny_bert_dir, tmp_path, capsys):
    from churon.cli import main

    out = tmp_path / "m.gguf"
    assert main(["quantize", str(tiny_bert_dir), str(out), "--type", "f16", "--quiet"]) == 0
    assert "F16" in capsys.readouterr().out
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "bert"


# --- llama.cpp loads the file churon writes


@pytest.mark.parametrize("qtype, bound", [("F32", 0.9999), ("Q8_0", 0.999)])
def test_llama_cpp_embeds_like_sentence_transformers(tiny_bert_dir, tmp_path, qtype, bound):
    """llama.cpp computes BERT's GELU with the tanh approximation (tiny_models' model uses erf GELU) and
    sums in its own order: on the F32 file its vectors are still within 1e-6 of sentence-transformers'
    (measured 0.9999999); 0.9999 leaves room for other llama.cpp builds. Q8_0 measured 0.9997."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from sentence_transformers import SentenceTransformer

    out = quantize_model(tiny_bert_dir, tmp_path / f"{qtype}.gguf", qtype, progress=False).path
    reference = SentenceTransformer(str(tiny_bert_dir), device="cpu")
    llm = llama_cpp.Llama(model_path=str(out), embedding=True, n_ctx=128, n_threads=2, verbose=False)
    try:
        for text, want in zip(SENTENCES, reference.encode(SENTENCES)):
            assert llm.tokenize(text.encode()) == reference.tokenizer(text)["input_ids"], text
            got = np.array(llm.embed(text))
            cosine = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
            assert cosine >= bound, (text, cosine)
    finally:
        llm.close()


def test_decoder_directories_are_unchanged(tiny_llama_dir):
    source = open_model(tiny_llama_dir)
    assert source.pooling is None and not isinstance(source.config, EncoderConfig)
    assert source.file_name("layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert source.file_name("layers.9.mlp.up_proj.weight") == "model.layers.9.mlp.up_proj.weight"
