"""The OpenAI-compatible server, driven over real HTTP on 127.0.0.1 by the official `openai` client.

One server process (`python scripts/serve.py`, real SmolLM2 weights, real HumanEval prompts) serves the whole
module; its greedy and seeded outputs must equal offline `jaxspec.generate` token for token, bad input must
get an HTTP 400 naming the field while the server keeps serving, disconnecting clients must not leak rows,
and SIGTERM must let an in-flight request finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import jaxspec
from jaxspec import SamplingParams

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
MAX_SLOTS, MAX_WAITING, CACHE_LEN = 8, 16, 512
STARTUP_TIMEOUT_S = 900  # a cold XLA cache compiles every batch and prompt size first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(extra_args: list[str], log: Path):
    """`python scripts/serve.py` on a free port with `extra_args`, until it answers /health; SIGINT at the end.
    Speculation is compiled before /health answers (--no-background-compile) unless `extra_args` says
    --background-compile: a test that counts drafts must not race the compiling thread."""
    port = _free_port()
    compiling = [] if "--background-compile" in extra_args else ["--no-background-compile"]
    cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--port", str(port), "--log-level", "warning",
           *compiling, *extra_args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    try:
        yield {"url": url, "proc": proc, "log": log}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with _serving(["--max-slots", str(MAX_SLOTS), "--cache-len", str(CACHE_LEN), "--chunk-steps", "4",
                   "--max-waiting", str(MAX_WAITING)], log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline(smollm2):
    """Offline generation, memoised: (text or ids, max_new_tokens, SamplingParams) -> GenerateResult row."""
    cache = {}

    def run(prompt, max_new_tokens, sampling=SamplingParams()):
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_new_tokens, sampling)
        if key not in cache:
            r = jaxspec.generate(smollm2, [prompt], max_new_tokens=max_new_tokens, sampling=sampling)
            cache[key] = (r.token_ids[0], r.text[0], r.finish_reason[0])
        return cache[key]

    return run


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{label}}}" if label else "")] = sample.value
    return values


def wait_for_idle(read_metrics, timeout: float, poll_s: float) -> dict[str, float]:
    """The metrics `read_metrics()` returns once no request runs or waits (a cancelled row is retired at the
    engine's next visit); fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics()
        if m["jaxspec_requests_running"] == 0 and m["jaxspec_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"requests still running after {timeout} s: {m}"
        time.sleep(poll_s)


def _wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    return wait_for_idle(lambda: _metrics(url), timeout, 0.5)


def test_models_and_health(server, client):
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_offline(client, offline, humaneval_prompts, smollm2, stream):
    for prompt in humaneval_prompts[:2]:
        ids, text, reason = offline(prompt, 32)
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
            assert finish == [reason]
        else:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
            got, usage = r.choices[0].text, r.usage
            assert r.choices[0].finish_reason == reason
        assert got == text
        assert usage.completion_tokens == len(ids)
        assert usage.prompt_tokens == len(smollm2.tokenizer.encode(prompt))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_offline(client, offline, smollm2, stream):
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Write a Python function that reverses a string."}]
    prompt = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids, text, reason = offline(prompt, 40)
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        usage = chunks[-1].usage
    else:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        got, usage = r.choices[0].message.content, r.usage
        assert r.choices[0].finish_reason == reason
    assert got == text
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(smollm2.tokenizer.encode(prompt)), len(ids))


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_offline(client, smollm2, humaneval_prompts, stream):
    """OpenAI's completions format: tokens, their log-probabilities (the offline values), the 3 most likely
    tokens plus the chosen one per position, and where each token's text starts."""
    prompt = humaneval_prompts[3]
    ref = jaxspec.generate(smollm2, [prompt], max_new_tokens=24, logprobs=3)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=3)
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
        tokens = [t for p in parts for t in p.tokens]
        values = [v for p in parts for v in p.token_logprobs]
        tops = [t for p in parts for t in p.top_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
    else:
        r = client.completions.create(**kwargs)
        text, lp = r.choices[0].text, r.choices[0].logprobs
        tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
        assert len(tokens) == r.usage.completion_tokens
    assert text == ref.text[0] and "".join(tokens) == text
    np.testing.assert_allclose(values, [e.logprob for e in ref.logprobs[0]], atol=1e-3)
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for token, value, top, e in zip(tokens, values, tops, ref.logprobs[0]):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(value)
        assert max(top.values()) == pytest.approx(e.top[0][1], abs=1e-3)  # greedy: the chosen is the likeliest


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(client, smollm2, stream):
    """OpenAI's chat format: one object per token of the content, with its bytes and its top_logprobs."""
    messages = [{"role": "user", "content": "Name three colours."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0, logprobs=True, top_logprobs=2)
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        entries = [e for c in chunks if c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content]
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason)
    else:
        r = client.chat.completions.create(**kwargs)
        content, entries, finish = (r.choices[0].message.content, r.choices[0].logprobs.content,
                                    r.choices[0].finish_reason)
        # The EOS that ends a "stop" choice is counted in usage but is not part of the text.
        assert len(entries) == r.usage.completion_tokens - (finish == "stop")
    assert bytes(b for e in entries for b in e.bytes).decode() == content
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.logprob <= 0
        assert e.top_logprobs[1].logprob <= e.top_logprobs[0].logprob


def test_16_concurrent_streaming_clients(server, offline, humaneval_prompts):
    """Mixed greedy and seeded sampled requests, mixed methods: every one equals its offline run."""
    settings = []
    for i in range(16):
        sampled = i % 3 == 2
        sampling = SamplingParams(temperature=0.8, top_k=40 if i % 2 else 0, top_p=0.95, seed=1000 + i) \
            if sampled else SamplingParams()
        spec = [None, {"method": "ngram"}, {"method": "sam", "num_speculative_tokens": 8}, "off"][i % 4]
        settings.append((humaneval_prompts[i % 6], 24 + (i % 3) * 8, sampling, spec))

    async def one(aclient, prompt, max_tokens, sampling, spec):
        extra = {"top_k": int(sampling.top_k)}
        if spec is not None:
            extra["speculative"] = spec
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=float(sampling.temperature),
            top_p=float(sampling.top_p), seed=int(sampling.seed), stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=600)
        return await asyncio.gather(*(one(aclient, *s) for s in settings))

    results = asyncio.run(run_all())
    for (prompt, max_tokens, sampling, _), (text, usage) in zip(settings, results):
        ids, want, _ = offline(prompt, max_tokens, sampling)
        assert text == want
        assert usage.completion_tokens == len(ids)
    m = _wait_idle(server["url"])
    assert m["jaxspec_spec_drafted_tokens_total"] > 0


