"""The proposer contract: pure functions that draft tokens for the target model to verify.

A proposer object holds only static settings (hashable, part of the compiled program's identity); whatever
arrays it needs (a draft model's weights, a static suffix automaton) are its `params`, a pytree passed as a
jit argument. Its per-row state is a pytree too. All three functions run inside the jitted decode loop, take
and return batched arrays (leading dim B, one entry per row) and never look at the host.

The loop calls, per generation run:
  pstate = init(params, ctx)                      after prefill (ctx holds prompt + first token)
  draft, pstate = propose(params, pstate, ctx, keys)   each step
  pstate = update(params, pstate, ctx, committed)      after verification (ctx already extended)
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from ..sampling_params import SamplingParams

PState = Any  # a proposer's per-row state pytree


@flax.struct.dataclass
class Draft:
    """What `propose` returns for each row: a chain of drafts, or a draft tree when `parents` is set."""

    tokens: jax.Array  # i32[B, K]  proposed tokens; entries at or past num_draft are ignored
    num_draft: jax.Array  # i32[B]  in [0, K]; 0 means this row only takes the target's own next token
    # f32[B, K, V] the distribution each draft token was sampled from (stochastic verification), or None for
    # deterministic drafts (n-gram, suffix automaton), which are judged by the target probability alone.
    probs: jax.Array | None = None
    match_len: jax.Array | None = None  # i32[B]  matched suffix length behind the draft (lookup proposers)
    # i32[B, K] for a draft tree (jaxspec.tree): node i+1 holds tokens[:, i] and hangs under node parents[:, i]
    # (0 is the root, the row's newest token; a parent precedes its child). None: a chain. For a tree,
    # num_draft counts nodes (a prefix in index order), the row's max_draft bounds the accepted depth, and
    # probs[:, j] is the distribution node j's children were drawn from.
    parents: jax.Array | None = None
    # f32[B, K] for a tree whose nodes are in rank order (every prefix is the best tree of its size): each node's
    # draft probability of its whole path, the chance the head gives it of being accepted. Given, the loop may
    # score only a prefix of the tree when its measured cost says a wider forward does not pay
    # (jaxspec.cost.choose_tree_width). None: the tree is scored whole.
    confidence: jax.Array | None = None


@flax.struct.dataclass
class BatchShared:
    """Proposer state that belongs to the whole batch rather than to one row: its arrays do not lead with B
    (a rollout group's suffix automaton, shared by the group's rows). The slot operations that move, copy and
    drop rows (`jaxspec.engine.slots`) keep it whole; rows refer into it with per-row state of their own."""

    value: Any


@flax.struct.dataclass
class Context:
    """What a proposer may read about each row."""

    history: jax.Array  # i32[B, H]  prompt + generated tokens (including the newest, not yet in the KV cache)
    history_len: jax.Array  # i32[B]
    max_draft: jax.Array  # i32[B]  drafts allowed this step (0 for finished rows; capped by the token budget)
    sampling: SamplingParams  # per-row arrays [B]
    positions: jax.Array  # i32[B]  position of each row's newest token (== its committed cache length)
    active: jax.Array | None = None  # bool[B]  rows still generating (None: all of them)
    # [B, P, D] the target's final hidden state at every prompt position, given to `init` of proposers with
    # `needs_features` (EAGLE, Medusa); [B, P, L*D] the outputs of the proposer's `feature_layers` side by side
    # when it declares some (EAGLE-3); None elsewhere.
    features: jax.Array | None = None
    # each row's constraint state and the batch's automata (`jaxspec.constraints.rows.ConstraintRows`) when rows
    # decode under constraints: a proposer may draft the tokens a constraint forces
    constraint: Any = None


@flax.struct.dataclass
class Committed:
    """The tokens a verification step appended to each row."""

    tokens: jax.Array  # i32[B, K+1]  -1 padded
    num: jax.Array  # i32[B]  in [0, K+1]
    # [B, K+1, D] for proposers with `needs_features`: features[:, j] is the target's hidden state at the fed
    # token whose logits produced tokens[:, j] (the newest token for j = 0, then the accepted drafts);
    # [B, K+1, L*D] with `feature_layers`, as in Context.features.
    features: jax.Array | None = None


class Proposer(abc.ABC):
    """The contract every proposer follows: static settings on the object, three pure jittable functions.

    Every proposer inherits this class (a chain proposer `ChainProposer`), beside
    `@dataclasses.dataclass(frozen=True)`. A custom one (`SpecConfig(method="custom", proposer=...)`) is checked
    at the boundary: `SpecConfig` raises ValueError when it is not a Proposer, does not declare `max_depth` or is
    not hashable, and `jaxspec.prepare` / `generate` trace `propose` once (`jax.eval_shape`) and raise ValueError
    naming any Draft field of the wrong shape: tokens [B, K] int, num_draft [B] int, probs None or [B, K, V],
    parents None or [B, K], confidence None or [B, K].

    The declarations below the budget have defaults here, so the loop reads them as plain attributes; a
    proposer overrides those that differ (a class attribute, a dataclass field or a property).
    """

    num_speculative_tokens: int  # K, the static draft budget per step (tree proposers: non-root nodes)
    # Whether the loop hands the proposer the target's hidden states (Context.features at init,
    # Committed.features at update): heads draft from them; other proposers save the loop carrying them.
    needs_features: ClassVar[bool] = False
    # With needs_features: the decoder layers whose outputs the proposer reads, concatenated (EAGLE-3); () the
    # target's final hidden state (`jaxspec.verification.feature_layers`).
    feature_layers: ClassVar[tuple[int, ...]] = ()
    # Whether it drafts from a static corpus, whose long matches are weaker evidence than a row's own text: its
    # widths are then chosen by cost at one row too (`SpecConfig.cost_aware_at`).
    uses_corpus: ClassVar[bool] = False
    # Whether it returns a tree's nodes best first with their `Draft.confidence`, so a cost-aware loop may score
    # only the best of them (`jaxspec.cost.choose_tree_width`).
    ranks_nodes: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def max_depth(self) -> int:
        """The most drafts one step can accept: K for a chain, the depth for a tree. It sizes tree verification."""

    @abc.abstractmethod
    def init(self, params: Any, ctx: Context) -> PState:
        """The per-row state after prefill (ctx holds each row's prompt and first generated token)."""

    @abc.abstractmethod
    def propose(self, params: Any, pstate: PState, ctx: Context, keys: jax.Array) -> tuple[Draft, PState]:
        """(Draft, state) for this step; keys: one PRNG key per row [B] for sampled drafts."""

    @abc.abstractmethod
    def update(self, params: Any, pstate: PState, ctx: Context, committed: Committed) -> PState:
        """The state after verification committed `committed` (ctx already holds those tokens)."""


def drafts_chains(proposer: Proposer) -> bool:
    """Whether `proposer` drafts chains: one step can accept all K of its drafts (a tree of K nodes accepts at
    most its depth, fewer than K)."""
    return proposer.max_depth == proposer.num_speculative_tokens


class ChainProposer(Proposer):
    """A proposer that drafts chains from tokens alone (n-gram, suffix automaton, a draft model): it reads no
    hidden states, and one step can accept all K of its drafts."""

    @property
    def max_depth(self) -> int:
        """K: a chain of K drafts can be accepted whole."""
        return self.num_speculative_tokens


def lookup_draft_count(match_len: jax.Array, available: jax.Array, max_draft: jax.Array, k: int, min_match: int,
                       draft_per_match: float | None) -> jax.Array:
    """i32[B] drafts for a lookup proposer (n-gram, suffix automaton) from its matched suffix length.

    Nothing below `min_match`; at most `available` continuation tokens, the row's `max_draft`, K, and, when
    `draft_per_match` is set, ceil(draft_per_match * match_len): a long match predicts a long copy, a short
    one rarely pays for the wider verify forward (SuffixDecoding's adaptive draft length).
    """
    n = jnp.minimum(jnp.minimum(available, max_draft), k)
    if draft_per_match is not None and draft_per_match != float("inf"):
        n = jnp.minimum(n, jnp.ceil(draft_per_match * match_len).astype(jnp.int32))
    return jnp.where(match_len >= min_match, jnp.maximum(n, 0), 0).astype(jnp.int32)
