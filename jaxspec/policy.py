"""How much to draft: one policy, asked for per-row draft caps by the engine, `generate` and rollouts.

Verification widens the target forward. At low load the forward is bandwidth-bound and a wider one costs
little more than a plain step; as the batch grows it turns compute-bound and every drafted token costs real
time (docs/cpu-performance.md has the numbers for XLA:CPU). Before each chunk of decode steps the caller asks
`DraftPolicy.draft_caps` "how many drafts per row, in a compiled batch of `num_slots` rows with a rows still
generating?" and gets a table `caps[a]` the device reads at every step (rows finishing inside a chunk move the
index); after the chunk it reports what the chunk achieved (`ChunkReport`) to `DraftPolicy.observe`.

Three things bound a row's drafts, each at its own level and each in one place:
- this policy, per chunk: a cap per row from the load and from what earlier chunks measured;
- the proposer, per step, within the cap: as many as its own evidence supports (a suffix match of length m
  drafts at most `draft_per_match * m`, `jaxspec.proposers.base.lookup_draft_count`);
- the loop, per step: the verify width that repays the drafts made, from the measured cost of each width
  (`jaxspec.cost.choose_width`, `SpecConfig.cost_aware`).

The variants are settings of one `DraftPolicy`:
- `mode="fixed"`: the full K whatever the load; `mode="off"`: never draft.
- `mode="adaptive"`: each rule that is set lowers the cap:
  - `load` (`LoadLimit`): speculate only while at most `max_active` requests are in flight, halving K each
    time that load doubles. The serving engine's rule: its load is the requests it holds.
  - `gain` (`GainModel`): the cap that maximises the predicted tokens per unit of step cost, from the
    measured verify cost at the current batch and the measured acceptance per draft position. The rollouts'
    rule: a rollout starts at P x G rows, where verifying is compute-bound, and ends with a few long samples,
    where it is nearly free.
  - `guard` (`SlowdownGuard`): speculation off in a batch size where chunks that drafted measured slower than
    plain ones, tried again after an interval that doubles each time the measurement confirms the loss.
  `DraftPolicy()` is the engine's default (load and guard), `DraftPolicy.for_rollouts` a rollout's (gain).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

MODES = ("adaptive", "fixed", "off")


@dataclasses.dataclass(frozen=True)
class ChunkReport:
    """What one chunk of decode steps achieved, as its caller reports it to the policy."""

    num_slots: int  # the compiled batch the chunk ran at
    active: int  # rows generating when the chunk started
    max_cap: int  # the largest draft cap the chunk's table allowed for `active` rows (0: plain decoding)
    tokens: int  # tokens committed by all rows in the chunk
    seconds: float  # wall time of the chunk, compiling excluded
    steps: int = 0  # decode steps the chunk ran (0: not counted)
    accepted_at: np.ndarray | None = None  # f64[K] accepted drafts at each draft position, summed over rows
    row_steps: int = 0  # active row-steps the chunk ran (the denominator of `accepted_at`)


# ---------------------------------------------------------------------- the load rule


@dataclasses.dataclass(frozen=True)
class LoadLimit:
    """K up to `full_k_active` requests in flight, halved per doubling of that load, 0 past `max_active`."""

    # A threshold of 8 is a common choice on accelerators; on XLA:CPU a verify step over 8 rows costs several
    # plain ones already at width 9 (c(T), docs/cpu-performance.md), and always-on speculation at 8 busy rows
    # serves slower than plain decoding (scripts/bench_serve.py), so 4.
    max_active: int = 4
    full_k_active: int = 1  # up to this many requests in flight draft the full K

    def __post_init__(self):
        if self.max_active < 0:
            raise ValueError(f"max_active={self.max_active!r} must be >= 0")
        if self.full_k_active < 1:
            raise ValueError(f"full_k_active={self.full_k_active!r} must be >= 1")

    def caps(self, num_slots: int, k: int, waiting: int = 0) -> np.ndarray:
        """i32[num_slots + 1]. In flight = the active rows (the table's index) plus the requests waiting for a
        row: a queue means the server is saturated, and every drafted token then costs another request's time."""
        active = np.arange(num_slots + 1)
        load = active + waiting
        doublings = np.ceil(np.log2(np.maximum(load, 1) / self.full_k_active)).clip(min=0)
        caps = np.floor(k / 2.0 ** doublings).astype(np.int32)
        return np.where(load <= self.max_active, caps, 0).astype(np.int32)


# ---------------------------------------------------------------------- the gain model


@dataclasses.dataclass
class DraftingOverhead:
    """Per compiled batch: a drafting chunk's measured cost per step (in plain steps) over c(K + 1), the cost
    of its verify forward alone. Smoothed: each new measurement has weight `weight`.

    A chunk that drafts costs more per step than c(K + 1): it samples at every scored position, drafts, keeps
    the proposer's state (a group automaton appends each sibling's tokens in turn) and picks its width with a
    `lax.switch`. At 128 rows on a CPU a width-3 chunk ran 1.61 plain steps where c(3) was 1.22."""

    weight: float = 0.5
    _factor: dict[int, float] = dataclasses.field(default_factory=dict, repr=False)  # batch -> factor
    _latest: float | None = dataclasses.field(default=None, repr=False)  # the last factor measured anywhere

    @property
    def measured(self) -> bool:
        """Whether any pair of chunks has been measured (at any batch)."""
        return self._latest is not None

    def factor(self, batch: int) -> float:
        """The factor at this batch: measured there, else the last measured at any batch, else 1."""
        return self._factor.get(batch, 1.0 if self._latest is None else self._latest)

    def observe(self, batch: int, measured: float, modeled: float) -> None:
        """Learn from one pair of chunks at `batch`: `measured` the drafting chunk's time per step over the
        plain chunk's, `modeled` the c(K + 1) it was chosen by."""
        ratio = measured / modeled
        old = self._factor.get(batch)
        self._factor[batch] = ratio if old is None else (1 - self.weight) * old + self.weight * ratio
        self._latest = self._factor[batch]


_OVERHEADS: dict[tuple, DraftingOverhead] = {}


def overhead_for(shape: tuple) -> DraftingOverhead:
    """The drafting overhead learned by this process's chunks of one shape (a hashable key: model, proposer,
    widths, cache and chunk sizes), created on first use. An RL loop runs one rollout per training step, and
    only the first pays for learning that drafting does not pay at its first batch."""
    return _OVERHEADS.setdefault(shape, DraftingOverhead())


@dataclasses.dataclass
class GainModel:
    """The cap K (0, or w - 1 for a compiled verify width w) maximising

        (1 + m(K)) / (c_b(K + 1) * overhead_b)          (plain decoding: 1 / 1)

    c_b(w) is the measured cost of a forward over w new tokens per row at batch b, in plain steps (`cost_of`,
    from `jaxspec.cost.verify_cost`: measured once per machine and shape and cached on disk, a prior from the
    model's sizes until then; None when nothing may be measured, and then the full K). m(K) = r_0 + ... +
    r_{K-1} is the expected accepted drafts per row and step: r_j the measured rate of accepted drafts at
    position j per active row-step, over recent chunks that allowed position j (older chunks decay). Positions
    never measured are extrapolated from the ones that were (a geometric tail), and before anything is
    measured r_j = prior ** (j + 1). overhead_b is what a drafting chunk costs beside its verify forward
    (`DraftingOverhead`), learned from a drafting chunk timed beside a plain one at the same batch; until a
    first pair is measured, a chunk that drafted is followed by a plain one at its batch."""

    widths: tuple[int, ...]  # compiled verify widths (1 first)
    cost_of: Callable[[int], dict[int, float] | None]  # batch size -> {width: c(w)}, or None when unmeasured
    # Acceptance rate per position before any measurement. Conservative, because exploring costs a whole chunk
    # at the current batch: with 0.5 the policy explores a width-3 chunk at 32 rows, T = 1.0, which on XLA:CPU
    # costs a large share of a 128-token rollout (4 prompts x 8 samples); with 0.3 it explores only where
    # verifying is cheap (small batches), and measured acceptance takes over from there.
    prior: float = 0.3
    decay: float = 0.7  # weight of the older measurements at each new chunk
    min_row_steps: float = 8.0  # row-steps below which a position's rate counts as unmeasured
    overhead: DraftingOverhead = dataclasses.field(default_factory=DraftingOverhead)
    _accepted: np.ndarray | None = dataclasses.field(default=None, repr=False)  # f64[K] decayed accepted at j
    _row_steps: np.ndarray | None = dataclasses.field(default=None, repr=False)  # f64[K] decayed row-steps at j
    _timed: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict, repr=False)  # batch -> (cap, s)

    def _sized(self, k: int) -> None:
        if self._accepted is None or len(self._accepted) != k:
            self._accepted, self._row_steps = np.zeros((k,)), np.zeros((k,))

    def caps_for(self, k: int) -> tuple[int, ...]:
        """The caps a chunk may run: 0 and each compiled width's w - 1."""
        return (0,) + tuple(w - 1 for w in self.widths if 1 < w <= k + 1)

    def rates(self, k: int) -> np.ndarray:
        """f64[K] r_j, accepted drafts at position j per active row-step (measured, else extrapolated)."""
        self._sized(k)
        rates = np.zeros((k,))
        ratio = self.prior
        for j in range(k):
            if self._row_steps[j] >= self.min_row_steps:
                rates[j] = self._accepted[j] / self._row_steps[j]
                if j and rates[j - 1] > 0:
                    ratio = min(rates[j] / rates[j - 1], 1.0)
            else:
                rates[j] = (rates[j - 1] if j else 1.0) * ratio
        return rates

    def expected_gain(self, batch: int, k: int) -> dict[int, float]:
        """cap -> predicted tokens per unit of step cost relative to plain decoding, at this batch size (empty
        when there is no cost table)."""
        costs = self.cost_of(batch)
        if not costs:
            return {}
        accepted = np.concatenate([[0.0], np.cumsum(self.rates(k))])  # m(K) for K = 0..K
        overhead = self.overhead.factor(batch)
        return {cap: (1.0 if cap == 0 else (1.0 + accepted[cap]) / (costs[cap + 1] * overhead))
                for cap in self.caps_for(k)}

    def cap(self, batch: int, k: int) -> int:
        """The draft cap of the next chunk at this batch size."""
        gains = self.expected_gain(batch, k)
        if not gains:
            return k
        last = self._timed.get(batch)
        if not self.overhead.measured and last is not None and last[0] > 0:
            # The factor is learned only from a drafting chunk beside a plain one, and acceptance high enough to
            # keep drafting never runs the plain one: at T = 0.7 and 128 rows, drafting chunk after chunk on c(3)
            # alone makes a rollout much slower than plain. So the first drafting chunk is followed by one
            # plain chunk at the same batch, once per shape.
            return 0
        # On a tie plain decoding wins: speculation that does not pay costs drafting time besides.
        return max(gains, key=lambda cap: (gains[cap], -cap))

    def observe(self, report: ChunkReport) -> None:
        """Learn acceptance from a chunk run at `report.max_cap`; with its steps counted, what drafting costs
        beside the verify forward, from it and the chunk before it at that batch."""
        cap = report.max_cap
        if report.steps > 0 and report.seconds > 0:
            self._time(report.num_slots, cap, report.seconds / report.steps)
        if cap == 0 or report.row_steps <= 0 or report.accepted_at is None:
            return
        self._sized(len(report.accepted_at))
        allowed = np.arange(len(self._accepted)) < cap
        self._accepted = np.where(allowed, self.decay * self._accepted + report.accepted_at, self._accepted)
        self._row_steps = np.where(allowed, self.decay * self._row_steps + report.row_steps, self._row_steps)

    def _time(self, batch: int, cap: int, step_seconds: float) -> None:
        """Pair this chunk with the last one timed at `batch` (the one before it, contexts alike) when one of
        the two drafted and the other did not."""
        before = self._timed.get(batch)
        self._timed[batch] = (cap, step_seconds)
        if before is None or (before[0] == 0) == (cap == 0):
            return
        (drafting_cap, drafting_s), plain_s = ((cap, step_seconds), before[1]) if cap else (before, step_seconds)
        costs = self.cost_of(batch)
        if costs:
            self.overhead.observe(batch, drafting_s / plain_s, costs[drafting_cap + 1])


