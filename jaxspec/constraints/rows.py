"""Structured output inside the decode loop: each row's constraint automaton state, the masks it puts on every
verified position, and tokens the constraint forces, drafted for free.

A row's state is the automaton state after its newest token (`jaxspec.constraints.FREE` for a row without a
constraint). At verification the state advances along each draft (each tree path), and the target's logits at
every scored position are masked by the state there: a draft token the constraint forbids has probability 0
and is never accepted, and the token the target draws at each position comes from the masked distribution,
exactly as plain constrained decoding draws it. After commit the state advances by exactly the committed
tokens. The row's stop ids are legal where the constraint is complete (a final state), and only there.

Where the constraint leaves exactly one legal token, drafting it costs nothing and verification accepts it
whenever the drafts before it were accepted; where it leaves one legal text of several bytes (a JSON key, the
`": ` after it), the first token of that text as the tokenizer writes it is a near-certain draft
(`jaxspec.constraints.jump`). `ForcedTokenProposer` overrides the row's own proposer with forced tokens and
extends its chain through both.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from ..proposers.base import BatchShared, ChainProposer, Committed, Context, Draft, Proposer, drafts_chains
from . import (
    Choice,
    JsonSchema,
    Regex,
    TokenAutomaton,
    advance,
    allowed_mask,
    compile_constraint,
    forced_token,
    is_final,
    jump_token,
    stack,
    states_along,
)


@flax.struct.dataclass
class ConstraintRows:
    """The batch's constraints: one automaton set shared by every row, one state per row."""

    state: jax.Array  # i32[B]  each row's state after its newest token (FREE: unconstrained)
    automaton: BatchShared  # a `TokenAutomaton` (`jaxspec.constraints.stack` of every row's)

    @property
    def aut(self) -> TokenAutomaton:
        return self.automaton.value


def stop_mask(stop_ids: jax.Array, vocab: int) -> jax.Array:
    """bool[B, V] each row's stop ids (i32[B, M], -1 padded)."""
    rows = jnp.broadcast_to(jnp.arange(stop_ids.shape[0])[:, None], stop_ids.shape)
    ids = jnp.where(stop_ids >= 0, stop_ids, vocab)
    return jnp.zeros((stop_ids.shape[0], vocab), bool).at[rows, ids].set(True, mode="drop")


def legal(aut: TokenAutomaton, states: jax.Array, stops: jax.Array) -> jax.Array:
    """bool[B, W, V] the tokens legal after each node, in states i32[B, W]: the constraint's, plus the row's
    stop ids (bool[B, V]) in final states. A position where nothing would be legal (a complete constraint on a
    row that may not stop) allows everything rather than produce an empty distribution."""
    ok = allowed_mask(aut, states)  # bool[B, W, V]
    ok = ok | (is_final(aut, states)[..., None] & stops[:, None, :])
    return ok | ~jnp.any(ok, axis=-1, keepdims=True)


def node_states(rows: ConstraintRows, fed: jax.Array, parents: jax.Array | None) -> jax.Array:
    """i32[B, W] the state after each fed node: fed i32[B, W] is the newest token then the drafts; a chain, or a
    tree with parents i32[B, W-1]. Node 0's state is the row's own."""
    drafts = fed[:, 1:]
    if drafts.shape[1] == 0:  # the width-1 branch: no drafts (and no zero-sized arrays, which XLA:CPU mishandles)
        return rows.state[:, None]
    return states_along(rows.aut, rows.state, drafts, None if parents is None else parents[:, : drafts.shape[1]])


def constrain_scored(logits: jax.Array, rows: ConstraintRows | None, fed: jax.Array, parents: jax.Array | None,
                     stop_ids: jax.Array) -> jax.Array:
    """The verify forward's logits f32[B, W, V] with every position masked by its node's state (unchanged
    without constraints)."""
    if rows is None:
        return logits

    def mask(z):
        states = node_states(rows, fed, parents)  # i32[B, W]
        return jnp.where(legal(rows.aut, states, stop_mask(stop_ids, z.shape[-1])), z, -jnp.inf)

    # A batch that carries constraints for every row (the serving engine's) pays nothing while none is active.
    return jax.lax.cond(jnp.any(rows.state >= 0), mask, lambda z: z, logits)


def commit(rows: ConstraintRows | None, tokens: jax.Array, keep: jax.Array) -> ConstraintRows | None:
    """The rows after committing the first keep i32[B] of tokens i32[B, T]."""
    if rows is None:
        return None
    path = states_along(rows.aut, rows.state, tokens)  # i32[B, T+1]
    return rows.replace(state=jnp.take_along_axis(path, jnp.clip(keep, 0, tokens.shape[1])[:, None], axis=1)[:, 0])


