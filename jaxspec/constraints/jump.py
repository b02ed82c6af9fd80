"""Forced text: where a constraint leaves one way to go for several bytes, the tokens that write it.

A byte-level automaton over a BPE vocabulary rarely leaves exactly one legal *token*: after `{"` a JSON key can
be written as one token or as several, so every split is legal. It often leaves exactly one legal *text*: the
key, the `": ` after it, the `, "` before the next. A state forces its next byte when every legal token starts
with that byte (and the state is not final); following single-byte transitions gives the whole forced text.
Drafting the first token of that text (jump-forward decoding) is speculation no model offers: verification
accepts it whenever the target writes the text the same way.

Which way that is: a model writes minified JSON with the tokens of the spaced JSON it mostly saw, `":` and then
`"` rather than the tokenizer's own `":"` (measured on the default model: in five extraction requests, every
string-valued key drafted with `":"` had it rejected for `":`). So the text is encoded in pieces that end after
each `:` and `,`, and no drafted token spans a separator and what follows it. A one-byte forced text is drafted
too: after `":` the opening `"` of a string value is forced, though `"Tom` and a thousand other tokens starting
with it are legal.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

MAX_FORCED_BYTES = 64  # forced text followed from a state, at most
_SEPARATORS = b":,"  # a drafted token ends after one of these (JSON's, where spaced JSON puts a space)


def first_piece(text: bytes) -> bytes:
    """`text` up to and including its first separator (all of it if none): what the first drafted token is
    taken from."""
    ends = [i for i in (text.find(c) for c in _SEPARATORS) if i >= 0]
    return text[: min(ends) + 1] if ends else text


def jump_tokens(keys: np.ndarray, nxt: np.ndarray, final: np.ndarray, vocab_size: int,
                token_bytes: Sequence[bytes | None], encode: Callable[[str], list[int]]) -> np.ndarray:
    """i32[S] per state the first token of its forced text (`encode` of its `first_piece`), or -1: no forced
    text, a text that is not whole UTF-8 characters, or a first token the state does not allow.

    keys i32[E] (sorted state * V + token) and nxt i32[E] are the automaton's transitions, final bool[S];
    token_bytes[t] is token t's bytes (None: never produced)."""
    num_states = final.shape[0]
    first_byte = np.full(vocab_size, -1, np.int64)  # i64[V] each token's first byte (-1: none)
    single = {}  # byte -> the token that is that byte alone
    for t, data in enumerate(token_bytes):
        if data:
            first_byte[t] = data[0]
            if len(data) == 1:
                single[data[0]] = t
    starts = np.searchsorted(keys, np.arange(num_states + 1, dtype=np.int64) * vocab_size)  # i64[S+1] edge ranges

    def edges(s: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = starts[s], starts[s + 1]
        return keys[lo:hi] - s * vocab_size, nxt[lo:hi]

    def forced_byte(s: int) -> tuple[int, int] | None:
        """(the byte state s forces, the state after it) or None."""
        if final[s]:
            return None
        tokens, after = edges(s)
        firsts = np.unique(first_byte[tokens])
        if firsts.size != 1 or firsts[0] < 0 or int(firsts[0]) not in single:
            return None
        b = int(firsts[0])
        at = np.flatnonzero(tokens == single[b])
        return (b, int(after[at[0]])) if at.size else None

    step = [forced_byte(s) for s in range(num_states)]
    jump = np.full(num_states, -1, np.int32)
    for s in range(num_states):
        text, state = bytearray(), s
        while step[state] is not None and len(text) < MAX_FORCED_BYTES and state >= 0:
            b, state = step[state]
            text.append(b)
        if not text:
            continue
        try:
            ids = encode(first_piece(bytes(text)).decode("utf-8"))
        except UnicodeDecodeError:
            continue
        if ids and ids[0] in set(edges(s)[0].tolist()):
            jump[s] = ids[0]
    return jump
