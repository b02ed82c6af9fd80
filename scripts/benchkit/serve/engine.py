"""The serving engine under a queue, in process (no HTTP, no client): `python scripts/bench_serve.py --engine`.

bench_serve.py measures the whole server, where the load generator shares the cores with the server and
chunk times also carry streaming and HTTP work. This isolates the engine: each policy gets its own `Engine`
(same model, same settings), all of them compiled first; then every repeat submits the same N HumanEval
prompts at once to each engine in turn (the order alternating between repeats) and times until the last
request finishes. Reported per level: tokens/s, the median seconds of a chunk with every slot busy (the
device work per chunk), and how many chunks drafted (max cap > 0).

    python scripts/bench_serve.py --engine                                  # off vs adaptive, 48 requests x 96 tokens
    python scripts/bench_serve.py --engine --policies off,fixed,adaptive --requests 64 --max-tokens 128 --repeats 2

With --prefill-batches it measures admission instead: one engine per `max_prefill_batch` value (the same
model, settings and policy otherwise), and each repeat gives every engine in turn the same burst of N
HumanEval prompts (default 8, greedy, 32 new tokens) arriving at once: queued while the engine's loop thread
waits, so its next look at the queue finds them all (a one-token request, admitted and answered before the
clock starts, holds it there). Reported per burst: the prefill calls that admitted it, the prompt tokens and
those the calls ran (padding to a prompt bucket and a batch size included), time to first token
(TTFT: from the burst's arrival to each request's first token) mean, median and max, and the total time
until the last request finished; then the means over repeats, and whether every engine gave the same tokens.

    python scripts/bench_serve.py --engine --prefill-batches 1,8            # 8 requests x 32 tokens, 3 repeats
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time

import jaxspec
from benchkit import machine, page, tables, workloads
from benchkit.cli import ints
from benchkit.timing import clocked, rounds
from jaxspec.engine import Engine, EngineConfig, Request
from jaxspec.policy import DraftPolicy
from jaxspec.shapes import prompt_bucket


class Level:
    """Bursts of requests on one engine: submitted at once, timed until the last finishes."""

    def __init__(self, config: EngineConfig, policy: str, lm):
        self.engine = Engine(lm, config, policy=DraftPolicy.named(policy), observers=[self._observe])
        self.chunks: list[dict] = []
        self.left = 0  # requests of the running burst not yet finished
        self.last_chunk = threading.Event()  # the burst's last chunk (or admission) has been recorded

    def _observe(self, event: str, info: dict) -> None:
        # Engine thread. A request finishes inside a chunk or at its admission (done at its first token), and
        # either way its output reaches `on_output` before the chunk's or the admission's event reaches here:
        # the event seen with nothing left closes the burst, and every chunk of it is recorded by then.
        if event == "chunk":
            self.chunks.append(info)
        if event in ("chunk", "admit") and not self.left:
            self.last_chunk.set()

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        tokens, finished = [0], threading.Event()
        self.chunks.clear()
        self.last_chunk.clear()
        self.left = len(prompts)

        def on_output(output) -> None:  # engine thread, like `_observe`: no lock needed
            tokens[0] += len(output.token_ids)
            if output.finish_reason is not None:
                self.left -= 1
                if not self.left:
                    finished.set()

        def burst() -> None:
            for prompt in prompts:
                self.engine.submit(Request(prompt, max_tokens), on_output)
            finished.wait()

        wall, _ = clocked(burst)
        self.last_chunk.wait()
        full = [c["seconds"] for c in self.chunks if c["active"] == c["slots"]]
        return {"wall_s": wall, "tokens": tokens[0],
                "full_chunk_s": statistics.median(full) if full else float("nan"),
                "drafting_chunks": sum(c["max_cap"] > 0 for c in self.chunks), "chunks": len(self.chunks)}


class Burst:
    """One engine, given bursts of requests that all arrive before its loop thread looks at the queue."""

    def __init__(self, config: EngineConfig, policy: str, lm):
        self.engine = Engine(lm, config, policy=DraftPolicy.named(policy), observers=[self._observe])
        self.batches: list[int] = []  # each admission's prefill batch (one entry per request)

    def _observe(self, event: str, info: dict) -> None:
        if event == "admit":
            self.batches.append(info["prefill_batch"])

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        held, gate = threading.Event(), threading.Event()

        def hold(output) -> None:  # engine thread: the holder's only event; the loop waits here
            held.set()
            gate.wait()

        self.engine.submit(Request(prompts[0][:1], 1), hold)
        held.wait()
        n = len(prompts)
        first: list[float | None] = [None] * n
        tokens: list[list[int]] = [[] for _ in range(n)]
        end, left, finished = [0.0], [n], threading.Event()

        def on_output(i: int, output) -> None:  # engine thread
            if first[i] is None and output.token_ids:
                first[i] = time.perf_counter()
            tokens[i] += output.token_ids
            if output.finish_reason is not None:
                left[0] -= 1
                if not left[0]:
                    end[0] = time.perf_counter()
                    finished.set()

        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            self.engine.submit(Request(prompt, max_tokens), functools.partial(on_output, i))
        self.batches.clear()  # the holder's admission is recorded once the gate opens: after this
        gate.set()
        finished.wait()
        ttft = [f - start for f in first]
        calls = _prefill_calls(self.batches[1:])  # the holder's own admission first
        return {"ttft": ttft, "total_s": end[0] - start, "tokens": tokens, "batches": calls,
                "generated": sum(len(t) for t in tokens), "padded": self._padded(prompts, calls)}

    def _padded(self, prompts: list[list[int]], calls: list[int]) -> int:
        """Prompt tokens the prefill calls ran, padding included (rows to a batch size, prompts to a bucket):
        requests are admitted in arrival order."""
        config, total, i = self.engine.config, 0, 0
        for n in calls:
            size = next(b for b in config.prefill_batch_sizes if b >= n)
            total += size * prompt_bucket(max(len(p) for p in prompts[i:i + n]), config.cache_len)
            i += n
        return total


def _prefill_calls(batches: list[int]) -> list[int]:
    """The sizes of the prefill calls, from one entry per admitted request (each naming its call's size)."""
    calls, i = [], 0
    while i < len(batches):
        calls.append(batches[i])
        i += batches[i]
    return calls


def burst_main(args, lm, prompts) -> None:
    levels = args.prefill_batches
    bursts: dict[int, Burst] = {}
    for most in levels:  # in order: each engine's warm-up compiles only what the ones before did not
        # Everything compiled before timing: nothing compiles on a thread beside the timed bursts.
        config = EngineConfig(max_slots=args.max_slots, cache_len=args.cache_len, max_prefill_batch=most,
                              spec=jaxspec.SpecConfig(method=args.method, sam_source=args.sam_source),
                              background_compile=False)
        bursts[most] = Burst(config, args.policy, lm)
        seconds, _ = clocked(lambda b=bursts[most]: (b.engine.start(), b.engine.ready.wait()))
        print(f"# max_prefill_batch={most}: warm-up {seconds:.1f} s (prefill batch sizes "
              f"{config.prefill_batch_sizes})", flush=True)
    requests = args.requests or 8
    max_tokens = args.max_tokens or 32
    print(f"\n# burst admission: {machine.line(machine.info())}; {requests} requests x {max_tokens} tokens "
          f"arriving at once, method {args.method}, policy {args.policy}, {args.max_slots} slots\n")
    print(tables.head(["repeat", "max_prefill_batch", "prefill calls", "prompt tokens (padded)", "TTFT mean s",
                       "TTFT p50 s", "TTFT max s", "total s"]))
    for most in levels:  # one burst each, untimed: programs met only under load (regroups) compile here
        bursts[most].run(prompts[-requests:], max_tokens)
    results: dict[int, list[dict]] = {most: [] for most in levels}
    for rep, most in rounds(levels, args.repeats, alternate=True):
        burst = [prompts[(rep * requests + i) % len(prompts)] for i in range(requests)]
        r = bursts[most].run(burst, max_tokens)
        results[most].append(r)
        print(tables.row([rep, most, "+".join(map(str, r["batches"])), f"{sum(map(len, burst))} ({r['padded']})",
                          f"{statistics.mean(r['ttft']):.2f}",
                          f"{statistics.median(r['ttft']):.2f}", f"{max(r['ttft']):.2f}", f"{r['total_s']:.2f}"]),
              flush=True)
    print("\n" + tables.head(["max_prefill_batch", "TTFT mean s", "TTFT p50 s", "TTFT max s", "total s",
                              "tokens/s"]))
    for most in levels:
        rs = results[most]
        print(tables.row([most, *(f"{statistics.mean(stat(r['ttft']) for r in rs):.2f}"
                                  for stat in (statistics.mean, statistics.median, max)),
                          f"{statistics.mean(r['total_s'] for r in rs):.2f}",
                          f"{sum(r['generated'] for r in rs) / sum(r['total_s'] for r in rs):.1f}"]))
    base = levels[0]
    same = all(results[most][i]["tokens"] == results[base][i]["tokens"]
               for most in levels for i in range(args.repeats))
    print(f"\nevery engine gave the same tokens to every request: {'yes' if same else 'NO'}")
    for b in bursts.values():
        b.engine.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_serve.py --engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="off,adaptive",
                   help="policies, the first is the baseline (default: %(default)s)")
    p.add_argument("--method", default="sam", help="the engine's speculation method (default: %(default)s)")
    p.add_argument("--sam-source", default="auto", choices=("auto", "dynamic", "static", "both"),
                   help="sam's draft source, SpecConfig.sam_source (default: %(default)s)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per burst (default: 48; 8 with --prefill-batches)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens per request (default: 96; 32 with --prefill-batches)")
    p.add_argument("--repeats", type=int, default=None,
                   help="bursts per policy, order alternating (default: 4; 3 with --prefill-batches)")
    p.add_argument("--prefill-batches", type=ints, default=None,
                   help="measure burst admission instead: max_prefill_batch values, the first the baseline (e.g. 1,8)")
    p.add_argument("--policy", default="adaptive", help="the policy with --prefill-batches (default: %(default)s)")
    p.add_argument("--max-slots", type=int, default=8, help="engine slots (default: %(default)s)")
    p.add_argument("--cache-len", type=int, default=1024, help="KV slots per row (default: %(default)s)")
    page.add_option(p, "serve-engine")
    args = p.parse_args(argv)
    jaxspec.enable_compilation_cache()
    with page.Tee() as printed:
        run(args)
    if args.write_page:
        page.write(args.write_page, printed.text, machine.info(), vars(args))
    return 0


