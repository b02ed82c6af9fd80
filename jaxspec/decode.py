"""The device side of generation: prefill, and the whole decode as one jitted `lax.while_loop`.

Every step is a speculative step: propose up to K drafts per row, score the newest token plus the drafts with
one target forward (K/V written at each row's own length), verify them with lossless rejection sampling, and
commit by appending the output tokens and advancing each row's cache length. A rejected draft costs nothing to
undo: the length never moves past it. Plain decoding is the same step with no proposer (K = 0), so
speculative and plain runs share one machinery.

The host calls `prefill` once and `decode` once; nothing crosses to the host between steps. Shapes are fixed
(batch B, prompt bucket P, history H = P + output bucket, cache S), rows finish independently, and per-request
values (sampling settings, seeds, limits, stop ids) are arrays, so a new request never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from . import logprobs as lp
from .cache import KVCache
from .config import SamplingParams
from .proposers.base import Committed, Context, Draft, Proposer
from .rejection import rejection_sample
from .sampling import row_keys, sample
from .tree import depths, gather_nodes, gather_path, tree_ancestor_mask, verify_tree

# What a draft token outside [0, vocab) becomes before anything is fed to the target: the embedding lookup of
# an out-of-range id gives NaN, whose K/V would stay in the cache past the row's length and poison the row.
# Any id inside the vocabulary serves, since a draft holding the placeholder is never accepted.
OOV_DRAFT_PLACEHOLDER = 0


@flax.struct.dataclass
class RowLimits:
    """When each row stops: its token budget and its stop ids (`jaxspec.prepare` builds them)."""

    max_new_tokens: jax.Array  # i32[B]  at least 1
    stop_ids: jax.Array  # i32[B, M]  token ids that end the row (EOS and user stop ids), -1 padded


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
    done: jax.Array  # bool[B]
    steps: jax.Array  # i32[]  loop iterations (each one target forward)
    pstate: Any  # the proposer's per-row state
    counters: SpecCounters
    logprobs: lp.LogprobBuffer | None = None  # beside `history`, when a row asked for log-probabilities

    @property
    def num_generated(self) -> jax.Array:
        """i32[B]: tokens each row generated so far (its first, from prefill, included)."""
        return self.history_len - self.prompt_len

    @property
    def last_tokens(self) -> jax.Array:
        """i32[B]: each row's newest token, sampled but not yet in the cache."""
        return jnp.take_along_axis(self.history, (self.history_len - 1)[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class NoProposer:
    """Plain decoding: never drafts (K = 0)."""

    num_speculative_tokens: int = 0

    def init(self, params, ctx: Context):
        return ()

    def propose(self, params, pstate, ctx: Context, keys):
        batch = ctx.history.shape[0]
        return Draft(tokens=jnp.zeros((batch, 0), jnp.int32), num_draft=jnp.zeros((batch,), jnp.int32)), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        return pstate


def _is_stop(tokens: jax.Array, limits: RowLimits) -> jax.Array:
    """bool[B, ...] for tokens i32[B, ...]."""
    stop = limits.stop_ids.reshape(limits.stop_ids.shape[:1] + (1,) * (tokens.ndim - 1) + limits.stop_ids.shape[1:])
    return jnp.any(tokens[..., None] == stop, axis=-1)


def _context(state: DecodeState, sampling: SamplingParams, limits: RowLimits, k: int) -> Context:
    # A row may draft at most one token fewer than it still may emit: the target adds one token of its own.
    room = limits.max_new_tokens - state.num_generated - 1
    max_draft = jnp.where(state.done, 0, jnp.clip(room, 0, k))
    return Context(history=state.history, history_len=state.history_len, max_draft=max_draft, sampling=sampling,
                   positions=state.cache.lengths, active=~state.done)


@functools.partial(jax.jit, static_argnames=("graphdef", "proposer", "cache_len", "buffer_len", "num_top_logprobs"))
def prefill(graphdef, params, prompts: jax.Array, prompt_lens: jax.Array, sampling: SamplingParams,
            limits: RowLimits, proposer_params=None, logprob_rows: jax.Array | None = None, *,
            proposer: Proposer = NoProposer(), cache_len: int, buffer_len: int,
            num_top_logprobs: int = 0) -> DecodeState:
    """Run the prompts (right-padded i32[B, P], true lengths i32[B]), sample each row's first token and
    initialise the proposer.

    With `logprob_rows` (bool[B]) the state records the target's log-probability of every token the marked
    rows generate, and the `num_top_logprobs` most likely tokens at each position (`jaxspec.logprobs`).

    Padding tokens write K/V past a row's length; the length never covers them, so they are overwritten.
    """
    model = nnx.merge(graphdef, params)
    batch, width = prompts.shape
    cache = model.new_cache(batch, cache_len)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    # Prefill keeps the XLA attention: the kernel is built for the few new tokens of a verification step.
    out, cache = model(prompts, positions, cache, logits_at=(prompt_lens - 1)[:, None], attention_impl="xla",
                       cached_slots=0)
    # (out.hidden holds every prompt position's feature, which EAGLE and Medusa heads start from.)
    cache = cache.advance(prompt_lens)
    first = sample(row_keys(sampling.seed, cache.lengths), out.logits[:, 0], sampling)
    history = jnp.zeros((batch, width + buffer_len), jnp.int32).at[:, :width].set(prompts)
    history = history.at[jnp.arange(batch), prompt_lens].set(first)
    done = _is_stop(first, limits) | (limits.max_new_tokens <= 1)
    logprobs = None
    if logprob_rows is not None:
        logprobs = lp.LogprobBuffer.zeros(logprob_rows, width + buffer_len, num_top_logprobs)
        scored = lp.record(logprobs, jnp.ones((batch,), bool),
                           lambda: lp.score(out.logits, first[:, None], num_top_logprobs))
        logprobs = lp.write(logprobs, prompt_lens[:, None], scored)
    state = DecodeState(cache=cache, history=history, history_len=prompt_lens + 1, prompt_len=prompt_lens,
                        done=done, steps=jnp.zeros((), jnp.int32), pstate=(),
                        counters=SpecCounters.zeros(batch, proposer.num_speculative_tokens, buffer_len),
                        logprobs=logprobs)
    k = proposer.num_speculative_tokens
    ctx = _context(state, sampling, limits, k)
    if getattr(proposer, "needs_features", False):
        ctx = ctx.replace(features=out.hidden)
    return state.replace(pstate=proposer.init(proposer_params, ctx))


def _pad_outputs(tokens: jax.Array, features: jax.Array | None, k: int):
    """Output tokens (and their features) padded from [B, W] to [B, K+1]."""
    pad = k + 1 - tokens.shape[1]
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)), constant_values=-1)
    if features is not None:
        features = jnp.pad(features, ((0, 0), (0, pad), (0, 0)))
    return tokens, features


