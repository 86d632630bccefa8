"""LoRA adapter files (formats/lora.py): PEFT adapters read bitwise as saved and with PEFT's scaling, GGUF
adapters in llama.cpp's layout (convert_lora_to_gguf.py's, written here with gguf-py) read as the PEFT adapter
they came from, churon's own GGUF adapters in that layout and read back, llama.cpp loading one (slow), and
every malformed or mismatched adapter a ModelFileError naming the tensor or field."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from churon.errors import ModelFileError
from churon.formats.hf import HFModel
from churon.formats.lora import is_lora_adapter, read_lora, write_lora_gguf
from tiny_models import (
    N_HEADS,
    N_KV_HEADS,
    make_hf_model,
    make_peft_adapter,
    peft_model,
    permute_qk,
    unpermute_qk,
    write_gguf,
)

PREFIX = "base_model.model.model."
WEIGHTS = "adapter_model.safetensors"

# id -> (arch, make_peft_adapter arguments): ranks 1 / 4 / 8, rsLoRA, rank_pattern and alpha_pattern (a plain
# name and a regular expression, the first match winning as in PEFT), subsets of the targets
ADAPTERS = {
    "llama-r1": ("llama", dict(rank=1, alpha=2.0)),
    "llama-r4": ("llama", dict(rank=4, alpha=8.0)),
    "llama-rslora-patterns": ("llama", dict(rank=8, alpha=16.0, use_rslora=True,
                                            rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 4},
                                            alpha_pattern={"v_proj": 3.0, "layers.1.*_proj": 5.0})),
    "qwen2-r4-subset": ("qwen2", dict(rank=4, alpha=16.0, targets=("q_proj", "v_proj", "down_proj"))),
    "qwen3-r8-patterns": ("qwen3", dict(rank=8, alpha=8.0, targets=("k_proj", "o_proj", "gate_proj", "up_proj"),
                                        rank_pattern={"k_proj": 1, "gate_proj": 4}, alpha_pattern={"up_proj": 2.0})),
    "qwen3-rslora": ("qwen3", dict(rank=4, alpha=4.0, use_rslora=True)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """arch -> a tiny random model's HF directory, made on first use."""
    made = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_hf_model(arch, tmp_path_factory.mktemp(f"model-{arch}"))
        return made[arch]

    return get


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    """ADAPTERS id -> (model directory, the PEFT adapter directory), made on first use."""
    made = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            arch, kwargs = ADAPTERS[name]
            hf = model_dir(arch)
            made[name] = hf, make_peft_adapter(hf, tmp_path_factory.mktemp(f"adapter-{name}"), seed=7, **kwargs)
        return made[name]

    return get


def config_of(hf: Path):
    return HFModel(hf).config


def module_of(key: str) -> str:
    """layers.0.self_attn.q_proj of base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    return key.removeprefix(PREFIX).split(".lora_", 1)[0]


def peft_modules(hf: Path, ad: Path) -> dict[str, tuple[int, float]]:
    """canonical module -> (r, scaling) of every LoRA layer PEFT builds for the adapter."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, mod in peft_model(hf, ad).named_modules():
        if isinstance(mod, LoraLayer):
            out[name.removeprefix(PREFIX)] = (mod.r["default"], mod.scaling["default"])
    return out


