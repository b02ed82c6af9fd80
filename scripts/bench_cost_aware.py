#!/usr/bin/env python
"""Cost-aware verify widths against the narrowest-width rule, side by side, on held-out prompts (default model).

`SpecConfig(method="sam", cost_aware=False)` verifies each step at the narrowest compiled width holding the
batch's longest draft; `cost_aware=True` measures the cost c(w) of each width (its own and the narrow ones of
`jaxspec.shapes.COST_CHOICE_WIDTHS`) for the batch's shapes and runs the width maximising expected committed
tokens per unit of cost from each row's running acceptance (jaxspec.cost). Each rule runs with sam drafting from the
row's own text alone (`sam_source="dynamic"`) and with the draft corpus shipped for the model beside it ("both").
The default (`sam_source="auto"`, `cost_aware=None`) is "both" by cost at every batch size on a CPU, and the row's
text alone, narrowest width at one row and by cost above, elsewhere; the table marks it. The `--sam-widths` and
`--sam-lookup` rules take the default source. All against plain decoding, greedy,
interleaved over `--repeats` rounds, on the HumanEval prompts held out from head training, completed as code
("held-out") and asked about in a chat ("chat"), or standard-library function heads, code far from HumanEval
and from the shipped corpus ("stdlib"). Outputs must be identical to plain decoding's; the table
reports decode tokens/s relative to `none` (median over rounds, and each round's ratio: this machine is
shared and noisy), mean acceptance length and the c(w) tables measured.

    python scripts/bench_cost_aware.py                       # batch 1 and 8, 8 prompts per workload
    python scripts/bench_cost_aware.py --batches 1 --limit 4 --new-tokens 64 --repeats 2
    python scripts/bench_cost_aware.py --batches 1 --configs "sam narrowest width" --sam-widths "1,5,9,17"
    python scripts/bench_cost_aware.py --batches 1 --configs "sam narrowest width" --sam-lookup "2:2.0:1,5,9,17"
"""

from __future__ import annotations

import argparse
import statistics

import jaxspec
from benchkit import machine, tables, workloads
from benchkit.acceptance import pooled_acceptance_length
from benchkit.cli import ints
from benchkit.timing import interleave
from jaxspec import SamplingParams, SpecConfig, cost
from jaxspec.methods import sam_source_for

CONFIGS = {
    "none": SpecConfig(),
    # the row's own text alone
    "sam narrowest width": SpecConfig(method="sam", cost_aware=False, sam_source="dynamic"),
    "sam cost-aware": SpecConfig(method="sam", cost_aware=True, sam_source="dynamic"),
    # the same with the dynamic source's suffix automaton instead of the default index (same drafts, other costs)
    "sam cost-aware automaton": SpecConfig(method="sam", cost_aware=True, sam_source="dynamic",
                                           sam_index="automaton"),
    # the row's own text and the draft corpus shipped for the model (the target's completions of prompts the
    # benchmark never asks), the longer match drafting: the default on a CPU
    "sam both": SpecConfig(method="sam", cost_aware=False, sam_source="both"),
    "sam both cost-aware": SpecConfig(method="sam", cost_aware=True, sam_source="both"),
}
DEFAULT = SpecConfig(method="sam")


WORKLOADS = ("held-out", "chat", "stdlib")


def prompts_for(workload: str, tokenizer, limit: int) -> list:
    if workload == "held-out":
        return workloads.held_out_prompts(tokenizer, limit)
    if workload == "stdlib":  # code far from HumanEval and from the shipped corpus (the replay's tuning prompts)
        from jaxspec.train.prompts import stdlib_prompts  # jaxspec.train needs the [train] extra

        return [tokenizer.encode(t) for t in stdlib_prompts(limit)]
    return workloads.held_out_chat_texts(tokenizer, limit)


def batches_of(prompts: list, size: int) -> list[list]:
    return [prompts[i: i + size] for i in range(0, len(prompts) - size + 1, size)] or [prompts]


