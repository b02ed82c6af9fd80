"""Suffix automata (SAM) as fixed-capacity int32 arrays: a dynamic one per row, built on the device token by
token inside jit, and a static one over a corpus, built once on the host and passed to the device as a pytree.

A suffix automaton holds every substring of a text in at most 2n - 1 states. Each state is an endpos class:
`length` (its longest string), `link` (the state of the longest suffix with a different endpos set, -1 for the
root) and `min_endpos` (the end index, in the text, of the first occurrence of its strings). Construction is the
standard online algorithm, amortised O(1) per token; a clone copies its original's min_endpos.

Layout (one row; a batch of rows has a leading axis on every field)
  nodes i32[C, 4]      per state: LENGTH, LINK, MIN_ENDPOS, HEAD (the slot of its first transition, -1: none)
  slots i32[S + W, 4]  the transitions: SRC state, TOKEN, DST state, NEXT (the slot of SRC's next transition);
                       SRC -1 marks an empty slot
  text  i32[T]         the text itself: drafts are read from it, so a row's SAM needs nothing from the caller
  num_states, num_edges, last (the state of the whole text), text_len, full
There is no dense [states, vocab] table. A transition lives in one slot of an open-addressing hash table with S
(a power of two) home slots: its home is a multiplicative hash (murmur3's finaliser) of (state, token), and
linear probing looks at most W = PROBE_WINDOW slots from there, all gathered at once (W spare slots at the end,
so a window never wraps). The slots double as the edges of per-state transition lists (HEAD, NEXT), which a
clone walks to copy its original's transitions; redirecting a transition rewrites its slot's DST in place.

Capacity (dynamic SAM, from `max_text_len` T): C = 2T states (a text of n >= 2 tokens has at most 2n - 1),
S = the power of two >= 2 * 3T (at most 3n transitions: load <= 1/2). Before an extension a row is marked
`full` and stops extending if its text already holds T tokens, num_states + 2 > C, or the table is half full
(2 * num_edges + 6 > S); with the default sizes only the first can happen. Should a probe window fill up in
the middle of an extension (W occupied slots in a row: vanishingly rare at load <= 1/2 with W = 32, or a table
made too small on purpose), the row is marked `full` then. Writes of idle rows go to an out-of-range index and
are dropped, so nothing is written out of bounds; a full row no longer follows its text and drafts nothing
(generation stays correct: drafts are only suggestions).

Batching. The extension loops run as `lax.while_loop`s whose trip count depends on the data. `jax.vmap` of such
a loop runs the body for every row and then selects each loop-carried array row by row, which copies the whole
table at every iteration (over an order of magnitude slower). So the implementation is written for a batch of rows
explicitly (the `*_batch` functions): each loop runs while any row has work, and idle rows write nothing. The
one-row functions (`extend`, `extend_many`, `build`, `draft`, `static_feed`, `static_step`,
`static_draft`) are `custom_vmap` wrappers: called on one row they run the batch code with B = 1, and under
`jax.vmap` they run it once on the whole batch.

Cost (XLA:CPU, through `SamProposer` inside a jitted loop, K + 1 = 9 extensions and one draft per row and
step): a small fraction of a decode step, growing with the batch, since the loops run as long as the slowest row;
the big-table gathers and scatters are split across threads by XLA, which costs most when the other cores are
busy. Building the automaton of a prompt, once per row, costs about one or two decode steps for a 1000-token
prompt.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

PROBE_WINDOW = 32  # W: slots one lookup gathers; a key lives at most W - 1 slots past its home
LENGTH, LINK, MIN_ENDPOS, HEAD = 0, 1, 2, 3  # columns of `nodes`
SRC, TOKEN, DST, NEXT = 0, 1, 2, 3  # columns of `slots`


# ----------------------------------------------------------------------------------------------------------------
# hashing


def _fmix32(h, xp):
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> xp.uint32(16))


def _home(state, token, bits: int, xp=jnp):
    """The home slot in [0, 2**bits) of the key (state, token); the same function in numpy (xp=np) and jax."""
    s = xp.asarray(state).astype(xp.uint32)
    t = xp.asarray(token).astype(xp.uint32)
    h = _fmix32((s * xp.uint32(0x9E3779B1)) ^ t, xp)
    if bits == 0:
        return xp.zeros_like(h).astype(xp.int32)
    return (h >> xp.uint32(32 - bits)).astype(xp.int32)


def _table_bits(slots) -> int:
    size = slots.shape[-2] - PROBE_WINDOW
    bits = size.bit_length() - 1
    assert size == 1 << bits, f"hash table of {size} home slots is not a power of two"
    return bits


def _probe(slots, rows, state, token):
    """Look up (state, token) in each row's table (slots i32[B, S + W, 4], or [S + W, 4] shared by all rows):
    (slot, found, ok, entry).

    slot: where the key is, or else the first empty slot of its window (where it would go); ok: False when the
    key is absent and the window has no empty slot (the table is too crowded to insert it); entry: the slot's
    row (SRC, TOKEN, DST, NEXT); its DST is the target state when found.
    """
    home = _home(state, token, _table_bits(slots))
    idx = home[:, None] + jnp.arange(PROBE_WINDOW, dtype=jnp.int32)
    window = slots[idx] if slots.ndim == 2 else slots[rows[:, None], idx]  # [B, W, 4]
    hit = (window[..., SRC] == state[:, None]) & (window[..., TOKEN] == token[:, None])
    stop = hit | (window[..., SRC] < 0)
    j = jnp.argmax(stop, axis=1).astype(jnp.int32)
    entry = jnp.take_along_axis(window, j[:, None, None], axis=1)[:, 0]
    found = (entry[:, SRC] == state) & (entry[:, TOKEN] == token)
    return home + j, found, jnp.any(stop, axis=1), entry


def _put(arr, rows, idx, mask, value):
    """arr[row, idx[row]] = value[row] where mask[row]; other rows write nothing (their index is out of range)."""
    return arr.at[rows, jnp.where(mask, idx, arr.shape[1])].set(value, mode="drop")


# ----------------------------------------------------------------------------------------------------------------
# one-row functions that run as batch code under vmap


def _rowwise(batched_fn: Callable, num_shared: int = 0) -> Callable:
    """A one-row function from `batched_fn(*shared, *rows)`, whose `rows` arguments carry a leading batch axis.

    The `num_shared` first arguments are the same for all rows (a static automaton). Under `jax.vmap` the batch
    code runs once on the whole batch; a shared argument that is itself batched falls back to plain vmap.
    """

    def one_row(*args):
        shared, rest = args[:num_shared], args[num_shared:]
        out = batched_fn(*shared, *jax.tree.map(lambda x: x[None], rest))
        return jax.tree.map(lambda x: x[0], out)

    fn = custom_vmap(one_row)

    @fn.def_vmap
    def _rule(axis_size, in_batched, *args):
        if any(jax.tree.leaves(in_batched[:num_shared])):
            in_axes = tuple(jax.tree.map(lambda b: 0 if b else None, ib) for ib in in_batched)
            out = jax.vmap(one_row, in_axes=in_axes)(*args)
        else:
            shared, rest = args[:num_shared], args[num_shared:]
            rest = jax.tree.map(lambda x, b: x if b else jnp.broadcast_to(x, (axis_size,) + x.shape), rest,
                                tuple(in_batched[num_shared:]))
            out = batched_fn(*shared, *rest)
        return out, jax.tree.map(lambda _: True, out)

    @functools.wraps(batched_fn)
    def call(*args):
        return fn(*(jax.tree.map(jnp.asarray, a) for a in args))

    return call


# ----------------------------------------------------------------------------------------------------------------
# the dynamic automaton


class _NodeColumns:
    """Named views of the `nodes` table that both automata keep."""

    @property
    def length(self):
        return self.nodes[..., LENGTH]

    @property
    def link(self):
        return self.nodes[..., LINK]

    @property
    def min_endpos(self):
        return self.nodes[..., MIN_ENDPOS]


@flax.struct.dataclass
class SuffixAutomaton(_NodeColumns):
    """The suffix automaton of one row's text (a batch: every field with a leading axis B)."""

    nodes: jax.Array  # i32[C, 4]  LENGTH, LINK, MIN_ENDPOS, HEAD
    slots: jax.Array  # i32[S + W, 4]  SRC, TOKEN, DST, NEXT  (SRC -1: empty)
    text: jax.Array  # i32[T]
    num_states: jax.Array  # i32
    num_edges: jax.Array  # i32  transitions stored
    last: jax.Array  # i32  the state of the whole text
    text_len: jax.Array  # i32
    full: jax.Array  # bool  capacity ran out: the automaton stopped following the text

    @property
    def max_text_len(self) -> int:
        return self.text.shape[-1]

    @classmethod
    def create(cls, max_text_len: int, *, batch: int | None = None, max_states: int | None = None,
               hash_slots: int | None = None) -> "SuffixAutomaton":
        """The automaton of the empty text: one row, or `batch` rows.

        Defaults: max_states = 2 * max_text_len, hash_slots = the power of two >= 6 * max_text_len (smaller
        values are for exercising the capacity checks).
        """
        t = max(int(max_text_len), 1)
        c = max(int(max_states or 2 * t), 2)
        s = 1 << max(int(hash_slots or 6 * t) - 1, 1).bit_length()
        lead = () if batch is None else (batch,)
        nodes = jnp.zeros(lead + (c, 4), jnp.int32).at[..., 0, :].set(jnp.array([0, -1, -1, -1], jnp.int32))
        scalar = functools.partial(jnp.zeros, lead, jnp.int32)
        return cls(nodes=nodes, slots=jnp.full(lead + (s + PROBE_WINDOW, 4), -1, jnp.int32),
                   text=jnp.zeros(lead + (t,), jnp.int32),
                   num_states=scalar() + 1, num_edges=scalar(), last=scalar(), text_len=scalar(),
                   full=jnp.zeros(lead, bool))


