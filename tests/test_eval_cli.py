"""`churon eval perplexity|compare` on tiny models: the figures churon.evaluation computes, as a table and JSON."""

import json

import pytest

from churon.cli import main
from churon.evaluation import compare, perplexity, text_windows
from churon.loader import load_model
from tiny_models import TRAINING_TEXT

CTX = 32


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TRAINING_TEXT, encoding="utf-8")
    return path


def windows_of(model_path, text_file):
    model, tokenizer, _ = load_model(model_path, kernels="reference")
    tokens = tokenizer.encode(text_file.read_text(encoding="utf-8"), add_bos=False)
    return model, text_windows(tokens, CTX, bos_id=tokenizer.bos_id if tokenizer.add_bos else None)


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_perplexity_is_churon_evaluations(capsys, tmp_path, tiny_llama_dir, text_file):
    out_json = tmp_path / "ppl.json"
    code, out, _ = run(capsys, "eval", "perplexity", tiny_llama_dir, "--text", text_file, "--ctx", CTX,
                       "--kernels", "reference", "--json", out_json, "-q")
    assert code == 0
    model, windows = windows_of(tiny_llama_dir, text_file)
    expected = perplexity(model, windows)
    record = json.loads(out_json.read_text())
    assert record["perplexity"] == pytest.approx(expected, rel=1e-9)
    assert record["windows"] == len(windows) > 1
    assert record["n_tokens"] == len(windows) * (CTX - 1 - CTX // 2)
    assert f"{expected:.4f}" in out


def test_compare_with_itself_is_zero_kl_and_full_agreement(capsys, tmp_path, tiny_llama_q8, text_file):
    out_json = tmp_path / "cmp.json"
    code, out, _ = run(capsys, "eval", "compare", tiny_llama_q8, tiny_llama_q8, "--text", text_file, "--ctx", CTX,
                       "--json", out_json, "-q")
    assert code == 0
    r = json.loads(out_json.read_text())
    assert r["mean_kl"] == pytest.approx(0.0, abs=1e-12) and r["p99_kl"] == pytest.approx(0.0, abs=1e-12)
    assert r["top1_agreement"] == 1.0
    assert r["ppl_test"] == r["ppl_ref"]
    assert "100.00%" in out


def test_compare_reports_what_evaluation_compare_computes(capsys, tmp_path, tiny_llama_dir, tiny_llama_q8, text_file):
    out_json = tmp_path / "cmp.json"
    code, out, _ = run(capsys, "eval", "compare", tiny_llama_q8, tiny_llama_dir, "--text", text_file, "--ctx", CTX,
                       "--kernels", "reference", "--json", out_json, "-q")
    assert code == 0
    ref, windows = windows_of(tiny_llama_dir, text_file)
    test, _ = windows_of(tiny_llama_q8, text_file)
    expected = compare(ref, test, windows)
    r = json.loads(out_json.read_text())
    assert r["reference"] == str(tiny_llama_dir) and r["model"] == str(tiny_llama_q8)
    for key in ("mean_kl", "p99_kl", "top1_agreement", "ppl_test", "ppl_ref"):
        assert r[key] == pytest.approx(getattr(expected, key), rel=1e-9, abs=1e-15), key
    assert 0 < r["mean_kl"] < 0.1 and r["n_tokens"] == expected.n_tokens
    assert f"{expected.mean_kl:.6f}" in out and f"{expected.ppl_ref:.4f}" in out


def test_bad_arguments_are_clear_errors(capsys, tmp_path, tiny_llama_dir, text_file):
    code, _, err = run(capsys, "eval", "perplexity", tiny_llama_dir, "--text", tmp_path / "missing.txt")
    assert code == 1 and "missing.txt" in err and "cannot read the text" in err
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model at all")
    code, _, err = run(capsys, "eval", "compare", garbage, tiny_llama_dir, "--text", text_file)
    assert code == 1 and "garbage.gguf" in err and "not a GGUF file" in err
    code, _, err = run(capsys, "eval", "perplexity", tiny_llama_dir, "--text", text_file, "--ctx", 100000)
    assert code == 1 and "fewer than one window of --ctx 100000" in err
    code, _, err = run(capsys, "eval", "perplexity", tiny_llama_dir, "--text", text_file, "--ctx", 1)
    assert code == 1 and "--ctx 1" in err
    with pytest.raises(SystemExit):  # argparse: --text is required
        main(["eval", "compare", str(tiny_llama_dir), str(tiny_llama_dir)])