# ---------------------------------------------------------------------- the measured guard


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
class SlowdownGuard:
    """Speculation off in a batch size where it measured slower than plain decoding (tokens per second per
    active row over whole chunks, both kinds timed in the same process), tried again after an interval that
    doubles each time the measurement confirms the loss."""

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
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing={self.smoothing!r} must be in (0, 1]")
        if self.min_chunks < 1 or self.probe_interval < 1:
            raise ValueError(f"min_chunks={self.min_chunks!r} and probe_interval={self.probe_interval!r} must be >= 1")

    def _record(self, num_slots: int) -> _SlotsRecord:
        return self._records.setdefault(num_slots, _SlotsRecord(interval=self.probe_interval))

    def measures_plain_next(self, num_slots: int) -> bool:
        """Whether the next chunk at this batch size runs plain: while warming up the two kinds alternate;
        then, when off, it speculates once per interval to see whether that changed, and when on, it measures
        plain decoding once per interval."""
        record = self._record(num_slots)
        if record.plain.chunks < self.min_chunks:
            return record.speculative.chunks > record.plain.chunks
        due = record.since_switch >= record.interval
        return not due if record.off else due

    def observe(self, report: ChunkReport) -> None:
        """Add the chunk's rate to its batch size's record and switch speculation off or on on clear evidence."""
        if report.seconds <= 0 or report.tokens <= 0 or report.active <= 0:
            return
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

    def measured(self, num_slots: int) -> tuple[int, int]:
        """(speculative, plain) chunks measured at this batch size."""
        record = self._records.get(num_slots)
        return (0, 0) if record is None else (record.speculative.chunks, record.plain.chunks)

    def speculating(self, num_slots: int) -> bool:
        """Whether speculation is currently on for this batch size."""
        record = self._records.get(num_slots)
        return record is None or not record.off


