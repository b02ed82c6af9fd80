"""The server against hostile clients, over real HTTP: one uvicorn server in a thread on 127.0.0.1, with an API key
and the loopback Host check, driven by the official `openai` client (httpx where a request must be malformed).

Each test pins one refusal or bound: a setting float32 cannot hold is a 400 naming it (not a 500), a huge
`prediction` is refused by its length before it is tokenized and never stalls the event loop, error bodies stay
small, stop strings are bounded and held back in linear time, unknown or unimplemented fields are refused by
name, more choices than the server holds is a 400 on both endpoints, access control (key, JSON content type,
Host), and text work runs in the app's own thread pool, so a saturated default pool does not delay chat.

The engine serves the small random model of tests/test_server_fuzz.py (the real SmolLM2 tokenizer) at one batch
size, so the module compiles few programs.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

import test_server_fuzz as fuzz
from jaxspec import SpecConfig
from jaxspec.engine import Engine, EngineConfig
from jaxspec.serving import create_app
from jaxspec.serving.app import LOOPBACK_HOSTS
from jaxspec.serving.protocol import (
    MAX_MESSAGE_CHARS,
    MAX_STOP_CHARS,
    NOT_SUPPORTED,
    ChatCompletionRequest,
    RequestError,
)
from jaxspec.serving.translate import Translator
from jaxspec.text import TextStream

pytestmark = pytest.mark.real_model  # the real tokenizer comes from the SmolLM2 GGUF

MODEL = fuzz.MODEL
tokenizer = fuzz.tokenizer  # the fixtures: SmolLM2's real tokenizer, and a tiny random Llama that carries it
small_lm = fuzz.small_lm

KEY = "test-key-0123456789"
MAX_PREDICTION = 64  # tokens
CAPACITY = 6  # max_slots + max_waiting
CONFIG = EngineConfig(max_slots=2, slot_buckets=(2,), cache_len=256, chunk_steps=2, max_waiting=CAPACITY - 2,
                      spec=SpecConfig(method="sam", num_speculative_tokens=3), max_prediction_len=MAX_PREDICTION)
CHAT = [{"role": "user", "content": "Write a haiku about JAX."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(small_lm):
    engine = Engine(small_lm, CONFIG)
    loops: list[asyncio.AbstractEventLoop] = []
    app = create_app(engine, served_model_name=MODEL, api_key=KEY, allowed_hosts=LOOPBACK_HOSTS, warmup=False,
                     on_ready=lambda: loops.append(asyncio.get_running_loop()))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 600
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    yield {"url": f"http://127.0.0.1:{port}", "engine": engine, "loop": loops[0]}
    srv.should_exit = True
    thread.join(60)
    assert engine.failed is None, f"the engine failed: {engine.failed!r}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(server["url"] + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}", **headers})


def error_of(r: httpx.Response, status: int, param: str | None) -> dict:
    """OpenAI's error object of a refusal with `status`, naming `param`."""
    assert r.status_code == status, r.text[:2000]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param, err
    return err


# ------------------------------------------------------------------------------------ numbers and settings


@pytest.mark.parametrize("value", [1e308, 100.5])
def test_repetition_penalty_above_its_bound_is_a_400_naming_it(client, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       extra_body={"repetition_penalty": value})
    assert e.value.body["param"] == "repetition_penalty"


def test_repetition_penalty_at_its_bound_is_served(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                       extra_body={"repetition_penalty": 100})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_setting_the_engine_refuses_is_a_400_naming_it(server):
    """Past the protocol's bounds (a body built without validation), SamplingParams' own refusal is caught with
    the engine's: a RequestError naming the field, never an exception the route does not handle."""
    translator = Translator(server["engine"], MODEL)
    body = ChatCompletionRequest.model_construct(**{**ChatCompletionRequest(model=MODEL, messages=CHAT).__dict__,
                                                    "repetition_penalty": 1e308})
    with pytest.raises(RequestError) as e:
        asyncio.run(translator.engine_requests(body, [1, 2, 3], prompt_param="messages", default_max=2,
                                               logprobs_param="top_logprobs"))
    assert e.value.param == "repetition_penalty" and e.value.status == 400


# --------------------------------------------------------------------------------------------- prediction


