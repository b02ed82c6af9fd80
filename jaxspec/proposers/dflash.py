"""DFlash: a block drafter proposes a whole chain in one forward (`jaxspec.models.dflash`).

The drafter keeps a KV cache per layer over the committed positions, in step with the target's (same lengths):
the context keys and values made from the target's chosen layers at each committed position.

- init: after prefill, every prompt position's context from the prompt's layer features.
- propose: the block [newest token, mask x K] at positions n .. n + K runs through the drafter once (its keys
  written past the committed slots, where verification's rejected drafts also go); position i's output, scored by
  the target's LM head, is draft i. Greedy rows take each position's argmax; sampled rows sample each position from
  its processed distribution q, which goes to verification. Position i's distribution does not depend on the
  drafts before it, so a draft drawn from it is a draft drawn from q_i given them, which is all lossless
  verification asks.
- update: the committed positions' context from the target's features of the verify forward (the newest token
  and the accepted drafts); the cache advances by the count.

As a tree (`tree_top_k` m > 1): the block's argmax chain of C = K - tree_depth * (m - 1) drafts, and at each of its
first `tree_depth` positions the next m - 1 best candidates as siblings of the chain's token there (children of the
chain node before it). One block forward still drafts every node; a step accepts the chain up to its first miss
and, where a sibling is the target's token at that position, that one too. The nodes are deterministic, so sampled
rows are verified by the point-mass rule.

Over a draft vocabulary (`SpecConfig(draft_vocab=N)`) the K positions score N columns of the LM head instead of V;
q is then scattered into a V-wide vector, zero outside the N ids, as for the EAGLE heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from ..cache import KVCache
from ..models.dflash import block_visibility
from ..sampling import is_greedy, processed_probs, sample
from .base import Committed, Context, Draft, Proposer


@flax.struct.dataclass
class DFlashState:
    """The DFlash proposer's per-row state: the drafter's context cache, lengths == the target's committed."""

    cache: KVCache


