"""A rollout group's draft material as plain texts, searched by comparing tokens: `group_sam`'s loop-free index.

The group automaton (`group_automaton`) finds the longest suffix of a row's text that occurs anywhere in its
group in amortised O(1) work per token, but it extends in `lax.while_loop`s whose trip counts depend on the
data, and the G siblings of a group take turns. On a GPU each iteration of such a loop is a kernel launch and a
copy of its condition to the host, so the one-string automaton's update costs more than a decode step of the
default model there. This index keeps only the texts and compares: each step, every row
compares the last `max_match` tokens of its own text with the tokens ending at every position of every string
of its group, O(max_match * N * T) work per row in a fixed number of array operations and no loop that
depends on the data.

Layout (every field has a leading group axis P)
  texts i32[P, N, T]   each string's text: the group's prompt, then the sample's tokens (strings 0..G-1) or
                       a reference completion (strings G..N-1)
  text_len i32[P, N]
  lost bool[P, N]      the string outgrew T: it stops growing, and its row drafts nothing (what it holds stays
                       draft material for its siblings)

Drafting (`draft_rows`) for the row of string s in group p with text x = texts[p, s, :n]: for every string w
and position i with a continuation (i < text_len[p, w] - 1), run(w, i) = the length of the longest common
suffix of texts[p, w, :i + 1] and x, counted up to `max_match` tokens. The draft is what follows the first
(w, i) in (string, position) order attaining the largest run, and match_len is that run. Below `max_match`
this is the automaton's rule, the longest suffix of the row's text that has a continuation somewhere in the
group (its own earlier text included; the row's own end has no continuation, so it never matches itself);
suffixes longer than `max_match` tie, and the first of them drafts. Drafts are proposals, so which
occurrence drafts changes acceptance, never the output.

Cost against the group automaton: appending is one scatter (no turns between siblings, no loop), state is
4 N T bytes per group (against 16 (2 N T + 1) + 16 * 6 N T for the automaton's tables), and drafting compares
max_match x N x T tokens per row instead of following at most a few suffix links.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

MAX_MATCH = 32  # tokens of a row's suffix compared at every position: longer matches tie


@flax.struct.dataclass
class GroupMatch:
    """The texts of G groups of N strings each (see the module docstring)."""

    texts: jax.Array  # i32[P, N, T]
    text_len: jax.Array  # i32[P, N]
    lost: jax.Array  # bool[P, N]

    @classmethod
    def create(cls, num_groups: int, num_strings: int, max_text_len: int) -> "GroupMatch":
        """Every string of every group the empty text, with room for `max_text_len` tokens."""
        p, n, t = int(num_groups), int(num_strings), max(int(max_text_len), 1)
        return cls(texts=jnp.zeros((p, n, t), jnp.int32), text_len=jnp.zeros((p, n), jnp.int32),
                   lost=jnp.zeros((p, n), bool))

    @staticmethod
    def nbytes(num_strings: int, max_text_len: int) -> int:
        """Device bytes of one group's texts as `create` sizes them."""
        return num_strings * (4 * max(int(max_text_len), 1) + 5)


def extend_rows(gm: GroupMatch, group: jax.Array, string: jax.Array, tokens: jax.Array,
                num: jax.Array) -> GroupMatch:
    """Row b appends tokens[b, :num[b]] to string string[b] of group group[b] (group, string, num i32[B]; tokens
    i32[B, M]); group < 0 marks an unused row, num 0 does nothing. One scatter: rows write different strings
    (a sample is one row), so no row waits for a sibling. A string that would outgrow T is marked lost instead
    and keeps the text it has."""
    group, string, tokens, num = (jnp.asarray(x, jnp.int32) for x in (group, string, tokens, num))
    num_groups, num_strings, width = gm.texts.shape
    real = (group >= 0) & (group < num_groups)
    g = jnp.where(real, group, num_groups)  # out of range: every write of an unused row is dropped
    s = jnp.clip(string, 0, num_strings - 1)
    read = jnp.clip(g, 0, num_groups - 1)
    n, lost = gm.text_len[read, s], gm.lost[read, s]  # i32[B], bool[B]
    num = jnp.clip(num, 0, tokens.shape[1])
    fits = n + num <= width
    m = jnp.where(real & fits & ~lost, num, 0)
    j = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    at = jnp.where(j < m[:, None], n[:, None] + j, width)  # [B, M]  past the end: dropped
    texts = gm.texts.at[g[:, None], s[:, None], at].set(tokens, mode="drop")
    return GroupMatch(texts=texts, text_len=gm.text_len.at[g, s].add(m, mode="drop"),
                      lost=gm.lost.at[g, s].set(lost | (real & (num > 0) & ~fits), mode="drop"))


