"""Suffix automata on the device (dynamic), on the host (static), and the SAM proposer, against brute force."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import whole_copies
from jaxspec import SpecConfig
from jaxspec.proposers.base import Committed, Context
from jaxspec.proposers.index import suffix_automaton as sa
from jaxspec.proposers.index import suffix_match as sm
from jaxspec.proposers.index.suffix_automaton import StaticMatch, StaticSuffixAutomaton, SuffixAutomaton
from jaxspec.proposers.sam import SamProposer
from jaxspec.sampling_params import SamplingParams

K = 5
VOCAB = 49152


# ------------------------------------------------------------------------------------------------ brute force


def _s(tokens) -> str:
    """Tokens as a str (one character per token) so that str.find does substring search."""
    return "".join(chr(0x100 + int(t)) for t in tokens)


def ref_dynamic(t, k=K):
    """(l, draft): the longest l (1 <= l < n) such that t[n-l:] also ends at some e < n-1; the smallest such e;
    draft = t[e+1 : min(e+1+k, n)]. (0, []) if there is none."""
    n = len(t)
    s = _s(t)
    for length in range(n - 1, 0, -1):
        start = s.find(s[n - length:])
        end = start + length - 1
        if end < n - 1:
            return length, list(t[end + 1: min(end + 1 + k, n)])
    return 0, []


def ref_static(corpus, t, k=K):
    """(l, draft): the longest suffix of t found in corpus; draft = the corpus tokens after its first occurrence."""
    c, s = _s(corpus), _s(t)
    for length in range(min(len(t), len(corpus)), 0, -1):
        start = c.find(s[len(t) - length:])
        if start >= 0:
            end = start + length - 1
            return length, list(corpus[end + 1: end + 1 + k])
    return 0, []


def got(tokens, match_len, available, k=K):
    n = min(int(available), k) if match_len > 0 else 0
    return int(match_len), [int(x) for x in np.asarray(tokens)[:n]]


# ------------------------------------------------------------------------------------------------ jitted drivers


@functools.partial(jax.jit, static_argnames=("max_text_len", "capacity"))
def trace_dynamic(tokens, lengths, max_text_len, capacity=()):
    """Append tokens[b, j] (j < lengths[b]) one at a time with the one-row API under vmap; record the draft after
    every append. Returns per step [L, B]: draft tokens, match_len, available, full, num_states; and the final SAM."""
    sam = SuffixAutomaton.create(max_text_len, batch=tokens.shape[0], **dict(capacity))

    def step(sam, j):
        sam = jax.vmap(sa.extend)(sam, tokens[:, j], j < lengths)
        draft, match_len, available = jax.vmap(functools.partial(sa.draft, k=K))(sam)
        return sam, (draft, match_len, available, sam.full, sam.num_states)

    return jax.lax.scan(step, sam, jnp.arange(tokens.shape[1]))


@jax.jit
def trace_static(ssam, tokens):
    def step(match, token):
        match = jax.vmap(sa.static_step, in_axes=(None, 0, 0))(ssam, match, token)
        return match, jax.vmap(functools.partial(sa.static_draft, k=K), in_axes=(None, 0))(ssam, match)

    return jax.lax.scan(step, StaticMatch.create(tokens.shape[0]), tokens.T)[1]


def padded(texts, width):
    out = np.zeros((len(texts), width), np.int32)
    for i, t in enumerate(texts):
        out[i, : len(t)] = t
    return jnp.asarray(out), jnp.asarray([len(t) for t in texts], jnp.int32)


def check_dynamic_trace(texts, out, stop_at=None):
    draft, match_len, available = (np.asarray(x) for x in out[:3])
    for b, t in enumerate(texts):
        for j in range(len(t) if stop_at is None else stop_at[b]):
            assert got(draft[j, b], match_len[j, b], available[j, b]) == ref_dynamic(t[: j + 1]), (b, j, t[: j + 1])


def random_texts(rng, n, length):
    """Small alphabets (many repeats), a sparse large vocabulary, and periodic strings."""
    texts = []
    for i in range(n):
        kind = i % 5
        if kind < 3:
            texts.append(rng.integers(0, (2, 3, 5)[kind], length).tolist())
        elif kind == 3:
            ids = rng.choice(VOCAB, 4, replace=False)
            texts.append(ids[rng.integers(0, 4, length)].tolist())
        else:
            period = rng.integers(1, 4)
            texts.append([int(7 + (j % period)) for j in range(length)])
    return texts


# ------------------------------------------------------------------------------------------------ dynamic SAM


def test_dynamic_matches_brute_force_after_every_append():
    rng = np.random.default_rng(0)
    texts = random_texts(rng, 10, 200)
    texts[-1] = texts[-1][:37]  # rows of different lengths in one batch
    tokens, lengths = padded(texts, 200)
    _, out = trace_dynamic(tokens, lengths, max_text_len=256)
    assert not np.asarray(out[3]).any()
    check_dynamic_trace(texts, out)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_dynamic_matches_brute_force_hypothesis(data):
    alphabet = data.draw(st.sampled_from([[0, 1], [0, 1, 2], [3, 1, 4, 5, 9], [5, 49151, 20000, 77, 1]]))
    texts = [data.draw(st.lists(st.sampled_from(alphabet), min_size=1, max_size=64)) for _ in range(2)]
    tokens, lengths = padded(texts, 64)
    check_dynamic_trace(texts, trace_dynamic(tokens, lengths, max_text_len=64)[1])


def test_one_row_api_equals_batched():
    """The one-row functions (no vmap) and the batch functions build the same automaton."""
    t = np.random.default_rng(1).integers(0, 3, 60).tolist()
    one = jax.jit(sa.build, static_argnums=2)(jnp.asarray(t), len(t), 64)
    many = jax.jit(sa.build_batch, static_argnums=2)(*padded([t, t[:30]], 60), 64)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        np.testing.assert_array_equal(a, b[0])
    ext = jax.jit(sa.extend)
    row = SuffixAutomaton.create(64)
    for c in t:
        row = ext(row, c)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(row)):
        np.testing.assert_array_equal(a, b)
    assert got(*sa.draft(row, K)) == ref_dynamic(t)


def host_lookup(slots, state, token):
    bits = sa._table_bits(slots)
    home = int(sa._home(np.asarray([state]), np.asarray([token]), bits, np)[0])
    for j in range(home, home + sa.PROBE_WINDOW):
        if slots[j, sa.SRC] < 0:
            return None
        if slots[j, sa.SRC] == state and slots[j, sa.TOKEN] == token:
            return int(slots[j, sa.DST])
    return None


def transitions_by_list(nodes, slots, state):
    out, e = {}, nodes[state, sa.HEAD]
    while e >= 0:
        assert slots[e, sa.SRC] == state
        out[int(slots[e, sa.TOKEN])] = int(slots[e, sa.DST])
        e = slots[e, sa.NEXT]
    return out


def check_automaton(t, nodes, slots, num_states):
    """The arrays against the Python construction, min_endpos against brute force, and every transition."""
    n = len(t)
    assert num_states <= max(2 * n - 1, 2)
    length, link, min_end, trans = sa._host_sam(t)
    assert num_states == len(length)
    np.testing.assert_array_equal(nodes[:num_states, sa.LENGTH], length)
    np.testing.assert_array_equal(nodes[:num_states, sa.LINK], link)
    np.testing.assert_array_equal(nodes[:num_states, sa.MIN_ENDPOS], min_end)
    s = _s(t)
    for v in range(1, num_states):
        end, size = int(min_end[v]), int(length[v])
        assert s.find(s[end - size + 1: end + 1]) == end - size + 1  # its longest string first ends at min_endpos
        assert length[link[v]] < size
        assert transitions_by_list(nodes, slots, v) == trans[v]
        for tok, dst in trans[v].items():
            assert host_lookup(slots, v, tok) == dst
    assert transitions_by_list(nodes, slots, 0) == trans[0]


def test_dynamic_invariants():
    rng = np.random.default_rng(2)
    texts = random_texts(rng, 5, 150) + [[4], [4, 4], [1, 2]]
    tokens, lengths = padded(texts, 150)
    sam = sa.build_batch(tokens, lengths, 160)
    for b, t in enumerate(texts):
        check_automaton(t, np.asarray(sam.nodes[b]), np.asarray(sam.slots[b]), int(sam.num_states[b]))
        assert int(sam.num_edges[b]) == sum(len(d) for d in sa._host_sam(t)[3])
        assert int(sam.text_len[b]) == len(t) and not bool(sam.full[b])


# ------------------------------------------------------------------------------------------------ capacity


@pytest.mark.parametrize("capacity", [
    dict(),  # the text outgrows max_text_len
    dict(max_states=30),  # the states run out first
    dict(hash_slots=32),  # the transition table reaches half load first
], ids=["text", "states", "hash"])
def test_capacity_overflow_stops_cleanly(capacity):
    rng = np.random.default_rng(3)
    texts = [rng.integers(0, 3, 100).tolist(), rng.integers(0, 5, 100).tolist(), [1, 2] * 50]
    tokens, lengths = padded(texts, 100)
    sam, out = trace_dynamic(tokens, lengths, max_text_len=40, capacity=tuple(capacity.items()))
    _, match_len, available, full, num_states = (np.asarray(x) for x in out)
    assert full[-1].all()
    first_full = full.argmax(axis=0)
    assert (num_states <= sam.nodes.shape[1]).all() and (np.asarray(sam.num_edges) * 2 <= sam.slots.shape[1]).all()
    check_dynamic_trace(texts, out, stop_at=first_full)  # right up to the overflow
    for b in range(len(texts)):
        assert (match_len[first_full[b]:, b] == 0).all() and (available[first_full[b]:, b] == 0).all()
        # The automaton stopped before the overflowing token: that of the text before it, intact.
        n = int(sam.text_len[b])
        assert n == first_full[b] and (n == 40 or capacity)
        assert (num_states[first_full[b]:, b] == num_states[-1, b]).all()
        check_automaton(texts[b][:n], np.asarray(sam.nodes[b]), np.asarray(sam.slots[b]), int(sam.num_states[b]))


def test_probe_window_overflow_marks_full(monkeypatch):
    """A window that fills up in the middle of an extension (forced here with a 2-slot window): the row is marked
    full, nothing is written out of bounds, and drafts stop; before that every draft was right."""
    monkeypatch.setattr(sa, "PROBE_WINDOW", 2)
    rng = np.random.default_rng(4)
    texts = [rng.integers(0, 40, 120).tolist(), rng.integers(0, 3, 120).tolist()]
    tokens, lengths = padded(texts, 120)
    sam, out = trace_dynamic(tokens, lengths, max_text_len=128, capacity=(("hash_slots", 256),))
    full, num_states = np.asarray(out[3]), np.asarray(out[4])
    assert full[-1].all()
    first_full = full.argmax(axis=0)
    # Row 0 (40 symbols, many transitions) overflows a window in the middle of an extension, long before the
    # table is half full (which the check before each extension would have caught).
    assert first_full[0] < 100 and 2 * int(sam.num_edges[0]) + 6 <= 256
    check_dynamic_trace(texts, out, stop_at=first_full)
    for b in range(2):
        assert (np.asarray(out[1])[first_full[b]:, b] == 0).all()
        assert (num_states[first_full[b]:, b] == num_states[-1, b]).all()  # frozen from then on


# ------------------------------------------------------------------------------------------------ static SAM


def test_static_matches_brute_force():
    rng = np.random.default_rng(5)
    sep = 49151
    docs = [rng.integers(0, 3, int(rng.integers(5, 60))).tolist() for _ in range(6)] + [[]]
    ssam = StaticSuffixAutomaton.build(docs, sep)
    corpus = [int(x) for x in np.asarray(ssam.corpus)]
    assert corpus == sum(([sep] + d if i else d for i, d in enumerate(docs)), [])
    check_automaton(corpus, np.asarray(ssam.nodes), np.asarray(ssam.slots), ssam.nodes.shape[0])
    # Texts: random, and pieces copied from the corpus (long matches), with unseen tokens in between.
    texts = [rng.integers(0, 4, 80).tolist()]
    for _ in range(3):
        t = []
        while len(t) < 80:
            start = int(rng.integers(0, len(corpus) - 10))
            t += corpus[start: start + int(rng.integers(3, 25))] + [int(rng.choice([0, 1, 2, 7, sep]))]
        texts.append(t[:80])
    draft, match_len, available = (np.asarray(x) for x in trace_static(ssam, jnp.asarray(texts, jnp.int32)))
    for b, t in enumerate(texts):
        for j in range(len(t)):
            assert got(draft[j, b], match_len[j, b], available[j, b]) == ref_static(corpus, t[: j + 1]), (b, j)


def test_static_large_vocabulary_and_table_growth():
    """Sparse large ids, and a table built with many transitions (the host build doubles until all fit)."""
    rng = np.random.default_rng(6)
    ids = rng.choice(VOCAB, 50, replace=False)
    docs = [ids[rng.integers(0, 50, 300)].tolist() for _ in range(4)]
    ssam = StaticSuffixAutomaton.build(docs, 0)
    corpus = [int(x) for x in np.asarray(ssam.corpus)]
    check_automaton(corpus, np.asarray(ssam.nodes), np.asarray(ssam.slots), ssam.nodes.shape[0])
    t = corpus[100:130] + ids[:5].tolist() + corpus[700:720]
    match = sa.static_feed(ssam, StaticMatch.create(), jnp.asarray(t), len(t))
    assert got(*sa.static_draft(ssam, match, K)) == ref_static(corpus, t)


# ------------------------------------------------------------------------------------------------ the proposer


def make_ctx(history, lengths, max_draft):
    batch = history.shape[0]
    return Context(history=jnp.asarray(history), history_len=jnp.asarray(lengths, jnp.int32),
                   max_draft=jnp.asarray(max_draft, jnp.int32), sampling=SamplingParams().broadcast(batch),
                   positions=jnp.asarray(lengths, jnp.int32) - 1)


def expected_draft(proposer, corpus, t, max_draft):
    k = proposer.num_speculative_tokens
    dyn = ref_dynamic(t, k) if proposer.source != "static" else (0, [])
    if proposer.max_text_len < len(t):
        dyn = (0, [])
    stat = ref_static(corpus, t, k) if proposer.source != "dynamic" else (0, [])
    match_len, draft = stat if stat[0] > dyn[0] else dyn
    n = min(len(draft), max_draft, k)
    if proposer.draft_per_match is not None:
        n = min(n, int(np.ceil(np.float32(proposer.draft_per_match) * np.float32(match_len))))
    if match_len < proposer.min_match:
        n = 0
    return match_len, draft[:n]


@pytest.mark.parametrize("proposer", [
    SamProposer(4, max_text_len=120),
    SamProposer(4, max_text_len=120, min_match=3, draft_per_match=0.5),
    SamProposer(4, max_text_len=120, source="static"),
    SamProposer(4, max_text_len=60, source="both", draft_per_match=1.0),  # max_text_len: rows outgrow it
    SamProposer(4, max_text_len=120, index="automaton"),
    SamProposer(4, max_text_len=60, source="both", draft_per_match=1.0, index="automaton"),
], ids=["dynamic", "min_match_per_match", "static", "both", "dynamic_automaton", "both_automaton"])
def test_sam_proposer_protocol(proposer):
    rng = np.random.default_rng(7)
    k, batch, width = proposer.num_speculative_tokens, 4, 120
    docs = [rng.integers(0, 3, 40).tolist(), rng.integers(0, 3, 40).tolist()]
    ssam = StaticSuffixAutomaton.build(docs, 9) if proposer.source != "dynamic" else None
    corpus = [int(x) for x in np.asarray(ssam.corpus)] if ssam is not None else []
    # Each row's full text: a prompt of its own length, then a continuation that repeats earlier pieces.
    texts = []
    for _b in range(batch):
        t = rng.integers(0, 3, 6).tolist()
        while len(t) < width:
            src = t if rng.random() < 0.6 else corpus or t
            start = int(rng.integers(0, max(len(src) - 8, 1)))
            t += src[start: start + int(rng.integers(2, 12))] + [int(rng.integers(0, 4))]
        texts.append(t[:width])
    lengths = np.array([7, 20, 3, 33])
    history = np.zeros((batch, width), np.int32)
    for b in range(batch):
        history[b] = texts[b]  # only history[:, :length] is visible to the proposer as text
    init, propose, update = (jax.jit(getattr(proposer, f)) for f in ("init", "propose", "update"))
    pstate = init(ssam, make_ctx(history, lengths, np.full(batch, k)))
    if proposer.source != "static":  # "auto" at 60-120 tokens of text is the match-length array
        assert isinstance(pstate.dynamic, sm.SuffixMatch if proposer.index != "automaton" else SuffixAutomaton)
    key = jax.random.key(0)
    for step in range(14):
        max_draft = np.array([k, 2, k, 0 if step % 4 == 3 else k])
        draft, pstate = propose(ssam, pstate, make_ctx(history, lengths, max_draft), key)
        assert draft.probs is None and draft.tokens.shape == (batch, k)
        for b in range(batch):
            match_len, want = expected_draft(proposer, corpus, texts[b][: lengths[b]], max_draft[b])
            n = int(draft.num_draft[b])
            assert n == len(want), (step, b)
            assert [int(x) for x in draft.tokens[b, :n]] == want
            assert (np.asarray(draft.tokens[b, n:]) == 0).all()
            assert int(draft.match_len[b]) == match_len
        # Commit 0 .. K+1 tokens per row (row 3 sometimes none, as a finished row).
        num = np.minimum(rng.integers(0, k + 2, batch), width - lengths)
        committed = np.full((batch, k + 1), -1, np.int32)
        for b in range(batch):
            committed[b, : num[b]] = texts[b][lengths[b]: lengths[b] + num[b]]
        lengths = lengths + num
        pstate = update(ssam, pstate, make_ctx(history, lengths, max_draft),
                        Committed(tokens=jnp.asarray(committed), num=jnp.asarray(num, jnp.int32)))


def test_both_takes_the_longer_match():
    corpus_doc = [5, 6, 7, 8, 9, 10, 11, 12]
    ssam = StaticSuffixAutomaton.build([corpus_doc], 0)
    proposer = SamProposer(3, max_text_len=32, source="both", min_match=1)
    # Row 0: its own text repeats [1, 2, 7] (dynamic match 3); the corpus has only [7] (static match 1).
    # Row 1: it ends in [5, 6, 7] (static match 3) and repeats only [7] (dynamic match 1).
    texts = [[1, 2, 7, 4, 1, 2, 7], [7, 1, 5, 6, 7]]
    history = np.zeros((2, 8), np.int32)
    for b, t in enumerate(texts):
        history[b, : len(t)] = t
    ctx = make_ctx(history, [len(t) for t in texts], [3, 3])
    pstate = jax.jit(proposer.init)(ssam, ctx)
    draft, _ = jax.jit(proposer.propose)(ssam, pstate, ctx, jax.random.key(0))
    assert draft.match_len.tolist() == [3, 3]
    assert draft.num_draft.tolist() == [3, 3]
    assert draft.tokens.tolist() == [[4, 1, 2], [8, 9, 10]]


@pytest.mark.contract
def test_compiled_update_changes_the_tables_in_place():
    """No copy of a whole table in the compiled init or update: XLA:CPU inserts one (at every loop iteration)
    when a write to an array is not ordered after the reads of it, which made a step ~20x slower."""
    proposer = SamProposer(4, max_text_len=64, index="automaton")
    batch = 2
    ctx = make_ctx(np.zeros((batch, 64), np.int32), [3, 5], [4, 4])
    pstate = jax.eval_shape(proposer.init, None, ctx)
    committed = Committed(tokens=jnp.zeros((batch, 5), jnp.int32), num=jnp.zeros(batch, jnp.int32))
    tables = {f"s32[{batch},{n},4]" for n in (pstate.dynamic.nodes.shape[1], pstate.dynamic.slots.shape[1])}
    for hlo in (jax.jit(proposer.init).lower(None, ctx).compile().as_text(),
                jax.jit(proposer.update, donate_argnums=1).lower(None, pstate, ctx, committed).compile().as_text()):
        assert not [line for table in tables for line in whole_copies(hlo, table)]


# ------------------------------------------------------------------------------------------------ match-length array


def trace_match(texts, prompt_lens, max_text_len, seed=0, width=K + 1, history_width=96):
    """Build each row's index from its first prompt_lens[b] tokens, then append the rest in random pieces of
    0 .. width tokens per step; yield (step, the number of tokens each row holds, the draft) after every step.
    (Fixed shapes: one compiled program per capacity, however long the texts.)"""
    rng = np.random.default_rng(seed)
    batch = len(texts)
    history, _ = padded([t[:n] for t, n in zip(texts, prompt_lens)], history_width)
    index = jax.jit(sm.build_batch, static_argnums=2)(history, jnp.asarray(prompt_lens, jnp.int32), max_text_len)
    append, draft = jax.jit(sm.extend_many_batch), jax.jit(functools.partial(sm.draft_batch, k=K))
    held = np.asarray(prompt_lens)
    step = 0
    while True:
        yield step, held, draft(index)
        if all(h >= len(t) for h, t in zip(held, texts)):
            return
        num = np.minimum(rng.integers(0, width + 1, batch), [len(t) - h for t, h in zip(texts, held)])
        pieces = np.zeros((batch, width), np.int32)
        for b in range(batch):
            pieces[b, : num[b]] = texts[b][held[b]: held[b] + num[b]]
        index = append(index, jnp.asarray(pieces), jnp.asarray(num, jnp.int32))
        held, step = held + num, step + 1


def test_match_index_matches_brute_force_after_every_append():
    """Built from prompts of 0 to 70 tokens (several build chunks), then grown a few tokens a step: each draft is
    the brute-force longest earlier occurrence's continuation."""
    rng = np.random.default_rng(1)
    texts = random_texts(rng, 10, 160)
    prompt_lens = [0, 1, 5, sm.BUILD_CHUNK, sm.BUILD_CHUNK + 1, 70, 3, 40, 2 * sm.BUILD_CHUNK, 9]
    checked = 0
    for step, held, (tokens, match_len, available) in trace_match(texts, prompt_lens, max_text_len=192):
        for b, t in enumerate(texts):
            assert got(tokens[b], match_len[b], available[b]) == ref_dynamic(t[: held[b]]), (step, b)
            checked += ref_dynamic(t[: held[b]])[0] > 0
    assert checked > 100  # most steps had a match to check, not only empty drafts