def extend_batch(sam: SuffixAutomaton, token: jax.Array, active: jax.Array) -> SuffixAutomaton:
    """Append token[b] to row b's text where active[b] (the online construction, batched).

    Written for XLA:CPU, where each operation costs about the same however small: two loops per token (A: walk
    the suffix links adding transitions; then B, copy the transitions of q into its clone, and C, redirect
    transitions q -> clone, side by side in one loop), and the three node rows an extension sets (cur, clone,
    q) written at the end in one scatter. Every write to an array depends on what was read from it before (a
    slot is written with what its window probe found, a node row with values read from the loop that read
    `nodes`), so XLA orders the reads first and updates the arrays in place instead of copying a whole table.
    """
    nodes, slots, text = sam.nodes, sam.slots, sam.text
    batch, cap_states = nodes.shape[:2]
    rows = jnp.arange(batch, dtype=jnp.int32)
    token = token.astype(jnp.int32)
    n = sam.text_len  # also the length of the state `last` (the whole text)
    fits = (n < text.shape[1]) & (sam.num_states + 2 <= cap_states) & (
        2 * sam.num_edges + 6 <= slots.shape[1] - PROBE_WINDOW)
    go = active & ~sam.full & fits
    cur, clone = sam.num_states, sam.num_states + 1
    neg = jnp.full_like(cur, -1)
    text = _put(text, rows, n, go, token)

    # A: from `last` up the suffix links, add transitions token -> cur until a state p already has one (to q).
    # The row registers (p, q, len(p), bad, edges) travel as one array: fewer operations per iteration.
    def a_cond(c):
        r = c[0]
        return jnp.any((r[:, 0] >= 0) & (r[:, 1] < 0) & (r[:, 3] == 0))

    def a_body(c):
        r, nodes, slots = c
        p, q = r[:, 0], r[:, 1]
        act = (p >= 0) & (q < 0) & (r[:, 3] == 0)
        ps = jnp.maximum(p, 0)
        slot, found, ok, entry = _probe(slots, rows, ps, token)
        node_p = nodes[rows, ps]
        ins = act & ~found & ok
        slots = _put(slots, rows, slot, ins, jnp.stack([ps, token, cur, node_p[:, HEAD]], axis=1))
        nodes = _put(nodes, rows, ps, ins, node_p.at[:, HEAD].set(slot))
        hit = act & found
        r = jnp.stack([jnp.where(ins, node_p[:, LINK], p), jnp.where(hit, entry[:, DST], q),
                       jnp.where(hit, node_p[:, LENGTH], r[:, 2]), r[:, 3] | (act & ~ok), r[:, 4] + ins], axis=1)
        return r, nodes, slots

    r0 = jnp.stack([jnp.where(go, sam.last, -1), neg, neg, jnp.zeros_like(neg), sam.num_edges], axis=1)
    r, nodes, slots = jax.lax.while_loop(a_cond, a_body, (r0, nodes, slots))
    p, q, len_p, bad, edges = r[:, 0], r[:, 1], r[:, 2], r[:, 3] > 0, r[:, 4]
    node_q = nodes[rows, jnp.maximum(q, 0)]
    solid = (q >= 0) & (len_p + 1 == node_q[:, LENGTH])
    split = go & ~bad & (q >= 0) & ~solid

    # B: the clone gets a copy of each transition of q (list from q's HEAD); C: from p up the suffix links,
    # transitions token -> q become token -> clone. Independent (different keys; B only fills empty slots,
    # which C's probes for present keys never reach), so one loop runs both.
    # Registers (e: q's next transition to copy, head: the clone's list, pc: the C state, bad, edges).
    def bc_cond(c):
        r = c[0]
        return jnp.any((r[:, 0] >= 0) | (r[:, 2] >= 0))

    def bc_body(c):
        r, slots = c
        e, head, pc = r[:, 0], r[:, 1], r[:, 2]
        act_b, act_c = e >= 0, pc >= 0
        edge = slots[rows, jnp.maximum(e, 0)]
        slot_b, _, ok_b, _ = _probe(slots, rows, clone, edge[:, TOKEN])
        pcs = jnp.maximum(pc, 0)
        slot_c, found_c, _, entry_c = _probe(slots, rows, pcs, token)
        ins = act_b & ok_b
        redirect = act_c & found_c & (entry_c[:, DST] == q)
        # Both writes in one scatter, which thereby follows both probes (two scatters would make XLA copy).
        idx = jnp.stack([jnp.where(ins, slot_b, slots.shape[1]), jnp.where(redirect, slot_c, slots.shape[1])], 1)
        new = jnp.stack([jnp.stack([clone, edge[:, TOKEN], edge[:, DST], head], axis=1),
                         entry_c.at[:, DST].set(clone)], axis=1)
        slots = slots.at[rows[:, None], idx].set(new, mode="drop")
        r = jnp.stack([jnp.where(ins, edge[:, NEXT], -1), jnp.where(ins, slot_b, head),
                       jnp.where(redirect, nodes[rows, pcs, LINK], -1), r[:, 3] | (act_b & ~ok_b), r[:, 4] + ins],
                      axis=1)
        return r, slots

    r0 = jnp.stack([jnp.where(split, node_q[:, HEAD], -1), neg, jnp.where(split, p, -1), bad.astype(jnp.int32),
                    edges], axis=1)
    r, slots = jax.lax.while_loop(bc_cond, bc_body, (r0, slots))
    clone_head, bad, edges = r[:, 1], r[:, 3] > 0, r[:, 4]
    good = go & ~bad
    split &= good
    # The new rows of cur and clone, and q's new link, in one scatter (after the loop: it uses clone_head).
    link_cur = jnp.where(q < 0, 0, jnp.where(solid, q, clone))
    idx = jnp.stack([jnp.where(good, cur, cap_states), jnp.where(split, clone, cap_states),
                     jnp.where(split, q, cap_states)], axis=1)
    new_rows = jnp.stack([
        jnp.stack([n + 1, link_cur, n, neg], axis=1),
        jnp.stack([len_p + 1, node_q[:, LINK], node_q[:, MIN_ENDPOS], clone_head], axis=1),
        node_q.at[:, LINK].set(clone)], axis=1)
    nodes = nodes.at[rows[:, None], idx].set(new_rows, mode="drop")
    return SuffixAutomaton(
        nodes=nodes, slots=slots, text=text, num_states=sam.num_states + good + split, num_edges=edges,
        last=jnp.where(good, cur, sam.last), text_len=n + go, full=sam.full | (active & ~fits) | bad)