def extend_groups(gm: GroupMatch, string: jax.Array, tokens: jax.Array, num: jax.Array) -> GroupMatch:
    """Append tokens[p, :num[p]] to string string[p] of group p (string, num i32[P]; tokens i32[P, M])."""
    groups = jnp.arange(gm.texts.shape[0], dtype=jnp.int32)
    return extend_rows(gm, groups, string, tokens, num)


def start(gm: GroupMatch, prefix: jax.Array, prefix_len: jax.Array) -> GroupMatch:
    """Each group's prefix (prefix i32[P, W], prefix_len i32[P]) as the text of every string of the group.

    `gm` is fresh from `create`: every string's text and flags are overwritten."""
    num_groups, num_strings, width = gm.texts.shape
    prefix = jnp.asarray(prefix, jnp.int32)[:, :width]
    prefix_len = jnp.clip(jnp.asarray(prefix_len, jnp.int32), 0, prefix.shape[1])
    pos = jnp.arange(prefix.shape[1], dtype=jnp.int32)
    prefix = jnp.where(pos < prefix_len[:, None], prefix, 0)
    texts = jnp.zeros_like(gm.texts).at[:, :, : prefix.shape[1]].set(prefix[:, None])
    return GroupMatch(texts=texts, text_len=jnp.repeat(prefix_len[:, None], num_strings, axis=1),
                      lost=jnp.zeros_like(gm.lost))


def catch_up(gm: GroupMatch, texts: jax.Array, lengths: jax.Array) -> GroupMatch:
    """Strings 0..M-1 of every group given the texts they have grown to elsewhere (texts i32[P, M, H], lengths
    i32[P, M]; each begins with what the string already holds). A string already as long, or lost, keeps its
    text (a lost string stops growing, as `extend_rows` has it); one longer than T takes its first T tokens and
    is marked lost."""
    texts, lengths = jnp.asarray(texts, jnp.int32), jnp.asarray(lengths, jnp.int32)
    num_strings, width = texts.shape[1], gm.texts.shape[2]
    have = gm.text_len[:, :num_strings]
    grow = (lengths > have) & ~gm.lost[:, :num_strings]  # bool[P, M]
    given = jnp.zeros(texts.shape[:2] + (width,), jnp.int32).at[..., : texts.shape[2]].set(texts[..., :width])
    new = jnp.where(grow[..., None], given, gm.texts[:, :num_strings])
    new_len = jnp.where(grow, jnp.minimum(lengths, width), have)
    lost = gm.lost[:, :num_strings] | (grow & (lengths > width))
    return GroupMatch(texts=gm.texts.at[:, :num_strings].set(new),
                      text_len=gm.text_len.at[:, :num_strings].set(new_len), lost=gm.lost.at[:, :num_strings].set(lost))


def suffix_runs(texts: jax.Array, text_len: jax.Array, string: jax.Array, max_match: int = MAX_MATCH) -> jax.Array:
    """i32[B, N, T]: for row b, whose text is texts[b, string[b], :text_len[b, string[b]]] (texts i32[B, N, T],
    the strings of the row's group; text_len i32[B, N]; string i32[B]), at every string w and position i the
    length of the longest common suffix of texts[b, w, :i + 1] and the row's text, counted up to `max_match`.

    One comparison of the row's j-th last token with texts[b, :, i - j] per j < max_match, each narrowing the
    positions still agreeing; XLA fuses the max_match comparisons into one pass over [B, N, T]."""
    batch, num_strings, width = texts.shape
    rows = jnp.arange(batch)
    n = text_len[rows, string]  # i32[B]
    j = jnp.arange(max_match, dtype=jnp.int32)
    own = texts[rows, string]  # [B, T]
    tail = jnp.take_along_axis(own, jnp.clip(n[:, None] - 1 - j, 0, width - 1), axis=1)  # [B, J]  from the end
    padded = jnp.pad(texts, ((0, 0), (0, 0), (max_match, 0)))
    pos = jnp.arange(width, dtype=jnp.int32)
    run = jnp.zeros((batch, num_strings, width), jnp.int32)
    alive = jnp.ones((batch, num_strings, width), bool)
    for k in range(max_match):  # unrolled: XLA fuses the comparisons into one loop over [B, N, T]
        shifted = padded[:, :, max_match - k: max_match - k + width]  # texts[b, w, i - k]; before the start: 0
        # Before a text's start (i < k) or past the row's own start (k >= n) nothing agrees, whatever is there.
        alive &= (shifted == tail[:, k, None, None]) & (pos >= k) & (k < n)[:, None, None]
        run += alive
    return run


