"""Generalized suffix automata on the device, one per group of strings: for RL rollouts, a group is one prompt's
G samples, which all begin with the prompt, and a sample drafts tokens from what its siblings wrote.

A generalized suffix automaton holds every substring of a *set* of strings; each state is an endpos class, the
set of (string, end position) pairs where its strings occur. It is built online as the one-string automaton
of `suffix_automaton` is, except that each string keeps its own `last` state and the strings grow interleaved.
Appending token c to string s, whose text has n tokens (LENGTH(last[s]) == n):
  1. if last[s] has a transition on c, to q, the text + c occurred before (in another string) and no state is
     made for it: if LENGTH(q) == n + 1, last[s] = q; else q is split, a clone of q (its transitions, link and
     witness) with LENGTH n + 1 takes the transitions c -> q of last[s] and its suffix-link ancestors (while
     they point to q), LINK(q) = clone and last[s] = clone;
  2. else the standard step: a new state cur (LENGTH n + 1, witness (s, n)) gets the transitions c -> cur of
     last[s] and its ancestors up to the first that has one on c (to q); LINK(cur) = the root, q, or a clone
     of q made as in 1.; last[s] = cur;
  3. texts[s, n] = c.
Whatever the order of appends to the strings, this keeps the automaton the minimal one of the set of texts
(one state per endpos class) and LENGTH(last[s]) == text_len[s]: the step needs only the automaton and the
state of the appended string's text, which is the longest string of its class (nothing else ends at its end).

Both cases run `suffix_automaton.extend_batch`, for all groups at once. In case 2 as it is; only the new
state's witness is then rewritten (s * L + n instead of n). Case 1's split is the standard step's split from
p = last[s], so that lane runs with its state count lowered by one: the clone lands at num_states, the state
the step makes for the whole text lands on the newest existing state, whose row is saved before and put back
after (with LINK = clone when it is q itself). The step's loop A writes nothing for that lane (it stops at its
first probe), and its loops B and C neither read nor write that row.

Layout (one group; every field has a leading group axis G)
  nodes i32[C, 4]      LENGTH, LINK, WITNESS, HEAD (`suffix_automaton`'s columns): WITNESS = s * L + e, one
                       occurrence of the state's strings, ending at position e of string s (the one that made
                       the state; a clone copies its original's; the prefix's states point into string 0)
  slots i32[S + W, 4]  the transitions: `suffix_automaton`'s open-addressing table (SRC -1: an empty slot)
  texts i32[N, L]      each string's text, beginning with the group's prefix: drafts are read from it
  text_len, last i32[N]; lost bool[N]; num_states, num_edges i32; full bool
`start` inserts each group's prefix once and gives it to all N strings. `extend_groups` appends to one string
per group; `extend_rows` takes rows (group, string, tokens), several of a group applied one after another;
`catch_up` appends to each string what it is missing of a longer text (an owner that stopped following).

Drafting (`draft_rows`): from last[s] up at most `max_hops` suffix links, the first state but the root whose
witness has a continuation (a token after it in its string); LENGTH is the match length, the tokens after the
witness are the draft. The state of a string's newest token usually has none yet; its parent usually has.

Capacity: `max_tokens`, the most tokens one group will hold (the prefix once, then every append), gives C =
2 * max_tokens + 1 states and S = the power of two >= 6 * max_tokens home slots (transitions <= 3 per token:
load <= 1/2). Before each append a string with L tokens is marked `lost` (it stops growing and drafts nothing),
and a group with num_states + 2 > C or 2 * num_edges + 6 > S is marked `full` (it stops growing and drafts
nothing); with the default sizes only the first can happen. A probe window without an empty slot in the
middle of an append also marks the group full. Idle lanes write out of range (`mode="drop"`), so nothing is
written out of bounds, and one group's or string's limits never touch another.

Cost: one append pass is one `extend_batch` over all G groups plus a probe, a gather and a scatter per group;
`extend_groups` makes max(num) passes and `extend_rows` one `extend_groups` per rank of a row within its group.
On XLA:CPU, jitted with the automaton donated (or carried by a loop), the passes set the cost, not the tables'
size: extend_rows for G = 16 groups of N = 8 strings (256-token prefixes), B = 128 rows (8 per group), 2 tokens
each (16 passes) costs the same with tables for 2048 tokens per group (5 MB) and for 16 * 8 * 256 = 32768 (80 MB:
C = 65537, S = 2**18), far below the cost of a decode step at that batch.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from .suffix_automaton import DST, LENGTH, LINK, PROBE_WINDOW, SuffixAutomaton, _probe, extend_batch

WITNESS = 2  # the third column of `nodes` (MIN_ENDPOS in suffix_automaton): s * L + e of one occurrence


def _sizes(max_tokens: int, max_states: int | None, hash_slots: int | None) -> tuple[int, int]:
    """(states C, home slots S) for a group of `max_tokens` inserted tokens."""
    t = max(int(max_tokens), 1)
    c = max(int(max_states or 2 * t + 1), 2)
    s = 1 << max(int(hash_slots or 6 * t) - 1, 1).bit_length()
    return c, s


@flax.struct.dataclass
class GroupAutomaton:
    """The generalized suffix automata of G groups of N strings each (see the module docstring)."""

    nodes: jax.Array  # i32[G, C, 4]  LENGTH, LINK, WITNESS, HEAD
    slots: jax.Array  # i32[G, S + W, 4]  SRC, TOKEN, DST, NEXT  (SRC -1: empty)
    texts: jax.Array  # i32[G, N, L]  each string's text (all begin with the group's prefix)
    text_len: jax.Array  # i32[G, N]
    last: jax.Array  # i32[G, N]  the state whose longest string is the string's whole text
    lost: jax.Array  # bool[G, N]  the string outgrew L (or could not be extended): not followed, drafts nothing
    num_states: jax.Array  # i32[G]
    num_edges: jax.Array  # i32[G]  transitions stored
    full: jax.Array  # bool[G]  the group's tables ran out: it stops growing and drafts nothing

    @classmethod
    def create(cls, num_groups: int, num_strings: int, max_text_len: int, *, max_tokens: int | None = None,
               max_states: int | None = None, hash_slots: int | None = None) -> "GroupAutomaton":
        """Empty automata: every string of every group is the empty text.

        max_tokens (default num_strings * max_text_len) is the most tokens ever inserted into one group: C =
        2 * max_tokens + 1 states, S = the power of two >= 6 * max_tokens hash slots. max_states / hash_slots
        override them (smaller values are for exercising the capacity checks).
        """
        c, s = _sizes(max_tokens or num_strings * max_text_len, max_states, hash_slots)
        g, n, width = int(num_groups), int(num_strings), max(int(max_text_len), 1)
        nodes = jnp.zeros((g, c, 4), jnp.int32).at[:, 0].set(jnp.array([0, -1, -1, -1], jnp.int32))
        return cls(nodes=nodes, slots=jnp.full((g, s + PROBE_WINDOW, 4), -1, jnp.int32),
                   texts=jnp.zeros((g, n, width), jnp.int32), text_len=jnp.zeros((g, n), jnp.int32),
                   last=jnp.zeros((g, n), jnp.int32), lost=jnp.zeros((g, n), bool),
                   num_states=jnp.ones((g,), jnp.int32), num_edges=jnp.zeros((g,), jnp.int32),
                   full=jnp.zeros((g,), bool))

    @staticmethod
    def nbytes(num_strings: int, max_text_len: int, *, max_tokens: int | None = None) -> int:
        """Device bytes of one group's automaton as `create` sizes it."""
        c, s = _sizes(max_tokens or num_strings * max_text_len, None, None)
        return 16 * c + 16 * (s + PROBE_WINDOW) + num_strings * (4 * max(int(max_text_len), 1) + 9) + 9

    @property
    def max_text_len(self) -> int:
        return self.texts.shape[-1]