def extend_many_batch(sam: SuffixAutomaton, tokens: jax.Array, num: jax.Array) -> SuffixAutomaton:
    """Append tokens[b, :num[b]] to row b (tokens i32[B, L], num i32[B])."""
    def body(c):
        j, s = c
        return j + 1, extend_batch(s, tokens[:, j], j < num)

    return jax.lax.while_loop(lambda c: c[0] < jnp.minimum(jnp.max(num, initial=0), tokens.shape[1]), body,
                              (jnp.int32(0), sam))[1]


def build_batch(history: jax.Array, length: jax.Array, max_text_len: int, **capacity) -> SuffixAutomaton:
    """Each row's automaton of history[b, :length[b]] (history i32[B, H]); `capacity` as in `create`."""
    empty = SuffixAutomaton.create(max_text_len, batch=history.shape[0], **capacity)
    return extend_many_batch(empty, history.astype(jnp.int32), length.astype(jnp.int32))


def draft_batch(sam: SuffixAutomaton, k: int):
    """(tokens i32[B, k], match_len i32[B], available i32[B]) from the longest suffix that occurred before."""
    batch = sam.nodes.shape[0]
    rows = jnp.arange(batch, dtype=jnp.int32)
    v = sam.nodes[rows, sam.last, LINK]  # -1 only for the empty text
    node_v = sam.nodes[rows, jnp.maximum(v, 0)]
    matched = (v > 0) & ~sam.full
    start = node_v[:, MIN_ENDPOS] + 1
    match_len = jnp.where(matched, node_v[:, LENGTH], 0)
    available = jnp.where(matched, sam.text_len - start, 0)
    idx = jnp.clip(start[:, None] + jnp.arange(k, dtype=jnp.int32), 0, sam.text.shape[1] - 1)
    return jnp.take_along_axis(sam.text, idx, axis=1), match_len, available


