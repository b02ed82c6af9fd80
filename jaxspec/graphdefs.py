"""NNX graph definitions as static jit arguments, hashed once.

jit hashes its static arguments on every call to find the compiled program, and flax hashes an `nnx.GraphDef`
by walking all its nodes each time, a cost on the order of a millisecond for SmolLM2 on a CPU, paid by every
decode chunk, prefill and proposer call that takes the model's graph definition. `hashed(graphdef)` returns an
equal-valued graph definition that computes its hash once and keeps it; everything else (nnx.merge, equality
between two of them, use as a static argument) is the GraphDef's own.
"""

from __future__ import annotations

import jax
from flax import nnx


@jax.tree_util.register_static
class HashedGraphDef(nnx.GraphDef):
    """An `nnx.GraphDef` whose hash is computed on first use and kept (the definition is immutable)."""

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = super().__hash__()
            object.__setattr__(self, "_hash", cached)  # the dataclass is frozen; the hash is not one of its fields
        return cached


def hashed(graphdef):
    """`graphdef` as a HashedGraphDef (itself when it already is one; anything else that is not a GraphDef too)."""
    if isinstance(graphdef, HashedGraphDef) or not isinstance(graphdef, nnx.GraphDef):
        return graphdef
    return HashedGraphDef(nodes=graphdef.nodes, attributes=graphdef.attributes, num_leaves=graphdef.num_leaves)
