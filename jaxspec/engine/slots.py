"""Slot operations on a batched `DecodeState`: pure functions, state in and state out, no engine needed.

A batch of B rows ("slots") lives on the device as one `DecodeState` whose every array leads with B (the loop's
step counter, a scalar, excepted). Rows come and go without recompiling anything:

- `empty_state(row, n)`: n finished copies of a one-row state, the batch no request holds yet (`empty_like`:
  the same from any batch's row 0);
- `insert(state, row, slot)`: a freshly prefilled one-row state written into row `slot`, in place
  (`insert_rows`: several rows into several slots);
- `regroup(state, keep, empty)`: rows `keep` of `state`, in that order, moved to the front of a batch of any
  other size (compaction when rows finished, growth when more are needed);
- `finish(state, rows)`: rows marked done, so the loop stops advancing them;
- `stack_settings(rows, width)`: each row's sampling settings, token budget and stop ids as the batch arrays
  (`SamplingParams` [B], `RowLimits`) the loop reads, defaults for free rows.

A row's outputs do not depend on where it sits: decoding a regrouped batch commits, row for row, the tokens
the original batch would have (tests/test_engine_slots.py). Every state here must come from `prefill` with the
same cache length, buffer and proposer, so that rows have one shape. Proposer state wrapped in `BatchShared`
(a rollout group's automaton) belongs to the batch, not to a row: every operation keeps it whole, the
destination's own for `insert`, the source's for `regroup` and `empty_state`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from ..limits import stop_table
from ..proposers.base import BatchShared
from ..sampling_params import SamplingParams
from ..state import DecodeState, RowLimits, RowParams


def _map_rows(fn, *states):
    """jax.tree.map of fn over per-row leaves; a `BatchShared` subtree (and the scalar step counter) is passed
    to fn whole, as the first state's."""
    return jax.tree.map(lambda x, *rest: x if isinstance(x, BatchShared) else fn(x, *rest), *states,
                        is_leaf=lambda x: isinstance(x, BatchShared))


@functools.partial(jax.jit, static_argnames=("n",))
def empty_state(row: DecodeState, n: int) -> DecodeState:
    """n copies of the one-row state `row`, every one marked done (its step counter kept)."""
    state = _map_rows(lambda x: x if x.ndim == 0 else jnp.repeat(x, n, axis=0), row)
    return state.replace(done=jnp.ones((n,), bool))


@functools.partial(jax.jit, static_argnames=("n",))
def empty_like(state: DecodeState, n: int) -> DecodeState:
    """n finished rows shaped like the rows of `state` (copies of its row 0), its batch-shared state and step
    counter kept: the `empty` a compaction regroups into."""
    empty = _map_rows(lambda x: x if x.ndim == 0 else jnp.repeat(x[:1], n, axis=0), state)
    return empty.replace(done=jnp.ones((n,), bool))


@functools.partial(jax.jit, donate_argnames=("state",))
def insert(state: DecodeState, row: DecodeState, slot: jax.Array) -> DecodeState:
    """`state` (donated: updated in place) with row `slot` (i32[]) replaced by the one-row state `row`; the
    step counter is `state`'s."""
    def put(big, small):
        if big.ndim == 0:
            return big  # the loop's step counter
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=0)

    return _map_rows(put, state, row)


@functools.partial(jax.jit, donate_argnames=("state",))
def insert_rows(state: DecodeState, rows: DecodeState, dest: jax.Array) -> DecodeState:
    """`state` (donated: updated in place) with row dest[i] replaced by row i of `rows` (dest i32[R], distinct;
    an index past the batch drops that row): `insert` for several rows at once, one scatter per array instead
    of a slice and an insert per row (under half the time for 8 rows of the default model)."""
    def put(big, small):
        if big.ndim == 0:
            return big  # the loop's step counter
        return big.at[dest].set(small.astype(big.dtype), mode="drop", unique_indices=True)

    return _map_rows(put, state, rows)


@functools.partial(jax.jit, donate_argnames=("empty",))
def _regroup(state: DecodeState, empty: DecodeState, keep: jax.Array) -> DecodeState:
    def put(old, new):
        if new.ndim == 0:
            return old  # the step counter goes on from `state`'s
        return jax.lax.dynamic_update_slice_in_dim(new, jnp.take(old, keep, axis=0).astype(new.dtype), 0, axis=0)

    return _map_rows(put, state, empty)  # batch-shared state: `state`'s


def regroup(state: DecodeState, keep: Sequence[int] | jax.Array, empty: DecodeState) -> DecodeState:
    """`empty` (a batch of n rows, usually `empty_state(row, n)`; donated) with its first len(keep) rows
    replaced by rows `keep` of `state`, in that order, and `state`'s step counter. n may be smaller than
    `state`'s batch (compaction) or larger (growth); len(keep) <= n. Compiled once per (B, len(keep), n)."""
    keep = jnp.asarray(keep, jnp.int32)  # i32[R]
    n = empty.done.shape[0]
    if keep.ndim != 1 or keep.shape[0] > n:
        raise ValueError(f"keep has shape {keep.shape}: at most the {n} rows of `empty` can be kept")
    return _regroup(state, empty, keep)


def finish(state: DecodeState, rows: Sequence[int] | jax.Array) -> DecodeState:
    """`state` with rows `rows` marked done: the loop leaves them as they are. Only `done` is new; every other
    array is `state`'s own (not jitted: a jitted copy of the batch would copy its caches)."""
    return state.replace(done=state.done.at[jnp.asarray(rows, jnp.int32)].set(True))


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """One occupied row's per-request values, as the decode loop reads them."""

    sampling: SamplingParams  # scalars
    max_new_tokens: int  # the row's token budget, its first token (from prefill) included
    stop_ids: Sequence[int]  # the ids that end the row (EOS included)


def stack_settings(rows: Sequence[RowSettings | None], num_stop_ids: int) -> RowParams:
    """The batch arrays of per-row values: `RowParams` of `SamplingParams` of [B] arrays and `RowLimits` (token
    budgets i32[B], stop ids i32[B, num_stop_ids], -1 padded). A free row (None) gets the defaults: greedy, a
    budget of one token, no stop ids."""
    sampling = SamplingParams.stack([SamplingParams() if r is None else r.sampling for r in rows])
    max_new = jnp.asarray([1 if r is None else r.max_new_tokens for r in rows], jnp.int32)  # i32[B]
    stops = stop_table([() if r is None else r.stop_ids for r in rows], num_stop_ids)  # i32[B, M]
    return RowParams(sampling=sampling, limits=RowLimits(max_new_tokens=max_new, stop_ids=jnp.asarray(stops)))
