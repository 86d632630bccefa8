"""`churon serve` against hostile and careless clients: bounded work per request, 400s for client mistakes,
keep-alive kept after errors, read deadlines and the connection limit, the graceful SIGTERM, the API key
off the command line, and aborts counted for requests that never started. Real server processes on tiny
random models, driven over raw sockets, httpx and the official clients.
"""

import asyncio
import json
import math
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx2 as httpx
import openai
import pytest

from churon import LLM, SamplingParams
from churon.server import create_app
from churon.server.serve import make_server
from test_server import MODEL, free_port, loaded_client, metrics, start_server, stop_server, wait_for
from tiny_models import CHAT_TEMPLATE, make_hf_model, write_gguf

MESSAGES = [{"role": "user", "content": "hello there"}]
# forces a long answer out of a model that would soon say its EOS: llguidance keeps the string open
LONG_JSON = {"type": "object", "properties": {"t": {"type": "string", "minLength": 4000}}, "required": ["t"]}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """A context of 8192 tokens: streams long enough to be running when the server is told to stop."""
    hf = make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"), max_positions=8192)
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / "m.gguf", "Q8_0")


LIMIT_FLAGS = ("--max-choices", "8", "--max-prompt-tokens", "64", "--max-logit-bias", "4", "--max-stop", "2",
               "--max-logprobs", "3", "--header-timeout", "1", "--body-timeout", "1.5")


@pytest.fixture(scope="module")
def server(gguf):
    proc, url = start_server(gguf, *LIMIT_FLAGS)
    yield url
    stop_server(proc)


# --- bounded work per request ------------------------------------------------------------------

AMPLIFIED = [
    ("n x prompts", "/v1/completions", {"prompt": [[1]] * 2000, "n": 128}, "n", "--max-choices"),
    ("n alone", "/v1/chat/completions", {"messages": MESSAGES, "n": 9}, "n", "--max-choices"),
    ("prompt tokens over the choices", "/v1/completions", {"prompt": [[5] * 20] * 2, "n": 2}, "prompt",
     "--max-prompt-tokens"),
    ("chat prompt tokens times n", "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 12}], "n": 8},
     "messages", "--max-prompt-tokens"),
    ("logit_bias entries", "/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(5)}},
     "logit_bias", "--max-logit-bias"),
    ("stop strings", "/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop", "--max-stop"),
    ("chat top_logprobs", "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 4},
     "top_logprobs", "--max-logprobs"),
    ("completion logprobs", "/v1/completions", {"prompt": "hi", "logprobs": 4}, "logprobs", "--max-logprobs"),
]


@pytest.mark.parametrize("name,path,body,param,flag", AMPLIFIED, ids=[a[0] for a in AMPLIFIED])
def test_amplified_work_is_a_400_naming_the_limit_and_its_flag(server, name, path, body, param, flag):
    r = httpx.post(f"{server}{path}", json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and flag in error["message"], error


def test_anthropic_stop_sequences_limit_is_its_own_error(server):
    r = httpx.post(f"{server}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": MESSAGES,
                                                  "stop_sequences": ["a", "b", "c"]}, timeout=30)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "stop_sequences" in body["error"]["message"] and "--max-stop" in body["error"]["message"]


def test_anthropic_prompt_tokens_limit_is_its_own_error(server):
    r = httpx.post(f"{server}/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "ab " * 40}]}, timeout=30)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages: ") and "--max-prompt-tokens" in body["error"]["message"]


def test_within_the_limits_is_served(server):
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": [[5] * 4] * 4, "n": 2, "max_tokens": 2,
                                                     "logprobs": 3, "stop": ["x", "y"], "logit_bias": {"7": 1}},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8


def test_the_default_queue_limit_is_the_kv_caches_blocks(gguf):
    """Without --max-queue, as many requests may wait for their first token as the KV cache has blocks."""
    llm = LLM(gguf, threads=1, kv_cache_memory=1 << 18, max_num_seqs=2)
    blocks = llm.engine.block_manager.num_blocks
    app = create_app(lambda: llm, MODEL)

    async def main():
        async with loaded_client(app) as http:
            over = await http.post("/v1/completions", json={"prompt": "hi", "n": blocks + 1, "max_tokens": 1})
            within = await http.post("/v1/completions", json={"prompt": "hi", "n": blocks, "max_tokens": 1})
            return over, within

    over, within = asyncio.run(main())
    assert app.state.server.admission.max_queue == blocks
    assert over.status_code == 503 and over.json()["error"]["code"] == "queue_full"
    assert within.status_code == 200 and len(within.json()["choices"]) == blocks


