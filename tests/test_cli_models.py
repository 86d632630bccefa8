"""`churon create / show / list / cp / rm / ps`, and `run` / `chat` of a created model, run as a user would."""

import datetime
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_cli import churon

from churon import LLM, SamplingParams
from churon.cli import _human_duration
from churon.modelfile import parse_modelfile

PROMPT = "hello there"


@pytest.fixture
def home(tmp_path):
    return {"CHURON_HOME": str(tmp_path / "home")}


@pytest.fixture(scope="module")
def llm(tiny_llama_q8):
    return LLM(tiny_llama_q8, threads=1)


def create(tmp_path, home, name, modelfile):
    path = tmp_path / f"{name.replace(':', '_')}.Modelfile"
    path.write_text(modelfile)
    return churon("create", name, "-f", path, env=home)


def prompt_tokens(stderr: str) -> int:
    return int(re.search(r"prompt: (\d+) tokens", stderr).group(1))


def test_run_a_created_model_with_its_system_and_parameters(tmp_path, home, tiny_llama_q8, llm):
    result = create(tmp_path, home, "brief", f"FROM {tiny_llama_q8}\nSYSTEM Be brief.\nPARAMETER temperature 0\n"
                                             "PARAMETER num_predict 8\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"created brief:latest from {tiny_llama_q8}")
    run = churon("run", "brief", PROMPT, "--threads", "1", "--verbose", env=home)
    assert run.returncode == 0, run.stderr
    # the Modelfile's temperature 0 and num_predict 8: the text the same flags give
    flags = churon("run", tiny_llama_q8, PROMPT, "--temperature", "0", "--max-tokens", "8", "--system", "Be brief.",
                   "--threads", "1", env=home)
    assert run.stdout == flags.stdout
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    assert run.stdout == llm.chat(messages, SamplingParams(temperature=0, max_tokens=8)).text + "\n"
    # the system turn is in the rendered prompt
    assert prompt_tokens(run.stderr) == len(llm.chat_prompt_ids(messages)) != len(llm.chat_prompt_ids(messages[1:]))
    # a flag overrides the PARAMETER; --system the SYSTEM
    shorter = churon("run", "brief", PROMPT, "--max-tokens", "3", "--system", "Other.", "--threads", "1", env=home)
    other = [{"role": "system", "content": "Other."}, messages[1]]
    assert shorter.stdout == llm.chat(other, SamplingParams(temperature=0, max_tokens=3)).text + "\n"


def test_a_created_models_template_and_messages_make_the_prompt(tmp_path, home, tiny_llama_q8, llm):
    modelfile = f'''FROM {tiny_llama_q8}
SYSTEM S
TEMPLATE """{{{{- range .Messages }}}}<{{{{ .Role }}}}>{{{{ .Content }}}}
{{{{ end }}}}<assistant>"""
MESSAGE user hi
MESSAGE assistant hello
PARAMETER temperature 0
PARAMETER num_predict 6
'''
    assert create(tmp_path, home, "templated", modelfile).returncode == 0
    run = churon("run", "templated", PROMPT, "--threads", "1", "--verbose", env=home)
    assert run.returncode == 0, run.stderr
    ids = llm.encode(f"<system>S\n<user>hi\n<assistant>hello\n<user>{PROMPT}\n<assistant>", add_bos=False)
    assert prompt_tokens(run.stderr) == len(ids)
    assert run.stdout == llm.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].text + "\n"
    chat = churon("chat", "templated", "--threads", "1", stdin=f"{PROMPT}\n/exit\n", env=home)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.split(">>> ")[1] == run.stdout  # the same seeded conversation, then the user's turn


