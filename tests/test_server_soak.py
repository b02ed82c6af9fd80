"""Soak: a real server under 64 concurrent streams and 100 clients that hang up mid-stream leaks nothing, and
hostile constrained requests stall no one.

One `python scripts/serve.py` process (real SmolLM2 weights, 127.0.0.1 only) takes, all at once, 64 streaming
requests (greedy and seeded, mixed speculation methods) and 100 streaming requests whose clients disconnect at
different moments: right after the response headers (the request may still be queued), after the first
tokens, or after a few chunks. Every one of the 64 must finish with exactly the text the same request got
before the soak; every disconnect must end its request as an abort; afterwards no request runs or waits,
/health is 200 and a greedy request still gives its earlier text.

Then six clients send constrained requests without pause, and plain requests are timed meanwhile. Schemas
whose compile explodes in outlines-core are refused by their limits or their compile budget, and a plain
request beside them takes at most twice its idle time plus one chunk. Admitted constrained requests (a new
small enum each time, predicted completions, json_object streams dropped after the first event) cost a plain
request beside them at most twice what the same requests without constraints cost it, plus one chunk: sharing
the batch slows a row on a CPU, a new constraint must not add a stall. The server's resident memory grows by
less than 1 GiB and it still answers /health.

Marked slow (deselected by default): `python -m pytest -m slow tests/test_server_soak.py`.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

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


# ------------------------------------------------------------------------------------- hostile constrained load

# Schemas and patterns whose compile is exponential or unbounded in outlines-core: each must be refused (400)
# by its limits or its compile budget, never take the server down or hold its memory, and never delay others.
HOSTILE_FORMATS = [
    {"type": "string", "minLength": 1_000_000_000},
    {"type": "string", "maxLength": 20},
    {"type": "string", "pattern": "[a-z]{5000}"},
    {"type": "object", "properties": {f"p{i}": {"$ref": "#"} for i in range(20)}},
    {"type": "object", "properties": {f"p{i}": {"$ref": "#"} for i in range(30)}},
]
LOAD_CLIENTS = 6  # each sends its requests one after another
PLAIN_PROBES = 8  # plain requests timed while the clients run
RSS_GROWTH_LIMIT = 1 << 30  # bytes the server may grow by over the whole test
PLAIN = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0, "speculative": "off"}


def _rss(pid: int) -> int:
    """Resident bytes of process `pid` (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def _hostile_body(client: int, i: int) -> dict:
    """A constrained request whose schema is refused by its limits or its compile budget."""
    schema = HOSTILE_FORMATS[(client * 7 + i) % len(HOSTILE_FORMATS)]
    return {"model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}}


def _admitted_body(client: int, i: int, constrained: bool) -> dict:
    """The i-th request of client `client` in the admitted mix: a new small enum (a new automaton each time), a
    predicted completion, or a long stream that the client drops after its first event (a json_object one).
    Without `constrained`, the same requests with no `response_format`: the batch load they make alone."""
    kind = (client + i) % 3
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    if kind == 0:
        options = [f"option {client}-{i}-{j}" for j in range(3 + 17 * (i % 4))]
        body.update(messages=[{"role": "user", "content": "Pick one."}],
                    response_format={"type": "json_schema", "json_schema": {
                        "name": "pick", "schema": {"type": "string", "enum": options}}})
    elif kind == 1:
        body.update(messages=[{"role": "user", "content": "Repeat: def add(a, b): return a + b"}],
                    prediction={"type": "content", "content": "def add(a, b):\n    return a + b\n" * 4})
    else:
        body.update(messages=[{"role": "user", "content": "Write a long story."}], max_tokens=200, stream=True,
                    response_format={"type": "json_object"})
    if not constrained:
        body.pop("response_format", None)
    return body


def _under_load(url: str, make_body, statuses: dict[int, int]) -> list[float]:
    """The latencies of PLAIN_PROBES plain requests sent one at a time while LOAD_CLIENTS clients send
    `make_body(client, i)` without pause (a stream is dropped after its first event); counts their statuses."""
    stop = asyncio.Event()

    async def client(http: httpx.AsyncClient, c: int) -> None:
        i = 0
        while not stop.is_set():
            body = make_body(c, i)
            i += 1
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            if body.get("stream"):
                async with http.stream("POST", path, json=body) as r:
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            break  # hang up after the first event
                continue
            r = await http.post(path, json=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400, 429), r.text
            if r.status_code == 400:
                assert r.json()["error"]["param"].startswith("response_format"), r.text
            assert len(r.text) < 4096, len(r.text)

    async def probe(http: httpx.AsyncClient) -> list[float]:
        latencies = []
        await asyncio.sleep(2.0)  # the clients are under way
        for _ in range(PLAIN_PROBES):
            t0 = time.perf_counter()
            r = await http.post("/v1/completions", json=PLAIN)
            assert r.status_code == 200, r.text
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.5)
        stop.set()
        return latencies

    async def run() -> list[float]:
        async with httpx.AsyncClient(base_url=url, timeout=SOAK_TIMEOUT_S) as http:
            clients = [asyncio.create_task(client(http, c)) for c in range(LOAD_CLIENTS)]
            latencies = await probe(http)
            await asyncio.wait_for(asyncio.gather(*clients), SOAK_TIMEOUT_S)
            return latencies

    latencies = asyncio.run(run())
    _wait_idle(url)
    return latencies


def test_hostile_constrained_requests_stall_no_one(server):
    """Six clients send constrained requests without pause. (1) Schemas refused by their limits or their compile
    budget: each is a 400 naming response_format, and a plain request's latency stays under twice its idle
    latency plus one chunk. (2) Admitted ones (a new enum per request, predictions, json_object streams dropped
    after the first event): a plain request's latency stays under twice what it is beside the same requests
    without their constraints, plus one chunk: a new constraint compiles no program and stalls no one. The
    server stays up and grows by less than 1 GiB."""
    url, pid = server["url"], server["proc"].pid
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(2):
            assert http.post("/v1/completions", json=PLAIN).status_code == 200
        idle = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert http.post("/v1/completions", json=PLAIN).status_code == 200
            idle.append(time.perf_counter() - t0)
    idle = sorted(idle)[2]
    chunk_s = idle * int(SERVER_ARGS[SERVER_ARGS.index("--chunk-steps") + 1]) / PLAIN["max_tokens"]
    rss_before = _rss(pid)

    refused: dict[int, int] = {}
    hostile = _under_load(url, _hostile_body, refused)
    assert set(refused) <= {400, 429} and refused.get(400, 0) >= LOAD_CLIENTS, refused

    unconstrained: dict[int, int] = {}
    baseline = _under_load(url, lambda c, i: _admitted_body(c, i, constrained=False), unconstrained)
    admitted: dict[int, int] = {}
    mixed = _under_load(url, lambda c, i: _admitted_body(c, i, constrained=True), admitted)
    assert set(admitted) == {200}, admitted

    grown = _rss(pid) - rss_before
    print(f"idle {idle:.3f} s; beside refused schemas {[round(x, 3) for x in hostile]}; beside unconstrained "
          f"requests {[round(x, 3) for x in baseline]}; beside the same constrained {[round(x, 3) for x in mixed]}; "
          f"statuses {refused} {unconstrained} {admitted}; rss +{grown / 2**20:.0f} MiB")
    assert server["proc"].poll() is None, "the server exited"
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert grown < RSS_GROWTH_LIMIT, f"the server grew by {grown / 2**20:.0f} MiB"
    assert max(hostile) <= 2 * idle + chunk_s, (hostile, idle)
    assert max(mixed) <= 2 * statistics.median(baseline) + chunk_s, (mixed, baseline)
