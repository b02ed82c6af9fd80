"""The generalized suffix automata of rollout groups (`jaxspec.proposers.index.group_automaton`) against a host
reference and brute force: interleaved appends to several strings of several groups over random alphabets,
after which each group's device tables must be the reference automaton (the same labelled graph, lengths,
links and witnesses), accept exactly the substrings of the group's strings, have one state per endpos class,
and draft by the reference rule, only true continuations of an occurrence of the row's suffix. Capacity
limits stop growth and drafting, never corrupt, and touch no other group or string."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.proposers.index import group_automaton as ga
from jaxspec.proposers.index.suffix_automaton import DST, HEAD, LENGTH, LINK, NEXT, SRC, TOKEN

G, N, L, K = 3, 4, 24, 5  # groups, strings per group, max_text_len, draft length
ROWS, M, STEPS = 6, 4, 16  # rows per extend_rows call, tokens per row, calls per random test
start = jax.jit(ga.start)
extend_rows = jax.jit(ga.extend_rows)
extend_groups = jax.jit(ga.extend_groups)
draft_rows = jax.jit(ga.draft_rows, static_argnames=("k", "max_hops"))


# ------------------------------------------------------------------------------------------------ references


class HostGroup:
    """One group's generalized suffix automaton in Python (dict transitions), built by the same rule: a new state
    for a string's whole text gets the witness (s, n) as s * L + n, a clone copies its original's."""

    def __init__(self, prefix: list[int], num_strings: int = N, width: int = L):
        self.length, self.link, self.witness, self.trans = [0], [-1], [-1], [{}]
        self.width = width
        self.texts: list[list[int]] = [[]]
        self.last, self.lost = [0], [False]
        for c in prefix:
            self.append(0, c)
        self.texts = [list(self.texts[0]) for _ in range(num_strings)]
        self.last, self.lost = self.last * num_strings, self.lost * num_strings

    def _split(self, p: int, c: int, q: int) -> int:
        clone = len(self.length)
        self.length.append(self.length[p] + 1), self.link.append(self.link[q]), self.witness.append(self.witness[q])
        self.trans.append(dict(self.trans[q]))
        while p != -1 and self.trans[p].get(c) == q:
            self.trans[p][c] = clone
            p = self.link[p]
        self.link[q] = clone
        return clone

    def append(self, s: int, c: int) -> None:
        n, last = len(self.texts[s]), self.last[s]
        if self.lost[s] or n >= self.width:
            self.lost[s] = True
            return
        q = self.trans[last].get(c)
        if q is not None:  # the text + c occurred before (in another string): no new state for it
            self.last[s] = q if self.length[q] == n + 1 else self._split(last, c, q)
        else:
            cur = len(self.length)
            self.length.append(n + 1), self.link.append(0), self.witness.append(s * self.width + n)
            self.trans.append({})
            p = last
            while p != -1 and c not in self.trans[p]:
                self.trans[p][c] = cur
                p = self.link[p]
            if p != -1:
                q = self.trans[p][c]
                self.link[cur] = q if self.length[p] + 1 == self.length[q] else self._split(p, c, q)
            self.last[s] = cur
        self.texts[s].append(c)

    def draft(self, s: int, k: int, max_hops: int) -> tuple[int, int, list[int]]:
        """(match_len, available, the real draft tokens): the rule `draft_rows` implements."""
        v = self.last[s]
        for _ in range(max_hops + 1):
            if v <= 0 or self.lost[s]:
                break
            w, e = divmod(self.witness[v], self.width)
            available = len(self.texts[w]) - e - 1
            if available > 0:
                return self.length[v], available, self.texts[w][e + 1: e + 1 + min(available, k)]
            v = self.link[v]
        return 0, 0, []


def _substrings(strings: list[list[int]]) -> set[tuple]:
    return {tuple(t[i:j]) for t in strings for i in range(len(t)) for j in range(i + 1, len(t) + 1)}


def _endpos_classes(strings: list[list[int]]) -> int:
    """States of the minimal such automaton: distinct sets of (string, end) of the non-empty substrings, + root."""
    endpos: dict[tuple, set] = {}
    for s, text in enumerate(strings):
        for i in range(len(text)):
            for j in range(i + 1, len(text) + 1):
                endpos.setdefault(tuple(text[i:j]), set()).add((s, j - 1))
    return len({frozenset(v) for v in endpos.values()}) + 1


# ------------------------------------------------------------------------------------------------ checks


def _device_transitions(a: ga.GroupAutomaton, g: int) -> list[dict]:
    """Group g's transitions read back from its hash table (one dict token -> state per state), after checking
    that each state's transition list (HEAD, NEXT) holds exactly the slots whose SRC it is."""
    slots, nodes = np.asarray(a.slots[g]), np.asarray(a.nodes[g])
    trans: list[dict] = [{} for _ in range(int(a.num_states[g]))]
    for i, (src, tok, dst) in enumerate(slots[:, [SRC, TOKEN, DST]].tolist()):
        if src >= 0:
            assert tok not in trans[src] and 0 < dst < len(trans)
            trans[src][tok] = (dst, i)
    for v, edges in enumerate(trans):
        listed, e = set(), int(nodes[v, HEAD])
        while e >= 0:
            assert slots[e, SRC] == v and e not in listed
            listed.add(e)
            e = int(slots[e, NEXT])
        assert listed == {i for _, i in edges.values()}
    return [{t: d for t, (d, _) in edges.items()} for edges in trans]