def copy_adapter(ad: Path, out: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of a PEFT adapter with adapter_config.json fields replaced (None: removed) and its tensors
    rewritten by tensors(dict) -> dict."""
    shutil.copytree(ad, out)
    if config:
        cfg = json.loads((out / "adapter_config.json").read_text())
        for k, v in config.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors(load_file(out / WEIGHTS)), out / WEIGHTS)
    return out


# --- PEFT adapters


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_peft_adapter_reads_bitwise_with_peft_scaling(adapter_dir, name):
    hf, ad = adapter_dir(name)
    arch, kwargs = ADAPTERS[name]
    lora = read_lora(ad, config_of(hf), max_rank=8)
    saved = load_file(ad / WEIGHTS)
    assert set(lora.modules) == {module_of(k) for k in saved}
    for module, m in lora.modules.items():
        assert m.a.dtype == m.b.dtype == torch.float32
        assert torch.equal(m.a, saved[f"{PREFIX}{module}.lora_A.weight"])
        assert torch.equal(m.b, saved[f"{PREFIX}{module}.lora_B.weight"])
    # PEFT's own r and scaling for each module (rank_pattern / alpha_pattern resolved as PEFT does)
    assert {k: (m.rank, m.scale) for k, m in lora.modules.items()} == peft_modules(hf, ad)
    assert lora.kind == "peft" and lora.architecture == arch and lora.base_model == str(hf)
    assert lora.alpha == kwargs["alpha"] and lora.use_rslora == kwargs.get("use_rslora", False)
    assert lora.targets == tuple(sorted(kwargs.get("targets", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"))))
    assert lora.rank == max(m.rank for m in lora.modules.values())
    assert lora.nbytes == sum(4 * t.numel() for t in saved.values())


def test_keys_with_the_adapter_name_segment_read_alike(adapter_dir, tmp_path):
    hf, ad = adapter_dir("llama-r4")
    named = copy_adapter(ad, tmp_path / "named", tensors=lambda ts: {
        k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): v
        for k, v in ts.items()})
    plain, other = read_lora(ad, config_of(hf)), read_lora(named, config_of(hf))
    assert other.modules.keys() == plain.modules.keys()
    for module, m in plain.modules.items():
        assert torch.equal(other.modules[module].a, m.a) and torch.equal(other.modules[module].b, m.b)
        assert other.modules[module].scale == m.scale
    assert other.names("layers.0.self_attn.q_proj")[0] == f"{PREFIX}layers.0.self_attn.q_proj.lora_A.default.weight"


@pytest.mark.parametrize("targets", ["all-linear", r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj", ["self_attn.q_proj",
                                     "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "up_proj", "down_proj"]])
def test_target_modules_as_peft_matches_them(adapter_dir, tmp_path, targets):
    """PEFT's shorthand, a regular expression over the whole module path, names matched as the path's end."""
    hf, ad = adapter_dir("llama-r4")
    lora = read_lora(copy_adapter(ad, tmp_path / "a", config={"target_modules": targets}), config_of(hf))
    assert lora.modules.keys() == read_lora(ad).modules.keys()


def test_is_lora_adapter(adapter_dir, tmp_path):
    hf, ad = adapter_dir("llama-r4")
    model_gguf = write_gguf(hf, tmp_path / "model.gguf", "F32")
    adapter_gguf = write_lora_gguf(read_lora(ad, config_of(hf)), config_of(hf), tmp_path / "adapter.gguf")
    (tmp_path / "notes.txt").write_text("not a model")
    assert is_lora_adapter(ad) and is_lora_adapter(adapter_gguf)
    assert not any(is_lora_adapter(p) for p in (hf, model_gguf, tmp_path / "notes.txt", tmp_path / "missing"))


# --- GGUF adapters as llama.cpp's converter writes them

_GGUF_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def convert_lora_to_gguf(hf: Path, ad: Path, out: Path, qtype: str = "F32") -> Path:
    """What llama.cpp's convert_lora_to_gguf.py writes for a PEFT adapter: general.type adapter, adapter.type
    lora, adapter.lora.alpha = lora_alpha, NAME.lora_a / NAME.lora_b for each base tensor NAME, lora_b of llama
    attn_q / attn_k with its rows permuted as LlamaModel.permute does the weights', 2-D tensors in qtype (Q8_0
    falls back to F16 where a row is not whole blocks, as the converter's quantization does)."""
    cfg = json.loads((ad / "adapter_config.json").read_text())
    hp = json.loads((hf / "config.json").read_text())
    arch = hp["model_type"]
    names = gguf.get_tensor_name_map(_GGUF_ARCHS[arch], hp["num_hidden_layers"])
    w = gguf.GGUFWriter(out, arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    for key, t in load_file(ad / WEIGHTS).items():
        hf_name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight").replace(
            ".lora_B.weight", ".weight")
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        is_b = ".lora_B." in key
        heads = {"attn_q": N_HEADS, "attn_k": N_KV_HEADS}.get(name.split(".")[2])
        if arch == "llama" and is_b and heads:
            t = permute_qk(t, heads)
        data = t.numpy()
        kind = gguf.GGMLQuantizationType[qtype]
        if kind == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
            kind = gguf.GGMLQuantizationType.F16
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name + (".lora_b" if is_b else ".lora_a"), data)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name + (".lora_b" if is_b else ".lora_a"), data.astype(np.float16))
        else:
            w.add_tensor(name + (".lora_b" if is_b else ".lora_a"), gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file dequantized by gguf-py to float32 (a copy, not the file's map), torch order."""
    reader = gguf.GGUFReader(path)
    return {t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(reversed(t.shape.tolist()))) for t in reader.tensors}


@pytest.mark.parametrize(("name", "qtype"), [
    ("llama-r4", "F32"), ("qwen2-r4-subset", "F32"), ("qwen3-rslora", "F32"),
    ("llama-r4", "F16"), ("llama-r4", "BF16"), ("llama-r4", "Q8_0"),
])
def test_gguf_adapter_reads_as_the_peft_adapter(adapter_dir, tmp_path, name, qtype):
    hf, ad = adapter_dir(name)
    arch = ADAPTERS[name][0]
    config = config_of(hf)
    path = convert_lora_to_gguf(hf, ad, tmp_path / "a.gguf", qtype)
    lora, peft = read_lora(path, config), read_lora(ad, config)
    stored = gguf_tensors(path)
    assert lora.kind == "gguf" and lora.architecture == arch and lora.alpha == peft.alpha
    assert lora.modules.keys() == peft.modules.keys()
    for module, m in lora.modules.items():
        a_name, b_name = lora.names(module)
        heads = {"q_proj": N_HEADS, "k_proj": N_KV_HEADS}.get(module.rsplit(".", 1)[-1]) if arch == "llama" else None
        b = torch.from_numpy(stored[b_name])
        assert torch.equal(m.a, torch.from_numpy(stored[a_name]))
        assert torch.equal(m.b, unpermute_qk(b, heads) if heads else b)
        # llama.cpp's scaling: alpha / r (no rsLoRA in a GGUF adapter)
        assert m.scale == peft.alpha / m.rank
        if qtype == "F32":
            assert torch.equal(m.a, peft.modules[module].a) and torch.equal(m.b, peft.modules[module].b)
        else:  # each type's rounding: bf16 8 bits, f16 11, q8_0 ~8 bits of the block's largest value
            tol = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 8e-3}[qtype]
            torch.testing.assert_close(m.a, peft.modules[module].a, rtol=0, atol=tol * m.a.abs().max().item())
            torch.testing.assert_close(m.b, peft.modules[module].b, rtol=0, atol=tol * m.b.abs().max().item())