# One-row API (jax.vmap runs the batch code).
def extend(sam: SuffixAutomaton, token, active=True) -> SuffixAutomaton:
    """The automaton of text + [token] (unchanged where not `active`; marked `full` instead of overflowing)."""
    return _rowwise(extend_batch)(sam, jnp.asarray(token, jnp.int32), jnp.asarray(active, bool))


def extend_many(sam: SuffixAutomaton, tokens, num) -> SuffixAutomaton:
    """Append tokens[:num] (tokens i32[L])."""
    return _rowwise(extend_many_batch)(sam, jnp.asarray(tokens, jnp.int32), jnp.asarray(num, jnp.int32))


def build(history, length, max_text_len: int, **capacity) -> SuffixAutomaton:
    """A row's automaton of history[:length] (history i32[H]); `capacity` as in `SuffixAutomaton.create`."""
    return extend_many(SuffixAutomaton.create(max_text_len, **capacity), history, length)


def draft(sam: SuffixAutomaton, k: int):
    """(tokens i32[k], match_len, available): the k tokens that followed the first occurrence of the longest suffix
    of the text that also ends earlier; `available` of them are real (the rest repeat the text's last token)."""
    return _rowwise(functools.partial(draft_batch, k=k))(sam)


# ----------------------------------------------------------------------------------------------------------------
# the static automaton


