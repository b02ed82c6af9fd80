"""The playground: its page driven in headless Chromium, and its stream over plain HTTP.

One real server (`python scripts/serve.py`, the real default model, the settings of test_server.py so the XLA
cache serves both) serves the module. The page must stream the output with accepted drafts marked apart from
target tokens, exactly as the stream flags them, and update its tokens/s and acceptance display as events
arrive; the stream must flag every token, agree with the engine's counts and with the OpenAI routes' text, and
refuse bad input with HTTP 400 naming the field.

The browser is Debian's `chromium`, driven by selenium through Debian's `chromium-driver` (`make install`
installs both). The driver is built from the same Debian source package as the browser, so the two always
match, and selenium is given both paths, so nothing is downloaded at test time. (Playwright would want its
own browser build, or run a system Chromium of whatever version Debian ships against the protocol version it
was built for.) Set PLAYGROUND_SCREENSHOT=docs/images/playground.png to refresh the documentation's screenshot.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from jaxspec.models.loading import named_model_path
from jaxspec.models.tokenizer import Tokenizer
from test_server import CACHE_LEN, MAX_SLOTS, MAX_WAITING, MODEL, _serving

pytestmark = pytest.mark.real_model

PROBLEM = 3  # HumanEval/3: its docstring repeats in the output, so the suffix automaton (sam) drafts well
MAX_TOKENS = 96
GENERATION_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    try:
        path = named_model_path(MODEL)
    except ValueError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    log = tmp_path_factory.mktemp("playground") / "serve.log"
    # --policy fixed: always draft, so that sam's drafts do not hang on the adaptive policy's timings of a busy
    # machine (the policy sets per-row caps at run time: the compiled programs are test_server.py's).
    with _serving(["--max-slots", str(MAX_SLOTS), "--cache-len", str(CACHE_LEN), "--chunk-steps", "4",
                   "--max-waiting", str(MAX_WAITING), "--policy", "fixed"], log) as running:
        yield running["url"]


@pytest.fixture(scope="module")
def browser():
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        message = "Debian's chromium and chromium-driver are not installed (make install installs them)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # --no-sandbox: Chromium refuses to run as root with its sandbox; /dev/shm is small in containers.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    yield driver
    driver.quit()


def _generate(url: str, body: dict) -> list[dict]:
    """The events of one `POST /playground/generate` stream."""
    with httpx.stream("POST", f"{url}/playground/generate", json=body, timeout=GENERATION_TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in r.iter_lines() if line]


SETTINGS = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "speculative": {"method": "sam"}}  # greedy


# ------------------------------------------------------------------------------------------ the stream


@pytest.mark.parametrize("mode", ["prompt", "chat"])
def test_stream_flags_every_token_and_matches_the_openai_routes(server, tokenizer, humaneval_prompts, mode):
    prompt = humaneval_prompts[PROBLEM]
    if mode == "prompt":
        route, body = "/v1/completions", {"prompt": prompt}
    else:
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Complete:\n{prompt}"}]}
    events = _generate(server, {**body, **SETTINGS})
    *tokens, done = events
    assert tokens and all(len(e["ids"]) == len(e["pieces"]) == len(e["draft"]) > 0 for e in tokens)
    assert done["done"] and done["finish_reason"] in ("stop", "length") and done["error"] is None
    ids = [t for e in tokens for t in e["ids"]]
    flags = [f for e in tokens for f in e["draft"]]
    text = "".join(p for e in tokens for p in e["pieces"]) + done["tail"]
    assert text == tokenizer.decode(ids, skip_special_tokens=True)

    # The flags agree with the engine's counts: each step commits its accepted drafts, then the target's own
    # token (the last step may be cut after its drafts); the first token comes from the prefill.
    stats = done["stats"]
    assert flags[0] is False
    assert sum(flags) == stats["accepted"]
    assert flags[1:].count(False) + flags[-1] == stats["steps"]
    if mode == "prompt":
        assert 0 < sum(flags) < len(flags)  # sam drafts on this prompt, and the target still has its say

    # The same request through the OpenAI route gives the same greedy text.
    r = httpx.post(server + route, json={"model": MODEL, **body, **SETTINGS}, timeout=GENERATION_TIMEOUT_S)
    choice = r.json()["choices"][0]
    assert (choice["text"] if mode == "prompt" else choice["message"]["content"]) == text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": 1.5}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100_000}, "max_tokens"),  # past the context: the engine's check
    ({"prompt": "x", "seed": "7"}, "seed"),
    ({"prompt": "x", "speculative": {"method": "eagle2"}}, "speculative.method"),  # a method not served
    ({"prompt": "x", "speculative": {"method": "sam", "num_speculative_tokens": 10_000}},
     "speculative.num_speculative_tokens"),
    ({"prompt": "x", "temprature": 0.5}, "temprature"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 8}, "prompt"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
])
def test_bad_input_is_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server}/playground/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split(".")[-1] in error["message"], error


def test_page_and_its_files_are_served(server):
    page = httpx.get(server + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # Everything the page loads comes from this server, and nothing names another: it works offline.
    assert "://" not in page.text
    for path in ("/playground/static/app.js", "/playground/static/style.css"):
        assert f'"{path}"' in page.text
        r = httpx.get(server + path, timeout=30)
        assert r.status_code == 200 and "://" not in r.text
    config = httpx.get(server + "/playground/config", timeout=30).json()
    assert config["model"] == MODEL and "sam" in config["methods"]


# --------------------------------------------------------------------------------------------- the page


# Keeps a copy of the stream the page reads (window.received), and records each change of the tokens/s display
# with the number of tokens shown at that moment (window.tpsUpdates).
_WATCH = """
window.received = "";
const pageFetch = window.fetch;
window.fetch = async (...args) => {
  const response = await pageFetch(...args);
  if (!String(args[0]).endsWith("/playground/generate")) return response;
  const [copy, page] = response.body.tee();
  (async () => {
    const reader = copy.pipeThrough(new TextDecoderStream()).getReader();
    for (let r = await reader.read(); !r.done; r = await reader.read()) window.received += r.value;
  })();
  return new Response(page, {status: response.status, headers: response.headers});
};
window.tpsUpdates = [];
new MutationObserver(() => tpsUpdates.push([document.getElementById("tps").textContent,
                                            document.querySelectorAll("#output .tok").length]))
  .observe(document.getElementById("tps"), {childList: true, characterData: true, subtree: true});
