"""Prometheus metrics of the server: engine totals read at scrape time, latency histograms observed live.

Counters that the engine already keeps (tokens, steps, drafts, acceptances per position) are exported by a
collector that reads `EngineMetrics` when /metrics is scraped, so nothing is counted twice. Latencies are
histograms observed as they happen: time to first token, time per output token, end-to-end request time,
queue time, and the decode step time the engine measures per chunk.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine import Engine
from ..state import mean_acceptance_length

if TYPE_CHECKING:
    from .choices import Choice

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, engine: Engine):
        self._engine = engine

    def collect(self):
        e = self._engine
        m = e.metrics
        gauges = {
            "jaxspec_requests_running": ("Requests decoding in a slot", m.requests_running),
            "jaxspec_requests_waiting": ("Requests queued for a slot", m.requests_waiting),
            "jaxspec_batch_slots": ("Rows of the compiled batch the engine runs now", m.num_slots),
            "jaxspec_batch_max_slots": ("The most rows the engine may run", e.config.max_slots),
            "jaxspec_batch_occupancy": ("Running requests / compiled rows",
                                        m.requests_running / m.num_slots if m.num_slots else 0.0),
            "jaxspec_speculating": ("1 while the policy lets the current batch size speculate", int(m.speculating)),
            "jaxspec_spec_mean_acceptance_length": (
                "Tokens committed per active row-step since start (jaxspec.state.mean_acceptance_length)",
                mean_acceptance_length(m.committed, m.row_steps) if m.row_steps else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "jaxspec_prompt_tokens": ("Prompt tokens prefilled", m.prompt_tokens),
            "jaxspec_generation_tokens": ("Tokens generated", m.generated_tokens),
            "jaxspec_decode_steps": ("Decode loop steps (one target forward each)", m.steps),
            "jaxspec_decode_row_steps": ("Active rows summed over decode steps", m.row_steps),
            "jaxspec_decode_committed_tokens": ("Tokens committed by decode steps (not prefill's first ones)",
                                                m.committed),
            "jaxspec_spec_drafted_tokens": ("Draft tokens proposed and verified", m.drafted),
            "jaxspec_spec_accepted_tokens": ("Draft tokens accepted", m.accepted),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, values in (
                ("jaxspec_spec_drafted_tokens_per_position", "Drafts at each position (finished requests)",
                 m.drafted_per_position),
                ("jaxspec_spec_accepted_tokens_per_position", "Accepted drafts at each position (finished requests)",
                 m.accepted_per_position)):
            family = CounterMetricFamily(name, doc, labels=["position"])
            for j, v in enumerate(values):
                family.add_metric([str(j)], int(v))
            yield family


class ServerMetrics:
    """The server's Prometheus registry: the engine's totals (read at scrape time) and the latency histograms;
    it observes the engine's chunks and admissions as they happen."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()  # what /metrics exports
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        # Finished HTTP requests' choices, by finish reason.
        self.requests = Counter("jaxspec_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        # Requests answered with an error, by HTTP status.
        self.rejected = Counter("jaxspec_requests_rejected", "Requests refused (bad input, queue full)",
                                ["status"], registry=r)
        # Time to first token.
        self.ttft = Histogram("jaxspec_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        # Time per output token after the first.
        self.tpot = Histogram("jaxspec_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        # Time from arrival to the last token.
        self.e2e = Histogram("jaxspec_request_seconds", "From arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # Time from arrival to admission into a slot.
        self.queue = Histogram("jaxspec_queue_seconds", "From arrival to admission into a slot",
                               buckets=_LATENCY_BUCKETS, registry=r)
        # Decode step time (a chunk's time over its steps).
        self.step = Histogram("jaxspec_decode_step_seconds", "Time per decode step (chunk time / steps)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        engine.observers.append(self._observe)

    def record(self, arrived: float, choices: Sequence["Choice"]) -> None:
        """Count a finished HTTP request's choices by finish reason and observe their latencies; `arrived` is
        the request's perf_counter() on arrival."""
        now = time.perf_counter()
        for c in choices:
            self.requests.labels(finish_reason=c.finish_reason or "abort").inc()
            if c.first_token_at is not None:
                self.ttft.observe(c.first_token_at - arrived)
                if c.text.num_tokens > 1:
                    self.tpot.observe((now - c.first_token_at) / (c.text.num_tokens - 1))
            self.e2e.observe(now - arrived)

    def _observe(self, kind: str, info: dict) -> None:
        if kind == "chunk" and info["steps"]:
            self.step.observe(info["seconds"] / info["steps"])
        elif kind == "admit":
            self.queue.observe(info["queued_s"])
