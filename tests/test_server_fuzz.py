"""The server against hostile input, in-process: every request is answered 200 or 4xx, and the engine survives.

Hypothesis draws request bodies for /v1/completions and /v1/chat/completions from the request schema (every
field over its full range, unicode with astral characters and special-token text, nested values), then spoils
at most one thing: a wrong JSON type, a value out of range, a lone UTF-16 surrogate in a string, a bad message,
a bad prompt, an unknown field (refused by name, as OpenAI refuses unknown arguments). Raw bodies add what
`json.dumps` cannot write: NaN and Infinity literals, integers past Python's digit limit, nesting past the
parser's recursion limit, invalid UTF-8, bodies that are not objects, bodies over the size limit (with and
without a Content-Length).

A valid body must get 200 with a well-formed completion (or SSE stream); a spoiled one must get a 4xx whose
body is OpenAI's error object and whose `param` names the spoiled field by its dotted path. Afterwards
/health is 200, no request is left running and a greedy request still gives the text it gave before.

Targeted regression tests cover each known failure under hostile input (top_k=2**31, lone surrogates, body
size, NaN, a request failing inside the engine, cache_len beyond the model's context, tokenization on the event
loop), and the incremental detokenizer (`TextStream`) is checked against `tokenizer.decode` of the whole output and
for a per-token cost that does not grow with the output.

The app runs over a small random model that carries the real SmolLM2 tokenizer (49152 ids, byte-level BPE,
chat template), so every text path is the real one while the engine compiles and decodes in seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import os
import random
import threading
from typing import Any

import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import jaxspec
from jaxspec import SpecConfig
from jaxspec.engine import Engine, EngineConfig
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import Llama
from jaxspec.models.loading import named_model_path
from jaxspec.models.tokenizer import Tokenizer
from jaxspec.serving import create_app
from jaxspec.serving.protocol import NOT_SUPPORTED
from jaxspec.text import TextStream
from test_server import wait_for_idle  # the real server test's polling, over the in-process client here

pytestmark = pytest.mark.real_model  # the real tokenizer comes from the SmolLM2 GGUF

MODEL = "smollm2-tiny-random"
VOCAB = 49152  # SmolLM2's tokenizer
MAX_POSITIONS = 512
K = 3
CONFIG = EngineConfig(max_slots=2, slot_buckets=(1, 2), cache_len=256, chunk_steps=2, max_waiting=32,
                      spec=SpecConfig(method="sam", num_speculative_tokens=K))
MAX_BODY = 512 << 10  # this app's body limit; the server's default (2 MiB) is checked in tests/test_server.py
REQUEST_TIMEOUT_S = 300  # the longest any one answer may take (the first waits for no compile: warmup did it)
MAX_STOP_IDS = 8  # the engine's stop-id slots, EOS ids included
SETTINGS = settings(max_examples=int(os.environ.get("JAXSPEC_FUZZ_EXAMPLES", "100")), deadline=None,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

GREEDY_COMPLETION = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
GREEDY_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Write a haiku about JAX."}],
               "max_tokens": 8, "temperature": 0}


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    try:
        path = named_model_path("smollm2-135m")
    except ValueError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    tok = Tokenizer.from_gguf(path)
    assert tok.vocab_size == VOCAB
    return tok


@pytest.fixture(scope="module")
def small_lm(tokenizer):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=8, tie_word_embeddings=False, max_position_embeddings=MAX_POSITIONS)
    return jaxspec.LanguageModel.from_module(Llama(cfg, rngs=nnx.Rngs(0)), tokenizer=tokenizer, name=MODEL)


@dataclasses.dataclass
class Server:
    client: Any  # fastapi.testclient.TestClient, inside its context (the lifespan ran)
    engine: Engine
    tokenizer: Tokenizer
    baseline: dict  # the greedy texts answered before any hostile request


@pytest.fixture(scope="module")
def server(small_lm, tokenizer):
    from fastapi.testclient import TestClient

    engine = Engine(small_lm, CONFIG)
    app = create_app(engine, served_model_name=MODEL, max_body_bytes=MAX_BODY)
    # raise_server_exceptions=False: an unhandled error must show up as the 500 a client would get.
    with TestClient(app, raise_server_exceptions=False) as client:
        baseline = {}
        for path, body in (("/v1/completions", GREEDY_COMPLETION), ("/v1/chat/completions", GREEDY_CHAT)):
            r = request(client, "POST", path, json=body)
            assert r.status_code == 200, r.text
            baseline[path] = _texts(r.json())
        yield Server(client, engine, tokenizer, baseline)
    assert engine.failed is None, f"the engine failed: {engine.failed!r}"


def request(client, method: str, path: str, **kwargs):
    """`client.request(...)` that fails the test instead of hanging when no answer comes."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(client.request, method, path, **kwargs).result(REQUEST_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        body = kwargs.get("json", kwargs.get("content"))
        pytest.fail(f"{method} {path} got no answer within {REQUEST_TIMEOUT_S} s; body: {str(body)[:500]}")
    finally:
        pool.shutdown(wait=False)


def _texts(obj: dict) -> list[str]:
    return [c["text"] if "text" in c else c["message"]["content"] for c in obj["choices"]]


def metrics(client) -> dict[str, float]:
    r = request(client, "GET", "/metrics")
    assert r.status_code == 200
    return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples if not s.labels}