@flax.struct.dataclass
class StaticSuffixAutomaton(_NodeColumns):
    """The suffix automaton of a corpus (sequences joined by a separator), built on the host; a pytree."""

    nodes: jax.Array  # i32[N_states, 4]  LENGTH, LINK, MIN_ENDPOS, HEAD
    slots: jax.Array  # i32[S + W, 4]  SRC, TOKEN, DST, NEXT
    corpus: jax.Array  # i32[N]

    @classmethod
    def build(cls, sequences: Sequence[Sequence[int]], separator: int) -> "StaticSuffixAutomaton":
        """The automaton of the sequences joined by `separator` (between them, none at the end), built on the
        host: the online construction in Python, then the same hash-table layout as the dynamic automaton, sized
        for load <= 1/2 and doubled until every transition lies within W slots of its home (so a lookup that
        finds neither the key nor an empty slot in its window means "absent"). Linear in the corpus length; being
        Python, it takes seconds for a corpus of a few hundred thousand tokens.

        A draft is the corpus tokens after the match's first occurrence, up to the corpus end: it may run
        through a separator into the next sequence (verification rejects what does not fit).

        Token ids (and the separator) must be integers in [0, 2**31 - 1]: the tables hold int32. Ids at or past
        a model's vocabulary are caught where the automaton meets the model (`generate`, via `max_token_id`).
        """
        separator = _corpus_id(separator, "separator")
        if not _is_token_iterable(sequences):
            raise ValueError(f"sequences={sequences!r} must be a list of token-id lists")
        corpus: list[int] = []
        for i, seq in enumerate(sequences):
            if not _is_token_iterable(seq):
                raise ValueError(f"sequences[{i}]={seq!r} must be a list of token ids")
            if i:
                corpus.append(separator)
            corpus.extend(_corpus_id(t, f"sequences[{i}][{j}]") for j, t in enumerate(seq))
        length, link, min_end, trans = _host_sam(corpus)
        nodes = np.stack([length, link, min_end, np.full(len(length), -1, np.int64)], axis=1)
        src = np.repeat(np.arange(len(trans)), [len(d) for d in trans])
        tok = np.fromiter((t for d in trans for t in d), np.int64, count=len(src))
        dst = np.fromiter((v for d in trans for v in d.values()), np.int64, count=len(src))
        slots = _host_table(nodes, src, tok, dst)
        as_i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
        return cls(nodes=as_i32(nodes), slots=as_i32(slots),
                   corpus=as_i32(np.asarray(corpus if corpus else [int(separator)], np.int64)))

    def max_token_id(self) -> int:
        """The largest token id in the corpus (read on the host): a model must have a larger vocabulary."""
        return int(np.max(np.asarray(self.corpus)))

    def min_token_id(self) -> int:
        """The smallest token id in the corpus (read on the host); `build` makes it >= 0."""
        return int(np.min(np.asarray(self.corpus)))


