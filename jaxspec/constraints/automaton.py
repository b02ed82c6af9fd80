"""A token-level automaton on the device and the pure functions the decode loop calls on it.

A row's constraint state is an i32: a state of the automaton (>= 0), or
  FREE = -1  the row has no constraint: every token is legal and advancing stays FREE;
  DEAD = -2  a token the state did not allow was taken (only along a draft that verification rejects): every
             token is legal, so masked logits are never all -inf, and advancing stays DEAD.
A state >= num_states is treated as DEAD.

Layout (`TokenAutomaton`; S states, E legal (state, token) pairs, W = ceil(V / 32) words per state):
  allowed u32[S, W]  bit t % 32 of word t // 32 set: token t is legal in the state (a mask row costs V / 8 bytes)
  keys    i32[E]     sorted state * V + token of every legal pair: `advance` binary-searches it (log2 E probes)
  next    i32[E]     the state after keys[e]'s token
  final   bool[S]    the text so far matches completely: EOS is legal (and keeps the state)
  forced  i32[S]     the only legal token, or -1 (precomputed on the host)
  jump    i32[S]     where the constraint forces a text (a JSON key, `":`, a string's opening `"`) though not one
                     token: the first token a model likely writes it with, or -1 (`jaxspec.constraints.jump`)
A dense [S, V] next-state table would be S * V * 4 bytes (a 160-state JSON schema: 31 MB at V = 49152); the
pairs are E * 8 (a JSON string state allows ~48k tokens, so a schema with a few strings has E ~ 10**5: ~1 MB).
int32 keys need S * V < 2**31 (S < 43690 at V = 49152): `check_key_range`. `stack` pads keys with 2**31 - 1
(next DEAD), which sorts last and matches no lookup, and pads states with rows that allow nothing.

Each device automaton made by `to_device` keeps its numpy twin (`host_twin`), so that `stack` builds batches
on the host with no device work but one transfer.
"""

from __future__ import annotations

import dataclasses
import weakref

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .tables import check_key_range as check_key_range  # re-exported: stack and tests use it here

FREE = -1  # no constraint
DEAD = -2  # an illegal token was taken
INITIAL = 0  # the initial state of a compiled automaton


class _Sizes:
    """Sizes shared by the device automaton and its numpy twin (same field names)."""

    @property
    def num_states(self) -> int:
        return self.allowed.shape[0]

    @property
    def num_edges(self) -> int:
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.allowed, self.keys, self.next, self.final, self.forced, self.jump))


@flax.struct.dataclass
class TokenAutomaton(_Sizes):
    """Legal tokens and transitions of one or more token-level automata (see the module docstring)."""

    allowed: jax.Array  # u32[S, W]
    keys: jax.Array  # i32[E]  sorted state * vocab_size + token
    next: jax.Array  # i32[E]
    final: jax.Array  # bool[S]
    forced: jax.Array  # i32[S]
    jump: jax.Array  # i32[S]
    vocab_size: int = flax.struct.field(pytree_node=False)



@dataclasses.dataclass(frozen=True, eq=False)
class HostAutomaton(_Sizes):
    """A `TokenAutomaton`'s arrays in numpy (the same layout)."""

    allowed: np.ndarray  # u32[S, W]
    keys: np.ndarray  # i32[E]
    next: np.ndarray  # i32[E]
    final: np.ndarray  # bool[S]
    forced: np.ndarray  # i32[S]
    jump: np.ndarray  # i32[S]
    vocab_size: int



_twins: dict[int, HostAutomaton] = {}  # id(device automaton) -> its host arrays, while it lives


def to_device(host: HostAutomaton) -> TokenAutomaton:
    """The device copy of `host` (one transfer per array), remembered as its twin."""
    put = jax.device_put
    aut = TokenAutomaton(allowed=put(host.allowed), keys=put(host.keys), next=put(host.next),
                         final=put(host.final), forced=put(host.forced), jump=put(host.jump),
                         vocab_size=host.vocab_size)
    _twins[id(aut)] = host
    weakref.finalize(aut, _twins.pop, id(aut), None)
    return aut


def host_twin(aut: TokenAutomaton) -> HostAutomaton:
    """The numpy arrays of `aut`: its twin if `to_device` made it, else copied from the device."""
    twin = _twins.get(id(aut))
    if twin is None:
        twin = HostAutomaton(*(np.asarray(a) for a in (aut.allowed, aut.keys, aut.next, aut.final, aut.forced,
                                                       aut.jump)), vocab_size=aut.vocab_size)
    return twin


