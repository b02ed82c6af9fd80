"""One automaton for a batch whose rows have different constraints, or none.

`stack` concatenates the distinct automata (states offset, keys shifted by offset * V, so they stay sorted) on
the host from their numpy twins and transfers the result once: no XLA program is compiled, whatever the mix.
Sizes are padded (padding states allow nothing and nothing reaches them; padding keys sort last and match no
lookup) because the decode loop compiles once per shape: to powers of two, so it sees few shapes, or to a fixed
`capacity`, so it sees one (the engine's: a new constraint then never compiles a program).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .automaton import DEAD, FREE, INITIAL, HostAutomaton, TokenAutomaton, check_key_range, host_twin
from .automaton import to_device as _to_device
from .tables import MAX_KEY as _MAX_KEY


def _bucket(n: int, cap: int) -> int:
    """The power of two >= n (at least 8), but at most `cap` unless n itself is more."""
    return max(n, min(max(8, 1 << max(n - 1, 0).bit_length()), cap))


def used_size(automata: Sequence[TokenAutomaton | None]) -> tuple[int, int]:
    """(states, edges) the distinct automata of `automata` (by identity; None entries free) take in a stack, at
    most (a stacked entry's padding edges are counted, though `stack` drops them)."""
    unique = {id(a): a for a in automata if a is not None}.values()
    return sum(a.num_states for a in unique), sum(a.num_edges for a in unique)


def stack(automata: Sequence[TokenAutomaton | None], *, vocab_size: int | None = None,
          pad: bool = True, capacity: tuple[int, int] | None = None) -> tuple[TokenAutomaton, jax.Array]:
    """(one automaton holding each distinct compiled automaton of `automata`, i32[B] each entry's initial state
    in it: FREE for None). Distinct is by identity: `compile_constraint` returns one object per spec. (A stacked
    automaton given as an entry is taken whole; its entry's initial state is its state 0.)

    `vocab_size` is needed only when every entry is None (the result then has one state, which nothing reaches).
    With `pad` the state and pair counts are rounded up to powers of two; with `capacity` (states, pairs) they
    are exactly that (ValueError naming it when the automata need more).
    """
    entries = list(automata)
    unique: list[TokenAutomaton] = []
    index: dict[int, int] = {}
    for a in entries:
        if a is None or id(a) in index:
            continue
        if not isinstance(a, TokenAutomaton):
            raise ValueError(f"stack takes TokenAutomaton or None entries, got {type(a).__name__}")
        index[id(a)] = len(unique)
        unique.append(a)
    sizes = {a.vocab_size for a in unique} | ({int(vocab_size)} if vocab_size is not None else set())
    if len(sizes) != 1:
        raise ValueError(f"stack needs one vocab_size, got {sorted(sizes) or 'none'} "
                         "(pass vocab_size= when every entry is None)")
    v = sizes.pop()
    offsets = np.cumsum([0] + [a.num_states for a in unique])
    hosts = [host_twin(a) for a in unique]
    edges = [h.keys != _MAX_KEY for h in hosts]  # a stacked entry's padding pairs are dropped (not shifted)
    used_s, used_e = int(offsets[-1]), sum(int(e.sum()) for e in edges)
    if capacity is not None:
        total_s, total_e = (int(c) for c in capacity)
        if used_s > total_s or used_e > total_e or min(total_s, total_e) < 1:
            raise ValueError(f"the automata need {used_s} states and {used_e} edges; capacity={capacity} holds "
                             f"{total_s} and {total_e}")
    else:
        total_s = _bucket(max(used_s, 1), _MAX_KEY // v) if pad else max(used_s, 1)
        total_e = _bucket(max(used_e, 1), 1 << 31) if pad else max(used_e, 1)
    check_key_range(total_s, v)
    initial = jnp.asarray([FREE if a is None else INITIAL + int(offsets[index[id(a)]]) for a in entries], jnp.int32)
    if len(unique) == 1 and (total_s, total_e) == (unique[0].num_states, unique[0].num_edges):
        return unique[0], initial

    pad_s, pad_e = total_s - used_s, total_e - used_e
    words = -(-v // 32)
    host = HostAutomaton(
        allowed=np.concatenate([h.allowed for h in hosts] + [np.zeros((pad_s, words), np.uint32)]),
        keys=np.concatenate([h.keys[e] + np.int32(o * v) for h, e, o in zip(hosts, edges, offsets)]
                            + [np.full(pad_e, _MAX_KEY, np.int32)]),
        next=np.concatenate([h.next[e] + np.int32(o) for h, e, o in zip(hosts, edges, offsets)]
                            + [np.full(pad_e, DEAD, np.int32)]),
        final=np.concatenate([h.final for h in hosts] + [np.zeros(pad_s, bool)]),
        forced=np.concatenate([h.forced for h in hosts] + [np.full(pad_s, -1, np.int32)]),
        jump=np.concatenate([h.jump for h in hosts] + [np.full(pad_s, -1, np.int32)]),
        vocab_size=v,
    )
    return _to_device(host), initial