def _append(ga: GroupAutomaton, string: jax.Array, token: jax.Array, active: jax.Array) -> GroupAutomaton:
    """Append token[g] to string string[g] of group g where active[g] (string, token i32[G]; active bool[G]):
    one step of the generalized construction for every group at once (cases 1 and 2 of the module docstring,
    both through `extend_batch`)."""
    nodes = ga.nodes
    groups, cap_states = nodes.shape[:2]
    num_strings, width = ga.texts.shape[1:]
    lanes = jnp.arange(groups, dtype=jnp.int32)
    s = jnp.clip(string, 0, num_strings - 1)
    token = token.astype(jnp.int32)
    n, last, lost = ga.text_len[lanes, s], ga.last[lanes, s], ga.lost[lanes, s]
    ns = ga.num_states
    room = n < width
    fits = (ns + 2 <= cap_states) & (2 * ga.num_edges + 6 <= ga.slots.shape[1] - PROBE_WINDOW)
    go = active & ~ga.full & ~lost & room & fits

    _, exists, _, entry = _probe(ga.slots, lanes, last, token)
    q = jnp.maximum(entry[:, DST], 0)
    before = nodes[lanes[:, None], jnp.stack([q, jnp.maximum(ns - 1, 0)], axis=1)]  # [G, 2, 4]: q, newest state
    exists &= go
    moves = exists & (before[:, 0, LENGTH] == n + 1)  # last[s] -> q: nothing else changes
    splits = exists & ~moves
    std = SuffixAutomaton(nodes=nodes, slots=ga.slots, text=jnp.zeros((groups, width), jnp.int32),
                          num_states=ns - splits, num_edges=ga.num_edges, last=last, text_len=n,
                          full=jnp.zeros_like(ga.full))
    out = extend_batch(std, token, go & ~moves)
    good = go & ~moves & ~out.full  # out.full: a probe window filled up mid-extension

    # One scatter: the new state's witness (s * L + n, not n), or the newest state put back.
    made = jnp.minimum(ns, cap_states - 1)
    row_made = out.nodes[lanes, made].at[:, WITNESS].set(s * width + n)
    saved = before[:, 1].at[:, LINK].set(jnp.where(q == ns - 1, ns, before[:, 1, LINK]))
    fix = jnp.where(good, jnp.where(splits, ns - 1, made), cap_states)
    nodes = out.nodes.at[lanes, fix].set(jnp.where(splits[:, None], saved, row_made), mode="drop")

    # The string's new state: q where it moved, else num_states (the new state, or the split's clone).
    moved = moves | good
    at_s = lambda mask: jnp.where(mask, s, num_strings)  # noqa: E731  out of range: dropped
    return GroupAutomaton(
        nodes=nodes, slots=out.slots, texts=ga.texts.at[lanes, s, jnp.where(go, n, width)].set(token, mode="drop"),
        text_len=ga.text_len.at[lanes, at_s(go)].add(1, mode="drop"),
        last=ga.last.at[lanes, at_s(moved)].set(jnp.where(moves, q, ns), mode="drop"),
        lost=ga.lost.at[lanes, at_s(active & ~ga.full & ~room)].set(True, mode="drop"),
        num_states=jnp.where(splits, ns + good, out.num_states), num_edges=out.num_edges,
        full=ga.full | (active & ~lost & room & ~fits) | out.full)