_extend_many = jax.jit(sa.extend_many_batch)
_automaton_draft = jax.jit(functools.partial(sa.draft_batch, k=K))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_match_index_equals_the_automaton_hypothesis(data):
    """The same (match_len, available, draft) as the automaton, whatever the text and however it is appended,
    up to and past the capacity, where both stop drafting."""
    alphabet = data.draw(st.sampled_from([[0, 1], [0, 1, 2], [3, 1, 4, 5, 9], [5, 49151, 20000, 77, 1]]))
    texts = [data.draw(st.lists(st.sampled_from(alphabet), min_size=1, max_size=80)) for _ in range(3)]
    prompt_lens = [data.draw(st.integers(0, len(t))) for t in texts]
    cap = data.draw(st.sampled_from([40, 96]))
    seed = data.draw(st.integers(0, 2**16))
    history, _ = padded([t[:n] for t, n in zip(texts, prompt_lens)], 96)
    automaton = jax.jit(sa.build_batch, static_argnums=2)(history, jnp.asarray(prompt_lens, jnp.int32), cap)
    previous = np.asarray(prompt_lens)
    for _, held, (tokens, match_len, available) in trace_match(texts, prompt_lens, cap, seed=seed):
        num = held - previous
        pieces = np.zeros((len(texts), K + 1), np.int32)
        for b, t in enumerate(texts):
            pieces[b, : num[b]] = t[previous[b]: held[b]]
        automaton = _extend_many(automaton, jnp.asarray(pieces), jnp.asarray(num, jnp.int32))
        previous = held
        want = _automaton_draft(automaton)
        for b in range(len(texts)):
            assert got(tokens[b], match_len[b], available[b]) == got(*(np.asarray(w)[b] for w in want)), b
            if held[b] > cap:
                assert int(match_len[b]) == 0  # past the capacity: no drafts


