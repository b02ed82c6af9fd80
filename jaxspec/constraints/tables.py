"""An outlines-core Index as the arrays of a token automaton, in numpy (the layout of `automaton`).

States are renumbered densely, the initial state first, so every compiled automaton starts at state
0 = `INITIAL`; `forced` counts outlines-core's EOS but not its aliases (the tokenizer's other end ids, legal
wherever that EOS is and leading to the same state).

This module imports numpy and the standard library alone: the compile worker, which never imports jaxspec (nor
jax), loads it by path, builds the tables there and sends them back.
"""

from __future__ import annotations

import numpy as np

MAX_KEY = 2**31 - 1  # keys (state * V + token) are int32; also the padding key, above every real one
FIELDS = ("allowed", "keys", "next", "final", "forced")  # the arrays `index_tables` returns


def check_key_range(num_states: int, vocab_size: int) -> None:
    """ValueError unless every key state * vocab_size + token fits int32 below the padding key."""
    if num_states * vocab_size > MAX_KEY:
        raise ValueError(f"{num_states} states at vocab_size={vocab_size} overflow int32 keys: at most "
                         f"{MAX_KEY // vocab_size} states fit")


def index_tables(transitions: dict, initial: int, finals, eos_token_ids: tuple[int, ...],
                 vocab_size: int) -> dict[str, np.ndarray]:
    """The arrays (FIELDS) of an outlines-core Index given as its transitions {state: {token: next state}},
    initial state and final states; `eos_token_ids[1:]` become aliases of its EOS."""
    reached = {n for row in transitions.values() for n in row.values()}
    old = np.array(sorted((set(transitions) | reached) - {initial}), np.int64)
    old = np.concatenate([[initial], old])  # new id = position: the initial state is 0 (INITIAL)
    num_states = len(old)
    check_key_range(num_states, vocab_size)
    order = np.argsort(old, kind="stable")

    def renumber(states: np.ndarray) -> np.ndarray:
        return order[np.searchsorted(old[order], states)]

    counts = [len(transitions.get(int(s), ())) for s in old]
    total = sum(counts)
    tok = np.empty(total, np.int64)
    dst = np.empty(total, np.int64)
    at = 0
    for s, n in zip(old, counts):
        if n:
            row = transitions[int(s)]
            tok[at:at + n] = np.fromiter(row.keys(), np.int64, n)
            dst[at:at + n] = np.fromiter(row.values(), np.int64, n)
            at += n
    src = np.repeat(np.arange(num_states, dtype=np.int64), counts)
    dst = renumber(dst)
    final = np.zeros(num_states, bool)
    final[renumber(np.array(sorted(finals), np.int64))] = True
    if tok.size and (tok.min() < 0 or tok.max() >= vocab_size):
        raise ValueError(f"outlines-core gave token {int(tok.max())} outside vocab_size={vocab_size}")

    # forced: outlines-core's allowed set has exactly one token (EOS included, its aliases not).
    forced = np.full(num_states, -1, np.int32)
    single = np.flatnonzero(np.asarray(counts) == 1)
    forced[single] = tok[np.searchsorted(src, single)]

    # Every EOS id is legal in every final state and keeps it.
    ends = np.flatnonzero(final)
    eos = np.asarray(eos_token_ids, np.int64)
    src = np.concatenate([src, np.repeat(ends, len(eos))])
    tok = np.concatenate([tok, np.tile(eos, len(ends))])
    dst = np.concatenate([dst, np.repeat(ends, len(eos))])
    keys, first = np.unique(src * vocab_size + tok, return_index=True)  # sorted, one per (state, token)
    src, tok, dst = src[first], tok[first], dst[first]

    stuck = np.setdiff1d(np.flatnonzero(~final), src)
    if stuck.size:  # outlines-core rejects such regexes itself; a mask with no legal token would be NaN
        raise ValueError(f"state {int(stuck[0])} is not final and allows no token")

    words = -(-vocab_size // 32)
    bits = np.bincount(src * words + tok // 32, weights=np.left_shift(1, tok % 32).astype(np.float64),
                       minlength=num_states * words)  # distinct bits per word: the sum is the OR (< 2**32, exact)
    allowed = bits.astype(np.uint32).reshape(num_states, words)  # u32[S, W]
    return {"allowed": allowed, "keys": keys.astype(np.int32), "next": dst.astype(np.int32), "final": final,
            "forced": forced}
