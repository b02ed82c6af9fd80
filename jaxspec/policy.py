"""When to speculate under load: the serving engine asks a policy for per-row draft caps before each chunk.

Verification widens the target forward. At low load the forward is bandwidth-bound and a wider one costs
little more than a plain step; as the batch grows it turns compute-bound and every drafted token costs real
time (docs/cpu-performance.md has the numbers for XLA:CPU). A policy therefore answers, for a compiled batch
of `num_slots` rows, "how many drafts per row, with a rows still generating?" as a table `caps[a]` that the
device reads at every step (rows finishing inside a chunk move the index), and learns from what each chunk
achieved.

- `FixedPolicy`: the full K whatever the load.
- `OffPolicy`: never speculate.
- `AdaptivePolicy` (the default): speculate only while at most `max_active` requests are in flight (the
  active rows plus the engine's queue; 4 by default, chosen for XLA:CPU), halving K each time that load doubles,
  and switch speculation off in a batch size where it measured
  slower than plain decoding (tokens per second per active row over whole chunks, both kinds timed in the
  same server), trying it again after an interval that doubles each time the measurement confirms the loss.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class ChunkReport:
    """What one chunk of decode steps achieved, as the engine reports it to the policy."""

    num_slots: int  # the compiled batch the chunk ran at
    active: int  # rows generating when the chunk started
    max_cap: int  # the largest draft cap the chunk's table allowed for `active` rows (0: plain decoding)
    tokens: int  # tokens committed by all rows in the chunk
    seconds: float  # wall time of the chunk


class SpeculationPolicy(Protocol):
    """What the engine asks before each chunk (`draft_caps`) and tells after it (`observe`)."""

    def draft_caps(self, num_slots: int, k: int, waiting: int = 0) -> np.ndarray:
        """i32[num_slots + 1]: the most drafts per row while a rows are active (index a) and `waiting`
        requests queue for a free row."""
        ...

    def observe(self, report: ChunkReport) -> None:
        """Learn from a finished chunk."""
        ...


@dataclasses.dataclass
class FixedPolicy:
    """Always draft up to K per row."""

    def draft_caps(self, num_slots: int, k: int, waiting: int = 0) -> np.ndarray:
        """i32[num_slots + 1], K everywhere."""
        return np.full((num_slots + 1,), k, np.int32)

    def observe(self, report: ChunkReport) -> None:
        """Nothing to learn."""
        pass


@dataclasses.dataclass
class OffPolicy:
    """Never draft: every step is a plain decode step."""

    def draft_caps(self, num_slots: int, k: int, waiting: int = 0) -> np.ndarray:
        """i32[num_slots + 1], all zero."""
        return np.zeros((num_slots + 1,), np.int32)

    def observe(self, report: ChunkReport) -> None:
        """Nothing to learn."""
        pass


@dataclasses.dataclass
class _Arm:
    """Tokens per second for one way of running one batch size: decayed sums of tokens and of seconds.

    A ratio of sums, not an average of per-chunk rates: a chunk's rate swings with the text (a stretch that
    repeats commits many drafts, one that does not commits none), so a rate must cover many chunks, and long
    chunks must weigh by their length.
    """

    tokens: float = 0.0
    seconds: float = 0.0
    chunks: int = 0

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def add(self, tokens: float, seconds: float, smoothing: float) -> None:
        self.tokens = (1 - smoothing) * self.tokens + tokens
        self.seconds = (1 - smoothing) * self.seconds + seconds
        self.chunks += 1


@dataclasses.dataclass
class _SlotsRecord:
    speculative: _Arm = dataclasses.field(default_factory=_Arm)
    plain: _Arm = dataclasses.field(default_factory=_Arm)
    off: bool = False  # speculation measured slower at this batch size
    since_switch: int = 0  # chunks run since the last chunk of the other kind
    interval: int = 0  # chunks of the current kind before one chunk of the other kind is measured


@dataclasses.dataclass
class AdaptivePolicy:
    """The default: speculate at low load, K halving as load doubles, off where it measured slower than plain."""

    # Speculate only while at most this many requests are in flight. A threshold of 8 is a common choice on
    # accelerators; on XLA:CPU a verify step over 8 rows costs several plain ones already at width 9 (c(T),
    # docs/cpu-performance.md), and always-on speculation at 8 busy rows serves slower than plain decoding
    # (scripts/bench_serve.py), so 4.
    max_active: int = 4
    full_k_active: int = 1  # up to this many active rows draft the full K; K halves as the count doubles
    # Chunk rates vary with the text (how much it repeats) as much as with the step cost, so the guard acts
    # only on clear evidence: several chunks of each kind, and a loss beyond `margin`. The losses it is for,
    # wide verification at large batches, are 2-3x.
    min_chunks: int = 6  # chunks of each kind measured before the rates are compared
    # Speculation goes off when it measures this fraction slower than plain decoding with one active row;
    # margin / sqrt(active) with more: the text's burstiness (a stretch that repeats commits many drafts, one
    # that does not commits none) averages out over independent rows, and large batches are where the real
    # losses are.
    margin: float = 0.25
    smoothing: float = 0.05  # decay per chunk of the rate sums (a window of about 20 chunks)
    probe_interval: int = 16  # chunks of one kind between measurements of the other; doubles after each
    max_probe_interval: int = 32  # measurement that confirms the current choice
    _records: dict[int, _SlotsRecord] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.max_active < 0:
            raise ValueError(f"max_active={self.max_active!r} must be >= 0")
        if self.full_k_active < 1:
            raise ValueError(f"full_k_active={self.full_k_active!r} must be >= 1")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing={self.smoothing!r} must be in (0, 1]")
        if self.min_chunks < 1 or self.probe_interval < 1:
            raise ValueError(f"min_chunks={self.min_chunks!r} and probe_interval={self.probe_interval!r} must be >= 1")

    def static_caps(self, num_slots: int, k: int, waiting: int = 0) -> np.ndarray:
        """The load rule alone: K up to `full_k_active` requests in flight, halved per doubling, 0 past
        `max_active`. In flight = the active rows (the table's index) plus the requests waiting for a row:
        a queue means the server is saturated, and every drafted token then costs another request's time."""
        active = np.arange(num_slots + 1)
        load = active + waiting
        doublings = np.ceil(np.log2(np.maximum(load, 1) / self.full_k_active)).clip(min=0)
        caps = np.floor(k / 2.0 ** doublings).astype(np.int32)
        # Index 0 (no row active) drafts nothing, so max_active=0 gives an all-zero table.
        return np.where((active >= 1) & (load <= self.max_active), caps, 0).astype(np.int32)

    def _record(self, num_slots: int) -> _SlotsRecord:
        return self._records.setdefault(num_slots, _SlotsRecord(interval=self.probe_interval))

    def _measure_plain_next(self, record: _SlotsRecord) -> bool:
        if record.plain.chunks < self.min_chunks:  # warming up: alternate the two kinds
            return record.speculative.chunks > record.plain.chunks
        # Off: speculate once per interval to see whether that changed; on: measure plain once per interval.
        due = record.since_switch >= record.interval
        return not due if record.off else due

    def draft_caps(self, num_slots: int, k: int, waiting: int = 0) -> np.ndarray:
        """`static_caps`, or all zero when the guard measures plain decoding this chunk or has switched off."""
        caps = self.static_caps(num_slots, k, waiting)
        if caps.any() and self._measure_plain_next(self._record(num_slots)):
            return np.zeros_like(caps)
        return caps

    def observe(self, report: ChunkReport) -> None:
        """Add the chunk's rate to its batch size's record and switch speculation off or on on clear evidence."""
        if report.seconds <= 0 or report.tokens <= 0 or report.active <= 0:
            return
        if not self.static_caps(report.num_slots, 1).any():
            return  # this batch size never speculates: nothing to learn
        record = self._record(report.num_slots)
        # Per active row: a chunk's tokens grow with the rows running, whatever the kind of step.
        speculative = report.max_cap > 0
        (record.speculative if speculative else record.plain).add(report.tokens / report.active, report.seconds,
                                                                  self.smoothing)
        minority = speculative == record.off  # the kind run only to measure it
        record.since_switch = 0 if minority else record.since_switch + 1
        spec, plain = record.speculative, record.plain
        if spec.chunks < self.min_chunks or plain.chunks < self.min_chunks:
            return
        # On a tie speculation stays on: it costs nothing then, and pays as soon as the text starts repeating.
        off = spec.rate < plain.rate * (1 - self.margin / np.sqrt(report.active))
        if minority:
            # A measurement of the other kind: a confirmed choice is checked less often, a changed one resets.
            record.interval = (min(2 * record.interval, self.max_probe_interval) if off == record.off
                               else self.probe_interval)
        record.off = off

    def speculating(self, num_slots: int) -> bool:
        """Whether speculation is currently on for this batch size (for metrics and tests)."""
        record = self._records.get(num_slots)
        return record is None or not record.off


def make_policy(name: str, *, max_active: int = 4) -> SpeculationPolicy:
    """The policy a server option names: "adaptive", "fixed" or "off"."""
    if name == "adaptive":
        return AdaptivePolicy(max_active=max_active)
    if name == "fixed":
        return FixedPolicy()
    if name == "off":
        return OffPolicy()
    raise ValueError(f"policy={name!r} must be 'adaptive', 'fixed' or 'off'")