# --- client mistakes are 400s ------------------------------------------------------------------

MISTAKES = [
    ("superscript digit as a logit_bias key", "/v1/completions", b'{"prompt": "hi", "logit_bias": {"\\u00b2": 1}}',
     "logit_bias"),
    ("Arabic-Indic digits as a logit_bias key", "/v1/completions", '{"prompt": "hi", "logit_bias": {"١٢": 1}}'.encode(),
     "logit_bias"),
    ("seed of 2**63", "/v1/completions", b'{"prompt": "hi", "seed": 9223372036854775808}', "seed"),
    ("seed of 2**64", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}', "seed"),
    ("lone surrogate in a prompt", "/v1/completions", b'{"prompt": "hi \\ud800 there"}', "prompt"),
    ("lone surrogate in a prompt list", "/v1/completions", b'{"prompt": ["ok", "hi \\udfff"]}', "prompt"),
    ("lone surrogate in a message", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("lone surrogate in a text part", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}', "messages.0.content.0.text"),
    ("lone surrogate in a stop string", "/v1/completions", b'{"prompt": "hi", "stop": "\\ud800"}', "stop"),
    ("lone surrogate to /tokenize", "/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("lone surrogate in a Responses input", "/v1/responses", b'{"input": "hi \\ud800"}', "input"),
]


@pytest.mark.parametrize("name,path,raw,param", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_client_mistakes_are_400s_naming_the_field(server, name, path, raw, param):
    r = httpx.post(f"{server}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_lone_surrogate_is_an_anthropic_400(server):
    raw = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    r = httpx.post(f"{server}/v1/messages", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "surrogate" in r.json()["error"]["message"]


def test_a_tiny_temperature_samples_at_the_floor(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "temperature": 1e-300, "max_tokens": 3,
                                                     "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# --- keep-alive after errors -------------------------------------------------------------------


def _local_port(response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_keep_alive_survives_errors_500_included(gguf, monkeypatch):
    """One pooled connection: a 400, a 404, a 500 (the engine's step raising), then a normal answer. uvicorn
    closes the connection of a request whose app raised: the 500 must be answered without raising."""
    llm = LLM(gguf, threads=1)
    port = free_port()
    server = make_server(create_app(lambda: llm, MODEL), "127.0.0.1", port, log_level="critical")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            wait_for(lambda: _ok(http, "/health"))
            ports = []
            r = http.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"²": 1}})
            assert r.status_code == 400
            ports.append(_local_port(r))
            r = http.post("/v1/audio/speech", json={"input": "hi"})
            assert r.status_code == 404
            ports.append(_local_port(r))
            with monkeypatch.context() as m:
                m.setattr(llm.engine.runner, "execute", _explode)
                r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 500 and "kernel exploded" in r.json()["error"]["message"]
            ports.append(_local_port(r))
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            ports.append(_local_port(r))
            assert len(set(ports)) == 1, ports  # one connection served them all
    finally:
        server.should_exit = True
        thread.join(30)


def _ok(http, path) -> bool:
    try:
        return http.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def _explode(*args, **kwargs):
    raise RuntimeError("kernel exploded")


# --- read deadlines and the connection limit ---------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> tuple[bool, bytes]:
    """Send `trickle` a byte every 0.2 s (or nothing) until the server closes; (closed in time, what it sent)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    received, sent = b"", 0
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
            if not chunk:
                return True, received
            received += chunk
        except socket.timeout:
            pass
        except ConnectionResetError:
            return True, received
        if sent < len(trickle):
            try:
                sock.send(trickle[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return True, received
            sent += 1
    return False, received


# --- clients that leave: their requests aborted, their blocks freed ----------------------------
# 6000 tokens: the tiny model's 240 took ~60 ms, about the client's 50 ms read timeout, so the request could end
# before its client left

def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 6000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            assert next(response.iter_lines()).startswith("data: ")  # it runs; now hang up
    aborted = 'churon_request_finished_total{finished_reason="abort"}'
    wait_for(lambda: metrics(server).get(aborted, 0) == before.get(aborted, 0) + 1)
    after = metrics(server)
    assert after["churon_num_requests_running"] == 0
    assert after["churon_kv_cache_usage_ratio"] == before["churon_kv_cache_usage_ratio"]
    length = 'churon_request_finished_total{finished_reason="length"}'
    assert after.get(length, 0) == before.get(length, 0)  # it did not run to its end


def test_client_leaving_a_non_streamed_request_aborts_it(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "another long story", "max_tokens": 6000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 6000 tokens are done
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.05))
    aborted = 'churon_request_finished_total{finished_reason="abort"}'
    wait_for(lambda: metrics(server).get(aborted, 0) == before.get(aborted, 0) + 1)
    after = metrics(server)
    assert after["churon_num_requests_running"] == 0
    assert after["churon_kv_cache_usage_ratio"] == before["churon_kv_cache_usage_ratio"]


def test_an_idle_connection_is_closed_after_the_header_timeout(server):
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as sock:
        started = time.monotonic()
        closed, _ = _closed_within(sock, 10)
        assert closed and 0.8 < time.monotonic() - started < 5


def test_slow_loris_headers_are_cut_off_at_the_header_timeout(server):
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-padding: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as sock:
        started = time.monotonic()
        closed, _ = _closed_within(sock, 10, trickle=head)  # a byte each 0.2 s: still sending when cut off
        assert closed and time.monotonic() - started < 5


def test_a_trickled_body_is_a_408_at_the_body_timeout(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as sock:
        sock.sendall(head.encode())
        started = time.monotonic()
        closed, received = _closed_within(sock, 10, trickle=body)
        assert closed and time.monotonic() - started < 5
        assert received.startswith(b"HTTP/1.1 408") and b"--body-timeout" in received
    # the server goes on serving
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200


def test_headers_past_the_size_limit_are_a_431(server):
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * (100 << 10))
        closed, received = _closed_within(sock, 5)
        assert closed and received.startswith(b"HTTP/1.1 431")
    # a large body (400 KiB, sent with its head) is no head: it passes to the route
    r = httpx.post(f"{server}/tokenize", json={"prompt": "a " * (200 << 10)}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] > 1000


def test_requests_on_a_kept_alive_connection_are_not_cut_by_the_header_timeout(server):
    with httpx.Client(timeout=30) as http:
        r = http.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        first = _local_port(r)
        time.sleep(1.5)  # idle past the 1 s header timeout, within uvicorn's 5 s keep-alive
        r = http.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and _local_port(r) == first


def test_connections_beyond_the_limit_are_503_and_closed(gguf):
    proc, url = start_server(gguf, "--max-connections", "4", "--header-timeout", "30")
    port = int(url.rsplit(":", 1)[1])
    try:
        time.sleep(0.5)  # start_server's own probes are closed by now
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port)) as extra:
            closed, received = _closed_within(extra, 5)
            assert closed and received.startswith(b"HTTP/1.1 503") and b"--max-connections" in received
        try:  # a real client's request meets the same: the 503, or the close if it reads too late
            assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        idle.pop().close()
        time.sleep(0.3)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        for s in idle:
            s.close()
    finally:
        stop_server(proc)


def _serve_with_file_limit(model_path, soft: int, hard: int, *flags: str):
    """`churon serve` started under RLIMIT_NOFILE (soft, hard); its process and URL once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "churon.cli", "serve", str(model_path), "--port", str(port), "--threads", "1",
           "--served-model-name", MODEL, "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: proc.poll() is not None or _answers(url), timeout=120)
    assert proc.poll() is None, proc.stderr.read()
    return proc, url


def _answers(url) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_soft_file_limit_is_raised_to_the_hard_one(gguf):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc, url = _serve_with_file_limit(gguf, 256, hard)
    try:
        with open(f"/proc/{proc.pid}/limits") as f:
            [line] = [line for line in f if line.startswith("Max open files")]
        assert line.split()[3] == (str(hard) if hard != resource.RLIM_INFINITY else "unlimited")
    finally:
        stop_server(proc)


def test_more_idle_connections_than_files_lock_nobody_out(gguf):
    """The file limit fixed at 400 (the hard one too): of 450 idle connections, those past the connection limit
    (400 less the 128 kept for the rest) are answered 503 and closed, instead of the accept loop failing on
    "Too many open files" for everyone, and once the header timeout has closed the others, clients are served."""
    proc, url = _serve_with_file_limit(gguf, 400, 400, "--header-timeout", "3")
    port = int(url.rsplit(":", 1)[1])
    try:
        time.sleep(0.5)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(450)]
        answers = [_closed_within(sock, 2) for sock in idle[-100:]]  # all past the limit of 272
        assert all(closed and received.startswith(b"HTTP/1.1 503") for closed, received in answers)
        wait_for(lambda: _answers(url), timeout=15)  # the header timeout closed the idle ones
        for sock in idle:
            sock.close()
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200
    finally:
        stop_server(proc)
    assert "Too many open files" not in proc.stderr.read()


# --- chat templates off the event loop ---------------------------------------------------------

# renders an ordinary conversation at once (the model loads), but spins on one that says "spin"
HOSTILE_TEMPLATE = (
    "{% for message in messages %}{% if 'spin' in message['content'] %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{% endfor %}"
    + CHAT_TEMPLATE
)


def test_a_hostile_template_is_that_requests_400_while_health_answers(tmp_path):
    hf = make_hf_model("qwen2", tmp_path / "hf", chat_template=HOSTILE_TEMPLATE)
    proc, url = start_server(write_gguf(hf, tmp_path / "hostile.gguf", "Q8_0"))
    try:
        results = {}

        def chat():
            results["chat"] = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                                         json={"messages": [{"role": "user", "content": "spin please"}], "max_tokens": 2})

        def message():
            results["anthropic"] = httpx.post(f"{url}/v1/messages", timeout=60, json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "spin please"}]})

        def response():
            results["responses"] = httpx.post(f"{url}/v1/responses", timeout=60,
                                              json={"input": "spin please", "max_output_tokens": 2})

        threads = [threading.Thread(target=chat), threading.Thread(target=message), threading.Thread(target=response)]
        started = time.monotonic()
        for t in threads:
            t.start()
        health = []
        while any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=2).status_code == 200
            health.append(time.monotonic() - t0)
            time.sleep(0.1)
        assert time.monotonic() - started > 1.5  # the template did spin, to its limit
        assert len(health) >= 5 and max(health) < 1.0, health
        r = results["chat"]
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "could not render this conversation within its limits" in error["message"]
        r = results["anthropic"]
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "within its limits" in r.json()["error"]["message"]
        r = results["responses"]
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        assert "within its limits" in r.json()["error"]["message"]
        ok = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200, ok.text
    finally:
        stop_server(proc)


