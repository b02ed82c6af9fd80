"""Log-probabilities of given sequences under the model: what an RL loss or an evaluation reads.

`score(lm, token_ids, ...)` runs the target's own forward (the `jaxspec.target.TargetModel` contract, called as
prefill calls it: positions 0..T-1, a fresh cache of T slots, `cached_slots=0`) once over whole rows of tokens,
and returns, at every position t, the log-probability of token t given the tokens before it. It is the
teacher-forced counterpart of `generate(..., logprobs=L)`: the same log-softmax (`jaxspec.logprobs.score`) of the
same logits, computed in one forward instead of one decode step at a time.

`score_arrays` is the pure function underneath, over (graphdef, params, arrays) with the settings that shape
the program static: it can be jitted, vmapped and differentiated with respect to `params` (a policy-gradient
loss is `-sum(advantage * score_arrays(...).logprobs)`). `score` checks its arguments, raising a ValueError
naming the bad value, and calls a jitted `score_arrays`; other weights of the model's shapes (`params=`) reuse
the compiled program.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import logprobs as lp
from .generation import _host
from .models.loading import LanguageModel
from .rollouts.inputs import check_params
from .validation import is_integer, short_repr


@flax.struct.dataclass
class ScoreResult:
    """Per-position log-probabilities of B rows of T tokens (a pytree: it passes through jit and grad).

    Position t of row b is scored when `mask[b, t]`: it lies in the row (t < its length), after its prompt
    (t >= its prompt length) and is not position 0, which has no context to be predicted from. Every other
    position holds 0 in `logprobs`, `top_ids`, `top_logprobs` and `ranks` (never NaN), so sums over a row and
    gradients of them need no further masking.
    """

    logprobs: jax.Array  # f32[B, T]  log p(token_ids[b, t] | token_ids[b, :t]) under softmax(logits / temperature)
    mask: jax.Array  # bool[B, T]  the scored positions
    top_ids: jax.Array  # i32[B, T, K]  the K = top_logprobs most likely tokens at position t, most likely first
    top_logprobs: jax.Array  # f32[B, T, K]  their log-probabilities
    ranks: jax.Array  # i32[B, T]  1 + the number of tokens more likely than token_ids[b, t] at position t


def score_arrays(graphdef, params, tokens: jax.Array, lengths: jax.Array, prompt_lens: jax.Array,
                 temperature: float | jax.Array = 1.0, *, top_logprobs: int = 0,
                 max_scored: int | None = None) -> ScoreResult:
    """The log-probability of every token of `tokens` i32[B, T] given the tokens before it, from one forward.

    Row b holds `lengths[b]` tokens (i32[B]) and then padding, which is replaced by token 0 before the forward:
    attention is causal, so padding on the right never reaches a real token. Positions t with
    `max(prompt_lens[b], 1) <= t < lengths[b]` are scored (`ScoreResult.mask`). The log-probabilities are the
    log-softmax of logits / `temperature` (1.0: the model's raw distribution; a float or an f32 scalar, traced).

    `top_logprobs` (static) also returns the K most likely tokens at each scored position. `max_scored` (static)
    computes logits at only that many positions per row, from the row's first scored position on: a long prompt
    then costs no LM head and no log-softmax over the vocabulary. Positions past the first scored one + max_scored
    are not scored (`mask` False): a caller whose rows score more must pass a larger bound (`score` checks).

    Pure in (graphdef, params, arrays): jit it with graphdef, top_logprobs and max_scored static, and
    differentiate it with respect to params (the shipped Llama's CPU matmul kernel gives XLA its derivatives).
    """
    model = nnx.merge(graphdef, params)
    batch, width = tokens.shape
    t = jnp.arange(width, dtype=jnp.int32)  # i32[T]
    lengths = jnp.asarray(lengths, jnp.int32)
    start = jnp.maximum(jnp.asarray(prompt_lens, jnp.int32), 1)  # i32[B] the first scored position
    tokens = jnp.where(t[None, :] < lengths[:, None], tokens, 0).astype(jnp.int32)  # i32[B, T]
    num = width - 1 if max_scored is None else min(int(max_scored), width - 1)  # W logit positions per row
    # Without a bound every row scores from position 1 (logits at 0..T-2); with one, from its first scored position.
    first = jnp.ones_like(start) if max_scored is None else start  # i32[B]
    scored_at = first[:, None] + jnp.arange(num, dtype=jnp.int32)  # i32[B, W] the positions scored
    mask_w = (scored_at >= start[:, None]) & (scored_at < lengths[:, None])  # bool[B, W]
    rows = jnp.arange(batch)[:, None]
    if num == 0:  # rows of one token: nothing has context
        return ScoreResult(logprobs=jnp.zeros((batch, width), jnp.float32), mask=jnp.zeros((batch, width), bool),
                           top_ids=jnp.zeros((batch, width, top_logprobs), jnp.int32),
                           top_logprobs=jnp.zeros((batch, width, top_logprobs), jnp.float32),
                           ranks=jnp.zeros((batch, width), jnp.int32))
    positions = jnp.broadcast_to(t, (batch, width))  # i32[B, T]
    # The logits at position p - 1 predict token p; a position past the row's end reads the last slot (masked).
    logits_at = jnp.minimum(scored_at - 1, width - 1)  # i32[B, W]
    out, _ = model(tokens, positions, model.new_cache(batch, width), logits_at=logits_at, attention_impl="xla",
                   cached_slots=0)
    logits = out.logits.astype(jnp.float32) / temperature  # f32[B, W, V]
    targets = jnp.take_along_axis(tokens, jnp.minimum(scored_at, width - 1), axis=1)  # i32[B, W]
    scored = lp.score(logits, targets, top_logprobs)
    # A token's rank in the vocabulary (vLLM's `rank`): 1 + the tokens with a larger logit (ties share a rank).
    chosen = jnp.take_along_axis(logits, targets[..., None], axis=-1)  # f32[B, W, 1]
    ranks = 1 + jnp.sum(logits > chosen, axis=-1, dtype=jnp.int32)  # i32[B, W]

    def place(values):  # [B, W, ...] -> [B, T, ...]: the values at the scored positions, 0 elsewhere
        keep = mask_w.reshape(mask_w.shape + (1,) * (values.ndim - 2))
        base = jnp.zeros((batch, width) + values.shape[2:], values.dtype)
        return base.at[rows, scored_at].set(jnp.where(keep, values, jnp.zeros((), values.dtype)), mode="drop")

    return ScoreResult(logprobs=place(scored.token), mask=place(mask_w), top_ids=place(scored.top_ids),
                       top_logprobs=place(scored.top), ranks=place(ranks))


# graphdef, top_logprobs and max_scored shape the program; params, arrays and temperature are arguments.
_score_jit = jax.jit(score_arrays, static_argnames=("graphdef", "top_logprobs", "max_scored"))


def _token_array(token_ids) -> np.ndarray:
    """i32[B, T] from an integer array or a rectangular list of token-id lists; ValueError naming the problem."""
    token_ids = _host(token_ids, "token_ids")
    if isinstance(token_ids, (list, tuple)):
        rows = [_host(r, f"token_ids[{i}]") for i, r in enumerate(token_ids)]
        if not rows or not all(isinstance(r, (list, tuple, np.ndarray)) for r in rows):
            raise ValueError(f"token_ids={short_repr(token_ids)} must be a non-empty list of token-id lists or an "
                             f"integer array [B, T]")
        for i, r in enumerate(rows):
            if len(r) != len(rows[0]):
                raise ValueError(f"token_ids is ragged: row {i} has {len(r)} tokens, row 0 has {len(rows[0])}; pad "
                                 f"the rows to one length T and pass lengths= (or mask=)")
            if isinstance(r, np.ndarray) and (r.ndim != 1 or r.dtype.kind not in "iu"):
                raise ValueError(f"token_ids[{i}] is a {r.dtype} array of shape {r.shape}; a row must be 1-D "
                                 f"integer token ids")
            if not isinstance(r, np.ndarray) and not all(is_integer(x) for x in r):
                raise ValueError(f"token_ids[{i}]={short_repr(r)} must hold integer token ids")
        token_ids = np.asarray(rows, np.int64).reshape(len(rows), -1)
    if not isinstance(token_ids, np.ndarray):
        raise ValueError(f"token_ids={short_repr(token_ids)} must be an integer array [B, T] or a list of token-id "
                         f"lists")
    if token_ids.ndim != 2 or token_ids.dtype.kind not in "iu":
        raise ValueError(f"token_ids is a {token_ids.dtype} array of shape {token_ids.shape}; it must be integer "
                         f"token ids [B, T]")
    if 0 in token_ids.shape:
        raise ValueError(f"token_ids has shape {token_ids.shape}: at least one row of at least one token is needed")
    return token_ids


def _row_ints(value, name: str, batch: int, low: int, high: np.ndarray | int) -> np.ndarray:
    """i64[B] from `value` (B integers), each in [low, high] (high: one bound per row or for all)."""
    value = _host(value, name)
    arr = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if arr is None or arr.shape != (batch,) or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name}={short_repr(value)} must be {batch} integers, one per row of token_ids")
    high = np.broadcast_to(np.asarray(high), (batch,))
    for i, (n, hi) in enumerate(zip(arr.tolist(), high.tolist())):
        if not low <= n <= hi:
            raise ValueError(f"{name}[{i}]={n} must be in [{low}, {hi}]")
    return arr.astype(np.int64)


def _lengths(lengths, mask, batch: int, width: int) -> np.ndarray:
    if lengths is not None and mask is not None:
        raise ValueError("pass lengths= or mask=, not both")
    if mask is None:
        return np.full((batch,), width, np.int64) if lengths is None else _row_ints(lengths, "lengths", batch, 0,
                                                                                     width)
    mask = _host(mask, "mask")
    arr = np.asarray(mask) if isinstance(mask, (list, tuple, np.ndarray)) else None
    if arr is None or arr.shape != (batch, width):
        shape = "no shape" if arr is None else f"shape {arr.shape}"
        raise ValueError(f"mask has {shape}; it must be booleans of token_ids' shape {(batch, width)}")
    if arr.dtype.kind not in "biu" or not np.isin(arr, (0, 1)).all():
        raise ValueError(f"mask={short_repr(mask)} must hold booleans (or 0 and 1)")
    arr = arr.astype(bool)
    lengths = arr.sum(axis=1)
    for i, n in enumerate(lengths.tolist()):
        if not arr[i, :n].all():
            raise ValueError(f"mask row {i} has padding before a token: pad on the right (the forward is causal, so "
                             f"a row's tokens must come first)")
    return lengths.astype(np.int64)


def score(lm: LanguageModel, token_ids, *, lengths=None, mask=None, prompt_lens=None, params: Any = None,
          temperature: float = 1.0, top_logprobs: int = 0, max_scored: int | None = None) -> ScoreResult:
    """The log-probability of each token of `token_ids` given the tokens before it, under `lm` (one forward).

    token_ids: an integer array i32[B, T] of right-padded rows, or a list of B token-id lists of one length T.
    lengths (B integers in [0, T]) or mask (bool[B, T], True on each row's tokens, which come first): where
    each row's tokens end; default, every row holds T tokens. prompt_lens (B integers in [0, lengths[b]]):
    score only the positions from prompt_lens[b] on, the completion; default, every position but 0, which
    has no context. params: weights of `lm.params`'s structure, shapes and dtypes (default `lm.params`); new
    weights reuse the compiled program. temperature: the log-probabilities are those of softmax(logits /
    temperature); 1.0, the default, is the model's raw distribution, what `generate(..., logprobs=L)` records.
    top_logprobs: also return the K most likely tokens and their log-probabilities at each scored position.
    max_scored: compute logits at only this many positions per row (each row's scored span must fit in it),
    so a long prompt costs no LM head; the values are the same.

    Returns a `ScoreResult` of jax arrays: `logprobs` f32[B, T] (0 where not scored, `mask` False),
    `top_ids` i32[B, T, K], `top_logprobs` f32[B, T, K], and `ranks` i32[B, T], each token's rank in the
    vocabulary (1: the most likely). Compiled per (B, T) shape, `top_logprobs` and
    `max_scored`. Inside your own jit or `jax.grad` call `score_arrays` (the same computation, pure).

    Raises ValueError naming the value: token_ids ragged, empty (B or T of 0), not integers, or with an id
    outside [0, V) among a row's tokens; lengths outside [0, T] or both lengths and mask; a mask with padding
    before a token; prompt_lens outside [0, lengths]; temperature not a finite number > 0; top_logprobs
    outside [0, V]; max_scored < 1 or shorter than a row's scored span; params of another structure or shape.
    """
    tokens = _token_array(token_ids)
    batch, width = tokens.shape
    vocab = lm.config.vocab_size
    row_lengths = _lengths(lengths, mask, batch, width)
    starts = (np.zeros((batch,), np.int64) if prompt_lens is None
              else _row_ints(prompt_lens, "prompt_lens", batch, 0, row_lengths))
    for i, n in enumerate(row_lengths.tolist()):
        row = tokens[i, :n]
        bad = np.flatnonzero((row < 0) | (row >= vocab))
        if bad.size:
            raise ValueError(f"token_ids[{i}, {int(bad[0])}]={int(row[bad[0]])} is outside the vocabulary "
                             f"[0, {vocab})")
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not math.isfinite(temperature) or temperature <= 0):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0")
    if not is_integer(top_logprobs) or not 0 <= top_logprobs <= vocab:
        raise ValueError(f"top_logprobs={top_logprobs!r} must be an integer in [0, {vocab}]")
    if max_scored is not None:
        if not is_integer(max_scored) or max_scored < 1:
            raise ValueError(f"max_scored={max_scored!r} must be None or an integer >= 1")
        span = np.maximum(row_lengths - np.maximum(starts, 1), 0)
        if span.max() > max_scored:
            i = int(span.argmax())
            raise ValueError(f"max_scored={max_scored} is less than row {i}'s {int(span[i])} scored positions")
        max_scored = int(max_scored)
    params = check_params(lm, params)
    return _score_jit(lm.graphdef, params, jnp.asarray(tokens, jnp.int32), jnp.asarray(row_lengths, jnp.int32),
                      jnp.asarray(starts, jnp.int32), jnp.float32(temperature), top_logprobs=int(top_logprobs),
                      max_scored=max_scored)

