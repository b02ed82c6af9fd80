"""The texts index of rollout groups (`jaxspec.proposers.index.group_match`) against brute force: interleaved appends
by rows of several groups over random alphabets, references, unused rows, texts past their capacity, catching
up; each draft must be the continuation of the first (string, position) with the longest suffix match (up to
`max_match` tokens) among positions with a continuation, and below the cap its match length must be the group
automaton's."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import SpecConfig
from jaxspec.proposers.group_sam import GroupSamProposer
from jaxspec.proposers.index import group_automaton as ga
from jaxspec.proposers.index import group_match as gm

P, N, T, K = 3, 4, 24, 5  # groups, strings per group, max_text_len, draft length
start = jax.jit(gm.start)
extend_rows = jax.jit(gm.extend_rows)
extend_groups = jax.jit(gm.extend_groups)
draft_rows = jax.jit(gm.draft_rows, static_argnames=("k", "max_match"))


class HostGroups:
    """The texts of every group in Python lists, appended by the same rules."""

    def __init__(self, prefixes: list[list[int]], num_strings: int = N, width: int = T):
        self.width = width
        self.texts = [[list(p) for _ in range(num_strings)] for p in prefixes]
        self.lost = [[False] * num_strings for _ in prefixes]

    def append(self, p: int, s: int, tokens: list[int]) -> None:
        if not tokens or self.lost[p][s]:
            return
        if len(self.texts[p][s]) + len(tokens) > self.width:
            self.lost[p][s] = True
            return
        self.texts[p][s] += tokens

    def draft(self, p: int, s: int, k: int, max_match: int) -> tuple[list[int], int, int]:
        """(draft tokens, match_len, available) by brute force over every string and position of group p."""
        texts, x = self.texts[p], self.texts[p][s]
        best, at = 0, None
        for w, t in enumerate(texts):
            for i in range(len(t) - 1):  # positions with a continuation
                r = 0
                while r < max_match and r <= i and r < len(x) and t[i - r] == x[-1 - r]:
                    r += 1
                if r > best:
                    best, at = r, (w, i)
        if best == 0 or self.lost[p][s]:
            return [], 0, 0
        w, i = at
        cont = texts[w][i + 1:]
        return cont[:k], best, len(cont)


def got(tokens, match_len, available, k=K):
    n = min(int(available), k)
    return [int(t) for t in np.asarray(tokens)[:n]], int(match_len), int(available)


def _random_steps(rng: random.Random, host: HostGroups, state, alphabet: int, steps: int, max_match: int,
                  rows_per_step: int = 6, width: int = 4):
    """Random rows (some unused) append random token runs; after each step every string's draft is checked."""
    checked = 0
    strings = [(p, s) for p in range(len(host.texts)) for s in range(len(host.texts[p]))]
    for _ in range(steps):
        picked = rng.sample(strings, rows_per_step)
        group = np.array([p if rng.random() > 0.15 else -1 for p, _ in picked], np.int32)
        string = np.array([s for _, s in picked], np.int32)
        num = np.array([rng.randrange(width + 1) for _ in picked], np.int32)
        tokens = np.array([[rng.randrange(alphabet) for _ in range(width)] for _ in picked], np.int32)
        state = extend_rows(state, jnp.asarray(group), jnp.asarray(string), jnp.asarray(tokens), jnp.asarray(num))
        for b, (p, s) in enumerate(picked):
            if group[b] >= 0:
                host.append(p, s, tokens[b, : num[b]].tolist())
        all_group = np.array([p for p, _ in strings], np.int32)
        all_string = np.array([s for _, s in strings], np.int32)
        out = draft_rows(state, jnp.asarray(all_group), jnp.asarray(all_string), k=K, max_match=max_match)
        for b, (p, s) in enumerate(strings):
            want = host.draft(p, s, K, max_match)
            assert got(*(np.asarray(x)[b] for x in out)) == (want[0], want[1], want[2]), (p, s, host.texts[p])
            checked += want[1] > 0
        texts, text_len, lost = (np.asarray(x) for x in (state.texts, state.text_len, state.lost))
        for p, s in strings:
            assert text_len[p, s] == len(host.texts[p][s]) and bool(lost[p, s]) == host.lost[p][s]
            assert texts[p, s, : text_len[p, s]].tolist() == host.texts[p][s]
    return state, checked


@pytest.mark.parametrize("alphabet, max_match", [(2, 32), (3, 3), (5, 32), (50, 2)])
def test_interleaved_appends_draft_what_brute_force_finds(alphabet, max_match):
    rng = random.Random(alphabet * 100 + max_match)
    prefixes = [[rng.randrange(alphabet) for _ in range(rng.randrange(0, 7))] for _ in range(P)]
    host = HostGroups(prefixes, width=16)
    lens = [len(x) for x in prefixes]
    state = start(gm.GroupMatch.create(P, N, 16), jnp.asarray([x + [0] * (8 - len(x)) for x in prefixes], jnp.int32),
                  jnp.asarray(lens, jnp.int32))
    _, checked = _random_steps(rng, host, state, alphabet, steps=12, max_match=max_match)
    assert checked > 20  # most drafts had a match to check, not only empty ones
    assert any(any(lost) for lost in host.lost), "some string outgrew T, so the lost path is checked"