def wait_idle(client, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once no request runs or waits."""
    return wait_for_idle(lambda: metrics(client), timeout, 0.05)


def assert_healthy_and_unchanged(srv: Server) -> None:
    """/health 200, nothing left running, and the greedy requests answer exactly as before."""
    r = request(srv.client, "GET", "/health")
    assert r.status_code == 200, r.text
    wait_idle(srv.client)
    for path, body in (("/v1/completions", GREEDY_COMPLETION), ("/v1/chat/completions", GREEDY_CHAT)):
        r = request(srv.client, "POST", path, json=body)
        assert r.status_code == 200, r.text
        assert _texts(r.json()) == srv.baseline[path]


# ------------------------------------------------------------------------------------- what an answer is


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a body deserves. `param` None with ok False: a 4xx that need not name a field (not JSON text)."""

    ok: bool  # valid: 200 expected
    param: str | None = None  # the field a 4xx must name (its dotted path)
    either: bool = False  # 200 and a 4xx naming `param` both conform
    status: int | None = None  # the exact 4xx when it matters (413)


OK = Expect(ok=True)


def bad(param: str | None, status: int | None = None) -> Expect:
    return Expect(ok=False, param=param, status=status)


def names(param: str | None, expected: str) -> bool:
    """Whether `param` names the field at `expected` (the field itself, or its parent or child path)."""
    if param is None:
        return False
    return param == expected or expected.startswith(param + ".") or param.startswith(expected + ".")


def check_error(r) -> dict:
    assert 400 <= r.status_code < 500, f"HTTP {r.status_code}: {r.text[:1000]}"
    obj = r.json()
    assert set(obj) == {"error"}, obj
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    return err


def check_answer(r, expect: Expect, body: Any, chat: bool, num_choices: int | None = None,
                 prompt_tokens: int | None = None) -> None:
    where = f"\nbody: {str(body)[:2000]}\nresponse: HTTP {r.status_code} {r.text[:2000]}"
    assert r.status_code == 200 or 400 <= r.status_code < 500, "neither 200 nor 4xx" + where
    if r.status_code == 200:
        assert expect.ok or expect.either, "a bad body was accepted" + where
        check_completion(r, body, chat, num_choices, prompt_tokens, where)
        return
    err = check_error(r)
    assert not expect.ok, "a valid body was refused" + where
    if expect.status is not None:
        assert r.status_code == expect.status, where
    if expect.param is not None:
        assert names(err["param"], expect.param), f"param should name {expect.param!r}" + where


def check_completion(r, body: dict, chat: bool, num_choices: int | None, prompt_tokens: int | None,
                     where: str) -> None:
    """A 200 in OpenAI's format: every choice finished, usage consistent, text valid UTF-8."""
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    if body.get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream"), where
        events = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", "the stream did not end with [DONE]" + where
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), "an error event in a valid request's stream" + where
        finished: dict[int, str] = {}
        texts: dict[int, str] = {}
        for c in chunks:
            assert c["object"] == ("chat.completion.chunk" if chat else "text_completion"), where
            for ch in c["choices"]:
                piece = ch["delta"].get("content") if chat else ch["text"]
                texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
                if ch["finish_reason"] is not None:
                    assert ch["index"] not in finished, "a choice finished twice" + where
                    finished[ch["index"]] = ch["finish_reason"]
        if num_choices is not None:
            assert sorted(finished) == list(range(num_choices)), "a choice never finished" + where
        assert set(finished.values()) <= {"stop", "length"}, where
        usage = chunks[-1].get("usage") if chunks else None
        if (body.get("stream_options") or {}).get("include_usage"):
            assert usage is not None and chunks[-1]["choices"] == [], where
        choice_texts = list(texts.values())
    else:
        obj = r.json()
        assert obj["object"] == ("chat.completion" if chat else "text_completion"), where
        choices = obj["choices"]
        if num_choices is not None:
            assert sorted(c["index"] for c in choices) == list(range(num_choices)), where
        assert all(c["finish_reason"] in ("stop", "length") for c in choices), where
        wants = body.get("logprobs") is not None and body.get("logprobs") is not False
        for c in choices:
            assert (c["logprobs"] is not None) == wants, where
        usage = obj["usage"]
        choice_texts = _texts(obj)
        if max_tokens is not None:
            assert usage["completion_tokens"] <= max_tokens * len(choices), where
        assert usage["completion_tokens"] >= len(choices), where
    for text in choice_texts:
        text.encode("utf-8")  # no lone surrogate reaches a client
    if usage is not None:
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], where
        if prompt_tokens is not None:
            assert usage["prompt_tokens"] == prompt_tokens, where


# ------------------------------------------------------------------------------------------- strategies

# Text a client may send: any Unicode scalar value (astral planes, controls, NUL, BOM, U+FFFD), with the
# tokenizer's special-token text and multi-byte characters made likely.
SPECIAL_BITS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "😀", "👩‍👩‍👧", "𝔘𝔫𝔦", "中文", "é", "\u0000", "\ufeff",
                "\ufffd", "\r\n", " ", "\U0010ffff", "\U000e0001", "def f(x):"]
chars = st.characters(codec="utf-8")  # every code point but the surrogates
text_piece = st.one_of(st.text(chars, min_size=1, max_size=4), st.sampled_from(SPECIAL_BITS))
texts = st.lists(text_piece, min_size=1, max_size=4).map("".join)  # never empty
any_text = st.one_of(st.just(""), texts)
surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
token_ids = st.integers(0, VOCAB - 1)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), any_text)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)), max_leaves=8)

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "n", "stream", "stream_options", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "speculative", "user", "metadata", "prediction", "response_format"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "prompt_logprobs", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}

# Valid values of the fields both endpoints share, over their whole ranges, edges made likely.
COMMON_VALID = {
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 2, 0.0, 1e-45, 5e-324, 1e-38, 1e-37, 1e-6,
                                                                1e-5, 2.0])),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([1, 1e-38, 5e-324, 0.5])),
    "top_k": st.one_of(st.integers(-1, 64), st.integers(-1, 2**31 - 1),
                       st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1])),
    "min_p": st.one_of(st.floats(0, 1), st.sampled_from([0, 1, 1e-45])),
    "seed": st.one_of(st.none(), st.integers(), st.sampled_from([-1, 2**32, 2**63, 2**64, -2**64, 10**30])),
    "stop": st.one_of(st.none(), texts, st.lists(texts, max_size=4)),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "presence_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([0, -0.0, -2, 2, 1e-45])),
    "frequency_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([0, -2, 2])),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), st.sampled_from([1, 5e-324, 100])),
    "speculative": st.one_of(st.none(), st.just("off"), st.fixed_dictionaries({}, optional={
        "method": st.one_of(st.none(), st.sampled_from(["none", "ngram", "sam"])),
        "num_speculative_tokens": st.one_of(st.none(), st.integers(0, K))})),
    "user": st.one_of(st.none(), any_text),
}


