"""What the load generator measured: per request, per level (one mode at one concurrency), and its summary."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from jaxspec.state import mean_acceptance_length


@dataclasses.dataclass
class RequestResult:
    """One streamed request, as the client saw it. Times are seconds from sending the request."""

    index: int
    prompt_index: int
    ok: bool = False
    error: str | None = None
    sent_at: float | None = None  # seconds from the start of the level
    ttft: float | None = None  # first event with non-empty text
    t_last: float | None = None  # last event with non-empty text
    e2e: float | None = None  # until [DONE] (or the failure)
    completion_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None
    usage_missing: bool = False  # no usage chunk: completion_tokens counted as content chunks (a lower bound)
    content_chunks: int = 0
    chunk_gaps: list[float] = dataclasses.field(default_factory=list)  # between successive content chunks
    finish_reason: str | None = None
    text: str = ""  # the completion, streamed chunks joined

    @property
    def per_token_latency(self) -> float | None:
        if not self.ok or self.completion_tokens is None or self.completion_tokens < 2 or self.ttft is None:
            return None
        return (self.t_last - self.ttft) / (self.completion_tokens - 1)


@dataclasses.dataclass
class ServerCounters:
    """The server's cumulative counters at one scrape (None where /metrics did not have them)."""

    drafted: float | None = None
    accepted: float | None = None
    steps: float | None = None
    row_steps: float | None = None
    committed: float | None = None  # tokens committed by decode steps: with row_steps, the acceptance length
    generated: float | None = None


@dataclasses.dataclass
class LevelResult:
    """One mode at one concurrency."""

    mode: str
    concurrency: int
    num_requests: int
    wall_s: float
    requests: list[RequestResult]
    counters_before: ServerCounters | None
    counters_after: ServerCounters | None
    # Summary, filled by summarize():
    ok_requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    completion_tokens: int = 0
    throughput_tok_s: float = 0.0
    requests_per_s: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    e2e_p50_s: float | None = None
    chunk_gap_p50_ms: float | None = None
    tokens_per_chunk: float | None = None
    mean_acceptance_length: float | None = None
    draft_acceptance_rate: float | None = None  # accepted / drafted over the level
    mean_active_rows: float | None = None  # row_steps / steps: the batch the engine actually ran
    server_generated_tokens: float | None = None  # generation_tokens delta: a cross-check of usage
    usage_missing: int = 0


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000.0 * x


def _delta(after: ServerCounters | None, before: ServerCounters | None, field: str) -> float | None:
    if after is None or before is None:
        return None
    a, b = getattr(after, field), getattr(before, field)
    return None if a is None or b is None else a - b


def summarize(level: LevelResult) -> LevelResult:
    ok = [r for r in level.requests if r.ok]
    level.ok_requests = len(ok)
    level.errors = len(level.requests) - len(ok)
    level.error_kinds = dict(Counter(r.error for r in level.requests if not r.ok))
    level.usage_missing = sum(r.usage_missing for r in ok)
    level.completion_tokens = sum(r.completion_tokens or 0 for r in ok)
    level.throughput_tok_s = level.completion_tokens / level.wall_s if level.wall_s > 0 else 0.0
    level.requests_per_s = len(ok) / level.wall_s if level.wall_s > 0 else 0.0
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.per_token_latency for r in ok if r.per_token_latency is not None]
    gaps = [g for r in ok for g in r.chunk_gaps]
    level.ttft_p50_ms, level.ttft_p99_ms = _ms(percentile(ttfts, 50)), _ms(percentile(ttfts, 99))
    level.tpot_p50_ms, level.tpot_p99_ms = _ms(percentile(tpots, 50)), _ms(percentile(tpots, 99))
    level.e2e_p50_s = percentile([r.e2e for r in ok if r.e2e is not None], 50)
    level.chunk_gap_p50_ms = _ms(percentile(gaps, 50))
    chunks = sum(r.content_chunks for r in ok)
    level.tokens_per_chunk = level.completion_tokens / chunks if chunks else None

    before, after = level.counters_before, level.counters_after
    d_acc, d_rows = _delta(after, before, "accepted"), _delta(after, before, "row_steps")
    d_draft, d_steps = _delta(after, before, "drafted"), _delta(after, before, "steps")
    d_committed = _delta(after, before, "committed")
    if d_rows and d_committed is not None:
        level.mean_acceptance_length = mean_acceptance_length(d_committed, d_rows)
    if d_draft:
        level.draft_acceptance_rate = (d_acc or 0.0) / d_draft
    if d_steps:
        level.mean_active_rows = (d_rows or 0.0) / d_steps
    level.server_generated_tokens = _delta(after, before, "generated")
    return level
