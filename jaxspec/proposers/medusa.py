"""Medusa: M heads on the target's last feature propose tokens t+2 .. t+M+1 at once, arranged as a static tree.

The newest token x_{t+1} came from the target's LM head at feature h_t; head i maps h_t to the logits of
x_{t+2+i}. Each step takes every head's top-k candidates and lays them into a fixed tree topology
(`TreeTopology`, built best-first from the heads' measured rank accuracies), so one target forward scores
many continuations. Candidates are deterministic (top-k), so sampled rows are verified by the point-mass rule
(the target samples, the tree is followed while it matches): lossless for any candidates.

Over a draft vocabulary (`SpecConfig(draft_vocab=N)`) the heads' top-k runs over N columns of the LM head and
the candidates map back to target ids.

State per row: h_t, the target feature behind the newest token (updated from the verify forward's features).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..tree import TreeTopology, tokens_from_topk
from .base import Committed, Context, Draft, Proposer


@dataclasses.dataclass(frozen=True)
class MedusaProposer(Proposer):
    """Medusa heads drafting a static tree (`SpecConfig(method="medusa")`)."""

    num_speculative_tokens: int  # non-root nodes of the tree
    graphdef: Any  # nnx.GraphDef of MedusaHeads; params = {"head": state, "readout": Readout}
    topology: TreeTopology  # the static tree the candidates are laid into
    needs_features: bool = True  # the loop passes the target's hidden states

    def __post_init__(self):
        if self.topology.num_nodes != self.num_speculative_tokens:
            raise ValueError(f"topology has {self.topology.num_nodes} nodes, num_speculative_tokens="
                             f"{self.num_speculative_tokens}")

    @property
    def max_depth(self) -> int:
        """The tree's depth D: the most drafts one step can accept."""
        return self.topology.max_depth

    @property
    def top_k(self) -> int:
        """Candidates taken from each head: one more than the highest rank the tree uses."""
        return max(self.topology.child_rank) + 1

    def init(self, params, ctx: Context) -> jax.Array:
        """f32[B, D]: the prompt's last feature (it produced the first generated token)."""
        last = ctx.history_len - 2  # history holds prompt + first token
        return jnp.take_along_axis(ctx.features, last[:, None, None], axis=1)[:, 0].astype(jnp.float32)

    def propose(self, params, feature, ctx: Context, keys) -> tuple[Draft, jax.Array]:
        """The tree of every head's top-k candidates, all K nodes for every row."""
        heads = nnx.merge(self.graphdef, params["head"])
        depth = self.max_depth
        readout = params["readout"]
        logits = readout.logits(heads(feature)[:, :depth])  # f32[B, D, V], or f32[B, D, N] over a draft vocabulary
        _, index = jax.lax.top_k(logits, self.top_k)  # i32[B, D, k]: head d's ranked candidates
        candidates = readout.token_ids(index.astype(jnp.int32))  # as target ids
        tokens = tokens_from_topk(self.topology, candidates)  # i32[B, K]
        batch = feature.shape[0]
        parents = jnp.broadcast_to(jnp.asarray(self.topology.parents, jnp.int32), tokens.shape)
        num = jnp.full((batch,), self.num_speculative_tokens, jnp.int32)
        return Draft(tokens=tokens, num_draft=num, parents=parents), feature

    def update(self, params, feature, ctx: Context, committed: Committed) -> jax.Array:
        """f32[B, D]: the target's feature behind the newest committed token."""
        last = jnp.maximum(committed.num - 1, 0)
        newest = jnp.take_along_axis(committed.features, last[:, None, None], axis=1)[:, 0]
        return jnp.where((committed.num > 0)[:, None], newest.astype(jnp.float32), feature)