@st.composite
def stop_token_ids(draw, ignore_eos: bool):
    most = MAX_STOP_IDS - (0 if ignore_eos else 2)  # SmolLM2 has two EOS ids
    return draw(st.one_of(st.none(), st.lists(token_ids, max_size=most)))


@st.composite
def unknown_fields(draw, known: set[str]) -> dict:
    keys = st.text(chars, min_size=1, max_size=8).filter(lambda k: k not in known and k not in NOT_SUPPORTED)
    return draw(st.dictionaries(keys, json_values, min_size=1, max_size=1))


completion_prompts = st.one_of(
    texts, st.lists(token_ids, min_size=1, max_size=40), st.lists(texts, min_size=1, max_size=2),
    st.lists(st.lists(token_ids, min_size=1, max_size=20), min_size=1, max_size=2))

content_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": any_text}), max_size=2)
roles = st.sampled_from(["system", "developer", "user", "assistant"])
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": st.one_of(any_text, content_parts)},
                                          optional={"name": texts}), min_size=1, max_size=3)


@st.composite
def valid_body(draw, chat: bool) -> dict:
    """A body the server must serve (context permitting: `predict` checks the token counts)."""
    body = {"model": MODEL}
    if chat:
        body["messages"] = draw(messages)
        key = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
        body[key] = draw(st.integers(1, 6))
    else:
        body["prompt"] = draw(completion_prompts)
        body["max_tokens"] = draw(st.integers(1, 6))
    for name in sorted(COMMON_VALID):
        if draw(st.booleans()):
            value = draw(COMMON_VALID[name])
            if value is not None or draw(st.booleans()):
                body[name] = value
    if "ignore_eos" in body or draw(st.booleans()):
        body["stop_token_ids"] = draw(stop_token_ids(bool(body.get("ignore_eos"))))
    if chat:
        if draw(st.booleans()):
            body["logprobs"] = draw(st.booleans())
            if body["logprobs"] and draw(st.booleans()):
                body["top_logprobs"] = draw(st.integers(0, 20))
    else:
        if draw(st.booleans()):
            body["logprobs"] = draw(st.one_of(st.none(), st.integers(0, 5)))
        if draw(st.booleans()):
            body["echo"] = draw(st.booleans())
        if draw(st.booleans()):
            body["prompt_logprobs"] = draw(st.one_of(st.none(), st.integers(0, 20)))
    return body


def with_surrogate(draw, text: str) -> str:
    i = draw(st.integers(0, len(text)))
    return text[:i] + draw(surrogates) + text[i:]


# Wrong JSON types per kind of field (strict types: a string is not a number, a bool is not an int).
NOT_A_NUMBER = st.one_of(texts, st.booleans(), st.lists(st.integers(), max_size=2), st.just({}), st.just(None))
NOT_AN_INT = st.one_of(texts, st.booleans(), st.sampled_from([1.5, 2.0, -0.5]), st.just([1]), st.just({"a": 1}))
NOT_A_BOOL = st.one_of(st.sampled_from([0, 1, "true", "false", 1.0, None]), st.just([True]))
NOT_A_STRING = st.one_of(st.integers(), st.booleans(), st.just([]), st.just({"text": "x"}), st.floats(-1, 1))

# (field, strategy of spoiled values, the param a 4xx must name); the param None means "the field itself".
SPOILERS_COMMON = [
    ("temperature", NOT_A_NUMBER, None),
    ("temperature", st.one_of(st.floats(max_value=-5e-324, allow_infinity=False),
                              st.floats(min_value=2, exclude_min=True, allow_infinity=False)), None),
    ("top_p", NOT_A_NUMBER, None),
    ("top_p", st.one_of(st.floats(max_value=0, allow_infinity=False),
                        st.floats(min_value=1, exclude_min=True, allow_infinity=False)), None),
    ("top_k", NOT_AN_INT, None),
    ("top_k", st.integers(max_value=-2), None),
    ("min_p", NOT_A_NUMBER, None),
    ("min_p", st.one_of(st.floats(max_value=-5e-324, allow_infinity=False),
                        st.floats(min_value=1, exclude_min=True, allow_infinity=False)), None),
    ("max_tokens", NOT_AN_INT, None),
    ("max_tokens", st.one_of(st.integers(max_value=0), st.integers(min_value=CONFIG.cache_len)), None),
    ("n", NOT_AN_INT, None),
    ("n", st.one_of(st.integers(max_value=0), st.integers(min_value=17)), None),
    ("seed", NOT_AN_INT.filter(lambda v: v is not None), None),
    ("stop", st.one_of(NOT_A_STRING.filter(lambda v: v != []), st.just(""), st.just(["a", ""]),
                       st.lists(texts, min_size=5, max_size=6), st.just([1])), None),
    ("stop_token_ids", st.one_of(st.just("1"), st.just([1.5]), st.just([True]),
                                 st.lists(st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB)),
                                          min_size=1, max_size=3),
                                 st.lists(token_ids, min_size=MAX_STOP_IDS + 1, max_size=MAX_STOP_IDS + 3)), None),
    ("ignore_eos", NOT_A_BOOL, None),
    ("stream", NOT_A_BOOL, None),
    ("stream_options", st.one_of(st.just("yes"), st.just([]), st.just({"include_usage": "yes"})), None),
    ("presence_penalty", st.one_of(st.floats(allow_nan=False, allow_infinity=False).filter(lambda v: abs(v) > 2),
                                   NOT_A_NUMBER), None),
    ("frequency_penalty", st.sampled_from([2.5, -2.001, 1e300, "0"]), None),
    ("repetition_penalty", st.one_of(st.sampled_from([0, -1, -1e-300, "1", 100.001, 1e30, 1e308]), NOT_A_NUMBER),
     None),
    ("speculative", st.one_of(st.integers(), st.just("on"), st.just([]),
                              st.just({"method": "bogus"}), st.just({"method": 3})), None),
    ("speculative", st.sampled_from([{"method": "eagle"}, {"method": "medusa"}, {"method": "eagle2"}]),
     "speculative.method"),
    ("speculative", st.one_of(st.integers(max_value=-1), st.integers(min_value=K + 1)).map(
        lambda k: {"num_speculative_tokens": k}), "speculative.num_speculative_tokens"),
    ("speculative", st.just({"method": "sam", "draft": 4}), "speculative.draft"),
    ("user", NOT_A_STRING, None),
    ("model", st.one_of(texts.filter(lambda s: s != MODEL), NOT_A_STRING, st.just(None)), None),
]
SPOILERS_COMPLETION = SPOILERS_COMMON + [
    ("prompt", st.sampled_from(["", [], [[]], [""], [VOCAB], [-1], [[1, 2], []], ["a", 1], [[1, "a"]], {"a": 1},
                                3, None, True, [1.5], [[VOCAB + 5]]]), None),
    ("prompt", st.integers(CONFIG.max_context, CONFIG.cache_len * 2).map(lambda n: [7] * n), None),
    ("prompt", st.integers(CONFIG.max_context, CONFIG.cache_len * 2).map(lambda n: "ab " * n), None),
    ("logprobs", st.one_of(NOT_AN_INT.filter(lambda v: v is not None), st.integers(max_value=-1),
                           st.integers(min_value=6)), None),
    ("echo", NOT_A_BOOL.filter(lambda v: v is not None), None),
    ("prompt_logprobs", st.one_of(NOT_AN_INT.filter(lambda v: v is not None), st.integers(max_value=-1),
                                  st.integers(min_value=21)), None),
]
SPOILERS_CHAT = SPOILERS_COMMON + [
    ("messages", st.one_of(st.just([]), st.just(None), st.just("hi"), st.just({"role": "user"}), st.just([1])),
     None),
    ("top_logprobs", st.integers(0, 20), None),  # without logprobs=true
    ("max_completion_tokens", st.one_of(NOT_AN_INT, st.integers(max_value=0)), None),
]


