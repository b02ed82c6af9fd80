"""Predicted outputs (speculative edits): draft from a text the output is expected to mostly repeat.

A request may carry a `prediction` (OpenAI's Predicted Outputs), typically the code file being edited: most of
the output copies it. Each row keeps a cursor into its prediction, the index of the prediction token expected
to follow the row's newest token, and drafts prediction[cursor : cursor + n] with
n = min(K, max_draft, tokens left in the prediction), so K can be large (16-64): a long run of accepted
drafts costs one target forward.

- Start: after prefill the row's output holds one token; if it equals prediction[0] the cursor is 1, else 0
  (the first step proposes the prediction's start).
- In sync: after each step the cursor moves over the committed tokens that equal the prediction at the
  cursor (the accepted drafts, and the target's own token when it continues the prediction too).
- Out of sync: a committed token that differs from the prediction (the edit) leaves the cursor at the
  differing position. Each later step tries to re-synchronise by finding the row's newest output n-gram (its
  last `ngram` output tokens, then shorter ones down to `min_match`) in the prediction at or after the
  cursor; the first occurrence of the longest matching n-gram puts the cursor just after it. Only where no
  n-gram occurs there, the last occurrence before the cursor does: in an output that repeats itself a re-sync
  can land a period ahead, and the cursor would otherwise reach the prediction's end with periods of output
  to go (measured: a HumanEval completion that lists similar calls committed one token a step for its last
  79 tokens with its own text as the prediction). No match: the row drafts nothing from the prediction this step (the
  cursor stays) and tries again with newer n-grams.
  The first draft from a prediction, and the first after each re-sync, is a probe of at most `probe` tokens;
  once a draft is accepted whole, drafts take up to K. An output that meets an unrelated prediction by chance
  (a first token, a common n-gram) then costs a narrow verify, and a right prediction one step more.

Rows without a prediction (length 0), out-of-sync rows with no match, and rows whose prediction is used up
take the draft of an optional inner proposer (a deterministic chain proposer: n-gram, suffix automaton), or
draft nothing. Every draft is deterministic (Draft.probs and parents None).

Per row the state counts `accepted` and `rejected` prediction tokens (OpenAI's usage fields): of the
`drafted` tokens a step took from the prediction, accepted is the leading run of committed tokens equal to
them, rejected the rest. An accepted draft equals its committed token and a rejected one never equals the
token the target emits in its place, so leading matches count exactly; they stay honest when `spec_step`
scores fewer drafts than proposed (a verify width cap): unscored drafts count as rejected unless the target's
own token happens to continue the prediction.

The prediction is installed after `prefill` with `with_prediction` (init leaves every row without one):

    state = jaxspec.prefill(...)
    tokens, lengths = pad_predictions(predictions, proposer.max_prediction_len)
    state = state.replace(pstate=with_prediction(state.pstate, tokens, lengths, state.history,
                                                 state.history_len, state.prompt_len))
    state = jaxspec.decode(...)

`params` of this proposer are the inner proposer's params (None without one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .base import ChainProposer, Committed, Context, Draft, Proposer


@flax.struct.dataclass
class PredictionState:
    """Per-row state; every array leads with the batch dim B, so the engine can move rows by indexing it."""

    tokens: jax.Array  # i32[B, L]  each row's prediction (garbage past `length`)
    length: jax.Array  # i32[B]  prediction length; 0: the row has none
    cursor: jax.Array  # i32[B]  index of the prediction token expected after the row's newest token
    # bool[B] the cursor follows the output (False after a mismatch, until an n-gram re-synchronises it)
    synced: jax.Array
    drafted: jax.Array  # i32[B]  prediction tokens proposed this step (set by propose, read by update)
    accepted: jax.Array  # i32[B]  prediction tokens accepted so far
    rejected: jax.Array  # i32[B]  prediction tokens proposed and not accepted so far
    # i32[B] where the row's output starts in the history: Context has no prompt length, and the re-sync
    # n-gram must lie in the output (a prompt quoting the prediction would otherwise match across the boundary)
    prompt_len: jax.Array
    inner: Any  # the inner proposer's state, () without one
    # i32[B] the shortest output n-gram that may re-synchronise the row: min_match, doubled (up to ngram) each
    # time a prediction draft is rejected outright, back to min_match when one is accepted. In a prediction
    # that does not fit the output, short n-grams match by chance and every false draft costs a wide verify.
    need: jax.Array | None = None
    # bool[B] the row's last prediction draft was accepted whole: its next may take K tokens, else `probe`. False
    # from the start and after each re-sync, so an output that meets the prediction by chance (a first token or
    # an n-gram an unrelated prediction shares with it: `return result`) costs a narrow verify, not a K + 1 wide
    # one.
    proven: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PredictionProposer(ChainProposer):
    """Drafts from each row's prediction after a cursor; `inner` drafts for rows the prediction cannot serve.

    params: the inner proposer's params (None without one). Install predictions with `with_prediction`.
    """

    num_speculative_tokens: int  # K, the most drafts per step (large values pay off: 16-64)
    max_prediction_len: int  # L, the prediction buffer's width (static: part of the state's shape)
    ngram: int = 4  # re-sync tries the last `ngram` output tokens first ...
    min_match: int = 2  # ... down to `min_match` tokens; shorter suffixes never re-synchronise
    inner: Proposer | None = None  # a deterministic chain proposer with K' <= K (drafts padded to K), or None
    probe: int = 8  # the first draft from a prediction, and after each re-sync, takes at most this many tokens

    def __post_init__(self):
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer >= 1")
        if isinstance(self.max_prediction_len, bool) or not isinstance(self.max_prediction_len, int) \
                or self.max_prediction_len < 1:
            raise ValueError(f"max_prediction_len={self.max_prediction_len!r} must be an integer >= 1")
        if isinstance(self.min_match, bool) or not isinstance(self.min_match, int) or self.min_match < 1:
            raise ValueError(f"min_match={self.min_match!r} must be an integer >= 1")
        if isinstance(self.ngram, bool) or not isinstance(self.ngram, int) or self.ngram < self.min_match:
            raise ValueError(f"ngram={self.ngram!r} must be an integer >= min_match={self.min_match!r}")
        if isinstance(self.probe, bool) or not isinstance(self.probe, int) or self.probe < 1:
            raise ValueError(f"probe={self.probe!r} must be an integer >= 1")
        inner = self.inner
        if inner is None:
            return
        if not isinstance(inner, Proposer):
            raise ValueError(f"inner={inner!r} is not a Proposer (jaxspec.proposers.base.Proposer)")
        inner_k = inner.num_speculative_tokens
        if isinstance(inner_k, bool) or not isinstance(inner_k, int) or not 0 <= inner_k <= k:
            raise ValueError(f"inner has num_speculative_tokens={inner_k!r}; it must be an integer in [0, {k}] "
                             f"(this proposer's num_speculative_tokens): its drafts are padded to K")
        if inner.needs_features:
            raise ValueError(f"inner={type(inner).__name__} reads the target's features; the inner proposer must "
                             "draft from tokens alone (a chain proposer such as NgramProposer or SamProposer)")
        if inner.max_depth != inner_k:
            raise ValueError(f"inner has max_depth={inner.max_depth!r}: it must draft chains "
                             f"(max_depth == its num_speculative_tokens={inner_k}), not trees")

    def init(self, params, ctx: Context) -> PredictionState:
        """Every row without a prediction (`with_prediction` installs them); the inner proposer's state."""
        batch = ctx.history.shape[0]

        def zeros():  # one array per field: the decode loop donates the state, so no two fields share a buffer
            return jnp.zeros((batch,), jnp.int32)

        return PredictionState(
            tokens=jnp.zeros((batch, self.max_prediction_len), jnp.int32), length=zeros(), cursor=zeros(),
            synced=jnp.ones((batch,), bool), drafted=zeros(), accepted=zeros(), rejected=zeros(),
            need=jnp.full((batch,), self.min_match, jnp.int32), proven=jnp.zeros((batch,), bool),
            # Right after prefill the newest token is the first generated one: the prompt is everything before.
            prompt_len=(ctx.history_len - 1).astype(jnp.int32),
            inner=() if self.inner is None else self.inner.init(params, ctx))

    def _resync(self, pstate: PredictionState, ctx: Context, retry: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(cursor i32[B], found bool[B]): for rows in `retry` (bool[B]), the index just after the first
        occurrence, at or after the cursor, of the longest output suffix of `min_match`..`ngram` tokens found
        in the prediction there; with none there, just after its last occurrence before the cursor. Other rows
        (and rows with no match) keep their cursor, found False."""
        pred, length, cursor = pstate.tokens, pstate.length, pstate.cursor  # i32[B, L], i32[B], i32[B]
        hist, hist_len = ctx.history, ctx.history_len  # i32[B, H], i32[B]
        width = pred.shape[1]
        out_len = hist_len - pstate.prompt_len  # i32[B]  output tokens so far

        def search():
            ahead, found_ahead = cursor, jnp.zeros_like(retry)  # the first occurrence at or after the cursor
            behind, found_behind = cursor, jnp.zeros_like(retry)  # the last one before it
            # Shorter n-grams first so that longer ones, when they match, overwrite them.
            for n in range(self.min_match, self.ngram + 1):
                if n > width:
                    break
                suffix = jnp.take_along_axis(hist, jnp.maximum(hist_len[:, None] - n + jnp.arange(n), 0),
                                             axis=1)  # i32[B, n]
                num_windows = width - n + 1
                hits = jnp.ones((pred.shape[0], num_windows), bool)  # window i covers pred[i : i + n]
                for t in range(n):
                    hits &= pred[:, t: t + num_windows] == suffix[:, t: t + 1]
                i = jnp.arange(num_windows)
                hits &= (n >= pstate.need)[:, None]  # long enough for the row's recent record
                hits &= ((i + n <= length[:, None])  # inside the prediction
                         & (out_len[:, None] >= n) & retry[:, None])  # the n-gram lies in the output
                first = jnp.min(jnp.where(hits & (i >= cursor[:, None]), i, width), axis=1)  # i32[B], width: none
                last = jnp.max(jnp.where(hits & (i < cursor[:, None]), i, -1), axis=1)  # i32[B], -1: none
                ahead = jnp.where(first < width, first + n, ahead)
                found_ahead |= first < width
                behind = jnp.where(last >= 0, last + n, behind)
                found_behind |= last >= 0
            # Behind the cursor only when nothing lies ahead: in a text that repeats itself (a list of similar
            # lines), a re-sync can land a period ahead of the output, and the cursor then reaches the
            # prediction's end while the output still has periods to go.
            return jnp.where(found_ahead, ahead, behind), found_ahead | found_behind

        # The search scans the whole prediction per n-gram length: skip it on steps where every row is in sync.
        return jax.lax.cond(jnp.any(retry), search, lambda: (cursor, jnp.zeros_like(retry)))

    def propose(self, params, pstate: PredictionState, ctx: Context, keys: jax.Array
                ) -> tuple[Draft, PredictionState]:
        """The prediction's next tokens for rows in sync (after re-synchronising the others), else the inner
        proposer's draft."""
        k = self.num_speculative_tokens
        pred, length = pstate.tokens, pstate.length  # i32[B, L], i32[B]
        batch, width = pred.shape
        active = jnp.ones((batch,), bool) if ctx.active is None else ctx.active
        retry = ~pstate.synced & (length > 0) & active  # bool[B]
        found_cursor, found = self._resync(pstate, ctx, retry)
        cursor = jnp.where(found, found_cursor, pstate.cursor)  # i32[B]
        synced = pstate.synced | found
        proven = pstate.proven & ~found  # bool[B]
        left = jnp.maximum(length - cursor, 0)  # i32[B]  prediction tokens after the cursor
        most = jnp.minimum(jnp.minimum(left, ctx.max_draft), jnp.where(proven, k, min(self.probe, k)))  # i32[B]
        pred_num = jnp.where(synced & active, jnp.clip(most, 0), 0)
        pred_num = pred_num.astype(jnp.int32)  # i32[B]
        pred_tokens = jnp.take_along_axis(pred, jnp.minimum(cursor[:, None] + jnp.arange(k), width - 1),
                                          axis=1)  # i32[B, K]
        tokens, num_draft, inner_state = pred_tokens, pred_num, pstate.inner
        if self.inner is not None:
            # The inner proposer runs for every row each step, so its state stays in step with the history.
            d, inner_state = self.inner.propose(params, pstate.inner, ctx, keys)
            if d.probs is not None or d.parents is not None:
                raise ValueError(f"inner={type(self.inner).__name__} drafts with a distribution or a tree; the "
                                 "inner proposer must draft deterministic chains (Draft.probs and parents None)")
            use_pred = pred_num > 0  # bool[B]
            inner_tokens = jnp.pad(d.tokens.astype(jnp.int32), ((0, 0), (0, k - d.tokens.shape[1])))  # i32[B, K]
            tokens = jnp.where(use_pred[:, None], pred_tokens, inner_tokens)
            inner_num = jnp.clip(jnp.minimum(d.num_draft, ctx.max_draft), 0, k).astype(jnp.int32)
            num_draft = jnp.where(use_pred, pred_num, inner_num)
        new = pstate.replace(cursor=cursor, synced=synced, drafted=pred_num, proven=proven, inner=inner_state)
        return Draft(tokens=tokens.astype(jnp.int32), num_draft=num_draft), new

    def update(self, params, pstate: PredictionState, ctx: Context, committed: Committed) -> PredictionState:
        """Move each in-sync row's cursor over the committed tokens that follow the prediction, count the step's
        accepted and rejected prediction drafts, and update the inner proposer."""
        pred, length, cursor = pstate.tokens, pstate.length, pstate.cursor  # i32[B, L], i32[B], i32[B]
        width = pred.shape[1]
        tokens, num = committed.tokens.astype(jnp.int32), committed.num.astype(jnp.int32)  # i32[B, K+1], i32[B]
        j = jnp.arange(tokens.shape[1])
        at = cursor[:, None] + j  # i32[B, K+1]  the prediction index each committed token should equal
        expected = jnp.take_along_axis(pred, jnp.minimum(at, width - 1), axis=1)
        same = (tokens == expected) & (at < length[:, None]) & (j < num[:, None])  # bool[B, K+1]
        run = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=1), axis=1)  # i32[B]  leading matches
        tracking = pstate.synced & (length > 0)
        # `drafted` is 0 unless the row drafted from the prediction, and a finished row commits nothing (num 0):
        # rows that drafted nothing from the prediction count nothing.
        accepted = jnp.minimum(run, pstate.drafted)
        rejected = pstate.drafted - accepted
        inner = pstate.inner if self.inner is None else self.inner.update(params, pstate.inner, ctx, committed)
        return pstate.replace(
            cursor=jnp.where(tracking, cursor + run, cursor),
            # A committed token off the prediction leaves the cursor at the mismatch: propose re-syncs from it.
            synced=pstate.synced & (run == num),
            drafted=jnp.zeros_like(pstate.drafted),
            accepted=pstate.accepted + accepted, rejected=pstate.rejected + rejected, inner=inner,
            need=jnp.where(accepted > 0, self.min_match,
                           jnp.where(pstate.drafted > 0, jnp.minimum(2 * pstate.need, self.ngram), pstate.need)),
            proven=jnp.where(pstate.drafted > 0, accepted == pstate.drafted, pstate.proven))