def run(lm, batch: list, spec: SpecConfig, new_tokens: int):
    out = jaxspec.generate(lm, batch, max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0.0),
                           spec=spec)
    return out.token_ids, out.stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="held-out,chat",
                        help=f"of {', '.join(WORKLOADS)} (default: %(default)s)")
    parser.add_argument("--batches", type=ints, default="1,8")
    parser.add_argument("--limit", type=int, default=8, help="prompts per workload (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of the configurations to run; none "
                        "always runs, and '' runs only the --sam-widths and --sam-lookup ones (default: %(default)s)")
    parser.add_argument("--sam-widths", default="", help="more sam configurations at other verify widths, each "
                        "run by the narrowest-width rule: width sets separated by ';', e.g. '1,5,9,17;1,9'")
    parser.add_argument("--sam-lookup", default="", help="more sam configurations with other draft-length rules, "
                        "the default source, widths chosen as by default: "
                        "MIN_MATCH:DRAFT_PER_MATCH:WIDTHS separated by ';', e.g. "
                        "'2:2.0:1,5,9,17;3:inf:1,9,17' (the default is 1:2.0:1,3,5,9,17)")
    args = parser.parse_args(argv)
    if unknown := set(args.workloads.split(",")) - set(WORKLOADS):
        parser.error(f"--workloads names {sorted(unknown)}; the workloads are {', '.join(WORKLOADS)}")
    chosen = [c for c in args.configs.split(",") if c]
    if unknown := set(chosen) - set(CONFIGS):
        parser.error(f"--configs names {sorted(unknown)}; the configurations are {sorted(CONFIGS)}")
    configs = {name: spec for name, spec in CONFIGS.items() if name == "none" or name in chosen}
    for text in filter(None, args.sam_widths.split(";")):
        widths = tuple(ints(text))
        configs[f"sam widths {widths}"] = SpecConfig(method="sam", cost_aware=False, verify_widths=widths)
    for text in filter(None, args.sam_lookup.split(";")):
        try:
            min_match, per_match, widths = text.split(":")
            spec = SpecConfig(method="sam", min_match=int(min_match),
                              draft_per_match=float(per_match), verify_widths=tuple(ints(widths)))
        except ValueError as e:
            parser.error(f"--sam-lookup {text!r}: {e}")
        configs[f"sam min_match {spec.min_match}, per match {spec.draft_per_match}, widths {spec.verify_widths}"] = spec

    lm = jaxspec.load_model()
    print(machine.line(machine.info()))
    print(f"greedy, {args.new_tokens} new tokens, {args.limit} prompts per workload, median of {args.repeats} "
          f"interleaved rounds; tokens/s relative to none\n")
    rows = []
    for workload in args.workloads.split(","):
        prompts = prompts_for(workload, lm.tokenizer, args.limit)
        for size in args.batches:
            groups = batches_of(prompts, size)
            calls = {name: (lambda spec=spec, groups=groups: [run(lm, g, spec, args.new_tokens) for g in groups])
                     for name, spec in configs.items()}
            samples = interleave(calls, args.repeats, alternate=True)
            default_source = sam_source_for(lm, DEFAULT)
            default_cost_aware = DEFAULT.cost_aware_at(size, corpus=default_source != "dynamic")
            rates = {name: [sum(sum(len(t) for t in ids) - len(ids) for ids, _ in r) /
                            sum(s.decode_s for _, s in r) for r in runs] for name, runs in samples.items()}
            plain = statistics.median(rates["none"])
            reference = [ids for ids, _ in samples["none"][0]]
            for name, runs in samples.items():
                same = all([ids for ids, _ in r] == reference for r in runs)
                spec = configs[name]
                source = sam_source_for(lm, spec)
                default = spec.method == "sam" and source == default_source \
                    and spec.cost_aware_at(size, corpus=source != "dynamic") == default_cost_aware \
                    and spec.verify_widths == DEFAULT.verify_widths and spec.sam_index == DEFAULT.sam_index \
                    and spec.min_match == DEFAULT.min_match and spec.draft_per_match == DEFAULT.draft_per_match
                rounds = " ".join(f"{r / n:.2f}" for r, n in zip(rates[name], rates["none"]))
                rows.append((workload, size, name + (" (default)" if default else ""),
                             f"{statistics.median(rates[name]):.1f}", f"{statistics.median(rates[name]) / plain:.3f}",
                             rounds, tables.fmt(pooled_acceptance_length(s for _, s in runs[0])),
                             sum(s.steps for _, s in runs[0]), "yes" if same else "NO"))
                print(" | ".join(map(str, rows[-1])), flush=True)  # as it goes: a run cut short keeps its rows
    print(tables.markdown(("workload", "batch", "config", "tokens/s", "vs none", "each round", "acceptance",
                           "loop steps", "same output"), rows))
    print("\nloop steps: forward passes of the decode loops (summed over the batches). A batch runs until its slowest "
          "row is done, so none's steps over the narrowest-width rule's (every draft scored) bound what any width "
          "choice can gain at one plain step per forward.")
    print("\nc(w) measured for the cost-aware runs (plain steps per forward at each verify width):")
    for t in cost.measured():
        print(f"  batch {t['batch']}, cache {t['cache_len']}, {t['cached']} cached: "
              + ", ".join(f"c({w})={c:.2f}" for w, c in zip(t["widths"], t["costs"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