@st.composite
def spoiled_body(draw, chat: bool) -> tuple[dict, Expect]:
    """A valid body with one thing wrong, and the field a 4xx must name."""
    body = draw(valid_body(chat))
    kind = draw(st.sampled_from(["field", "field", "field", "surrogate", "missing", "unknown", "message"]
                                if chat else ["field", "field", "field", "surrogate", "missing", "unknown"]))
    if kind == "missing":
        name = draw(st.sampled_from(["model", "messages" if chat else "prompt"]))
        del body[name]
        return body, bad(name)
    if kind == "unknown":
        extra = draw(unknown_fields(CHAT_FIELDS if chat else COMPLETION_FIELDS))
        body.update(extra)
        return body, bad(next(iter(extra)))
    if kind == "message" and chat:
        i = draw(st.integers(0, len(body["messages"]) - 1))
        m = dict(body["messages"][i])
        body["messages"] = list(body["messages"])
        field, value = draw(st.sampled_from([
            ("role", "wizard"), ("role", None), ("role", 1), ("content", 5), ("content", None),
            ("content", [{"type": "image_url", "image_url": {"url": "x"}}]), ("content", [{"text": "no type"}]),
            ("content", [{"type": "text", "text": 3}]), ("name", 7), (None, None)]))
        if field is None:
            body["messages"][i] = "a message that is not an object"
            return body, bad(f"messages.{i}")
        m[field] = value
        body["messages"][i] = m
        return body, bad(f"messages.{i}.{field}")
    if kind == "surrogate":
        return surrogate_body(draw, body, chat)
    field, values, param = draw(st.sampled_from(SPOILERS_CHAT if chat else SPOILERS_COMPLETION))
    value = draw(values)
    body[field] = value
    if field == "top_logprobs":
        body.pop("logprobs", None)
    if field == "max_completion_tokens":
        body.pop("max_tokens", None)
    if field == "max_tokens" and value == 0:
        body.pop("echo", None)  # max_tokens 0 asks for the echoed prompt alone: valid only with echo
    if field == "stop_token_ids" and isinstance(value, list) and len(value) > MAX_STOP_IDS:
        body.pop("ignore_eos", None)
    return body, bad(param or field)


def surrogate_body(draw, body: dict, chat: bool) -> tuple[dict, Expect]:
    """A lone surrogate put into one of the body's strings (valid otherwise): 400 naming that string."""
    targets = [("model",), ("stop",), ("user",)]
    if chat:
        for i, m in enumerate(body["messages"]):
            targets.append(("messages", i, "content"))
            targets.append(("messages", i, "name"))
            if isinstance(m["content"], list):
                targets += [("messages", i, "content", j, "text") for j in range(len(m["content"]))]
    else:
        targets.append(("prompt",))
    path = draw(st.sampled_from(targets))
    value = _get(body, path)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        j = draw(st.integers(0, len(value) - 1))
        path = (*path, j)
        value = value[j]
    if not isinstance(value, str):
        value = draw(texts)
    _set(body, path, with_surrogate(draw, value))
    return body, bad(".".join(str(p) for p in path))


def _get(obj, path):
    for p in path:
        try:
            obj = obj[p]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _set(obj, path, value):
    for p in path[:-1]:
        obj[p] = dict(obj[p]) if isinstance(obj[p], dict) else list(obj[p])
        obj = obj[p]
    obj[path[-1]] = value


def predict(tokenizer: Tokenizer, body: dict, chat: bool) -> tuple[Expect, int | None, int | None]:
    """For a valid body: the context check the server makes after tokenizing (prompt too long, prompt +
    max_tokens past the context), the number of choices and the prompt tokens usage must report."""
    limit = CONFIG.max_context
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    n = body.get("n", 1)
    if chat:
        msgs = [{"role": "system" if m["role"] == "developer" else m["role"],
                 "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])}
                for m in body["messages"]]
        try:
            prompts = [tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))]
        except ValueError:  # the template refuses these messages
            return bad("messages"), None, None
        field = "messages"
    else:
        p = body["prompt"]
        items = [p] if isinstance(p, str) or all(isinstance(t, int) for t in p) else p
        prompts = [tokenizer.encode(x) if isinstance(x, str) else list(x) for x in items]
        field = "prompt"
    for ids in prompts:
        if len(ids) >= limit:
            return bad(field), None, None
        if max_tokens is not None and len(ids) + max_tokens > limit:
            return bad("max_tokens"), None, None
    return OK, n * len(prompts), sum(len(ids) for ids in prompts)


