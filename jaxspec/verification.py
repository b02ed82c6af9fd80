"""Verification: score a step's drafts with one target forward and keep what lossless rejection sampling accepts.

`verify` runs the forward at one of the compiled verify widths (a `lax.switch`), over a chain (`_score_chain`)
or over a draft tree under its ancestor mask (`_score_tree`), and returns a `Verified`: each row's output tokens
and the cache holding their K/V, its lengths not yet advanced (`jaxspec.decode.commit` advances them). What is
fixed for the compiled program is a `Scoring`; what the proposer drafted this step is a `Drafts`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from . import logprobs as lp
from .cache import KVCache, write_new
from .proposers.base import Draft, Proposer
from .rejection import rejection_sample
from .state import DecodeState, RowParams
from .tree import DraftTree, gather_nodes, gather_path, tree_ancestor_mask, verify_tree


def feature_layers(proposer: Proposer) -> tuple[int, ...] | None:
    """What `proposer` reads of the target at each position: None nothing, () its final hidden state
    (`output.hidden`), or the outputs of these decoder layers, concatenated (an EAGLE-3 head's)."""
    if not proposer.needs_features:
        return None
    return tuple(proposer.feature_layers)


def layer_request(layers: tuple[int, ...] | None) -> dict:
    """The forward's keyword asking for decoder layers' outputs, only when some are wanted: a target without
    `return_layers` then serves every other method."""
    return {"return_layers": layers} if layers else {}


def target_features(out, layers: tuple[int, ...] | None) -> jax.Array | None:
    """[B, T, D] final hidden states, [B, T, L*D] the chosen layers' outputs side by side, or None."""
    if layers is None:
        return None
    return jnp.concatenate(out.layer_hidden, axis=-1) if layers else out.hidden


@dataclasses.dataclass(frozen=True)
class Scoring:
    """What every verify forward of one compiled loop shares: the target, the proposer's budget and what it reads
    back, the attention, and whether the forwards leave their K/V writes to after the width switch."""

    model: Any  # the merged target module
    k: int  # the proposer's K: outputs are padded to K + 1 so every width agrees
    max_depth: int  # the longest run of drafts one step can accept (a tree's depth)
    layers: tuple[int, ...] | None  # what the proposer reads of the target (`feature_layers`)
    attention_impl: str  # "xla" or "pallas"
    # The forwards leave the cache unwritten and one write after the switch adds their K/V (several widths, on a
    # target that can): a branch that updated the cache would make XLA copy it whole.
    defer: bool = False

    @classmethod
    def of(cls, model, proposer: Proposer, widths: tuple[int, ...], attention_impl: str) -> "Scoring":
        """The scoring of `proposer`'s drafts by `model` at `widths`."""
        defer = len(widths) > 1 and attention_impl == "xla" and getattr(model, "defers_cache_writes", False)
        return cls(model=model, k=proposer.num_speculative_tokens, max_depth=proposer.max_depth,
                   layers=feature_layers(proposer), attention_impl=attention_impl, defer=defer)


@flax.struct.dataclass
class Drafts:
    """One step's drafts as verification scores them."""

    draft: Draft  # every token inside the vocabulary (`jaxspec.decode` replaced the others)
    num: jax.Array  # i32[B] drafts (a chain) or nodes (a tree) to score
    in_vocab: jax.Array  # bool[B, K] which proposed tokens were inside the vocabulary
    node_depth: jax.Array | None  # i32[B, K+1] each tree node's depth, the root included; None for a chain
    max_draft: jax.Array  # i32[B] the most drafts each row may still accept


@flax.struct.dataclass
class Verified:
    """One step's verification, before anything is committed: each row's output tokens (its accepted drafts,
    then the target's own token) and the cache holding their K/V, its lengths not yet advanced."""

    tokens: jax.Array  # i32[B, K+1]  -1 padded
    num: jax.Array  # i32[B]  in [1, K+1]
    cache: KVCache
    # f32[B, K+1, D]: the target's hidden state at the fed token behind each output (proposers with
    # needs_features; [B, K+1, L*D] with feature_layers), else None
    features: jax.Array | None
    logprobs: lp.Scored | None  # the outputs' log-probabilities, padded to K+1, when a row asked for them


def _verified(tokens: jax.Array, num: jax.Array, cache: KVCache, features: jax.Array | None,
              logprobs: lp.Scored | None, k: int) -> Verified:
    """A Verified whose outputs (and features) are padded from [B, W] to [B, K+1], so every width agrees."""
    pad = k + 1 - tokens.shape[1]
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)), constant_values=-1)
    if features is not None:
        features = jnp.pad(features, ((0, 0), (0, pad), (0, 0)))
    if logprobs is not None:
        logprobs = logprobs.pad(k + 1)
    return Verified(tokens=tokens, num=num, cache=cache, features=features, logprobs=logprobs)