def _row(aut: TokenAutomaton, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(bool[...] the state is a real one, i32[...] a safe index into the per-state arrays)."""
    state = jnp.asarray(state, jnp.int32)
    real = (state >= 0) & (state < aut.num_states)
    return real, jnp.clip(state, 0, aut.num_states - 1)


def allowed_mask(aut: TokenAutomaton, state: jax.Array) -> jax.Array:
    """bool[..., V] the tokens legal in each state i32[...] (every token for FREE and DEAD)."""
    real, row = _row(aut, state)
    words = aut.allowed[row]  # u32[..., W]
    bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1  # u32[..., W, 32]
    mask = bits.reshape(*words.shape[:-1], -1)[..., :aut.vocab_size] != 0  # bool[..., V]
    return mask | ~real[..., None]


def mask_logits(aut: TokenAutomaton, state: jax.Array, logits: jax.Array) -> jax.Array:
    """logits f[..., V] with the tokens illegal in state i32[...] set to -inf."""
    return jnp.where(allowed_mask(aut, state), logits, -jnp.inf)


def advance(aut: TokenAutomaton, state: jax.Array, token: jax.Array) -> jax.Array:
    """i32[...] the state after `token` i32[...] in `state` i32[...] (broadcast): FREE and DEAD stay; a token
    the state does not allow (negative or >= V included) gives DEAD."""
    state = jnp.asarray(state, jnp.int32)
    token = jnp.asarray(token, jnp.int32)
    real, row = _row(aut, state)
    legal_id = (token >= 0) & (token < aut.vocab_size)
    key = row * aut.vocab_size + jnp.clip(token, 0, aut.vocab_size - 1)  # < S * V <= 2**31 - 1
    at = jnp.minimum(jnp.searchsorted(aut.keys, key), aut.num_edges - 1)
    found = legal_id & (aut.keys[at] == key)
    return jnp.where(real, jnp.where(found, aut.next[at], DEAD), jnp.where(state == FREE, FREE, DEAD))


def states_along(aut: TokenAutomaton, state: jax.Array, tokens: jax.Array,
                 parents: jax.Array | None = None) -> jax.Array:
    """i32[B, T+1] the states of a draft: column 0 is `state` i32[B], column i+1 the state after tokens[:, i]
    (i32[B, T]). A chain by default; with `parents` i32[B, T] (jaxspec.tree's layout: node i+1 holds
    tokens[:, i] and hangs under node parents[:, i] in [0, i]) the state after each tree node's path.

    Column j is the state whose `allowed_mask` judges the token after node j."""
    state = jnp.asarray(state, jnp.int32)
    tokens = jnp.asarray(tokens, jnp.int32)
    batch, num = tokens.shape
    if parents is None:
        def step(s, tok):
            s = advance(aut, s, tok)
            return s, s

        _, after = jax.lax.scan(step, state, tokens.T)  # i32[T, B]
        return jnp.concatenate([state[:, None], after.T], axis=1)

    parents = jnp.clip(jnp.asarray(parents, jnp.int32), 0, num)
    rows = jnp.arange(batch)

    def node(i, states):
        prev = states[rows, parents[:, i]]
        return states.at[:, i + 1].set(advance(aut, prev, tokens[:, i]))

    init = jnp.full((batch, num + 1), DEAD, jnp.int32).at[:, 0].set(state)
    return jax.lax.fori_loop(0, num, node, init)


def advance_many(aut: TokenAutomaton, state: jax.Array, tokens: jax.Array, num: jax.Array) -> jax.Array:
    """i32[B] each row's state i32[B] after the first num[b] (clipped to [0, T]) of its tokens i32[B, T]."""
    path = states_along(aut, state, tokens)  # i32[B, T+1]
    num = jnp.clip(jnp.asarray(num, jnp.int32), 0, path.shape[1] - 1)
    return jnp.take_along_axis(path, num[:, None], axis=1)[:, 0]


def forced_token(aut: TokenAutomaton, state: jax.Array) -> jax.Array:
    """i32[...] the only token legal in each state i32[...], or -1 (several legal, or FREE/DEAD)."""
    real, row = _row(aut, state)
    return jnp.where(real, aut.forced[row], -1)


def jump_token(aut: TokenAutomaton, state: jax.Array) -> jax.Array:
    """i32[...] the first token of the text each state i32[...] forces, as a model likely writes it, or -1."""
    real, row = _row(aut, state)
    return jnp.where(real, aut.jump[row], -1)


def is_final(aut: TokenAutomaton, state: jax.Array) -> jax.Array:
    """bool[...] the output so far is complete (a real final state, or FREE); DEAD is not."""
    real, row = _row(aut, state)
    return jnp.where(real, aut.final[row], jnp.asarray(state) == FREE)