def encode_body(body: Any, raw_utf8: bool) -> bytes:
    """JSON bytes: ASCII with \\u escapes (a lone surrogate becomes a valid escape), or raw UTF-8 (a lone
    surrogate becomes the invalid bytes ED A0 80 ...)."""
    if raw_utf8:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(body).encode("ascii")


def post(srv: Server, path: str, content: bytes | Any, headers: dict | None = None):
    return request(srv.client, "POST", path, content=content,
                   headers={"content-type": "application/json", **(headers or {})})


# ------------------------------------------------------------------------------------------- fuzz tests


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@SETTINGS
@given(data=st.data())
def test_fuzzed_bodies_get_200_or_a_4xx_naming_the_field(server, chat, data):
    """Any body drawn from the schema, valid or with one thing spoiled, gets 200 with a well-formed completion
    or a 4xx whose error object names the spoiled field; never a 5xx, never a hang."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    spoil = data.draw(st.booleans(), label="spoil")
    if spoil:
        body, expect = data.draw(spoiled_body(chat), label="body")
        num_choices = prompt_tokens = None
    else:
        body = data.draw(valid_body(chat), label="body")
        expect, num_choices, prompt_tokens = predict(server.tokenizer, body, chat)
    raw = data.draw(st.booleans(), label="raw utf-8")
    content = encode_body(body, raw)
    if raw and not expect.ok and any(0xD800 <= ord(c) <= 0xDFFF for c in json.dumps(body, ensure_ascii=False)):
        expect = bad(None)  # the body is not UTF-8: the whole body is at fault, no field can be named
    r = post(server, path, content)
    check_answer(r, expect, body, chat, num_choices, prompt_tokens)


def _with_literal(body: dict, field: str, literal: str) -> bytes:
    """The body with `literal` written as `field`'s raw JSON value."""
    marker = "__JAXSPEC_LITERAL__"
    return json.dumps({**body, field: marker}).replace(f'"{marker}"', literal).encode()


@st.composite
def raw_body(draw) -> tuple[bytes, Expect, dict | None]:
    """Bytes `json.dumps` would not write, each with what it deserves."""
    body = {"model": MODEL, "prompt": draw(texts), "max_tokens": draw(st.integers(1, 4))}
    kind = draw(st.sampled_from(["constant", "overflow", "digits", "deep", "utf8", "not_object", "truncated",
                                 "duplicate", "oversize", "at_limit", "bom"]))
    if kind == "constant":  # NaN, Infinity, -Infinity: Python's json takes them, JSON does not
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "[NaN]", '{"a": -Infinity}']))
        field = draw(st.sampled_from(["temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "n",
                                      "presence_penalty", "stop_token_ids", "speculative", "x_unknown"]))
        return _with_literal(body, field, literal), bad(None), None
    if kind == "overflow":  # 1e400 parses to inf
        literal = draw(st.sampled_from(["1e400", "-1e400"]))
        field = draw(st.sampled_from(["temperature", "top_p", "min_p", "presence_penalty", "max_tokens", "seed"]))
        return _with_literal(body, field, literal), bad(field), None
    if kind == "digits":  # past Python's int digit limit (4300): json.loads raises ValueError
        field = draw(st.sampled_from(["max_tokens", "seed", "top_k", "x_unknown"]))
        return _with_literal(body, field, "1" * draw(st.integers(4400, 20000))), bad(None), None
    if kind == "deep":
        depth = draw(st.sampled_from([50, 900, 5000, 60_000]))  # all under MAX_BODY
        field = draw(st.sampled_from(["prompt", "stop", "x_unknown", "speculative"]))
        nested = draw(st.sampled_from(["[" * depth + "]" * depth, '{"a": ' * depth + "1" + "}" * depth]))
        # Shallow: a 400 naming the field (an unknown one too). Deep: the parser may give up (400, no field to
        # name) or not (then a 400 naming the field).
        expect = bad(field) if depth <= 100 else bad(None)
        return _with_literal(body, field, nested), expect, body
    if kind == "utf8":  # invalid UTF-8 inside a string
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf",
                                     b"\xf4\x90\x80\x80"]))
        text = json.dumps(body).encode()
        i = text.index(b'"prompt": "') + len(b'"prompt": "')
        return text[:i] + junk + text[i:], bad(None), None
    if kind == "not_object":
        return draw(st.sampled_from([b"[]", b"[1, 2]", b"null", b"1", b'"x"', b"true", b"", b" ", b"{}"])), \
            bad(None), None
    if kind == "truncated":
        text = json.dumps(body).encode()
        return text[: draw(st.integers(0, len(text) - 1))], bad(None), None
    if kind == "duplicate":  # the last value wins, as in every JSON parser this server could use
        text = json.dumps(body)[:-1] + ', "max_tokens": 2}'
        return text.encode(), Expect(ok=True, either=True), {**body, "max_tokens": 2}
    if kind in ("oversize", "at_limit"):
        field = draw(st.sampled_from(["prompt", "x_padding", "user"]))
        base = len(json.dumps({**body, field: ""}).encode())
        size = MAX_BODY + draw(st.integers(1, 4096)) if kind == "oversize" else MAX_BODY
        padded = json.dumps({**body, field: "x" * (size - base)}).encode()
        assert len(padded) == size
        if kind == "oversize":
            return padded, bad(None, status=413), None
        # At the limit exactly: read and judged on its content (a prompt far past the context: 400).
        return padded, (bad(field) if field in ("prompt", "x_padding") else OK), {**body, field: "..."}
    assert kind == "bom"
    return b"\xef\xbb\xbf" + json.dumps(body).encode(), Expect(ok=False, either=True), body


