"""Draft trees: layout, static topologies (Medusa), node selection (EAGLE-2), lossless verification, commit.

Layout. A row's draft tree has K non-root nodes. Node 0 is the root, the row's newest committed token (not a
draft); node i+1 holds tokens[:, i] and hangs under node parents[:, i] in [0, i], so a parent always precedes
its children and a chain is parents[:, i] == i. A node at depth d (the root has depth 0) is a candidate for
the token at position positions + d - 1, and the target's logits after it, target_logits[:, node], judge its
children. node_valid bool[B, K] marks the nodes that may be accepted (closed under ancestors); draft_probs
f32[B, K, V], when given, is indexed by node: draft_probs[:, j] is what node j's children were drawn from.

A `DraftTree` holds those four arrays. `verify_tree` walks one root-to-node path and emits the accepted drafts
and one target token; `gather_path` then moves the path's K/V to contiguous cache slots.
docs/concepts/draft-trees.md describes the layout and docs/concepts/losslessness.md the verification rules,
their proof and the random streams.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .rejection import _ACCEPT_STREAM
from .sampling import argmax, categorical, draw, is_greedy, process_logits
from .sampling_params import SamplingParams
from .validation import is_integer

__all__ = [
    "DraftTree",
    "TreeTopology",
    "ancestor_mask",
    "depths",
    "gather_nodes",
    "gather_path",
    "select_nodes",
    "tokens_from_topk",
    "tree_ancestor_mask",
    "verify_tree",
]


def _check_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must be rank {rank} {layout}, got {name}.shape={x.shape}")


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """bool[B, T, T]: ``out[b, i, j]`` is True iff node j is node i or an ancestor of node i.

    Args:
      parents: i32[B, T]; parent index of each node among the T new tokens, -1 for a root.
        Indices outside [0, T) are treated as -1.  Parents must form a forest (typically
        ``parents[b, i] < i``); a cycle gives a meaningless mask rather than an error.

    Uses pointer doubling: after k rounds every node knows its ancestors closer than 2**k and
    its 2**k-th ancestor, so ceil(log2 T) rounds of [B, T, T] gathers cover any depth, with no
    Python loop over T in the trace.
    """
    parents = jnp.asarray(parents)
    if parents.ndim != 2:
        raise ValueError(f"parents must be rank 2 [B, T], got {parents.shape=}")
    if not jnp.issubdtype(parents.dtype, jnp.integer):
        raise ValueError(f"parents must be an integer array, got {parents.dtype=}")
    batch, num_nodes = parents.shape
    parents = parents.astype(jnp.int32)
    # Node index `num_nodes` is a virtual node with no ancestors and itself as parent, so
    # jumping past a root lands somewhere that contributes nothing and never leaves.
    sentinel = num_nodes
    hop = jnp.where((parents >= 0) & (parents < num_nodes), parents, sentinel)  # i32[B, T]
    nodes = jnp.arange(num_nodes)
    anc = jnp.broadcast_to(nodes[:, None] == nodes[None, :], (batch, num_nodes, num_nodes))
    no_ancestors = jnp.zeros((batch, 1, num_nodes), dtype=bool)
    sentinel_hop = jnp.full((batch, 1), sentinel, dtype=jnp.int32)
    for _ in range((num_nodes - 1).bit_length()):
        anc_ext = jnp.concatenate([anc, no_ancestors], axis=1)  # bool[B, T+1, T]
        hop_ext = jnp.concatenate([hop, sentinel_hop], axis=1)  # i32[B, T+1]
        anc = anc | jnp.take_along_axis(anc_ext, hop[:, :, None], axis=1)
        hop = jnp.take_along_axis(hop_ext, hop, axis=1)
    return anc


def tree_ancestor_mask(parents: jax.Array) -> jax.Array:
    """bool[B, K+1, K+1]: node i sees node j iff j is i or an ancestor of i; the root is node 0.

    parents: i32[B, K] in the tree convention (node i+1's parent in [0, i]). This is the attention mask of
    the verify forward over [root, node 1, ..., node K].
    """
    parents = jnp.asarray(parents)
    _check_rank("parents", parents, 2, "[B, K]")
    root = jnp.full((parents.shape[0], 1), -1, jnp.int32)
    return ancestor_mask(jnp.concatenate([root, parents.astype(jnp.int32)], axis=1))


def depths(parents: jax.Array) -> jax.Array:
    """i32[B, K+1] depth of every node, the root (node 0) included at depth 0; parents: i32[B, K]."""
    return (jnp.sum(tree_ancestor_mask(parents), axis=-1) - 1).astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# static topologies (Medusa)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TreeTopology:
    """A static draft tree, built on the host; hashable, so it can be part of a compiled program's identity.

    parents: node i+1's parent for i in 0..K-1, in [0, i] (0 is the root).
    child_rank: node i+1's rank among its parent's candidates, i.e. which of a head's ranked top-k
      candidates its token is (`tokens_from_topk`). When not given: the order of creation, 0 for a parent's
      first child, 1 for the next, ... `from_paths` and `best_first` set it to the path's last rank, which is
      the same thing whenever a parent's children use ranks 0, 1, 2, ... without gaps.
    """

    parents: tuple[int, ...]
    child_rank: tuple[int, ...] | None = None

    def __post_init__(self):
        parents = tuple(self.parents)
        for i, p in enumerate(parents):
            if not is_integer(p) or not 0 <= p <= i:
                raise ValueError(f"parents[{i}]={p!r} must be an integer in [0, {i}] (a parent precedes its child)")
        parents = tuple(int(p) for p in parents)
        object.__setattr__(self, "parents", parents)
        if self.child_rank is None:
            made: dict[int, int] = {}  # children created so far, per parent
            rank = []
            for p in parents:
                rank.append(made.get(p, 0))
                made[p] = rank[-1] + 1
            object.__setattr__(self, "child_rank", tuple(rank))
            return
        rank = tuple(self.child_rank)
        if len(rank) != len(parents):
            raise ValueError(f"child_rank has {len(rank)} entries, parents {len(parents)}: need one per node")
        if not all(is_integer(r) and r >= 0 for r in rank):
            raise ValueError(f"child_rank={rank!r} must hold integers >= 0")
        if len(set(zip(parents, rank))) != len(parents):
            raise ValueError(f"child_rank={rank!r} repeats a rank among siblings (parents={parents!r})")
        object.__setattr__(self, "child_rank", tuple(int(r) for r in rank))

    @property
    def num_nodes(self) -> int:
        """K, the non-root nodes."""
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        """Depth of each non-root node (length K, every entry >= 1)."""
        depth = [0]  # the root
        for p in self.parents:
            depth.append(depth[p] + 1)
        return tuple(depth[1:])

    @property
    def max_depth(self) -> int:
        """D, the most drafts one path holds (0 for an empty tree)."""
        return max(self.depths, default=0)

    @property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Each node's path of ranks from the root, the form `from_paths` takes."""
        path: list[tuple[int, ...]] = [()]
        for p, r in zip(self.parents, self.child_rank):
            path.append(path[p] + (r,))
        return tuple(path[1:])

    @classmethod
    def chain(cls, k: int) -> "TreeTopology":
        """K nodes in a line: each the rank-0 child of the previous one."""
        if not is_integer(k) or k < 0:
            raise ValueError(f"k={k!r} must be an integer >= 0")
        return cls(parents=tuple(range(k)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "TreeTopology":
        """A tree from Medusa-style choices: each path a tuple of per-depth top-k ranks, e.g.
        ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)). Nodes are ordered breadth-first (by depth, then
        lexicographically); every prefix of a path must be a path too."""
        normal = []
        for path in paths:
            path = tuple(path)
            if not path or not all(is_integer(r) and r >= 0 for r in path):
                raise ValueError(f"path {path!r} must be a non-empty tuple of ranks >= 0")
            normal.append(tuple(int(r) for r in path))
        if len(set(normal)) != len(normal):
            dup = next(p for p in normal if normal.count(p) > 1)
            raise ValueError(f"path {dup!r} appears more than once")
        order = sorted(normal, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(order)}
        for path in order:
            if len(path) > 1 and path[:-1] not in index:
                raise ValueError(f"path {path!r} needs its prefix {path[:-1]!r} among the paths")
        parents = tuple(0 if len(p) == 1 else index[p[:-1]] + 1 for p in order)
        return cls(parents=parents, child_rank=tuple(p[-1] for p in order))

    @classmethod
    def best_first(cls, rank_probs: Sequence[Sequence[float]], budget: int) -> "TreeTopology":
        """The tree of the `budget` paths most likely to be right (maximising the expected accepted drafts).

        A path of ranks `(r_1, ..., r_d)` is right with probability `rank_probs[0][r_1] * ... *
        rank_probs[d-1][r_d]`. Ties go to the shallower, then lexicographically smaller path; nodes are
        ordered breadth-first as in `from_paths`. See docs/concepts/draft-trees.md.

        Args:
          rank_probs: `[D][k]`, per depth d the probability that the rank-r candidate (Medusa head d's r-th
            top-k token) is the right token.
          budget: the number of nodes K.
        """
        table = [list(map(float, row)) for row in rank_probs]
        if not table or not table[0] or any(len(row) != len(table[0]) for row in table):
            raise ValueError(f"rank_probs={rank_probs!r} must be a non-empty [D][k] table")
        if not all(0.0 <= v <= 1.0 for row in table for v in row):
            raise ValueError(f"rank_probs={rank_probs!r} must hold probabilities in [0, 1]")
        depth, k = len(table), len(table[0])
        total = sum(k ** d for d in range(1, depth + 1))
        if not is_integer(budget) or not 0 <= budget <= total:
            raise ValueError(f"budget={budget!r} must be an integer in [0, {total}] (every path of a "
                             f"depth-{depth}, top-{k} tree)")
        # Heap entries (-probability, depth, path): popped most likely first, then shallower, then by path.
        frontier = [(-table[0][r], 1, (r,)) for r in range(k)]
        heapq.heapify(frontier)
        chosen = []
        while len(chosen) < budget:
            neg_prob, d, path = heapq.heappop(frontier)
            chosen.append(path)
            if d < depth:
                for r in range(k):
                    heapq.heappush(frontier, (neg_prob * table[d][r], d + 1, path + (r,)))
        return cls.from_paths(chosen)

    @classmethod
    def default(cls, depth: int, top_k: int, budget: int) -> "TreeTopology":
        """`best_first` over a fixed prior, for heads without measured accuracies.

        The prior is `rank_probs[d][r] = 0.6 ** (d + 1) / (r + 1)`: a first head right about 60% of the time
        with its top-1 candidate (Medusa's reported ballpark), accuracy falling geometrically for heads that
        look further ahead, and lower-ranked candidates less likely roughly in proportion to 1 / rank. Only
        the ordering it induces matters; measured accuracies (`rank_probs` saved by training) replace it.
        """
        if not is_integer(depth) or depth < 1:
            raise ValueError(f"depth={depth!r} must be an integer >= 1")
        if not is_integer(top_k) or top_k < 1:
            raise ValueError(f"top_k={top_k!r} must be an integer >= 1")
        prior = [[0.6 ** (d + 1) / (r + 1) for r in range(top_k)] for d in range(depth)]
        return cls.best_first(prior, budget)


def tokens_from_topk(topology: TreeTopology, topk_tokens: jax.Array) -> jax.Array:
    """i32[B, K] node tokens of a static tree from per-depth ranked candidates.

    topk_tokens: i32[B, D', k] with D' >= topology.max_depth, k > max(child_rank): topk_tokens[:, d, r] is
    head d's rank-r candidate. A node at depth d with child_rank r gets topk_tokens[:, d-1, r].
    """
    topk_tokens = jnp.asarray(topk_tokens)
    _check_rank("topk_tokens", topk_tokens, 3, "[B, D, k]")
    _, num_depths, k = topk_tokens.shape
    if num_depths < topology.max_depth:
        raise ValueError(f"topk_tokens.shape={topk_tokens.shape} covers {num_depths} depths, the topology "
                         f"needs {topology.max_depth}")
    if topology.num_nodes and k <= max(topology.child_rank):
        raise ValueError(f"topk_tokens.shape={topk_tokens.shape} holds {k} candidates per depth, the topology "
                         f"uses rank {max(topology.child_rank)}")
    depth = np.asarray(topology.depths, np.int32) - 1  # static gather indices, i32[K]
    rank = np.asarray(topology.child_rank, np.int32)
    return topk_tokens[:, depth, rank].astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# dynamic trees (EAGLE-2)
# --------------------------------------------------------------------------------------------


def select_nodes(scores: jax.Array, parents: jax.Array, tokens: jax.Array,
                 budget: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Keep each row's `budget` best candidate nodes, closed under ancestors, as a tree of `budget` nodes.

    scores: f32[B, M] cumulative draft log-probability of each non-root candidate, non-increasing along every
      root-to-node path; -inf (or NaN) marks an invalid candidate.
    parents: i32[B, M] in the tree convention (candidate i+1's parent in [0, i]).
    tokens: i32[B, M].
    budget: static int in [0, M].
    Returns (tokens i32[B, budget], parents i32[B, budget] remapped to the kept nodes, kept_index i32[B,
    budget] the original index of each kept node, valid bool[B, budget]), the kept nodes in rank order.

    Ranking by (score descending, index ascending) puts a parent before its child (its score is at least the
    child's and its index smaller), so the top `budget` are closed under ancestors; a score above an
    ancestor's is first lowered to it, which keeps that true for any input. The nodes stay in that order, so
    every prefix of the result is itself the best tree of its size: a verify forward narrower than the budget
    scores the first nodes, the most confident ones (`jaxspec.cost.choose_tree_width`). Invalid candidates
    rank after every valid one: a row with fewer valid candidates than `budget` keeps some invalid ones,
    marked False in `valid`, and the caller must not accept them. So `valid` is a prefix (sum(valid) is the
    row's node count), and every parent precedes its children (a valid node's ancestors are valid and rank
    before it; an invalid node's parent ranks before it, or was not kept and becomes the root).
    """
    scores, parents, tokens = map(jnp.asarray, (scores, parents, tokens))
    _check_rank("scores", scores, 2, "[B, M]")
    if parents.shape != scores.shape or tokens.shape != scores.shape:
        raise ValueError(f"{scores.shape=}, {parents.shape=} and {tokens.shape=} must be equal [B, M]")
    batch, num = scores.shape
    if not is_integer(budget) or not 0 <= budget <= num:
        raise ValueError(f"budget={budget!r} must be an integer in [0, {num}] (the candidates per row)")
    parents = parents.astype(jnp.int32)
    scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores.astype(jnp.float32))
    anc = tree_ancestor_mask(parents)[:, 1:, 1:]  # bool[B, M, M] without the root
    path_min = jnp.min(jnp.where(anc, scores[:, None, :], jnp.inf), axis=-1)  # f32[B, M]

    kept = jnp.argsort(-path_min, axis=1, stable=True)[:, :budget].astype(jnp.int32)  # i32[B, budget]: ties by index
    valid = jnp.take_along_axis(path_min, kept, axis=1) > -jnp.inf  # bool[B, budget]

    rows = jnp.arange(batch)[:, None]
    new_index = jnp.zeros((batch, num + 1), jnp.int32).at[rows, kept + 1].set(
        jnp.arange(1, budget + 1, dtype=jnp.int32))  # i32[B, M+1]: old node -> new node; the root stays 0
    new_parents = jnp.take_along_axis(new_index, jnp.take_along_axis(parents, kept, axis=1), axis=1)
    new_tokens = jnp.take_along_axis(tokens.astype(jnp.int32), kept, axis=1)
    return new_tokens, new_parents, kept, valid


# --------------------------------------------------------------------------------------------
# verification
# --------------------------------------------------------------------------------------------


def _start_path(batch: int, max_depth: int) -> jax.Array:
    """i32[B, D+1]: just the root."""
    return jnp.full((batch, max_depth + 1), -1, jnp.int32).at[:, 0].set(0)


def _extend(path: jax.Array, moved: jax.Array, depth: jax.Array, node: jax.Array) -> jax.Array:
    """path i32[B, D+1] with `node` at column depth i32[B] where moved bool[B]."""
    at = moved[:, None] & (jnp.arange(path.shape[1]) == depth[:, None])
    return jnp.where(at, node, path)


def _at(x: jax.Array, node: jax.Array) -> jax.Array:
    """x[b, node[b]] for x [B, K+1, ...] and node i32[B]."""
    return jax.vmap(lambda row, n: row[n])(x, node)


def _follow(target: jax.Array, tokens: jax.Array, parents: jax.Array, eligible: jax.Array, depth: jax.Array,
            max_depth: int) -> jax.Array:
    """i32[B, D+1] path of the greedy and point-mass rules: from the root, step to the first eligible child
    whose token is the target's own token at the current node (target: i32[B, K+1], one per node).

    Nodes are visited in index order: a node's children all come after it, so the first matching child of
    the current node met is its lowest-index one, and its later siblings are no longer children of `cur`.
    """
    batch, k = tokens.shape
    if k == 0:
        return _start_path(batch, max_depth)

    def visit(i, walk):
        cur, path = walk  # i32[B], i32[B, D+1]
        node = i + 1
        moved = eligible[:, i] & (parents[:, i] == cur) & (tokens[:, i] == _at(target, cur))
        return jnp.where(moved, node, cur), _extend(path, moved, depth[:, node], node)

    _, path = jax.lax.fori_loop(0, k, visit, (jnp.zeros(batch, jnp.int32), _start_path(batch, max_depth)))
    return path


class DraftTree(NamedTuple):
    """One draft tree per row, as `verify_tree` takes it (the layout in this module's docstring)."""

    tokens: jax.Array  # i32[B, K] node i+1's token
    parents: jax.Array  # i32[B, K] node i+1's parent, in [0, i]
    node_valid: jax.Array  # bool[B, K] nodes that may be accepted, closed under ancestors
    # f32[B, K, V] by node (`draft_probs[:, j]`: what node j's children were drawn from, i.i.d.), or None for
    # deterministic drafts
    draft_probs: jax.Array | None = None


class _Walk(NamedTuple):
    """Recursive rejection state while walking down the tree."""

    cur: jax.Array  # i32[B] the node whose children are being tested
    path: jax.Array  # i32[B, D+1] the root and the accepted nodes, -1 padded
    residual: jax.Array  # f32[B, V] the target residual at cur, unnormalised
    mass: jax.Array  # f32[B] its total; exactly 1 while it is still p, so a chain's test is rejection.py's
    tried: jax.Array  # i32[B] children of cur rejected so far: the next test's sibling number
    from_p: jax.Array  # bool[B] nothing was subtracted at cur: a last token here comes from p itself


def _recursive_rejection(keys, positions, z, tree: DraftTree, eligible, depth, max_depth):
    """(path i32[B, D+1], last token i32[B]) of recursive rejection sampling over i.i.d. siblings, for the
    processed logits z f32[B, K+1, V] and the eligible nodes bool[B, K] at their depths i32[B, K+1]."""
    batch, k = tree.tokens.shape
    vocab = z.shape[-1]
    parents = tree.parents
    lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
    p = jnp.exp(z - lse)  # f32[B, K+1, V], computed as rejection.py does so a chain matches it bit for bit
    draft_probs = tree.draft_probs.astype(jnp.float32)
    tokens = jnp.clip(tree.tokens, 0, vocab - 1)  # ineligible garbage must still index safely

    def uniform(key, position, sibling):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, position), _ACCEPT_STREAM + sibling))

    def visit(i, walk: _Walk) -> _Walk:
        node = i + 1
        child = eligible[:, i] & (parents[:, i] == walk.cur)  # bool[B]
        x = tokens[:, i]
        q = _at(draft_probs, jnp.minimum(walk.cur, k - 1))  # f32[B, V]; a leaf's row is never used
        q_x = jnp.take_along_axis(q, x[:, None], axis=1)[:, 0]
        r_x = jnp.take_along_axis(walk.residual, x[:, None], axis=1)[:, 0]
        u = jax.vmap(uniform)(keys, positions + _at(depth, walk.cur), walk.tried)  # f32[B] in [0, 1)
        # u < r(x) / q(x) with r = residual / mass, without dividing: q(x) = 0 accepts iff r(x) > 0.
        accept = child & (u * q_x * walk.mass < r_x)
        rejected = child & ~accept

        left = jnp.maximum(walk.residual / walk.mass[:, None] - q, 0.0)  # f32[B, V]
        left_mass = jnp.sum(left, axis=-1)
        # An empty residual means r == q, where a rejection happens only by rounding: keep r, as the chain
        # code then draws from p.
        shrink = rejected & (left_mass > 0)
        residual = jnp.where(shrink[:, None], left, walk.residual)
        mass = jnp.where(shrink, left_mass, walk.mass)
        return _Walk(
            cur=jnp.where(accept, node, walk.cur),
            path=_extend(walk.path, accept, depth[:, node], node),
            residual=jnp.where(accept[:, None], p[:, node], residual),
            mass=jnp.where(accept, 1.0, mass),
            tried=jnp.where(accept, 0, walk.tried + rejected),
            from_p=accept | (walk.from_p & ~shrink),
        )

    start = _Walk(cur=jnp.zeros(batch, jnp.int32), path=_start_path(batch, max_depth), residual=p[:, 0],
                  mass=jnp.ones(batch, jnp.float32), tried=jnp.zeros(batch, jnp.int32),
                  from_p=jnp.ones(batch, bool))
    end = jax.lax.fori_loop(0, k, visit, start) if k > 0 else start  # K = 0: the root's bonus token
    # A bonus token (nothing rejected at the final node) is drawn from z itself: bit for bit plain decoding.
    logits = jnp.where(end.from_p[:, None], _at(z, end.cur), jnp.log(end.residual))
    last_keys = jax.vmap(jax.random.fold_in)(keys, positions + _at(depth, end.cur))
    return end.path, categorical(last_keys, logits)


def _target_samples(keys, positions, target_logits, sampling, depth, max_depth: int) -> jax.Array:
    """i32[B, K+1]: the token plain sampling draws after each node (`draw` with the key of its position).

    Every node at one depth uses plain decoding's key for that position, so nodes whose distributions are
    equal draw the same token."""
    # Nodes deeper than D are never accepted: any key serves them.
    node_positions = positions[:, None] + jnp.minimum(depth, max_depth)  # i32[B, K+1]
    node_keys = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))(keys, node_positions)  # key[B, K+1]
    return draw(node_keys, target_logits, sampling)


def _emit(tokens: jax.Array, path: jax.Array, last: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The path's drafts, then `last` i32[B], then -1: (i32[B, D+1], i32[B] accepted drafts + 1)."""
    batch, width = path.shape
    n = jnp.sum(path >= 0, axis=1) - 1  # i32[B] accepted drafts
    node_tokens = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tokens], axis=1)  # i32[B, K+1]
    drafts = jnp.take_along_axis(node_tokens, jnp.maximum(path, 0), axis=1)  # i32[B, D+1]
    # Output j is the node at depth j + 1 while j < n.
    drafts = jnp.concatenate([drafts[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
    j = jnp.arange(width)
    out = jnp.where(j < n[:, None], drafts, jnp.where(j == n[:, None], last[:, None], -1))
    return out.astype(jnp.int32), (n + 1).astype(jnp.int32)


def _check_verify_inputs(keys, target_logits, tree: DraftTree, positions, max_depth) -> None:
    batch, width, vocab = target_logits.shape
    nodes = (batch, width - 1)
    draft_probs = tree.draft_probs
    for name, x in (("tokens", tree.tokens), ("parents", tree.parents), ("node_valid", tree.node_valid)):
        if x.shape != nodes:
            raise ValueError(f"{name} must have shape [B, K]={nodes} to match {target_logits.shape=}, "
                             f"got {name}.shape={x.shape}")
    if draft_probs is not None and draft_probs.shape != (*nodes, vocab):
        raise ValueError(f"draft_probs must have shape [B, K, V]={(*nodes, vocab)}, got {draft_probs.shape=}")
    if keys.shape[:1] != (batch,):
        raise ValueError(f"keys must hold one key per row, B={batch}, got {keys.shape=}")
    if positions is not None and positions.shape != (batch,):
        raise ValueError(f"positions must have shape [B]=({batch},), got {positions.shape=}")
    if not is_integer(max_depth) or not 0 <= max_depth <= width - 1:
        raise ValueError(f"max_depth={max_depth!r} must be a static integer in [0, K={width - 1}]")


def verify_tree(keys: jax.Array, target_logits: jax.Array, tree: DraftTree, sampling: SamplingParams, *,
                positions: jax.Array | None = None,
                max_depth: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verify each row's draft tree against the target: accept one root-to-node path, then one target token.

    Greedy rows follow the argmax; deterministic drafts (`draft_probs=None`) follow the target's own sample
    (the point-mass rule); drafts with distributions use recursive rejection over i.i.d. siblings. The rules
    and why they are lossless: docs/concepts/losslessness.md.

    Args:
      keys: key[B], one base key per row (plain decoding's `jax.random.key(seed)`).
      target_logits: f32[B, K+1, V] raw target logits after node j (node 0 the root).
      tree: the draft tree (`DraftTree`): its nodes' tokens and parents, which may be accepted, and what they
        were drawn from (None for deterministic drafts: top-k candidates, lookups).
      sampling: scalars or per-row arrays [B]; temperatures below GREEDY_BELOW (0 included) are greedy.
      positions: i32[B] absolute position of each row's first output token (None: 0).
      max_depth: static D in [0, K] (None: K); nodes deeper than D are never accepted.

    Returns:
      (path i32[B, D+1] accepted node indices from the root, `path[:, 0] = 0`, -1 padded; output tokens
      i32[B, D+1], the accepted drafts then one target token, -1 padded; their count i32[B] in [1, D+1]).
    """
    target_logits = jnp.asarray(target_logits)
    tree = DraftTree(*(None if x is None else jnp.asarray(x) for x in tree))
    positions = None if positions is None else jnp.asarray(positions)
    _check_rank("target_logits", target_logits, 3, "[B, K+1, V]")
    max_depth = target_logits.shape[1] - 1 if max_depth is None else max_depth
    _check_verify_inputs(keys, target_logits, tree, positions, max_depth)
    batch = target_logits.shape[0]
    tree = tree._replace(tokens=tree.tokens.astype(jnp.int32), parents=tree.parents.astype(jnp.int32))
    tokens, parents = tree.tokens, tree.parents
    positions = jnp.zeros((batch,), jnp.int32) if positions is None else positions.astype(jnp.int32)
    depth = depths(parents)  # i32[B, K+1]
    # The path must fit its D + 1 outputs; invalid nodes never hold it.
    eligible = tree.node_valid.astype(bool) & (depth[:, 1:] <= max_depth)  # bool[B, K]

    def greedy():
        best = argmax(target_logits)  # i32[B, K+1]
        path = _follow(best, tokens, parents, eligible, depth, max_depth)
        return path, _at(best, jnp.max(path, axis=1))  # the final node has the path's largest index

    def sampled():
        if tree.draft_probs is not None:
            z = process_logits(target_logits, sampling)  # f32[B, K+1, V], -inf outside the kept tokens
            return _recursive_rejection(keys, positions, z, tree, eligible, depth, max_depth)
        t = _target_samples(keys, positions, target_logits, sampling, depth, max_depth)  # i32[B, K+1]
        path = _follow(t, tokens, parents, eligible, depth, max_depth)
        return path, _at(t, jnp.max(path, axis=1))

    # An all-greedy batch needs neither the processed distribution nor random numbers, as in `sample`.
    path, last = jax.lax.cond(jnp.all(is_greedy(sampling.temperature)), greedy, sampled)
    return (path, *_emit(tokens, path, last))


# --------------------------------------------------------------------------------------------
# commit
# --------------------------------------------------------------------------------------------


def gather_path(buffer: jax.Array, start: jax.Array, path: jax.Array) -> jax.Array:
    """Move the accepted path's cache entries to contiguous slots: a plain prefix extension again.

    buffer: [B, Hkv, S, hd] one layer's key or value cache, node i of row b at slot start[b] + i.
    start: i32[B] the root's slot.
    path: i32[B, D+1] from `verify_tree`; path node j lands at slot start[b] + j, -1 entries write nothing.
    Every slot is read before any is written, so overlapping moves (path[j] >= j) are safe.
    """
    buffer, start, path = map(jnp.asarray, (buffer, start, path))
    _check_rank("buffer", buffer, 4, "[B, Hkv, S, hd]")
    _check_rank("path", path, 2, "[B, D+1]")
    batch, _, slots, _ = buffer.shape
    if start.shape != (batch,) or path.shape[0] != batch:
        raise ValueError(f"start [B] and path [B, D+1] must match {buffer.shape=}, got {start.shape=}, "
                         f"{path.shape=}")
    rows = jnp.arange(batch)[:, None]
    start = start.astype(jnp.int32)[:, None]
    moved = buffer[rows, :, start + jnp.maximum(path, 0)]  # [B, D+1, Hkv, hd]
    to = jnp.where(path >= 0, start + jnp.arange(path.shape[1]), slots)  # out of bounds: dropped
    return buffer.at[rows, :, to].set(moved, mode="drop")


def gather_nodes(x: jax.Array, path: jax.Array) -> jax.Array:
    """[B, D+1, ...] per-node values (e.g. hidden states [B, K+1, F]) along the path i32[B, D+1].

    Entries where path is -1 hold an arbitrary node's value (currently the root's); mask them by the count.
    """
    x, path = jnp.asarray(x), jnp.asarray(path)
    _check_rank("path", path, 2, "[B, D+1]")
    if x.ndim < 2 or x.shape[0] != path.shape[0]:
        raise ValueError(f"x must be [B, K+1, ...] with B={path.shape[0]}, got {x.shape=}")
    return jax.vmap(lambda row, nodes: row[nodes])(x, jnp.maximum(path, 0))


def dynamic_tree_nodes(depth: int, top_k: int) -> int:
    """The nodes an EAGLE-2 dynamic tree drafts before its best K are kept: the root's top_k children, then
    top_k children for each of the top_k frontier nodes at every further level."""
    return top_k + (depth - 1) * top_k ** 2
