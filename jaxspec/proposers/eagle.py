"""EAGLE: a one-layer head drafts autoregressively in the target's feature space (Li et al. 2024; EAGLE-3, 2025).

The design and its modes are described in docs/concepts/proposers.md.

Position i of the head reads the pair (f_i, x_{i+1}): the target's feature at i and the token after it. Its
output predicts f_{i+1}, and the target's LM head turns that into the distribution of x_{i+2}. The head keeps
its own one-layer KV cache over the committed positions, in step with the target's (same length, same
positions); drafts write past it and are overwritten, like the target's rejected drafts.

- init: after prefill, the head reads every prompt pair (prompt features from the prefill forward).
- update: after verification, the head reads the committed pairs with the *target's* features from the
  verify forward (F_j at the fed token, c_j the committed token after it) and keeps its prediction at the
  last one: the feature behind the first draft of the next step.
- propose, mode "chain": K drafts, each fed back with the head's own predicted feature. Greedy rows take the
  argmax, sampled rows sample from the head's processed distribution q, which goes to verification.
- propose, mode "static" (EAGLE-1): a fixed `TreeTopology`; every node with children is run through the
  head once (one forward per depth over that depth's parents) and its children are its ranked top-k tokens.
- propose, mode "tree" (EAGLE-2's dynamic tree): from the root, expand the `top_k` most confident frontier
  nodes by cumulative draft log-probability, each with its top-k children, for `depth` levels, then keep the
  K best nodes (`select_nodes`, closed under ancestors), best first, with each one's path probability as its
  confidence, so the loop can score fewer of them where a wide forward costs more than it would commit. Each
  level is one head forward over the frontier under a tree mask. Candidates are deterministic, so sampled rows
  use the point-mass rule (lossless).

EAGLE-3 (`feature_layers` set, an `Eagle3Head`) drafts the same ways. The loop hands it the outputs of the
target's low, middle and high layers side by side, [.., L*D], instead of the final hidden state, and the head
fuses them to its feature (`target_features`) wherever the target's features enter: at init and update.

Over a draft vocabulary (`SpecConfig(draft_vocab=N)`, `Readout.restrict`) each head forward scores N columns of
the LM head instead of V, and candidates and samples map back to target ids. A sampled chain's q is then its
distribution over the N ids scattered into a V-wide vector, zero elsewhere: the exact probability of every
target id. Verification reads q at the drafted id (inside the set) and in the residual max(p - q, 0), where
the zeros leave the target's own mass on every id the draft could not propose.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..cache import KVCache
from ..sampling import processed_probs, sample
from ..tree import TreeTopology, dynamic_tree_nodes, select_nodes
from .base import Committed, Context, Draft, Proposer


@flax.struct.dataclass
class EagleState:
    """The EAGLE proposer's per-row state."""

    cache: KVCache  # the head's one layer; lengths == the target's committed lengths
    pred: jax.Array  # f32[B, D]  the head's predicted feature at the newest token's position