def _accepts(trans: list[dict], word) -> bool:
    v = 0
    for c in word:
        if c not in trans[v]:
            return False
        v = trans[v][c]
    return True


def _check_group(a: ga.GroupAutomaton, g: int, ref: HostGroup, alphabet: int, rng: random.Random) -> None:
    """Group g on the device is `ref`: same graph, lengths, links, witnesses, texts and string states."""
    trans = _device_transitions(a, g)
    assert len(trans) == len(ref.length) == _endpos_classes(ref.texts)
    nodes = np.asarray(a.nodes[g])
    to_ref, todo = {0: 0}, [0]  # device state -> reference state, by walking both from the root
    while todo:
        v = todo.pop()
        r = to_ref[v]
        assert trans[v].keys() == ref.trans[r].keys()
        for c, d in trans[v].items():
            if d not in to_ref:
                to_ref[d] = ref.trans[r][c]
                todo.append(d)
            assert to_ref[d] == ref.trans[r][c]
    assert sorted(to_ref.values()) == list(range(len(ref.length)))  # a bijection
    for v, r in to_ref.items():
        assert nodes[v, LENGTH] == ref.length[r]
        assert to_ref.get(int(nodes[v, LINK]), -1) == ref.link[r]
        assert nodes[v, ga.WITNESS] == ref.witness[r]
    substrings = _substrings(ref.texts)
    assert all(_accepts(trans, w) for w in substrings)
    for _ in range(200):
        word = tuple(rng.randrange(alphabet) for _ in range(rng.randint(1, 8)))
        assert _accepts(trans, word) == (word in substrings), word
    for s, text in enumerate(ref.texts):
        assert int(a.text_len[g, s]) == len(text) and bool(a.lost[g, s]) == ref.lost[s]
        assert np.asarray(a.texts[g, s, : len(text)]).tolist() == text
        assert to_ref[int(a.last[g, s])] == ref.last[s] and nodes[int(a.last[g, s]), LENGTH] == len(text)
    assert not bool(a.full[g])


def _check_drafts(a: ga.GroupAutomaton, refs: list[HostGroup], max_hops: int = 4) -> int:
    """draft_rows for every (group, string) follows the reference rule and is sound: the matched suffix ends at
    the witness occurrence, and the first min(available, K) tokens are what follows it. Returns how many drafted.
    Unused rows (group -1) draft nothing."""
    groups = np.repeat(np.arange(len(refs) + 1) - 1, N).astype(np.int32)  # N unused rows first
    strings = np.tile(np.arange(N), len(refs) + 1).astype(np.int32)
    out = draft_rows(a, jnp.asarray(groups), jnp.asarray(strings), k=K, max_hops=max_hops)
    tokens, match, available = (np.asarray(x) for x in out)
    assert tokens.shape == (len(groups), K) and np.all((tokens >= 0) & (tokens < 1000))
    drafted = 0
    for i, (g, s) in enumerate(zip(groups.tolist(), strings.tolist())):
        if g < 0:
            assert match[i] == available[i] == 0
            continue
        ref = refs[g]
        want_len, want_avail, want = ref.draft(s, K, max_hops)
        assert (match[i], available[i]) == (want_len, want_avail)
        assert tokens[i, : len(want)].tolist() == want
        if match[i]:
            drafted += 1
            text, m, n = ref.texts[s], int(match[i]), min(int(available[i]), K)
            assert any(other[e - m + 1: e + 1] == text[len(text) - m:] and len(other) - e - 1 == available[i]
                       and other[e + 1: e + 1 + n] == want for other in ref.texts for e in range(m - 1, len(other)))
    return drafted


