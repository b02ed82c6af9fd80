"""The device side of generation: prefill, and the whole decode as one jitted `lax.while_loop`.

Every step is a speculative step: propose up to K drafts per row, score the newest token plus the drafts with
one target forward (K/V written at each row's own length), verify them with lossless rejection sampling, and
commit by appending the output tokens and advancing each row's cache length. A rejected draft costs nothing to
undo: the length never moves past it. Plain decoding is the same step with no proposer (K = 0), so
speculative and plain runs share one machinery.

The host calls `prefill` once and `decode` once; nothing crosses to the host between steps. Shapes are fixed
(batch B, prompt bucket P, history H = P + output bucket, cache S), rows finish independently, and per-request
values (sampling settings, seeds, limits, stop ids) are arrays, so a new request never recompiles.

The state the loop carries is `jaxspec.state`; scoring and verifying a step's drafts is `jaxspec.verification`;
this module proposes, commits and loops.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from . import cost, sharding
from .models.packing import Packing
from .processors import ProcessorRequest
from .proposers.base import ChainProposer, Committed, Context, Draft, Proposer
from .sampling import row_keys, sample
from .state import DecodeState, RowLimits, RowParams, SpecCounters
from .tree import depths
from .verification import Drafts, Scoring, Verified, feature_layers, layer_request, target_features, verify

# What a draft token outside [0, vocab) becomes before anything is fed to the target: the embedding lookup of
# an out-of-range id gives NaN, whose K/V would stay in the cache past the row's length and poison the row.
# Any id inside the vocabulary serves, since a draft holding the placeholder is never accepted.
OOV_DRAFT_PLACEHOLDER = 0


@dataclasses.dataclass(frozen=True)
class NoProposer(ChainProposer):
    """Plain decoding: never drafts (K = 0)."""

    num_speculative_tokens: int = 0

    def init(self, params, ctx: Context):
        return ()

    def propose(self, params, pstate, ctx: Context, keys):
        batch = ctx.history.shape[0]
        return Draft(tokens=jnp.zeros((batch, 0), jnp.int32), num_draft=jnp.zeros((batch,), jnp.int32)), pstate

    def update(self, params, pstate, ctx: Context, committed: Committed):
        return pstate


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """How every step of a compiled loop runs: static, part of the program's identity (`decode`, `decode_chunk`
    and `spec_step` take one; `Prepared.step` is generate's)."""

    proposer: Proposer = NoProposer()  # drafts each step; NoProposer decodes plainly
    widths: tuple[int, ...] = (1,)  # the compiled verify widths, ending at K + 1
    attention_impl: str = "xla"  # "xla", or "pallas" for the verification kernel


def _is_stop(tokens: jax.Array, limits: RowLimits) -> jax.Array:
    """bool[B, ...] for tokens i32[B, ...]."""
    stop = limits.stop_ids.reshape(limits.stop_ids.shape[:1] + (1,) * (tokens.ndim - 1) + limits.stop_ids.shape[1:])
    return jnp.any(tokens[..., None] == stop, axis=-1)


