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


def markdown_report(machine_info: dict, levels: list[LevelResult], ratios: list[dict], checks: list[str]) -> str:
    tp = throughput_of(levels)
    out = [f"# jaxspec server under load, {machine.line(machine_info)}", "",
           head(["mode", "concurrency", "requests", "errors", "completion tokens", "wall s", "tokens/s", "x off",
                 "requests/s", "TTFT p50 ms", "TTFT p99 ms", "per-token p50 ms", "per-token p99 ms",
                 "mean acceptance length", "mean active rows"])]
    for lv in levels:
        off = tp.get(("off", lv.concurrency))
        x_off = lv.throughput_tok_s / off if off and lv.ok_requests else None
        out.append(row([lv.mode, lv.concurrency, lv.num_requests, lv.errors, lv.completion_tokens, f"{lv.wall_s:.1f}",
                        f"{lv.throughput_tok_s:.1f}", fmt(x_off, ".2f"), f"{lv.requests_per_s:.2f}",
                        fmt(lv.ttft_p50_ms, ".0f"), fmt(lv.ttft_p99_ms, ".0f"), fmt(lv.tpot_p50_ms, ".1f"),
                        fmt(lv.tpot_p99_ms, ".1f"), fmt(lv.mean_acceptance_length, ".2f"),
                        fmt(lv.mean_active_rows, ".1f")]))
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