def with_prediction(pstate: PredictionState, tokens, lengths, history, history_len, prompt_len, *,
                    trust_start: bool = True) -> PredictionState:
    """The state with each row's prediction installed (pure, jittable): tokens i32[B, L'] (L' <= L, padded to
    the state's L), lengths i32[B] (0: no prediction; clipped to L' under jit, checked otherwise), and the
    cursor set from the row's output so far, history[b, prompt_len[b]:history_len[b]] (after prefill: the first
    generated token).

    An output that is a prefix of the prediction puts the cursor after it; a single token that is not makes the
    first step propose the prediction's start (cursor 0) with `trust_start`, or starts out of sync without it
    (`generate` and the engine: an unrelated prediction then costs nothing until an output n-gram matches it,
    where a first draft of K prediction tokens would cost a wide verify); a longer output that left the
    prediction starts out of sync at its last matching position, and propose re-synchronises by n-gram. The
    counters start at 0; the inner proposer's state is kept.
    """
    batch, width = pstate.tokens.shape
    tokens = jnp.asarray(tokens).astype(jnp.int32)
    if tokens.ndim != 2 or tokens.shape[0] != batch or tokens.shape[1] > width:
        raise ValueError(f"tokens has shape {tokens.shape}; expected [B, L'] with B={batch} and L' <= "
                         f"max_prediction_len={width} (pad_predictions builds it)")
    if not isinstance(lengths, jax.core.Tracer):
        host = np.asarray(lengths)
        if host.shape != (batch,):
            raise ValueError(f"lengths has shape {host.shape}; expected ({batch},)")
        bad = np.flatnonzero((host < 0) | (host > tokens.shape[1]))
        if bad.size:
            raise ValueError(f"lengths[{bad[0]}]={host[bad[0]]} must be in [0, {tokens.shape[1]}]")
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, tokens.shape[1])  # i32[B]
    tokens = jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))  # i32[B, L]
    history = jnp.asarray(history, jnp.int32)  # i32[B, H]
    history_len, prompt_len = jnp.asarray(history_len, jnp.int32), jnp.asarray(prompt_len, jnp.int32)
    out_len = history_len - prompt_len  # i32[B]
    j = jnp.arange(width)
    output = jnp.take_along_axis(history, jnp.minimum(prompt_len[:, None] + j, history.shape[1] - 1),
                                 axis=1)  # i32[B, L]  the output's first L tokens
    same = (output == tokens) & (j < out_len[:, None]) & (j < lengths[:, None])  # bool[B, L]
    run = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # i32[B]
    # Fresh buffers for every field: `decode` donates the whole state, and one buffer held twice (a shared
    # zeros, the DecodeState's own prompt_len called eagerly) fails as a double donation.
    return pstate.replace(tokens=jnp.array(tokens, copy=True), length=lengths, cursor=run,
                          synced=(run == out_len) | ((out_len <= 1) & trust_start),
                          drafted=jnp.zeros((batch,), jnp.int32),
                          accepted=jnp.zeros((batch,), jnp.int32), rejected=jnp.zeros((batch,), jnp.int32),
                          prompt_len=jnp.array(prompt_len, copy=True),
                          proven=jnp.zeros((batch,), bool))


def pad_predictions(predictions: Sequence[Sequence[int] | None], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Host helper: (i32[B, max_len] the predictions right-padded with 0, i32[B] their lengths) from one token
    list per row (empty or None: no prediction). ValueError naming the first row that is not a 1-D list of
    integers or is longer than max_len."""
    table = np.zeros((len(predictions), max_len), np.int32)
    lengths = np.zeros((len(predictions),), np.int32)
    for i, row in enumerate(predictions):
        arr = np.asarray([] if row is None else row)
        if arr.size == 0:
            continue
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"prediction {i} must be a 1-D sequence of token ids; got dtype {arr.dtype}, "
                             f"shape {arr.shape}")
        if arr.size > max_len:
            raise ValueError(f"prediction {i} has {arr.size} tokens; max_prediction_len={max_len} holds at most "
                             f"{max_len}")
        table[i, : arr.size] = arr
        lengths[i] = arr.size
    return table, lengths
