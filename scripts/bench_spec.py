#!/usr/bin/env python
"""Benchmark speculative decoding of the default model on this machine.

What it measures, all in one process, each figure next to the verification cost that bounds it:

1. c(T): the target forward over T new tokens per row (KV cache of realistic length, timed inside a jitted
   loop as the decode loop runs it, median of repeated calls), as a multiple of the T = 1 decode forward, at
   each batch size. Verifying K drafts costs c(K + 1) decode steps, so a method pays only when its mean
   acceptance length beats it.
2. Two workloads (scripts/benchkit/workloads.py): free-form (HumanEval prompts, plain text completion) and
   extractive (chat requests to rewrite a HumanEval function: answers that mostly copy the input), greedy and
   sampled. The core configurations (none, ngram default, sam adaptive = `SpecConfig.adaptive_sam()`) run at
   every batch and temperature; the K sweep (ngram and sam at fixed K, self_draft) at --sweep-batches and
   --sweep-temperatures (--full: everywhere). Same prompts, batch and sampling for every method: tokens/s,
   speedup over `none`, mean acceptance length (tokens committed per active row-step), acceptance rate per
   draft position, ms per step.
3. Proposer + rejection-sampling cost, standalone: jitted propose + update of each proposer and
   `jaxspec.rejection_sample` at the real shapes (batch 8, at each verify width), as a share of the measured
   step time of that configuration at batch 8: a range, from every step verifying at the narrowest width to
   every step at the widest (the loop does not record which width each step took).
4. With --peers: transformers' prompt-lookup decoding (prompt_lookup_num_tokens 3 and 10) and its plain
   decoding on the same token ids at batch 1, and the greedy output checks (jaxspec none == peer plain;
   every jaxspec speculative run == jaxspec none: they must).

Every configuration is compiled once before it is timed (a generation with the same shapes whose rows stop
at their first token), and a counter of compiled programs confirms that no timed run compiled.

    python scripts/bench_spec.py              # default run: ~37 min on an idle 2-core VM (~30 with a warm
                                              # compile cache), + ~7 min with --peers
    python scripts/bench_spec.py --peers      # + transformers peers (pip install -e ".[peers]")
    python scripts/bench_spec.py --ks 1,3 --methods none,ngram,sam        # narrower: ~27 min
    python scripts/bench_spec.py --workloads ""                           # c(T) alone: ~3 min
    python scripts/bench_spec.py --limit 2 --batch1-limit 1 --new-tokens 16 --ks 3 --cost-ts 1,9   # smoke test
    python scripts/bench.py --spec ...        # the same, through scripts/bench.py

Outputs: bench_out/bench_spec.json, bench_out/bench_spec.md (the tables, also printed) and
bench_out/acceptance_vs_position.png (mean acceptance length against position in the output; needs matplotlib).
The pieces (configurations, c(T), runner, checks, overhead, peers, report) are in scripts/benchkit/spec/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import jaxspec
from benchkit import machine, page, workloads
from benchkit.cli import floats, ints
from benchkit.spec.checks import compare_with_none, describe_greedy_none, evaluate_targets
from benchkit.spec.configs import (
    RUNNABLE,
    SAM_LABEL,
    Plan,
    adaptive_sam,
    config_settings,
    drop_duplicates,
    make_configs,
    parse_ks,
)
from benchkit.spec.cost import cost_curves
from benchkit.spec.overhead import add_overheads
from benchkit.spec.peers import compare_with_peers
from benchkit.spec.report import acceptance_curves, markdown, plot_acceptance
from benchkit.spec.runner import Runner, run_workload
from jaxspec import SpecConfig
from jaxspec.generation import default_attention_impl

DEFAULT_COST_TS = "1,2,3,4,5,6,8,9,16,17,32"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="free-form,extractive", help="(default: %(default)s)")
    parser.add_argument("--limit", type=int, default=8, help="prompts per workload (default: %(default)s)")
    parser.add_argument("--batch1-limit", type=int, default=4,
                        help="prompts (the first of --limit) for batch-1 runs and the peers (default: %(default)s)")
    parser.add_argument("--methods", default=",".join(RUNNABLE), help="(default: %(default)s)")
    parser.add_argument("--ks", default="1,3,5,8", help="the K sweep: fixed K for ngram and sam; their default "
                        "settings (sam adaptive) always run (default: %(default)s)")
    parser.add_argument("--self-draft-ks", default="3", help="the K sweep for self_draft; 'default' is its default "
                        "setting (default: %(default)s)")
    parser.add_argument("--self-draft-layers", type=int, default=SpecConfig.self_draft_layers,
                        help="(default: %(default)s)")
    parser.add_argument("--batches", type=ints, default="1,8", help="batches of the core configurations: none, "
                        "ngram default, sam adaptive (default: %(default)s)")
    parser.add_argument("--temperatures", type=floats, default="0,0.8", help="0 is greedy (default: %(default)s)")
    parser.add_argument("--sweep-batches", type=ints, default="8", help="batches of the K sweep (default: %(default)s)")
    parser.add_argument("--sweep-temperatures", type=floats, default="0", help="temperatures of the K sweep (default: "
                        "%(default)s)")
    parser.add_argument("--full", action="store_true", help="the K sweep at every batch and temperature too")
    parser.add_argument("--new-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate all --new-tokens (default: stop at EOS)")
    parser.add_argument("--seed", type=int, default=0, help="row i samples with seed + i (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per run; the median is reported "
                        "(default: %(default)s)")
    parser.add_argument("--cost-ts", type=ints, default=DEFAULT_COST_TS,
                        help="T for c(T); empty to skip (default: %(default)s)")
    parser.add_argument("--cost-context", type=int, default=384, help="tokens cached for c(T) (default: %(default)s)")
    parser.add_argument("--cost-cache-len", type=int, default=640, help="cache slots for c(T) (default: %(default)s)")
    parser.add_argument("--cost-repeats", type=int, default=7, help="timed calls per T, round-robin over the Ts "
                        "(default: %(default)s)")
    parser.add_argument("--cost-forwards", type=int, default=4, help="forwards per timed call, in one jitted loop "
                        "(default: %(default)s)")
    parser.add_argument("--overhead-repeats", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--attention", choices=["xla", "pallas"], default=None,
                        help="attention of c(T) and every run (default: the platform's, Pallas on a GPU); "
                        "`--workloads '' --attention xla` beside the default run separates the kernel's share")
    parser.add_argument("--peers", action="store_true", help="also run transformers (the [peers] extra)")
    parser.add_argument("--peer-limit", type=int, default=None, help="prompts for the peers (default: the batch-1 "
                        "prompts)")
    parser.add_argument("--plot-methods", default="sam,ngram", help="methods whose default setting is plotted "
                        "(default: %(default)s)")
    parser.add_argument("--plot-bin", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--plot-batch", type=int, default=1, help="the batch whose runs are plotted (default: "
                        "%(default)s, else the first of --batches)")
    parser.add_argument("--show-outputs", type=int, default=2, help="greedy none outputs to print per workload "
                        "(default: %(default)s)")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="JAX's persistent compilation cache: a rerun skips the compiles of unchanged programs; "
                        "empty to switch it off (default: jaxspec's, ~/.cache/jaxspec-xla)")
    parser.add_argument("--out", default="bench_out/bench_spec.json", help="(default: %(default)s)")
    page.add_option(parser, "spec")
    args = parser.parse_args(argv)
    for m in (m for m in args.methods.split(",") if m):
        if m not in RUNNABLE:
            parser.error(f"--methods: {m!r} is not one of {RUNNABLE}")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    """The core batches and temperatures, and the sweep's (--full: the core's); every batch and temperature
    that anything runs at, the core's first."""
    batches, temperatures = args.batches, args.temperatures
    sweep_batches = batches if args.full else args.sweep_batches
    sweep_temperatures = temperatures if args.full else args.sweep_temperatures
    return Plan(batches=tuple(batches + [b for b in sweep_batches if b not in batches]),
                temperatures=tuple(temperatures + [t for t in sweep_temperatures if t not in temperatures]),
                sweep_batches=tuple(sweep_batches), sweep_temperatures=tuple(sweep_temperatures),
                batch1_limit=min(args.batch1_limit, args.limit))


