"""The generalized suffix automaton of a rollout group (`jaxspec.proposers.group_automaton`), checked by brute
force: interleaved appends to several strings of several groups over random alphabets, after which the device
tables must accept exactly the substrings of the group's strings, have exactly as many states as the strings
have endpos classes (the automaton is minimal), keep every string's text and state, and draft only true
continuations of an occurrence of the row's suffix. Capacity limits must stop growth, never corrupt."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.proposers import group_automaton as ga
from jaxspec.proposers.suffix_automaton import DST, LENGTH, SRC, TOKEN

G, N, L, K = 3, 4, 40, 5
start = jax.jit(ga.start)
extend_rows = jax.jit(ga.extend_rows)
extend_groups = jax.jit(ga.extend_groups)
draft_rows = jax.jit(ga.draft_rows, static_argnames=("k", "max_hops"))


def _transitions(a: ga.GroupAutomaton, g: int) -> list[dict]:
    """Group g's transitions read back from its hash table: one dict token -> state per state."""
    trans = [{} for _ in range(int(a.num_states[g]))]
    for src, tok, dst in np.asarray(a.slots[g])[:, [SRC, TOKEN, DST]]:
        if src >= 0:
            trans[src][int(tok)] = int(dst)
    return trans


def _accepts(trans: list[dict], word) -> bool:
    v = 0
    for c in word:
        if c not in trans[v]:
            return False
        v = trans[v][c]
    return True


def _endpos_classes(strings: list[list[int]]) -> int:
    """States of the minimal automaton of the strings' suffixes: distinct endpos sets, plus the root."""
    endpos: dict[tuple, set] = {}
    for s, text in enumerate(strings):
        for i in range(len(text)):
            for j in range(i + 1, len(text) + 1):
                endpos.setdefault(tuple(text[i:j]), set()).add((s, j - 1))
    return len({frozenset(v) for v in endpos.values()}) + 1


def _check(a: ga.GroupAutomaton, strings: list[list[list[int]]], alphabet: int, rng: random.Random) -> None:
    for g, group in enumerate(strings):
        trans = _transitions(a, g)
        substrings = {tuple(t[i:j]) for t in group for i in range(len(t)) for j in range(i + 1, len(t) + 1)}
        assert all(_accepts(trans, w) for w in substrings)
        for _ in range(100):
            word = tuple(rng.randrange(alphabet) for _ in range(rng.randint(1, 6)))
            assert _accepts(trans, word) == (word in substrings), word
        assert int(a.num_states[g]) == _endpos_classes(group)
        nodes = np.asarray(a.nodes[g])
        for s, text in enumerate(group):
            assert int(a.text_len[g, s]) == len(text)
            assert nodes[int(a.last[g, s]), LENGTH] == len(text)
            assert np.asarray(a.texts[g, s, : len(text)]).tolist() == text


def _check_drafts(a: ga.GroupAutomaton, strings: list[list[list[int]]]) -> int:
    """Every (group, string)'s draft is a true continuation of an occurrence of its matched suffix; returns how
    many drafted."""
    groups = np.repeat(np.arange(len(strings)), N).astype(np.int32)
    rows = np.tile(np.arange(N), len(strings)).astype(np.int32)
    tokens, match, available = (np.asarray(x) for x in draft_rows(a, jnp.asarray(groups), jnp.asarray(rows), k=K))
    drafted = 0
    for i, (g, s) in enumerate(zip(groups, rows)):
        if match[i] == 0:
            assert available[i] == 0
            continue
        drafted += 1
        text = strings[g][s]
        suffix, n = text[len(text) - match[i]:], min(available[i], K)
        assert len(suffix) == match[i]
        assert any(other[e - len(suffix) + 1: e + 1] == suffix and len(other) - e - 1 == available[i]
                   and other[e + 1: e + 1 + n] == tokens[i, :n].tolist()
                   for other in strings[g] for e in range(len(suffix) - 1, len(other) - 1))
    return drafted


