"""bench_spec's report: the markdown tables and the plot of acceptance length against output position."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import machine, plots
from ..tables import fmt, head, row
from .configs import DEFAULT
from .cost import cost_of


def markdown(report: dict) -> str:
    lines = [f"# jaxspec speculative decoding, {report['model']}, {machine.line(report)}", "",
             f"{report['new_tokens']} new tokens per prompt, "
             f"stopping at EOS{' (ignored)' if report['ignore_eos'] else ''}; "
             f"tokens/s over prefill + decode of all calls (median of {report['repeats']} repeat(s)).", ""]
    lines += ["Configurations (fixed K: draft K tokens whenever the last 2+ tokens occurred before; `default`: "
              "`SpecConfig(method=...)`, for sam the adaptive `SpecConfig.adaptive_sam()`):", ""]
    lines += [f"- {label}: {settings}" for label, settings in report["configs"].items()]
    lines.append("")
    if report.get("copied_4grams"):
        lines += ["Share of the greedy `none` outputs' 4-grams that occur in their prompt: " + ", ".join(
            f"{w} {v:.0%}" for w, v in report["copied_4grams"].items()) + ".", ""]
    costs = report["cost_curve"]
    if costs:
        lines += [f"## c(T): target forward over T new tokens per row / the T = 1 forward, timed inside a jitted loop "
                  f"({report['cost_context']} tokens cached, cache of {report['cost_cache_len']} slots, "
                  f"{report.get('attention_impl', 'xla')} attention)", ""]
        batches = list(costs)
        lines.append(head(["T"] + [col for b in batches for col in (f"batch {b} ms", "c")]))
        for i, first in enumerate(costs[batches[0]]):
            lines.append(row([first["T"]] + [cell for b in batches
                                             for cell in (f"{costs[b][i]['ms']:.1f}", f"{costs[b][i]['c']:.2f}")]))
        lines.append("")
    lines += ["MAL: mean acceptance length (tokens committed per active row-step). c(K+1): the cost of the widest "
              "verify in decode steps; MAL / c(K+1) is the speedup were every step verified at that width. "
              "tokens/s and speedup: prefill + decode, as a user sees them (the targets use these); decode "
              "speedup: the decode loop alone (prefill is the same work for every method). "
              "Overhead: standalone propose + update, and rejection sampling at the narrowest..widest verify "
              "width, at batch 8, in ms and as a share of this configuration's measured batch-8 step (a range: "
              "the loop does not record which width each step took). Greedy == none: identical output rows.", ""]
    for workload, runs in report["runs"].items():
        for temperature in report["temperatures"]:
            lines += [f"### {workload}, temperature {temperature:g}", "",
                      head(["batch", "config", "tokens/s", "speedup vs none", "decode speedup", "MAL", "c(K+1)",
                            "MAL / c(K+1)", "ms/step", "steps", "acceptance by position", "overhead ms (share)",
                            "greedy == none"])]
            lines += [_run_row(r) for r in runs if r["temperature"] == temperature]
            lines.append("")
    if report.get("peers"):
        lines += ["## transformers peer (batch 1, same token ids)", "",
                  head(["workload", "T", "prompts", "plain tokens/s", "prompt lookup 3", "prompt lookup 10",
                        "jaxspec none", "jaxspec sam adaptive", "sam / best prompt lookup",
                        "jaxspec none == peer plain (greedy)"])]
        for p in report["peers"]:
            lines.append(row([p["workload"], f"{p['temperature']:g}", p["prompts"],
                              f"{p['plain']['tokens_per_s']:.1f}", f"{p['prompt_lookup_3']['tokens_per_s']:.1f}",
                              f"{p['prompt_lookup_10']['tokens_per_s']:.1f}",
                              fmt(p.get("jaxspec_none_tokens_per_s"), ".1f"),
                              fmt(p.get("jaxspec_sam_tokens_per_s"), ".1f"), f"{fmt(p.get('sam_over_best_lookup'))}x",
                              p.get("none_equals_peer_plain", "-")]))
        lines.append("")
    if report.get("mismatches"):
        lines += ["## Greedy mismatches (speculative != none)", ""]
        lines += [f"- {m}" for m in report["mismatches"]]
        lines.append("")
    lines += ["## Targets", ""]
    for t in report["targets"]:
        lines.append(f"- {t['target']}: {t['value']} -> {t['status']}")
    lines.append("")
    return "\n".join(lines)


def _run_row(r: dict) -> str:
    rates = " ".join(fmt(a, ".2f") for a in r["acceptance_rate_per_position"][:8])
    rates += " ..." if len(r["acceptance_rate_per_position"]) > 8 else ""
    ov = r.get("overhead")
    ov_text = "-" if ov is None else (
        f"{ov['propose_update_ms']:.2f} + {ov['rejection_ms_min']:.1f}..{ov['rejection_ms']:.1f} "
        f"({fmt(ov['share_min'], '.1%')}..{fmt(ov['share'], '.1%')})")
    return row([r["batch"], r["config"], f"{r['tokens_per_s']:.1f}", f"{fmt(r.get('speedup'))}x",
                f"{fmt(r.get('decode_speedup'))}x", fmt(r["mean_acceptance_length"]), fmt(r.get("c_verify")),
                fmt(r.get("mal_over_c")), f"{r['ms_per_step']:.1f}", r["steps"], rates or "-", ov_text,
                r.get("greedy_equals_none", "-")])


def acceptance_by_position(committed_rows: list[tuple[int, ...]], bin_size: int) -> list[dict]:
    """Mean tokens committed per step, binned by the output position where the step started.

    A histogram of each row's `committed_per_step`: the overall mean acceptance length comes from the stats
    objects, this shows how it changes along the output.
    """
    sums, counts = {}, {}
    for committed in committed_rows:
        position = 1  # the first output token comes from prefill
        for c in committed:
            b = position // bin_size
            sums[b] = sums.get(b, 0) + c
            counts[b] = counts.get(b, 0) + 1
            position += c
    return [{"start": b * bin_size, "steps": counts[b], "mean_acceptance_length": sums[b] / counts[b]}
            for b in sorted(counts)]


def acceptance_curves(runs_by_workload: dict[str, list[dict]], methods: list[str], batch: int,
                      bin_size: int) -> list[dict]:
    """Acceptance against output position of the default setting of each of `methods`, at `batch`."""
    return [{"workload": workload, "config": r["config"], "temperature": r["temperature"], "batch": r["batch"],
             "bins": acceptance_by_position(r["_committed"], bin_size)}
            for workload, runs in runs_by_workload.items() for r in runs
            if r["method"] in methods and r["K"] == DEFAULT and r["batch"] == batch]


def plot_acceptance(curves: list[dict], cost_curve: list[dict] | None, widths: tuple[int, ...], batch: int,
                    path: Path, bin_size: int) -> bool:
    """One line per curve; dotted lines at c(w) for the adaptive sam's verify widths w > 1 at `batch`: the
    acceptance length a step verified at width w must beat to pay for itself. False without matplotlib."""
    plt = plots.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = {}  # one colour per workload and configuration; greedy solid, sampled dashed
    for c in curves:
        colour = colours.setdefault((c["workload"], c["config"]), f"C{len(colours)}")
        xs = [b["start"] + bin_size / 2 for b in c["bins"]]
        ax.plot(xs, [b["mean_acceptance_length"] for b in c["bins"]], marker="o", markersize=3, color=colour,
                linestyle="-" if c["temperature"] == 0 else "--",
                label=f"{c['workload']}, {c['config']}, T={c['temperature']:g}, batch {c['batch']}")
    for w in (w for w in widths if w > 1):
        cw = cost_of(cost_curve, w)
        if np.isfinite(cw):
            ax.axhline(cw, color="grey", linewidth=0.8, linestyle=":")
            ax.annotate(f"c({w}) = {cw:.2f}", (1.0, cw), xycoords=("axes fraction", "data"), fontsize=8,
                        color="grey", xytext=(3, -3), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel(f"position in the output (tokens, {bin_size}-token bins)")
    ax.set_ylabel("mean acceptance length (tokens committed per step)")
    ax.set_title(f"Acceptance against output position; dotted: c(w), the cost of a width-w verify in decode "
                 f"steps (batch {batch})", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    plots.save(fig, path)
    return True