@SETTINGS
@given(case=raw_body(), chunked=st.booleans())
def test_fuzzed_raw_bodies(server, case, chunked):
    """Bodies that are not the JSON a client library writes: NaN/Infinity literals and invalid UTF-8 get 400,
    numbers past the parser's limits and nesting past its recursion limit 400, bodies over the limit 413 (with
    a Content-Length or streamed without one), never a 500."""
    content, expect, body = case
    if chunked:  # Transfer-Encoding: chunked, no Content-Length: the limit must be enforced as bytes arrive
        data = content
        content = iter([data[i: i + 65536] for i in range(0, len(data), 65536)] or [b""])
    r = post(server, "/v1/completions", content)
    check_answer(r, expect, body or {"raw": case[0][:200]}, chat=False)
    if expect.status == 413:
        assert check_error(r)["code"] == "request_too_large"


def test_after_the_fuzzing_the_server_is_healthy_and_unchanged(server):
    """After every hostile request above: /health 200, no request running or waiting, the engine not failed,
    and the greedy requests answer exactly the text they gave before."""
    assert server.engine.failed is None
    assert_healthy_and_unchanged(server)


# ------------------------------------------------------------------------- regressions: hostile input


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("top_k", [2**31 - 1, 2**31, 2**32, 2**63, 2**64 + 1])
def test_huge_top_k_is_answered_and_the_engine_survives(server, chat, top_k):
    """top_k=2**31 used to pass validation and overflow int32 on the engine thread, failing the whole engine
    (every later request 503). Up to 2**31 - 1 it is served (above the vocabulary: no limit); beyond, 200 or
    a 400 naming top_k; either way the engine keeps serving."""
    body = dict(GREEDY_CHAT if chat else GREEDY_COMPLETION, top_k=top_k, temperature=0.7, seed=1, max_tokens=4)
    r = post(server, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode())
    if top_k <= 2**31 - 1:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert check_error(r)["param"] == "top_k"
    assert_healthy_and_unchanged(server)


def test_top_k_above_the_vocabulary_is_no_limit(server):
    """A seeded request with top_k past the vocabulary samples exactly as with top_k=0 (no limit)."""
    base = dict(GREEDY_COMPLETION, temperature=0.9, seed=1234, max_tokens=6)
    texts_ = []
    for top_k in (0, VOCAB, VOCAB + 1, 2**31 - 1):
        r = post(server, "/v1/completions", json.dumps(dict(base, top_k=top_k)).encode())
        assert r.status_code == 200, r.text
        texts_.append(_texts(r.json()))
    assert all(t == texts_[0] for t in texts_), texts_


@pytest.mark.parametrize("seed", [-1, 2**32, 2**32 + 5, 2**64, -2**70, 10**40])
def test_any_integer_seed_is_served_mod_2_32(server, seed):
    """seed takes any integer and is reduced mod 2**32: the same text as the reduced seed."""
    base = dict(GREEDY_COMPLETION, temperature=0.9, max_tokens=6)
    got = post(server, "/v1/completions", json.dumps(dict(base, seed=seed)).encode())
    want = post(server, "/v1/completions", json.dumps(dict(base, seed=seed % 2**32)).encode())
    assert got.status_code == 200 and want.status_code == 200, (got.text, want.text)
    assert _texts(got.json()) == _texts(want.json())


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 5e-38, 1e-37, 1e-30, 1e-10])
def test_tiny_temperatures_are_served_like_greedy(server, temperature):
    """Dividing logits by a temperature of 1e-38 overflowed to inf; a tiny temperature must be served (and,
    sampling from a near-point mass, give the greedy text)."""
    body = dict(GREEDY_COMPLETION, temperature=temperature, seed=3)
    r = post(server, "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 200, r.text
    assert _texts(r.json()) == server.baseline["/v1/completions"]


SURROGATE_CASES = [
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": "def f(x):\udfff return x"}, "prompt"),
    ("/v1/completions", {"prompt": ["def f(x):", "\ud83d"]}, "prompt.1"),
    ("/v1/completions", {"prompt": "def f(x):", "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"prompt": "def f(x):", "stop": ["\n", "a\udc00"]}, "stop.1"),
    ("/v1/completions", {"prompt": "def f(x):", "user": "\ud800"}, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "hi"},
                                           {"role": "user", "content": "\ude00\ud83d"}]}, "messages.1.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"},
                                                                       {"type": "text", "text": "x\ud800"}]}]},
     "messages.0.content.1.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": "\ud800"}, "stop"),
]


@pytest.mark.parametrize("path,change,param", SURROGATE_CASES, ids=[p for _, _, p in SURROGATE_CASES])
def test_a_lone_surrogate_gets_400_naming_the_field(server, path, change, param):
    """A lone surrogate (valid JSON as a \\u escape, invalid Unicode) made the tokenizer raise TypeError: HTTP
    500. It must be a 400 naming the string's field (the field itself, or its item's path)."""
    base = GREEDY_CHAT if "chat" in path else GREEDY_COMPLETION
    body = {k: v for k, v in base.items() if k not in ("prompt", "messages")} | change
    content = json.dumps(body).encode("ascii")
    assert b"\\ud" in content  # sent as an escape: the body itself is valid JSON in valid UTF-8
    r = post(server, path, content)
    assert r.status_code == 400, r.text
    err = check_error(r)
    field = param.split(".")[0] if param.split(".")[-1].isdigit() else param
    assert err["param"] in (param, field), err
    assert_healthy_and_unchanged(server)


def test_a_surrogate_pair_escape_is_one_astral_character(server, tokenizer):
    """"\\ud83d\\ude00" in JSON is the valid pair for U+1F600: served, with the tokens of that character."""
    content = b'{"model": "%s", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2, "temperature": 0}' % MODEL.encode()
    r = post(server, "/v1/completions", content)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("smile \U0001F600"))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_3_mb_body_gets_413(server, chunked):
    """A 3 MB body is refused with 413 and the error object (code request_too_large), whether it declares its
    length or streams without one, and the server keeps serving."""
    body = json.dumps({**GREEDY_COMPLETION, "prompt": "def f(x): " * 300_000}).encode()
    assert len(body) > 3_000_000
    content = iter([body[i: i + 65536] for i in range(0, len(body), 65536)]) if chunked else body
    r = post(server, "/v1/completions", content)
    assert r.status_code == 413, r.text[:500]
    assert check_error(r)["code"] == "request_too_large"
    r = post(server, "/v1/chat/completions",
             json.dumps({**GREEDY_CHAT, "messages": [{"role": "user", "content": "x" * 3_000_000}]}).encode())
    assert r.status_code == 413 and check_error(r)["code"] == "request_too_large"
    assert_healthy_and_unchanged(server)


