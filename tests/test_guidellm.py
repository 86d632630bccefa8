"""GuideLLM (guidellm) benchmarking `churon serve` with its defaults: streamed chat completions that ask for
vLLM's `stream_options.continuous_usage_stats`, counted from the usage chunks the server sends.

A server that refuses any of its fields gets a 400 on every request, and GuideLLM still exits 0 with a
table of zeros: the run is checked from its JSON report, request by request. GuideLLM needs a Hugging Face
tokenizer to build its synthetic prompts; the tiny model's own directory is one, offline.
"""

import json
import os
import subprocess
import sys

import pytest

from churon import LLM
from test_server import MODEL, start_server, stop_server
from tiny_models import make_hf_model, write_gguf

REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 5, 32, 16


@pytest.mark.slow
def test_guidellm_default_streaming_benchmark_completes(tmp_path):
    hf = make_hf_model("qwen2", tmp_path / "hf")
    gguf = write_gguf(hf, tmp_path / "m.gguf", "Q8_0")
    report = tmp_path / "benchmarks.json"
    proc, url = start_server(gguf)
    try:
        cmd = [
            sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={url},model={MODEL}",
            "--profile", "kind=synchronous",
            "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--tokenizer", f"kind=huggingface_auto,model={hf}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive",
        ]
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        stop_server(proc)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    [benchmark] = json.loads(report.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    assert metrics["time_to_first_token_ms"]["successful"]["min"] > 0
    llm = LLM(gguf, threads=1)
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        # the counts GuideLLM reports are the server's usage: the chat template's tokens, the max_tokens it asked for
        [message] = body["messages"]
        text = "".join(part["text"] for part in message["content"])
        assert request["input_metrics"]["text_tokens"] == len(llm.chat_prompt_ids([{"role": "user", "content": text}]))
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