def _score_and_verify(model, width: int, state: DecodeState, draft: Draft, num_draft: jax.Array,
                      sampling: SamplingParams, k: int, attention_impl: str, want_features: bool):
    """One target forward over each row's newest token plus its first `width - 1` drafts, then verification.

    Returns (output tokens i32[B, K+1] padded with -1, their count i32[B], the cache with the new K/V, the
    target's hidden states at the fed tokens [B, K+1, D] or None, and the outputs' log-probabilities or None).
    """
    cache = state.cache
    fed = jnp.concatenate([state.last_tokens[:, None], draft.tokens[:, : width - 1]], axis=1)  # [B, width]
    positions = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)
    out, cache = model(fed, positions, cache, attention_impl=attention_impl)
    probs = None if draft.probs is None else draft.probs[:, : width - 1]
    keys = jax.vmap(jax.random.key)(sampling.seed)
    # Output token j sits at position lengths + 1 + j; plain decoding keys the same position the same way.
    tokens, num = rejection_sample(keys, out.logits, draft.tokens[:, : width - 1], probs, num_draft, sampling,
                                   positions=cache.lengths + 1)
    scored = _logprobs_of(state, lambda: out.logits, tokens, k)
    tokens, features = _pad_outputs(tokens, out.hidden if want_features else None, k)
    return tokens, num, cache, features, scored