def extend_groups(ga: GroupAutomaton, string: jax.Array, tokens: jax.Array, num: jax.Array) -> GroupAutomaton:
    """Append tokens[g, :num[g]] to string string[g] of group g (string, num i32[G]; tokens i32[G, M]); num 0:
    nothing. One `_append` pass over all groups per token position, while any group has tokens left."""
    string, tokens, num = (jnp.asarray(x, jnp.int32) for x in (string, tokens, num))

    def body(c):
        j, ga = c
        return j + 1, _append(ga, string, tokens[:, j], j < num)

    steps = jnp.minimum(jnp.max(num, initial=0), tokens.shape[1])
    return jax.lax.while_loop(lambda c: c[0] < steps, body, (jnp.int32(0), ga))[1]


def start(ga: GroupAutomaton, prefix: jax.Array, prefix_len: jax.Array) -> GroupAutomaton:
    """Each group's prefix (prefix i32[G, P], prefix_len i32[G]) inserted once, as string 0, then given to every
    string of the group: its text and its state (the prefix states' witnesses point into string 0).

    `ga` is fresh from `create`: every other string's text, state and `lost` flag are overwritten.
    """
    prefix_len = jnp.asarray(prefix_len, jnp.int32)
    ga = extend_groups(ga, jnp.zeros_like(prefix_len), prefix, prefix_len)
    num_strings = ga.texts.shape[1]
    copy = lambda x: jnp.repeat(x[:, :1], num_strings, axis=1)  # noqa: E731
    return ga.replace(texts=copy(ga.texts), text_len=copy(ga.text_len), last=copy(ga.last), lost=copy(ga.lost))


