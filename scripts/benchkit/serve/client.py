"""The load generator: streaming completions over httpx, a closed loop of client tasks; the counter scrape."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from .results import RequestResult, ServerCounters


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
                        result.text += choice["text"]
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


_COUNTERS = {
    "drafted": "jaxspec_spec_drafted_tokens",
    "accepted": "jaxspec_spec_accepted_tokens",
    "steps": "jaxspec_decode_steps",
    "row_steps": "jaxspec_decode_row_steps",
    "committed": "jaxspec_decode_committed_tokens",
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