def test_llama_gguf_adapter_read_without_a_config_keeps_llama_cpp_rows(adapter_dir, tmp_path):
    hf, ad = adapter_dir("llama-r4")
    path = convert_lora_to_gguf(hf, ad, tmp_path / "a.gguf")
    stored, peft = gguf_tensors(path), read_lora(ad)
    lora = read_lora(path)  # inspect: no model to un-permute by
    q = lora.modules["layers.0.self_attn.q_proj"]
    assert torch.equal(q.b, torch.from_numpy(stored["blk.0.attn_q.weight.lora_b"]))
    assert torch.equal(q.b, permute_qk(peft.modules["layers.0.self_attn.q_proj"].b, N_HEADS))
    with pytest.raises(ModelFileError, match=r"a\.gguf: read without a model config, its attn_q / attn_k lora_b rows"):
        lora.check(config_of(hf))


# --- churon's GGUF adapters


@pytest.mark.parametrize("name", ["llama-r4", "qwen2-r4-subset", "qwen3-r8-patterns"])
def test_written_gguf_adapter_has_llama_cpp_layout_and_reads_back_exactly(adapter_dir, tmp_path, name):
    """One alpha fits every module (alpha / r == scale): it is written, and A and B as they are."""
    hf, ad = adapter_dir(name)
    arch = ADAPTERS[name][0]
    config = config_of(hf)
    peft = read_lora(ad, config)
    path = write_lora_gguf(peft, config, tmp_path / "a.gguf")
    reader = gguf.GGUFReader(path)
    fields = {k: reader.fields[k].contents() for k in
              ("general.architecture", "general.type", "adapter.type", "adapter.lora.alpha", "general.file_type")}
    alpha = peft.alpha  # no pattern changes alpha / r on these adapters' modules but for qwen3's up_proj
    if name == "qwen3-r8-patterns":
        alpha = 0.0  # up_proj's alpha 2 / r 8 and the others' 8 / r: no one alpha, scales folded into B
    assert fields == {"general.architecture": arch, "general.type": "adapter", "adapter.type": "lora",
                      "adapter.lora.alpha": alpha, "general.file_type": int(gguf.LlamaFileType.ALL_F32)}
    stored = gguf_tensors(path)
    assert len(stored) == 2 * len(peft.modules)
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    back = read_lora(path, config)
    for module, m in peft.modules.items():
        a_name, b_name = back.names(module)
        assert a_name.startswith("blk.") and a_name.endswith(".weight.lora_a") and b_name.endswith(".weight.lora_b")
        b = m.b if alpha else m.b * m.scale
        heads = {"q_proj": N_HEADS, "k_proj": N_KV_HEADS}.get(module.rsplit(".", 1)[-1]) if arch == "llama" else None
        assert np.array_equal(stored[a_name], m.a.numpy())
        assert np.array_equal(stored[b_name], (permute_qk(b, heads) if heads else b).numpy())
        r = back.modules[module]
        assert torch.equal(r.a, m.a) and torch.equal(r.b, b)
        assert r.scale == (m.scale if alpha else 1.0)