# ---------------------------------------------------------------------- the policy


@dataclasses.dataclass
class DraftPolicy:
    """Per-row draft caps for each chunk (see the module docstring). The default is the serving engine's:
    adaptive, with the load rule and the measured guard."""

    mode: str = "adaptive"  # "adaptive", "fixed" (always the full K) or "off" (never draft)
    load: LoadLimit | None = dataclasses.field(default_factory=LoadLimit)
    gain: GainModel | None = None
    guard: SlowdownGuard | None = dataclasses.field(default_factory=SlowdownGuard)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES}")

    @classmethod
    def named(cls, mode: str, *, max_active: int = 4) -> DraftPolicy:
        """The policy a server option names: "adaptive" (load rule `max_active`, and the guard), "fixed", "off"."""
        if mode not in MODES:
            raise ValueError(f"policy={mode!r} must be one of {MODES}")
        return cls(mode, load=LoadLimit(max_active=max_active))

    @classmethod
    def for_rollouts(cls, mode: str, gain: GainModel) -> DraftPolicy:
        """A rollout's policy: `mode`, and when adaptive the gain model alone (a rollout has no queue, and its
        batch shrinks as samples finish, which the gain model's per-batch costs follow)."""
        if mode not in MODES:
            raise ValueError(f"speculation={mode!r} must be one of {MODES}")
        return cls(mode, load=None, gain=gain, guard=None)

    @property
    def drafts(self) -> bool:
        """Whether this policy ever lets a row draft (not "off")."""
        return self.mode != "off"

    def ceiling(self, num_slots: int, k: int, waiting: int = 0) -> np.ndarray:
        """i32[num_slots + 1]: the caps the mode and the load and gain rules allow, before the guard."""
        if self.mode == "off" or k == 0:
            return np.zeros((num_slots + 1,), np.int32)
        caps = np.full((num_slots + 1,), k, np.int32)
        if self.mode == "fixed":
            return caps
        if self.load is not None:
            caps = np.minimum(caps, self.load.caps(num_slots, k, waiting))
        if self.gain is not None:
            caps = np.minimum(caps, self.gain.cap(num_slots, k))
        caps[0] = 0  # no row active drafts nothing, so max_active=0 gives an all-zero table
        return caps

    def draft_caps(self, num_slots: int, k: int, waiting: int = 0) -> np.ndarray:
        """i32[num_slots + 1]: the most drafts per row while a rows are active (index a) and `waiting` requests
        queue for a free row; all zero when the guard measures plain decoding this chunk or has switched off."""
        caps = self.ceiling(num_slots, k, waiting)
        if (self.mode == "adaptive" and self.guard is not None and caps.any()
                and self.guard.measures_plain_next(num_slots)):
            return np.zeros_like(caps)
        return caps

    def cap(self, batch: int, k: int) -> int:
        """The draft cap of a chunk whose `batch` rows all generate (a rollout's or `generate`'s batch)."""
        return int(self.draft_caps(batch, k)[batch])

    def observe(self, report: ChunkReport) -> None:
        """Learn from a finished chunk."""
        if self.mode != "adaptive":
            return
        if self.gain is not None:
            self.gain.observe(report)
        # A load rule that never lets a row draft (max_active=0) has nothing to teach the guard.
        if self.guard is not None and (self.load is None or self.load.max_active >= 1):
            self.guard.observe(report)

    def speculating(self, num_slots: int) -> bool:
        """Whether speculation is currently on for this batch size (for metrics)."""
        if self.mode != "adaptive" or self.guard is None:
            return self.drafts
        return self.guard.speculating(num_slots)