def extend_rows(ga: GroupAutomaton, group: jax.Array, string: jax.Array, tokens: jax.Array,
                num: jax.Array) -> GroupAutomaton:
    """Row b appends tokens[b, :num[b]] to string string[b] of group group[b] (group, string, num i32[B]; tokens
    i32[B, M]); group < 0 marks an unused row, num 0 does nothing.

    The rows of one group take turns in row order (each row's rank among its group's rows with something to
    append, from a [B, B] comparison) while the groups go side by side: rank r's rows are scattered into
    per-group arrays and appended by one `extend_groups`. Rows of one string thus append in row order.
    """
    group, string, tokens, num = (jnp.asarray(x, jnp.int32) for x in (group, string, tokens, num))
    num_groups = ga.num_states.shape[0]
    real = (group >= 0) & (group < num_groups) & (num > 0)  # bool[B]
    same = (group[:, None] == group[None, :]) & real[:, None] & real[None, :]  # bool[B, B]
    rank = jnp.sum(jnp.tril(same, -1), axis=1)  # i32[B]: rows of the same group before this one

    def body(c):
        r, ga = c
        dest = jnp.where(real & (rank == r), group, num_groups)  # out of range: dropped
        scatter = lambda x: jnp.zeros((num_groups,) + x.shape[1:], jnp.int32).at[dest].set(x, mode="drop")  # noqa: E731
        return r + 1, extend_groups(ga, scatter(string), scatter(tokens), scatter(num))

    ranks = jnp.max(jnp.where(real, rank + 1, 0), initial=0)
    return jax.lax.while_loop(lambda c: c[0] < ranks, body, (jnp.int32(0), ga))[1]


def catch_up(ga: GroupAutomaton, texts: jax.Array, lengths: jax.Array) -> GroupAutomaton:
    """Bring strings 0..M-1 of every group up to the texts they have grown to elsewhere (texts i32[G, M, H],
    lengths i32[G, M]): string s of group g appends texts[g, s, text_len[g, s]:lengths[g, s]], the tokens it
    has not been given yet. A string already as long (or longer), a lost string and a full group append
    nothing, so catching up twice appends nothing the second time.

    For an owner that stops following its strings while nothing drafts from them (a rollout chunk that does
    not speculate) and catches up before drafting resumes: the automaton then holds the same set of texts,
    hence the same states, as if every token had been appended as it came (only which occurrence a state's
    witness names may differ).
    """
    texts, lengths = jnp.asarray(texts, jnp.int32), jnp.asarray(lengths, jnp.int32)
    num_groups, num_strings, width = texts.shape
    have = ga.text_len[:, :num_strings]  # i32[G, M]
    num = jnp.where(ga.lost[:, :num_strings] | ga.full[:, None], 0, jnp.maximum(lengths - have, 0))
    idx = jnp.minimum(have[..., None] + jnp.arange(width, dtype=jnp.int32), width - 1)  # i32[G, M, H]
    tokens = jnp.take_along_axis(texts, idx, axis=2)
    group = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), num_strings)
    string = jnp.tile(jnp.arange(num_strings, dtype=jnp.int32), num_groups)
    return extend_rows(ga, group, string, tokens.reshape(num_groups * num_strings, width), num.reshape(-1))


def draft_rows(ga: GroupAutomaton, group: jax.Array, string: jax.Array, k: int, max_hops: int = 4):
    """(tokens i32[B, k], match_len i32[B], available i32[B]) for rows (group, string i32[B]).

    From v = last[group, string], then up at most `max_hops` suffix links (unrolled), the first state v other
    than the root whose witness occurrence (string w, end e) has a continuation, available = text_len[w] - e - 1
    > 0: match_len = LENGTH(v), tokens = texts[w, e + 1 : e + 1 + k] (indices clipped: only `available` of them
    are real). Nothing found, an unused row (group < 0), a full group or a lost string: match_len = available =
    0 (tokens in range, meaningless).
    """
    num_groups, num_strings, width = ga.texts.shape
    group, string = jnp.asarray(group, jnp.int32), jnp.asarray(string, jnp.int32)
    g = jnp.clip(group, 0, num_groups - 1)
    s = jnp.clip(string, 0, num_strings - 1)
    usable = (group >= 0) & ~ga.full[g] & ~ga.lost[g, s]
    v = ga.last[g, s]
    found = jnp.zeros_like(usable)
    match_len = available = witness = jnp.zeros_like(v)
    for _ in range(max_hops + 1):
        node = ga.nodes[g, v]  # [B, 4]
        w = jnp.maximum(node[:, WITNESS], 0)
        avail = ga.text_len[g, w // width] - w % width - 1
        take = ~found & (v > 0) & (avail > 0)
        match_len = jnp.where(take, node[:, LENGTH], match_len)
        available = jnp.where(take, avail, available)
        witness = jnp.where(take, w, witness)
        found |= take
        v = jnp.maximum(node[:, LINK], 0)
    ok = found & usable
    idx = jnp.clip(witness[:, None] % width + 1 + jnp.arange(k, dtype=jnp.int32), 0, width - 1)  # [B, k]
    tokens = ga.texts[g[:, None], (witness // width)[:, None], idx]
    return tokens, jnp.where(ok, match_len, 0), jnp.where(ok, available, 0)