@dataclasses.dataclass(frozen=True)
class ForcedTokenProposer(ChainProposer):
    """The row's proposer, with the tokens its constraint forces drafted for free.

    Walking the draft from the row's state: where the state allows one token, that token is the draft (an
    inner token there would be rejected anyway), and the chain goes on through it even past the inner
    proposer's own drafts; elsewhere the inner proposer's token stands while it has one. `inner` (K' <= K) must
    draft deterministic chains (n-gram, suffix automaton, predictions) or nothing (None)."""

    num_speculative_tokens: int  # K
    inner: Proposer | None = None

    def __post_init__(self):
        inner = self.inner
        if inner is not None and (inner.needs_features or not drafts_chains(inner)
                                  or inner.num_speculative_tokens > self.num_speculative_tokens):
            raise ValueError(f"inner={type(inner).__name__}: forced tokens draft beside a chain proposer of K' <= "
                             f"{self.num_speculative_tokens} (none, ngram, sam, predictions)")

    def init(self, params, ctx: Context):
        return () if self.inner is None else self.inner.init(params, ctx)

    def propose(self, params, pstate, ctx: Context, keys: jax.Array) -> tuple[Draft, object]:
        k = self.num_speculative_tokens
        batch = ctx.history.shape[0]
        tokens = jnp.zeros((batch, k), jnp.int32)
        num = jnp.zeros((batch,), jnp.int32)
        if self.inner is not None:
            draft, pstate = self.inner.propose(params, pstate, ctx, keys)
            if draft.probs is not None or draft.parents is not None:
                raise ValueError(f"inner={type(self.inner).__name__} drafts with a distribution or a tree; forced "
                                 "tokens need deterministic chains")
            tokens = tokens.at[:, : draft.tokens.shape[1]].set(draft.tokens.astype(jnp.int32))
            num = draft.num_draft.astype(jnp.int32)
        if ctx.constraint is None:
            return Draft(tokens=tokens, num_draft=num), pstate
        aut = ctx.constraint.aut

        def step(carry, j):
            state, going = carry  # i32[B], bool[B]: the chain still runs
            forced = forced_token(aut, state)  # i32[B], -1: a choice
            # Past the inner proposer's drafts, the first token of a forced text (a JSON key) as the tokenizer
            # writes it (jump-forward): the target writes it the same way more often than not.
            forced = jnp.where((forced < 0) & (j >= num), jump_token(aut, state), forced)
            token = jnp.where(forced >= 0, forced, tokens[:, j])
            drafted = going & ((forced >= 0) | (j < num))
            after = advance(aut, state, token)
            # A token that leaves the state where it was (a complete constraint's end-of-text) ends the chain:
            # nothing follows a stop.
            return (after, drafted & (after != state)), (token, drafted)

        def walk():
            _, (drafted, kept) = jax.lax.scan(step, (ctx.constraint.state, jnp.ones((batch,), bool)), jnp.arange(k))
            return drafted.T, jnp.sum(kept.T, axis=1).astype(jnp.int32)  # i32[B, K], i32[B]

        # A batch that carries constraints for every row (the serving engine's) walks nothing while none is active.
        tokens, num = jax.lax.cond(jnp.any(ctx.constraint.state >= 0), walk, lambda: (tokens, num))
        return Draft(tokens=tokens, num_draft=num), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        return pstate if self.inner is None else self.inner.update(params, pstate, ctx, committed)


def rows_for(lm, constraint, batch: int) -> ConstraintRows | None:
    """`generate`'s `constraint=`: None, one constraint for every row, or one (or None) per row, stacked into one
    automaton set. A constraint is a `Regex`, `JsonSchema` or `Choice` (compiled over the model's tokenizer,
    cached) or a `TokenAutomaton` already compiled (any token-level automaton over the model's vocabulary).
    ValueError naming the bad entry."""
    if constraint is None:
        return None
    specs = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * batch
    compiled = (Regex, JsonSchema, Choice)
    if len(specs) != batch:
        raise ValueError(f"constraint has {len(specs)} entries; it must be one constraint (or None) for every row, "
                         f"or one per prompt: {batch}")
    if all(s is None for s in specs):
        return None
    automata = []
    for i, spec in enumerate(specs):
        if isinstance(spec, compiled):
            if lm.tokenizer is None:
                raise ValueError(f"constraint[{i}]={spec!r} is compiled over the model's tokenizer, and the model "
                                 "has none: pass a TokenAutomaton")
            spec = compile_constraint(spec, lm.tokenizer, lm.config.vocab_size)
        elif isinstance(spec, TokenAutomaton):
            if spec.vocab_size != lm.config.vocab_size:
                raise ValueError(f"constraint[{i}] is an automaton over {spec.vocab_size} tokens; the model has "
                                 f"{lm.config.vocab_size}")
        elif spec is not None:
            raise ValueError(f"constraint[{i}]={spec!r} must be a jaxspec.Regex, JsonSchema, Choice, a "
                             "TokenAutomaton or None")
        automata.append(spec)
    aut, initial = stack(automata, vocab_size=lm.config.vocab_size)
    return ConstraintRows(state=initial, automaton=BatchShared(aut))


def wrap(proposer: Proposer, k_forced: int) -> Proposer:
    """The row proposer with up to `k_forced` forced tokens drafted a step (`ForcedTokenProposer`,
    K = max(K, k_forced)); the proposer itself where `k_forced` is 0 (`jaxspec.methods.forced_token_budget`
    says which methods take forced drafts)."""
    if k_forced == 0:
        return proposer
    inner = None if proposer.num_speculative_tokens == 0 else proposer
    return ForcedTokenProposer(max(k_forced, proposer.num_speculative_tokens), inner)