def _started(prefix_lens: list[int], alphabet: int, rng: random.Random, **capacity):
    prefixes = np.zeros((len(prefix_lens), 4), np.int32)
    for g, n in enumerate(prefix_lens):
        prefixes[g, :n] = [rng.randrange(alphabet) for _ in range(n)]
    a = start(ga.GroupAutomaton.create(len(prefix_lens), N, L, **capacity), jnp.asarray(prefixes),
              jnp.asarray(prefix_lens, jnp.int32))
    return a, [HostGroup(prefixes[g, :n].tolist()) for g, n in enumerate(prefix_lens)]


def _random_tokens(rng: random.Random, alphabet: int, ref: HostGroup | None, s: int) -> list[int]:
    """M tokens for string s: random, or (as rollout samples do) what a sibling wrote after the same position or
    after a random one."""
    if ref is not None and rng.random() < 0.6:
        sibling = ref.texts[rng.randrange(len(ref.texts))]
        at = len(ref.texts[s]) if rng.random() < 0.5 else rng.randrange(len(sibling) + 1)
        copied = sibling[at: at + M]
        return copied + [rng.randrange(alphabet) for _ in range(M - len(copied))]
    return [rng.randrange(alphabet) for _ in range(M)]


def _random_rows(rng: random.Random, alphabet: int, refs: list[HostGroup], rows: int = ROWS):
    """One extend_rows call's arguments: some rows unused (group -1), several of one group or string."""
    group = np.array([rng.randrange(-1, len(refs)) for _ in range(rows)], np.int32)
    string = np.array([rng.randrange(N) for _ in range(rows)], np.int32)
    tokens = np.array([_random_tokens(rng, alphabet, refs[g] if g >= 0 else None, s) for g, s in zip(group, string)],
                      np.int32)
    num = np.array([rng.randint(0, M) for _ in range(rows)], np.int32)
    return group, string, tokens, num


def _apply_rows(refs: list[HostGroup], group, string, tokens, num) -> None:
    for b in range(len(group)):  # in row order
        for c in tokens[b, : num[b]].tolist() if group[b] >= 0 else []:
            refs[group[b]].append(int(string[b]), c)


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("alphabet", [2, 3, 5, 50])
def test_interleaved_appends_match_the_reference_and_brute_force(alphabet):
    rng = random.Random(alphabet)
    a, refs = _started([0, 1, rng.randint(2, 4)], alphabet, rng)
    for g, ref in enumerate(refs):
        _check_group(a, g, ref, alphabet, rng)
    drafted = 0
    for step in range(STEPS):
        if step % 3 == 2:  # one string per group, through extend_groups
            string = np.array([rng.randrange(N) for _ in range(G)], np.int32)
            tokens = np.array([_random_tokens(rng, alphabet, refs[g], string[g]) for g in range(G)], np.int32)
            num = np.array([rng.randint(0, M) for _ in range(G)], np.int32)
            _apply_rows(refs, np.arange(G), string, tokens, num)
            a = extend_groups(a, jnp.asarray(string), jnp.asarray(tokens), jnp.asarray(num))
        else:
            rows = _random_rows(rng, alphabet, refs)
            _apply_rows(refs, *rows)
            a = extend_rows(a, *(jnp.asarray(x) for x in rows))
        for g, ref in enumerate(refs):
            _check_group(a, g, ref, alphabet, rng)
        drafted += _check_drafts(a, refs)
        if step % 4 == 3:
            _check_drafts(a, refs, max_hops=0)
    assert drafted > 0


@pytest.mark.parametrize("alphabet", [2, 3])
def test_single_tokens_to_short_strings_split_existing_states(alphabet):
    """Short strings over few symbols: an appended string's text often occurred before, inside a longer context
    (its state must be split, no new state made) or as a whole (its state is reused)."""
    rng = random.Random(10 + alphabet)
    a, refs = _started([0, 0, 0], alphabet, rng)
    for _ in range(40):
        string = np.array([rng.randrange(N) for _ in range(G)], np.int32)
        tokens = np.array([[rng.randrange(alphabet)] * M for _ in range(G)], np.int32)
        _apply_rows(refs, np.arange(G), string, tokens, np.ones(G, np.int32))
        a = extend_groups(a, jnp.asarray(string), jnp.asarray(tokens), jnp.ones(G, jnp.int32))
        for g, ref in enumerate(refs):
            _check_group(a, g, ref, alphabet, rng)
        _check_drafts(a, refs)