def _take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...] at one index per row i32[B] -> [B, ...]."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 1)), axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class EagleProposer(Proposer):
    """The EAGLE head drafting a chain, a static tree (EAGLE-1) or a dynamic tree (EAGLE-2)."""

    num_speculative_tokens: int  # chain: drafts per step; tree: nodes kept for verification
    graphdef: Any  # nnx.GraphDef of EagleHead; params = {"head": state, "readout": Readout}
    cache_len: int  # the target's cache slots per row
    mode: Literal["chain", "static", "tree"] = "chain"  # eagle (chain or static tree) or eagle2 ("tree")
    depth: int = 0  # tree: levels expanded
    top_k: int = 0  # tree: frontier nodes per level, and children per frontier node
    topology: TreeTopology | None = None  # static: the tree
    needs_features: bool = True  # the loop passes the target's hidden states
    feature_layers: tuple[int, ...] = ()  # EAGLE-3: the target layers whose outputs the head fuses; () final

    def __post_init__(self):
        if self.mode not in ("chain", "static", "tree"):
            raise ValueError(f"mode={self.mode!r} must be 'chain', 'static' or 'tree'")
        if self.mode == "static" and (self.topology is None
                                      or self.topology.num_nodes != self.num_speculative_tokens):
            raise ValueError(f"mode='static' needs a topology of num_speculative_tokens="
                             f"{self.num_speculative_tokens} nodes, got {self.topology!r}")
        if self.mode == "tree":
            if self.depth < 1 or self.top_k < 1:
                raise ValueError(f"tree_depth={self.depth!r} and tree_top_k={self.top_k!r} must be >= 1")
            if self.num_speculative_tokens > self.num_candidates:
                raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} exceeds the "
                                 f"{self.num_candidates} nodes a depth-{self.depth}, top-{self.top_k} tree drafts")

    @property
    def max_depth(self) -> int:
        """The most drafts one step can accept: K for a chain, the tree's depth otherwise."""
        if self.mode == "static":
            return self.topology.max_depth
        return self.depth if self.mode == "tree" else self.num_speculative_tokens

    @property
    def ranks_nodes(self) -> bool:
        """Tree mode drafts its nodes best first, with their confidence (`Draft.confidence`)."""
        return self.mode == "tree"

    @property
    def num_candidates(self) -> int:
        """Tree mode: the nodes drafted before the best K are kept."""
        return dynamic_tree_nodes(self.depth, self.top_k)

    @property
    def _scratch(self) -> int:
        """Head cache slots past the committed ones that drafting writes."""
        if self.mode == "static":
            return max(len(self._expanded), 1)
        return self.num_speculative_tokens if self.mode == "chain" else (self.depth - 1) * self.top_k

    @property
    def _expanded(self) -> tuple[int, ...]:
        """Static mode: the non-root nodes with children, by depth (each depth's are run together, so their
        scratch slots must be contiguous), then index."""
        depth = self.topology.depths
        return tuple(sorted(set(p for p in self.topology.parents if p > 0), key=lambda n: (depth[n - 1], n)))

    def init(self, params, ctx: Context) -> EagleState:
        """The head's cache over every prompt pair, and its prediction at the last one."""
        head = nnx.merge(self.graphdef, params["head"])
        batch, width = ctx.features.shape[:2]
        cache = head.new_cache(batch, self.cache_len + self._scratch)
        # Pair i = (f_i, x_{i+1}); pairs past a row's prompt are padding the cache length never covers.
        embeds = params["readout"].embed_tokens(ctx.history[:, 1: width + 1])
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        out, cache = head(embeds, head.target_features(ctx.features.astype(jnp.float32)), positions, cache)
        prompt_len = ctx.history_len - 1
        return EagleState(cache=cache.replace(lengths=prompt_len), pred=_take_rows(out, prompt_len - 1))

    def update(self, params, state: EagleState, ctx: Context, committed: Committed) -> EagleState:
        """The head reads the committed pairs with the target's features; its cache advances by the count."""
        head = nnx.merge(self.graphdef, params["head"])
        width = self.max_depth + 1  # a step commits at most max_depth drafts plus one token
        tokens, features = committed.tokens[:, :width], committed.features[:, :width]
        positions = state.cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)
        out, cache = head(params["readout"].embed_tokens(tokens), head.target_features(features.astype(jnp.float32)),
                          positions, state.cache)
        num = committed.num
        pred = jnp.where((num > 0)[:, None], _take_rows(out, jnp.maximum(num - 1, 0)), state.pred)
        return EagleState(cache=cache.advance(num), pred=pred)

    def propose(self, params, state: EagleState, ctx: Context, keys) -> tuple[Draft, EagleState]:
        """A chain (sampled rows carry q), a static tree, or the dynamic tree, by `mode`."""
        if self.mode == "chain":
            return self._chain(params, state, ctx, keys), state
        if self.mode == "static":
            return self._static(params, state), state
        return self._tree(params, state), state

    def _chain(self, params, state: EagleState, ctx: Context, keys) -> Draft:
        head = nnx.merge(self.graphdef, params["head"])
        readout = params["readout"]
        k = self.num_speculative_tokens
        start = state.cache.lengths  # i32[B]: position of the newest token

        def draw(i, feature):  # f32[B, D] -> draft token i32[B], its distribution q f32[B, V]
            # Over a draft vocabulary the token is drawn among its N columns, and q is that same distribution
            # with zeros at every other id: the exact probability of each target id, as verification needs.
            logits = readout.logits(feature)  # f32[B, N] (N = V without a draft vocabulary)
            step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, i)
            token = readout.token_ids(sample(step_keys, logits, ctx.sampling))
            return token, readout.full_vocab(processed_probs(logits, ctx.sampling))

        token, q = draw(0, state.pred)
        batch = token.shape[0]
        tokens = jnp.zeros((batch, k), jnp.int32).at[:, 0].set(token)
        probs = jnp.zeros((batch, k, q.shape[-1]), jnp.float32).at[:, 0].set(q)

        def step(i, carry):
            cache, feature, tokens, probs = carry
            # Pair (predicted f at position start + i - 1, draft i - 1), written past the committed slots.
            at = start + i - 1
            embeds = readout.embed_tokens(jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1))
            out, cache = head(embeds, feature[:, None], at[:, None], cache, write_at=at)
            token, q = draw(i, out[:, 0])
            return cache, out[:, 0], tokens.at[:, i].set(token), probs.at[:, i].set(q)

        _, _, tokens, probs = jax.lax.fori_loop(1, k, step, (state.cache, state.pred, tokens, probs))
        return Draft(tokens=tokens, num_draft=jnp.minimum(ctx.max_draft, k), probs=probs)

    def _static(self, params, state: EagleState) -> Draft:
        head = nnx.merge(self.graphdef, params["head"])
        readout = params["readout"]
        topo = self.topology
        parents, ranks, node_depth = topo.parents, topo.child_rank, topo.depths
        expanded = self._expanded
        slot_of = {node: i for i, node in enumerate(expanded)}  # scratch slot of each expanded node
        cache, start = state.cache, state.cache.lengths
        batch = start.shape[0]
        rel = jnp.arange(cache.max_len)[None, :] - start[:, None]  # [B, S]
        width = max(ranks) + 1

        def ranked(feature):  # f32[B, n, D] -> i32[B, n, width] each node's ranked candidates (target ids)
            return readout.token_ids(jax.lax.top_k(readout.logits(feature), width)[1].astype(jnp.int32))

        tokens = jnp.zeros((batch, topo.num_nodes), jnp.int32)
        outputs = {0: state.pred}  # node -> the head's feature after it (root: the state's prediction)
        candidates = {0: ranked(state.pred[:, None])[:, 0]}
        for level in range(1, topo.max_depth + 1):
            # Fill this depth's tokens from their parents' candidates, then run the ones that have children.
            for i in (i for i in range(topo.num_nodes) if node_depth[i] == level):
                tokens = tokens.at[:, i].set(candidates[parents[i]][:, ranks[i]])
            run = [n for n in expanded if node_depth[n - 1] == level]
            if not run:
                continue
            # Static visibility: each run node sees the committed prefix, itself and its expanded ancestors.
            sees = np.zeros((len(run), self._scratch), bool)
            for row, node in enumerate(run):
                a = node
                while a > 0:
                    sees[row, slot_of[a]] = True
                    a = parents[a - 1]
            in_scratch = (rel >= 0) & (rel < self._scratch)
            seen = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(sees), (batch,) + sees.shape),
                                       jnp.clip(rel, 0, self._scratch - 1)[:, None, :].repeat(len(run), 1), axis=2)
            visible = (rel < 0)[:, None, :] | (in_scratch[:, None, :] & seen)
            feats = jnp.stack([outputs[parents[n - 1]] for n in run], axis=1)  # [B, n, D]
            fed = tokens[:, [n - 1 for n in run]]
            positions = jnp.broadcast_to((start + level - 1)[:, None], fed.shape)
            out, cache = head(readout.embed_tokens(fed), feats, positions, cache, write_at=start + slot_of[run[0]],
                              visible=visible)
            cand = ranked(out)
            for row, node in enumerate(run):
                outputs[node], candidates[node] = out[:, row], cand[:, row]
        parents_arr = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), tokens.shape)
        return Draft(tokens=tokens, num_draft=jnp.full((batch,), topo.num_nodes, jnp.int32), parents=parents_arr)

    def _tree(self, params, state: EagleState) -> Draft:
        head = nnx.merge(self.graphdef, params["head"])
        readout = params["readout"]
        k, depth = self.top_k, self.depth
        cache = state.cache
        start = cache.lengths  # i32[B]
        batch, slots = start.shape[0], cache.max_len
        scratch = self._scratch

        def children(feature):  # f32[B, F, D] -> top-k (log-probs f32[B, F, k], target ids i32[B, F, k])
            lp = jax.nn.log_softmax(readout.logits(feature), axis=-1)  # over the draft vocabulary when restricted
            top, index = jax.lax.top_k(lp, k)
            return top, readout.token_ids(index)

        # Level 1: the root's top-k children; every one of them is on the first frontier.
        lp, tok = children(state.pred[:, None])
        scores, tokens = lp[:, 0], tok[:, 0].astype(jnp.int32)  # [B, k]
        parents = jnp.zeros((batch, k), jnp.int32)
        frontier = jnp.arange(1, k + 1, dtype=jnp.int32)[None].repeat(batch, 0)  # node indices [B, k]
        f_scores, f_tokens = scores, tokens
        f_inputs = jnp.broadcast_to(state.pred[:, None], (batch, k, state.pred.shape[-1]))  # parents' features
        ancestry = jnp.zeros((batch, k, max(scratch, 1)), bool)  # scratch slots each frontier node sees
        rel = jnp.arange(slots)[None, :] - start[:, None]  # [B, S]: slot index past the committed prefix

        for level in range(1, depth):
            # Run the head on the frontier (depth `level`): pair (parent's feature, node token) at
            # position start + level - 1, written at scratch slots (level - 1) * k + f.
            base = (level - 1) * k
            ancestry = ancestry.at[:, :, base: base + k].set(
                jnp.eye(k, dtype=bool)[None] | ancestry[:, :, base: base + k])
            in_scratch = (rel >= 0) & (rel < scratch)
            seen = jnp.take_along_axis(ancestry, jnp.clip(rel, 0, scratch - 1)[:, None, :].repeat(k, 1), axis=2)
            visible = (rel < 0)[:, None, :] | (in_scratch[:, None, :] & seen)  # bool[B, k, S]
            positions = jnp.broadcast_to((start + level - 1)[:, None], (batch, k))
            out, cache = head(readout.embed_tokens(f_tokens), f_inputs, positions, cache, write_at=start + base,
                              visible=visible)
            lp, tok = children(out)  # [B, k, k]
            child_scores = (f_scores[:, :, None] + lp).reshape(batch, k * k)
            child_tokens = tok.reshape(batch, k * k).astype(jnp.int32)
            child_parents = jnp.repeat(frontier, k, axis=1)  # [B, k*k]
            first = 1 + scores.shape[1]  # node index of this level's first child
            scores = jnp.concatenate([scores, child_scores], axis=1)
            tokens = jnp.concatenate([tokens, child_tokens], axis=1)
            parents = jnp.concatenate([parents, child_parents], axis=1)
            # The next frontier: the k most confident children; each inherits its parent's scratch ancestry.
            f_scores, pick = jax.lax.top_k(child_scores, k)  # [B, k]
            owner = pick // k  # which frontier node each pick hangs under
            frontier = first + pick
            f_tokens = jnp.take_along_axis(child_tokens, pick, axis=1)
            f_inputs = jnp.take_along_axis(out, owner[:, :, None], axis=1)
            ancestry = jnp.take_along_axis(ancestry, owner[:, :, None], axis=1)

        kept_tokens, kept_parents, kept, valid = select_nodes(scores, parents, tokens, self.num_speculative_tokens)
        confidence = jnp.where(valid, jnp.exp(jnp.take_along_axis(scores, kept, axis=1)), 0.0)  # f32[B, K]
        return Draft(tokens=kept_tokens, num_draft=jnp.sum(valid, axis=1).astype(jnp.int32), parents=kept_parents,
                     confidence=confidence)
