"""Specs -> outlines-core token automata -> host arrays -> a `TokenAutomaton` on the device, cached.

The vocabulary outlines-core sees maps each token's bytes (a byte-level token's characters mapped back to the
bytes they stand for, `Tokenizer.token_bytes`) to its ids; special tokens (`<|im_start|>`, ...) are left out,
the EOS ids are legal exactly in final states. outlines-core takes one EOS id (the tokenizer's `eos_token_id`);
the tokenizer's other end ids (`eos_token_ids`, which the decode loop stops at too) are added as aliases: legal
wherever that EOS is, leading to the same state.

outlines-core's Index (its transitions as {state: {token: next state}}) becomes numpy arrays in the layout of
`automaton` (states renumbered densely, the initial state first, so every compiled automaton starts at state
0 = `INITIAL`; `forced` counts outlines-core's EOS but not its aliases), then one transfer to the device.

`compile_constraint(spec, tokenizer, vocab_size)` is cached by (spec, the tokenizer's vocabulary fingerprint,
vocab_size): a second call with an equal spec returns the same object. The fingerprint (a hash of every token's
bytes and the EOS ids) is computed once per tokenizer object.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import outlines_core

from .automaton import HostAutomaton, TokenAutomaton, check_key_range, to_device
from .jump import jump_tokens
from .spec import Choice, JsonSchema, Regex

if TYPE_CHECKING:
    from jaxspec.models.tokenizer import Tokenizer

_CACHE_SIZE = 128  # compiled automata kept (each a few MB at V = 49152)


@dataclasses.dataclass(frozen=True)
class HostVocabulary:
    """What outlines-core needs from a tokenizer, built once per vocabulary."""

    fingerprint: str  # sha256 of the token bytes, the left-out ids and the EOS ids
    vocabulary: outlines_core.Vocabulary
    eos_token_ids: tuple[int, ...]  # eos_token_ids[0] is the one outlines-core knows
    num_tokens: int  # ids the tokenizer produces: [0, num_tokens)
    token_bytes: tuple = ()  # token_bytes[t]: token t's bytes (None for special tokens and EOS)
    encode: Any = None  # the tokenizer's text -> ids, for forced texts (`jump`)


_lock = threading.Lock()
_by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> HostVocabulary
_by_fingerprint: dict[str, HostVocabulary] = {}


def host_vocabulary(tokenizer: Tokenizer) -> HostVocabulary:
    """The outlines-core vocabulary of a jaxspec `Tokenizer` (byte-level BPE), once per tokenizer object."""
    vocab = _by_tokenizer.get(tokenizer)
    if vocab is not None:
        return vocab
    with _lock:
        vocab = _by_tokenizer.get(tokenizer)
        if vocab is None:
            vocab = _build_vocabulary(tokenizer)
            vocab = _by_fingerprint.setdefault(vocab.fingerprint, vocab)
            _by_tokenizer[tokenizer] = vocab
    return vocab


def _build_vocabulary(tokenizer: Tokenizer) -> HostVocabulary:
    eos = tuple(int(i) for i in (getattr(tokenizer, "eos_token_ids", None) or ()))
    if not eos:
        raise ValueError(f"tokenizer {tokenizer!r} has no EOS id: a constrained output could never end")
    special = {int(i) for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    num_tokens = int(tokenizer.vocab_size)
    tokens: dict[bytes, list[int]] = {}
    token_bytes: list[bytes | None] = [None] * num_tokens
    digest = hashlib.sha256(repr(eos).encode())
    for i in range(num_tokens):
        if i in special or i in eos:
            digest.update(b"\xff\xff\xff\xff")
            continue
        try:
            data = tokenizer.token_bytes(i)
        except (KeyError, ValueError) as e:
            raise ValueError(f"token {i} ({tokenizer.id_to_token(i)!r}) has no byte form: constraints need a "
                             f"byte-level BPE tokenizer ({e!r})") from None
        digest.update(len(data).to_bytes(4, "little") + data)
        if data:
            tokens.setdefault(data, []).append(i)
            token_bytes[i] = data
    vocabulary = outlines_core.Vocabulary(eos[0], tokens)
    return HostVocabulary(digest.hexdigest(), vocabulary, eos, num_tokens, tuple(token_bytes), tokenizer.encode)


def compile_constraint(spec: Regex | JsonSchema | Choice, tokenizer: Tokenizer, vocab_size: int) -> TokenAutomaton:
    """The device automaton of `spec` over `tokenizer`'s vocabulary, masks `vocab_size` wide (the model's
    vocabulary, >= the tokenizer's; ids the tokenizer never produces are never legal). Starts at `INITIAL`.

    Cached: an equal spec over an equal vocabulary returns the same object. ValueError for a spec outlines-core
    cannot compile over this vocabulary (naming the regex), or a vocab_size too small.
    """
    if not isinstance(spec, (Regex, JsonSchema, Choice)):
        raise ValueError(f"spec must be a Regex, JsonSchema or Choice, got {spec!r}")
    vocab = host_vocabulary(tokenizer)
    return _compile_cached(spec, vocab.fingerprint, int(vocab_size))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compile_cached(spec, fingerprint: str, vocab_size: int) -> TokenAutomaton:
    return to_device(compile_host(spec, _by_fingerprint[fingerprint], vocab_size))


def clear_cache() -> None:
    """Forget every compiled automaton (the vocabularies stay)."""
    _compile_cached.cache_clear()


def compile_host(spec: Regex | JsonSchema | Choice, vocab: HostVocabulary, vocab_size: int) -> HostAutomaton:
    """outlines-core's Index of `spec` as host arrays (uncached)."""
    if vocab_size < vocab.num_tokens:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {vocab.num_tokens} tokens")
    regex = spec.regex()
    try:
        index = outlines_core.Index(regex, vocab.vocabulary)
    except (ValueError, TypeError) as e:
        raise ValueError(f"cannot compile {spec!r} (regex {regex!r}) over this vocabulary: {e}") from None
    host = index_arrays(index, vocab.eos_token_ids, vocab_size)
    if vocab.encode is None:
        return host
    jump = jump_tokens(host.keys, host.next, host.final, vocab_size, vocab.token_bytes, vocab.encode)
    return dataclasses.replace(host, jump=jump)


def index_arrays(index: outlines_core.Index, eos_token_ids: tuple[int, ...], vocab_size: int) -> HostAutomaton:
    """Host arrays of an outlines-core Index; `eos_token_ids[1:]` become aliases of its EOS."""
    transitions = index.get_transitions()  # {state: {token: next state}}
    initial = index.get_initial_state()
    finals = index.get_final_states()
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
    allowed = bits.astype(np.uint32).reshape(num_states, words)
    return HostAutomaton(allowed=allowed, keys=keys.astype(np.int32), next=dst.astype(np.int32), final=final,
                         forced=forced, jump=np.full(num_states, -1, np.int32), vocab_size=vocab_size)


__all__ = ["HostVocabulary", "clear_cache", "compile_constraint", "compile_host", "host_vocabulary", "index_arrays"]
