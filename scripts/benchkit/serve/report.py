"""bench_serve's report: throughput ratios between modes, the targets, the markdown tables, the plot, the files."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path

from .. import machine, plots
from ..tables import fmt, head, row
from .results import LevelResult
from .servers import Target


def throughput_of(levels: list[LevelResult]) -> dict[tuple[str, int], float]:
    """Completion tokens/s of each (mode, concurrency) that completed a request."""
    return {(lv.mode, lv.concurrency): lv.throughput_tok_s for lv in levels if lv.ok_requests}


def ratio_rows(levels: list[LevelResult], concurrencies: list[int]) -> list[dict]:
    """adaptive/off, fixed/off and adaptive/fixed throughput at each concurrency (None where a mode is missing)."""
    tp = throughput_of(levels)

    def ratio(a, b, c):
        return tp[(a, c)] / tp[(b, c)] if (a, c) in tp and (b, c) in tp and tp[(b, c)] > 0 else None

    return [{"concurrency": c, "fixed/off": ratio("fixed", "off", c), "adaptive/off": ratio("adaptive", "off", c),
             "adaptive/fixed": ratio("adaptive", "fixed", c)} for c in concurrencies]


def target_checks(ratios: list[dict], high_concurrency: int, tolerance: float) -> list[str]:
    """The issue's targets: adaptive no more than `tolerance` below off at high concurrency; at concurrency 1
    adaptive keeps fixed's gain (adaptive/fixed >= 1 - tolerance)."""
    lines = []
    for r in ratios:
        c, a_off, a_fixed = r["concurrency"], r["adaptive/off"], r["adaptive/fixed"]
        if c >= high_concurrency and a_off is not None:
            ok = a_off >= 1.0 - tolerance
            lines.append(f"c={c}: adaptive/off {a_off:.3f} >= {1 - tolerance:.2f}: {'met' if ok else 'NOT met'}")
        if c == 1 and a_fixed is not None:
            ok = a_fixed >= 1.0 - tolerance
            lines.append(f"c=1: adaptive/fixed {a_fixed:.3f} >= {1 - tolerance:.2f} (keeps fixed's gain, "
                         f"fixed/off {fmt(r['fixed/off'], '.3f')}): {'met' if ok else 'NOT met'}")
    return lines


def peer_checks(levels: list[LevelResult], reference: str, ours: list[str], concurrencies: list[int]) -> list[str]:
    """Each of our modes against the reference server at each concurrency: throughput at least the reference's,
    p99 time to first token at most the reference's."""
    by_key = {(lv.mode, lv.concurrency): lv for lv in levels if lv.ok_requests}
    lines = []
    for c in concurrencies:
        ref = by_key.get((reference, c))
        for mode in ours:
            lv = by_key.get((mode, c))
            if ref is None or lv is None or not ref.throughput_tok_s:
                continue
            x = lv.throughput_tok_s / ref.throughput_tok_s
            ttft_ok = lv.ttft_p99_ms is not None and ref.ttft_p99_ms is not None and lv.ttft_p99_ms <= ref.ttft_p99_ms
            lines.append(f"c={c}, {mode}: throughput {x:.2f}x {reference}'s >= 1: {'met' if x >= 1 else 'NOT met'}; "
                         f"TTFT p99 {fmt(lv.ttft_p99_ms, '.0f')} ms <= {reference}'s {fmt(ref.ttft_p99_ms, '.0f')} ms: "
                         f"{'met' if ttft_ok else 'NOT met'}")
    return lines


def same_text(level: LevelResult, reference: LevelResult) -> tuple[int, int]:
    """How many of level's completed requests streamed the same text as the reference's first completed request of
    their prompt, out of those that have one to compare with. At temperature 0 a lossless server's are all equal."""
    texts = {}
    for r in reference.requests:
        if r.ok:
            texts.setdefault(r.prompt_index, r.text)
    compared = [r.text == texts[r.prompt_index] for r in level.requests if r.ok and r.prompt_index in texts]
    return sum(compared), len(compared)