def test_written_gguf_adapter_folds_scales_one_alpha_cannot_give(adapter_dir, tmp_path):
    """rsLoRA with per-module ranks and alphas: llama.cpp's alpha / r cannot give every scale, so each is in B."""
    hf, ad = adapter_dir("llama-rslora-patterns")
    config = config_of(hf)
    peft = read_lora(ad, config)
    back = read_lora(write_lora_gguf(peft, config, tmp_path / "a.gguf"), config)
    assert back.alpha == 0.0
    for module, m in peft.modules.items():
        r = back.modules[module]
        assert r.scale == 1.0 and torch.equal(r.a, m.a) and torch.equal(r.b, m.b * m.scale)


def test_written_gguf_adapter_keeps_one_alpha_through_rslora(adapter_dir, tmp_path):
    """rsLoRA at one rank: alpha / sqrt(r) == (alpha * sqrt(r)) / r, one alpha llama.cpp scales by."""
    hf, ad = adapter_dir("qwen3-rslora")
    config = config_of(hf)
    peft = read_lora(ad, config)
    back = read_lora(write_lora_gguf(peft, config, tmp_path / "a.gguf"), config)
    assert back.alpha == 8.0  # 4 / sqrt(4) * 4
    assert all(back.modules[k].scale == m.scale and torch.equal(back.modules[k].b, m.b) for k, m in peft.modules.items())


def test_written_f16_gguf_adapter_reads_back_close(adapter_dir, tmp_path):
    hf, ad = adapter_dir("llama-r4")
    config = config_of(hf)
    peft = read_lora(ad, config)
    path = write_lora_gguf(peft, config, tmp_path / "a.gguf", "F16")
    assert {t.tensor_type for t in gguf.GGUFReader(path).tensors} == {gguf.GGMLQuantizationType.F16}
    back = read_lora(path, config)
    for module, m in peft.modules.items():
        r = back.modules[module]
        assert r.scale == m.scale
        # float16 rounding, nothing else
        assert torch.equal(r.b, m.b.half().float()) and torch.equal(r.a, m.a.half().float())


