"""Comparisons between runs: speedups over `none`, greedy equality, how extractive outputs are; the targets."""

from __future__ import annotations

import numpy as np


def copied_fraction(prompt: list[int], output: list[int], n: int = 4) -> float:
    """Share of the output's n-grams that occur in the prompt: how extractive the output is."""
    grams = {tuple(prompt[i: i + n]) for i in range(len(prompt) - n + 1)}
    outs = [tuple(output[i: i + n]) for i in range(len(output) - n + 1)]
    return sum(g in grams for g in outs) / len(outs) if outs else float("nan")


def describe_greedy_none(workload: str, runs: list[dict], prompts: list[list[int]], tokenizer,
                         show: int) -> dict | None:
    """How extractive the greedy `none` outputs of a workload are (share of their 4-grams in the prompt) and the
    first `show` of them as text, printed and returned; None without a greedy `none` run."""
    none_greedy = next((r for r in runs if r["method"] == "none" and r["temperature"] == 0), None)
    if none_greedy is None:
        return None
    outputs = none_greedy["_outputs"]
    copied = float(np.nanmean([copied_fraction(prompts[i], out) for i, out in zip(none_greedy["prompts"], outputs)]))
    print(f"--- {workload}: {copied:.0%} of the greedy none outputs' 4-grams occur in their "
          f"prompt; output lengths {[len(o) for o in outputs]}", flush=True)
    samples = [tokenizer.decode(out) for out in outputs[:show]]
    for i, text in enumerate(samples):
        print(f"--- {workload} greedy none output {i} (batch {none_greedy['batch']}): {text[:200]!r}", flush=True)
    return {"copied_4grams": copied, "sample_outputs": samples}


def compare_with_none(runs_by_workload: dict[str, list[dict]]) -> list[str]:
    """Adds each run's speedup over `none` at the same workload, batch and temperature, whether its greedy
    outputs equal `none`'s, and whether `none`'s greedy outputs at batch > 1 equal batch 1's. Returns one line
    per greedy output that differs from `none`'s (speculation is lossless: there must be none)."""
    mismatches = []
    for workload, runs in runs_by_workload.items():
        for r in runs:
            base = next(b for b in runs if b["method"] == "none" and b["batch"] == r["batch"]
                        and b["temperature"] == r["temperature"])
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["decode_speedup"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            if r["temperature"] == 0 and r["method"] != "none":
                same = sum(a == b for a, b in zip(r["_outputs"], base["_outputs"]))
                r["greedy_equals_none"] = f"{same}/{len(base['_outputs'])}"
                for i, (a, b) in enumerate(zip(r["_outputs"], base["_outputs"])):
                    if a != b:
                        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                        mismatches.append(f"{workload}, batch {r['batch']}, {r['config']}, prompt "
                                          f"{r['prompts'][i]}: first difference at output token {at} "
                                          f"(spec {a[at:at + 5]} vs none {b[at:at + 5]}; lengths {len(a)}, {len(b)})")
        b1 = next((r for r in runs if r["method"] == "none" and r["batch"] == 1 and r["temperature"] == 0), None)
        for r in runs:
            if r["method"] == "none" and r["batch"] > 1 and r["temperature"] == 0 and b1 is not None:
                pairs = [(b1["_outputs"][b1["prompts"].index(i)], out) for i, out in zip(r["prompts"], r["_outputs"])
                         if i in b1["prompts"]]
                r["greedy_equals_batch1"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return mismatches


def evaluate_targets(report: dict, sam_label: str) -> list[dict]:
    """The issue's targets for the adaptive sam: against the peer's prompt lookup, against `none` per workload,
    and its proposer + rejection overhead at batch 8."""
    targets = []

    def add(target, value, ok):
        status = ok if isinstance(ok, str) else "met" if ok else "NOT met"
        targets.append({"target": target, "value": value, "status": status})

    for p in report.get("peers", []):
        ratio = p.get("sam_over_best_lookup")
        if ratio is not None:
            add(f"{sam_label} >= 1.5x the peer's best prompt lookup ({p['workload']}, T={p['temperature']:g}, batch 1)",
                f"{ratio:.2f}x", ratio >= 1.5)
    for workload, runs in report["runs"].items():
        for r in runs:
            if r["config"] != sam_label or r.get("speedup") is None:
                continue
            where = f"{workload}, T={r['temperature']:g}, batch {r['batch']}"
            if workload == "extractive":
                add(f"{sam_label} >= 2x none ({where})",
                    f"{r['speedup']:.2f}x (decode alone {r['decode_speedup']:.2f}x)", r["speedup"] >= 2.0)
            if workload == "free-form":
                add(f"{sam_label} >= 0.97x none ({where})",
                    f"{r['speedup']:.2f}x (decode alone {r['decode_speedup']:.2f}x)", r["speedup"] >= 0.97)
            ov = r.get("overhead")
            if r["batch"] == 8 and ov is not None:
                low, high = ov["share_min"], ov["share"]
                add(f"{sam_label} proposer + rejection sampling < 5% of the step ({where})",
                    f"{low:.1%} (every step at the narrowest width) .. {high:.1%} (at the widest)",
                    "met" if high < 0.05 else "NOT met" if low >= 0.05 else
                    "met only if most steps verify at the narrow widths")
    if not report.get("peers"):
        targets.append({"target": f"{sam_label} >= 1.5x the peer's best prompt lookup", "value": "-",
                        "status": "not measured (run with --peers)"})
    return targets
