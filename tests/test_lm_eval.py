"""lm-eval-harness (lm_eval) against `churon serve`, as its users run it: the `local-completions` model with
the server's own tokenizer (`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize), on a
local multiple-choice task and a loglikelihood_rolling (perplexity) task.

Its loglikelihood requests send `echo: true, max_tokens: 1, logprobs: 1` and drop the last logprobs
entry as the generated token's. The scores must equal what the same loglikelihoods give computed here by
LLM with prompt_logprobs: exactly, since the server runs the same kernels and a token's logits do not depend
on its batch. The questions are chosen so that the generated token is often end-of-generation, the case
that silently shifted lm-eval's sums by one prompt token when churon left a stop token out of the logprobs.
"""

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from churon import LLM, SamplingParams
from test_server import MODEL, start_server, stop_server

DATA = Path(__file__).parent / "data"
MC_DATA, TEXT_DATA = DATA / "lm_eval_mc.jsonl", DATA / "lm_eval_text.jsonl"


def write_tasks(directory: Path) -> None:
    """The two tasks as lm-eval yaml files over the local jsonl files (datasets' `json` loader: no hub)."""
    mc = {
        "task": "churon_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(MC_DATA)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    rolling = {
        "task": "churon_rolling",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(TEXT_DATA)}},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}],
    }
    for config in (mc, rolling):
        (directory / f"{config['task']}.yaml").write_text(yaml.safe_dump(config))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def loglikelihoods(llm: LLM, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, int]]:
    """(sum of the continuation's prompt logprobs, the greedy next token) of each (context, continuation)."""
    outs = llm.generate([c + x for c, x in pairs], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    return [(sum(e.logprob for e in o.prompt_logprobs[len(c):]), o.token_ids[0]) for (c, _), o in zip(pairs, outs)]


@pytest.mark.slow
def test_lm_eval_scores_equal_the_engines_loglikelihoods(smollm2_gguf, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    proc, url = start_server(smollm2_gguf, "--threads", "2")
    try:
        model_args = {"base_url": f"{url}/v1/completions", "model": MODEL, "tokenizer_backend": "remote", "max_retries": 1}
        results = lm_eval.simple_evaluate(
            model="local-completions", model_args=model_args, tasks=["churon_mc", "churon_rolling"],
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), batch_size=4,
            log_samples=True, bootstrap_iters=0,
        )
    finally:
        stop_server(proc)

    llm = LLM(smollm2_gguf, threads=2)
    tokenizer = llm.tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=False)

    # multiple choice: lm-eval's pairs (context, " " + choice), split where the context's tokens end
    docs = read_jsonl(MC_DATA)
    pairs = []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        for choice in doc["choices"]:
            whole, context_ids = encode(f"{context} {choice}"), encode(context)
            pairs.append((context_ids, whole[len(context_ids):]))
    reference = loglikelihoods(llm, pairs)
    stops = [next_token in tokenizer.eog_ids for _, next_token in reference]
    assert any(stops), "no generated end-of-generation token: the case this test is for never occurs"
    samples = sorted(results["samples"]["churon_mc"], key=lambda s: s["doc_id"])
    got = [resp[0][0] for s in samples for resp in s["resps"]]
    assert got == [ll for ll, _ in reference]
    correct = []
    for i, doc in enumerate(docs):
        lls = [ll for ll, _ in reference[4 * i : 4 * i + 4]]
        correct.append(float(lls.index(max(lls)) == doc["answer"]))
    assert results["results"]["churon_mc"]["acc,none"] == sum(correct) / len(correct)

    # perplexity: each text is one window, scored after lm-eval's prefix token (the remote tokenizer's BOS)
    texts = [doc["text"] for doc in read_jsonl(TEXT_DATA)]
    reference = [ll for ll, _ in loglikelihoods(llm, [([tokenizer.bos_id], encode(t)) for t in texts])]
    samples = sorted(results["samples"]["churon_rolling"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == reference
    words = sum(len(re.split(r"\s+", t)) for t in texts)
    num_bytes = sum(len(t.encode()) for t in texts)
    scores = results["results"]["churon_rolling"]
    assert scores["word_perplexity,none"] == math.exp(-sum(reference) / words)
    assert scores["byte_perplexity,none"] == math.exp(-sum(reference) / num_bytes)
    assert scores["bits_per_byte,none"] == -sum(reference) / num_bytes / math.log(2)
