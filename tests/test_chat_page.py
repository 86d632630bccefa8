"""The chat page at GET /: one static file that works offline, driven in a real browser (headless Chromium
through selenium) against a real `churon serve` of tiny random models: one preloaded with an embedding model
beside it, another in the server's $CHURON_HOME, loaded when the page's picker names it.

Every answer the page shows is checked against the same greedy request sent to the API directly; the page's
state is read from the DOM (a screenshot is saved under the test's tmp_path for a person to look at)."""

import json
import re
import shutil
from pathlib import Path

import httpx2 as httpx
import pytest

try:
    from selenium import webdriver
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # the page's own test runs without it; the browser's skip
    webdriver = None

from test_server import MODEL, gguf, start_server, stop_server  # noqa: F401 (gguf is a fixture)

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
OTHER = "other"  # the model in $CHURON_HOME
SYSTEM = "be brief"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_llama_q8):
    """The servers' $CHURON_HOME (not this machine's cache, whose models would be in the picker): one model in it."""
    models = tmp_path_factory.mktemp("home") / "models"
    models.mkdir()
    shutil.copy(tiny_llama_q8, models / f"{OTHER}.gguf")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CHURON_HOME", str(models.parent))
        yield models.parent


@pytest.fixture(scope="module")
def server(home, gguf, tiny_bert_dir):  # noqa: F811 (gguf is a fixture)
    # an embedding model beside the chat one: the picker offers only the models that generate
    proc, url = start_server(gguf, "--embedding-model", str(tiny_bert_dir))
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def driver():
    if webdriver is None:
        pytest.skip("selenium is not installed: the chat page's browser tests need it (pip install selenium)")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not path.exists():
            pytest.skip(f"{path} is absent: the chat page's browser tests need Debian's {package} (apt-get install -y {package})")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start; /dev/shm is small in containers
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))
    yield browser
    browser.quit()


def api_answer(url: str, messages: list[dict], **settings) -> str:
    """The same request the page sends, not streamed: the answer the page must show."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, **settings}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def streamed_deltas(url: str, messages: list[dict], **settings) -> list[str]:
    """The same request streamed from the API: its content deltas, in order (the empty ones left out)."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True, **settings}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]


def wait(driver, predicate, timeout=60):
    return WebDriverWait(driver, timeout).until(predicate)


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def open_page(driver, url: str) -> None:
    driver.get(url)
    wait(driver, lambda d: js(d, "return document.querySelectorAll('#model option').length") > 0)


def fill(driver, id: str, value: str) -> None:
    # set as a value, not typed: a long prompt typed key by key is slow, and the page reads only .value
    js(driver, "const e = document.getElementById(arguments[0]); e.value = arguments[1]; e.dispatchEvent(new Event('change'))", id, value)


def ask(driver, text: str) -> dict:
    """Send text from the page and wait for its answer to end; the answer turn as the DOM holds it."""
    turns = js(driver, "return document.querySelectorAll('.turn.assistant').length")
    fill(driver, "prompt", text)
    driver.find_element("id", "send").click()
    wait(driver, lambda d: js(d, "const t = document.querySelectorAll('.turn.assistant');"
                                 "return t.length > arguments[0] && !t[t.length - 1].hasAttribute('aria-busy')", turns))
    return js(driver, """
        const t = [...document.querySelectorAll('.turn.assistant')].pop();
        const error = t.querySelector('.error');
        return {content: t.querySelector('.content').textContent, error: error && error.textContent,
                copy: t.querySelector('button.copy') !== null};""")


