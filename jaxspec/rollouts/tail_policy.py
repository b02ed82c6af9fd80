"""When a rollout speculates: a draft cap per chunk from the measured verify cost and the measured acceptance.

A rollout starts with every sample running (P x G rows) and ends with a few long ones. At a large batch the
target forward is compute-bound and scoring w tokens per row costs nearly w plain steps; as rows finish and
the batch is compacted, the forward turns bandwidth-bound and scoring w tokens costs little more than one.
So the same drafts that lose at 128 rows pay at 8, and speculation should switch on, and K grow, as the
active count falls (the batch-size switch of speculative RL rollouts).

Before each chunk the policy picks the cap K (0, or w - 1 for a compiled verify width w) maximising

    (1 + m(K)) / c_b(K + 1)          (plain decoding: 1 / 1)

where c_b(w) is the measured cost of a forward over w new tokens per row at the current batch b, in plain
steps (`jaxspec.cost.verify_cost`: measured once per machine and shape and cached on disk, a prior from the
model's sizes until then), and
m(K) = r_0 + ... + r_{K-1} the expected accepted drafts per row and step: r_j is the measured rate of accepted
drafts at position j per active row-step, over recent chunks that allowed position j (older chunks decay).
Positions never measured are extrapolated from the ones that were (a geometric tail), and before anything
is measured r_j = prior ** (j + 1). When nothing may be measured (JAXSPEC_VERIFY_COST=off) there is no cost
table and "adaptive" drafts the full K, as "always" does.

A chunk that drafts costs more per step than c_b(K + 1): it samples at every scored position, drafts, keeps
the proposer's state (a group automaton appends each sibling's tokens in turn) and picks its width with a
`lax.switch`. At 128 rows on a CPU a width-3 chunk ran 1.61 plain steps where c(3) was 1.22. So the policy
times its chunks (compiling excluded) and learns the ratio of a drafting chunk's time per step to the plain
chunk's next to it at the same batch, over what c_b predicts (`DraftingOverhead`); the cost it weighs is
c_b(K + 1) times that factor: the batch's own once measured there, else the last one measured at any batch,
else 1. Until a first pair is measured, a chunk that drafted is followed by a plain one at the same batch, so
that a policy whose acceptance keeps it drafting still learns what drafting costs. The factor outlives the
rollout: rollouts of one shape in a process share it (`overhead_for`), as an RL loop's rollouts, one per
training step, do, so only the first of them pays for finding out that drafting does not pay at its first
batch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

MODES = ("adaptive", "always", "off")


@dataclasses.dataclass
class DraftingOverhead:
    """Per compiled batch: a drafting chunk's measured cost per step (in plain steps) over c(K + 1), the cost
    of its verify forward alone. Smoothed: each new measurement has weight `weight`."""

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
    """The drafting overhead learned by this process's rollouts of one shape (a hashable key: model, proposer,
    widths, cache and chunk sizes), created on first use."""
    return _OVERHEADS.setdefault(shape, DraftingOverhead())


@dataclasses.dataclass
class TailPolicy:
    """Draft caps for a rollout's chunks (see the module docstring)."""

    k: int  # the proposer's K
    widths: tuple[int, ...]  # compiled verify widths (1 first)
    cost_of: Callable[[int], dict[int, float] | None]  # batch size -> {width: c(w)}, or None when unmeasured
    mode: str = "adaptive"
    # Acceptance rate per position before any measurement. Conservative, because exploring costs a whole chunk
    # at the current batch: with 0.5 the policy explores a width-3 chunk at 32 rows, T = 1.0, which on XLA:CPU costs
    # a large share of a 128-token rollout (4 prompts x 8 samples); with 0.3 it explores only where verifying is
    # cheap (small batches), and measured acceptance takes over from there.
    prior: float = 0.3
    decay: float = 0.7  # weight of the older measurements at each new chunk
    min_row_steps: float = 8.0  # row-steps below which a position's rate counts as unmeasured
    overhead: DraftingOverhead = dataclasses.field(default_factory=DraftingOverhead)
    _accepted: np.ndarray = dataclasses.field(init=False, repr=False)  # f64[K] decayed accepted drafts at j
    _row_steps: np.ndarray = dataclasses.field(init=False, repr=False)  # f64[K] decayed row-steps allowing j
    _timed: dict[int, tuple[int, float]] = dataclasses.field(init=False, repr=False)  # batch -> (cap, s/step)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"speculation={self.mode!r} must be one of {MODES}")
        self._accepted = np.zeros((self.k,))
        self._row_steps = np.zeros((self.k,))
        self._timed = {}

    @property
    def caps(self) -> tuple[int, ...]:
        """The caps a chunk may run: 0 and each compiled width's w - 1."""
        return (0,) + tuple(w - 1 for w in self.widths if 1 < w <= self.k + 1)

    def rates(self) -> np.ndarray:
        """f64[K] r_j, accepted drafts at position j per active row-step (measured, else extrapolated)."""
        rates = np.zeros((self.k,))
        ratio = self.prior
        for j in range(self.k):
            if self._row_steps[j] >= self.min_row_steps:
                rates[j] = self._accepted[j] / self._row_steps[j]
                if j and rates[j - 1] > 0:
                    ratio = min(rates[j] / rates[j - 1], 1.0)
            else:
                rates[j] = (rates[j - 1] if j else 1.0) * ratio
        return rates

    def expected_gain(self, batch: int) -> dict[int, float]:
        """cap -> predicted tokens per unit of step cost relative to plain decoding, at this batch size (empty
        when there is no cost table)."""
        costs = self.cost_of(batch)
        if not costs:
            return {}
        accepted = np.concatenate([[0.0], np.cumsum(self.rates())])  # m(K) for K = 0..K
        overhead = self.overhead.factor(batch)
        return {cap: (1.0 if cap == 0 else (1.0 + accepted[cap]) / (costs[cap + 1] * overhead))
                for cap in self.caps}

    def choose(self, batch: int) -> int:
        """The draft cap of the next chunk at this batch size."""
        if self.mode == "off" or self.k == 0:
            return 0
        if self.mode == "always":
            return self.k
        gains = self.expected_gain(batch)
        if not gains:
            return self.k
        last = self._timed.get(batch)
        if not self.overhead.measured and last is not None and last[0] > 0:
            # The factor is learned only from a drafting chunk beside a plain one, and acceptance high enough to
            # keep drafting never runs the plain one: at T = 0.7 and 128 rows, drafting chunk after chunk on c(3)
            # alone makes a rollout much slower than plain. So the first drafting chunk is followed by one
            # plain chunk at the same batch, once per shape.
            return 0
        # On a tie plain decoding wins: speculation that does not pay costs drafting time besides.
        return max(gains, key=lambda cap: (gains[cap], -cap))

    def observe(self, cap: int, accepted_at: np.ndarray, row_steps: int, *, batch: int | None = None,
                step_seconds: float | None = None) -> None:
        """Learn from a chunk run at `cap`: accepted_at f64[K] accepted drafts per position, row_steps the
        active row-steps it ran; with `batch` and `step_seconds` (its time per step, compiling excluded), what
        drafting costs beside the verify forward, from it and the chunk before it at that batch."""
        if batch is not None and step_seconds is not None and step_seconds > 0:
            self._time(batch, cap, step_seconds)
        if cap == 0 or row_steps <= 0:
            return
        allowed = np.arange(self.k) < cap
        self._accepted = np.where(allowed, self.decay * self._accepted + accepted_at, self._accepted)
        self._row_steps = np.where(allowed, self.decay * self._row_steps + row_steps, self._row_steps)

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