def test_stop_strings_and_n(client, offline, humaneval_prompts):
    prompt = humaneval_prompts[0]
    ids, text, _ = offline(prompt, 32)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=["\n"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index("\n")]
    assert 1 <= r.usage.completion_tokens < len(ids)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, seed=7, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16


def test_penalties_equal_offline(client, offline, humaneval_prompts):
    """presence/frequency penalties (OpenAI's fields) and repetition_penalty (extra_body) reach every verified
    position: the served greedy text equals offline plain decoding with the same penalties, and differs from
    the unpenalised text."""
    prompt = humaneval_prompts[1]
    settings = SamplingParams(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3)
    ids, text, _ = offline(prompt, 48, settings)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                  presence_penalty=0.8, frequency_penalty=0.6,
                                  extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == text
    assert text != offline(prompt, 48)[1]


def test_predicted_outputs(client, offline, smollm2):
    """OpenAI's `prediction` (chat) through the official client: the text equals offline greedy decoding, and
    usage reports the prediction's accepted and rejected tokens; an edited prediction still gives the same text.
    Completions take it in extra_body."""
    messages = [{"role": "user", "content": "Write a Python function that returns the squares of a list."}]
    prompt = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids, text, _ = offline(prompt, 64)
    edited = text.replace("def ", "def  ", 1) if "def " in text else "x" + text
    for prediction in (text, edited):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                           prediction={"type": "content", "content": prediction})
        assert r.choices[0].message.content == text
        details = r.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= len(ids) // 2
        if prediction == text:
            assert details.rejected_prediction_tokens == 0
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, temperature=0,
                                  extra_body={"prediction": {"type": "content", "content": [{"type": "text",
                                                                                              "text": text}]}})
    assert r.choices[0].text == text and r.usage.completion_tokens_details.accepted_prediction_tokens > 0
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert plain.usage.completion_tokens_details is None  # no prediction, no details