def public(x):
    """The report without its in-memory `_` keys, with non-finite floats as null: what the JSON holds."""
    if isinstance(x, dict):
        return {k: public(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, list):
        return [public(v) for v in x]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_cache != "":
        jaxspec.enable_compilation_cache(args.compile_cache)

    started = time.perf_counter()
    methods = [m for m in args.methods.split(",") if m]
    if "none" not in methods:
        methods.insert(0, "none")  # speedups and the greedy checks are measured against it
    plan = make_plan(args)
    core_temperatures = args.temperatures
    configs, aliases = drop_duplicates(make_configs(methods, parse_ks(args.ks), parse_ks(args.self_draft_ks),
                                                    args.self_draft_layers))
    out_json = Path(args.out)
    out_json.parent.mkdir(parents=True, exist_ok=True)

    lm = jaxspec.load_model(jaxspec.DEFAULT_MODEL)
    attention = args.attention or default_attention_impl()
    prompts = {w: workloads.load_workload(w, lm.tokenizer, args.limit) for w in args.workloads.split(",") if w}
    report = machine.info() | {
        "model": lm.name, "new_tokens": args.new_tokens, "ignore_eos": args.ignore_eos, "repeats": args.repeats,
        "temperatures": list(plan.temperatures), "batches": list(plan.batches), "args": vars(args),
        "configs": {c.label: config_settings(c.spec) for c in configs}
        | {a: f"the same settings as {b} (not run twice)" for a, b in aliases.items()},
        "prompt_tokens": {w: [len(p) for p in ps] for w, ps in prompts.items()},
        "cost_context": args.cost_context, "cost_cache_len": args.cost_cache_len, "attention_impl": attention}
    print(f"# {lm.name}: workloads {list(prompts)}, {len(configs)} configs {[c.label for c in configs]}, "
          f"batches {list(plan.batches)}, temperatures {list(plan.temperatures)}, attention {attention}", flush=True)

    # 1. c(T)
    cost_ts = args.cost_ts
    costs = report["cost_curve"] = cost_curves(lm, list(plan.batches), cost_ts, args.cost_context,
                                               args.cost_cache_len, args.cost_repeats,
                                               args.cost_forwards, attention) if cost_ts else {}

    # 2. the runs, and what the greedy none outputs look like
    runner = Runner(lm, args.new_tokens, args.ignore_eos, args.seed, args.repeats, attention)
    report["runs"] = {}
    for workload, ps in prompts.items():
        runs = report["runs"][workload] = run_workload(runner, workload, ps, configs, plan, costs)
        described = describe_greedy_none(workload, runs, ps, lm.tokenizer, args.show_outputs)
        if described is not None:
            for key, value in described.items():
                report.setdefault(key, {})[workload] = value

    # speedups and greedy checks, within (workload, batch, temperature)
    report["mismatches"] = compare_with_none(report["runs"])
    for m in report["mismatches"]:
        print(f"MISMATCH: {m}")

    # 3. proposer + rejection overhead at batch 8
    if 8 in plan.batches:
        add_overheads(lm, report["runs"], prompts, configs, args.new_tokens, args.overhead_repeats)

    # 4. peers
    report["peers"] = []
    if args.peers:
        count = min(args.peer_limit or plan.batch1_limit, plan.batch1_limit)
        report["peers"] = compare_with_peers(report["runs"], prompts, core_temperatures, count, args.new_tokens,
                                             args.seed, SAM_LABEL)

    # 5. the plot: adaptive configs, at batch 1 where it ran (else the first batch)
    plot_batch = args.plot_batch if args.plot_batch in plan.batches else plan.batches[0]
    curves = report["acceptance_vs_position"] = acceptance_curves(report["runs"], args.plot_methods.split(","),
                                                                  plot_batch, args.plot_bin)
    png = out_json.parent / "acceptance_vs_position.png"
    plotted = bool(curves) and plot_acceptance(curves, costs.get(plot_batch), adaptive_sam().verify_widths,
                                               plot_batch, png, args.plot_bin)

    report["targets"] = evaluate_targets(report, SAM_LABEL)
    report["total_s"] = time.perf_counter() - started
    text = markdown(report) + f"\nTotal run time: {report['total_s'] / 60:.1f} min.\n"
    print("\n" + text)
    md = out_json.with_suffix(".md")
    md.write_text(text)
    out_json.write_text(json.dumps(public(report), indent=2, default=str))
    print(f"JSON: {out_json}\nmarkdown: {md}" + (f"\nplot: {png}" if plotted else ""))
    if args.write_page:
        page.write(args.write_page, text, report, public(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