def test_references_and_a_row_drafting_what_its_sibling_wrote():
    """String 1 drafts what string 0 (a sibling) and string 3 (a reference) wrote after the shared suffix."""
    state = start(gm.GroupMatch.create(1, N, T), jnp.asarray([[7, 8, 9]], jnp.int32), jnp.asarray([3], jnp.int32))
    state = extend_groups(state, jnp.asarray([3], jnp.int32), jnp.asarray([[1, 2, 3, 4, 5, 6]], jnp.int32),
                          jnp.asarray([6], jnp.int32))
    one = lambda s, toks: extend_rows(state, jnp.asarray([0]), jnp.asarray([s]), jnp.asarray([toks]),  # noqa: E731
                                      jnp.asarray([len(toks)]))
    state = one(0, [1, 2, 3, 40, 41])
    state = one(1, [1, 2])  # references begin with the prompt too: [7 8 9 1 2 3 4 5 6]
    tokens, match_len, available = draft_rows(state, jnp.asarray([0]), jnp.asarray([1]), k=K)
    # [7 8 9 1 2] matches string 0's [7 8 9 1 2] (5 tokens) before the reference's [1 2] (2): the sibling drafts
    assert got(tokens[0], match_len[0], available[0]) == ([3, 40, 41], 5, 3)
    state = one(1, [3, 4])
    tokens, match_len, available = draft_rows(state, jnp.asarray([0]), jnp.asarray([1]), k=K)
    assert got(tokens[0], match_len[0], available[0]) == ([5, 6], 7, 2)  # now only the reference continues


def test_match_lengths_are_at_least_the_group_automatons():
    """Below max_match the match is never shorter than the automaton's, and usually equal: the automaton drafts
    from one recorded occurrence (witness) per state and walks up to a shorter suffix when that one has no
    continuation yet, where this index sees every occurrence. Each draft continues a true occurrence."""
    rng = random.Random(5)
    width, cap = 40, 6
    prefixes = [[rng.randrange(3) for _ in range(5)] for _ in range(P)]
    host = HostGroups(prefixes, width=width)
    args = (jnp.asarray(prefixes, jnp.int32), jnp.full((P,), 5, jnp.int32))
    match = start(gm.GroupMatch.create(P, N, width), *args)
    automaton = jax.jit(ga.start)(ga.GroupAutomaton.create(P, N, width), *args)
    group, string = np.repeat(np.arange(P), N).astype(np.int32), np.tile(np.arange(N), P).astype(np.int32)
    compared = equal = 0
    for _ in range(8):
        num = np.array([rng.randrange(4) for _ in group], np.int32)
        tokens = np.array([[rng.randrange(3) for _ in range(3)] for _ in group], np.int32)
        match = extend_rows(match, group, string, tokens, num)
        automaton = jax.jit(ga.extend_rows)(automaton, group, string, tokens, num)
        for b in range(len(group)):
            host.append(int(group[b]), int(string[b]), tokens[b, : num[b]].tolist())
        m_out = draft_rows(match, group, string, k=K, max_match=cap)
        a_out = jax.jit(ga.draft_rows, static_argnames=("k", "max_hops"))(automaton, group, string, k=K,
                                                                           max_hops=width)
        for b in range(len(group)):
            m_len, a_len = int(m_out[1][b]), int(a_out[1][b])
            assert m_len >= min(a_len, cap), (b, m_len, a_len)
            compared += 0 < a_len < cap
            equal += m_len == a_len
            x = host.texts[group[b]][string[b]]
            tokens_b, _, available = got(*(np.asarray(o)[b] for o in m_out))
            if m_len:  # a true continuation: some string holds x's last m_len tokens followed by the draft
                piece = x[len(x) - m_len:] + tokens_b
                assert any(piece == t[i: i + len(piece)] for t in host.texts[group[b]] for i in range(len(t))), b
    assert compared > 30 and equal > 0.8 * len(group) * 8


