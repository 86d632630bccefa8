"""Sanity tests of tests/tiny_models.py: the tiny HF models and GGUF files the other tests rely on."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

import tiny_models as tm

IDS = torch.tensor([[1, 5, 17, 100, 250, 3, 42, 399, 7, 2]])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tm.make_hf_model(arch, root / arch, tie_word_embeddings=(arch != "qwen2")) for arch in tm.ARCHS}


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def fields(path):
    reader = gguf.GGUFReader(path)
    return reader, {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# --- tokenizer ---------------------------------------------------------------------------------------

def test_tokenizer_files_are_deterministic_and_load(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tm.make_tokenizer_files(tmp_path / "a")
    tm.make_tokenizer_files(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

    tok = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert 300 <= tok.get_vocab_size() <= 500
    assert [tok.token_to_id(t) for t in tm.SPECIAL_TOKENS] == [0, 1, 2]
    assert all(t.special for t in tok.get_added_tokens_decoder().values())

    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert (hf_tok.bos_token, hf_tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    text = hf_tok.apply_chat_template([{"role": "user", "content": "Hello, world!"}], tokenize=False,
                                      add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n")
    ids = hf_tok(text)["input_ids"]
    assert ids == tok.encode(text).ids and ids[0] == 1  # no BOS added, specials matched whole
    assert hf_tok.decode(ids) == text
    assert json.loads((tmp_path / "a" / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


# --- HF model ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", tm.ARCHS)
def test_saved_model_equals_in_memory_model(hf_dirs, arch):
    tie = arch != "qwen2"
    mem = tm._build_model(arch, hf_dirs[arch], tie, 0, None, 0)
    mem.set_attn_implementation("eager")
    ref = tm.reference_model(hf_dirs[arch])
    mem_sd, ref_sd = mem.state_dict(), ref.state_dict()
    assert mem_sd.keys() == ref_sd.keys()
    assert all(torch.equal(mem_sd[k], ref_sd[k]) for k in mem_sd)
    out = logits(ref)
    assert torch.equal(logits(mem), out)
    assert out.std() > 0.5  # weights large enough that logits are not all ~0
    config = json.loads((hf_dirs[arch] / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] == tie
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}


def test_model_is_seeded(tmp_path):
    a = tm.make_hf_model("qwen3", tmp_path / "a", seed=3)
    b = tm.make_hf_model("qwen3", tmp_path / "b", seed=3)
    c = tm.make_hf_model("qwen3", tmp_path / "c", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_qwen2_has_biases_and_qwen3_has_qk_norms(hf_dirs):
    q2 = tm.reference_model(hf_dirs["qwen2"]).state_dict()
    q3 = tm.reference_model(hf_dirs["qwen3"]).state_dict()
    assert q2["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    assert "model.layers.0.self_attn.q_proj.bias" not in q3
    assert q3["model.layers.0.self_attn.q_norm.weight"].shape == (tm.HEAD_DIM,)


def test_sharded_and_legacy_config(tmp_path):
    plain = tm.make_hf_model("llama", tmp_path / "plain")
    sharded = tm.make_hf_model("llama", tmp_path / "sharded", shard=True)
    legacy = tm.make_hf_model("llama", tmp_path / "legacy", legacy_config=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    cfg = json.loads((legacy / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None and "rope_parameters" not in cfg
    want = logits(tm.reference_model(plain))
    assert torch.equal(logits(tm.reference_model(sharded)), want)
    assert torch.equal(logits(tm.reference_model(legacy)), want)
    # Same tensors and metadata in the GGUF, whatever the checkpoint layout.
    gp = tm.write_gguf(plain, tmp_path / "plain.gguf", "Q8_0")
    assert tm.write_gguf(legacy, tmp_path / "legacy.gguf", "Q8_0").read_bytes() == gp.read_bytes()
    rp, sp = gguf.GGUFReader(gp), gguf.GGUFReader(tm.write_gguf(sharded, tmp_path / "sharded.gguf", "Q8_0"))
    a = {t.name: bytes(np.array(t.data).tobytes()) for t in rp.tensors}
    b = {t.name: bytes(np.array(t.data).tobytes()) for t in sp.tensors}
    assert a == b


# --- GGUF --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", tm.ARCHS)
def test_gguf_metadata(hf_dirs, tmp_path, arch):
    _, kv = fields(tm.write_gguf(hf_dirs[arch], tmp_path / "m.gguf", "F32"))
    assert kv["general.architecture"] == arch
    assert kv["general.file_type"] == gguf.LlamaFileType.ALL_F32
    expect = {
        f"{arch}.block_count": 2, f"{arch}.context_length": 256, f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2, f"{arch}.rope.freq_base": 10000.0,
    }
    for k, v in expect.items():
        assert kv[k] == v, k
    assert kv[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    # As llama.cpp: key/value_length only when config.json has head_dim (not qwen2), vocab_size and
    # rope.dimension_count only for llama.
    assert (f"{arch}.attention.key_length" in kv) == (arch != "qwen2")
    assert (f"{arch}.rope.dimension_count" in kv) == (arch == "llama")
    if arch == "llama":
        assert kv["llama.vocab_size"] == 400 and kv["llama.rope.dimension_count"] == 16
    if arch == "qwen3":
        assert kv["qwen3.attention.key_length"] == kv["qwen3.attention.value_length"] == 16

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(hf_dirs[arch] / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert kv["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    assert kv["tokenizer.ggml.token_type"] == [3, 3, 3] + [1] * (len(vocab) - 3)
    merges = json.loads((hf_dirs[arch] / "tokenizer.json").read_text())["model"]["merges"]
    assert kv["tokenizer.ggml.merges"] == [" ".join(m) for m in merges]
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"],
            kv["tokenizer.ggml.padding_token_id"]) == (0, 2, 0)
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert kv["tokenizer.chat_template"] == tm.CHAT_TEMPLATE


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_gguf_tensor_names_and_types(hf_dirs, tmp_path, arch):
    reader = gguf.GGUFReader(tm.write_gguf(hf_dirs[arch], tmp_path / "m.gguf", "Q4_0"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    want = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if arch == "qwen2" else set())
    for i in range(2):
        names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
        names += {"llama": [], "qwen2": ["attn_q.bias", "attn_k.bias", "attn_v.bias"],
                  "qwen3": ["attn_q_norm", "attn_k_norm"]}[arch]
        want |= {f"blk.{i}.{n}" if n.endswith(".bias") else f"blk.{i}.{n}.weight" for n in names}
    assert set(types) == want
    for t in reader.tensors:
        want_type = gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else gguf.GGMLQuantizationType.Q4_0
        assert t.tensor_type == want_type, t.name
    shapes = {t.name: t.shape.tolist() for t in reader.tensors}  # GGML order: [row length, rows]
    assert shapes["token_embd.weight"] == [64, 400]
    assert shapes["blk.0.attn_k.weight"] == [64, 32] and shapes["blk.0.ffn_down.weight"] == [128, 64]


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_llama_q_k_are_permuted_qwen_are_not(hf_dirs, tmp_path, arch):
    reader = gguf.GGUFReader(tm.write_gguf(hf_dirs[arch], tmp_path / "m.gguf", "F32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    hf = tm.reference_model(hf_dirs[arch]).state_dict()
    for proj, n_head in (("q", tm.N_HEADS), ("k", tm.N_KV_HEADS)):
        w = hf[f"model.layers.1.self_attn.{proj}_proj.weight"].numpy()
        got = stored[f"blk.1.attn_{proj}.weight"]
        if arch == "llama":
            assert not np.array_equal(got, w)
            assert np.array_equal(got, tm.permute_qk(w, n_head))
            assert np.array_equal(tm.unpermute_qk(got, n_head), w)
        else:
            assert np.array_equal(got, w)
    assert np.array_equal(stored["blk.1.attn_v.weight"], hf["model.layers.1.self_attn.v_proj.weight"].numpy())


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_reference_with_gguf_weights(hf_dirs, tmp_path, arch):
    plain = tm.reference_model(hf_dirs[arch])
    want = logits(plain)
    f32 = tm.reference_model(hf_dirs[arch], tm.write_gguf(hf_dirs[arch], tmp_path / "f32.gguf", "F32"))
    assert torch.equal(logits(f32), want)

    path = tm.write_gguf(hf_dirs[arch], tmp_path / "q4.gguf", "Q4_0")
    q4 = tm.reference_model(hf_dirs[arch], path)
    got = logits(q4)
    assert not torch.equal(got, want)
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.8
    # The reference holds exactly the dequantized file contents (llama q/k back in HF layout) ...
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    deq = tm.gguf_tensor_as_hf(reader, t, arch)
    q_proj = q4.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q_proj, deq)
    # ... which are the HF weights rounded to Q4_0, and norms stay exact.
    orig = plain.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert 0 < (q_proj - orig).abs().max() < 0.1
    assert torch.equal(q4.state_dict()["model.norm.weight"], plain.state_dict()["model.norm.weight"])


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_1", "Q5_0", "Q5_1"])
def test_other_qtypes(hf_dirs, tmp_path, qtype):
    path = tm.write_gguf(hf_dirs["llama"], tmp_path / "m.gguf", qtype)
    reader, kv = fields(path)
    assert kv["general.file_type"] == tm.QTYPES[qtype][1]
    assert {t.tensor_type.name for t in reader.tensors} == {qtype, "F32"}
    got = logits(tm.reference_model(hf_dirs["llama"], path))
    want = logits(tm.reference_model(hf_dirs["llama"]))
    assert not torch.equal(got, want)
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.8


def test_llama3_rope_freqs(tmp_path):
    hf = tm.make_hf_model("llama", tmp_path / "l3", rope_scaling=tm.LLAMA3_ROPE_SCALING)
    reader, kv = fields(tm.write_gguf(hf, tmp_path / "l3.gguf", "Q8_0"))
    assert not any(k.startswith("llama.rope.scaling") for k in kv)  # llama.cpp writes only the tensor
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    factors = torch.from_numpy(np.array(t.data))
    assert factors.shape == (tm.HEAD_DIM // 2,)
    assert factors[0] == 1 and factors[-1] == 8 and 1 < factors[-2] < 8  # all three llama3 regimes
    base = 1.0 / (tm.ROPE_THETA ** (torch.arange(0, tm.HEAD_DIM, 2, dtype=torch.float32) / tm.HEAD_DIM))
    inv_freq = tm.reference_model(hf).model.rotary_emb.inv_freq
    torch.testing.assert_close(base / factors, inv_freq, rtol=1e-6, atol=0)

    bad = dict(tm.LLAMA3_ROPE_SCALING, original_max_position_embeddings=64)
    hf_bad = tm.make_hf_model("llama", tmp_path / "bad", rope_scaling=bad)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        tm.write_gguf(hf_bad, tmp_path / "bad.gguf")


def test_untied_output_and_padded_vocab(tmp_path):
    hf = tm.make_hf_model("qwen2", tmp_path / "m", tie_word_embeddings=False, extra_vocab=16)
    path = tm.write_gguf(hf, tmp_path / "m.gguf", "Q8_0")
    reader, kv = fields(path)
    names = {t.name: t for t in reader.tensors}
    assert names["output.weight"].shape.tolist() == [64, 416]
    assert kv["tokenizer.ggml.tokens"][-16:] == [f"[PAD{i}]" for i in range(400, 416)]
    assert kv["tokenizer.ggml.token_type"][-16:] == [gguf.TokenType.UNUSED] * 16
    ref = tm.reference_model(hf, path)
    assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)
    assert logits(ref).shape[-1] == 416


def test_bad_arguments(tmp_path, hf_dirs):
    with pytest.raises(ValueError, match="unknown arch"):
        tm.make_hf_model("gpt2", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown qtype"):
        tm.write_gguf(hf_dirs["llama"], tmp_path / "x.gguf", "Q4_K")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_gguf_loader_agrees(hf_dirs, tmp_path, arch):
    """An independent reader of llama.cpp GGUFs (transformers' gguf_file loading, which undoes the llama
    q/k permutation itself) computes the same logits as reference_model with the file's weights.
    (Its qwen3 support ignores attention.key_length, and it ignores rope_freqs, so only these two.)"""
    from transformers import AutoModelForCausalLM

    path = tm.write_gguf(hf_dirs[arch], tmp_path / "m.gguf", "Q4_0")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    assert torch.equal(logits(theirs), logits(tm.reference_model(hf_dirs[arch], path)))
