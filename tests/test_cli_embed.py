"""`churon embed` (texts as arguments or one a line on stdin, JSON out), `churon inspect` of an encoder, and
`churon run` / `churon serve` refusing what an embedding model cannot do: run as a user would, a subprocess."""

import json
import subprocess
import sys

import pytest

from churon import LLM
from test_cli import churon

TEXTS = ["hello world", "the quick brown fox", "中文"]


@pytest.fixture(scope="module")
def embedder(tiny_bert_dir):
    return LLM(tiny_bert_dir, threads=1)


def embed(*args, stdin=None) -> dict:
    result = churon("embed", *args, "--threads", "1", stdin=stdin)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_embed_texts_given_as_arguments(tiny_bert_dir, embedder):
    out = embed(tiny_bert_dir, *TEXTS)
    assert out == {"model": str(tiny_bert_dir), "dimensions": embedder.embedding_dim, "embeddings": embedder.embed(TEXTS)}


def test_embed_reads_one_text_a_line_from_stdin(tiny_bert_dir, embedder):
    out = embed(tiny_bert_dir, stdin="".join(t + "\n" for t in TEXTS))
    assert out["embeddings"] == embedder.embed(TEXTS)


def test_embed_truncate_and_pooling(tiny_bert_dir, embedder):
    long = "hello " * embedder.max_embed_len
    refused = churon("embed", tiny_bert_dir, long, "--threads", "1")
    assert refused.returncode == 1 and f"more than the {embedder.max_embed_len}" in refused.stderr
    assert embed(tiny_bert_dir, long, "--truncate")["embeddings"] == embedder.embed(long, truncate=True)
    cls = LLM(tiny_bert_dir, threads=1, pooling="cls")
    assert embed(tiny_bert_dir, *TEXTS, "--pooling", "cls")["embeddings"] == cls.embed(TEXTS)


def test_embed_without_text_is_an_error(tiny_bert_dir):
    result = churon("embed", tiny_bert_dir)
    assert result.returncode == 1 and "no text" in result.stderr


def test_run_and_chat_on_an_embedding_model_name_its_task(tiny_bert_dir):
    for command in (["run", tiny_bert_dir, "hello"], ["chat", tiny_bert_dir]):
        result = churon(*command, "--threads", "1")
        assert result.returncode == 1
        assert "embedding model" in result.stderr and f"churon {command[0]}` needs a text-generation model" in result.stderr


def test_inspect_an_encoder(tiny_bert_dir):
    result = churon("inspect", tiny_bert_dir, "--tensors")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for line in ["architecture       bert (encoder: embeddings)", "layers             2", "hidden size        64",
                 "attention heads    4", "head dim           16", "context length     128", "token types        2",
                 "activation         gelu", "pooling            mean, normalized, max length 64",
                 "no KV cache", "encoder.layer.1.output.dense.weight"]:
        assert line in out, line
    assert "KV cache per token" not in out


def test_serve_refuses_pooling_for_a_model_loaded_to_generate():
    r = subprocess.run([sys.executable, "-m", "churon.cli", "serve", "x", "--task", "generate", "--pooling", "mean"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--pooling is for the model that embeds" in r.stderr