def test_paths_branch_at_their_first_token_and_take_each_branchs_best_match():
    """Path c is the best (longest, then first) match among occurrences whose next token no earlier path
    starts with: brute force over random groups."""
    rng = random.Random(11)
    paths, depth = 3, 3
    draft_paths = jax.jit(gm.draft_paths, static_argnames=("k", "paths", "max_match"))
    prefixes = [[rng.randrange(4) for _ in range(4)] for _ in range(P)]
    host = HostGroups(prefixes, width=32)
    state = start(gm.GroupMatch.create(P, N, 32), jnp.asarray(prefixes, jnp.int32), jnp.full((P,), 4, jnp.int32))
    group, string = np.repeat(np.arange(P), N).astype(np.int32), np.tile(np.arange(N), P).astype(np.int32)
    branched = 0
    for _ in range(5):
        num = np.array([rng.randrange(5) for _ in group], np.int32)
        tokens = np.array([[rng.randrange(4) for _ in range(4)] for _ in group], np.int32)
        state = extend_rows(state, group, string, tokens, num)
        for b in range(len(group)):
            host.append(int(group[b]), int(string[b]), tokens[b, : num[b]].tolist())
        out = [np.asarray(x) for x in draft_paths(state, group, string, k=depth, paths=paths)]
        for b in range(len(group)):
            texts, x = host.texts[group[b]], host.texts[group[b]][string[b]]
            taken: set[int] = set()
            for c in range(paths):
                best, at = 0, None
                for w, t in enumerate(texts):
                    for i in range(len(t) - 1):
                        r = 0
                        while r < 32 and r <= i and r < len(x) and t[i - r] == x[-1 - r]:
                            r += 1
                        if r > best and t[i + 1] not in taken:
                            best, at = r, (w, i)
                assert int(out[1][b, c]) == best, (b, c)
                if best:
                    w, i = at
                    cont = texts[w][i + 1:]
                    assert int(out[2][b, c]) == len(cont)
                    assert out[0][b, c, : min(depth, len(cont))].tolist() == cont[:depth]
                    taken.add(cont[0])
                    branched += c > 0
    assert branched > 20


def test_catch_up_gives_each_string_its_text():
    state = start(gm.GroupMatch.create(2, 3, 10), jnp.asarray([[4, 5], [6, 0]], jnp.int32), jnp.asarray([2, 1]))
    state = extend_rows(state, jnp.asarray([0]), jnp.asarray([1]), jnp.asarray([[9, 9, 9]]), jnp.asarray([3]))
    texts = np.zeros((2, 3, 12), np.int32)
    lengths = np.array([[4, 3, 2], [12, 1, 3]], np.int32)
    texts[0, 0, :4], texts[0, 1, :3], texts[0, 2, :2] = [4, 5, 1, 2], [4, 5, 9], [4, 5]  # string (0, 1) has 5
    texts[1, 0], texts[1, 2, :3] = np.arange(12), [6, 7, 8]
    out = jax.jit(gm.catch_up)(state, jnp.asarray(texts), jnp.asarray(lengths))
    text_len, lost = np.asarray(out.text_len), np.asarray(out.lost)
    assert text_len.tolist() == [[4, 5, 2], [10, 1, 3]]
    assert np.asarray(out.texts)[0, 1, :5].tolist() == [4, 5, 9, 9, 9], "a longer string keeps its text"
    assert np.asarray(out.texts)[0, 0, :4].tolist() == [4, 5, 1, 2]
    assert lost.tolist() == [[False, False, False], [True, False, False]], "12 tokens do not fit in 10"
    tokens, match_len, _ = draft_rows(out, jnp.asarray([1]), jnp.asarray([0]), k=2)
    assert int(match_len[0]) == 0, "a lost string drafts nothing"
    # String (0, 2) is lost by an append past T; catching up with a text that would fit does not grow it.
    lost_one = extend_rows(out, jnp.asarray([0]), jnp.asarray([2]), jnp.asarray([[1] * 9]), jnp.asarray([9]))
    again = jax.jit(gm.catch_up)(lost_one, jnp.asarray(texts).at[0, 2, 2].set(7), jnp.asarray(lengths).at[0, 2].set(3))
    assert bool(np.asarray(lost_one.lost)[0, 2]) and np.asarray(again.text_len)[0, 2] == 2, \
        "a lost string stops growing, in catch_up as in extend_rows"


def test_group_sam_index_choice_and_bad_values():
    make = lambda **kw: GroupSamProposer(4, group_size=2, prompt_width=8, buffer_len=8, **kw)  # noqa: E731
    assert make().uses_match_index
    assert not make(max_tokens=12).uses_match_index, "a bounded capacity is the automaton's"
    assert not make(index="automaton").uses_match_index
    assert make().index_bytes() < make(index="automaton").index_bytes()
    assert make(paths=2).max_depth == 2 and make().max_depth == 4
    for kw, message in ((dict(index="trie"), "index='trie'"), (dict(index="match", max_tokens=12), "max_tokens=12"),
                        (dict(max_match=0), "max_match=0"), (dict(paths=3), "paths=3"),
                        (dict(paths=2, index="automaton"), "paths=2")):
        with pytest.raises(ValueError, match=message):
            make(**kw)
    assert SpecConfig(method="group_sam", tree_top_k=2).tree_top_k == 2
    for kw, message in ((dict(tree_top_k=3), "tree_top_k=3"), (dict(tree_top_k=2, tree_depth=4), "tree_depth=4"),
                        (dict(tree_top_k=2, sam_index="automaton"), "sam_index='automaton'")):
        with pytest.raises(ValueError, match=message):
            SpecConfig(method="group_sam", **kw)