@pytest.mark.parametrize("alphabet", [2, 3, 5, 50])
def test_interleaved_appends_match_brute_force(alphabet):
    rng = random.Random(alphabet)
    prefix_lens = [0, 1, rng.randint(2, 4)]
    prefixes = np.zeros((G, 4), np.int32)
    strings = []
    for g, n in enumerate(prefix_lens):
        prefixes[g, :n] = [rng.randrange(alphabet) for _ in range(n)]
        strings.append([prefixes[g, :n].tolist() for _ in range(N)])
    a = start(ga.GroupAutomaton.create(G, N, L), jnp.asarray(prefixes), jnp.asarray(prefix_lens, jnp.int32))
    drafted = 0
    for step in range(12):
        if step % 3 == 2:  # one string per group through extend_groups
            string = np.array([rng.randrange(N) for _ in range(G)], np.int32)
            tokens = np.array([[rng.randrange(alphabet) for _ in range(4)] for _ in range(G)], np.int32)
            num = np.array([rng.randint(0, 4) for _ in range(G)], np.int32)
            for g in range(G):
                strings[g][string[g]] += tokens[g, : num[g]].tolist()
            a = extend_groups(a, jnp.asarray(string), jnp.asarray(tokens), jnp.asarray(num))
        else:  # rows, several of one group (even of one string), some unused (group -1)
            group = np.array([rng.randrange(-1, G) for _ in range(6)], np.int32)
            string = np.array([rng.randrange(N) for _ in range(6)], np.int32)
            tokens = np.array([[rng.randrange(alphabet) for _ in range(4)] for _ in range(6)], np.int32)
            num = np.array([rng.randint(0, 4) for _ in range(6)], np.int32)
            for b in range(6):
                if group[b] >= 0:
                    strings[group[b]][string[b]] += tokens[b, : num[b]].tolist()
            a = extend_rows(a, jnp.asarray(group), jnp.asarray(string), jnp.asarray(tokens), jnp.asarray(num))
        _check(a, strings, alphabet, rng)
        drafted += _check_drafts(a, strings)
    assert not bool(a.full.any()) and not bool(a.lost.any())
    assert drafted > 0


def test_a_row_drafts_what_its_sibling_wrote():
    a = ga.start(ga.GroupAutomaton.create(1, 2, 30), jnp.asarray([[7, 8, 9]]), jnp.asarray([3]))
    a = ga.extend_groups(a, jnp.asarray([0]), jnp.asarray([[1, 2, 3, 4, 5, 6]]), jnp.asarray([6]))
    a = ga.extend_groups(a, jnp.asarray([1]), jnp.asarray([[1, 2, 3]]), jnp.asarray([3]))
    tokens, match, available = ga.draft_rows(a, jnp.asarray([0]), jnp.asarray([1]), k=4)
    assert tokens[0, :3].tolist() == [4, 5, 6] and int(match[0]) == 6 and int(available[0]) == 3


def test_a_full_group_stops_growing_and_drafting_alone():
    a = ga.GroupAutomaton.create(2, 2, 40, max_states=16)
    a = start(a, jnp.zeros((2, 1), jnp.int32), jnp.asarray([1, 1]))
    tokens = jnp.asarray([list(range(1, 21)), [1, 2] * 10])  # 20 new states in group 0, few in group 1
    a = extend_groups(a, jnp.asarray([0, 0]), tokens, jnp.asarray([20, 6]))
    assert a.full.tolist() == [True, False]
    assert int(a.num_states[0]) <= 16
    a = extend_groups(a, jnp.asarray([1, 1]), tokens, jnp.asarray([3, 3]))  # the second string: 0 1 2 ...
    _, match, _ = draft_rows(a, jnp.asarray([0, 1]), jnp.asarray([1, 1]), k=4)
    assert int(match[0]) == 0 and int(match[1]) > 0


def test_a_string_past_its_length_is_lost_alone():
    a = start(ga.GroupAutomaton.create(1, 2, 6), jnp.asarray([[5, 6]]), jnp.asarray([2]))
    a = extend_groups(a, jnp.asarray([0]), jnp.asarray([[1, 2, 3, 4, 5, 6]]), jnp.asarray([6]))
    assert a.lost.tolist() == [[True, False]] and int(a.text_len[0, 0]) == 6
    a = extend_groups(a, jnp.asarray([1]), jnp.asarray([[1, 2, 3]]), jnp.asarray([3]))
    tokens, match, available = draft_rows(a, jnp.asarray([0, 0]), jnp.asarray([0, 1]), k=2)
    assert int(match[0]) == 0 and int(tokens[1, 0]) == 4 and int(available[1]) == 1
