"""Several proposers in one batch: each row drafts with the proposer its request chose, within two caps.

A serving batch mixes requests that asked for different methods (plain, prompt lookup, suffix automaton) and
draft budgets. `MixedProposer` runs every member proposer over the whole batch (they are cheap next to the
target forward) and keeps, per row, the draft of the member the row chose. A row's drafts are capped by

- its own request's budget (`MixedState.max_draft`, set when the row is admitted), and
- the load cap `MixedParams.draft_cap_by_active[a]`, where a is the number of rows still generating: the
  draft policy's answer to "how many drafts per row pay off with a rows running?". It is a jit argument,
  so the policy may change it between chunks without recompiling, and it is read at every step, so it
  follows rows finishing inside a chunk.

Several members must be deterministic chains (n-gram, suffix automaton): their drafts carry no distribution
and no tree, so one verification rule serves every row. A lone member may be anything (a Medusa or EAGLE-2
tree, an EAGLE chain sampled from its own distribution): its draft passes through, with its node or token
count capped the same way (a tree's nodes are ordered parents first, so a prefix is a smaller tree).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from .base import Committed, Context, Draft, Proposer


@flax.struct.dataclass
class MixedParams:
    draft_cap_by_active: jax.Array  # i32[A + 1]  the most drafts per row while a rows are active
    members: tuple  # each member proposer's params


@flax.struct.dataclass
class MixedState:
    choice: jax.Array  # i32[B]  index of the row's proposer in MixedProposer.proposers
    max_draft: jax.Array  # i32[B]  the row's own draft budget, in [0, K]
    members: tuple  # each member proposer's per-row state


@dataclasses.dataclass(frozen=True)
class MixedProposer(Proposer):
    proposers: tuple[Proposer, ...]  # all with the same K; a row's choice indexes this tuple
    num_speculative_tokens: int

    def __post_init__(self):
        if not self.proposers:
            raise ValueError("proposers=() must name at least one proposer")
        ks = [p.num_speculative_tokens for p in self.proposers]
        if any(k != self.num_speculative_tokens for k in ks):
            raise ValueError(f"member proposers have K={ks}; all must equal num_speculative_tokens="
                             f"{self.num_speculative_tokens}")
        if len(self.proposers) > 1 and any(p.needs_features for p in self.proposers):
            raise ValueError("a proposer that reads the target's features (Medusa, EAGLE) must be the only member")

    @property
    def needs_features(self) -> bool:
        """A head member reads the target's features (it is then the only member)."""
        return any(p.needs_features for p in self.proposers)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The head member's (`jaxspec.verification.feature_layers`): which of the target's layers it reads."""
        return next((tuple(p.feature_layers) for p in self.proposers if p.needs_features), ())

    @property
    def max_depth(self) -> int:
        """The deepest member's: verification is sized for any row's choice."""
        return max(p.max_depth for p in self.proposers)

    def init(self, params: MixedParams, ctx: Context) -> MixedState:
        """Every row starts with member 0 and the full budget; the engine sets the row's choice after prefill."""
        batch = ctx.history.shape[0]
        members = tuple(p.init(mp, ctx) for p, mp in zip(self.proposers, params.members))
        return MixedState(choice=jnp.zeros((batch,), jnp.int32),
                          max_draft=jnp.full((batch,), self.num_speculative_tokens, jnp.int32), members=members)

    def propose(self, params: MixedParams, pstate: MixedState, ctx: Context, keys: jax.Array
                ) -> tuple[Draft, MixedState]:
        k = self.num_speculative_tokens
        batch = ctx.history.shape[0]
        active = jnp.ones((batch,), bool) if ctx.active is None else ctx.active
        table = params.draft_cap_by_active
        load_cap = table[jnp.minimum(jnp.sum(active), table.shape[0] - 1)]
        cap = jnp.minimum(jnp.minimum(ctx.max_draft, pstate.max_draft), load_cap)  # i32[B]
        ctx = ctx.replace(max_draft=cap)
        if len(self.proposers) == 1:
            return self._propose_alone(params, pstate, ctx, keys, cap)

        def draft_all():
            tokens = jnp.zeros((batch, k), jnp.int32)
            num = jnp.zeros((batch,), jnp.int32)
            match = jnp.zeros((batch,), jnp.int32)
            states = []
            for i, (p, mp, ms) in enumerate(zip(self.proposers, params.members, pstate.members)):
                d, ms = p.propose(mp, ms, ctx, keys)
                if d.probs is not None:
                    raise ValueError(f"{p!r} drafts with a distribution; MixedProposer takes deterministic proposers")
                mine = pstate.choice == i
                tokens = jnp.where(mine[:, None], d.tokens, tokens)
                num = jnp.where(mine, d.num_draft, num)
                if d.match_len is not None:
                    match = jnp.where(mine, d.match_len, match)
                states.append(ms)
            return tokens, jnp.minimum(num, cap), match, tuple(states)

        def draft_none():
            zeros = jnp.zeros((batch,), jnp.int32)
            return jnp.zeros((batch, k), jnp.int32), zeros, zeros, pstate.members

        # Under load the policy caps every row at 0: then the members' lookups are skipped outright.
        tokens, num, match, members = jax.lax.cond(jnp.any(cap > 0), draft_all, draft_none)
        return Draft(tokens=tokens, num_draft=num, match_len=match), pstate.replace(members=members)

    def _propose_alone(self, params: MixedParams, pstate: MixedState, ctx: Context, keys: jax.Array,
                       cap: jax.Array) -> tuple[Draft, MixedState]:
        proposer, member_params, member_state = self.proposers[0], params.members[0], pstate.members[0]

        def draft():
            d, ms = proposer.propose(member_params, member_state, ctx, keys)
            return d.replace(num_draft=jnp.minimum(d.num_draft, cap)), (ms,)

        def draft_none():  # the same structure, all zeros: no row drafts, the state is left as it was
            shape = jax.eval_shape(draft)[0]
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape), pstate.members

        d, members = jax.lax.cond(jnp.any(cap > 0), draft, draft_none)
        return d, pstate.replace(members=members)

    def update(self, params: MixedParams, pstate: MixedState, ctx: Context, committed: Committed) -> MixedState:
        members = tuple(p.update(mp, ms, ctx, committed)
                        for p, mp, ms in zip(self.proposers, params.members, pstate.members))
        return pstate.replace(members=members)
