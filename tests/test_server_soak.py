"""Soak: a real server under 64 concurrent streams and 100 clients that hang up mid-stream leaks nothing.

One `python scripts/serve.py` process (real SmolLM2 weights, 127.0.0.1 only) takes, all at once, 64 streaming
requests (greedy and seeded, mixed speculation methods) and 100 streaming requests whose clients disconnect at
different moments: right after the response headers (the request may still be queued), after the first
tokens, or after a few chunks. Every one of the 64 must finish with exactly the text the same request got
before the soak; every disconnect must end its request as an abort; afterwards no request runs or waits,
/health is 200 and a greedy request still gives its earlier text.

Marked slow (deselected by default): `python -m pytest -m slow tests/test_server_soak.py`.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from test_server import _metrics, _serving, _wait_idle  # the real server test's process helpers

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

MODEL = "smollm2-135m"
MAX_SLOTS = 8
# The same compiled shapes as tests/test_server.py's server (slots, cache, chunk), so the XLA cache serves both.
SERVER_ARGS = ["--max-slots", str(MAX_SLOTS), "--cache-len", "512", "--chunk-steps", "4", "--max-waiting", "256"]
NUM_STREAMS, NUM_DISCONNECTS = 64, 100
STREAM_TOKENS = 24
SOAK_TIMEOUT_S = 900  # the whole burst; the test fails rather than waits longer
PROMPTS = ["def fibonacci(n):", "def is_prime(n):", "# Sort a list of tuples by their second item\n",
           "class Stack:\n    def __init__(self):"]
SPECS = [None, {"method": "ngram"}, {"method": "sam", "num_speculative_tokens": 4}, "off"]


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    """The server process; `smollm2` makes the module skip where the model package is absent."""
    log = tmp_path_factory.mktemp("soak") / "serve.log"
    with _serving(SERVER_ARGS, log) as running:
        yield running


def stream_body(i: int) -> dict:
    """The i-th of the 64 streams: its prompt, greedy or seeded sampling, and speculation method."""
    body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": STREAM_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    if (i // len(PROMPTS)) % 2:
        body.update(temperature=0.8, top_p=0.95, top_k=40, seed=(i // (2 * len(PROMPTS))) % 2)
    else:
        body.update(temperature=0)
    spec = SPECS[(i // 3) % len(SPECS)]
    if spec is not None:
        body["speculative"] = spec
    return body


def reference_key(body: dict) -> str:
    """Requests that must produce the same text: same prompt and sampling (speculation never changes it)."""
    return json.dumps({k: body.get(k) for k in ("prompt", "temperature", "top_p", "top_k", "seed")}, sort_keys=True)


async def read_stream(http: httpx.AsyncClient, body: dict) -> tuple[str, list[str], dict | None]:
    """(text, finish reasons, usage) of one streamed completion read to its end."""
    text, finishes, usage, done = "", [], None, False
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["text"]
                if choice["finish_reason"] is not None:
                    finishes.append(choice["finish_reason"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert done, "the stream ended without [DONE]"
    return text, finishes, usage


async def hang_up(http: httpx.AsyncClient, i: int, after_events: int) -> None:
    """Open a long stream and close the connection after `after_events` data events (0: after the headers)."""
    body = {"model": MODEL, "prompt": f"# task {i}\ndef solve(items):", "max_tokens": 400, "temperature": 0.7,
            "seed": i, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        if after_events == 0:
            return
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen >= after_events:
                    return  # leaving the block closes the connection mid-stream
        pytest.fail(f"a 400-token stream ended after {seen} events")


def test_64_streams_and_100_disconnects_leak_no_slot(server):
    """64 concurrent streams finish with their pre-soak text while 100 clients hang up around them; then
    no request runs or waits, 100 more requests ended as aborts, /health is 200 and greedy output is
    unchanged."""
    url = server["url"]
    bodies = [stream_body(i) for i in range(NUM_STREAMS)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    timeout = httpx.Timeout(SOAK_TIMEOUT_S, connect=30)

    async def references() -> dict[str, str]:
        """Each distinct request alone, before the soak: the text it must always get."""
        refs = {}
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
            for body in bodies:
                key = reference_key(body)
                if key not in refs:
                    text, finishes, _ = await read_stream(http, {**body, "speculative": "off"})
                    assert len(finishes) == 1
                    refs[key] = text
        return refs

    refs = asyncio.run(references())
    _wait_idle(url)
    before = _metrics(url)
    aborts_before = before.get("jaxspec_requests_total{finish_reason=abort}", 0.0)

    rng = random.Random(0)
    moments = [rng.choice([0, 1, 2, 5]) for _ in range(NUM_DISCONNECTS)]

    async def soak():
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
            streams = [asyncio.create_task(read_stream(http, b)) for b in bodies]
            # Hang-ups arrive in waves while the streams run, so rows are freed and re-filled many times.
            hangups = []
            for start in range(0, NUM_DISCONNECTS, 20):
                hangups += [asyncio.create_task(hang_up(http, i, moments[i]))
                            for i in range(start, min(start + 20, NUM_DISCONNECTS))]
                await asyncio.sleep(0.5)
            return await asyncio.wait_for(asyncio.gather(*streams, *hangups), SOAK_TIMEOUT_S)

    results = asyncio.run(soak())[:NUM_STREAMS]
    for body, (text, finishes, usage) in zip(bodies, results):
        assert finishes in (["length"], ["stop"]), (body, finishes)
        assert usage is not None and 1 <= usage["completion_tokens"] <= STREAM_TOKENS
        assert text == refs[reference_key(body)], (body, text, refs[reference_key(body)])

    after = _wait_idle(url)
    assert after["jaxspec_requests_running"] == 0 and after["jaxspec_requests_waiting"] == 0
    assert after["jaxspec_requests_total{finish_reason=abort}"] - aborts_before == NUM_DISCONNECTS
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200

    # Every slot is free again: a full batch of requests is admitted at once and each gets its text.
    async def full_batch():
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
            return await asyncio.gather(*(read_stream(http, bodies[i % len(PROMPTS)]) for i in range(MAX_SLOTS)))

    for i, (text, finishes, _) in enumerate(asyncio.run(full_batch())):
        assert len(finishes) == 1
        assert text == refs[reference_key(bodies[i % len(PROMPTS)])]
    _wait_idle(url)
    assert "Traceback" not in server["log"].read_text()