def _logprobs_of(state: DecodeState, logits_fn, tokens: jax.Array, k: int) -> lp.Scored | None:
    """The log-probabilities of output tokens i32[B, W] under `logits_fn()` f32[B, W, V], padded to K + 1."""
    buffer = state.logprobs
    if buffer is None:
        return None
    scored = lp.record(buffer, ~state.done, lambda: lp.score(logits_fn(), tokens, buffer.num_top))
    return scored.pad(k + 1)


def _score_and_verify_tree(model, width: int, state: DecodeState, draft: Draft, in_vocab: jax.Array,
                           node_depth: jax.Array, num_nodes: jax.Array, max_draft: jax.Array,
                           sampling: SamplingParams, k: int, max_depth: int, attention_impl: str,
                           want_features: bool):
    """The tree version: one forward over the root and the first `width - 1` draft nodes under their ancestor
    mask, verification along the tree, and the accepted path's K/V moved to contiguous slots. A node whose
    token was out of the vocabulary (`in_vocab` bool[B, K] False), or under such a node, is never accepted.

    Node i's K/V is written at slot lengths + i; after verification path node j moves to slot lengths + j, so
    the cache again holds a plain prefix and later steps never see the tree.
    """
    cache = state.cache
    n = width - 1
    tokens, parents = draft.tokens[:, :n], draft.parents[:, :n]  # [B, n]
    fed = jnp.concatenate([state.last_tokens[:, None], tokens], axis=1)  # [B, width]: root, then the nodes
    depth = node_depth[:, :width]  # i32[B, width]: a parent precedes its child, so a prefix keeps its depths
    mask = tree_ancestor_mask(parents)  # bool[B, width, width]
    out, cache = model(fed, cache.lengths[:, None] + depth, cache, tree_mask=mask, attention_impl=attention_impl)
    # Nodes past the row's node count, deeper than it may still emit, or on a path through an out-of-vocabulary
    # token are never accepted.
    valid = ((jnp.arange(n) < num_nodes[:, None]) & (depth[:, 1:] <= max_draft[:, None])
             & _path_in_vocab(mask, in_vocab[:, :n]))  # bool[B, n]
    probs = None if draft.probs is None else draft.probs[:, :n]
    keys = jax.vmap(jax.random.key)(sampling.seed)
    path, out_tokens, num = verify_tree(keys, out.logits, tokens, parents, valid, probs, sampling,
                                        positions=cache.lengths + 1, max_depth=min(max_depth, n))
    cache = cache.replace(k=tuple(gather_path(b, cache.lengths, path) for b in cache.k),
                          v=tuple(gather_path(b, cache.lengths, path) for b in cache.v))
    features = gather_nodes(out.hidden, path) if want_features else None
    # Output token j was drawn from the logits of path node j (the root first).
    scored = _logprobs_of(state, lambda: gather_nodes(out.logits, path), out_tokens, k)
    out_tokens, features = _pad_outputs(out_tokens, features, k)
    return out_tokens, num, cache, features, scored


def _replace_out_of_vocab(draft: Draft, vocab: int) -> tuple[Draft, jax.Array]:
    """The draft with every token outside [0, vocab) replaced by OOV_DRAFT_PLACEHOLDER, and bool[B, K] which
    tokens were inside it. Proposers are pluggable (a custom one, a static corpus): nothing they return may
    reach the target's embedding lookup out of range."""
    tokens = draft.tokens.astype(jnp.int32)  # i32[B, K]
    in_vocab = (tokens >= 0) & (tokens < vocab)  # bool[B, K]
    return draft.replace(tokens=jnp.where(in_vocab, tokens, OOV_DRAFT_PLACEHOLDER)), in_vocab


def _leading_in_vocab(in_vocab: jax.Array) -> jax.Array:
    """i32[B] drafts before a chain's first out-of-vocabulary one (bool[B, K])."""
    return jnp.sum(jnp.cumprod(in_vocab.astype(jnp.int32), axis=1), axis=1)