def _context(state: DecodeState, rows: RowParams, k: int) -> Context:
    # A row may draft at most one token fewer than it still may emit: the target adds one token of its own.
    limits = rows.limits
    room = limits.max_new_tokens - state.num_generated - 1
    cap = k if limits.draft_cap is None else jnp.clip(limits.draft_cap, 0, k)
    max_draft = jnp.where(state.done, 0, jnp.clip(room, 0, cap))
    return Context(history=state.history, history_len=state.history_len, max_draft=max_draft, sampling=rows.sampling,
                   positions=state.cache.lengths, active=~state.done, constraint=state.constraint)


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    """How `prefill` lays out a batch: static, part of the program's identity (`Prepared.prefill_spec` is
    generate's)."""

    cache_len: int  # KV cache slots S per row
    buffer_len: int  # output slots N after the prompt bucket: the history is P + N wide
    proposer: Proposer = NoProposer()  # initialised from the prompts (its features, when it reads them)
    # G > 1: each prompt starts G consecutive rows (B = P * G: row p * G + g is sample g of prompt p), its K/V
    # computed once and copied into the group's rows
    group_size: int = 1
    # N: the prompts' token-wise work runs over their tokens packed into N positions rather than P x W
    # (`jaxspec.shapes.packed_width`, `jaxspec.models.packing`), where the target packs (`packs_prefill`);
    # None: over the padded prompts
    packed: int | None = None


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def prefill(graphdef, params, prompts: jax.Array, prompt_lens: jax.Array, rows: RowParams, proposer_params=None,
            processors: ProcessorRequest = ProcessorRequest(), *, spec: PrefillSpec) -> DecodeState:
    """Run the prompts (right-padded i32[P, W], true lengths i32[P]), sample each row's first token and
    initialise the proposer and the processors.

    `rows` (each row's sampling and limits) and the arrays of `processors` (`jaxspec.processors`: log-probabilities,
    penalties, constraints) have B rows: P, or P * G with `spec.group_size` G > 1, where the group's rows sample
    their first tokens with their own seeds. A constrained row's first token is drawn from the masked
    distribution; penalties apply only with `processors.track_counts`.

    Padding tokens write K/V past a row's length; the length never covers them, so they are overwritten.
    """
    model = nnx.merge(graphdef, params)
    proposer, group_size = spec.proposer, spec.group_size
    num_prompts, width = prompts.shape
    cache = model.new_cache(num_prompts, spec.cache_len)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (num_prompts, width))
    # Prefill keeps the XLA attention: the kernel is built for the few new tokens of a verification step.
    layers = feature_layers(proposer)
    packing = {}
    if spec.packed is not None and getattr(model, "packs_prefill", False):
        packing["packing"] = Packing.of(prompt_lens, width, spec.packed)
    out, cache = model(prompts, positions, cache, logits_at=(prompt_lens - 1)[:, None], attention_impl="xla",
                       cached_slots=0, **packing, **layer_request(layers))
    # (the features cover every prompt position: EAGLE and Medusa heads start from them)
    logits, hidden = out.logits, target_features(out, layers)
    if group_size > 1:  # one forward per prompt, its cache and outputs copied into the group's rows
        logits, hidden, prompts, prompt_lens, cache = jax.tree.map(
            lambda x: jnp.repeat(x, group_size, axis=0), (logits, hidden, prompts, prompt_lens, cache))
    batch = prompts.shape[0]
    cache = cache.advance(prompt_lens)
    sampling, limits = rows.sampling, rows.limits
    procs = processors.start(prompts, prompt_lens, logits.shape[-1], width + spec.buffer_len)
    # The first token's position has seen the prompt and no output.
    adjusted = procs.adjust(logits, jnp.zeros((batch, 1), jnp.int32), sampling, limits.stop_ids)  # f32[B, 1, V]
    first = sample(row_keys(sampling.seed, cache.lengths), adjusted[:, 0], sampling)
    everyone = jnp.ones((batch,), bool)
    scored = procs.read(everyone, lambda: (logits, adjusted), first[:, None], sampling)
    procs = procs.commit(first[:, None], jnp.ones((batch,), jnp.int32), prompt_lens[:, None], scored)
    history = jnp.zeros((batch, width + spec.buffer_len), jnp.int32).at[:, :width].set(prompts)
    history = history.at[jnp.arange(batch), prompt_lens].set(first)
    done = _is_stop(first, limits) | (limits.max_new_tokens <= 1)
    state = DecodeState(cache=cache, history=history, history_len=prompt_lens + 1, prompt_len=prompt_lens,
                        from_draft=jnp.zeros(history.shape, bool), done=done, steps=jnp.zeros((), jnp.int32), pstate=(),
                        counters=SpecCounters.zeros(batch, proposer.num_speculative_tokens, spec.buffer_len))
    state = state.with_processors(procs)
    ctx = _context(state, rows, proposer.num_speculative_tokens)
    if proposer.needs_features:
        ctx = ctx.replace(features=hidden)
    return pinned(state.replace(pstate=proposer.init(proposer_params, ctx)))


def pinned(state: DecodeState) -> DecodeState:
    """The state with its rows pinned to the mesh's batch axis and the cache's KV heads to its heads axis
    (`jaxspec.sharding.use_rules`), so the loop carries one layout from step to step; unchanged without a mesh."""
    if sharding.active() is None:
        return state
    batch = state.history.shape[0]

    def heads(x):  # [B, Hkv, S, hd], or stacked [B, L, Hkv, S, hd]
        return sharding.constrain(x, "batch", *([None] * (x.ndim - 4)), "heads", None, None)

    cache = state.cache
    cache = cache.replace(k=jax.tree.map(heads, cache.k), v=jax.tree.map(heads, cache.v),
                          lengths=sharding.constrain(cache.lengths, "batch"))
    return sharding.constrain_rows(state.replace(cache=None), batch).replace(cache=cache)


def _replace_out_of_vocab(draft: Draft, vocab: int) -> tuple[Draft, jax.Array]:
    """The draft with every token outside [0, vocab) replaced by OOV_DRAFT_PLACEHOLDER, and bool[B, K] which
    tokens were inside it. Proposers are pluggable (a custom one, a static corpus): nothing they return may
    reach the target's embedding lookup out of range."""
    tokens = draft.tokens.astype(jnp.int32)  # i32[B, K]
    in_vocab = (tokens >= 0) & (tokens < vocab)  # bool[B, K]
    return draft.replace(tokens=jnp.where(in_vocab, tokens, OOV_DRAFT_PLACEHOLDER)), in_vocab