def test_write_refuses_what_float16_cannot_hold_and_leaves_the_old_file(adapter_dir, tmp_path):
    hf, ad = adapter_dir("llama-r4")
    lora = read_lora(ad, config_of(hf))
    q = lora.modules["layers.0.self_attn.q_proj"]
    lora.modules["layers.0.self_attn.q_proj"] = dataclasses.replace(q, b=q.b * 1e6)
    (tmp_path / "a.gguf").write_bytes(b"kept")
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_q\.weight\.lora_b' holds values float16 cannot"):
        write_lora_gguf(lora, config_of(hf), tmp_path / "a.gguf", "F16")
    assert (tmp_path / "a.gguf").read_bytes() == b"kept"


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_partial_one(adapter_dir, tmp_path, monkeypatch):
    hf, ad = adapter_dir("llama-r4")
    lora = read_lora(ad, config_of(hf))
    (tmp_path / "a.gguf").write_bytes(b"kept")

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_lora_gguf(lora, config_of(hf), tmp_path / "a.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == b"kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf"]


def test_read_lora_of_a_device_or_fifo_says_it_is_no_regular_file():
    with pytest.raises(ModelFileError, match=r"/dev/null: not a regular file"):
        read_lora("/dev/null")


def test_write_refuses_other_types(adapter_dir, tmp_path):
    hf, ad = adapter_dir("llama-r4")
    with pytest.raises(ValueError, match="F32 or F16, not 'Q4_0'"):
        write_lora_gguf(read_lora(ad), config_of(hf), tmp_path / "a.gguf", "Q4_0")
    assert not (tmp_path / "a.gguf").exists()


# --- bad adapters: ModelFileError naming the tensor or field


@pytest.mark.parametrize(("fields", "match"), [
    ({"use_dora": True}, r"use_dora = True: DoRA .* is not supported"),
    ({"lora_bias": True}, r"lora_bias = True: a bias on lora_B is not supported"),
    ({"bias": "all"}, r"bias = 'all': trained biases of the base model"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save = \['lm_head'\]"),
    ({"fan_in_fan_out": True}, r"fan_in_fan_out = True"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, r"target_parameters = "),
    ({"trainable_token_indices": [3, 4]}, r"trainable_token_indices = \[3, 4\]"),
    ({"alora_invocation_tokens": [5]}, r"alora_invocation_tokens = \[5\]: aLoRA"),
    ({"layer_replication": [[0, 2], [0, 2]]}, r"layer_replication = "),
    ({"init_lora_weights": "pissa_niter_4"}, r"init_lora_weights = 'pissa_niter_4' changed the base model's weights"),
    ({"peft_type": "IA3"}, r"peft_type = 'IA3': churon loads LoRA adapters"),
    ({"peft_type": None}, r"peft_type = None"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules names 'lm_head', which churon does not apply LoRA to"),
    ({"target_modules": ["c_attn"]}, r"target_modules names 'c_attn'"),
    ({"target_modules": ["q_proj", "v_proj"]},
     r"tensor 'base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_A\.weight' adapts"
     r" 'model\.layers\.0\.mlp\.down_proj', which target_modules in adapter_config\.json does not name"),
    ({"target_modules": "model\\.layers\\.\\d+\\.self_attn\\..*"}, r"adapts 'model\.layers\.0\.mlp\.down_proj'"),
    ({"r": 0}, r"adapter_config\.json: r = 0 must be at least 1"),
    ({"r": None}, r"adapter_config\.json: field 'r' is missing"),
    ({"lora_alpha": "16"}, r"lora_alpha = '16' is not a finite number"),
    ({"r": 8}, r"tensor 'base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_A\.weight' has shape \[4, 128\],"
               r" but adapter_config\.json gives layers\.0\.mlp\.down_proj rank 8"),
    ({"rank_pattern": {"layers.1.self_attn.q_proj": 2}},
     r"'base_model\.model\.model\.layers\.1\.self_attn\.q_proj\.lora_A\.weight' has shape \[4, 64\].* rank 2"),
    ({"rank_pattern": ["q_proj"]}, r"rank_pattern = \['q_proj'\] is not an object"),
    ({"alpha_pattern": {"q_proj": None}}, r"alpha_pattern\['q_proj'\] = None is not a finite number"),
    ({"rank_pattern": {"q_proj(": 2}}, r"rank_pattern: .* is not a regular expression"),
    ({"target_modules": "(q|k"}, r"target_modules: '\(q\|k' is not a regular expression"),
    # patterns that backtrack for ever on a module name (Python's re has no time limit): refused unmatched
    ({"target_modules": "(a+)+b"}, r"target_modules: '\(a\+\)\+b' repeats a repetition or alternatives"),
    ({"rank_pattern": {"(q|qq)*_proj": 2}}, r"rank_pattern: .* repeats a repetition or alternatives"),
    ({"alpha_pattern": {".*" * 6 + "x": 2}}, r"alpha_pattern: .* has more than 6 repetitions"),
    ({"target_modules": "q" * 1001}, r"target_modules: a pattern of 1001 characters \(at most 1000\)"),
    ({"auto_mapping": {"parent_library": "transformers.models.qwen2.modeling_qwen2"}},
     r"adapter_config\.json: the adapter is for architecture 'qwen2', the model is 'llama'"),
])
def test_bad_adapter_config(adapter_dir, tmp_path, fields, match):
    hf, ad = adapter_dir("llama-r4")
    bad = copy_adapter(ad, tmp_path / "bad", config=fields)
    with pytest.raises(ModelFileError, match=match):
        read_lora(bad, config_of(hf))


def _drop_b(ts):
    return {k: v for k, v in ts.items() if k != f"{PREFIX}layers.1.self_attn.v_proj.lora_B.weight"}


def _with(extra):
    return lambda ts: ts | extra


def _renamed(old, new):
    return lambda ts: {k.replace(old, new): v for k, v in ts.items()}


Q_A = f"{PREFIX}layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(("tensors", "match"), [
    (_drop_b, r"adapter_model\.safetensors: tensor 'base_model\.model\.model\.layers\.1\.self_attn\.v_proj"
              r"\.lora_A\.weight' has no lora_B beside it"),
    (_with({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(400, 4)}),
     r"tensor 'base_model\.model\.lm_head\.lora_A\.weight' adapts 'lm_head', which churon does not apply LoRA to"),
    (_renamed("layers.1.mlp.up_proj", "layers.5.mlp.up_proj"),
     r"tensor 'base_model\.model\.model\.layers\.5\.mlp\.up_proj\.lora_A\.weight' is for layer 5, but the model has"
     r" 2 layers"),
    (_renamed("self_attn.o_proj", "self_attn.out_proj"),
     r"adapts 'model\.layers\.0\.self_attn\.out_proj', which churon does not apply LoRA to"),
    (_with({f"{PREFIX}layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(64)}),
     r"tensor '.*q_proj\.lora_magnitude_vector' is DoRA's magnitude"),
    (_with({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 400)}),
     r"tensor '.*embed_tokens\.lora_embedding_A' adapts an embedding"),
    (_with({f"{PREFIX}layers.0.self_attn.q_proj.lora_B.bias": torch.zeros(64)}),
     r"tensor '.*q_proj\.lora_B\.bias' is a bias on lora_B"),
    (_with({"base_model.model.lm_head.weight": torch.zeros(400, 64)}),
     r"tensor 'base_model\.model\.lm_head\.weight' is not a LoRA tensor"),
    (_with({Q_A.replace("lora_A.weight", "lora_A.default.weight"): torch.zeros(4, 64)}),
     r"tensors of more than one adapter \(None, default\)"),
    (_with({Q_A: torch.zeros(4, 64, dtype=torch.int32)}), r"tensor '.*q_proj\.lora_A\.weight' has type I32"),
    (_with({Q_A: torch.zeros(4, 64, 1)}), r"tensor '.*q_proj\.lora_A\.weight' has shape \[4, 64, 1\]"),
    (_with({Q_A.replace("A.weight", "B.weight"): torch.zeros(64, 3)}),
     r"tensor '.*q_proj\.lora_B\.weight' has shape \[64, 3\] \(3 columns\), but '.*q_proj\.lora_A\.weight' has"
     r" \[4, 64\] \(rank 4\)"),
    (_with({Q_A.replace("A.weight", "B.weight"): torch.zeros(48, 4)}),
     r"tensor '.*q_proj\.lora_B\.weight' has shape \[48, 4\] \(48 output features\), but the model's"
     r" layers\.0\.self_attn\.q_proj gives 64 \(num_heads \* head_dim\)"),
])
def test_bad_adapter_tensors(adapter_dir, tmp_path, tensors, match):
    hf, ad = adapter_dir("llama-r4")
    bad = copy_adapter(ad, tmp_path / "bad", tensors=tensors)
    with pytest.raises(ModelFileError, match=match):
        read_lora(bad, config_of(hf))


def test_adapter_for_another_model(adapter_dir, model_dir, tmp_path):
    hf, ad = adapter_dir("llama-r4")
    config = config_of(hf)
    wider = dataclasses.replace(config, hidden_size=128)
    with pytest.raises(ModelFileError, match=r"tensor '.*layers\.0\.mlp\.down_proj\.lora_B\.weight' has shape \[64, 4\]"
                                             r" \(64 output features\), but the model's layers\.0\.mlp\.down_proj gives"
                                             r" 128 \(hidden_size\)"):
        read_lora(ad, wider)
    with pytest.raises(ModelFileError, match=r"adapter_config\.json: the adapter is for architecture 'llama', the model"
                                             r" is 'qwen2'"):
        read_lora(ad, config_of(model_dir("qwen2")))
    path = write_lora_gguf(read_lora(ad, config), config, tmp_path / "a.gguf")
    with pytest.raises(ModelFileError, match=r"a\.gguf: the adapter is for architecture 'llama', the model is 'qwen2'"):
        read_lora(path, config_of(model_dir("qwen2")))
    with pytest.raises(ModelFileError, match=r"a\.gguf: tensor 'blk\.0\.attn_q\.weight\.lora_a' has shape \[4, 64\]"
                                             r" \(64 input features\), but the model's layers\.0\.self_attn\.q_proj takes"
                                             r" 128 \(hidden_size\)"):
        read_lora(path, wider)
    # an adapter already read, checked against another model
    with pytest.raises(ModelFileError, match=r"hidden_size"):
        read_lora(ad).check(wider)


def test_rank_beyond_the_maximum(adapter_dir, tmp_path):
    hf, ad = adapter_dir("llama-r4")
    config = config_of(hf)
    with pytest.raises(ModelFileError, match=r"tensor '.*lora_A\.weight' has rank 4, more than the maximum rank 2"):
        read_lora(ad, config, max_rank=2)
    path = write_lora_gguf(read_lora(ad, config), config, tmp_path / "a.gguf")
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.0\.\w+\.weight\.lora_a' has rank 4, more than the maximum"):
        read_lora(path, config, max_rank=3)
    with pytest.raises(ModelFileError, match=r"rank 4, more than the maximum rank 1"):
        read_lora(ad).check(config, max_rank=1)


def test_pickled_or_missing_weights(adapter_dir, tmp_path):
    _, ad = adapter_dir("llama-r4")
    bad = copy_adapter(ad, tmp_path / "bad")
    (bad / WEIGHTS).rename(bad / "adapter_model.bin")
    with pytest.raises(ModelFileError, match=r"adapter_model\.bin: a pickle, which churon does not load .* re-save the"
                                             r" adapter as safetensors"):
        read_lora(bad)
    (bad / "adapter_model.bin").unlink()
    with pytest.raises(ModelFileError, match=r"adapter_model\.safetensors: no such file"):
        read_lora(bad)
    (bad / "adapter_config.json").unlink()
    with pytest.raises(ModelFileError, match=r"bad: not a LoRA adapter: no adapter_config\.json"):
        read_lora(bad)
    with pytest.raises(ModelFileError, match=r"missing: no such file or directory"):
        read_lora(tmp_path / "missing")


def _safetensors(header: dict, data: bytes = b"", length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


@pytest.mark.parametrize("content", [
    pytest.param(lambda good: good[: len(good) // 2], id="truncated"),
    pytest.param(lambda good: good[:6], id="shorter-than-its-length"),
    pytest.param(lambda good: _safetensors({Q_A: {"dtype": "F32", "shape": [1 << 20, 1 << 20],
                                                  "data_offsets": [0, 1024]}}, bytes(1024)), id="shape-beyond-data"),
    pytest.param(lambda good: _safetensors({Q_A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1 << 40]}},
                                           bytes(1024)), id="offsets-beyond-file"),
    pytest.param(lambda good: _safetensors({}, length=1 << 60), id="header-length-beyond-file"),
    pytest.param(lambda good: b"\x00" * 64, id="zeros"),
])
def test_hostile_safetensors(adapter_dir, tmp_path, content):
    hf, ad = adapter_dir("llama-r4")
    bad = copy_adapter(ad, tmp_path / "bad")
    (bad / WEIGHTS).write_bytes(content((ad / WEIGHTS).read_bytes()))
    with pytest.raises(ModelFileError, match=r"bad/adapter_model\.safetensors: "):
        read_lora(bad, config_of(hf))


def _gguf_adapter(path: Path, tensors: dict[str, np.ndarray], **fields) -> Path:
    """A GGUF adapter file with the given metadata fields (None: left out) and float32 tensors."""
    w = gguf.GGUFWriter(path, fields.pop("arch", "llama"))
    meta = {"general.type": "adapter", "adapter.type": "lora"} | fields
    for key, value in meta.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif value is not None:
            w.add_float32(key, value)
    if "adapter.lora.alpha" not in meta:
        w.add_float32("adapter.lora.alpha", 8.0)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


A64, B64 = np.zeros((4, 64), np.float32), np.zeros((64, 4), np.float32)


@pytest.mark.parametrize(("tensors", "fields", "match"), [
    ({"blk.0.attn_q.weight.lora_a": A64}, {}, r"tensor 'blk\.0\.attn_q\.weight\.lora_a' has no lora_b beside it"),
    ({"token_embd.weight.lora_a": A64, "token_embd.weight.lora_b": B64}, {},
     r"tensor 'token_embd\.weight\.lora_a' adapts 'token_embd\.weight', which churon does not apply LoRA to"),
    ({"blk.0.attn_q.bias.lora_a": A64}, {}, r"tensor 'blk\.0\.attn_q\.bias\.lora_a' adapts 'blk\.0\.attn_q\.bias'"),
    ({"blk.0.attn_q.weight.lora_c": A64}, {}, r"tensor 'blk\.0\.attn_q\.weight\.lora_c' is not a LoRA tensor"),
    ({"blk.9.attn_q.weight.lora_a": A64, "blk.9.attn_q.weight.lora_b": B64}, {},
     r"tensor 'blk\.9\.attn_q\.weight\.lora_a' is for layer 9, but the model has 2 layers"),
    ({}, {}, r"a\.gguf: no LoRA tensors"),
    ({"blk.0.attn_q.weight.lora_a": A64}, {"general.type": "model"},
     r"a\.gguf: general\.type = 'model': not a LoRA adapter"),
    ({"blk.0.attn_q.weight.lora_a": A64}, {"general.type": None}, r"general\.type = None: not a LoRA adapter"),
    ({"blk.0.attn_q.weight.lora_a": A64}, {"adapter.type": "control_vector"},
     r"adapter\.type = 'control_vector': not a LoRA adapter"),
    ({"blk.0.attn_q.weight.lora_a": A64}, {"adapter.lora.alpha": float("nan")},
     r"adapter\.lora\.alpha = nan is not a finite number"),
    ({"blk.0.attn_q.weight.lora_a": A64}, {"adapter.alora.invocation_tokens": [1, 2]}, r"aLoRA .* is not supported"),
])
def test_bad_gguf_adapter(model_dir, tmp_path, tensors, fields, match):
    path = _gguf_adapter(tmp_path / "a.gguf", tensors, **fields)
    with pytest.raises(ModelFileError, match=match):
        read_lora(path, config_of(model_dir("llama")))


def test_model_gguf_is_not_an_adapter(model_dir, tmp_path):
    path = write_gguf(model_dir("llama"), tmp_path / "model.gguf", "Q8_0")
    with pytest.raises(ModelFileError, match=r"model\.gguf: general\.type = 'model': not a LoRA adapter"):
        read_lora(path)


def test_gguf_adapter_declaring_huge_shapes(model_dir, tmp_path):
    """A tensor index claiming more bytes than the file has ends at the index, before anything is allocated."""
    path = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_tensor_info("blk.0.attn_q.weight.lora_a", (1 << 31, 64), np.dtype(np.float32), (1 << 31) * 64 * 4)
    w.add_tensor_info("blk.0.attn_q.weight.lora_b", (64, 1 << 31), np.dtype(np.float32), (1 << 31) * 64 * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"a\.gguf: truncated: tensor 'blk\.0\.attn_q\.weight\.lora_a' needs bytes"):
        read_lora(path, config_of(model_dir("llama")))


def test_gguf_adapter_norms_are_skipped_as_llama_cpp_does(model_dir, tmp_path):
    """mergekit-extract-lora writes norm weights into adapters; llama.cpp leaves them out, and so does churon."""
    path = _gguf_adapter(tmp_path / "a.gguf", {"blk.0.attn_norm.weight": np.ones(64, np.float32),
                                               "blk.0.attn_v.weight.lora_a": A64 + 1,
                                               "blk.0.attn_v.weight.lora_b": np.ones((32, 4), np.float32)},
                         **{"adapter.lora.alpha": 0.0})
    lora = read_lora(path, config_of(model_dir("llama")))
    assert list(lora.modules) == ["layers.0.self_attn.v_proj"]
    assert lora.modules["layers.0.self_attn.v_proj"].scale == 1.0  # alpha 0: llama.cpp's "no scaling"


# --- llama.cpp loads churon's adapter


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-rslora-patterns", "qwen2-r4-subset", "qwen3-r8-patterns"])
def test_llama_cpp_applies_churon_adapter_as_peft_does(adapter_dir, tmp_path, name):
    """llama.cpp with an F32 model, an F32 KV cache and churon's F32 adapter computes in float32 on the CPU as
    PEFT (float32, eager) does: the logits agree to ~1e-6 of their largest magnitude; 1e-5 allows for the
    different summation orders. (llama.cpp's default F16 KV cache alone moves them ~2e-3.) The adapters move
    the logits by about their own size, so a wrong row order, scale or missing module fails by far."""
    llama_cpp = pytest.importorskip("llama_cpp")
    hf, ad = adapter_dir(name)
    config = config_of(hf)
    model = write_gguf(hf, tmp_path / "model.gguf", "F32")
    adapter = write_lora_gguf(read_lora(ad, config), config, tmp_path / "adapter.gguf")
    tokens = [5, 17, 100, 33, 250, 7, 9, 300, 42, 128]
    with torch.no_grad():
        want = peft_model(hf, ad, model)(torch.tensor([tokens])).logits[0].double()
    f32 = int(gguf.GGMLQuantizationType.F32)
    llm = llama_cpp.Llama(model_path=str(model), lora_path=str(adapter), logits_all=True, n_ctx=64, n_threads=2,
                          type_k=f32, type_v=f32, verbose=False)
    llm.eval(tokens)
    got = torch.tensor(np.array(llm.scores[: len(tokens)])).double()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize(("value", "dtype"), [(float("nan"), torch.float32), (1e300, torch.float64)])
def test_non_finite_adapter_tensors_are_refused_naming_the_tensor(adapter_dir, tmp_path, value, dtype):
    """A diverged fine-tune's NaN (or an F64 value beyond float32) is the file's error, not NaN logits later."""
    hf, ad = adapter_dir("llama-r4")

    def poison(ts):
        v = ts[Q_A].to(dtype)
        v[1, 2] = value
        return ts | {Q_A: v}

    bad = copy_adapter(ad, tmp_path / "bad", tensors=poison)
    with pytest.raises(ModelFileError, match=rf"adapter_model\.safetensors: tensor '{Q_A}' holds NaN or infinite"):
        read_lora(bad, config_of(hf))


def test_a_gguf_adapter_with_an_infinity_is_refused_naming_the_tensor(adapter_dir, tmp_path):
    hf, ad = adapter_dir("llama-r4")
    lora = read_lora(ad, config_of(hf))
    name = "layers.1.mlp.down_proj"
    b = lora.modules[name].b.clone()
    b[0, 0] = float("inf")
    modules = lora.modules | {name: dataclasses.replace(lora.modules[name], b=b)}
    path = write_lora_gguf(dataclasses.replace(lora, modules=modules), config_of(hf), tmp_path / "a.gguf")
    with pytest.raises(ModelFileError, match=r"a\.gguf: tensor 'blk\.1\.ffn_down\.weight\.lora_b' holds NaN or infinite"):
        read_lora(path, config_of(hf))