def _path_in_vocab(mask: jax.Array, in_vocab: jax.Array) -> jax.Array:
    """bool[B, n]: node i+1 and all its ancestors hold in-vocabulary tokens, so node validity stays closed under
    ancestors (mask bool[B, n+1, n+1] from tree_ancestor_mask, in_vocab bool[B, n])."""
    ok = jnp.concatenate([jnp.ones_like(in_vocab[:, :1]), in_vocab], axis=1)  # bool[B, n+1], the root is fed
    return jnp.all(~mask | ok[:, None, :], axis=-1)[:, 1:]


def propose_once(proposer: Proposer, proposer_params, state: DecodeState, sampling: SamplingParams,
                 limits: RowLimits):
    """What `proposer.propose` returns at `state`, called with the context and keys `spec_step` gives it.

    Nothing is scored or committed. For inspecting drafts, and for checking a proposer's output shapes with
    `jax.eval_shape` before anything compiles. Returns propose's result as is: (Draft, new proposer state).
    """
    ctx = _context(state, sampling, limits, proposer.num_speculative_tokens)
    return proposer.propose(proposer_params, state.pstate, ctx, row_keys(sampling.seed, state.cache.lengths))


def spec_step(model, proposer: Proposer, proposer_params, state: DecodeState, sampling: SamplingParams,
              limits: RowLimits, widths: tuple[int, ...], attention_impl: str = "xla") -> DecodeState:
    """Propose, score, verify, commit: one step for every row (finished rows ride along and commit nothing).

    `model` is the merged target module (`lm.module`, or `nnx.merge(lm.graphdef, lm.params)` inside jit);
    `widths` the verify widths (`Prepared.widths`). Not jitted itself: call it inside your own jitted
    function or loop. Returns the new state.
    """
    k = proposer.num_speculative_tokens
    batch = state.history.shape[0]
    active = ~state.done
    ctx = _context(state, sampling, limits, k)
    keys = row_keys(sampling.seed, state.cache.lengths)
    draft, pstate = proposer.propose(proposer_params, state.pstate, ctx, keys)
    draft, in_vocab = _replace_out_of_vocab(draft, model.cfg.vocab_size)
    want_features = getattr(proposer, "needs_features", False)
    is_tree = draft.parents is not None
    node_depth = depths(draft.parents) if is_tree else None  # i32[B, K+1], the root included
    proposed = jnp.clip(draft.num_draft, 0, k).astype(jnp.int32)  # i32[B]
    # A chain's drafts are its depth, cut at its first out-of-vocabulary token; a tree's nodes are bounded by
    # the node count (out-of-vocabulary ones are marked invalid), its depth by max_draft.
    num_draft = (jnp.where(ctx.max_draft > 0, proposed, 0) if is_tree
                 else jnp.minimum(jnp.minimum(proposed, ctx.max_draft), _leading_in_vocab(in_vocab)))

    # The narrowest compiled width that holds the longest draft in the batch: a step where nobody drafts
    # costs one plain decode step, not c(K+1) of them.
    def branch(width):
        n = jnp.minimum(num_draft, width - 1)
        if is_tree:
            return lambda: _score_and_verify_tree(model, width, state, draft, in_vocab, node_depth, n,
                                                  ctx.max_draft, sampling, k, getattr(proposer, "max_depth", k),
                                                  attention_impl, want_features)
        return lambda: _score_and_verify(model, width, state, draft, n, sampling, k, attention_impl, want_features)

    if len(widths) == 1:
        out_tokens, num_out, cache, features, out_logprobs = branch(widths[0])()
    else:
        choice = jnp.sum(jnp.asarray(widths[:-1]) < jnp.max(num_draft) + 1)
        out_tokens, num_out, cache, features, out_logprobs = jax.lax.switch(choice, [branch(w) for w in widths])

    # Commit: keep output tokens up to and including the first stop token, and within the token budget.
    j = jnp.arange(k + 1)
    stop_at = jnp.where(_is_stop(out_tokens, limits) & (j < num_out[:, None]), j, k + 1)
    room = limits.max_new_tokens - state.num_generated
    keep = jnp.minimum(jnp.minimum(num_out, jnp.min(stop_at, axis=1) + 1), room)
    keep = jnp.where(active, keep, 0)  # i32[B]
    kept = j < keep[:, None]  # bool[B, K+1]
    slots = jnp.where(kept, state.history_len[:, None] + j, state.history.shape[1])  # out of bounds: dropped
    history = state.history.at[jnp.arange(batch)[:, None], slots].set(out_tokens, mode="drop")
    history_len = state.history_len + keep
    # The newest token joins the cache with every kept token but the last, which is the new newest token.
    cache = cache.advance(keep)
    stopped = jnp.any(_is_stop(out_tokens, limits) & kept, axis=1)
    done = state.done | (active & (stopped | (history_len - state.prompt_len >= limits.max_new_tokens)))

    accepted = jnp.where(active, jnp.minimum(num_out - 1, keep), 0)
    c = state.counters
    pos = jnp.arange(k)
    # Per-position counts are by depth: a tree drafts at depth j when one of its scored nodes is that deep.
    draft_depth = num_draft
    if is_tree:
        scored = jnp.arange(k) < num_draft[:, None]
        draft_depth = jnp.minimum(jnp.max(jnp.where(scored, node_depth[:, 1:], 0), axis=1), ctx.max_draft)
    counters = SpecCounters(
        steps=c.steps + active, drafted=c.drafted + jnp.where(active, num_draft, 0), accepted=c.accepted + accepted,
        drafted_at=c.drafted_at + (active[:, None] & (pos < draft_depth[:, None])),
        accepted_at=c.accepted_at + (pos < accepted[:, None]),
        committed=c.committed.at[jnp.arange(batch), jnp.where(active, c.steps, c.committed.shape[1])].set(
            keep, mode="drop"))

    logprobs = None if out_logprobs is None else lp.write(state.logprobs, slots, out_logprobs)
    new = state.replace(cache=cache, history=history, history_len=history_len, done=done, steps=state.steps + 1,
                        counters=counters, logprobs=logprobs)
    committed = Committed(tokens=jnp.where(kept, out_tokens, -1), num=keep, features=features)
    pstate = proposer.update(proposer_params, pstate, _context(new, sampling, limits, k), committed)
    return new.replace(pstate=pstate)