def _forward(scoring: Scoring, fed: jax.Array, positions: jax.Array, cache: KVCache, tree_mask: jax.Array | None):
    """The target forward of a verify step: (output, the cache with the fed tokens' K/V written), or when
    deferring (output, a cache of `width` slots holding just their K/V), written by `_write_deferred`."""
    extra = layer_request(scoring.layers)
    if scoring.defer:
        extra["write_cache"] = False
    return scoring.model(fed, positions, cache, tree_mask=tree_mask, attention_impl=scoring.attention_impl, **extra)


def _score_chain(scoring: Scoring, width: int, state: DecodeState, drafts: Drafts, rows: RowParams) -> Verified:
    """One target forward over each row's newest token plus its first `width - 1` drafts, then rejection
    sampling along the chain."""
    cache, draft = state.cache, drafts.draft
    fed = jnp.concatenate([state.last_tokens[:, None], draft.tokens[:, : width - 1]], axis=1)  # i32[B, width]
    positions = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)
    out, written = _forward(scoring, fed, positions, cache, None)
    sampling, processors = rows.sampling, state.processors
    logits = processors.adjust(out.logits, fed, sampling, rows.limits.stop_ids)  # f32[B, width, V]
    probs = None if draft.probs is None else draft.probs[:, : width - 1]
    keys = jax.vmap(jax.random.key)(sampling.seed)
    # Output token j sits at position lengths + 1 + j; plain decoding keys the same position the same way.
    tokens, num = rejection_sample(keys, logits, draft.tokens[:, : width - 1], probs, drafts.num, sampling,
                                   positions=cache.lengths + 1)
    scored = processors.read(~state.done, lambda: (out.logits, logits), tokens, sampling)
    return _verified(tokens, num, written, target_features(out, scoring.layers), scored, scoring.k)


