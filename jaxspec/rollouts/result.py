"""What `rollout` returns: every sample's tokens, text, finish reason and log-probabilities, and the timeline."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..state import mean_acceptance_length


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
    """One chunk of decode steps as the rollout ran it."""

    end_step: int  # the loop's step counter after the chunk
    end_s: float  # seconds since the rollout started, after the chunk's readback
    batch: int  # the compiled batch it ran at
    active: int  # samples still generating when it started
    draft_cap: int  # the most drafts per row it allowed (0: plain decoding)
    run_s: float  # seconds it ran (its decode steps and the readback after them), compiling excluded
    drafting_overhead: float  # the factor on c(w) the policy chose its cap by (`GainModel.overhead`)


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """Timing and acceptance of one rollout. Times are seconds from the call's start (prefill included)."""

    num_samples: int  # P x G
    wall_s: float  # the whole call
    prefill_s: float
    time_to_50_s: float  # when half the samples had finished
    time_to_90_s: float
    time_to_100_s: float
    steps: int  # decode loop steps (target forwards)
    row_steps: int  # active rows summed over steps
    committed: int  # tokens committed by decode steps (each sample's first token, from prefill, excluded)
    drafted: int
    accepted: int
    tail_row_steps: int  # row-steps after 90% of the samples had finished
    tail_committed: int
    active_per_step: tuple[int, ...]  # samples generating at each step
    committed_per_step: tuple[int, ...]  # tokens all samples committed at each step
    step_end_s: tuple[float, ...]  # when each step ended (interpolated within its chunk)
    chunks: tuple[ChunkRecord, ...]

    @property
    def tail_s(self) -> float:
        """The long tail: from 90% of the samples finished to the last."""
        return self.time_to_100_s - self.time_to_90_s

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per active row-step (1.0 for plain decoding)."""
        return mean_acceptance_length(self.committed, self.row_steps)

    @property
    def tail_mean_acceptance_length(self) -> float:
        """The same over the tail's steps."""
        return mean_acceptance_length(self.tail_committed, self.tail_row_steps)

    @property
    def generated_tokens(self) -> int:
        """Every sample's tokens, its first included."""
        return self.committed + self.num_samples

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """P prompts x G samples: index `[p][g]` is sample g of prompt p."""

    token_ids: list[list[list[int]]]  # the sample's new tokens (its stop token included)
    text: list[list[str]]  # their text (the stop token and special tokens left out)
    finish_reason: list[list[str]]  # "stop" (a stop id) or "length" (max_new_tokens)
    # per token, its log-probability under the sampling distribution (logprobs_mode="sampling") or the
    # target's raw one ("raw"); None when logprobs=False
    logprobs: list[list[list[float]]] | None
    stats: RolloutStats
    seeds: np.ndarray  # u32[P, G] each sample's seed (`jaxspec.rollout.sample_seeds`)


@dataclasses.dataclass
class SampleRecord:
    """One finished sample as read back from the device (host arrays)."""

    tokens: list[int]
    logprobs: list[float] | None
    steps: int  # loop steps it was active (all samples start at step 0)
    drafted: int
    accepted: int
    committed: np.ndarray  # i32[steps] tokens it committed at each of its steps


def timeline_stats(samples: list[SampleRecord], chunks: list[ChunkRecord], *, wall_s: float,
                   prefill_s: float) -> RolloutStats:
    """The rollout's statistics from its finished samples and chunk records."""
    steps = max((c.end_step for c in chunks), default=0)
    chunk_steps = np.array([0] + [c.end_step for c in chunks], float)
    chunk_times = np.array([prefill_s] + [c.end_s for c in chunks], float)
    # Each chunk's steps share its time evenly: a step's end time is interpolated within its chunk.
    step_end = np.interp(np.arange(1, steps + 1), chunk_steps, chunk_times) if steps else np.zeros((0,))
    finish_step = np.array([s.steps for s in samples])  # a sample finishing in prefill: step 0
    finish_s = np.where(finish_step > 0, np.interp(finish_step, chunk_steps, chunk_times), prefill_s)
    # Samples active at step s: those finishing after it (a count of finish steps, summed from the end).
    finished_at = np.bincount(np.minimum(finish_step, steps), minlength=steps + 1)  # i64[steps + 1]
    active = (len(samples) - np.cumsum(finished_at))[:steps].astype(np.int64)
    per_step = np.zeros((steps,), np.int64)
    for s in samples:
        per_step[: s.steps] += s.committed[: s.steps]
    t50, t90, t100 = (float(np.quantile(finish_s, q, method="higher")) for q in (0.5, 0.9, 1.0))
    step90 = int(np.quantile(finish_step, 0.9, method="higher"))  # the step by which 90% had finished
    return RolloutStats(
        num_samples=len(samples), wall_s=wall_s, prefill_s=prefill_s, time_to_50_s=t50, time_to_90_s=t90,
        time_to_100_s=t100, steps=steps,
        row_steps=int(active.sum()), committed=int(per_step.sum()), drafted=sum(s.drafted for s in samples),
        accepted=sum(s.accepted for s in samples), tail_row_steps=int(active[step90:].sum()),
        tail_committed=int(per_step[step90:].sum()), active_per_step=tuple(active.tolist()),
        committed_per_step=tuple(per_step.tolist()), step_end_s=tuple(step_end.tolist()), chunks=tuple(chunks))