def _loop(graphdef, params, state: DecodeState, sampling: SamplingParams, limits: RowLimits, proposer_params,
          proposer: Proposer, widths: tuple[int, ...], attention_impl: str, last_step: jax.Array) -> DecodeState:
    """Steps until every row is done or the loop's step counter reaches `last_step`."""
    model = nnx.merge(graphdef, params)

    def cond(s: DecodeState):
        return ~jnp.all(s.done) & (s.steps < last_step)

    def body(s: DecodeState):
        return spec_step(model, proposer, proposer_params, s, sampling, limits, widths, attention_impl)

    return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames=("graphdef", "proposer", "widths", "attention_impl"),
                   donate_argnames=("state",))
def decode(graphdef, params, state: DecodeState, sampling: SamplingParams, limits: RowLimits, proposer_params=None,
           *, proposer: Proposer = NoProposer(), widths: tuple[int, ...] = (1,),
           attention_impl: str = "xla") -> DecodeState:
    """Decode until every row is done, as one `lax.while_loop` on the device; returns the final state.

    `state` is donated: its buffers are reused for the result, so do not read the state you passed in.
    """
    max_steps = state.counters.committed.shape[1]
    return _loop(graphdef, params, state, sampling, limits, proposer_params, proposer, widths, attention_impl,
                 jnp.asarray(max_steps, jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "proposer", "widths", "attention_impl", "num_steps"),
                   donate_argnames=("state",))
def decode_chunk(graphdef, params, state: DecodeState, sampling: SamplingParams, limits: RowLimits,
                 proposer_params=None, *, proposer: Proposer = NoProposer(), widths: tuple[int, ...] = (1,),
                 attention_impl: str = "xla", num_steps: int) -> DecodeState:
    """At most `num_steps` more steps, fewer once every row is done: the serving engine's unit of work.

    Between chunks the host streams what rows committed, admits requests into free rows and retires finished
    ones; the state (cache, histories, proposer state) stays on the device and is updated in place.
    """
    return _loop(graphdef, params, state, sampling, limits, proposer_params, proposer, widths, attention_impl,
                 state.steps + num_steps)