def test_rows_of_one_string_append_in_row_order():
    a, refs = _started([2, 0, 1], 3, random.Random(0))
    group = np.array([1, 1, -1, 1, 0, 1], np.int32)
    string = np.array([2, 2, 2, 0, 2, 2], np.int32)
    tokens = np.array([[1, 2, 0, 0], [3, 4, 0, 0], [9, 9, 9, 9], [5, 0, 0, 0], [6, 7, 8, 0], [7, 0, 0, 0]],
                      np.int32)
    num = np.array([2, 2, 4, 1, 3, 1], np.int32)
    a = extend_rows(a, *(jnp.asarray(x) for x in (group, string, tokens, num)))
    _apply_rows(refs, group, string, tokens, num)
    assert refs[1].texts[2] == [1, 2, 3, 4, 7] and refs[1].texts[0] == [5]
    for g, ref in enumerate(refs):
        _check_group(a, g, ref, 10, random.Random(g))


def test_a_row_drafts_what_its_sibling_wrote():
    a = start(ga.GroupAutomaton.create(1, 2, 30), jnp.asarray([[7, 8, 9]]), jnp.asarray([3]))
    a = extend_groups(a, jnp.asarray([0]), jnp.asarray([[1, 2, 3, 4, 5, 6]]), jnp.asarray([6]))  # abcdef
    tokens, match, available = draft_rows(a, jnp.asarray([0, 0]), jnp.asarray([0, 1]), k=4)
    assert match.tolist() == [0, 3] and available.tolist() == [0, 6]  # string 1 is the prefix: what followed it
    assert tokens[1].tolist() == [1, 2, 3, 4]
    a = extend_groups(a, jnp.asarray([1]), jnp.asarray([[1, 2, 3, 0, 0, 0]]), jnp.asarray([3]))  # abc
    tokens, match, available = draft_rows(a, jnp.asarray([0]), jnp.asarray([1]), k=4)
    assert tokens[0, :3].tolist() == [4, 5, 6] and int(match[0]) == 6 and int(available[0]) == 3


def test_catch_up_appends_what_each_string_is_missing():
    """An owner that stopped following its strings (a rollout chunk that does not speculate) hands over each
    string's whole text: catch_up appends only the missing tail, the strings of a group in order, so the
    automaton is the reference built that way; a text no longer than what is held appends nothing, and a
    second call changes nothing."""
    rng = random.Random(4)
    a, refs = _started([0, 2, 3], 3, rng)
    for _ in range(3):  # followed for a while
        rows = _random_rows(rng, 3, refs)
        _apply_rows(refs, *rows)
        a = extend_rows(a, *(jnp.asarray(x) for x in rows))
    texts = np.zeros((G, N, L), np.int32)
    lengths = np.zeros((G, N), np.int32)
    for g, ref in enumerate(refs):
        for s, held in enumerate(ref.texts):
            grown = held + _random_tokens(rng, 3, ref, s)[: rng.randint(0, M)] * 2  # 0..6 tokens it missed
            lengths[g, s] = len(held) - 1 if s == 1 else min(len(grown), L)  # string 1: shorter than held
            texts[g, s, : lengths[g, s]] = grown[: lengths[g, s]]
    held = np.array([[len(t) for t in ref.texts] for ref in refs])
    assert np.sum(np.maximum(lengths - held, 0)) > 4, "strings have tokens to catch up"
    for g, ref in enumerate(refs):
        for s in range(N):
            for c in texts[g, s, held[g, s]: lengths[g, s]].tolist():
                ref.append(s, c)
    catch_up = jax.jit(ga.catch_up)
    a = catch_up(a, jnp.asarray(texts), jnp.asarray(lengths))
    assert a.text_len.tolist() == [[len(t) for t in ref.texts] for ref in refs]
    for g, ref in enumerate(refs):
        _check_group(a, g, ref, 3, rng)
    assert _check_drafts(a, refs) > 0
    again = catch_up(a, jnp.asarray(texts), jnp.asarray(lengths))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(again)))


