#!/usr/bin/env python
"""RL rollouts side by side: the long tail, per-row and grouped speculation, references (default model, CPU).

P HumanEval prompts (held out from head training) x G samples each, sampled at each temperature, up to N new
tokens. Per temperature, with the same seeds (`jaxspec.sample_seeds`), interleaved over `--repeats` rounds
after a warm-up that compiles everything:

* generate   every sample as one `jaxspec.generate` batch: no compaction, the batch waits for its slowest row;
* none       `jaxspec.rollout` without speculation: the tail compacted into smaller compiled batches;
* none-unshared  the same with every sample prefilling its prompt itself (what shared prefill saves: the
             "prefill s" column is the time to every sample's first token);
* sam        rollout, each row drafting from its own text (suffix automaton);
* group_sam  rollout, each row drafting from every sample of its prompt;
* group_sam+refs  the same with an earlier rollout (another seed) of each prompt as references.
A speculative method may name its index after "@" (`SpecConfig.sam_index`): group_sam@automaton,
group_sam@match, sam@automaton; without one it takes the default ("auto"). group_sam/N drafts N paths
(`SpecConfig.tree_top_k`, a tree of continuations that differ in their first token): group_sam/2,
group_sam+refs/2@match.

The speculation runs use the policy `--speculation` names: by default adaptive (speculate where the measured
verify cost of the current batch is repaid by the measured acceptance); "fixed" measures drafting quality.
Every run must produce the same samples as `generate` and as rollout-none (the table counts identical samples
against each; on a GPU at XLA's default TF32 precision they can differ, see docs/how-to/rollouts.md). Reported:
whole-rollout wall time and its ratio to rollout-none, the tail (from 90%
of the samples finished to the last) and its ratio, acceptance overall and in the tail, tokens/s; and the
ceiling: the share of next tokens that the 4-token context before them, seen earlier in the sample's own text
or anywhere in its group, predicts. A plot shows active rows and committed tokens per step over time.

    python scripts/bench_rollout.py                                   # 16 x 8, 256 tokens, T = 0.7 and 1.0
    python scripts/bench_rollout.py --prompts 4 --samples 8 --new-tokens 128 --temperatures 0.7 --repeats 1
    python scripts/bench_rollout.py --methods none,group_sam@automaton,group_sam,group_sam/2 --speculation fixed
    python scripts/bench_rollout.py --stop humaneval --new-tokens 512 --methods generate,none,group_sam

`--stop humaneval` cuts each sample where HumanEval's scoring cuts it (the end of the function: "\\ndef",
"\\nclass", "\\nif", "\\nprint", "\\n#"): completions end at different lengths, as an RL reward sees them, and a
tail of few running samples forms. The table gives the tail's share of the rollout's wall time, and the active
samples over time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from pathlib import Path

import numpy as np

import jaxspec
from benchkit import machine, output, page, plots, tables, workloads
from benchkit.cli import floats
from benchkit.timing import interleave
from jaxspec import SamplingParams, SpecConfig
from jaxspec.proposers.sam import SAM_INDEXES

METHODS = ("generate", "none", "none-unshared", "sam", "group_sam", "group_sam+refs")
CONTEXT = 4  # tokens of context behind a predicted next token, for the ceiling


def ceiling(prompts: list[list[int]], samples: list[list[list[int]]]) -> tuple[float, float]:
    """(own, group): the share of generated tokens whose preceding CONTEXT tokens occurred before, followed by
    that same token, in the sample's own text so far (prompt + its earlier output) / anywhere in its group (the
    prompt, the sample's own text so far, its siblings' whole outputs)."""
    hits_own = hits_group = total = 0
    for prompt, group in zip(prompts, samples):
        sibling_next: dict[int, dict[tuple, set]] = {}
        for g, out in enumerate(group):
            table: dict[tuple, set] = {}
            text = prompt + out
            for i in range(CONTEXT, len(text)):
                table.setdefault(tuple(text[i - CONTEXT: i]), set()).add(text[i])
            sibling_next[g] = table
        for g, out in enumerate(group):
            text = prompt + out
            own: dict[tuple, set] = {}
            for i in range(CONTEXT, len(text)):
                ctx, nxt = tuple(text[i - CONTEXT: i]), text[i]
                if i >= len(prompt):
                    total += 1
                    in_own = nxt in own.get(ctx, ())
                    in_group = in_own or any(nxt in sibling_next[h].get(ctx, ()) for h in sibling_next if h != g)
                    hits_own += in_own
                    hits_group += in_group
                own.setdefault(ctx, set()).add(nxt)
    return hits_own / max(total, 1), hits_group / max(total, 1)


def parse_method(method: str) -> tuple[str, int | None, str]:
    """"name[/paths][@index]" -> (name, paths or None, index); ValueError for what the script cannot run."""
    rest, _, index = method.partition("@")
    name, _, paths = rest.partition("/")
    speculative = name in METHODS and name != "generate" and not name.startswith("none")
    if (name not in METHODS or ((index or paths) and not speculative) or (index and index not in SAM_INDEXES)
            or (paths and (not paths.isdigit() or not name.startswith("group_sam")))):
        raise ValueError(f"{method!r} is not one of {METHODS}, with /paths for group_sam and @ one of "
                         f"{SAM_INDEXES} for a speculative one")
    if speculative:  # SpecConfig's own checks: paths must divide K, paths need the texts index
        SpecConfig(method=name.split("+")[0], sam_index=index or "auto", tree_top_k=int(paths) if paths else None)
    return name, int(paths) if paths else None, index or "auto"


def run(lm, method: str, prompts, common: dict, every, generate_sampling, earlier):
    """One timed call: `generate` over every sample, or a rollout with the method (earlier: the references)."""
    if method == "generate":
        res = jaxspec.generate(lm, every, max_new_tokens=common["max_new_tokens"], sampling=generate_sampling,
                               stop=common.get("stop"))
        print(f"  generate: {res.stats.prefill_s + res.stats.decode_s:.1f} s", flush=True)
        return res
    name, paths, index = parse_method(method)
    spec = None if name.startswith("none") else SpecConfig(method=name.split("+")[0], sam_index=index,
                                                            tree_top_k=paths)
    refs = earlier if name.endswith("+refs") else None
    if spec is None:
        common = common | {"speculation": "off"}
    res = jaxspec.rollout(lm, prompts, spec=spec, references=refs, logprobs=False,
                          shared_prefill=name != "none-unshared", **common)
    s = res.stats
    print(f"  {method}: wall {s.wall_s:.1f} s, prefill {s.prefill_s:.2f} s, tail {s.tail_s:.1f} s, acceptance "
          f"{s.mean_acceptance_length:.3f} (tail {s.tail_mean_acceptance_length:.3f}), caps "
          f"{[(c.batch, c.draft_cap) for c in s.chunks]}", flush=True)
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--temperatures", type=floats, default="0.7,1.0")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculation", default="adaptive", choices=("adaptive", "fixed", "off"),
                        help="the rollouts' speculation policy (fixed: measure drafting quality where it loses)")
    parser.add_argument("--stop", default="none", choices=("none", "humaneval"),
                        help="stop strings: none (samples end at EOS or the budget) or HumanEval's end of function")
    parser.add_argument("--out", default="bench_out/rollout")
    page.add_option(parser, "rollout")
    args = parser.parse_args(argv)
    jaxspec.enable_compilation_cache()  # every figure is taken after a warm-up: a cached compile only shortens the run

    lm = jaxspec.load_model()
    prompts = workloads.held_out_prompts(lm.tokenizer, args.prompts)
    methods = args.methods.split(",")
    for m in methods:
        try:
            parse_method(m)
        except ValueError as e:
            parser.error(f"--methods: {e}")
    info = machine.info()
    header = (f"{machine.line(info)}\n{len(prompts)} held-out HumanEval prompts x {args.samples} samples, up to "
              f"{args.new_tokens} new tokens, top-p 1, speculation {args.speculation}, "
              + ("cut at HumanEval's stop strings, " if args.stop == "humaneval" else "")
              + f"{args.repeats} timed round(s) after a warm-up\n")
    report, sections = {"machine": info, "args": vars(args), "temperatures": {}}, [header]
    out_dir = Path(args.out)
    for temperature in args.temperatures:
        sampling = SamplingParams(temperature=temperature)
        common = dict(num_samples=args.samples, max_new_tokens=args.new_tokens, sampling=sampling, seed=args.seed,
                      stop=list(workloads.HUMANEVAL_STOP) if args.stop == "humaneval" else None)
        earlier = jaxspec.rollout(lm, prompts, **common | {"seed": args.seed + 1000}, logprobs=False)
        common["speculation"] = args.speculation
        seeds = jaxspec.sample_seeds(args.seed, len(prompts), args.samples).reshape(-1)
        every = [p for p in prompts for _ in range(args.samples)]

        generate_sampling = [SamplingParams(temperature=temperature, seed=int(s)) for s in seeds]
        calls = {m: functools.partial(run, lm, m, prompts, common, every, generate_sampling, earlier.token_ids)
                 for m in methods}
        samples = interleave(calls, args.repeats, alternate=True)
        rows, entry = [], {}
        base = samples["generate"][0].token_ids if "generate" in samples else None
        # Beside generate: on a GPU rollout-none itself can differ from generate (TF32 rounding depends on shapes),
        # and then whether speculation changed a sample is this column's question.
        plain = [t for g in samples["none"][0].token_ids for t in g] if "none" in samples else None
        wall = {m: statistics.median(r.stats.decode_s + r.stats.prefill_s if m == "generate" else r.stats.wall_s
                                     for r in runs) for m, runs in samples.items()}
        tail = {m: statistics.median(r.stats.tail_s for r in runs) for m, runs in samples.items() if m != "generate"}
        for m, runs in samples.items():
            r = runs[-1]
            flat = r.token_ids if m == "generate" else [t for g in r.token_ids for t in g]
            same = sum(a == b for a, b in zip(flat, base)) if base is not None else None
            same_plain = sum(a == b for a, b in zip(flat, plain)) if plain is not None else None
            tokens = sum(len(t) for t in flat)
            s = r.stats
            acc = s.mean_acceptance_length
            tail_acc = None if m == "generate" else s.tail_mean_acceptance_length
            rows.append((m, f"{wall[m]:.1f}", f"{statistics.median(x.stats.prefill_s for x in runs):.2f}",
                         tables.fmt(wall.get("none", np.nan) / wall[m], ".3f"),
                         tables.fmt(tail.get(m), ".1f"),
                         tables.fmt(tail[m] / wall[m] if tail.get(m) is not None else None, ".2f"),
                         tables.fmt(tail["none"] / tail[m] if tail.get(m) and tail.get("none") else None, ".3f"),
                         tables.fmt(acc), tables.fmt(tail_acc), f"{tokens / wall[m]:.0f}",
                         f"{same}/{len(flat)}" if same is not None else "-",
                         f"{same_plain}/{len(flat)}" if same_plain is not None else "-"))
            entry[m] = dict(wall_s=[x.stats.decode_s + x.stats.prefill_s if m == "generate" else x.stats.wall_s
                                    for x in runs], tail_s=tail.get(m), acceptance=acc, tail_acceptance=tail_acc,
                            tokens=tokens, identical=same, identical_to_none=same_plain,
                            timeline=None if m == "generate" else dict(
                                active=s.active_per_step, committed=s.committed_per_step, end_s=s.step_end_s,
                                chunks=[c.__dict__ for c in s.chunks]))
        rollout_none = samples.get("none", [None])[0]
        own, group = ceiling(prompts, rollout_none.token_ids) if rollout_none else (None, None)
        entry["ceiling"] = dict(own=own, group=group)
        report["temperatures"][str(temperature)] = entry
        sections.append(f"## T = {temperature}\n\n" + tables.markdown(
            ("method", "wall s", "prefill s", "vs rollout-none", "tail s", "tail share", "tail vs none", "acceptance",
             "tail acceptance", "tokens/s", "same as generate", "same as rollout-none"), rows)
            + f"\n\nceiling: a {CONTEXT}-token context seen before predicts the next token for "
              f"{tables.fmt(own, '.3f')} of tokens (own text), {tables.fmt(group, '.3f')} (group)\n\n"
            + "active samples at 0, 25, 50, 75 and 90% of the wall time:\n"
            + "".join(f"- {m}: {active_over_time(runs[-1].stats)}\n" for m, runs in samples.items()
                      if m != "generate")
            + "\nms a step inside the chunks, by compiled batch and draft cap (in brackets), median over the chunks:\n"
            + "".join(f"- {m}: {step_costs(runs[-1].stats.chunks)}\n" for m, runs in samples.items()
                      if m != "generate"))
        _plot(samples, temperature, out_dir)
    output.write(out_dir, "bench_rollout", report, "\n".join(sections))
    if args.write_page:
        page.write(args.write_page, "\n".join(sections), info, {k: v for k, v in report.items() if k != "machine"})
    total = args.prompts * args.samples
    differ = [m for m, e in ((m, report["temperatures"][t][m]) for t in report["temperatures"] for m in methods)
              if any(n is not None and n != total for n in (e["identical"], e["identical_to_none"]))]
    return output.exit_status(differ, "samples differ from generate's or rollout-none's")


def active_over_time(stats) -> str:
    """The samples still generating at fractions of the rollout's wall time, e.g. "64, 41, 12, 3, 1": how soon the
    batch thins out into a tail."""
    ends = np.asarray(stats.step_end_s)
    active = np.asarray(stats.active_per_step)
    counts = []
    for f in (0.0, 0.25, 0.5, 0.75, 0.9):
        at = f * stats.wall_s
        counts.append(stats.num_samples if at < stats.prefill_s or not len(ends) else
                      int(active[min(np.searchsorted(ends, at), len(active) - 1)]) if at <= ends[-1] else 0)
    return ", ".join(map(str, counts))


def step_costs(chunks) -> str:
    """Device time per decode step for each compiled batch and draft cap, e.g. "64 rows 8.3 ms (8), 32 rows 7.9 ms
    (8)": what a step costs beside the step counts, the first place to look when a method is slower than
    rollout-none."""
    per_shape, before = {}, 0
    for c in chunks:
        if c.end_step > before:
            per_shape.setdefault((c.batch, c.draft_cap), []).append(1000 * c.run_s / (c.end_step - before))
        before = c.end_step
    return ", ".join(f"{b} rows {statistics.median(ms):.1f} ms ({cap})" for (b, cap), ms in per_shape.items())


def _plot(samples: dict, temperature: float, out_dir: Path) -> None:
    plt = plots.pyplot()
    if plt is None:
        return
    fig, (ax_rows, ax_tokens) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for m, runs in samples.items():
        if m == "generate":
            continue
        s = runs[-1].stats
        ax_rows.step(s.step_end_s, s.active_per_step, where="post", label=m)
        ax_tokens.plot(s.step_end_s, s.committed_per_step, label=m, linewidth=0.8)
    ax_rows.set_ylabel("active samples")
    ax_tokens.set_ylabel("tokens committed per step")
    ax_tokens.set_xlabel("seconds since the rollout started")
    ax_rows.legend()
    ax_rows.set_title(f"rollout timeline, T = {temperature}")
    out_dir.mkdir(parents=True, exist_ok=True)
    plots.save(fig, out_dir / f"rollout_T{temperature}.png")


if __name__ == "__main__":
    raise SystemExit(main())