@dataclasses.dataclass(frozen=True)
class DFlashProposer(Proposer):
    """A DFlash drafter drafting a chain of K <= block_size - 1 tokens per step, or a tree of K nodes."""

    num_speculative_tokens: int  # K drafts per step
    graphdef: Any  # nnx.GraphDef of DFlashDrafter; params = {"head": state, "readout": Readout}
    cache_len: int  # the target's cache slots per row
    block_size: int  # the block the drafter runs: the anchor and block_size - 1 masks
    feature_layers: tuple[int, ...] = ()  # the target layers whose outputs the drafter reads
    tree_top_k: int = 1  # > 1: a tree, the first `tree_depth` positions drafting their tree_top_k best candidates
    tree_depth: int = 0
    needs_features: bool = True

    def __post_init__(self):
        if not 1 <= self.max_depth <= self.block_size - 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r} must be in [1, "
                             f"{self.block_size - 1}]: this drafter drafts blocks of {self.block_size} (the newest "
                             f"token and {self.block_size - 1} masks)" if self.tree_top_k == 1 else
                             f"a tree of num_speculative_tokens={self.num_speculative_tokens} nodes with tree_depth="
                             f"{self.tree_depth} positions of tree_top_k={self.tree_top_k} candidates leaves a chain "
                             f"of {self.max_depth}; it must be in [1, {self.block_size - 1}], this drafter's block "
                             f"less the newest token")
        if self.tree_top_k > 1 and not 1 <= self.tree_depth <= self.max_depth:
            raise ValueError(f"tree_depth={self.tree_depth!r} must be in [1, {self.max_depth}], the chain's length")

    @property
    def max_depth(self) -> int:
        """The chain's length: K for a chain, K less the siblings for a tree."""
        return self.num_speculative_tokens - self.tree_depth * (self.tree_top_k - 1) if self.tree_top_k > 1 \
            else self.num_speculative_tokens

    def init(self, params, ctx: Context) -> DFlashState:
        """The context of every prompt position (the newest token's comes with the first verification)."""
        drafter = nnx.merge(self.graphdef, params["head"])
        batch, width = ctx.features.shape[:2]
        cache = drafter.new_cache(batch, self.cache_len + self.block_size)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        cache = drafter.write_context(ctx.features, positions, cache, jnp.zeros((batch,), jnp.int32))
        # Slots past a row's prompt hold padding that its length never covers.
        return DFlashState(cache=cache.replace(lengths=ctx.history_len - 1))

    def update(self, params, state: DFlashState, ctx: Context, committed: Committed) -> DFlashState:
        """The committed positions' context from the target's features there; the cache advances by the count."""
        drafter = nnx.merge(self.graphdef, params["head"])
        width = self.max_depth + 1  # a step commits at most K drafts plus one token
        start = state.cache.lengths
        positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)
        cache = drafter.write_context(committed.features[:, :width], positions, state.cache, start)
        return DFlashState(cache=cache.advance(committed.num))

    def propose(self, params, state: DFlashState, ctx: Context, keys) -> tuple[Draft, DFlashState]:
        """One drafter forward over the block; K drafts (sampled rows carry each position's q)."""
        drafter = nnx.merge(self.graphdef, params["head"])
        readout = params["readout"]
        k, width = self.max_depth, self.block_size
        start = state.cache.lengths  # i32[B]: position of the newest token
        batch = start.shape[0]
        anchor = jnp.take_along_axis(ctx.history, (ctx.history_len - 1)[:, None], axis=1)[:, 0]  # i32[B]
        positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, W]
        visible = block_visibility(start, width, state.cache.max_len)
        hidden = drafter(drafter.block_embeds(readout, anchor, width), positions, state.cache, write_at=start,
                         visible=visible)  # [B, W, D]
        logits = readout.logits(hidden[:, 1: k + 1])  # f32[B, K, N] (N = V without a draft vocabulary)
        if self.tree_top_k > 1:
            return self._tree(readout, logits), state

        # The K positions as B * K rows of one sampling call, row (b, i) with row b's settings and key fold_in(key_b,
        # i): vmapping the call over positions instead would turn its all-greedy shortcut (a lax.cond) into a select
        # that also runs the sampled path.
        rows = logits.reshape(batch * k, -1)  # f32[B*K, N]
        position_keys = jax.vmap(lambda key: jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(k)))(keys)
        sampling = jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), ctx.sampling)
        tokens = readout.token_ids(sample(position_keys.reshape(batch * k), rows, sampling)).reshape(batch, k)
        # Greedy rows are verified by the target's argmax alone: an all-greedy batch skips the V-wide q of every
        # position.
        vocab = readout.embed.shape[0]
        probs = jax.lax.cond(jnp.all(is_greedy(ctx.sampling.temperature)),
                             lambda: jnp.zeros((batch, k, vocab), jnp.float32),
                             lambda: readout.full_vocab(processed_probs(rows, sampling)).reshape(batch, k, vocab))
        num_draft = jnp.minimum(ctx.max_draft, k)
        return Draft(tokens=tokens.astype(jnp.int32), num_draft=num_draft, probs=probs), state

    def _tree(self, readout, logits: jax.Array) -> Draft:
        """The argmax chain over the C positions of `logits` f32[B, C, N], then the next best candidates of the
        first `tree_depth` positions, each hanging under the chain node before its position."""
        batch, chain = logits.shape[:2]
        m, depth = self.tree_top_k, self.tree_depth
        ids = readout.token_ids(jax.lax.top_k(logits, m)[1].astype(jnp.int32))  # [B, C, m] target ids, best first
        siblings = ids[:, :depth, 1:].reshape(batch, depth * (m - 1))
        tokens = jnp.concatenate([ids[:, :, 0], siblings], axis=1)  # [B, K]
        # Chain node i (1-based) hangs under node i - 1; the siblings at position d under chain node d - 1.
        parents = jnp.asarray(list(range(chain)) + [d for d in range(depth) for _ in range(m - 1)], jnp.int32)
        num = jnp.full((batch,), self.num_speculative_tokens, jnp.int32)
        return Draft(tokens=tokens, num_draft=num, parents=jnp.broadcast_to(parents, tokens.shape))