def test_a_huge_prediction_is_refused_before_tokenizing_and_the_loop_stays_free(server, tokenizer,
                                                                                 monkeypatch):
    """1.9 MB of prediction text (~680k tokens, far over the 64 served) is refused by its length in characters:
    the tokenizer never sees it, and /health answers promptly meanwhile."""
    encoded: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: (encoded.append(len(text)), encode(text, **kw))[1])
    text = "ab " * 633_000
    result: dict = {}

    def send():
        result["r"] = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                            "prediction": {"type": "content", "content": text}})

    sender = threading.Thread(target=send)
    sender.start()
    worst = 0.0
    with httpx.Client(base_url=server["url"]) as probe:
        while sender.is_alive():
            t = time.perf_counter()
            assert probe.get("/health", timeout=30).status_code == 200
            worst = max(worst, time.perf_counter() - t)
            time.sleep(0.01)
    sender.join()
    err = error_of(result["r"], 400, "prediction")
    assert "characters" in err["message"]
    assert not any(n > 10_000 for n in encoded), f"the prediction was tokenized: {encoded}"
    assert worst < 0.5, f"/health waited {worst:.2f} s"


def test_a_prediction_within_the_bounds_is_served(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                       prediction={"type": "content", "content": "a short guess"})
    assert r.usage.completion_tokens_details.accepted_prediction_tokens is not None


def test_a_prediction_over_the_tokens_but_under_the_characters_is_refused_by_the_engine(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       prediction={"type": "content", "content": "x y " * MAX_PREDICTION})
    assert e.value.body["param"] == "prediction" and "tokens" in e.value.body["message"]


# ------------------------------------------------------------------------------------------- error bodies


@pytest.mark.parametrize("case", ["model", "unknown_field", "path"])
def test_error_messages_are_bounded(server, case):
    huge = "x" * 200_000
    if case == "path":
        r = httpx.get(f"{server['url']}/{huge[:10_000]}", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 404, r.text[:500]
        err = r.json()["error"]
    else:
        body = {"model": huge, "messages": CHAT} if case == "model" else {"model": MODEL, "messages": CHAT, huge: 1}
        err = post(server, "/v1/chat/completions", body).json()["error"]
    assert len(err["message"]) <= MAX_MESSAGE_CHARS + 40 and "characters)" in err["message"], err["message"][:300]
    assert err["param"] is None or len(err["param"]) <= 250


# ------------------------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize("stop", [["x" * (MAX_STOP_CHARS + 1)], ["a", "b", "c", "d", "e"], [""]])
def test_stop_strings_are_bounded(client, stop):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stop=stop)
    assert e.value.body["param"] == "stop"


def test_a_longest_stop_string_is_served(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stop=["x" * MAX_STOP_CHARS] * 4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_holding_back_a_stop_prefix_is_linear(tokenizer):
    """2,000 tokens, each extending a tail that is the start of the stop string: with 4 stop strings of the
    longest length the stream takes about as long as with 4 short ones (comparing every prefix length per token
    took over 10x as long)."""
    a = tokenizer.encode("a")
    assert len(a) == 1

    def seconds(stop: list[str]) -> float:
        best = float("inf")
        for _ in range(3):
            stream, released = TextStream(tokenizer, stop), []
            t = time.perf_counter()
            for _ in range(2000):
                released.append(stream.add(a))
            best = min(best, time.perf_counter() - t)
            held = max(len(s) for s in stop) - 1  # the tail that could still become a stop string
            assert not stream.stopped and "".join(released) == "a" * (2000 - held)
        return best

    long = seconds(["a" * (MAX_STOP_CHARS - 1) + c for c in "bcde"])
    short = seconds(["ab", "ac", "ad", "ae"])
    assert long < 4 * short + 0.01, f"{long:.4f} s against {short:.4f} s"


# --------------------------------------------------------------------------------- fields: nothing ignored


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"1": 5}), ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("parallel_tool_calls", True),
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("web_search_options", {}), ("best_of", 2), ("store", True), ("x_unknown", 1), ("Temperature", 0.5)])
def test_unknown_and_unimplemented_fields_are_refused_by_name(server, field, value):
    err = error_of(post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, field: value}), 400, field)
    assert field in err["message"]
    assert ("not supported" in err["message"]) == (field in NOT_SUPPORTED)


@pytest.mark.parametrize("field,value,param", [("suffix", "}", "suffix"), ("best_of", 2, "best_of"),
                                               ("logit_bias", {"50256": -100}, "logit_bias")])