def test_a_full_group_stops_growing_and_drafting_alone():
    rng = random.Random(1)
    a, refs = _started([1, 1], 3, rng, max_states=16)
    tokens = np.array([list(range(1, 21)), [1, 2] * 10], np.int32)  # 20 new states in group 0, few in group 1
    a = extend_groups(a, jnp.asarray([0, 0]), jnp.asarray(tokens), jnp.asarray([20, 6]))
    _apply_rows(refs[1:], np.zeros(1, np.int32), np.zeros(1, np.int32), tokens[1:], np.array([6]))
    assert a.full.tolist() == [True, False] and int(a.num_states[0]) <= 16
    frozen = jax.tree.map(lambda x: np.asarray(x[0]), (a.nodes, a.slots, a.num_states, a.num_edges))
    rows = (np.array([0, 1, 0], np.int32), np.array([1, 1, 0], np.int32), tokens[[1, 1, 0], :3], np.full(3, 3))
    a = extend_rows(a, *(jnp.asarray(x) for x in rows))  # group 1's string 1 gets 1 2 1: string 0 goes on
    _apply_rows(refs[1:], np.zeros(1, np.int32), *(x[1:2] for x in rows[1:]))
    after = jax.tree.map(lambda x: np.asarray(x[0]), (a.nodes, a.slots, a.num_states, a.num_edges))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(after)))
    _, match, available = draft_rows(a, jnp.asarray([0, 0, 1]), jnp.asarray([0, 1, 1]), k=4)
    assert match.tolist()[:2] == [0, 0] and available.tolist()[:2] == [0, 0] and int(match[2]) > 0
    _check_group(a, 1, refs[1], 3, rng)


def test_small_hash_table_and_crowded_windows_mark_full():
    rng = random.Random(2)
    a, refs = _started([0, 0, 0], 5, rng, hash_slots=16)  # 16 home slots: full past 5 transitions
    tokens = np.array([[0, 1, 2, 3], [0, 0, 0, 0], [0, 1, 0, 1]], np.int32)
    a = extend_groups(a, jnp.asarray([0, 1, 2]), jnp.asarray(tokens), jnp.asarray([4, 4, 4]))
    assert not a.full.any() and a.num_edges.tolist() == [7, 4, 5]
    for g in range(3):
        _apply_rows(refs, np.array([g]), np.array([g]), tokens[g:g + 1], np.array([4]))
        _check_group(a, g, refs[g], 5, rng)
    # Group 0 is past the counts. Group 1's table gets every empty slot taken by a foreign key: its next new
    # transition finds no room mid-extension (the counts allow it). Both are marked full, their tables stay.
    slots = np.asarray(a.slots).copy()
    slots[1][slots[1, :, SRC] < 0] = [10**6, 0, 0, -1]
    a = a.replace(slots=jnp.asarray(slots))
    before = jax.tree.map(lambda x: np.asarray(x[:2]), (a.nodes, a.slots, a.num_states, a.num_edges))
    a = extend_groups(a, jnp.asarray([0, 1, 2]), jnp.asarray([[4, 0, 0, 0], [0, 3, 0, 0], [0] * 4]),
                      jnp.asarray([1, 2, 0]))
    assert a.full.tolist() == [True, True, False]
    after = jax.tree.map(lambda x: np.asarray(x[:2]), (a.nodes, a.slots, a.num_states, a.num_edges))
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    _, match, available = draft_rows(a, jnp.asarray([0, 1, 1]), jnp.asarray([0, 0, 1]), k=2)
    assert match.tolist() == [0, 0, 0] and available.tolist() == [0, 0, 0]
    _check_group(a, 2, refs[2], 5, rng)


def test_a_string_past_its_length_is_lost_alone():
    rng = random.Random(3)
    a = start(ga.GroupAutomaton.create(2, 2, 6), jnp.asarray([[5, 6], [5, 6]]), jnp.asarray([2, 2]))
    refs = [HostGroup([5, 6], 2, 6), HostGroup([5, 6], 2, 6)]
    rows = (np.array([0, 0, 1], np.int32), np.array([0, 1, 0], np.int32),
            np.array([[1, 2, 3, 4, 5, 6], [1, 2, 3, 0, 0, 0], [1, 2, 3, 4, 0, 0]], np.int32), np.array([6, 3, 4]))
    a = jax.jit(ga.extend_rows)(a, *(jnp.asarray(x) for x in rows))
    for b in range(3):
        for c in rows[2][b, : rows[3][b]].tolist():
            refs[rows[0][b]].append(int(rows[1][b]), c)
    assert a.lost.tolist() == [[True, False], [False, False]] and a.text_len.tolist() == [[6, 5], [6, 2]]
    assert not a.full.any()
    for g in range(2):
        _check_group(a, g, refs[g], 7, rng)
    tokens, match, available = draft_rows(a, jnp.asarray([0, 0, 1]), jnp.asarray([0, 1, 1]), k=2)
    assert match.tolist() == [0, 5, 2] and available.tolist() == [0, 1, 4]
    assert tokens[1, 0] == 4 and tokens[2].tolist() == [1, 2]
