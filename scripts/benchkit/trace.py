"""Where a traced run's time went: a `jax.profiler` trace (its Perfetto JSON) summed by event, per thread.

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes `perfetto_trace.json.gz` under `dir`: Chrome
trace-event JSON whose complete events ("ph": "X") carry a start and a duration in microseconds, grouped in
processes (the host, each device) and threads (a GPU's streams, the host's Python and XLA threads). Summing the
durations of each event name per thread answers "which kernels, copies and host calls took the time" without a
trace viewer; the file itself opens in https://ui.perfetto.dev for the timeline.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path


def find(trace_dir: str | Path) -> Path:
    """The newest `perfetto_trace.json.gz` under `trace_dir` (jax writes it a few folders down)."""
    found = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    return found[-1]


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of [start, end) intervals in microseconds (nested events count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1000


def summarise(path: str | Path, top: int = 20) -> list[dict]:
    """Per thread with complete events, busiest first: {"process", "thread", "events", "busy_ms", "top": [{"name",
    "count", "total_ms", "mean_us"}, ...]}, `top` event names by total duration. An event nested in one of the
    same name counts once; busy_ms is the union of the thread's events, so nested scopes are not counted twice."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    per_thread: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    spans: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    reach: dict[tuple, float] = {}  # (thread, name) -> end of the last counted event of that name
    complete = sorted((e for e in events if e.get("ph") == "X" and "dur" in e), key=lambda e: float(e["ts"]))
    for e in complete:
        key, name = (e["pid"], e.get("tid")), e.get("name", "?")
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        spans[key].append((start, end))
        if start < reach.get((key, name), float("-inf")):
            continue  # inside an event of the same name (jax records a dispatch twice, nested): counted once
        reach[(key, name)] = end
        per_thread[key][name].append(end - start)
    out = []
    for key, by_name in per_thread.items():
        ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        out.append({"process": processes.get(key[0], str(key[0])), "thread": threads.get(key, str(key[1])),
                    "events": sum(len(v) for v in by_name.values()), "busy_ms": _busy_ms(spans[key]),
                    "top": [{"name": name, "count": len(d), "total_ms": sum(d) / 1000, "mean_us": sum(d) / len(d)}
                            for name, d in ranked]})
    return sorted(out, key=lambda t: -t["busy_ms"])