def test_the_page_is_one_offline_file_and_docs_are_off(server):
    r = httpx.get(f"{server}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert httpx.head(f"{server}/").status_code == 200  # Ollama's CLI asks HEAD / whether a server is up
    html = r.text
    # nothing from another host: no URL at all, no script or style loaded from a file
    assert re.findall(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html) == []
    assert re.findall(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=", html) == []
    # and the browser is told so: connections to this server only, nothing loaded from anywhere
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    # Swagger UI and ReDoc come from a CDN: off; the schema they would show stays
    assert httpx.get(f"{server}/docs").status_code == 404 and httpx.get(f"{server}/redoc").status_code == 404
    schema = httpx.get(f"{server}/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "/" not in schema["paths"]


def test_a_conversation_streams_the_greedy_answers_and_keeps_its_history(server, driver, tmp_path):
    open_page(driver, server)
    # the generation models, the loaded one first: the embedding model served beside them cannot chat
    assert js(driver, "return [...document.querySelectorAll('#model option')].map(o => o.value)") == [MODEL, OTHER]
    fill(driver, "system", SYSTEM)
    fill(driver, "temperature", "0")
    fill(driver, "max-tokens", str(MAX_TOKENS))
    # a stop string from the second half of the unstopped answer: the page's answer must end before it
    question = "What is churon?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    unstopped = api_answer(server, messages)
    stop = re.search(r"[A-Za-z]{3,}", unstopped[len(unstopped) // 2:]).group()
    fill(driver, "stop", f"{stop}\nnever-generated")
    settings = {"stop": [stop, "never-generated"]}

    # the answer's text as each delta lands in the DOM: every change puts a new text node in .content (the
    # node added, not .content's text when the observer is called: several deltas may land before it is)
    js(driver, """window.shown = [];
        new MutationObserver((records) => { for (const r of records)
            if (r.target.classList.contains('content') && r.addedNodes.length) window.shown.push(r.addedNodes[0].data); })
            .observe(document.getElementById('log'), {subtree: true, childList: true});""")
    first = ask(driver, question)
    expected = api_answer(server, messages, **settings)
    assert expected == unstopped[:unstopped.index(stop)] and expected
    assert first == {"content": expected, "error": None, "copy": True}
    deltas = streamed_deltas(server, messages, **settings)
    assert len(deltas) > 1 and js(driver, "return window.shown") == [''.join(deltas[:i + 1]) for i in range(len(deltas))]

    # the second turn is sent with the first: the answer is the API's to the whole conversation
    second = ask(driver, "And then?")
    messages = messages + [{"role": "assistant", "content": expected}, {"role": "user", "content": "And then?"}]
    assert second["content"] == api_answer(server, messages, **settings) and second["error"] is None

    # copy puts the answer on the clipboard
    driver.execute_cdp_cmd("Browser.grantPermissions", {"origin": server, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    driver.find_elements("css selector", ".turn.assistant button.copy")[0].click()
    wait(driver, lambda d: js(d, "return document.querySelector('.turn.assistant button.copy').textContent") == "Copied")
    assert driver.execute_async_script("navigator.clipboard.readText().then(arguments[0])") == expected
    driver.save_screenshot(str(tmp_path / "conversation.png"))
    assert (tmp_path / "conversation.png").stat().st_size > 0

    # a new chat forgets it all: the first question gets its first answer again
    driver.find_element("id", "new-chat").click()
    assert js(driver, "return document.querySelectorAll('.turn').length") == 0
    assert ask(driver, question)["content"] == expected

    # another model from the picker: the server loads it, and the answer is that model's
    Select(driver.find_element("id", "model")).select_by_value(OTHER)
    answer = ask(driver, question)
    assert answer["content"] == api_answer(server, [*messages[:2], {"role": "assistant", "content": expected},
                                                    {"role": "user", "content": question}], model=OTHER, **settings)
    assert js(driver, "return [...document.querySelectorAll('.turn.assistant .who')].pop().firstChild.data") == OTHER


def test_a_too_long_prompt_shows_the_apis_error_and_leaves_the_history(server, driver, tmp_path):
    open_page(driver, server)
    Select(driver.find_element("id", "model")).select_by_value(MODEL)  # the picker lists the last one used first
    fill(driver, "temperature", "0")
    fill(driver, "max-tokens", str(MAX_TOKENS))
    long = "hello " * 300  # 1,200 tokens: the tiny model's context is 256
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "context window" in message

    answer = ask(driver, long)
    driver.save_screenshot(str(tmp_path / "error.png"))
    assert answer == {"content": "", "error": message, "copy": False}
    assert js(driver, "return document.getElementById('prompt').value") == long  # back in the box, to shorten
    # the failed turn is not part of the conversation: the next question is answered as the first
    fill(driver, "prompt", "")
    assert ask(driver, "hi")["content"] == api_answer(server, [{"role": "user", "content": "hi"}])


def test_a_server_with_an_api_key_gets_it_from_the_page(home, gguf, driver):  # noqa: F811 (gguf is a fixture)
    proc, url = start_server(gguf, "--api-key", "page-secret")
    try:
        driver.get(url)  # the page itself is open: it holds no data, and it is where the key is typed
        wait(driver, lambda d: d.find_element("id", "key-box").is_displayed())
        assert "API key" in driver.find_element("id", "notice").text
        fill(driver, "api-key", "page-secret")
        wait(driver, lambda d: js(d, "return document.getElementById('model').value") == MODEL)
        fill(driver, "temperature", "0")
        fill(driver, "max-tokens", str(MAX_TOKENS))
        answer = ask(driver, "hi")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": MAX_TOKENS}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer page-secret"}, timeout=60)
        assert answer == {"content": r.json()["choices"][0]["message"]["content"], "error": None, "copy": True}
    finally:
        stop_server(proc)