# --- SIGTERM: a bounded grace period, then every stream ended properly ---------------------------


def _sse_events(url: str, path: str, body: dict, out: list, first: threading.Event, headers=None) -> None:
    """Read an SSE stream to its end: (event name or None, data) pairs into out."""
    try:
        with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=60) as r:
            out.append(("status", r.status_code))
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: "):
                    out.append((name, line[len("data: "):]))
                    name = None
                    first.set()
    except httpx.HTTPError as e:
        out.append(("broken", repr(e)))
    finally:
        first.set()


def test_sigterm_ends_every_stream_properly_within_the_grace_period(gguf):
    proc, url = start_server(gguf, "--shutdown-timeout", "1")
    streams = {
        "chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6000, "stream": True, "ignore_eos": True}),
        "completion": ("/v1/completions", {"prompt": "hi", "max_tokens": 6000, "stream": True, "ignore_eos": True}),
        "anthropic": ("/v1/messages", {"model": MODEL, "max_tokens": 6000, "messages": MESSAGES, "stream": True,
                                       "temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": LONG_JSON}}}),
        "responses": ("/v1/responses", {"input": "hello", "max_output_tokens": 6000, "stream": True, "temperature": 0,
                                        "text": {"format": {"type": "json_schema", "name": "t", "schema": LONG_JSON}}}),
        "short": ("/v1/completions", {"prompt": "hi", "max_tokens": 20, "stream": True, "ignore_eos": True}),
    }
    events = {name: [] for name in streams}
    firsts = {name: threading.Event() for name in streams}
    threads = {name: threading.Thread(target=_sse_events, args=(url, path, body, events[name], firsts[name]))
               for name, (path, body) in streams.items() if name != "short"}
    whole = {}

    def non_streamed():
        whole["r"] = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 6000, "ignore_eos": True},
                                timeout=60)

    threads["whole"] = threading.Thread(target=non_streamed)
    try:
        for t in threads.values():
            t.start()
        for name, first in firsts.items():
            if name != "short":
                assert first.wait(30), name
        wait_for(lambda: metrics(url)["churon_num_requests_running"] == 5)  # the non-streamed one runs too
        # started just before the signal, it finishes within the grace period
        threads["short"] = threading.Thread(target=_sse_events, args=(url, *streams["short"], events["short"], firsts["short"]))
        threads["short"].start()
        assert firsts["short"].wait(30)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        took = time.monotonic() - started
        for t in threads.values():
            t.join(20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 1 + 6, took  # the grace period, the streams' last events, the engine's stop
    assert proc.returncode in (0, -signal.SIGTERM), proc.stderr.read()

    def data(name):
        assert events[name][0] == ("status", 200), events[name][:3]
        assert all(kind != "broken" for kind, _ in events[name]), events[name][-3:]
        return events[name][1:]

    for name in ("chat", "completion"):  # OpenAI's: an error event naming the shutdown, then [DONE]
        last = data(name)
        assert last[-1] == (None, "[DONE]"), last[-3:]
        error = json.loads(last[-2][1])["error"]
        assert error["code"] == "server_shutting_down" and "--shutdown-timeout" in error["message"]
    short = data("short")
    assert short[-1] == (None, "[DONE]") and json.loads(short[-2][1])["choices"][0]["finish_reason"] == "length"
    last = data("anthropic")  # Anthropic's: an error event, overloaded_error, which its clients retry
    assert last[-1][0] == "error" and json.loads(last[-1][1])["error"]["type"] == "overloaded_error"
    last = data("responses")  # the Responses API's: response.failed
    assert last[-1][0] == "response.failed"
    assert "shutting down" in json.loads(last[-1][1])["response"]["error"]["message"]
    r = whole["r"]  # a response not yet started is a 503
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"


def test_a_draining_server_admits_nothing_new(gguf):
    app = create_app(lambda: LLM(gguf, threads=1), MODEL)

    async def main():
        async with loaded_client(app) as http:
            app.state.server.drain.begin(60)
            return [await http.get("/health"), await http.post("/v1/completions", json={"prompt": "hi"}),
                    await http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": MESSAGES})]

    health, completion, message = asyncio.run(main())
    for r in (health, completion):  # a load balancer's probe sees it too, and stops sending
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert r.headers["retry-after"] == "1"
    assert message.status_code == 503 and message.json()["error"]["type"] == "overloaded_error"


def test_a_second_signal_ends_the_streams_at_once_and_properly(gguf):
    proc, url = start_server(gguf, "--shutdown-timeout", "60")
    events, first = [], threading.Event()
    body = {"prompt": "hi", "max_tokens": 6000, "stream": True, "ignore_eos": True}
    reader = threading.Thread(target=_sse_events, args=(url, "/v1/completions", body, events, first))
    try:
        reader.start()
        assert first.wait(30)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        reader.join(20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - started < 6  # not the 60 s grace period
    assert events[-1] == (None, "[DONE]")
    error = json.loads(events[-2][1])["error"]
    assert error["code"] == "server_shutting_down" and "second signal" in error["message"]


# --- a request that fails alone, in each dialect ------------------------------------------------


def test_a_request_that_fails_alone_is_an_error_in_each_dialects_shape(gguf, monkeypatch):
    """GenerationError (NaN logits) after the first token: a 500 answered whole, and a stream's own final
    error event (Anthropic's `error`, the Responses API's `response.failed`); the next request is served."""
    llm = LLM(gguf, threads=1)
    prompt = llm.chat_prompt_ids(MESSAGES)
    [first] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].token_ids
    assert first not in prompt
    real = llm.model.backend.embedding

    def poisoned(table, ids):  # the step after the first token runs on a NaN embedding
        x = real(table, ids)
        x[ids == first] = math.nan
        return x

    app = create_app(lambda: llm, MODEL)
    anthropic_body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": MESSAGES}
    responses_body = {"input": MESSAGES[0]["content"], "max_output_tokens": 8, "temperature": 0}

    async def main():
        async with loaded_client(app) as http:
            monkeypatch.setattr(llm.model.backend, "embedding", poisoned)
            monkeypatch.setattr(llm.model, "fused_stack", None)  # op by op, through the poisoned embedding
            out = [await http.post("/v1/messages", json=anthropic_body),
                   await http.post("/v1/messages", json={**anthropic_body, "stream": True}),
                   await http.post("/v1/responses", json=responses_body),
                   await http.post("/v1/responses", json={**responses_body, "stream": True})]
            monkeypatch.setattr(llm.model.backend, "embedding", real)
            out.append(await http.post("/v1/messages", json=anthropic_body))
            return out

    whole, stream, response, response_stream, after = asyncio.run(main())
    assert whole.status_code == 500
    assert whole.json()["type"] == "error" and whole.json()["error"]["type"] == "api_error"
    assert "NaN" in whole.json()["error"]["message"]
    assert stream.status_code == 200
    last = stream.text.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error" and json.loads(last[1][len("data: "):])["error"]["type"] == "api_error"
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert "NaN" in response.json()["error"]["message"]
    last = response_stream.text.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: response.failed" and "NaN" in last[1]
    assert after.status_code == 200


# --- the API key off the command line ----------------------------------------------------------


@pytest.mark.parametrize("how", ["environment", "file"])
def test_the_api_key_from_the_environment_or_a_file_is_not_in_argv(gguf, tmp_path, monkeypatch, how):
    key = f"sekret-{how}-0123456789"
    if how == "environment":
        monkeypatch.setenv("CHURON_API_KEY", key)
        flags = ()
    else:
        (tmp_path / "key").write_text(key + "\n")
        flags = ("--api-key-file", str(tmp_path / "key"))
    proc, url = start_server(gguf, *flags)
    try:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 401
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        assert claude.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES).content is not None
    finally:
        stop_server(proc)


def test_api_key_and_api_key_file_together_are_refused(tmp_path):
    (tmp_path / "key").write_text("k")
    r = subprocess.run([sys.executable, "-m", "churon.cli", "serve", "x", "--api-key", "a", "--api-key-file",
                        str(tmp_path / "key")], capture_output=True, text=True)
    assert r.returncode == 1 and "not both" in r.stderr


# --- metrics: aborts of requests that never started ----------------------------------------------


def test_a_request_abandoned_in_the_queue_is_counted_as_an_abort(gguf):
    proc, url = start_server(gguf, "--max-num-seqs", "1")
    try:
        aborted = 'churon_request_finished_total{finished_reason="abort"}'
        before = metrics(url).get(aborted, 0)
        long = {"prompt": "hi", "max_tokens": 6000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=long) as running:
            lines = running.iter_lines()  # held: a dropped iterator closes the response
            assert next(lines).startswith("data: ")  # it holds the batch's one slot
            with pytest.raises(httpx.ReadTimeout):  # this one waits behind it; its client gives up
                httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=httpx.Timeout(10, read=0.3))
            wait_for(lambda: metrics(url).get(aborted, 0) == before + 1)
            after = metrics(url)
            assert after["churon_num_requests_running"] == 1 and after["churon_num_requests_waiting"] == 0
        wait_for(lambda: metrics(url).get(aborted, 0) == before + 2)  # and the running one, when its client left
    finally:
        stop_server(proc)


def test_a_non_ascii_api_key_matches_the_bytes_a_client_sends():
    """Header values arrive as bytes; the key is compared as its UTF-8 bytes (once decoded as latin-1 and
    re-encoded as UTF-8, no non-ASCII key could ever match)."""
    from churon.server.metrics import ServerMetrics
    from churon.server.middleware import RequestGuard

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    key = "clé-ünïcode-42"
    guard = RequestGuard(ok, metrics=ServerMetrics(), api_key=key, max_body_bytes=1 << 20)

    async def main():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return [(await http.get("/v1/models", headers={name: value})).status_code for name, value in [
                ("authorization", f"Bearer {key}".encode()), ("x-api-key", key.encode()),
                ("x-api-key", "clé-ünïcode-43".encode()), ("x-api-key", key.encode("latin-1"))]]

    assert asyncio.run(main()) == [200, 200, 401, 401]