def test_show_list_copy_and_remove(tmp_path, home, tiny_llama_q8):
    modelfile = f"FROM {tiny_llama_q8}\nSYSTEM Be brief.\nPARAMETER temperature 0.5\nPARAMETER stop <|im_end|>\n" \
                "TEMPLATE {{ .Prompt }}\nLICENSE MIT\n"
    assert create(tmp_path, home, "mario", modelfile).returncode == 0
    show = churon("show", "mario", env=home)
    assert show.returncode == 0, show.stderr
    for line in ["model             mario:latest", f"from              {tiny_llama_q8} ({tiny_llama_q8})",
                 "architecture      llama", "context length    256", "embedding length  64", "quantization      Q8_0",
                 "parameters:", "  temperature                    0.5", 'stop                           "<|im_end|>"',
                 "system:\n  Be brief.", "template:\n  {{ .Prompt }}", "license:\n  MIT"]:
        assert line in show.stdout, line
    shown = churon("show", "mario", "--modelfile", env=home).stdout
    assert parse_modelfile(shown) == parse_modelfile(modelfile)
    assert churon("show", "mario", "--parameters", env=home).stdout == \
        'temperature                    0.5\nstop                           "<|im_end|>"\n'
    assert churon("show", "mario", "--system", env=home).stdout == "Be brief.\n"
    assert churon("show", "mario", "--template", env=home).stdout == "{{ .Prompt }}\n"  # as written
    plain = churon("show", tiny_llama_q8, env=home)  # any model: its architecture
    assert f"file              {tiny_llama_q8}" in plain.stdout and "architecture      llama" in plain.stdout
    assert "system:" not in plain.stdout
    assert churon("show", tiny_llama_q8, "--modelfile", env=home).stdout.startswith(f"FROM {tiny_llama_q8}\nTEMPLATE")

    copied = churon("cp", "mario", "luigi:v1", env=home)
    assert copied.returncode == 0 and copied.stdout == "copied 'mario' to 'luigi:v1'\n"
    listing = churon("list", env=home).stdout.splitlines()
    rows = [line for line in listing if line.startswith(("mario:latest", "luigi:v1"))]
    assert len(rows) == 2 and all("llama" in r and "Q8_0" in r and r.endswith(str(tiny_llama_q8)) for r in rows), listing
    removed = churon("rm", "mario", env=home)
    assert removed.returncode == 0 and removed.stdout == "deleted 'mario'\n"
    assert not any(line.startswith("mario") for line in churon("list", env=home).stdout.splitlines())
    again = churon("rm", "mario", env=home)
    assert again.returncode == 1 and "mario: no created model of this name" in again.stderr
    registry = churon("rm", "smollm2-135m", env=home)
    assert registry.returncode == 1 and "smollm2-135m is a registry model, not a created one" in registry.stderr


@pytest.mark.parametrize("name, modelfile, message", [
    ("x", "FROM {model}\nFOO bar\n", "line 2: unknown instruction 'FOO'"),
    ("x", "# the base\nFROM ./missing.gguf\n", "line 2 (FROM): ./missing.gguf does not exist"),
    ("x", "FROM {model}\nPARAMETER temperature hot\n", "line 2 (PARAMETER): temperature='hot': must be a number"),
    ("../x", "FROM {model}\n", "model name '../x': '..' is not allowed in a name"),
])
def test_bad_modelfiles_and_names_are_clear_errors(tmp_path, home, tiny_llama_q8, name, modelfile, message):
    result = create(tmp_path, home, "m" if name == "../x" else name, modelfile.format(model=tiny_llama_q8))
    if name == "../x":
        result = churon("create", name, "-f", tmp_path / "m.Modelfile", env=home)
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert churon("show", "x", env=home).returncode == 1  # nothing was created


class _FakePs(BaseHTTPRequestHandler):
    """/api/ps as Ollama (and churon serve) answers it."""
    models: list = []

    def do_GET(self):
        body = json.dumps({"models": self.models}).encode() if self.path == "/api/ps" else b"{}"
        self.send_response(200 if self.path == "/api/ps" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_ps_prints_what_a_server_has_loaded_and_until_when(home):
    now = datetime.datetime.now(datetime.timezone.utc)
    _FakePs.models = [
        {"name": "mario:latest", "size": 3 << 20, "expires_at": (now + datetime.timedelta(minutes=4, seconds=30)).isoformat()},
        {"name": "smollm2-135m", "size": 2048, "expires_at": "2318-01-01T00:00:00Z"},  # keep_alive -1
        {"name": "old", "size": 10, "expires_at": (now - datetime.timedelta(seconds=5)).isoformat()},
    ]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakePs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = churon("ps", "--port", server.server_address[1], env=home)
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "NAME          SIZE     UNTIL",
        "------------  -------  ------------------",
        "mario:latest  3.0 MiB  4 minutes from now",
        "smollm2-135m  2.0 KiB  Forever",
        "old           10 B     Stopping...",
    ]
    closed = churon("ps", "--port", server.server_address[1], env=home)
    assert closed.returncode == 1 and f"no churon server answers at http://127.0.0.1:{server.server_address[1]}/api/ps" \
        in closed.stderr


@pytest.mark.parametrize("seconds, text", [(0.5, "Less than a second"), (1, "1 second"), (59, "59 seconds"),
                                           (60, "About a minute"), (299, "4 minutes"), (3600, "About an hour"),
                                           (5 * 3600, "5 hours"), (3 * 86400, "3 days"), (21 * 86400, "3 weeks"),
                                           (90 * 86400, "3 months"), (3 * 365 * 86400, "3 years")])
def test_durations_read_as_ollamas(seconds, text):
    assert _human_duration(seconds) == text