def _continued_runs(gm: GroupMatch, group: jax.Array, string: jax.Array, max_match: int):
    """(texts i32[B, N, T] and text_len i32[B, N] of each row's group, runs i32[B, N * T]: `suffix_runs` where a
    position has a continuation, else 0; rows as in `draft_rows`)."""
    num_groups, num_strings, width = gm.texts.shape
    g = jnp.clip(jnp.asarray(group, jnp.int32), 0, num_groups - 1)
    s = jnp.clip(jnp.asarray(string, jnp.int32), 0, num_strings - 1)
    texts, lens = gm.texts[g], gm.text_len[g]  # [B, N, T], [B, N]
    run = suffix_runs(texts, lens, s, max_match)
    pos = jnp.arange(width, dtype=jnp.int32)
    run = jnp.where(pos < lens[:, :, None] - 1, run, 0).reshape(run.shape[0], -1)
    usable = (jnp.asarray(group) >= 0) & ~gm.lost[g, s]
    return texts, lens, jnp.where(usable[:, None], run, 0)


def _continuation(texts: jax.Array, lens: jax.Array, best: jax.Array, at: jax.Array, k: int):
    """(tokens i32[B, k], match_len i32[B], available i32[B]) after flat position at[b] = w * T + i."""
    width = texts.shape[2]
    rows = jnp.arange(at.shape[0])
    w, end = at // width, at % width
    ok = best > 0
    available = jnp.where(ok, lens[rows, w] - end - 1, 0)
    idx = jnp.clip(end[:, None] + 1 + jnp.arange(k, dtype=jnp.int32), 0, width - 1)  # [B, k]
    return texts[rows[:, None], w[:, None], idx], jnp.where(ok, best, 0), available


def draft_rows(gm: GroupMatch, group: jax.Array, string: jax.Array, k: int, max_match: int = MAX_MATCH):
    """(tokens i32[B, k], match_len i32[B], available i32[B]) for rows (group, string i32[B]): the k tokens
    after the first (string, position) attaining the longest suffix match (`suffix_runs`) among positions with
    a continuation; `available` of them are real. Nothing matched, an unused row (group < 0) or a lost string:
    match_len = available = 0 (tokens in range, meaningless)."""
    return tuple(x[:, 0] for x in draft_paths(gm, group, string, k, 1, max_match))


def draft_paths(gm: GroupMatch, group: jax.Array, string: jax.Array, k: int, paths: int,
                max_match: int = MAX_MATCH):
    """Several distinct continuations per row (Seer's multi-path drafting): (tokens i32[B, paths, k],
    match_len i32[B, paths], available i32[B, paths]). Path 0 is `draft_rows`'s; path c is the best match
    among the occurrences whose next token differs from paths 0..c-1's first tokens, so the paths branch at
    their first token and match_len does not increase with c. A path with nothing left to match has
    match_len = available = 0."""
    texts, lens, run = _continued_runs(gm, group, string, max_match)
    batch, num_strings, width = texts.shape
    nxt = jnp.pad(texts[:, :, 1:], ((0, 0), (0, 0), (0, 1))).reshape(batch, -1)  # [B, N * T]  the next token
    out = []
    for _ in range(paths):  # unrolled: `paths` is small (one path: XLA drops the masking after it)
        best = jnp.max(run, axis=1)
        at = jnp.argmax(run, axis=1).astype(jnp.int32)  # the first (string, position) attaining it
        out.append(_continuation(texts, lens, best, at, k))
        first = jnp.take_along_axis(nxt, at[:, None], axis=1)  # [B, 1]
        run = jnp.where(nxt == first, 0, run)  # every occurrence continuing with that token is taken
    return tuple(jnp.stack(parts, axis=1) for parts in zip(*out))
