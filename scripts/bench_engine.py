#!/usr/bin/env python
"""The serving engine under a queue, in process (no HTTP, no client): speculation policies side by side.

bench_serve.py measures the whole server, where the load generator shares the cores with the server and
chunk times also carry streaming and HTTP work. This isolates the engine: each policy gets its own `Engine`
(same model, same settings), all of them compiled first; then every repeat submits the same N HumanEval
prompts at once to each engine in turn (the order alternating between repeats) and times until the last
request finishes. Reported per level: tokens/s, the median seconds of a chunk with every slot busy (the
device work per chunk), and how many chunks drafted (max cap > 0).

    python scripts/bench_engine.py                                  # off vs adaptive, 48 requests x 96 tokens
    python scripts/bench_engine.py --policies off,fixed,adaptive --requests 64 --max-tokens 128 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading

import jax

import jaxspec
from benchkit import machine, tables, workloads
from benchkit.timing import clocked, rounds
from jaxspec.engine import Engine, EngineConfig, Request
from jaxspec.policy import make_policy


class Level:
    """Bursts of requests on one engine: submitted at once, timed until the last finishes."""

    def __init__(self, config: EngineConfig, policy: str, lm):
        self.engine = Engine(lm, config, policy=make_policy(policy), observers=[self._observe])
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="off,adaptive",
                   help="policies, the first is the baseline (default: %(default)s)")
    p.add_argument("--method", default="sam", help="the engine's speculation method (default: %(default)s)")
    p.add_argument("--requests", type=int, default=48, help="requests per burst (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=96, help="max_tokens per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=4, help="bursts per policy, order alternating (default: %(default)s)")
    p.add_argument("--max-slots", type=int, default=8, help="engine slots (default: %(default)s)")
    p.add_argument("--cache-len", type=int, default=1024, help="KV slots per row (default: %(default)s)")
    args = p.parse_args()

    lm = jaxspec.load_model("smollm2-135m")
    prompts = workloads.free_form_prompts(lm.tokenizer)
    config = EngineConfig(max_slots=args.max_slots, cache_len=args.cache_len,
                          spec=jaxspec.SpecConfig(method=args.method))
    names = args.policies.split(",")
    levels = {name: Level(config, name, lm) for name in names}
    for level in levels.values():
        level.engine.start()
        level.engine.ready.wait()

    rates: dict[str, list[float]] = {n: [] for n in names}
    print(f"# engine policies under a queue: {machine.line(machine.info())}; {args.requests} requests x "
          f"{args.max_tokens} tokens per burst\n")
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


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jaxspec-xla"))
    main()