def test_completions_refuse_what_they_do_not_implement(client, field, value, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=2, **{field: value})
    assert e.value.body["param"] == param


def test_fields_that_ask_for_nothing_are_accepted(client):
    """Labels (`user`, `metadata`), the no-op values of unimplemented fields, best_of equal to n, and a previous
    answer's message sent back as the client's model dumps it (`refusal: null`, `tool_calls: null`, ...)."""
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    echoed = first.choices[0].message.model_dump()
    assert "refusal" in echoed
    r = client.chat.completions.create(
        model=MODEL, messages=[*CHAT, echoed, {"role": "user", "content": "Another."}], max_tokens=2,
        user="u-1", metadata={"team": "a"}, store=False, tool_choice="none", tools=[], logit_bias={},
        modalities=["text"], service_tier="auto")
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=2, n=2, best_of=2, suffix="")
    assert len(r.choices) == 2


# ------------------------------------------------------------------------------------- choices over capacity


def test_more_choices_than_the_server_holds_is_a_400_on_both_endpoints(client):
    """Never the retryable 429: a retrying client would loop."""
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=CAPACITY + 1)
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=2, n=CAPACITY + 1)
    assert chat.value.body["param"] == "n" and completion.value.body["param"] == "prompt"
    for e in (chat, completion):
        assert f"x n={CAPACITY + 1} make {CAPACITY + 1} choices; this server takes at most {CAPACITY} at once" \
            in e.value.body["message"]


# ------------------------------------------------------------------------------------------ access control


def test_the_api_key_is_required_on_the_api(server, client):
    wrong = openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert [m.id for m in client.models.list()] == [MODEL]
    for path in ("/v1/models", "/playground/config"):
        r = httpx.get(server["url"] + path, timeout=60)
        error_of(r, 401, None)
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(server["url"] + "/playground/generate", json={"prompt": "x", "max_tokens": 1}, timeout=60)
    error_of(r, 401, None)


def test_the_page_health_and_metrics_stay_open(server):
    for path in ("/", "/health", "/metrics", "/playground/static/app.js"):
        assert httpx.get(server["url"] + path, timeout=60).status_code == 200, path
    r = httpx.post(server["url"] + "/playground/generate", json={"prompt": "def f(x):", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200 and '"done": true' in r.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_a_post_that_is_not_json_typed_is_a_415(server, content_type):
    """A web page's "simple" cross-site POST (a form, or fetch with text/plain) cannot reach the routes."""
    headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": content_type} if content_type else {})
    for path in ("/v1/chat/completions", "/playground/generate"):
        r = httpx.post(server["url"] + path, content=b'{"model": "x", "messages": []}', headers=headers, timeout=60)
        error_of(r, 415, None)
    r = httpx.post(server["url"] + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1},
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json; charset=utf-8"},
                   timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host,status", [("evil.example", 421), ("evil.example:8000", 421), ("127.0.0.2", 421),
                                         ("localhost.evil.example", 421), ("localhost", 200), ("LOCALHOST:1", 200),
                                         ("[::1]:8000", 200), ("127.0.0.1", 200)])
def test_a_foreign_host_header_is_refused(server, host, status):
    """DNS rebinding: a page on another site that points its name at 127.0.0.1 sends its own name as Host."""
    for path in ("/health", "/v1/models"):
        r = httpx.get(server["url"] + path, headers={"Host": host, "Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == status, (path, r.text)
        if status != 200:
            error_of(r, status, None)


# ------------------------------------------------------------------------------------------- thread pool


def test_chat_is_not_delayed_by_a_saturated_default_pool(server, client, tokenizer, monkeypatch):
    """Every thread of asyncio's default pool blocked (as long constraint compiles would): chat templates and
    tokenizing run in the app's own pool, so a chat request is still answered."""
    threads: list[str] = []
    template = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template",
                        lambda *a, **kw: (threads.append(threading.current_thread().name), template(*a, **kw))[1])
    release = threading.Event()
    loop = server["loop"]
    loop.call_soon_threadsafe(lambda: [loop.run_in_executor(None, release.wait, 60) for _ in range(64)])
    try:
        t = time.perf_counter()
        r = client.with_options(timeout=20).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert time.perf_counter() - t < 15
    finally:
        release.set()
    assert threads and all(name.startswith("jaxspec-text") for name in threads), threads