def test_the_default_body_limit_is_2_mib():
    """`create_app`'s max_body_bytes defaults to 2 MiB (the real server's 413 is in tests/test_server.py)."""
    assert inspect.signature(create_app).parameters["max_body_bytes"].default == 2 << 20


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "max_tokens", "seed"])
def test_nan_and_infinity_literals_get_400(server, literal, field):
    """JSON has no NaN or Infinity; Python's parser takes them. They must be refused (400), not reach
    sampling as nan/inf."""
    r = post(server, "/v1/completions", _with_literal(GREEDY_COMPLETION, field, literal))
    assert r.status_code == 400, r.text
    check_error(r)


def test_too_many_digits_and_too_deep_nesting_get_400(server):
    """An integer of 5000 digits (json.loads raises ValueError, not JSONDecodeError) and arrays or objects
    nested 60000 deep (RecursionError), all under the body limit, are client errors: 400."""
    for content in (_with_literal(GREEDY_COMPLETION, "max_tokens", "9" * 5000),
                    _with_literal(GREEDY_COMPLETION, "prompt", "[" * 100_000 + "]" * 100_000),
                    _with_literal(GREEDY_COMPLETION, "x_unknown", '{"a":' * 60_000 + "1" + "}" * 60_000)):
        r = post(server, "/v1/completions", content)
        assert r.status_code == 400, r.text[:500]
        check_error(r)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_failing_in_the_engine_is_answered_and_the_next_is_served(server, monkeypatch, stream):
    """The engine's prefill raises for one request: that request alone fails (HTTP 500 with the error object;
    a stream ends with an error event), /health stays 200 and the next request gets its usual text."""
    engine = server.engine
    real_prefill = engine.runner.prefill
    failures = []

    def prefill_failing_once(*args, **kwargs):
        if not failures:
            failures.append(threading.current_thread().name)
            raise RuntimeError("simulated device failure during prefill")
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "prefill", prefill_failing_once)
    body = dict(GREEDY_COMPLETION, stream=stream)
    r = post(server, "/v1/completions", json.dumps(body).encode())
    assert failures, "the simulated failure never ran: the engine no longer admits through Runner.prefill"
    if stream:
        assert r.status_code == 200, r.text
        events = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c["error"] for c in chunks if "error" in c]
        finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
        assert errors or finishes == ["error"], f"a failed stream looked like a success: {r.text}"
        for e in errors:
            assert set(e) == {"message", "type", "param", "code"}, e
        assert finishes in ([], ["error"]), finishes
    else:
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert engine.failed is None, f"one request's failure failed the engine: {engine.failed!r}"
    assert_healthy_and_unchanged(server)


def test_cache_len_beyond_the_model_context_is_refused(small_lm):
    """A cache longer than the model's max_position_embeddings would decode at positions the model was never
    built for: Engine refuses it with a ValueError naming cache_len."""
    with pytest.raises(ValueError, match="cache_len"):
        Engine(small_lm, EngineConfig(max_slots=1, cache_len=2 * MAX_POSITIONS))
    Engine(small_lm, EngineConfig(max_slots=1, cache_len=MAX_POSITIONS))  # exactly the context: fine


def test_models_reports_a_max_model_len_within_the_model_context(server):
    """/v1/models reports max_model_len no larger than the model's context, and requests up to it fit."""
    r = request(server.client, "GET", "/v1/models")
    assert r.status_code == 200
    (entry,) = r.json()["data"]
    assert entry["id"] == MODEL
    assert 1 <= entry["max_model_len"] <= min(MAX_POSITIONS, CONFIG.cache_len)
    limit = entry["max_model_len"]
    ok = post(server, "/v1/completions", json.dumps(dict(GREEDY_COMPLETION, prompt=[5] * (limit - 2),
                                                         max_tokens=2)).encode())
    assert ok.status_code == 200, ok.text
    over = post(server, "/v1/completions", json.dumps(dict(GREEDY_COMPLETION, prompt=[5] * (limit - 2),
                                                           max_tokens=3)).encode())
    assert over.status_code == 400 and check_error(over)["param"] == "max_tokens", over.text