def _num_draft(draft: Draft, in_vocab: jax.Array, max_draft: jax.Array, k: int) -> jax.Array:
    """i32[B] drafts to score: a chain's are its depth, cut at the row's max_draft and at its first
    out-of-vocabulary token; a tree's are nodes, bounded by the node count (out-of-vocabulary ones are marked
    invalid instead), its depth by max_draft at verification."""
    proposed = jnp.clip(draft.num_draft, 0, k).astype(jnp.int32)  # i32[B]
    if draft.parents is not None:
        return jnp.where(max_draft > 0, proposed, 0)
    leading_in_vocab = jnp.sum(jnp.cumprod(in_vocab.astype(jnp.int32), axis=1), axis=1)  # i32[B]
    return jnp.minimum(jnp.minimum(proposed, max_draft), leading_in_vocab)


def _draft_depth(num_draft: jax.Array, node_depth: jax.Array | None, max_draft: jax.Array, k: int) -> jax.Array:
    """i32[B] the deepest draft position scored: a chain's draft count; a tree's deepest scored node, within
    the row's max_draft."""
    if node_depth is None:
        return num_draft
    scored = jnp.arange(k) < num_draft[:, None]  # bool[B, K]
    return jnp.minimum(jnp.max(jnp.where(scored, node_depth[:, 1:], 0), axis=1), max_draft)


def _width_choice(widths: tuple[int, ...], num_draft: jax.Array, state: DecodeState, draft: Draft,
                  limits: RowLimits, verify_cost: jax.Array | None) -> jax.Array:
    """i32[] index of this step's verify width. By default the narrowest width holding the batch's longest
    draft, so a step where nobody drafts costs one plain step, not c(K+1) of them; with a measured cost table
    (chains, and trees that rank their nodes) the width maximising the expected tokens of the rows furthest
    from their end per unit of cost (`jaxspec.cost`)."""
    unranked_tree = draft.parents is not None and draft.confidence is None  # scored whole
    if verify_cost is None or len(widths) == 1 or unranked_tree:
        return cost.narrowest_holding(widths, num_draft)
    behind = cost.furthest_behind(limits.max_new_tokens - state.num_generated, ~state.done)  # bool[B]
    if draft.parents is not None:
        return cost.choose_tree_width(widths, verify_cost, num_draft, draft.confidence, behind)
    rate = cost.optimistic_rate(state.counters.accepted, state.counters.drafted)  # f32[B]
    return cost.choose_width(widths, verify_cost, num_draft, rate, behind)


