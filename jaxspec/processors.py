"""Logits processors: the per-row options that change the target's scored distribution or read it back.

Three exist, each optional and absent (None, no operations compiled) when no row of the batch uses it:
- penalties (`jaxspec.penalties`): presence, frequency and repetition penalties, from the tokens counted so far;
- constraints (`jaxspec.constraints.rows`): a mask from each row's automaton state;
- log-probabilities (`jaxspec.logprobs`): each output token's log-probability and the most likely tokens.

The first two adjust the logits every scored position sees (`Processors.adjust`), in that order, before anything
is sampled or verified; the third reads them back for the tokens verification output (`Processors.read`); all
three advance over the tokens a step commits (`Processors.commit`). Prefill and every decode step call these three
and nothing else of them, so a new processor is plugged in here. `ProcessorRequest` is what prefill starts them
from.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax

from . import logprobs as lp
from .constraints import rows as constraint_rows
from .penalties import TokenCounts, penalize_scored
from .sampling_params import SamplingParams


@flax.struct.dataclass
class Processors:
    """The processors' per-row states, each None when no row uses it (`DecodeState.processors`)."""

    counts: TokenCounts | None = None  # token counts, when the batch tracks them for penalties
    constraint: constraint_rows.ConstraintRows | None = None  # automaton states, when some row is constrained
    logprobs: lp.LogprobBuffer | None = None  # beside the history, when some row asked for log-probabilities

    def adjust(self, logits: jax.Array, fed: jax.Array, sampling: SamplingParams, stop_ids: jax.Array,
               tree: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """f32[B, W, V] the logits rows sample and verify from, from the target's logits [B, W, V] at the fed
        tokens i32[B, W] (the newest token, then the drafts). Each position is penalised by the tokens on its
        path and masked by the constraint state they lead to. `tree`, for a draft tree: (ancestor mask
        bool[B, W, W], parents i32[B, W-1]); None for a chain. `stop_ids` i32[B, M]: what a constrained row may
        end with."""
        on_path, parents = (None, None) if tree is None else tree
        logits = penalize_scored(logits, self.counts, fed, on_path, sampling)
        return constraint_rows.constrain_scored(logits, self.constraint, fed, parents, stop_ids)

    def read(self, active: jax.Array, logits_fn: Callable[[], tuple[jax.Array, jax.Array]], tokens: jax.Array,
             sampling: SamplingParams) -> lp.Scored | None:
        """The log-probabilities of output tokens i32[B, W] for active bool[B] rows, from `logits_fn()`: (the raw
        logits f32[B, W, V] behind them, the adjusted ones), called only while some active row records; None
        when no row does."""
        buffer = self.logprobs
        if buffer is None:
            return None

        def compute():
            raw, adjusted = logits_fn()
            return lp.score(raw, tokens, buffer.num_top, sampling, buffer.processed, adjusted)

        return lp.record(buffer, active, compute)

    def commit(self, tokens: jax.Array, keep: jax.Array, slots: jax.Array, scored: lp.Scored | None) -> "Processors":
        """The states after each row keeps the first keep i32[B] of tokens i32[B, W], written at history slots
        i32[B, W] (out of range: dropped) with their log-probabilities `scored` (from `read`)."""
        return Processors(
            counts=None if self.counts is None else self.counts.add(tokens, keep),
            constraint=constraint_rows.commit(self.constraint, tokens, keep),
            logprobs=None if scored is None else lp.write(self.logprobs, slots, scored))


@flax.struct.dataclass
class ProcessorRequest:
    """Which processors a batch runs, as `prefill` takes it (`jaxspec.Prepared.processors` is generate's); rows [B].

    `logprob_rows` marks the rows that record log-probabilities, with the `num_top_logprobs` most likely tokens at
    each position: under the target's raw distribution, or for rows marked in `logprobs_processed` under the one
    the row samples from (`jaxspec.logprobs`). `constraint` holds each row's automaton state
    (`jaxspec.constraints.rows`). With `track_counts` the batch counts each row's prompt and output tokens and
    every row's penalties apply (`jaxspec.penalties`); without it penalties are ignored, so a caller whose rows
    ask for one must set it. The two settings are static: they choose what the program computes.
    """

    logprob_rows: jax.Array | None = None  # bool[B]
    logprobs_processed: jax.Array | None = None  # bool[B]
    constraint: constraint_rows.ConstraintRows | None = None
    num_top_logprobs: int = flax.struct.field(pytree_node=False, default=0)
    track_counts: bool = flax.struct.field(pytree_node=False, default=False)

    def start(self, prompts: jax.Array, prompt_lens: jax.Array, vocab: int, history_width: int) -> Processors:
        """The processors' states before any output, for right-padded prompts i32[B, W] of lengths i32[B] and
        histories `history_width` slots wide."""
        counts = TokenCounts.of_prompts(prompts, prompt_lens, vocab) if self.track_counts else None
        logprobs = None
        if self.logprob_rows is not None:
            logprobs = lp.LogprobBuffer.zeros(self.logprob_rows, history_width, self.num_top_logprobs,
                                              self.logprobs_processed)
        return Processors(counts=counts, constraint=self.constraint, logprobs=logprobs)