def test_match_index_under_vmap_and_jit_equals_batch_code():
    """Researchers vmap one-row code: vmapping the batch functions over rows of one gives the batch result."""
    rng = np.random.default_rng(3)
    texts = random_texts(rng, 4, 50)
    history, lengths = padded(texts, 50)
    whole = sm.build_batch(history, lengths, 64)
    one_row = jax.jit(jax.vmap(lambda h, n: jax.tree.map(lambda x: x[0], sm.build_batch(h[None], n[None], 64))))
    rows = one_row(history, lengths)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(rows)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sam_index_choice_and_bad_values():
    assert SamProposer(4, max_text_len=2048).uses_match_index  # "auto": on any device at 2048 tokens of text
    # past MATCH_MAX_TEXT_LEN only off a CPU
    assert SamProposer(4, max_text_len=8192).uses_match_index == (jax.default_backend() != "cpu")
    assert SamProposer(4, max_text_len=8192, index="match").uses_match_index
    assert not SamProposer(4, max_text_len=64, index="automaton").uses_match_index
    with pytest.raises(ValueError, match="index='trie'"):
        SamProposer(4, max_text_len=64, index="trie")
    with pytest.raises(ValueError, match="sam_index='trie'"):
        SpecConfig(method="sam", sam_index="trie")


@pytest.mark.parametrize("index", ["auto", "match", "automaton"])
def test_spec_config_sam_index_reaches_the_proposer(tiny_lm, index):
    """SpecConfig(sam_index=...) builds the proposer with that index, whose state is of the matching type."""
    from jaxspec.builders import build_proposer

    spec = SpecConfig(method="sam", sam_index=index)
    proposer, _ = build_proposer(tiny_lm, spec, prompt_width=32, buffer_len=32, cache_len=64)
    assert proposer.index == index
    ctx = make_ctx(np.zeros((2, 64), np.int32), [3, 5], [4, 4])
    state = jax.eval_shape(proposer.init, None, ctx)
    assert isinstance(state.dynamic, SuffixAutomaton if index == "automaton" else sm.SuffixMatch)
