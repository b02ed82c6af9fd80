"""Where a decode run's time goes: one `jax.profiler` trace of a rollout or a `generate` call, summed by event.

The run is made twice: the first compiles, the second is traced (`jax.profiler.trace`, with a Perfetto trace),
so the trace holds steps, not compiling. The report lists, per thread of the trace (a GPU's streams, the host's
Python and XLA threads), its busy time and the events that took the most of it: the kernels and copies a step
launches on a GPU, the host calls between chunks. The trace itself (`perfetto_trace.json.gz` under --out)
opens in https://ui.perfetto.dev for the timeline.

    python scripts/bench_kernel.py profile                               # rollout-none, 8 x 8, 32 tokens
    python scripts/bench_kernel.py profile --method group_sam --speculation fixed
    python scripts/bench_kernel.py profile --api generate --method sam --prompts 1 --samples 1 --temperature 0

Meant for an accelerator, where a step costs a few milliseconds and the question is which of its kernels,
copies and host synchronisations take them; on a CPU it works too, but the XLA threads' events are coarse.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax

import jaxspec
from benchkit import machine, output, page, tables, workloads
from benchkit import trace as trace_summary
from jaxspec import SamplingParams, SpecConfig


def _working_ms(thread: dict) -> float:
    """A thread's busy time less the waits among its top events: the thread that launches XLA's work spends its
    time waiting for the kernels, which run (and show what a step costs) on other threads."""
    return thread["busy_ms"] - sum(e["total_ms"] for e in thread["top"] if "wait" in e["name"].lower())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", choices=("rollout", "generate"), default="rollout",
                   help="rollout: jaxspec.rollout of P prompts x G samples; generate: one batch of P x G rows")
    p.add_argument("--method", default="none", help="a SpecConfig method, or none")
    p.add_argument("--sam-index", default="auto", help="SpecConfig.sam_index for sam and group_sam")
    p.add_argument("--prompts", type=int, default=8, help="P held-out HumanEval prompts")
    p.add_argument("--samples", type=int, default=8, help="G samples (rows) per prompt")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--speculation", choices=("adaptive", "fixed", "off"), default="fixed",
                   help="the rollout's speculation policy (rollout only)")
    p.add_argument("--python", action="store_true", help="also trace every Python call (slows the host)")
    p.add_argument("--top", type=int, default=15, help="events listed per thread")
    p.add_argument("--threads", type=int, default=6, help="threads listed, busiest first (waits not counted)")
    p.add_argument("--out", type=Path, default=Path("bench_out/profile"))
    page.add_option(p, "profile")
    args = p.parse_args(argv)
    for name in ("prompts", "samples", "new_tokens", "top", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    try:
        args.spec = None if args.method == "none" else SpecConfig(method=args.method, sam_index=args.sam_index)
    except ValueError as e:
        p.error(f"--method/--sam-index: {e}")
    return args


def make_run(lm, args):
    """A function running the configured call once, returning (steps, a one-line description of the run)."""
    prompts = workloads.held_out_prompts(lm.tokenizer, args.prompts)
    if args.api == "rollout":
        def run():
            r = jaxspec.rollout(lm, prompts, num_samples=args.samples, max_new_tokens=args.new_tokens,
                                sampling=SamplingParams(temperature=args.temperature), spec=args.spec,
                                speculation=args.speculation if args.spec else "off", logprobs=False)
            s = r.stats
            return s.steps, (f"rollout: wall {s.wall_s:.3f} s, {s.steps} steps, acceptance "
                             f"{s.mean_acceptance_length:.2f}, chunks {[(c.batch, c.draft_cap) for c in s.chunks]}")
        return run
    rows = [p for p in prompts for _ in range(args.samples)]
    sampling = [SamplingParams(temperature=args.temperature, seed=i) for i in range(len(rows))]

    def run():
        r = jaxspec.generate(lm, rows, max_new_tokens=args.new_tokens, sampling=sampling, spec=args.spec)
        s = r.stats
        return s.steps, (f"generate: decode {s.decode_s:.3f} s, {s.steps} steps, acceptance "
                         f"{s.mean_acceptance_length:.2f}")
    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    jaxspec.enable_compilation_cache()  # every figure is taken after a warm-up: a cached compile only shortens the run
    lm = jaxspec.load_model()
    run = make_run(lm, args)
    run()  # compiles everything the traced run needs
    trace_dir = args.out / "trace"
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if args.python else 0  # tracing every Python call slows the host several-fold
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options):
        started = time.perf_counter()
        steps, line = run()
        wall_ms = 1000 * (time.perf_counter() - started)
    threads = sorted(trace_summary.summarise(trace_summary.find(trace_dir), top=args.top), key=_working_ms,
                     reverse=True)[:args.threads]
    info = machine.info()
    text = [f"{machine.line(info)}\n{args.api}, method {args.method}, {args.prompts} prompts x {args.samples} "
            f"samples, {args.new_tokens} new tokens, T = {args.temperature}\n{line}\ntraced wall {wall_ms:.1f} ms, "
            f"{steps} steps ({wall_ms / max(steps, 1):.2f} ms a step)\n"]
    for t in threads:
        text.append(f"## {t['process']} / {t['thread']}: busy {t['busy_ms']:.1f} ms, {t['events']} events\n\n"
                    + tables.markdown(("event", "count", "total ms", "mean us", "ms a step"),
                                      [(e["name"][:90], e["count"], f"{e['total_ms']:.2f}", f"{e['mean_us']:.1f}",
                                        f"{e['total_ms'] / max(steps, 1):.3f}") for e in t["top"]]) + "\n")
    report = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "run": line,
              "wall_ms": wall_ms, "steps": steps, "threads": threads}
    output.write(args.out, "profile", report, "\n".join(text))
    if args.write_page:
        page.write(args.write_page, "\n".join(text), info, report)
    return 0