def _is_token_iterable(x) -> bool:
    """Lists, tuples, arrays, generators: iterables that are not text (whose items would be characters)."""
    return isinstance(x, Iterable) and not isinstance(x, (str, bytes))


def _corpus_id(token, where: str) -> int:
    """A corpus token id as a Python int, or ValueError naming where it sits."""
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token <= 2**31 - 1:
        raise ValueError(f"{where}={token!r} must be a token id, an integer in [0, 2**31 - 1]")
    return int(token)


def _host_sam(text: Sequence[int]):
    """The online construction in Python: (length, link, min_endpos, transitions as dicts)."""
    length, link, min_end, trans = [0], [-1], [-1], [{}]
    last = 0
    for i, c in enumerate(text):
        cur = len(length)
        length.append(length[last] + 1), link.append(-1), min_end.append(i), trans.append({})
        p = last
        while p != -1 and c not in trans[p]:
            trans[p][c] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = trans[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                length.append(length[p] + 1), link.append(link[q]), min_end.append(min_end[q])
                trans.append(dict(trans[q]))
                while p != -1 and trans[p].get(c) == q:
                    trans[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        last = cur
    return (np.asarray(length, np.int64), np.asarray(link, np.int64), np.asarray(min_end, np.int64), trans)


def _host_table(nodes: np.ndarray, src: np.ndarray, tok: np.ndarray, dst: np.ndarray):
    """The hash table of the transitions (src, tok) -> dst, with per-state lists (fills nodes' HEAD).

    Rounds d = 0 .. W-1: every key not yet placed tries slot home + d (one key per free slot). A key placed at
    home + d found home .. home + d - 1 taken, and slots never empty again, so a probe finds it. If a key is left
    over after W rounds the table doubles.
    """
    size = 16
    while size < 2 * max(len(src), 1):
        size *= 2
    while True:
        bits = size.bit_length() - 1
        home = _home(src, tok, bits, np)
        owner = np.full(size + PROBE_WINDOW, -1, np.int64)  # the key index in each slot
        left = np.arange(len(src))
        for d in range(PROBE_WINDOW):
            if not len(left):
                break
            slot = home[left] + d
            free = owner[slot] < 0
            cand, cslot = left[free], slot[free]
            cslot, first = np.unique(cslot, return_index=True)
            owner[cslot] = cand[first]
            placed = np.zeros(len(src), bool)
            placed[cand[first]] = True
            left = left[~placed[left]]
        if not len(left):
            break
        size *= 2
    slots = np.full((size + PROBE_WINDOW, 4), -1, np.int64)
    used = np.nonzero(owner >= 0)[0]
    key_of = owner[used]
    slots[used, SRC], slots[used, TOKEN], slots[used, DST] = src[key_of], tok[key_of], dst[key_of]
    # Per-state lists: each slot points to the next slot of the same source state.
    order = np.argsort(src[key_of], kind="stable")
    slots_sorted, src_sorted = used[order], src[key_of][order]
    same = src_sorted[1:] == src_sorted[:-1]
    slots[slots_sorted[:-1][same], NEXT] = slots_sorted[1:][same]
    starts = np.ones(len(src_sorted), bool)
    starts[1:] = ~same
    nodes[src_sorted[starts], HEAD] = slots_sorted[starts]
    return slots


@flax.struct.dataclass
class StaticMatch:
    """Where a row's text stands in the static automaton: the longest suffix of the text found in the corpus."""

    state: jax.Array  # i32
    length: jax.Array  # i32  its length (may be below the state's LENGTH)

    @classmethod
    def create(cls, batch: int | None = None) -> "StaticMatch":
        lead = () if batch is None else (batch,)
        return cls(state=jnp.zeros(lead, jnp.int32), length=jnp.zeros(lead, jnp.int32))


def static_feed_batch(ssam: StaticSuffixAutomaton, match: StaticMatch, tokens: jax.Array, num: jax.Array):
    """Advance each row's match by tokens[b, :num[b]]: one loop over all of them (take the transition, else
    follow a suffix link, else at the root drop the token)."""
    batch, width = tokens.shape
    rows = jnp.arange(batch, dtype=jnp.int32)

    def cond(c):
        return jnp.any(c[0] < num)

    def body(c):
        j, state, length = c
        act = j < num
        tok = tokens[rows, jnp.minimum(j, width - 1)]
        _, found, _, entry = _probe(ssam.slots, rows, state, tok)
        dst = entry[:, DST]
        parent = ssam.nodes[jnp.maximum(ssam.nodes[state, LINK], 0)]
        step = act & (found | (state == 0))
        back = act & ~found & (state != 0)
        new_state = jnp.where(step, jnp.where(found, dst, 0), jnp.where(back, ssam.nodes[state, LINK], state))
        new_len = jnp.where(step, jnp.where(found, length + 1, 0), jnp.where(back, parent[:, LENGTH], length))
        return j + step, new_state, new_len

    _, state, length = jax.lax.while_loop(cond, body, (jnp.zeros_like(num), match.state, match.length))
    return StaticMatch(state=state, length=length)


def static_draft_batch(ssam: StaticSuffixAutomaton, match: StaticMatch, k: int):
    """(tokens i32[B, k], match_len, available): the corpus tokens after the first occurrence of the match."""
    size = ssam.corpus.shape[0]
    start = ssam.nodes[match.state, MIN_ENDPOS] + 1
    matched = match.length > 0
    available = jnp.where(matched, size - start, 0)
    idx = jnp.clip(start[:, None] + jnp.arange(k, dtype=jnp.int32), 0, size - 1)
    return ssam.corpus[idx], jnp.where(matched, match.length, 0), available


def static_feed(ssam: StaticSuffixAutomaton, match: StaticMatch, tokens, num) -> StaticMatch:
    """The match after feeding tokens[:num] (tokens i32[L]); feed the prompt to a fresh `StaticMatch()` first."""
    return _rowwise(static_feed_batch, num_shared=1)(ssam, match, jnp.asarray(tokens, jnp.int32),
                                                      jnp.asarray(num, jnp.int32))


def static_step(ssam: StaticSuffixAutomaton, match: StaticMatch, token) -> StaticMatch:
    return static_feed(ssam, match, jnp.asarray(token, jnp.int32)[None], 1)


def static_draft(ssam: StaticSuffixAutomaton, match: StaticMatch, k: int):
    """(tokens i32[k], match_len, available), as `draft` but from the corpus."""
    return _rowwise(functools.partial(static_draft_batch, k=k), num_shared=1)(ssam, match)