def _score_tree(scoring: Scoring, width: int, state: DecodeState, drafts: Drafts, rows: RowParams) -> Verified:
    """The tree version: one forward over the root and the first `width - 1` draft nodes under their ancestor
    mask, verification along the tree, and the accepted path's K/V moved to contiguous slots. A node whose
    token was out of the vocabulary (`drafts.in_vocab` False), or under such a node, is never accepted.

    Node i's K/V is written at slot lengths + i; after verification path node j moves to slot lengths + j, so
    the cache again holds a plain prefix and later steps never see the tree.
    """
    cache, draft = state.cache, drafts.draft
    n = width - 1
    tokens, parents = draft.tokens[:, :n], draft.parents[:, :n]  # i32[B, n]
    fed = jnp.concatenate([state.last_tokens[:, None], tokens], axis=1)  # i32[B, width]: root, then the nodes
    depth = drafts.node_depth[:, :width]  # i32[B, width]: a parent precedes its child, so a prefix keeps its depths
    mask = tree_ancestor_mask(parents)  # bool[B, width, width]
    out, written = _forward(scoring, fed, cache.lengths[:, None] + depth, cache, mask)
    sampling, processors = rows.sampling, state.processors
    # f32[B, width, V]: each node penalised by the tokens on its path, masked by the state they lead to
    logits = processors.adjust(out.logits, fed, sampling, rows.limits.stop_ids, tree=(mask, parents))
    # Nodes past the row's node count, deeper than it may still emit, on a path through an out-of-vocabulary
    # token, or whose slot lies past the cache's end (its K/V dropped, `write_new`; a node's ancestors come
    # before it, so they fit wherever it does) are never accepted.
    in_cache = cache.lengths[:, None] + 1 + jnp.arange(n) < cache.max_len  # bool[B, n]: node i+1's slot exists
    valid = ((jnp.arange(n) < drafts.num[:, None]) & (depth[:, 1:] <= drafts.max_draft[:, None])
             & _path_in_vocab(mask, drafts.in_vocab[:, :n]) & in_cache)  # bool[B, n]
    probs = None if draft.probs is None else draft.probs[:, :n]
    keys = jax.vmap(jax.random.key)(sampling.seed)
    path, out_tokens, num = verify_tree(keys, logits, DraftTree(tokens, parents, valid, probs), sampling,
                                        positions=cache.lengths + 1, max_depth=min(scoring.max_depth, n))
    # Written slots start at the written cache's lengths: the rows' lengths, or 0 for deferred K/V.
    written = written.map_layers(lambda b: gather_path(b, written.lengths, path))
    features = None if scoring.layers is None else gather_nodes(target_features(out, scoring.layers), path)
    # Output token j was drawn from the logits of path node j (the root first).
    scored = processors.read(~state.done, lambda: (gather_nodes(out.logits, path), gather_nodes(logits, path)),
                             out_tokens, sampling)
    return _verified(out_tokens, num, written, features, scored, scoring.k)


def _path_in_vocab(mask: jax.Array, in_vocab: jax.Array) -> jax.Array:
    """bool[B, n]: node i+1 and all its ancestors hold in-vocabulary tokens, so node validity stays closed under
    ancestors (mask bool[B, n+1, n+1] from tree_ancestor_mask, in_vocab bool[B, n])."""
    ok = jnp.concatenate([jnp.ones_like(in_vocab[:, :1]), in_vocab], axis=1)  # bool[B, n+1], the root is fed
    return jnp.all(~mask | ok[:, None, :], axis=-1)[:, 1:]


def verify(scoring: Scoring, state: DecodeState, drafts: Drafts, rows: RowParams, widths: tuple[int, ...],
           choice: jax.Array) -> Verified:
    """Score each row's newest token and its first `drafts.num` drafts with one target forward at
    `widths[choice]` (a `lax.switch` over the compiled widths) and verify them losslessly under each row's
    sampling settings and processors (a constrained row may end with its stop ids)."""
    score = _score_chain if drafts.node_depth is None else _score_tree
    widest = max(widths)

    def branch(width):
        clipped = drafts.replace(num=jnp.minimum(drafts.num, width - 1))

        def run():
            return score(scoring, width, state, clipped, rows)

        if not scoring.defer:
            return run
        return lambda: _pad_slots(run(), widest)

    if len(widths) == 1:
        return branch(widths[0])()
    verified = jax.lax.switch(choice, [branch(w) for w in widths])
    return _write_deferred(verified, state.cache) if scoring.defer else verified


def _pad_slots(verified: Verified, widest: int) -> Verified:
    """A deferred Verified's K/V slots [B, Hkv, width, hd] padded to `widest`, so every branch agrees. The
    padding lands past each row's new length, in slots no row reads before writing them again."""
    def pad(b):
        return jnp.pad(b, ((0, 0), (0, 0), (0, widest - b.shape[2]), (0, 0)))

    return verified.replace(cache=verified.cache.map_layers(pad))


def _write_deferred(verified: Verified, cache: KVCache) -> Verified:
    """The Verified with its K/V slots written into `cache` at each row's length (outside any conditional, so in
    place; the widest width fits there, as every branch's forward needs)."""
    slots = verified.cache
    return verified.replace(cache=cache.map_layers(lambda b, n: write_new(b, n, cache.lengths), slots))