def markdown_report(machine_info: dict, levels: list[LevelResult], ratios: list[dict], checks: list[str],
                    reference: str | None = None) -> str:
    """The table of every (mode, concurrency); with `reference` (a peer's label) two more columns: throughput as a
    multiple of the reference's at that concurrency, and how many completions are the reference's text."""
    tp = throughput_of(levels)
    by_key = {(lv.mode, lv.concurrency): lv for lv in levels}
    title = "jaxspec server under load" if reference is None else f"jaxspec's server beside {reference} under load"
    columns = ["mode", "concurrency", "requests", "errors", "completion tokens", "wall s", "tokens/s", "x off"]
    if reference is not None:
        columns += [f"x {reference}", f"same text as {reference}"]
    out = [f"# {title}, {machine.line(machine_info)}", "",
           head(columns + ["requests/s", "TTFT p50 ms", "TTFT p99 ms", "per-token p50 ms", "per-token p99 ms",
                           "mean acceptance length", "mean active rows"])]
    for lv in levels:
        off = tp.get(("off", lv.concurrency))
        x_off = lv.throughput_tok_s / off if off and lv.ok_requests else None
        cells = [lv.mode, lv.concurrency, lv.num_requests, lv.errors, lv.completion_tokens, f"{lv.wall_s:.1f}",
                 f"{lv.throughput_tok_s:.1f}", fmt(x_off, ".2f")]
        if reference is not None:
            ref = by_key.get((reference, lv.concurrency))
            x_ref = lv.throughput_tok_s / tp[(reference, lv.concurrency)] if (
                ref is not None and lv.ok_requests and tp.get((reference, lv.concurrency))) else None
            same, compared = same_text(lv, ref) if ref is not None else (0, 0)
            cells += [fmt(x_ref, ".2f"), f"{same}/{compared}" if compared else fmt(None)]
        out.append(row(cells + [f"{lv.requests_per_s:.2f}", fmt(lv.ttft_p50_ms, ".0f"), fmt(lv.ttft_p99_ms, ".0f"),
                                fmt(lv.tpot_p50_ms, ".1f"), fmt(lv.tpot_p99_ms, ".1f"),
                                fmt(lv.mean_acceptance_length, ".2f"), fmt(lv.mean_active_rows, ".1f")]))
    # With fixed beside adaptive: their ratios to each other (the table's "x off" column has the rest).
    if any(r["fixed/off"] is not None for r in ratios):
        out += ["", "Throughput ratios (same run, same prompts):", "",
                head(["concurrency", "fixed/off", "adaptive/off", "adaptive/fixed"])]
        out += [row([r["concurrency"], fmt(r["fixed/off"], ".3f"), fmt(r["adaptive/off"], ".3f"),
                     fmt(r["adaptive/fixed"], ".3f")]) for r in ratios]
    errors = Counter()
    for lv in levels:
        errors.update(lv.error_kinds)
    if errors:
        out += ["", "Failed requests: " + ", ".join(f"{k}: {v}" for k, v in errors.most_common())]
    no_usage = sum(lv.usage_missing for lv in levels)
    if no_usage:
        out += ["", f"{no_usage} requests ended without a usage chunk: their completion tokens are counted as "
                "content chunks, a lower bound (throughput and per-token latency of those levels are off)"]
    if checks:
        out += ["", "Targets:", ""] + [f"- {line}" for line in checks]
    return "\n".join(out) + "\n"


def plot(levels: list[LevelResult], path: Path) -> bool:
    """Throughput, per-token latency and time to first token against concurrency, a line per mode; False
    without matplotlib."""
    plt = plots.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("throughput_tok_s", "completion tokens/s"), ("tpot_p50_ms", "per-token latency p50 (ms)"),
              ("ttft_p50_ms", "time to first token p50 (ms)")]
    modes = list(dict.fromkeys(lv.mode for lv in levels))
    for ax, (field, ylabel) in zip(axes, panels):
        for mode in modes:
            pts = [(lv.concurrency, getattr(lv, field)) for lv in levels
                   if lv.mode == mode and lv.ok_requests and getattr(lv, field) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set_xscale("log", base=2)
        concurrencies = sorted({lv.concurrency for lv in levels})
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("jaxspec server under load: speculation policy by concurrency")
    plots.save(fig, path)
    return True


def write_outputs(args: argparse.Namespace, machine_info: dict, targets: list[Target], levels: list[LevelResult],
                  ratios: list[dict], checks: list[str], warmup: list[int], markdown: str) -> None:
    """bench_serve.json (settings and every raw number), bench_serve.md and, unless --no-plot, bench_serve.png."""
    out_dir = Path(args.out_dir)
    data = {
        "date": machine_info["date"],
        "machine": machine_info,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "warmup_prompt_indices": warmup,
        "servers": [{"label": t.label, "base_url": t.base_url, "command": t.command, "model": t.model,
                     "startup_s": t.startup_s, "failed": t.failed} for t in targets],
        "ratios": ratios,
        "targets": checks,
        "levels": [dataclasses.asdict(lv) | {"requests": [dataclasses.asdict(r) | {
            "per_token_latency": r.per_token_latency} for r in lv.requests]} for lv in levels],
    }
    (out_dir / "bench_serve.json").write_text(json.dumps(data, indent=1))
    (out_dir / "bench_serve.md").write_text(markdown)
    wrote_plot = args.plot and levels and plot(levels, out_dir / "bench_serve.png")
    print(f"wrote {out_dir / 'bench_serve.json'}, {out_dir / 'bench_serve.md'}"
          + (f", {out_dir / 'bench_serve.png'}" if wrote_plot else ""), flush=True)