def run(args) -> None:

    lm = jaxspec.load_model("smollm2-135m")
    prompts = workloads.free_form_prompts(lm.tokenizer)
    if args.prefill_batches:
        args.repeats = args.repeats or 3
        burst_main(args, lm, prompts)
        return
    args.requests, args.max_tokens, args.repeats = args.requests or 48, args.max_tokens or 96, args.repeats or 4
    config = EngineConfig(max_slots=args.max_slots, cache_len=args.cache_len,
                          spec=jaxspec.SpecConfig(method=args.method, sam_source=args.sam_source),
                          background_compile=False)  # all compiled before the timed queue
    names = args.policies.split(",")
    levels = {name: Level(config, name, lm) for name in names}
    for level in levels.values():
        level.engine.start()
        level.engine.ready.wait()

    rates: dict[str, list[float]] = {n: [] for n in names}
    print(f"# engine policies under a queue: {machine.line(machine.info())}; {args.requests} requests x "
          f"{args.max_tokens} tokens per burst; method {args.method}, sam source {args.sam_source}\n")
    print(tables.head(["repeat", "policy", "wall s", "tokens/s", "median full chunk ms", "drafting chunks"]))
    for rep, name in rounds(names, args.repeats, alternate=True):
        burst = [prompts[(rep * args.requests + i) % len(prompts)] for i in range(args.requests)]
        r = levels[name].run(burst, args.max_tokens)
        rates[name].append(r["tokens"] / r["wall_s"])
        print(tables.row([rep, name, f"{r['wall_s']:.1f}", f"{rates[name][-1]:.1f}", f"{r['full_chunk_s'] * 1000:.0f}",
                          f"{r['drafting_chunks']}/{r['chunks']}"]), flush=True)
    base = names[0]
    for name in names[1:]:
        ratios = [a / b for a, b in zip(rates[name], rates[base])]
        print(f"{name}/{base} per repeat: {', '.join(f'{x:.3f}' for x in ratios)}; mean {statistics.mean(ratios):.3f}")
    for level in levels.values():
        level.engine.shutdown()