def commit(state: DecodeState, verified: Verified, limits: RowLimits) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Append each active row's output tokens up to and including its first stop token and within its budget,
    advance its cache over them and mark the rows that finished.

    Returns (the new state, its counters and proposer state untouched; tokens kept i32[B]; accepted drafts
    among them i32[B]). The newest token joins the cache with every kept token but the last, which becomes
    the new newest token; a rejected draft's K/V stays past the length, where the next step overwrites it.
    """
    batch, k1 = verified.tokens.shape
    active = ~state.done
    j = jnp.arange(k1)
    is_stop = _is_stop(verified.tokens, limits) & (j < verified.num[:, None])  # bool[B, K+1]
    stop_at = jnp.min(jnp.where(is_stop, j, k1), axis=1)  # i32[B], K+1 where no stop token
    room = limits.max_new_tokens - state.num_generated
    keep = jnp.where(active, jnp.minimum(jnp.minimum(verified.num, stop_at + 1), room), 0)  # i32[B]
    kept = j < keep[:, None]  # bool[B, K+1]
    # Output token j is an accepted draft for j < accepted; the target's own token follows them (unless a stop
    # token or the budget cut the run before it).
    accepted = jnp.where(active, jnp.minimum(verified.num - 1, keep), 0)  # i32[B]
    rows = jnp.arange(batch)[:, None]
    slots = jnp.where(kept, state.history_len[:, None] + j, state.history.shape[1])  # out of bounds: dropped
    history_len = state.history_len + keep
    finished = jnp.any(is_stop & kept, axis=1) | (history_len - state.prompt_len >= limits.max_new_tokens)
    processors = state.processors.commit(verified.tokens, keep, slots, verified.logprobs)
    new = state.replace(
        cache=verified.cache.advance(keep),
        history=state.history.at[rows, slots].set(verified.tokens, mode="drop"),
        history_len=history_len,
        from_draft=state.from_draft.at[rows, slots].set(j < accepted[:, None], mode="drop"),
        done=state.done | (active & finished),
        steps=state.steps + 1).with_processors(processors)
    return new, keep, accepted


def propose_once(proposer: Proposer, proposer_params, state: DecodeState, rows: RowParams):
    """What `proposer.propose` returns at `state`, called with the context and keys `spec_step` gives it.

    Nothing is scored or committed. For inspecting drafts, and for checking a proposer's output shapes with
    `jax.eval_shape` before anything compiles. Returns propose's result as is: (Draft, new proposer state).
    """
    ctx = _context(state, rows, proposer.num_speculative_tokens)
    return proposer.propose(proposer_params, state.pstate, ctx, row_keys(rows.sampling.seed, state.cache.lengths))


def spec_step(model, step: StepSpec, proposer_params, state: DecodeState, rows: RowParams,
              verify_cost: jax.Array | None = None) -> DecodeState:
    """Propose, score, verify, commit: one step for every row (finished rows ride along and commit nothing).

    `model` is the merged target module (`lm.module`, or `nnx.merge(lm.graphdef, lm.params)` inside jit);
    `step` the proposer, verify widths and attention (`Prepared.step`); `rows` each row's sampling and limits
    (`Prepared.rows`); `verify_cost` f32[len(widths)] the
    measured cost of each width (`Prepared.verify_cost`), or None for the narrowest width holding the drafts.
    Not jitted itself: call it inside your own jitted function or loop. Returns the new state.
    """
    proposer, widths = step.proposer, step.widths
    k = proposer.num_speculative_tokens
    ctx = _context(state, rows, k)
    draft, pstate = proposer.propose(proposer_params, state.pstate, ctx,
                                     row_keys(rows.sampling.seed, state.cache.lengths))
    draft, in_vocab = _replace_out_of_vocab(draft, model.cfg.vocab_size)
    num_draft = _num_draft(draft, in_vocab, ctx.max_draft, k)  # i32[B]
    node_depth = None if draft.parents is None else depths(draft.parents)  # i32[B, K+1], the root included
    choice = _width_choice(widths, num_draft, state, draft, rows.limits, verify_cost)
    num_draft = jnp.minimum(num_draft, jnp.asarray(widths, jnp.int32)[choice] - 1)  # drafts past it wait

    drafts = Drafts(draft=draft, num=num_draft, in_vocab=in_vocab, node_depth=node_depth, max_draft=ctx.max_draft)
    verified = verify(Scoring.of(model, proposer, widths, step.attention_impl), state, drafts, rows, widths, choice)
    new, keep, accepted = commit(state, verified, rows.limits)
    counters = state.counters.record(~state.done, num_draft, _draft_depth(num_draft, node_depth, ctx.max_draft, k),
                                     accepted, keep)
    new = new.replace(counters=counters)

    kept = jnp.arange(k + 1) < keep[:, None]  # bool[B, K+1]
    committed = Committed(tokens=jnp.where(kept, verified.tokens, -1), num=keep, features=verified.features)
    return new.replace(pstate=proposer.update(proposer_params, pstate, _context(new, rows, k), committed))


def _loop(model, state: DecodeState, rows: RowParams, proposer_params, step: StepSpec, last_step: jax.Array,
          verify_cost: jax.Array | None) -> DecodeState:
    """Steps until every row is done or the loop's step counter reaches `last_step`."""
    def cond(s: DecodeState):
        return ~jnp.all(s.done) & (s.steps < last_step)

    def body(s: DecodeState):
        return pinned(spec_step(model, step, proposer_params, s, rows, verify_cost))

    return jax.lax.while_loop(cond, body, pinned(state))


@functools.partial(jax.jit, static_argnames=("graphdef", "step"), donate_argnames=("state",))
def decode(graphdef, params, state: DecodeState, rows: RowParams, proposer_params=None, *,
           step: StepSpec = StepSpec(), verify_cost: jax.Array | None = None) -> DecodeState:
    """Decode until every row is done, as one `lax.while_loop` on the device; returns the final state.

    `state` is donated: its buffers are reused for the result, so do not read the state you passed in.
    `step` is the proposer, verify widths and attention; `verify_cost` (f32[len(widths)], `jaxspec.cost`) makes
    each step's width cost-aware.
    """
    max_steps = state.counters.committed.shape[1]
    return _loop(nnx.merge(graphdef, params), state, rows, proposer_params, step, jnp.asarray(max_steps, jnp.int32),
                 verify_cost)


@functools.partial(jax.jit, static_argnames=("graphdef", "step", "num_steps"), donate_argnames=("state",))
def decode_chunk(graphdef, params, state: DecodeState, rows: RowParams, proposer_params=None, *,
                 step: StepSpec = StepSpec(), num_steps: int, verify_cost: jax.Array | None = None) -> DecodeState:
    """At most `num_steps` more steps, fewer once every row is done: the serving engine's unit of work.

    Between chunks the host streams what rows committed, admits requests into free rows and retires finished
    ones; the state (cache, histories, proposer state) stays on the device and is updated in place.
    """
    return _loop(nnx.merge(graphdef, params), state, rows, proposer_params, step, state.steps + num_steps,
                 verify_cost)
