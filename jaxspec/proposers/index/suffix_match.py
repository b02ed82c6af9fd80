"""The longest earlier occurrence of each row's suffix, found by comparing tokens instead of walking an automaton.

The dynamic suffix automaton (`suffix_automaton`) finds it in amortised O(1) work per token, but its extension
walks suffix links in `lax.while_loop`s whose trip counts depend on the data. On a GPU every iteration of such a
loop is a kernel launch and a copy of its condition to the host, and extending by the tokens one step commits
costs more there than a whole decode step of the default model. This index does O(L T)
work per step instead (L the most tokens a step appends), with no loop at all: a fixed number of array
operations, which a GPU runs in a few launches and XLA:CPU in a few vectorised loops.

State per row (a batch has a leading axis B on every field):
  text  i32[T]  the row's text (drafts are read from it)
  run   i32[T]  run[i]: the length of the longest common suffix of text[:i + 1] and the whole text text[:n], for
                i < n - 1; 0 at the text's own end and past it (the end is not an earlier occurrence)
  text_len i32, full bool (the text outgrew T: the row stops following it and drafts nothing)

The longest suffix of the text that also ends earlier has length max(run), and its first occurrence ends at the
first i attaining it: the same draft as the automaton's (`draft_batch`), which the tests check on random
texts. Appending m tokens (text' = text + c, n' = n + m) is closed-form: for i < n' - 1,
    run'[i] = the number of leading j < m with text'[i - j] == text'[n' - 1 - j]      (a mismatch within the m)
    run'[i] = m + run[i - m]                                                          (all m match)
so one step compares an [L, B, T] block (L the most tokens a step commits) and takes one reduction over L.
Building from a prompt appends it in chunks of `BUILD_CHUNK` tokens inside a `fori_loop` of static length.

Cost against the automaton: O(L * T) per step (L the block width, however many tokens a row appends) instead of
amortised O(1) per token; state of 8 T bytes per row instead of about 165 T at T = 2048, plus the step's
temporary [L, B, T] block (4 L T bytes per row; 128 T while building, in chunks of 32). The comparison block is
what limits it: at T = 32k and L = 17 it is 0.5 M compares per row and step.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

BUILD_CHUNK = 32  # tokens of the prompt appended per iteration of `build_batch`


@flax.struct.dataclass
class SuffixMatch:
    """Each row's text and the matched-suffix length at every position of it (see the module docstring)."""

    text: jax.Array  # i32[B, T]
    run: jax.Array  # i32[B, T]
    text_len: jax.Array  # i32[B]
    full: jax.Array  # bool[B]

    @classmethod
    def create(cls, batch: int, max_text_len: int) -> "SuffixMatch":
        """The empty text for `batch` rows of capacity `max_text_len` tokens."""
        t = max(int(max_text_len), 1)
        return cls(text=jnp.zeros((batch, t), jnp.int32), run=jnp.zeros((batch, t), jnp.int32),
                   text_len=jnp.zeros((batch,), jnp.int32), full=jnp.zeros((batch,), bool))


def extend_many_batch(index: SuffixMatch, tokens: jax.Array, num: jax.Array) -> SuffixMatch:
    """Append tokens[b, :num[b]] to row b (tokens i32[B, L], num i32[B]); a row whose text would outgrow its
    capacity is marked `full` instead."""
    text, run, n = index.text, index.run, index.text_len
    batch, cap = text.shape
    width = tokens.shape[1]
    rows = jnp.arange(batch, dtype=jnp.int32)
    num = jnp.clip(num.astype(jnp.int32), 0, width)
    fits = n + num <= cap
    m = jnp.where(~index.full & fits, num, 0)  # i32[B]  tokens each row appends
    j = jnp.arange(width, dtype=jnp.int32)  # [L]
    text = text.at[rows[:, None], jnp.where(j < m[:, None], n[:, None] + j, cap)].set(
        tokens.astype(jnp.int32), mode="drop")
    n_new = n + m
    tail = jnp.take_along_axis(text, jnp.clip(n_new[:, None] - 1 - j, 0, cap - 1), axis=1)  # [B, L]  from the end
    # shifted[j, b, i] = text[b, i - j]; before the start (i < j) nothing agrees, whatever the padding holds
    padded = jnp.pad(text, ((0, 0), (width, 0)))
    shifted = jnp.stack([padded[:, width - k:width - k + cap] for k in range(width)])  # [L, B, T]
    pos = jnp.arange(cap, dtype=jnp.int32)
    agree = (shifted == tail.T[:, :, None]) & (pos[None, None] >= j[:, None, None])
    agree |= j[:, None, None] >= m[None, :, None]  # [L, B, T]  past a row's m tokens: no limit
    first_miss = jnp.where(jnp.all(agree, axis=0), width, jnp.argmin(agree, axis=0))  # [B, T]
    before = jnp.take_along_axis(run, jnp.clip(pos[None] - m[:, None], 0, cap - 1), axis=1)  # run[i - m]
    before = jnp.where(pos[None] >= m[:, None], before, 0)
    run = jnp.where(first_miss >= width, m[:, None] + before, first_miss)
    run = jnp.where(pos[None] < n_new[:, None] - 1, run, 0)
    return SuffixMatch(text=text, run=run, text_len=n_new, full=index.full | ((num > 0) & ~fits))


def build_batch(history: jax.Array, length: jax.Array, max_text_len: int) -> SuffixMatch:
    """Each row's index of history[b, :length[b]] (history i32[B, H])."""
    batch, width = history.shape
    chunks = -(-width // BUILD_CHUNK)
    history = jnp.pad(history.astype(jnp.int32), ((0, 0), (0, chunks * BUILD_CHUNK - width)))
    length = jnp.clip(length.astype(jnp.int32), 0, width)

    def body(c, index):
        piece = jax.lax.dynamic_slice_in_dim(history, c * BUILD_CHUNK, BUILD_CHUNK, axis=1)
        return extend_many_batch(index, piece, jnp.clip(length - c * BUILD_CHUNK, 0, BUILD_CHUNK))

    return jax.lax.fori_loop(0, chunks, body, SuffixMatch.create(batch, max_text_len))


def draft_batch(index: SuffixMatch, k: int):
    """(tokens i32[B, k], match_len i32[B], available i32[B]): the k tokens after the first occurrence of the
    longest suffix that also ends earlier; `available` of them are real (the rest are whatever the buffer holds
    past the text: zeros)."""
    best = jnp.max(index.run, axis=1)
    end = jnp.argmax(index.run, axis=1).astype(jnp.int32)  # the first position attaining it
    matched = (best > 0) & ~index.full
    start = end + 1
    available = jnp.where(matched, index.text_len - start, 0)
    idx = jnp.clip(start[:, None] + jnp.arange(k, dtype=jnp.int32), 0, index.text.shape[1] - 1)
    return jnp.take_along_axis(index.text, idx, axis=1), jnp.where(matched, best, 0), available