def test_large_prompts_are_tokenized_off_the_event_loop(server, monkeypatch):
    """Tokenizing a 0.9 MB prompt on the event loop stalled every stream for a second. A large prompt (or chat
    message) must be tokenized in a worker thread: the tokenizer is never called from the running loop."""
    tok = server.tokenizer
    calls = []
    real_encode, real_template = tok.encode, tok.apply_chat_template

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    def encode(text, *args, **kwargs):
        calls.append(("encode", len(text), on_loop()))
        return real_encode(text, *args, **kwargs)

    def apply_chat_template(messages, *args, **kwargs):
        calls.append(("apply_chat_template", sum(len(m["content"]) for m in messages), on_loop()))
        return real_template(messages, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    monkeypatch.setattr(tok, "apply_chat_template", apply_chat_template)
    big = "def f(x): return x\n" * 20_000  # 380 kB, under this app's limit; far past the context
    r = post(server, "/v1/completions", json.dumps(dict(GREEDY_COMPLETION, prompt=big)).encode())
    assert r.status_code == 400 and check_error(r)["param"] == "prompt", r.text[:500]
    r = post(server, "/v1/chat/completions",
             json.dumps(dict(GREEDY_CHAT, messages=[{"role": "user", "content": big}])).encode())
    assert r.status_code == 400 and check_error(r)["param"] == "messages", r.text[:500]
    large = [c for c in calls if c[1] >= len(big)]
    assert {c[0] for c in large} == {"encode", "apply_chat_template"}, calls
    assert not [c for c in large if c[2]], f"tokenized on the event loop: {[c for c in large if c[2]]}"


# ------------------------------------------------------------------------------- incremental detokenizer


class CountingTokenizer:
    """The tokenizer with its decoding work counted: ids passed to `decode` (here and on the backend) and
    tokens looked up one by one (`token_bytes`, `id_to_token`)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.work = 0

    def decode(self, ids, *args, **kwargs):
        self.work += len(ids)
        return self._tok.decode(ids, *args, **kwargs)

    def token_bytes(self, i):
        self.work += 1
        return self._tok.token_bytes(i)

    def id_to_token(self, i):
        self.work += 1
        return self._tok.id_to_token(i)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def token_pool(tokenizer) -> list[int]:
    """Token ids that make detokenization hard: pieces of multi-byte characters (emoji, CJK, accents), special
    tokens, whitespace, plus stop-string material."""
    samples = ["😀👍🏽👩‍👩‍👧", "中文字符測試", "héllo wörld ñ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\ufffd", "  \n\t",
               "def f(x):\n    return x", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "STOP", "END\n", "Ω≈ç√∫",
               "\U0010fffd"]
    pool = sorted({i for s in samples for i in tokenizer.encode(s)} | set(range(17)))
    return pool


@st.composite
def token_streams(draw, pool: list[int]) -> list[int]:
    return draw(st.lists(st.one_of(st.sampled_from(pool), token_ids), min_size=1, max_size=48))


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for s in sizes:
        if i >= len(ids):
            break
        out.append(ids[i: i + s])
        i += s
    if i < len(ids):
        out.append(ids[i:])
    return out


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_text_stream_equals_decoding_the_whole_output(tokenizer, token_pool, data):
    """Fed in chunks of any size, the released text is exactly `decode(all ids, skip_special_tokens=True)`:
    characters split across tokens come out whole, special tokens vanish, nothing is lost or doubled."""
    ids = data.draw(token_streams(token_pool), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 9), max_size=len(ids)), label="chunk sizes")
    count_only = data.draw(st.lists(token_ids, max_size=1), label="count only")
    stream = TextStream(tokenizer, ())
    pieces = [stream.add(chunk) for chunk in chunked(ids, sizes)]
    if count_only:
        pieces.append(stream.add([], count_only))
    pieces.append(stream.finish())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert stream.num_tokens == len(ids) + len(count_only)
    assert not stream.stopped


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_text_stream_stops_at_the_first_stop_string(tokenizer, token_pool, data):
    """Stop strings taken from the output itself, split across tokens: the text ends right before the first
    stop string to appear, the token count includes the token completing it, and no text released on the way
    was ever part of a stop string."""
    ids = data.draw(token_streams(token_pool), label="ids")
    full = tokenizer.decode(ids, skip_special_tokens=True)
    clean = full.replace("\ufffd", "")
    stops = []
    for _ in range(data.draw(st.integers(1, 3), label="stop count")):
        if len(clean) >= 1 and data.draw(st.booleans()):
            a = data.draw(st.integers(0, len(clean) - 1))
            b = data.draw(st.integers(a + 1, min(len(clean), a + 6)))
            stop = clean[a:b]
        else:
            stop = data.draw(st.text(chars, min_size=1, max_size=3))
        if "\ufffd" not in stop:
            stops.append(stop)
    stops = stops or ["\x00never"]
    # The reference: decode every prefix; the first prefix holding a stop string ends the text there.
    want_text, want_tokens, found = full, len(ids), False
    for i in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:i], skip_special_tokens=True)
        hits = [prefix.find(s) for s in stops if s in prefix]
        if hits:
            want_text, want_tokens, found = prefix[: min(hits)], i, True
            break
    sizes = data.draw(st.lists(st.integers(1, 5), max_size=len(ids)), label="chunk sizes")
    stream = TextStream(tokenizer, stops)
    released = ""
    for chunk in chunked(ids, sizes):
        released += stream.add(chunk)
        assert want_text.startswith(released), (released, want_text)
    released += stream.finish()
    assert released == want_text, (stops, released, want_text)
    assert stream.stopped == found
    assert stream.num_tokens == want_tokens


def test_text_stream_cost_per_token_does_not_grow(tokenizer, token_pool):
    """Decoding work per token (ids passed to decode, tokens looked up) is the same at token 4000 as at token
    400: the old TextStream re-decoded the whole output on every token (quadratic)."""
    rng = random.Random(0)
    ids = [rng.choice(token_pool) if rng.random() < 0.5 else rng.randrange(17, VOCAB) for _ in range(4000)]
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting, ["\x00never stop"])
    costs, text = [], ""
    for t in ids:
        before = counting.work
        text += stream.add([t])
        costs.append(counting.work - before)
    text += stream.finish()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(costs) > 0, "no decoding work was counted: this test no longer sees how TextStream decodes"
    early, late = costs[300:800], costs[-500:]
    assert max(late) <= 64, f"one token cost {max(late)} ids of decoding late in the output"
    assert sum(late) / len(late) <= 2 * sum(early) / len(early) + 4, (sum(early), sum(late))


def test_many_small_prompts_are_not_tokenized_on_the_event_loop(server, monkeypatch):
    """One body may hold 100000 one-character prompts (500 kB): tokenized one by one on the event loop they
    stall every stream for seconds, as one large prompt did. At most 64 kB of a request's text may be tokenized
    on the loop, and the request is refused (4xx), not fanned out into 100000 completions."""
    tok = server.tokenizer
    on_loop_chars = []
    real_encode = tok.encode

    def encode(text, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop_chars.append(len(text))
        except RuntimeError:
            pass
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    body = dict(GREEDY_COMPLETION, prompt=["a"] * 100_000, max_tokens=1)
    content = json.dumps(body).encode()
    assert len(content) < MAX_BODY
    r = post(server, "/v1/completions", content)
    check_error(r)
    assert sum(on_loop_chars) <= 64 << 10, f"{len(on_loop_chars)} prompts tokenized on the event loop"
    assert_healthy_and_unchanged(server)


@pytest.mark.parametrize("method,path", [("GET", "/v1/completions"), ("POST", "/v1/nothing"),
                                         ("DELETE", "/v1/chat/completions"), ("POST", "/health")])
def test_unknown_routes_and_methods_get_the_error_object(server, method, path):
    """A wrong path or method is a 4xx with OpenAI's error object too, as every answer of this API is."""
    r = request(server.client, method, path, content=b"{}")
    assert r.status_code in (404, 405), r.text
    check_error(r)
