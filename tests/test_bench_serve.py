"""`churon bench serve`: the load generator against a tiny churon server; its statistics; its bad input."""

import asyncio
import json
import subprocess
import sys

import pytest

from churon.bench import percentile, run_level, synthetic_prompts
from churon.cli import main
from test_server import gguf, start_server, stop_server  # noqa: F401  (gguf is a fixture)


@pytest.fixture(scope="module")
def server(gguf):  # noqa: F811
    proc, url = start_server(gguf)
    yield url
    stop_server(proc)


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "churon.cli", "bench", "serve", *args], capture_output=True, text=True, timeout=300)


def test_bench_serve_counts_every_request_and_token(server, tmp_path):
    out = tmp_path / "r.json"
    r = bench("--url", server, "--concurrency", "1,3", "--num-requests", "2,5", "--prompt-len", "12", "--output-len", "6",
              "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "output tok/s" in r.stdout and "TTFT p95 ms" in r.stdout
    data = json.loads(out.read_text())
    assert data["settings"]["prompt_len"] == 12 and data["settings"]["output_len"] == 6
    levels = data["results"]
    assert [x["concurrency"] for x in levels] == [1, 3] and [x["num_requests"] for x in levels] == [2, 5]
    for x in levels:
        assert x["completed"] == x["num_requests"] and x["failed"] == 0 and x["first_error"] is None
        assert x["output_tokens"] == 6 * x["num_requests"]  # ignore_eos honoured, counted from usage
        assert x["short_outputs"] == 0
        assert x["output_tokens_per_s"] == pytest.approx(x["output_tokens"] / x["duration_s"])
        assert x["requests_per_s"] == pytest.approx(x["completed"] / x["duration_s"])
        assert 0 < x["ttft_p50_ms"] <= x["ttft_p95_ms"] and 0 < x["itl_p50_ms"] <= x["itl_p95_ms"]
        assert x["mean_prompt_tokens"] >= 12  # one or more tokens per word


def test_failed_requests_are_counted_and_reported(server):
    result = asyncio.run(run_level(server, "not-served", synthetic_prompts(3, 4), 2, concurrency=2))
    assert (result.num_requests, result.completed, result.failed) == (3, 0, 3)
    assert result.output_tokens == 0 and "HTTP 404" in result.first_error and "not-served" in result.first_error
    # the command stops at its warm-up request rather than run a benchmark of failures
    r = bench("--url", server, "--model", "not-served", "--concurrency", "2", "--num-requests", "3", "--prompt-len", "4",
              "--output-len", "2")
    assert r.returncode == 1 and "warm-up request" in r.stderr and "HTTP 404" in r.stderr


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == pytest.approx(4.8)  # numpy.percentile's linear method
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile([], 95) == 0.0


def test_synthetic_prompts_differ_and_repeat_by_seed():
    prompts = synthetic_prompts(20, 30, seed=3)
    assert len(set(prompts)) == 20 and all(len(p.split()) == 30 for p in prompts)
    assert synthetic_prompts(20, 30, seed=3) == prompts and synthetic_prompts(20, 30, seed=4) != prompts


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "0"], "concurrency must be >= 1"),
    (["--concurrency", "1,x"], "not a comma-separated list of integers"),
    (["--concurrency", "1,2", "--num-requests", "1,2,3"], "3 request counts for 2 concurrency levels"),
    (["--output-len", "0"], "output_len must be >= 1"),
    (["--extra-body", "{oops"], "--extra-body is not valid JSON"),
    (["--url", "http://127.0.0.1:9", "--model", "m"], "cannot reach http://127.0.0.1:9"),
])
def test_bad_arguments_get_a_clear_error(args, message, capsys):
    try:
        code = main(["bench", "serve", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code != 0 and message in capsys.readouterr().err


def test_plot_without_matplotlib_says_so_before_running(capsys):
    try:
        import matplotlib  # noqa: F401

        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--plot", "x.png"]) == 1
    assert "--plot needs matplotlib" in capsys.readouterr().err
