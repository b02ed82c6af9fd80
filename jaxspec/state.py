"""The decode loop's state on the device: `DecodeState` (the batch's cache, histories and proposer state),
`RowParams` (each row's sampling settings and `RowLimits`, when it stops) and `SpecCounters` (what each row
drafted and accepted)."""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from . import logprobs as lp
from .cache import KVCache
from .constraints import rows as constraint_rows
from .penalties import TokenCounts
from .processors import Processors
from .sampling_params import SamplingParams


@flax.struct.dataclass
class RowLimits:
    """When each row stops: its token budget and its stop ids (`jaxspec.prepare` builds them)."""

    max_new_tokens: jax.Array  # i32[B]  at least 1
    stop_ids: jax.Array  # i32[B, M]  token ids that end the row (EOS and user stop ids), -1 padded
    # i32[B]: the most drafts a row may score per step, below the proposer's K (None: K). Data, not a static
    # setting, so a caller can turn speculation down or off between chunks without recompiling (rollouts do
    # as rows finish and the verify cost of the shrinking batch changes).
    draft_cap: jax.Array | None = None


@flax.struct.dataclass
class RowParams:
    """Each row's own parameters, arrays [B, ...] the loop reads at every step: how the row samples and when it
    stops. Data, not static settings, so rows with different requests share one compiled loop."""

    sampling: SamplingParams
    limits: RowLimits


@flax.struct.dataclass
class SpecCounters:
    """Per-row acceptance bookkeeping, kept on the device and read once at the end."""

    steps: jax.Array  # i32[B]  loop steps in which the row was active
    drafted: jax.Array  # i32[B]
    accepted: jax.Array  # i32[B]  accepted drafts that were emitted
    drafted_at: jax.Array  # i32[B, K]  steps with a draft at position j
    accepted_at: jax.Array  # i32[B, K]  steps whose draft at position j was accepted and emitted
    committed: jax.Array  # i32[B, N]  tokens the row committed at each of its own steps

    @classmethod
    def zeros(cls, batch: int, k: int, buffer_len: int) -> "SpecCounters":
        z = functools.partial(jnp.zeros, dtype=jnp.int32)
        return cls(steps=z((batch,)), drafted=z((batch,)), accepted=z((batch,)), drafted_at=z((batch, k)),
                   accepted_at=z((batch, k)), committed=z((batch, buffer_len)))

    def record(self, active: jax.Array, num_draft: jax.Array, draft_depth: jax.Array, accepted: jax.Array,
               kept: jax.Array) -> "SpecCounters":
        """The counters after one step: active bool[B] rows drafted num_draft i32[B] tokens (or tree nodes)
        reaching draft_depth i32[B] positions, and kept i32[B] tokens of which accepted i32[B] were drafts.
        Per-position counts are by depth: a tree drafts at depth j when one of its scored nodes is that deep."""
        batch, k = self.drafted_at.shape
        pos = jnp.arange(k)
        step_slot = jnp.where(active, self.steps, self.committed.shape[1])  # a finished row's write is dropped
        return SpecCounters(
            steps=self.steps + active,
            drafted=self.drafted + jnp.where(active, num_draft, 0),
            accepted=self.accepted + accepted,
            drafted_at=self.drafted_at + (active[:, None] & (pos < draft_depth[:, None])),
            accepted_at=self.accepted_at + (pos < accepted[:, None]),
            committed=self.committed.at[jnp.arange(batch), step_slot].set(kept, mode="drop"))


def mean_acceptance_length(committed: int, steps: int) -> float:
    """Tokens committed per active row-step: the one definition every statistic uses (library, engine, /metrics).

    A step commits its accepted drafts and then the target's own token, so plain decoding gives 1.0; a step cut
    by a stop token or the token budget counts only what it kept. `committed` excludes each row's first token,
    which prefill made. NaN when there were no steps.
    """
    return committed / steps if steps else float("nan")


@flax.struct.dataclass
class DecodeState:
    """The whole batch's decode state on the device: what `prefill` returns and `decode`/`spec_step` advance.

    A row's new tokens are `history[i, prompt_len[i]:history_len[i]]` (`jaxspec.Prepared.new_tokens` reads
    them all as one array).
    """

    cache: KVCache
    history: jax.Array  # i32[B, H]  prompt followed by the generated tokens (garbage past history_len)
    history_len: jax.Array  # i32[B]
    prompt_len: jax.Array  # i32[B]
    # bool[B, H] beside `history`: True where the token was an accepted draft, False where the target produced
    # it (each step commits a run of accepted drafts, then one token of the target's own)
    from_draft: jax.Array
    done: jax.Array  # bool[B]
    steps: jax.Array  # i32[]  loop iterations (each one target forward)
    pstate: Any  # the proposer's per-row state
    counters: SpecCounters
    logprobs: lp.LogprobBuffer | None = None  # beside `history`, when a row asked for log-probabilities
    # each row's token counts, when the batch tracks them for penalties (`ProcessorRequest.track_counts`)
    counts: TokenCounts | None = None
    # each row's constraint state and the batch's automata, when some row decodes under a constraint
    constraint: constraint_rows.ConstraintRows | None = None

    @property
    def processors(self) -> Processors:
        """The processors' states (`jaxspec.processors`): token counts, constraints, log-probabilities."""
        return Processors(counts=self.counts, constraint=self.constraint, logprobs=self.logprobs)

    def with_processors(self, processors: Processors) -> "DecodeState":
        """The state holding `processors`' states."""
        return self.replace(counts=processors.counts, constraint=processors.constraint,
                            logprobs=processors.logprobs)

    @property
    def num_generated(self) -> jax.Array:
        """i32[B]: tokens each row generated so far (its first, from prefill, included)."""
        return self.history_len - self.prompt_len

    @property
    def last_tokens(self) -> jax.Array:
        """i32[B]: each row's newest token, sampled but not yet in the cache."""
        return jnp.take_along_axis(self.history, (self.history_len - 1)[:, None], axis=1)[:, 0]