"""


def _open(browser, url: str) -> None:
    browser.get(url + "/")
    # The method list comes from /playground/config once the page has loaded.
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#method option"))


def _set(browser, element_id: str, value: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _wait_finished(browser) -> str:
    WebDriverWait(browser, GENERATION_TIMEOUT_S).until(
        lambda d: d.find_element(By.ID, "status").get_attribute("data-state") not in ("idle", "running"))
    return browser.find_element(By.ID, "status").get_attribute("data-state")


def test_page_streams_marked_tokens_and_live_stats(server, browser, humaneval_prompts, tmp_path):
    prompt = humaneval_prompts[PROBLEM]
    _open(browser, server)
    _set(browser, "prompt", prompt)
    Select(browser.find_element(By.ID, "method")).select_by_value("sam")
    _set(browser, "temperature", "0")
    _set(browser, "max_tokens", str(MAX_TOKENS))
    browser.execute_script(_WATCH)
    browser.find_element(By.ID, "run").click()
    assert _wait_finished(browser) == "done", browser.find_element(By.ID, "status").text
    WebDriverWait(browser, 30).until(lambda d: d.execute_script('return window.received.includes(\'"done": true\');'))

    spans = browser.execute_script(
        "return [...document.querySelectorAll('#output .tok')].map(s => [s.className, s.textContent]);")
    drafts = [text for cls, text in spans if cls == "tok draft"]
    targets = [text for cls, text in spans if cls == "tok target"]
    assert drafts and targets and len(drafts) + len(targets) == len(spans)
    # The page marks exactly what its stream flagged.
    *events, done = [json.loads(line) for line in browser.execute_script("return window.received;").splitlines()]
    assert done["done"]
    assert spans == [["tok draft" if d else "tok target", p] for e in events for p, d in zip(e["pieces"], e["draft"])
                     if p]
    # Greedy decoding is lossless: a request of its own gives the text the page shows.
    typed = browser.find_element(By.ID, "prompt").get_attribute("value")
    own = _generate(server, {"prompt": typed, **SETTINGS})
    text = "".join(p for e in own[:-1] for p in e["pieces"]) + own[-1]["tail"]
    assert browser.execute_script("return document.getElementById('output').textContent;") == text

    # Stats updated while the tokens streamed in, not only at the end.
    updates = browser.execute_script("return window.tpsUpdates;")
    assert len(updates) >= 3, updates
    shown = [count for _, count in updates]
    assert shown == sorted(shown) and shown[0] < shown[-1] == len(spans), updates
    assert float(browser.find_element(By.ID, "tps").text) > 0
    bars = browser.find_elements(By.CSS_SELECTOR, "#acceptance .bar .pct")
    assert bars and all(b.text.endswith("%") for b in bars) and bars[0].text != "0%"
    assert "drafted" in browser.find_element(By.ID, "accepted").text
    assert int(browser.find_element(By.ID, "tokens").text) == sum(len(e["ids"]) for e in events)

    shot = tmp_path / "playground.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("PLAYGROUND_SCREENSHOT"):
        shutil.copyfile(shot, Path(os.environ["PLAYGROUND_SCREENSHOT"]))


def test_page_shows_the_servers_error(server, browser):
    _open(browser, server)
    _set(browser, "prompt", "def f(x):")
    # Within the field's own limit (the context), but the prompt's tokens leave less: only the server knows.
    _set(browser, "max_tokens", browser.find_element(By.ID, "max_tokens").get_attribute("max"))
    browser.find_element(By.ID, "run").click()
    assert _wait_finished(browser) == "error"
    assert "max_tokens" in browser.find_element(By.ID, "status").text
    assert not browser.find_elements(By.CSS_SELECTOR, "#output .tok")


def test_page_chat_mode(server, browser):
    _open(browser, server)
    assert not browser.find_element(By.ID, "system").is_displayed()
    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=chat]").click()
    assert browser.find_element(By.ID, "prompt-label").text == "Message"
    _set(browser, "system", "You are a concise assistant.")
    _set(browser, "prompt", "Write a Python function that reverses a string.")
    _set(browser, "max_tokens", "24")
    browser.find_element(By.ID, "run").click()
    assert _wait_finished(browser) == "done", browser.find_element(By.ID, "status").text
    assert browser.find_element(By.ID, "output").text.strip()
    assert int(browser.find_element(By.ID, "tokens").text) <= 24
