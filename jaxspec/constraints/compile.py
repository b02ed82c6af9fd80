"""Specs -> token automata, through a bounded compile: cheap limit checks, then a worker process, then the device.

The vocabulary outlines-core sees maps each token's bytes (a byte-level token's characters mapped back to the
bytes they stand for, `Tokenizer.token_bytes`) to its ids; special tokens (`<|im_start|>`, ...) are left out,
the EOS ids are legal exactly in final states. outlines-core takes one EOS id (the tokenizer's `eos_token_id`);
the tokenizer's other end ids (`eos_token_ids`, which the decode loop stops at too) are added as aliases.

`compile_constraint(spec, tokenizer, vocab_size, limits)`:
  1. checks the spec against `limits` from its text alone (`jaxspec.constraints.limits`: milliseconds);
  2. looks it up in the cache, keyed by (spec, the vocabulary's fingerprint, vocab_size) and bounded by the
     bytes of the automata it holds (LRU), and in a smaller cache of the specs refused before;
  3. has a worker process build the regex (a schema's) and outlines-core's Index, check the automaton's size
     and return its tables, within the time and memory budget (`jaxspec.constraints.compiler`);
  4. computes the forced texts (`jump`, which needs the tokenizer) and moves the automaton to the device.
An equal spec then returns the same object. The fingerprint (a hash of every token's bytes and the EOS ids) is
computed once per tokenizer object.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading
import weakref
from typing import TYPE_CHECKING, Any

from .automaton import HostAutomaton, TokenAutomaton, to_device
from .compiler import CompileCancelled, Compiler
from .jump import jump_tokens
from .limits import (
    ConstraintLimits,
    ConstraintTooLarge,
    check_automaton,
    check_options,
    check_regex,
    check_schema,
    shown,
)
from .spec import Choice, JsonSchema, Regex

if TYPE_CHECKING:
    from jaxspec.models.tokenizer import Tokenizer

DEFAULT_LIMITS = ConstraintLimits()
CACHE_BYTES = 512 << 20  # compiled automata kept, device arrays and their host twins counted
_REFUSALS = 256  # refused specs remembered, so a client repeating one is refused at once
_POLL_S = 0.05  # how often a caller waiting for another's compile of the same spec looks at its cancel event


@dataclasses.dataclass(frozen=True)
class HostVocabulary:
    """What outlines-core needs from a tokenizer, built once per vocabulary."""

    fingerprint: str  # sha256 of the token bytes, the left-out ids and the EOS ids
    tokens: dict  # {token bytes: [ids]}: outlines-core's Vocabulary, built in the worker from it
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
    return HostVocabulary(digest.hexdigest(), tokens, eos, num_tokens, tuple(token_bytes), tokenizer.encode)


class AutomatonCache:
    """Compiled automata by key, least recently used first out once they hold more than `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0  # held now
        self._items: collections.OrderedDict = collections.OrderedDict()  # key -> (automaton, bytes)
        self._lock = threading.Lock()

    def get(self, key) -> TokenAutomaton | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key, automaton: TokenAutomaton) -> None:
        size = 2 * automaton.nbytes  # the device arrays and their host twin (`stack` reads it)
        with self._lock:
            if key in self._items:
                self.bytes -= self._items.pop(key)[1]
            self._items[key] = (automaton, size)
            self.bytes += size
            while self.bytes > self.max_bytes and len(self._items) > 1:
                self.bytes -= self._items.popitem(last=False)[1][1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)


compiler = Compiler()  # the worker processes every compile goes through
automata = AutomatonCache(CACHE_BYTES)
_refused: collections.OrderedDict = collections.OrderedDict()  # (key, limits) -> a function raising the error
_compiling: dict = {}  # key -> threading.Event set when the compile under way for it ends


def compile_constraint(spec: Regex | JsonSchema | Choice, tokenizer: Tokenizer, vocab_size: int,
                       limits: ConstraintLimits | None = None,
                       cancel: threading.Event | None = None) -> TokenAutomaton:
    """The device automaton of `spec` over `tokenizer`'s vocabulary, masks `vocab_size` wide (the model's
    vocabulary, >= the tokenizer's; ids the tokenizer never produces are never legal). Starts at `INITIAL`.

    Cached: an equal spec over an equal vocabulary returns the same object. ConstraintTooLarge (a ValueError)
    for a spec beyond `limits` (default `ConstraintLimits()`) or its compile's budget, ValueError for one
    outlines-core cannot compile, or a vocab_size too small; CompilerBusy when too many compiles wait,
    CompileCancelled when `cancel` is set before the compile ends (its worker is killed).
    """
    if not isinstance(spec, (Regex, JsonSchema, Choice)):
        raise ValueError(f"spec must be a Regex, JsonSchema or Choice, got {shown(repr(spec))}")
    limits = DEFAULT_LIMITS if limits is None else limits
    if not isinstance(limits, ConstraintLimits):
        raise ValueError(f"limits must be a ConstraintLimits, got {shown(repr(limits))}")
    vocab = host_vocabulary(tokenizer)
    vocab_size = int(vocab_size)
    if vocab_size < vocab.num_tokens:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {vocab.num_tokens} tokens")
    job = worker_job(spec, limits)
    key = (spec, vocab.fingerprint, vocab_size)
    found = automata.get(key)
    if found is None:
        found = _compile(key, job, vocab, limits, cancel)
    check_automaton(found.num_states, found.num_edges, limits, job["what"])
    return found


def _compile(key, job: dict, vocab: HostVocabulary, limits: ConstraintLimits,
             cancel: threading.Event | None) -> TokenAutomaton:
    """The automaton of `key`, compiled once however many threads ask for it at the same time: the first one
    compiles, the others wait for it (a second compile of the same spec would hold a worker as long again and
    every other constraint behind it), then take its automaton or its refusal."""
    while True:
        refusal = _refused.get((key, limits))
        if refusal is not None:
            refusal()
        found = automata.get(key)
        if found is not None:
            return found
        with _lock:
            done = _compiling.get(key)
            leader = done is None
            if leader:
                done = _compiling[key] = threading.Event()
        if leader:
            try:
                return _compile_once(key, job, vocab, limits, cancel)
            finally:
                with _lock:
                    del _compiling[key]
                done.set()
        while not done.wait(_POLL_S):  # then look again: the leader's automaton, its refusal, or a turn to lead
            if cancel is not None and cancel.is_set():
                raise CompileCancelled("the compile was cancelled while the same spec compiled for another caller")


def _compile_once(key, job: dict, vocab: HostVocabulary, limits: ConstraintLimits,
                  cancel: threading.Event | None) -> TokenAutomaton:
    job = dict(job, fingerprint=vocab.fingerprint, eos=vocab.eos_token_ids, vocab_size=key[2])
    with compiler.slot(cancel) as worker:
        found = automata.get(key)  # compiled while this one waited for a worker
        if found is not None:
            return found
        try:
            tables = worker.run(job, (vocab.eos_token_ids[0], vocab.tokens), limits, cancel)
        except ValueError as e:
            _refuse((key, limits), e)
            raise
    jump = jump_tokens(tables["keys"], tables["next"], tables["final"], key[2], vocab.token_bytes, vocab.encode)
    aut = to_device(HostAutomaton(**tables, jump=jump, vocab_size=key[2]))
    automata.put(key, aut)
    return aut


def _refuse(key, error: ValueError) -> None:
    """Remember that `key` was refused with `error`: the next try raises an equal error at once."""
    message = str(error)
    if isinstance(error, ConstraintTooLarge):
        limit, maximum, value = error.limit, error.maximum, error.value

        def again() -> None:
            raise ConstraintTooLarge(message, limit, maximum, value)
    else:
        def again() -> None:
            raise ValueError(message)
    with _lock:
        _refused[key] = again
        while len(_refused) > _REFUSALS:
            _refused.popitem(last=False)


def worker_job(spec: Regex | JsonSchema | Choice, limits: ConstraintLimits) -> dict:
    """What the worker compiles for `spec` ({"regex"} or {"schema", "whitespace"}, "what" and the limits),
    once its cheap checks pass: ConstraintTooLarge naming the limit and the offending part otherwise."""
    what = shown(repr(spec), 120)
    if isinstance(spec, JsonSchema):
        try:
            schema = json.loads(spec.schema)
        except RecursionError:
            raise limits.refuse("max_schema_depth", "too deep for the JSON parser",
                                f"JSON schema {spec.schema!r}") from None
        check_schema(spec.schema, schema, limits)
        check_regex(spec.whitespace, limits, "whitespace pattern")
        job = {"schema": spec.schema, "whitespace": spec.whitespace}
    else:
        if isinstance(spec, Choice):
            check_options(list(spec.options), limits)
        regex = spec.regex()
        check_regex(regex, limits, "Choice regex" if isinstance(spec, Choice) else "regex")
        job = {"regex": regex}
    return dict(job, what=what, limits=dataclasses.asdict(limits))


def clear_cache() -> None:
    """Forget every compiled automaton and every refusal (the vocabularies stay)."""
    automata.clear()
    with _lock:
        _refused.clear()


__all__ = ["AutomatonCache", "CACHE_BYTES", "DEFAULT_LIMITS", "HostVocabulary", "automata", "clear_cache",
           "compile_constraint", "compiler", "host_vocabulary", "worker_job"]
