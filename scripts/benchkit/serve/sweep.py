"""The benchmark: each server warmed up, then every mode at every concurrency level (or modes taking turns)."""

from __future__ import annotations

import argparse
import functools
import time
from collections import Counter
from collections.abc import Callable

import httpx

from ..tables import fmt
from .client import run_requests, scrape
from .results import LevelResult, summarize
from .servers import Target, served_model, start_server, stop_server, wait_ready


def requests_for_level(concurrency: int, args: argparse.Namespace) -> int:
    """A fixed --num-requests, else --requests-per-client per client task, at least --min-requests."""
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
    """One level: `concurrency` requests in flight, the server's counters scraped before and after."""
    n = requests_for_level(concurrency, args)
    prompt_indices = [i % len(prompts) for i in range(n)]  # the same prompts, in the same order, in every mode
    before = await scrape(client, target.base_url)
    results, wall = await run_requests(client, target.base_url, target.model, prompts, prompt_indices,
                                       concurrency, args)
    after = await scrape(client, target.base_url)
    level = summarize(LevelResult(mode=target.label, concurrency=concurrency, num_requests=n, wall_s=wall,
                                  requests=results, counters_before=before, counters_after=after))
    print(f"[{target.label}] c={concurrency:<3} {n} requests in {wall:6.1f} s: {level.throughput_tok_s:7.1f} tok/s, "
          f"TTFT p50 {fmt(level.ttft_p50_ms, '.0f')} ms, TPOT p50 {fmt(level.tpot_p50_ms, '.1f')} ms, "
          f"acceptance {fmt(level.mean_acceptance_length, '.2f')}"
          + (f", {level.errors} errors {level.error_kinds}" if level.errors else "")
          + (f", {level.usage_missing} without usage" if level.usage_missing else ""), flush=True)
    return level


async def benchmark(args: argparse.Namespace, prompts: list[str], warmup: list[int],
                    starters: list[Callable[[], Target]] | None = None) -> tuple[list[Target], list[LevelResult]]:
    """Every server at every level: --url, or servers started here (by `starters`, default one per --modes mode),
    one at a time or (--interleave) all at once taking turns. Every server started here is stopped on the way out,
    whatever happened."""
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

        if starters is None:
            starters = [functools.partial(start_server, mode, args) for mode in args.modes]
        try:
            if args.interleave:  # every server up at once; they take turns at each level
                for start in starters:
                    targets.append(start())
                ready = [t for t in targets if await prepare(client, t, prompts, warmup, args)]
                for c in args.concurrency:
                    for target in ready:
                        levels.append(await run_level(client, target, prompts, c, args))
            else:  # one server at a time
                for start in starters:
                    target = start()
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