def test_response_format(client, smollm2):
    """response_format json_schema and json_object through the openai client: the text follows the schema and
    equals offline constrained greedy decoding (the server speculates with sam beside the mask)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "legs": {"type": "integer"}}, "required": ["name", "legs"]}
    messages = [{"role": "user", "content": "Describe a spider as JSON with its name and number of legs."}]
    prompt = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    offline = jaxspec.generate(smollm2, [prompt], max_new_tokens=48, constraint=jaxspec.JsonSchema(schema),
                               spec=jaxspec.SpecConfig(forced_tokens=0))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "animal", "schema": schema}})
    text = r.choices[0].message.content
    assert text == offline.text[0] and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")


BAD_INPUTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format.json_schema"),
    ({"prediction": {"type": "file", "content": "x"}}, "prediction.type"),
    ({"prediction": {"type": "content", "content": "x " * 2000}}, "prediction"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10 * CACHE_LEN}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "def f(x): " * 400}, "prompt"),
    ({"model": "gpt-5"}, "model"),
    ({"speculative": {"method": "eagle"}}, "speculative.method"),
    ({"speculative": {"num_speculative_tokens": 99}}, "speculative.num_speculative_tokens"),
    ({"n": 0}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"min_p": 2}, "min_p"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
]


@pytest.mark.parametrize("change,param", BAD_INPUTS, ids=[p + str(i) for i, (_, p) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_400_naming_the_field(server, change, param):
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4, **change}
    r = httpx.post(server["url"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_bad_input_through_the_openai_client_and_server_keeps_serving(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=4)
    assert e.value.param == "messages.0.role"
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           **extra)
        assert e.value.param == param
    for body in (b"{not json", b"[1, 2]"):
        r = httpx.post(server["url"] + "/v1/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and "error" in r.json()
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_queue_full_gets_429_and_the_rest_finish(server):
    async def one(http, i):
        return await http.post("/v1/completions", json={"model": MODEL, "prompt": f"def f{i}(x):", "max_tokens": 8,
                                                        "temperature": 0, "ignore_eos": True})

    async def burst():
        async with httpx.AsyncClient(base_url=server["url"], timeout=600) as http:
            return await asyncio.gather(*(one(http, i) for i in range(3 * (MAX_SLOTS + MAX_WAITING))))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}
    assert codes.count(429) >= 1 and codes.count(200) >= MAX_SLOTS
    refused = next(r for r in responses if r.status_code == 429).json()["error"]
    assert refused["code"] == "queue_full"
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses if r.status_code == 200)
    _wait_idle(server["url"])


def test_100_disconnects_free_their_rows(server, client):
    before = _metrics(server["url"]).get('jaxspec_requests_total{finish_reason=abort}', 0.0)

    async def disconnect(http, i):
        body = {"model": MODEL, "prompt": f"# task {i}\ndef solve(items):", "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # leaving the block closes the connection mid-stream

    async def run():
        async with httpx.AsyncClient(base_url=server["url"], timeout=600) as http:
            for start in range(0, 100, MAX_SLOTS):
                await asyncio.gather(*(disconnect(http, i) for i in range(start, min(start + MAX_SLOTS, 100))))

    asyncio.run(run())
    m = _wait_idle(server["url"])
    assert m['jaxspec_requests_total{finish_reason=abort}'] - before == 100
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_metrics_parse_and_count(server):
    m = _metrics(server["url"])
    for name in ("jaxspec_generation_tokens_total", "jaxspec_prompt_tokens_total", "jaxspec_decode_steps_total",
                 "jaxspec_time_to_first_token_seconds_count", "jaxspec_time_per_output_token_seconds_count",
                 "jaxspec_decode_step_seconds_count", "jaxspec_batch_occupancy",
                 "jaxspec_spec_mean_acceptance_length", "jaxspec_spec_accepted_tokens_per_position_total{position=0}"):
        assert name in m, name
    assert m["jaxspec_generation_tokens_total"] > 0 and m["jaxspec_time_to_first_token_seconds_count"] > 0
    assert m["jaxspec_spec_mean_acceptance_length"] >= 1.0


# eagle2 is marked slow: each head starts a server of its own (more than a minute on a small CPU), the serving
# path is the same for both tree heads, and eagle2's head is served beside other methods in tests/test_engine.py.
@pytest.mark.parametrize("method", [pytest.param("eagle2", marks=pytest.mark.slow), "eagle3", "dflash"])
def test_a_trained_head_is_served(smollm2, humaneval_prompts, tmp_path, method):
    """`serve.py --method eagle3` (or eagle2, dflash): the shipped head drafts dynamic trees (dflash: blocks) for a
    greedy request, which still gets exactly the offline text."""
    args = ["--method", method, "--max-slots", "1", "--cache-len", "256", "--policy", "fixed", "--no-warmup"]
    with _serving(args, tmp_path / "serve.log") as running:
        client = openai.OpenAI(base_url=running["url"] + "/v1", api_key="unused", max_retries=0, timeout=900)
        prompt = humaneval_prompts[2]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
        assert r.choices[0].text == jaxspec.generate(smollm2, [prompt], max_new_tokens=32).text[0]
        m = _metrics(running["url"])
        assert m["jaxspec_spec_accepted_tokens_total"] > 0 and m["jaxspec_spec_drafted_tokens_total"] > 0


def _post_raw(server, path: str, content, **kwargs) -> httpx.Response:
    """POST bytes as they are (httpx's `json=` would refuse a lone surrogate or NaN before sending)."""
    return httpx.post(server["url"] + path, content=content, headers={"content-type": "application/json"},
                      timeout=300, **kwargs)


def _assert_still_serving(server, offline) -> None:
    assert httpx.get(server["url"] + "/health", timeout=30).status_code == 200
    _wait_idle(server["url"])
    _, text, _ = offline("def add(a, b):", 8)
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
    r = _post_raw(server, "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text


def test_hostile_sampling_settings_are_answered_and_the_engine_survives(server, offline):
    """A top_k beyond int32 must not overflow on the engine thread, where it would fail the engine (every later
    request 503): top_k up to 2**31 - 1 is served as no limit (the same seeded text as top_k=0), beyond it 200
    or a 400 naming top_k, any integer seed is served, and the server keeps serving."""
    base = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0.8, "seed": 5}
    texts = []
    for top_k in (0, 2**31 - 1):
        r = _post_raw(server, "/v1/completions", json.dumps({**base, "top_k": top_k}).encode())
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    for path, body in (("/v1/completions", base),
                       ("/v1/chat/completions", {**{k: v for k, v in base.items() if k != "prompt"},
                                                 "messages": [{"role": "user", "content": "Hi"}]})):
        for top_k in (2**31, 2**63, 2**64):
            r = _post_raw(server, path, json.dumps({**body, "top_k": top_k}).encode())
            assert r.status_code in (200, 400), r.text
            if r.status_code == 400:
                assert r.json()["error"]["param"] == "top_k"
    for seed in (-1, 2**64, 10**30):
        r = _post_raw(server, "/v1/completions", json.dumps({**base, "seed": seed}).encode())
        assert r.status_code == 200, r.text
    _assert_still_serving(server, offline)


def test_hostile_bodies_get_their_4xx_and_the_server_keeps_serving(server, offline):
    """Hostile bodies over real HTTP: a lone surrogate in a prompt, a chat message or a stop string gets 400
    naming the field (not a 500), NaN and Infinity 400, and a 3 MB body 413 under the default 2 MiB limit (with
    a Content-Length or chunked); the server keeps serving and greedy output is unchanged."""
    cases = [("/v1/completions", {"prompt": "\ud800"}, "prompt"),
             ("/v1/completions", {"prompt": "def f(x):", "stop": ["\n", "\udfff"]}, "stop.1"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}]},
              "messages.0.content")]
    for path, change, param in cases:
        body = {"model": MODEL, "max_tokens": 4, **change}
        r = _post_raw(server, path, json.dumps(body).encode("ascii"))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in (param, param.split(".")[0]), r.text
    for literal in ("NaN", "Infinity", "-Infinity"):
        content = b'{"model": "%s", "prompt": "def f(x):", "max_tokens": 4, "temperature": %s}' % (
            MODEL.encode(), literal.encode())
        r = _post_raw(server, "/v1/completions", content)
        assert r.status_code == 400 and "error" in r.json(), r.text
    big = json.dumps({"model": MODEL, "prompt": "def f(x): " * 300_000, "max_tokens": 4}).encode()
    assert len(big) > 3_000_000
    for content in (big, (big[i: i + 65536] for i in range(0, len(big), 65536))):  # declared length, chunked
        r = _post_raw(server, "/v1/completions", content)
        assert r.status_code == 413, r.text[:500]
        assert r.json()["error"]["code"] == "request_too_large"
    _assert_still_serving(server, offline)


def test_sigterm_finishes_the_request_in_flight(server):
    """Last in the module: it stops the server."""
    body = {"model": MODEL, "prompt": "def count(n):", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and server["proc"].poll() is None and usage is None:
                server["proc"].send_signal(signal.SIGTERM)
                usage = "sent"
            if '"usage": {' in line:
                usage = line
    assert usage not in (None, "sent") and '"completion_tokens": 48' in usage
    # uvicorn re-raises the signal once it has shut down gracefully, so the exit status reports SIGTERM.
    assert server["proc"].wait(120) in (0, -signal.SIGTERM)
    assert "Traceback" not in server["log"].read_text()
